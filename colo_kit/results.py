"""The lessons' one window on the lab record: a committed result under `results/` by name, and one footnote on where
a number comes from (machine, date, file). The runs that wrote them live in `record/`, outside the kit."""

from __future__ import annotations

import json
from pathlib import Path

from colo_kit.paths import results_dir

LESSONS = "lessons.json"  # what the lessons show from the large records, derived by `make numbers` (record/lessons.py)
CHECKS = {"cpu": "cpu_check.json", "gpu": "gpu_check.json"}  # one Run All of every notebook per kind of machine
UNMEASURED = {"cpu": "CPU laptop", "gpu": "1 GPU"}  # a kind with no record yet


def load(name: str, results: Path | None = None) -> dict | None:
    """`results/<name>.json` (e.g. "pingpong_cpu"), or None when it is not committed; `results`: another folder."""
    path = Path(results or results_dir()) / f"{name.removesuffix('.json')}.json"
    return json.loads(path.read_text()) if path.exists() else None


def shown(key: str) -> dict:
    """What a lesson shows (e.g. "04.speed") from `results/lessons.json`, with its `source`, `machine` and `date`."""
    entries = load(LESSONS) or {}
    if key not in entries:
        raise KeyError(f"results/{LESSONS} has no {key!r}; `make numbers` derives it from the records")
    return entries[key]


def footnote(entry: dict) -> str:
    """Where a shown number comes from, in one line: "measured on 1×H200, 2026-12-01 (results/speed_1xh200.json)"."""
    when = f", {entry['date']}" if entry.get("date") else ""
    return f"measured on {entry.get('machine') or 'the machine the file names'}{when} ({entry['source']})"


def record_footnote(name: str, results: Path | None = None) -> str:
    """`footnote` for a record a lesson reads whole (`load`): the machine from its `env`, its `date`."""
    record = load(name, results) or {}
    return footnote({"machine": machine_label(record.get("env") or {}), "date": record.get("date"),
                     "source": f"results/{name.removesuffix('.json')}.json"})


def machine_label(env: dict) -> str:
    """A record's `env` (`colo_kit.env.describe`) as a learner reads it: `1×H200`, `2×H100`, `CPU laptop (2 cores)`."""
    gpus = env.get("gpus") or []
    if not gpus:
        return f"CPU laptop ({env.get('cpu_count', '?')} cores)"
    names = sorted({g.get("name", "GPU").removeprefix("NVIDIA ").split()[0] for g in gpus})
    return f"{len(gpus)}×{'/'.join(names)}"


def measured_runs(results: Path | None = None) -> dict[str, dict[str, dict]]:
    """{notebook: {"cpu" | "gpu": its Run All record, with `machine` and `date`}} from the committed check runs, whole runs
    only."""
    out: dict[str, dict[str, dict]] = {}
    for tier, name in CHECKS.items():
        record = load(name, results) or {}
        for rec in record.get("notebooks", {}).get("notebooks", []):
            if rec.get("seconds") and rec.get("status", "").startswith(("completed", "executed every cell")):
                machine = rec.get("machine") or machine_label(record.get("env") or {})
                date = rec.get("date") or (record.get("updated") or "")[:10] or None
                out.setdefault(rec["notebook"], {})[tier] = {**rec, "machine": machine, "date": date}
    return out
