"""The quickstart's closing table and learning curves, from what its stages left in the output folder.

    python examples/quickstart_report.py runs/quickstart toy    # after examples/quickstart.sh

Reads OUT/times.tsv (stage, seconds: written by the quickstart), each stage's metrics.jsonl, log (the peak memory the
script printed) and checkpoints, and in this one process scores every causal LM (the final folders and the checkpoints)
by greedy exact match on the toy test prompts, the reward model by pair accuracy on the test pairs, and the SFT model's
samples on the flawed subset. Writes OUT/results.md (the table), OUT/results.json and, if matplotlib is installed,
OUT/curves.png (exact match over training, against the imitation ceiling).
"""

import glob
import json
import os
import re
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
import transformers
from transformers import AutoModelForSequenceClassification, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy_task import (  # noqa: E402
    demonstrators_ceiling,
    greedy_scores,
    in_flawed_subset,
    load_causal_lm,
    right_answers_in_samples,
    subset_scores,
)

POLICY_STAGES = {
    "sft": "SFT (imitates the demonstrator)",
    "dpo": "DPO (sigmoid, on the preference pairs)",
    "grpo": "GRPO (exact-match verifier)",
    "ppo": "PPO (the reward model)",
}
COLUMNS = ["exact_match", "flawed_subset", "other_prompts"]


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def peak_memory(out, stage):
    """The peak resident memory per process that the stage's script printed at the end (GiB), or None."""
    found = re.findall(
        r"peak \S+ (?:RSS )?memory per process ([\d.]+) GiB",
        open(os.path.join(out, f"{stage}.log"), errors="replace").read(),
    )
    return float(found[-1]) if found else None


def load_checkpoint_weights(model, checkpoint):
    """Put a training checkpoint's weights (torch.distributed.checkpoint, read in this one process) into `model`.
    ppo.py keeps the policy under model.policy (beside the value model); the other scripts under model."""
    names = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    weights = model.state_dict()
    nested = any(name.startswith("model.policy.") for name in names)
    dcp.load({"model": {"policy": weights} if nested else weights}, checkpoint_id=checkpoint, no_dist=True)
    model.load_state_dict(weights)


def learning_curve(model, tok, run_dir, rows, start, score=greedy_scores):
    """(step, score(model, tok, rows)) at every complete checkpoint of a run, after `start` = (0, the scores it started
    from)."""
    points = [start]
    checkpoints = glob.glob(os.path.join(run_dir, "checkpoints", "step_*", "checkpoint.json"))
    for path in sorted(checkpoints, key=lambda p: int(p.split("step_")[-1].split(os.sep)[0])):
        load_checkpoint_weights(model, os.path.dirname(path))
        points.append((json.load(open(path))["step"], score(model, tok, rows)))
    return points


@torch.no_grad()
def pair_accuracy(reward_dir, pairs_file, batch_size=100):
    """The reward model's test pair accuracy (chosen scored above rejected), on all pairs and on the flawed subset.
    Scored as reward.py does: prompt + completion + EOS, the score at the last token (right padding)."""
    tok = AutoTokenizer.from_pretrained(reward_dir, padding_side="right")
    model = AutoModelForSequenceClassification.from_pretrained(reward_dir, dtype=torch.float32).eval()
    rows = read_jsonl(pairs_file)

    def scores(key):
        texts = [r["prompt"] + r[key] + tok.eos_token for r in rows]
        return torch.cat(
            [
                model(**tok(texts[i : i + batch_size], return_tensors="pt", padding=True)).logits[:, 0]
                for i in range(0, len(texts), batch_size)
            ]
        )

    right = (scores("chosen") > scores("rejected")).tolist()
    flawed = [in_flawed_subset(r["prompt"]) for r in rows]
    return sum(right) / len(rows), sum(x for x, f in zip(right, flawed) if f) / sum(flawed)


def plot_curves(out, curves, ceiling, sft_score, reward_rows):
    """One PNG: a panel per stage, exact match over training with the ceiling and the SFT model's score as lines,
    and the reward model's test pair accuracy. None (with a message) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no curves.png (pip install matplotlib for one)")
        return None
    fig, axes = plt.subplots(1, len(curves) + 1, figsize=(3.2 * (len(curves) + 1), 3.0), squeeze=False)
    for ax, (stage, points) in zip(axes[0], curves.items()):
        steps = [step for step, _ in points]
        ax.plot(steps, [s["exact_match"] for _, s in points], marker="o", label="all test prompts")
        ax.plot(steps, [s["flawed_subset"] for _, s in points], marker=".", linestyle=":", label="flawed subset")
        ax.axhline(ceiling, color="grey", linestyle="--", label="imitation ceiling")
        if stage != "sft":
            ax.axhline(sft_score, color="black", linestyle=":", linewidth=1, label="SFT")
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(POLICY_STAGES[stage].split(" (")[0], fontsize=9)
        ax.set_ylabel("greedy exact match", fontsize=8)
    ax = axes[0][-1]
    evals = [(r["step"], r["eval/accuracy"]) for r in reward_rows if "eval/accuracy" in r]
    if evals:
        ax.plot(*zip(*evals), marker="o")
    ax.set_title("reward model", fontsize=9)
    ax.set_ylabel("test pair accuracy", fontsize=8)
    for ax in axes[0]:
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=6, loc="lower right")
    axes[0][1].legend(fontsize=6, loc="lower right")  # the SFT line
    fig.tight_layout()
    path = os.path.join(out, "curves.png")
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
    return path


def cell(value, fmt, unit=""):
    return "" if value is None else format(value, fmt) + unit


def report(out, toy):
    times = {name: float(seconds) for name, seconds in (line.split() for line in open(os.path.join(out, "times.tsv")))}
    test_file = os.path.join(toy, "prompts", "test.jsonl")
    rows = read_jsonl(test_file)
    model, tok = load_causal_lm(os.path.join(toy, "model"))
    untrained = greedy_scores(model, tok, rows)
    ceiling = demonstrators_ceiling(test_file)
    # the demonstrator's own answers to the same prompts (toy/sft/test.jsonl)
    demonstrations = read_jsonl(os.path.join(toy, "sft", "test.jsonl"))
    right = [d["completion"].strip() == r["answer"] for d, r in zip(demonstrations, rows)]
    demonstrator = subset_scores(right, [r["prompt"] for r in rows])
    table_rows = [
        {"stage": "untrained model", **untrained},
        {"stage": "the demonstrator (its answers to the test prompts)", **demonstrator},
        {
            "stage": "imitation ceiling (greedy copy of the demonstrator)",
            "exact_match": ceiling,
            "flawed_subset": 0.0,
            "other_prompts": 1.0,
        },
    ]
    curves, final = {}, {}
    for stage in POLICY_STAGES:
        model, tok = load_causal_lm(os.path.join(out, stage))
        final[stage] = greedy_scores(model, tok, rows)
        start = untrained if stage == "sft" else final["sft"]
        curves[stage] = learning_curve(model, tok, os.path.join(out, stage), rows, (0, start))
        last_step = read_jsonl(os.path.join(out, stage, "metrics.jsonl"))[-1]["step"]
        if curves[stage][-1][0] != last_step:  # the saved folder, when no checkpoint was taken at the last step
            curves[stage].append((last_step, final[stage]))
    samples = right_answers_in_samples(os.path.join(out, "sft"), test_file)
    accuracy, flawed_accuracy = pair_accuracy(
        os.path.join(out, "reward"), os.path.join(toy, "preference", "test.jsonl")
    )
    for stage in ["sft", "reward", "dpo", "grpo", "ppo"]:
        row = {
            "stage": POLICY_STAGES.get(stage, "reward model"),
            "seconds": times[stage],
            "peak_gib": peak_memory(out, stage),
        }
        if stage == "reward":
            row.update(pair_accuracy=accuracy, pair_accuracy_flawed_subset=flawed_accuracy)
        else:
            row.update(final[stage])
        table_rows.append(row)
    total, peak = times["total"], max(r.get("peak_gib") or 0 for r in table_rows)
    table = [
        "| stage | exact match | on the flawed subset | elsewhere | reward model: pair accuracy (flawed subset) "
        "| wall time | peak memory per process |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in table_rows:
        pairs = f"{r['pair_accuracy']:.3f} ({r['pair_accuracy_flawed_subset']:.3f})" if "pair_accuracy" in r else ""
        table.append(
            f"| {r['stage']} | "
            + " | ".join(cell(r.get(c), ".3f") for c in COLUMNS)
            + f" | {pairs} | {cell(r.get('seconds'), '.0f', ' s')} | {cell(r.get('peak_gib'), '.2f', ' GiB')} |"
        )
    table.append(f"| **total** | | | | | **{total:.0f} s** | {peak:.2f} GiB |")
    flawed_count = sum(in_flawed_subset(r["prompt"]) for r in rows)
    text = "\n".join(table) + (
        f"\n\nGreedy exact match on {len(rows)} test prompts ({flawed_count} in the flawed subset: their digits include"
        f" a 0). The SFT model's samples on the flawed subset (temperature 1, 8 per prompt): {samples[0]:.1%} right;"
        f" {samples[1]:.1%} of those prompts have at least one right sample."
    )
    open(os.path.join(out, "results.md"), "w").write(text + "\n")
    results = {
        "rows": table_rows,
        "total_seconds": total,
        "peak_gib": peak,
        "imitation_ceiling": ceiling,
        "sft_samples_right_on_flawed_subset": samples[0],
        "flawed_prompts_with_a_right_sample": samples[1],
        "curves": {stage: [[step, scores] for step, scores in points] for stage, points in curves.items()},
    }
    json.dump(results, open(os.path.join(out, "results.json"), "w"), indent=1)
    print("\n" + text + "\n")
    plot_curves(
        out, curves, ceiling, final["sft"]["exact_match"], read_jsonl(os.path.join(out, "reward", "metrics.jsonl"))
    )


if __name__ == "__main__":
    if not sys.stderr.isatty():  # a log: the table, not the bar of each model loaded
        transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", "torch.distributed is disabled")  # DCP's, for the one process it is given
    report(sys.argv[1], sys.argv[2])
