"""Where the kit keeps what it builds (models, runs) and what it ships (data/, results/)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    """Built models and other regenerable things. `COLO_KIT_CACHE` overrides `<repo>/.cache`."""
    path = Path(os.environ.get("COLO_KIT_CACHE", REPO_ROOT / ".cache"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def data_dir() -> Path:
    return REPO_ROOT / "data"


def results_dir() -> Path:
    """Committed evidence (benchmark JSON, reference numbers). `COLO_KIT_RESULTS` overrides."""
    path = Path(os.environ.get("COLO_KIT_RESULTS", REPO_ROOT / "results"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def runs_dir() -> Path:
    """Scratch output of runs (trainer output_dir, executed notebooks); ignored by git."""
    path = results_dir() / "runs"
    path.mkdir(parents=True, exist_ok=True)
    return path
