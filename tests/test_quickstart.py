"""examples/quickstart.sh in its fast mode (FAST=1: a few steps per stage): every stage runs on 2 processes, the
closing table is complete and consistent with what the stages wrote, and the curves are plotted (or skipped with a
message when matplotlib is missing). Whether the stages learn is tested by each script's own learning test; the
full quickstart's table is in bench/RESULTS.md and the README."""

import importlib.util
import json
import os
import re
import subprocess
import sys

from conftest import ROOT, read_metrics, script_env

FAST_STEPS = {"sft": 20, "reward": 10, "dpo": 5, "grpo": 2, "ppo": 4}  # what FAST=1 sets in examples/quickstart.sh


def test_quickstart_fast_mode(toy, tmp_path, monkeypatch, capsys):
    out = tmp_path / "quickstart"
    result = subprocess.run(
        ["bash", "examples/quickstart.sh"],
        cwd=ROOT,
        env=script_env({"FAST": "1", "OUT": str(out), "TOY": str(toy)}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    for stage, steps in FAST_STEPS.items():
        assert read_metrics(out / stage)[-1]["step"] == steps, stage
    # every metric the five scripts logged has its line in the README's metrics table
    readme = open(os.path.join(ROOT, "README.md")).read()
    documented = set(re.findall(r"`([\w/]+)`", readme.split("## Metrics")[1].split("\n## ")[0]))
    logged = {key for stage in FAST_STEPS for row in read_metrics(out / stage) for key in row}
    assert logged <= documented, sorted(logged - documented)
    report = json.load(open(out / "results.json"))
    rows = {row["stage"].split(" (")[0]: row for row in report["rows"]}
    assert list(rows) == ["untrained", "SFT", "reward model", "on-policy pairs", "DPO", "GRPO", "PPO"]
    for name in ("untrained", "SFT", "DPO", "GRPO", "PPO"):
        assert 0.0 <= rows[name]["exact_match"] <= 1.0, name
    assert rows["reward model"]["pair_accuracy"] == read_metrics(out / "reward")[-1]["eval/accuracy"]
    for name in ("SFT", "reward model", "DPO", "GRPO", "PPO"):  # wall time and the peak memory each script printed
        assert rows[name]["seconds"] >= 1 and 0.05 < rows[name]["peak_gib"] < 8, name
    times = dict(line.split() for line in open(out / "times.tsv"))
    assert sum(float(times[s]) for s in ["sft", "pairs", "reward", "dpo", "grpo", "ppo"]) <= report["total_seconds"]
    assert report["peak_gib"] == max(row.get("peak_gib") or 0 for row in report["rows"])
    table = open(out / "results.md").read()
    assert table in result.stdout and table.count("\n") == 2 + len(report["rows"]) + 1  # header, rows, total
    if importlib.util.find_spec("matplotlib"):
        assert (out / "curves.png").stat().st_size > 10_000 and "wrote" in result.stdout
    else:
        assert "matplotlib is not installed" in result.stdout and not (out / "curves.png").exists()
    # and without matplotlib, whatever this machine has: a message, no file
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from quickstart_report import plot_curves

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    if (out / "curves.png").exists():
        (out / "curves.png").unlink()
    assert plot_curves(str(out)) is None and not (out / "curves.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().out
