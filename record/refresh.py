"""The numbers a learner reads about the notebooks themselves (Run All times, peaks, "What you should see" values),
written where they are read from the committed check runs (`scripts/check.py refresh`, `make numbers`): README's
hardware matrix, INSTRUCTOR.md's schedule and memory tables, and the notebooks' headers."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from colo_kit.results import CHECKS, UNMEASURED, measured_runs
from record.notebooks import minutes as _minutes

FACT_KEY = "colo_kit_fact"  # the metadata `colo_kit.labs.lab.see` puts on its box; the check collects it


def source_digest(src: Path) -> str:
    """A notebook source's sha256 (16 hex digits), recorded beside what a check run measured: the freshness report
    (`record.status`) tells a record older than its notebook."""
    return hashlib.sha256(Path(src).read_bytes()).hexdigest()[:16]


def facts_of(executed_notebook) -> dict:
    """The `see` values an executed notebook (a path or a notebook node) recorded."""
    import nbformat

    nb = nbformat.read(executed_notebook, as_version=4) if not hasattr(executed_notebook, "cells") else executed_notebook
    facts = {}
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            facts.update(output.get("metadata", {}).get(FACT_KEY, {}))
    return facts


def refresh_tables(text: str) -> str:
    """README.md's hardware matrix and INSTRUCTOR.md's schedule and memory tables with the committed check
    runs' times, peaks and machines written in (`python scripts/check.py refresh`); a test fails while they differ.
    A header names the machine a column's numbers came from; where a tier's notebooks ran on more than one kind
    of machine, each cell names its own."""
    runs = measured_runs()
    kinds = {t: sorted({r[t]["machine"] for r in runs.values() if t in r}) for t in CHECKS}
    machines = {t: " and ".join(kinds[t]) or UNMEASURED[t] for t in CHECKS}  # a header: "1×H100 and 1×H200"

    def rec(stem: str, tier: str) -> dict | None:
        return runs.get(stem, {}).get(tier)

    def mixed(r: dict | None, tier: str) -> str:
        return f" ({r['machine']})" if r and len(kinds[tier]) > 1 else ""

    def peak(r: dict | None, key: str, tier: str) -> str:
        return f"{r[key]:.1f} GiB{mixed(r, tier)}" if r and r.get(key) is not None else "not recorded yet"

    def minutes(stem: str, tier: str) -> str:
        return _minutes(rec(stem, tier)) + mixed(rec(stem, tier), tier)

    out = []
    for line in text.split("\n"):
        if m := re.match(r"^(\| \d:\d\d–\d:\d\d \| `(\d\d_\w+)` \| )[^|]*( \|.*)$", line):  # INSTRUCTOR's schedule
            line = m[1] + " / ".join(minutes(m[2], t) for t in ("cpu", "gpu")) + m[3]
        elif m := re.match(r"^(\| `(\d\d_\w+)` \| [^|]* \| )[^|]* \| [^|]*( \|)$", line):  # INSTRUCTOR's memory
            line = m[1] + f"{peak(rec(m[2], 'cpu'), 'peak_rss_gib', 'cpu')} | " \
                          f"{peak(rec(m[2], 'gpu'), 'peak_gpu_gib', 'gpu')}" + m[3]
        elif m := re.match(r"^(\| `(\d\d_\w+)` \| [^|]*?· )[^|]*?( \| [^|]*?· )[^|]*?( \|.*)$", line):  # README
            line = m[1] + minutes(m[2], "cpu") + m[3] + minutes(m[2], "gpu") + m[4]
        elif m := re.match(r"^(\| slot \| notebook \| Run All: )[^|]*( \|.*)$", line):  # the schedule's header
            line = m[1] + f"{machines['cpu']} / {machines['gpu']}" + m[2]
        elif m := re.match(r"^(\| notebook \| what runs \| peak, )[^|]*( \| peak, )[^|]*( \|)$", line):
            line = m[1] + machines["cpu"] + m[2] + machines["gpu"] + m[3]
        line = re.sub(r"(the 1-GPU times below are from )[^.;)]*", lambda m: m[1] + machines["gpu"], line)
        out.append(line)
    return "\n".join(out)
