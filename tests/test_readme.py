"""Every command line in the README and in examples/quickstart.sh passes arguments the script accepts, with values of
the right type: the script's own tyro parser reads each one (what `--help` documents), without running anything."""

import importlib
import os
import re
import shlex

import pytest
import tyro

from conftest import ROOT

SCRIPTS = ["sft.py", "reward.py", "dpo.py", "grpo.py", "ppo.py"]
DOCUMENTS = ["README.md", "examples/quickstart.sh"]


def command_lines(path):
    """The shell commands of a markdown file's code blocks, or of a shell script: continuation lines joined, comments
    cut, shell variables and substitutions replaced by a placeholder number (which any str, int or float accepts)."""
    text = open(os.path.join(ROOT, path)).read()
    if path.endswith(".md"):  # the lines of ```bash blocks
        blocks = re.split(r"^```", text, flags=re.M)[1::2]
        text = "\n".join(block[len("bash\n") :] for block in blocks if block.startswith("bash\n"))
    text = re.sub(r"\$\(\(.*?\)\)|\$\([^)]*\)|\$\{\w+\}|\$\w+", "16", text.replace("\\\n", " "))
    return [line.split(" #")[0] for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def script_calls(path):
    """(script, its arguments) for every command line in `path` that runs one of the scripts."""
    calls = []
    for line in command_lines(path):
        words = shlex.split(line)
        at = [i for i, word in enumerate(words) if os.path.basename(word) in SCRIPTS]
        if at:
            calls.append((os.path.basename(words[at[0]]), words[at[0] + 1 :]))
    return calls


@pytest.mark.parametrize("path", DOCUMENTS)
def test_every_command_line_parses(path):
    calls = script_calls(path)
    # no vacuous pass: the README has a toy and a real-model command for every script, the quickstart runs every script
    scripts = [script for script, _ in calls]
    assert all(scripts.count(s) >= (2 if path == "README.md" else 1) for s in SCRIPTS), scripts
    args_classes = {script: importlib.import_module(script[:-3]).Args for script in SCRIPTS}
    for script, args in calls:
        try:
            tyro.cli(args_classes[script], args=args)
        except SystemExit:
            pytest.fail(f"{path}: `{script} {' '.join(args)}` does not parse (tyro's message above)")


def test_a_wrong_flag_is_caught():
    """The check above can fail: a misspelt flag and a value of the wrong type are refused by the same parser."""
    from sft import Args

    for bad in (["--learning_rte", "1e-3"], ["--max_steps", "many"]):
        with pytest.raises(SystemExit):
            tyro.cli(Args, args=bad)


# what the quickstart adds to the README's toy lines for its report (logging, checkpoints to score, evaluation)
REPORT_ONLY = {"log_every", "save_every", "eval_every", "per_device_eval_batch_size"}


def quickstart_stages(out="runs", toy="toy", micro_batch="16"):
    """(script, arguments) of each stage of examples/quickstart.sh in its full mode, its variables replaced by what a
    plain `bash examples/quickstart.sh` with OUT=runs TOY=toy on 2 processes gives them."""
    text = open(os.path.join(ROOT, "examples", "quickstart.sh")).read().replace("\\\n", " ")
    stages = []
    for line in text.splitlines():
        if line.startswith("stage "):
            words = shlex.split(line)  # stage NAME run SCRIPT ARGS...
            args = [re.sub(r"\$\(steps (\S+) \S+\)", r"\1", w) for w in words[4:]]
            args = [w.replace("$TOY", toy).replace("$OUT", out).replace("$MB", micro_batch) for w in args]
            stages.append((words[3], args))
    return stages


def test_the_toy_lines_are_the_quickstarts_commands():
    """The README's toy lines, in the README's order, are the commands examples/quickstart.sh runs (OUT=runs, TOY=toy,
    2 processes, the full step counts), less the flags that only serve its report (REPORT_ONLY): the same Args, field by
    field, once parsed by each script's own parser. test_quickstart runs the quickstart on 2 processes in its fast mode
    (fewer steps), the toy task written by `examples/toy_task.py --out`, each stage reading the folder the one before
    wrote: so every toy line runs as written, in this order. A line that names a folder no earlier line writes, or a
    flag or value that differs from the quickstart's, fails here."""
    lines = [line for line in command_lines("README.md") if re.search(r"(^|\s)toy/|toy_task\.py --out toy\b", line)]
    assert lines[0] == "python examples/toy_task.py --out toy" and all("--nproc_per_node 2" in x for x in lines[1:])
    readme = [call for call in script_calls("README.md") if any(arg.startswith("toy/") for arg in call[1])]
    stages = quickstart_stages()
    assert [script for script, _ in readme] == [script for script, _ in stages] == SCRIPTS
    assert 'python examples/toy_task.py --out "$TOY"' in open(os.path.join(ROOT, "examples", "quickstart.sh")).read()
    for (script, readme_args), (_, stage_args) in zip(readme, stages):
        assert differences(script, readme_args, stage_args) == {}, (script, "README vs quickstart")


def differences(script, args_a, args_b):
    """The Args fields, other than REPORT_ONLY, that two command lines of `script` set differently."""
    Args = importlib.import_module(script[:-3]).Args
    a, b = (vars(tyro.cli(Args, args=args)) for args in (args_a, args_b))
    return {k: (a[k], b[k]) for k in a if k not in REPORT_ONLY and a[k] != b[k]}


def test_the_comparison_catches_a_difference_and_ignores_report_flags():
    """Another learning rate is a difference; a value spelt differently, a default left out or a report flag is not."""
    script, stage_args = quickstart_stages()[2]  # dpo.py
    changed = [("3e-4" if w == "1e-4" else w) for w in stage_args]
    assert differences(script, changed, stage_args) == {"learning_rate": (3e-4, 1e-4)}
    same = [("0.0001" if w == "1e-4" else w) for w in stage_args] + ["--log_every", "1", "--num_train_epochs", "1"]
    assert differences(script, same, stage_args) == {}
