"""A notebook's first Run All on a freshly started GPU machine against the next one: each cell's seconds, and what the
caches on the machine held before and after each run.

Each named notebook runs twice in a row, in a fresh kernel each time, as `colo-kit run-notebooks` runs it (JupyterLab's
Run All). Only the first run of the first notebook meets empty caches; a later notebook's first run finds what the ones
before it left, and the record keeps the order. Each cell's seconds come from the timestamps nbclient writes into the
executed copy (`metadata.execution`); each cache folder is sized before and after every run, so the record shows which
of them a first run fills (vLLM's torch.compile cache, Triton's and Inductor's kernels, the kit's built models).

    python scripts/gpu/cold_start.py --notebooks 00,04 --out results/cold_start_1xh100.json [--budget-s 540]

Start it on a machine nothing has run on yet; it says where the caches already held something. A run that did not
complete keeps its status and the cells it finished; the file is written (atomically) only when some run completed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def cache_dirs() -> dict[str, Path]:
    """The folders a first Run All fills, by what fills them (the defaults each library uses, or its variable)."""
    from colo_kit.paths import cache_dir

    home = Path.home()
    user = os.environ.get("USER") or os.environ.get("LOGNAME") or "root"
    return {
        "vllm (torch.compile cache, compiled graphs)": Path(os.environ.get("VLLM_CACHE_ROOT", home / ".cache" / "vllm")),
        "triton kernels": Path(os.environ.get("TRITON_CACHE_DIR", home / ".triton" / "cache")),
        "torch inductor": Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", f"/tmp/torchinductor_{user}")),
        "flashinfer JIT": home / ".cache" / "flashinfer",
        "CUDA compute cache": Path(os.environ.get("CUDA_CACHE_PATH", home / ".nv" / "ComputeCache")),
        "colo_kit built models": cache_dir(),
    }


def folder_bytes(path: Path) -> int:
    """Bytes of the files under `path` (0 when it is missing); files that vanish while summed are skipped."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


def cache_sizes() -> dict[str, float]:
    """MiB held in each cache folder now."""
    return {what: round(folder_bytes(path) / 2**20, 1) for what, path in cache_dirs().items()}


def cell_seconds(executed: Path) -> list[dict]:
    """Each executed code cell of a notebook nbclient wrote: its index among all cells, its first source line, and the
    seconds from the kernel taking it (`iopub.execute_input`) to its reply (`shell.execute_reply`)."""
    import nbformat

    nb = nbformat.read(executed, as_version=4)
    out = []
    for i, cell in enumerate(nb.cells):
        stamps = cell.get("metadata", {}).get("execution", {})
        start, end = stamps.get("iopub.execute_input"), stamps.get("shell.execute_reply")
        if cell.cell_type != "code" or not (start and end):
            continue
        lines = [ln for ln in cell.source.splitlines() if ln.strip()]
        seconds = (datetime.fromisoformat(end.replace("Z", "+00:00"))
                   - datetime.fromisoformat(start.replace("Z", "+00:00"))).total_seconds()
        out.append({"cell": i, "first_line": (lines[0] if lines else "")[:100], "seconds": round(seconds, 2)})
    return out


def _check_runner():
    """scripts/check.py, whose `_run` runs a notebook as the GPU check does: in a session of its own, its peak memory
    sampled, and on a timeout its whole tree killed (jupyter_client starts the kernel in a session of its own, so a
    plain `subprocess.run` timeout would leave the kernel, and its engine's GPU memory, behind)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check", ROOT / "scripts" / "check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_once(notebook: Path, out_dir: Path, timeout_s: float, check=None) -> dict:
    """One Run All of `notebook` in a fresh kernel, in a child process, with the peak memory of its tree."""
    cmd = [sys.executable, "-m", "colo_kit", "run-notebooks", str(notebook), "--out", str(out_dir)]
    peaks: dict = {}
    t0 = time.time()
    rc, out, err = (check or _check_runner())._run(cmd, timeout_s, peaks, stdout=subprocess.PIPE,
                                                   stderr=subprocess.PIPE, text=True)
    status = {0: "completed", "timeout": f"cut at {timeout_s:.0f} s"}.get(rc, "failed")
    rec = {"status": status, "seconds": round(time.time() - t0, 1), **peaks}
    if status == "failed":
        rec["error_tail"] = (out or "")[-800:] + (err or "")[-1500:]
    executed = out_dir / notebook.name
    if executed.exists():
        rec["cells"] = cell_seconds(executed)
    return rec


def slowest_gaps(first: dict, second: dict, n: int = 5) -> list[dict]:
    """The `n` cells whose first run took the most seconds longer than their second."""
    later = {c["cell"]: c["seconds"] for c in second.get("cells", [])}
    gaps = [{**c, "second_seconds": later[c["cell"]], "extra_seconds": round(c["seconds"] - later[c["cell"]], 2)}
            for c in first.get("cells", []) if c["cell"] in later]
    return sorted(gaps, key=lambda g: -g["extra_seconds"])[:n]


def main(argv=None) -> int:
    import colo_kit

    colo_kit.setup()
    from colo_kit.env import describe
    from colo_kit.paths import runs_dir
    from record.store import write_json_atomic

    ap = argparse.ArgumentParser(prog="cold_start.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--notebooks", default="00", help="comma-separated numbers, run in this order (default 00)")
    ap.add_argument("--out", required=True, help="the record to write, e.g. results/cold_start_1xh100.json")
    ap.add_argument("--budget-s", type=float, default=540.0, help="wall seconds for all the runs together")
    args = ap.parse_args(argv)
    check = _check_runner()
    by_number = check._notebook_numbers()
    numbers = [n.strip() for n in args.notebooks.split(",") if n.strip()]
    bad = [n for n in numbers if n not in by_number]
    if bad or not numbers:
        print(f"cold_start.py: --notebooks {args.notebooks!r}: give numbers among {','.join(sorted(by_number))}, "
              "e.g. --notebooks 00,04", file=sys.stderr)
        return 2
    if args.budget_s <= 0:
        print(f"cold_start.py: --budget-s {args.budget_s}: give the wall seconds the runs may take, e.g. 540",
              file=sys.stderr)
        return 2
    work = runs_dir() / "cold_start"
    record = {"what": __doc__.split("\n\n")[0], "env": describe(), "commit": os.environ.get("COLO_KIT_COMMIT"),
              "order": numbers, "caches_at_start_mib": cache_sizes(), "notebooks": {}}
    held = {what: mib for what, mib in record["caches_at_start_mib"].items() if mib}
    if held:  # the first run is not a cold one: say so, and keep the sizes in the record
        print(f"[cold_start] caches not empty at the start, so the first run is not cold: {held}", flush=True)
    t0 = time.time()
    for n in numbers:
        nb = by_number[n]
        runs = []
        for which in ("first", "second"):
            left = args.budget_s - (time.time() - t0)
            if left < 30:
                runs.append({"status": "not run", "reason": f"budget of {args.budget_s:.0f} s spent"})
                continue
            rec = run_once(nb, work / f"{nb.stem}_{which}", left, check)
            rec["caches_after_mib"] = cache_sizes()
            runs.append(rec)
            print(f"[cold_start] {nb.stem} {which}: {rec['status']} in {rec['seconds']} s", flush=True)
        entry = {"first": runs[0], "second": runs[1]}
        if all(r["status"] == "completed" for r in runs):
            entry["first_over_second"] = round(runs[0]["seconds"] / runs[1]["seconds"], 2)
            entry["cells_most_slower_first"] = slowest_gaps(*runs)
        record["notebooks"][nb.stem] = entry
    if not any(r.get("status") == "completed" for e in record["notebooks"].values() for r in (e["first"], e["second"])):
        print(f"cold_start.py: no run completed; {args.out} left as it was", file=sys.stderr)
        print(json.dumps(record, indent=1)[:3000], file=sys.stderr)
        return 1
    write_json_atomic(Path(args.out), record)
    print(json.dumps({k: v.get("first_over_second") for k, v in record["notebooks"].items()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
