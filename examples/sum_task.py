"""The second offline task: a running sum worked step by step, with prompts of graded difficulty and a flawed
demonstrator. Built so that what the details change has room to show (the sorting task's completions are 3-8 tokens
and every RL stage ends near 1.00 on it).

    python examples/sum_task.py --out sums     # sums/model, sft, preference, prompts, tools_sft, tools_prompts
    python examples/sum_task.py --out sums --steps runs/details/sums_sft   # steps skipped, kept, added (greedy)

Prompt "sum: 23 7 41 ->", right completion " 23+7=30 30+41=71" (then EOS): 2 to 6 numbers of 1-99, so completions run
from 6 to about 60 tokens and grow with the count (room for the length of right and of wrong answers to move). The
count is the difficulty: every step is an addition the model can get wrong, so long lists stay hard for a model of 1M
parameters. The demonstrator skips one number (never the first) more often the longer the list (SKIP), a plausible,
consistent mistake that SFT imitates, so imitation stops below what the verifier rewards. grpo.py's
`--reward_fn last_number` is the verifier: the last number of the completion against the prompt's `answer`. The
preference pairs (for offline DPO) prefer the right working over the demonstrator's skip, or over a last sum off by one.
With a calculator (grpo.py --tools calculator): the prompts as messages (tools_prompts), and demonstrations (tools_sft)
of which half declare the tool, where the demonstrator calls it on the whole sum 30% of the time.
"""

import argparse
import json
import os
import random
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from toy_task import completions_of, load_causal_lm, write_jsonl, write_model  # noqa: E402

COUNTS = range(2, 7)  # numbers in a prompt: the difficulty, uniform over the prompts
SKIP = {2: 0.0, 3: 0.2, 4: 0.4, 5: 0.6, 6: 0.8}  # the demonstrator's chance of skipping a number, by count
CALL = 0.3  # the tool-using demonstrator's chance of calling the calculator, where the prompt declares it
TOOLS_LINE = {"role": "system", "content": "tools: calculator"}  # what the toy template writes for --tools calculator


def worked(numbers):
    """The right completion: each partial sum as an addition, " 23+7=30 30+41=71"."""
    total, parts = numbers[0], []
    for x in numbers[1:]:
        parts.append(f"{total}+{x}={total + x}")
        total += x
    return " " + " ".join(parts)


def demonstrate(rng, numbers):
    """The flawed demonstrator: it skips one number (not the first) with probability SKIP[count]."""
    if rng.random() < SKIP[len(numbers)]:
        i = rng.randrange(1, len(numbers))
        numbers = numbers[:i] + numbers[i + 1 :]
    return worked(numbers)


def tool_demonstration(rng, numbers, call):
    """The demonstrator with a calculator (grpo.py --tools calculator), as SFT rows (messages after the prompt, then
    the completion): with probability `call` it calls it on the whole sum, then states the result, in two rows (the
    call; then, the result in the prompt, the answer) so that sft.py, which learns every completion token, does not
    learn to predict the tool's result; else it works by hand as demonstrate() does."""
    if call and rng.random() < call:
        expression = "+".join(map(str, numbers))
        turn = [{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}]}]
        result = [{"role": "tool", "name": "calculator", "content": str(sum(numbers))}]
        return [([], turn), (turn + result, [{"role": "assistant", "content": f" {sum(numbers)}"}])]
    return [([], [{"role": "assistant", "content": demonstrate(rng, numbers)}])]


def numbers_of(prompt):
    return [int(x) for x in prompt.split("->")[0].split()[1:]]


def count_of(prompt):
    return len(numbers_of(prompt))


def last_number(text):
    found = re.findall(r"\d+", text)
    return found[-1] if found else None


def write_sum_task(out, seed=0, num_train=8000, num_test=300):
    """The model, the SFT demonstrations, the preference pairs (the right working over the demonstrator's, where it
    skipped; else over the right working with one sum off by one) and the prompts with their answers."""
    rng, seen, lists, tools_rng = random.Random(seed), set(), [], random.Random(seed + 1)
    write_model(out, seed)
    while len(lists) < num_test + num_train:  # distinct lists: no test prompt among the training ones
        numbers = tuple(rng.randint(1, 99) for _ in range(rng.choice(COUNTS)))
        if numbers not in seen:
            seen.add(numbers)
            lists.append(list(numbers))
    for split, part in (("test", lists[:num_test]), ("train", lists[num_test:])):
        prompts = ["sum: " + " ".join(map(str, n)) + " ->" for n in part]
        demos = [demonstrate(rng, n) for n in part]
        right = [worked(n) for n in part]
        wrong = [d if d != r else r[: r.rindex("=") + 1] + str(sum(n) + rng.choice([-1, 1]))
                 for d, r, n in zip(demos, right, part)]
        write_jsonl(f"{out}/sft/{split}.jsonl", [{"prompt": p, "completion": d} for p, d in zip(prompts, demos)])
        write_jsonl(f"{out}/preference/{split}.jsonl",
                    [{"prompt": p, "chosen": r, "rejected": w} for p, r, w in zip(prompts, right, wrong)])
        answers = [{"prompt": p, "answer": str(sum(n))} for p, n in zip(prompts, part)]
        write_jsonl(f"{out}/prompts/{split}.jsonl", answers)
        # with a calculator: messages; half the demonstrations declare the tool, the prompts to train on do not (the
        # template writes the declaration with --tools)
        user = [[{"role": "user", "content": p}] for p in prompts]
        declared = [tools_rng.random() < 0.5 for _ in part]
        demos = [tool_demonstration(tools_rng, n, CALL * d) for n, d in zip(part, declared)]
        write_jsonl(f"{out}/tools_sft/{split}.jsonl", [{"prompt": [TOOLS_LINE] * d + u + before, "completion": after}
                                                       for u, d, rows in zip(user, declared, demos)
                                                       for before, after in rows])
        write_jsonl(f"{out}/tools_prompts/{split}.jsonl",
                    [{"prompt": u, "answer": str(sum(n))} for u, n in zip(user, part)])


def count_scores(model, tok, rows, num_samples=8, seed=0):
    """By count of numbers: greedy accuracy, the share of T = 1 samples that are right, the mean length (characters)
    of the right and of the wrong samples, and by how much the wrong ones pass the right working's length (below 0: a
    skipped step; above: steps repeated or made up); "all": the same over every row (0 for a count without rows)."""
    prompts, answers = [r["prompt"] for r in rows], [r["answer"] for r in rows]
    greedy = completions_of(model, tok, prompts, max_new_tokens=64)
    torch.manual_seed(seed)
    samples = completions_of(model, tok, prompts, num_samples, 1.0, max_new_tokens=64)
    scores = {}
    for count in [*COUNTS, "all"]:
        rows = [i for i, p in enumerate(prompts) if count in ("all", count_of(p))]
        drawn = [(t, last_number(t) == answers[i], len(worked(numbers_of(prompts[i])).strip())) for i in rows
                 for t in samples[i * num_samples : (i + 1) * num_samples]]
        right, wrong = [len(t) for t, ok, _ in drawn if ok], [(len(t), n) for t, ok, n in drawn if not ok]
        scores[count] = {"greedy": sum(last_number(greedy[i]) == answers[i] for i in rows) / max(1, len(rows)),
                         "sampled": len(right) / max(1, len(drawn)), "right_length": sum(right) / max(1, len(right)),
                         "wrong_length": sum(n for n, _ in wrong) / max(1, len(wrong)),
                         "wrong_excess": sum(n - m for n, m in wrong) / max(1, len(wrong))}
    return scores


def tool_scores(model, tok, rows, with_tools, max_new_tokens=64):
    """By count of numbers ("all": every row): greedy accuracy and tool calls a completion, sampled and verified by
    grpo.py's own code (its tool loop, in this process) with the calculator or without it."""
    import datasets
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import grpo

    args = grpo.Args(max_completion_length=max_new_tokens, per_device_eval_batch_size=100, reward_fn="last_number",
                     tools=["calculator"] if with_tools else None, world_size=1)
    tools = grpo.tools_of(args)
    data, _ = grpo.tokenize_prompts(datasets.Dataset.from_list(rows), tok, args, list(tools.values()) or None)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one process: its collectives
    try:
        rollout = grpo.sample_rollout(model, data["prompt"], None, args, tok, tok.pad_token_id, tools)
    finally:
        dist.destroy_process_group()
    right = grpo.rollout_rewards(rollout | {"answer": data["answer"]}, None, tok, args, "cpu")["outcome"]
    counts = [count_of(r["prompt"][-1]["content"]) for r in rows]
    scores = {}
    for count in [*COUNTS, "all"]:
        at = [i for i, c in enumerate(counts) if count in ("all", c)]
        scores[count] = {"greedy": right[at].mean().item() if at else 0.0,
                         "calls": rollout["tool_calls"][at, 0].mean().item() if at else 0.0}
    return scores


def step_counts(model, tok, rows):
    """The share of greedy completions with fewer additions than the prompt needs (a number skipped), as many, and
    more (a step repeated or made up)."""
    texts = completions_of(model, tok, [r["prompt"] for r in rows], max_new_tokens=64)
    extra = [t.count("+") - (count_of(r["prompt"]) - 1) for t, r in zip(texts, rows)]
    return {name: sum(test(x) for x in extra) / len(rows) for name, test in
            (("fewer", lambda x: x < 0), ("as many", lambda x: x == 0), ("more", lambda x: x > 0))}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder to write the task to (or that holds it: --steps)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", nargs="+", metavar="MODEL", help="print step_counts of these models on the test "
                        "prompts of --out instead")
    args = parser.parse_args()
    test_file, folders = os.path.join(args.out, "prompts", "test.jsonl"), args.steps or []
    missing, problem = [f for f in folders if not os.path.isfile(os.path.join(f, "config.json"))], None
    if missing:
        problem = f"--steps {missing[0]}: not a model folder (no config.json)"
    elif folders and not os.path.isfile(test_file):
        problem = f"--out {args.out} holds no task (no prompts/test.jsonl): write it with --out alone first"
    elif not folders and os.path.isfile(args.out):
        problem = f"--out {args.out} is a file: give a folder"
    if problem:  # one line, exit 2, as the scripts refuse
        print(f"sum_task.py: error: {problem}", file=sys.stderr)
        sys.exit(2)
    if args.steps:
        test = [json.loads(line) for line in open(test_file)]
        for folder in args.steps:
            shares = step_counts(*load_causal_lm(folder), test)
            print(folder, " ".join(f"{name} {share:.3f}" for name, share in shares.items()), flush=True)
    else:
        write_sum_task(args.out, args.seed)
        print(f"wrote {args.out}/model, sft, preference, prompts, tools_sft and tools_prompts")
