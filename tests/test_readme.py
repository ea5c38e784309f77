"""Every command line in the README and in examples/quickstart.sh passes arguments the script accepts, with values of
the right type: the script's own tyro parser reads each one (what `--help` documents), without running anything."""

import importlib
import os
import re
import shlex
import subprocess

import pytest
import tyro

from conftest import ROOT, script_env

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


def test_the_toy_command_lines_run_in_the_order_given(tmp_path):
    """The README's toy lines, run as written and in the README's order (each stage reads the folder the one before
    wrote), in a fast mode: the same command with a few steps (`--max_steps` given last wins) and every relative
    `toy`/`runs` folder moved under a temporary directory. A line that names a folder no earlier line writes fails."""
    lines = [
        line
        for line in command_lines("README.md")
        if re.search(r"(^|\s)toy/", line) or re.search(r"toy_task\.py --out toy\b", line)
    ]
    scripts = [next(w for w in shlex.split(line) if w.endswith(".py")) for line in lines]
    assert scripts == ["examples/toy_task.py", *SCRIPTS], scripts  # the toy task, then every script once, in order
    for line, script in zip(lines, scripts):
        line = re.sub(r"(?<=\s)(toy|runs)(?=/|\s|$)", lambda m: str(tmp_path / m.group(1)), line)
        if script != "examples/toy_task.py":
            line += f" --max_steps {4 if script == 'ppo.py' else 2}"  # ppo: 2 epochs x 2 mini-batches per rollout
        result = subprocess.run(
            ["bash", "-c", line], cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, line + "\n" + result.stdout[-2000:] + result.stderr[-5000:]
    for name in ("sft", "reward", "dpo", "grpo", "ppo"):
        assert (tmp_path / "runs" / name / "config.json").exists(), name
