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
import types

import pytest
from conftest import ROOT, read_metrics, run_script, script_env

FAST_STEPS = {"sft": 10, "reward": 5, "dpo": 4, "grpo": 2, "ppo": 4}  # what FAST=1 sets in examples/quickstart.sh


def test_quickstart_fast_mode(tmp_path, monkeypatch, capsys):
    """From a machine without the toy task: the quickstart writes it (`examples/toy_task.py --out`, the README's first
    toy line), then runs the stages, which are the README's toy lines (tests/test_readme.py) with fewer steps."""
    out, toy = tmp_path / "quickstart", tmp_path / "toy"
    result = subprocess.run(
        ["bash", "examples/quickstart.sh"],
        cwd=ROOT,
        env=script_env({"FAST": "1", "OUT": str(out), "TOY": str(toy)}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-8000:]
    assert (toy / "model" / "config.json").exists() and (toy / "prompts" / "test.jsonl").exists()
    for stage, steps in FAST_STEPS.items():
        assert read_metrics(out / stage)[-1]["step"] == steps, stage
    # every metric the five scripts logged has its line in the README's metrics table
    readme = open(os.path.join(ROOT, "README.md")).read()
    documented = set(re.findall(r"`([\w/]+)`", readme.split("## Metrics")[1].split("\n## ")[0]))
    logged = {key for stage in FAST_STEPS for row in read_metrics(out / stage) for key in row}
    assert logged <= documented, sorted(logged - documented)
    report = json.load(open(out / "results.json"))
    rows = {row["stage"].split(" (")[0]: row for row in report["rows"]}
    names = ["untrained model", "the demonstrator", "imitation ceiling", "SFT", "reward model", "DPO", "GRPO", "PPO"]
    assert list(rows) == names
    for name in names:
        if name != "reward model":
            assert all(0.0 <= rows[name][key] <= 1.0 for key in ("exact_match", "flawed_subset", "other_prompts"))
    assert rows["imitation ceiling"]["exact_match"] == report["imitation_ceiling"]
    assert rows["the demonstrator"]["other_prompts"] == 1.0 > rows["the demonstrator"]["flawed_subset"]
    # the report's own scoring of the reward model agrees with what reward.py logged on the same test pairs (after 5
    # steps a near-tie pair may flip on float order: one pair of slack)
    logged_accuracy = read_metrics(out / "reward")[-1]["eval/accuracy"]
    assert rows["reward model"]["pair_accuracy"] == pytest.approx(logged_accuracy, abs=0.011)
    for name in ("SFT", "reward model", "DPO", "GRPO", "PPO"):  # wall time and the peak memory each script printed
        assert rows[name]["seconds"] >= 1 and 0.05 < rows[name]["peak_gib"] < 8, name
    for stage in (
        "sft",
        "dpo",
        "grpo",
        "ppo",
    ):  # a point at step 0 and at every checkpoint, the last one the saved model
        steps = [step for step, _ in report["curves"][stage]]
        assert steps[0] == 0 and steps[-1] == FAST_STEPS[stage] and steps == sorted(steps) and len(steps) >= 2, stage
        assert report["curves"][stage][-1][1] == {k: rows[stage.upper()][k] for k in report["curves"][stage][-1][1]}
    times = dict(line.split() for line in open(out / "times.tsv"))
    assert sum(float(times[s]) for s in ["sft", "reward", "dpo", "grpo", "ppo"]) <= report["total_seconds"]
    assert report["peak_gib"] == max(row.get("peak_gib") or 0 for row in report["rows"])
    assert 0 <= report["sft_samples_right_on_flawed_subset"] <= report["flawed_prompts_with_a_right_sample"] <= 1
    table = open(out / "results.md").read()
    assert table in result.stdout
    assert table.split("\n\n")[0].count("\n") == 2 + len(report["rows"])  # header, rows, total
    if importlib.util.find_spec("matplotlib"):
        assert (out / "curves.png").stat().st_size > 10_000 and "wrote" in output
    else:
        assert "matplotlib is not installed" in output and not (out / "curves.png").exists()
    # and without matplotlib, whatever this machine has: a message, no file
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from quickstart_report import plot_curves

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    if (out / "curves.png").exists():
        (out / "curves.png").unlink()
    assert plot_curves(str(out), report["curves"], 0.5, 0.5, []) is None and not (out / "curves.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().out


def forked(command, cwd, stdout, stderr):
    """details.py's subprocess.run for its `python script.py ...` runs: the script as a fork of the tests' launcher
    (conftest.run_script; about 10 s of imports less a run), its output into the run's log."""
    assert command[0] == sys.executable and stderr == subprocess.STDOUT, command
    result = run_script(command[1], command[2:])
    stdout.write(result.stdout + result.stderr)
    return result


# scoring a checkpoint (DCP, one process, no process group) warns that it loads in a single process: meant so
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_details_fast_mode(tmp_path, monkeypatch, capsys):
    """examples/details.py in its fast mode (FAST=1: 2 steps of each run, one seed, one process a run, two runs at a
    time), in this process, each run a fork (`forked`): it trains its SFT and reward models first, every run of every
    finding is the script with the finding's own flags, and each finding gets its table rows and (with matplotlib)
    its figure. What the findings show is measured by the full mode (README, "What the details change")."""
    out, qs, toy, sums = tmp_path / "details", tmp_path / "qs", tmp_path / "toy", tmp_path / "sums"
    for name, value in (("FAST", "1"), ("OUT", str(out)), ("QS", str(qs)), ("TOY", str(toy)), ("SUMS", str(sums))):
        monkeypatch.setenv(name, value)  # read by details.py at import: its steps, folders and flags
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    details = importlib.reload(importlib.import_module("details"))
    monkeypatch.setattr(details, "subprocess", types.SimpleNamespace(run=forked, STDOUT=subprocess.STDOUT))
    details.main()
    first = capsys.readouterr().out

    table = open(out / "table.md").read()
    assert table in first
    assert read_metrics(qs / "sft")[-1]["step"] == 10 and read_metrics(qs / "reward")[-1]["step"] == 5
    assert read_metrics(out / "sums_sft")[-1]["step"] == 10  # the running-sum task's SFT model
    assert read_metrics(out / "reward_weak")[-1]["step"] == 2  # the over-optimisation finding's weak reward model
    assert "Test pair accuracy: the quickstart's reward model" in table
    assert "- PPO, weak reward model, kl_coef 0.2: " in table  # the wrong answers of each run's final model
    for finding, title, runs, metrics in details.FINDINGS:
        section = table.split(f"## {title}\n")[1].split("\n## ")[0]
        for label, runner, flags in runs:
            folder = out / f"{details.folder_name(runner, flags)}_s1"
            ran = open(folder / "command.txt").read()
            assert f"{runner.__name__}.py" in ran and " ".join(map(str, flags)) in ran, (finding, label, ran)
            assert read_metrics(folder)[-1]["step"] == (4 if runner is details.ppo else 2), (finding, label)
            assert f"| {label} | 1 | " in section, (finding, label)
        if importlib.util.find_spec("matplotlib"):
            assert (out / f"{finding}.png").stat().st_size > 10_000, finding
    # a second call finds every run done: nothing runs again
    monkeypatch.setattr(details, "subprocess", None)
    details.main()
    again = capsys.readouterr().out
    assert " s\n" not in again.split("# What the details change")[0] and table.split("\n")[2] in again, again
