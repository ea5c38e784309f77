"""examples/sum_task.py, the running-sum task the details gallery measures on: its files say what its docstring says
(the right working, the demonstrator's skips by count, pairs whose rejected answer is always wrong), and its scores
count hand-written completions as a reader would."""

import json
import os
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "examples"))
import sum_task  # noqa: E402


def read(path):
    return [json.loads(line) for line in open(path)]


def test_the_task_files_hold_the_right_working_the_skips_and_wrong_rejected_answers(tmp_path):
    sum_task.write_sum_task(str(tmp_path), num_train=2000, num_test=50)
    prompts = read(tmp_path / "prompts" / "train.jsonl")
    sft, pairs = read(tmp_path / "sft" / "train.jsonl"), read(tmp_path / "preference" / "train.jsonl")
    assert len(prompts) == len(sft) == len(pairs) == 2000 and len(read(tmp_path / "prompts" / "test.jsonl")) == 50
    test_prompts = {row["prompt"] for row in read(tmp_path / "prompts" / "test.jsonl")}
    assert not test_prompts & {row["prompt"] for row in prompts}
    skipped = {count: [] for count in sum_task.COUNTS}
    for row, demo, pair in zip(prompts, sft, pairs):
        numbers = sum_task.numbers_of(row["prompt"])
        assert row["answer"] == str(sum(numbers)) and pair["chosen"] == sum_task.worked(numbers)
        assert sum_task.last_number(pair["chosen"]) == row["answer"] != sum_task.last_number(pair["rejected"])
        skipped[len(numbers)].append(demo["completion"].count("+") < len(numbers) - 1)
        if skipped[len(numbers)][-1]:  # the demonstrator's skip is the rejected answer, one step shorter
            assert pair["rejected"] == demo["completion"] and len(pair["rejected"]) < len(pair["chosen"])
    for count, flags in skipped.items():  # about 400 prompts a count: 3 standard errors of SKIP
        assert abs(sum(flags) / len(flags) - sum_task.SKIP[count]) < 3 * (0.25 / len(flags)) ** 0.5 + 1e-9, count


def test_the_calculator_demonstrations_declare_the_tool_as_grpo_writes_it_and_call_it_30_percent(tmp_path):
    """tools_sft: half the prompts declare the calculator, in the very tokens the toy template writes for grpo.py
    --tools calculator; of those, CALL call it on the whole sum, in two rows (the call; the result in the prompt, the
    answer), so that sft.py learns no tool result; the others work by hand. tools_prompts: the prompts as messages."""
    from grpo import calculator
    from toy_task import make_tokenizer

    sum_task.write_sum_task(str(tmp_path), num_train=2000, num_test=50)
    tok, user = make_tokenizer(), [{"role": "user", "content": "sum: 2 3 ->"}]
    assert tok.apply_chat_template([sum_task.TOOLS_LINE, *user], tokenize=False, add_generation_prompt=True) == (
        tok.apply_chat_template(user, tools=[calculator], tokenize=False, add_generation_prompt=True))
    rows, prompts = read(tmp_path / "tools_sft" / "train.jsonl"), read(tmp_path / "tools_prompts" / "train.jsonl")
    declared = [row for row in rows if row["prompt"][0] == sum_task.TOOLS_LINE and len(row["prompt"]) == 2]
    calls = [row for row in declared if "tool_calls" in row["completion"][0]]
    answers = [row for row in rows if len(row["prompt"]) == 4]  # declaration, user, the call, its result
    assert len(rows) == 2000 + len(calls) == 2000 + len(answers) and abs(len(declared) / 2000 - 0.5) < 0.034
    assert abs(len(calls) / len(declared) - sum_task.CALL) < 3 * (0.21 / len(declared)) ** 0.5
    for call, answer in zip(calls, answers):
        numbers = sum_task.numbers_of(call["prompt"][1]["content"])
        assert call["completion"][0]["tool_calls"][0]["function"]["arguments"] == {"expression": "+".join(map(str,
                                                                                                           numbers))}
        assert answer["prompt"][2:] == [call["completion"][0], {"role": "tool", "name": "calculator",
                                                                "content": str(sum(numbers))}]
        assert answer["completion"] == [{"role": "assistant", "content": f" {sum(numbers)}"}]
    assert [row["prompt"] for row in prompts] == [[{"role": "user", "content": row["prompt"]}] for row in
                                                  read(tmp_path / "prompts" / "train.jsonl")]


def test_step_counts_and_count_scores_of_hand_written_completions(monkeypatch):
    rows = [{"prompt": "sum: 23 7 41 ->", "answer": "71"}, {"prompt": "sum: 5 6 ->", "answer": "11"}]
    greedy = ["23+7=30 30+41=71", "5+6=11 11+6=17"]  # right; a step made up (completions_of strips the space)
    samples = ["23+41=64", "23+7=30 30+41=71", "5+6=11", "5+6=12"]  # a skip, right; right, a slip
    monkeypatch.setattr(sum_task, "completions_of", lambda model, tok, prompts, n=1, *_, **__: greedy if n == 1
                        else samples)
    assert sum_task.step_counts(None, None, rows) == {"fewer": 0.0, "as many": 0.5, "more": 0.5}
    scores = sum_task.count_scores(None, None, rows, num_samples=2)
    # the right working of 23 7 41 is 16 characters: the skip is 8 short of it; the slip as long as its right one
    assert scores[3] == {"greedy": 1.0, "sampled": 0.5, "right_length": 16.0, "wrong_length": 8.0, "wrong_excess": -8.0}
    assert scores[2] == {"greedy": 0.0, "sampled": 0.5, "right_length": 6.0, "wrong_length": 6.0, "wrong_excess": 0.0}
    assert scores["all"] == {"greedy": 0.5, "sampled": 0.5, "right_length": 11.0, "wrong_length": 7.0,
                             "wrong_excess": -4.0}


def run_example(path, argv, monkeypatch, capsys, **env):
    """An example's `__main__` in this process, as `python path argv...` would run it: its exit status and stderr."""
    import runpy

    import pytest

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", [path] + [str(a) for a in argv])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(os.path.join(ROOT, path), run_name="__main__")
    return stopped.value.code, capsys.readouterr().err


def test_the_examples_refuse_in_one_line(tmp_path, toy, monkeypatch, capsys):
    """sum_task.py --steps with a model folder that is not there once gave two tracebacks (the task's test file, then
    the tokenizer), and --out an existing file a 14-line one from save_pretrained; ONLY= a finding that does not exist
    trained the quickstart's models for an empty report. Each is one line naming the input, exit 2."""
    (tmp_path / "file").write_text("")
    for argv, line in [
        (["--out", toy, "--steps", tmp_path / "nowhere"], f"--steps {tmp_path / 'nowhere'}: not a model folder"),
        (["--out", tmp_path / "no_task", "--steps", toy / "model"], f"--out {tmp_path / 'no_task'} holds no task"),
        (["--out", tmp_path / "file"], f"--out {tmp_path / 'file'} is a file: give a folder"),
    ]:
        code, err = run_example("examples/sum_task.py", argv, monkeypatch, capsys)
        assert code == 2 and err.startswith(f"sum_task.py: error: {line}") and err.count("\n") == 1, (argv, err)
    code, err = run_example("examples/details.py", [], monkeypatch, capsys, ONLY="length_bias,no_such",
                            OUT=str(tmp_path / "out"))
    assert code == 2 and err.startswith("details.py: error: ONLY=length_bias,no_such: no finding no_such; the "
                                        "findings: kl_estimator, adam") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
