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
