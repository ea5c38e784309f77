"""The quickstart's closing table and learning curves, from what its stages left in the output folder.

    python examples/quickstart_report.py runs/quickstart toy    # after examples/quickstart.sh

Reads OUT/times.tsv (stage, seconds: written by the quickstart), each stage's metrics.jsonl and log (the peak memory
the script printed), scores every causal LM by greedy exact match on the toy test prompts in this one process, and
writes OUT/results.md (the table), OUT/results.json and, if matplotlib is installed, OUT/curves.png.
"""

import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from toy_task import exact_match  # noqa: E402

# stage folder -> (row label, metric plotted against the optimizer step)
STAGES = {
    "sft": ("SFT", "loss"),
    "reward": ("reward model", "loss"),
    "dpo": ("DPO (+RPO, on-policy pairs)", "loss"),
    "grpo": ("GRPO (exact-match verifier)", "objective/scores"),
    "ppo": ("PPO (reward model)", "objective/scores"),
}


def read_rows(out, stage):
    return [json.loads(line) for line in open(os.path.join(out, stage, "metrics.jsonl"))]


def peak_memory(out, stage):
    """The peak resident memory per process that the stage's script printed at the end (GiB), or None."""
    found = re.findall(
        r"peak \S+ (?:RSS )?memory per process ([\d.]+) GiB",
        open(os.path.join(out, f"{stage}.log"), errors="replace").read(),
    )
    return float(found[-1]) if found else None


def cell(row, key, fmt):
    return format(row[key], fmt) if row.get(key) is not None else ""


def plot_curves(out):
    """One PNG, a panel per stage; None (with a message) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no curves.png (pip install matplotlib for one)")
        return None
    stages = [s for s in STAGES if os.path.exists(os.path.join(out, s, "metrics.jsonl"))]
    fig, axes = plt.subplots(1, len(stages), figsize=(3.2 * len(stages), 2.8), squeeze=False)
    for ax, stage in zip(axes[0], stages):
        (title, key), rows = STAGES[stage], read_rows(out, stage)
        ax.plot([r["step"] for r in rows if key in r], [r[key] for r in rows if key in r], marker=".", label="train")
        evals = [(r["step"], r["eval/scores"]) for r in rows if "eval/scores" in r]
        if evals:  # grpo: greedy exact match on the test prompts; ppo: the reward model's score of greedy completions
            ax.plot(*zip(*evals), marker="o", linestyle="--", label="eval (greedy)")
            ax.legend(fontsize=7)
        ax.set_title(title.split(" (")[0], fontsize=9)
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.set_ylabel(key, fontsize=8)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    path = os.path.join(out, "curves.png")
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
    return path


def report(out, toy):
    times = dict(line.split() for line in open(os.path.join(out, "times.tsv")))
    test_prompts = os.path.join(toy, "prompts", "test.jsonl")
    rows = [{"stage": "untrained", "exact_match": exact_match(os.path.join(toy, "model"), test_prompts)}]
    for stage, (label, _) in STAGES.items():
        row = {"stage": label, "seconds": float(times[stage]), "peak_gib": peak_memory(out, stage)}
        if stage == "reward":
            row["pair_accuracy"] = read_rows(out, stage)[-1]["eval/accuracy"]
        else:
            row["exact_match"] = exact_match(os.path.join(out, stage), test_prompts)
        rows.append(row)
    rows.insert(3, {"stage": "on-policy pairs (the SFT model's mistakes)", "seconds": float(times["pairs"])})
    total, peak = float(times["total"]), max(r.get("peak_gib") or 0 for r in rows)
    table = [
        "| stage | exact match, toy test prompts | reward model: test pair accuracy | wall time "
        "| peak memory per process |",
        "|---|---|---|---|---|",
    ]
    table += [
        f"| {r['stage']} | {cell(r, 'exact_match', '.3f')} | {cell(r, 'pair_accuracy', '.3f')} "
        f"| {cell(r, 'seconds', '.0f')}"
        f"{' s' if 'seconds' in r else ''} | {cell(r, 'peak_gib', '.2f')}{' GiB' if r.get('peak_gib') else ''} |"
        for r in rows
    ]
    table.append(f"| **total** | | | **{total:.0f} s** | {peak:.2f} GiB |")
    text = "\n".join(table)
    open(os.path.join(out, "results.md"), "w").write(text + "\n")
    json.dump(
        {"rows": rows, "total_seconds": total, "peak_gib": peak}, open(os.path.join(out, "results.json"), "w"), indent=1
    )
    print("\n" + text + "\n")
    plot_curves(out)


if __name__ == "__main__":
    report(sys.argv[1], sys.argv[2])
