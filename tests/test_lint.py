"""`ruff check` with the project's settings (pyproject.toml): lines of at most 120 characters in every Python file
(STYLE.md), no unused imports or names, no undefined names."""

import os
import shutil
import subprocess
import sys

from conftest import ROOT


def test_ruff_check_passes():
    ruff = shutil.which("ruff") or os.path.join(os.path.dirname(sys.executable), "ruff")
    result = subprocess.run([ruff, "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


def test_ruff_catches_a_long_line(tmp_path):
    """The check can fail: a line of 121 characters is refused under the project's settings."""
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path)
    (tmp_path / "long.py").write_text("x = " + repr("a" * 115) + "\n")
    ruff = shutil.which("ruff") or os.path.join(os.path.dirname(sys.executable), "ruff")
    result = subprocess.run([ruff, "check", "."], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 1 and "E501" in result.stdout, result.stdout
