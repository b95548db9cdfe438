"""Prompt sets: `trl-lib/tldr` and `HuggingFaceH4/MATH-500` when online, `data/*.jsonl` stand-ins when not; each
says which it used (`dataset.info.description`)."""

from __future__ import annotations

import json
from pathlib import Path
import logging
import os

from colo_kit.paths import data_dir

log = logging.getLogger(__name__)


def _offline_requested() -> bool:
    return any(os.environ.get(v, "0") not in ("", "0", "false", "False")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "COLO_KIT_OFFLINE"))


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the hub's name resolves within seconds (offline, `load_dataset` retries ~25 s before failing)."""
    import concurrent.futures
    import socket

    host = os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("://")[-1].split("/")[0]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        pool.submit(socket.getaddrinfo, host, 443).result(timeout=timeout_s)
        return True
    except Exception:
        return False
    finally:
        pool.shutdown(wait=False)


def _load(hub_id: str, split: str, offline_file: str, source: str):
    from datasets import Dataset, load_dataset

    if source not in ("auto", "hub", "offline"):
        raise ValueError(f"source={source!r}; use 'auto' (hub, else data/), 'hub' or 'offline'")
    if source == "hub" or (source == "auto" and not _offline_requested() and _hub_reachable()):
        try:
            ds = load_dataset(hub_id, split=split)
            log.info("using %s (%s, %d rows) from the hub", hub_id, split, len(ds))
            return ds
        except Exception as exc:  # no network, no cache: fall back, but say so
            if source == "hub":
                raise
            log.info("%s unavailable (%s); using data/%s", hub_id, type(exc).__name__, offline_file)
    path = data_dir() / offline_file
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; run `make data` to regenerate the offline sets")
    ds = Dataset.from_list(read_jsonl(path))
    ds.info.description = f"colo_kit offline stand-in for {hub_id}: data/{offline_file}"
    log.info("using offline data/%s (%d rows) standing in for %s", offline_file, len(ds), hub_id)
    return ds


def read_jsonl(path, required: tuple[str, ...] = ()) -> list[dict]:
    """The rows of a JSONL file, each a JSON object with `required` keys; ValueError naming the first bad line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it ({exc}); give a UTF-8 JSONL file") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path} line {number}: not JSON ({exc.args[0].split(':')[0]}); one JSON object per "
                             "line") from None
        missing = [k for k in required if not isinstance(row, dict) or k not in row]
        if not isinstance(row, dict) or missing:
            raise ValueError(f"{path} line {number}: needs a JSON object with {', '.join(required) or 'fields'}"
                             + (f" (missing {', '.join(missing)})" if isinstance(row, dict) else ""))
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows; one JSON object per line")
    return rows


def load_problems(path):
    """A math set of your own (JSONL: `problem`, `answer`, optionally `subject`, `level`) as MATH-500 is."""
    from datasets import Dataset

    rows = read_jsonl(path, required=("problem", "answer"))
    for number, row in enumerate(rows, start=1):
        if not isinstance(row["problem"], str) or not isinstance(row["answer"], (str, int, float)):
            raise ValueError(f"{path} row {number}: problem must be text and answer text or a number")
        row["answer"] = str(row["answer"])
        row.setdefault("subject", "unknown")
        row.setdefault("level", 0)
        row.setdefault("unique_id", f"{Path(path).name}:{number}")
    ds = Dataset.from_list(rows)
    ds.info.description = f"problems from {path}"
    return ds


def load_tldr(split: str = "train", source: str = "auto"):
    """Prompts for the length-reward runs: a `prompt` column (plain text ending in 'TL;DR:')."""
    return _load("trl-lib/tldr", split, "tldr_prompts.jsonl", source)


def load_math(split: str = "test", source: str = "auto"):
    """Math problems with `problem`, `answer`, `subject`, `level`, `unique_id`."""
    return _load("HuggingFaceH4/MATH-500", split, "math_problems.jsonl", source)


def math_prompt(problem: str) -> list[dict]:
    """The one prompt template (chat form) of training and evaluation."""
    return [{"role": "user", "content": problem + "\nPlease reason step by step, and put your final "
             "answer within \\boxed{}."}]
