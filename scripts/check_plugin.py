"""A pytest plugin for scripts/check.py: one JSON line per test as soon as it ends (outcome, seconds,
the reason of a skip or an xfail), into the file named by COLO_KIT_CHECK_LOG. Lines survive a run
that is cut off by its time budget, unlike a JUnit report written at the end; the ids it selected go beside it
(`<log>.collected`), so a cut run's record can name the tests it never reached. The node ids listed in the file
named by COLO_KIT_CHECK_DONE are deselected (`check.py tests --resume`)."""

import json
import os
from pathlib import Path


def _reason(report) -> str | None:
    if getattr(report, "wasxfail", None) is not None:
        return report.wasxfail or None
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (file, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    if longrepr is not None and report.failed:
        return str(longrepr)[-1500:]
    return None


def _write(record: dict) -> None:
    path = os.environ.get("COLO_KIT_CHECK_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration
    xfail = getattr(report, "wasxfail", None) is not None
    if report.when == "call" or (report.when == "setup" and (report.skipped or report.failed)):
        if xfail:
            outcome = "xfailed" if report.skipped else "xpassed"
        elif report.when == "setup" and report.failed:
            outcome = "error"
        else:
            outcome = report.outcome
        _write({"nodeid": report.nodeid, "outcome": outcome, "seconds": round(_seconds[report.nodeid], 2),
                "reason": _reason(report)})
    elif report.when == "teardown" and report.failed:
        _write({"nodeid": report.nodeid, "outcome": "error", "seconds": round(_seconds[report.nodeid], 2),
                "reason": "teardown: " + (_reason(report) or "")})
    if report.when == "teardown" and os.environ.get("COLO_KIT_CHECK_GPU_MEM"):
        # what the GPU has free once the test and its fixtures are gone: a test that leaves an engine behind shows
        # as the drop, instead of as a later test's "GPU busy"
        _write({"nodeid": report.nodeid, "gpu_free_gib_after": _gpu_free_gib()})


def _gpu_free_gib() -> float | None:
    try:  # the kit's NVML reading (no CUDA initialised in pytest's process), CUDA's GPU 0 of this process
        from colo_kit.gpu_free import read_gpu

        return round(read_gpu(0)["free_gib"], 1)
    except Exception:  # no NVIDIA driver here: nothing to record, and never a reason to stop the suite
        return None


def pytest_collection_modifyitems(config, items):
    path = os.environ.get("COLO_KIT_CHECK_DONE")
    if not path:
        return
    done = set(Path(path).read_text().splitlines())
    left = [item for item in items if item.nodeid not in done]
    if len(left) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
        items[:] = left


def pytest_collection_finish(session):
    path = os.environ.get("COLO_KIT_CHECK_LOG")
    if path:  # after every deselection (-m, -k, --resume): what this process means to run
        Path(path + ".collected").write_text("".join(item.nodeid + "\n" for item in session.items))
