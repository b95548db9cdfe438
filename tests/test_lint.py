"""The code reads one way: ruff, with the project's configuration (pyproject.toml), finds nothing."""

import subprocess
import sys

import pytest

from colo_kit.paths import REPO_ROOT


def test_ruff_finds_nothing():
    pytest.importorskip("ruff", reason="ruff is in requirements/common.txt; this environment lacks it")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "colo_kit", "tests", "scripts"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]
