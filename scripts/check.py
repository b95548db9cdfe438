"""What a node can run: the whole test suite and every notebook as JupyterLab's Run All runs it, on
this machine, recorded with hardware, versions and commit.

    python scripts/check.py tests     --json results/gpu_check.json [--budget-s 560] [--parallel 8] [--per-file]
                                      [--resume] [-- <pytest args>]
    python scripts/check.py notebooks --json results/gpu_check.json [--notebooks 00,03[+01,02]] [--budget-s 560]
                                      [--resume]
    python scripts/check.py merge --json results/gpu_check.json --from <brought back>/gpu_check.json --run S
    python scripts/check.py prune --json results/gpu_check.json   # drop records of tests the suite no longer has
    python scripts/check.py refresh     # the notebooks' headers, README.md and docs/INSTRUCTOR.md from the records

Each call runs one part and merges it into `--json` (a part re-run replaces only the items it ran, each
item keeps the commit it ran at; a notebook the budget left out replaces no record of one that ran). Every file it
writes (the record, the HTML copies, refresh's notebooks and docs) is replaced whole or not at all, merges into one
record take turns, and a malformed record is named in one line (record/store.py). Executed notebooks are kept
beside the JSON, as HTML and as the executed notebook (`results/gpu_check/NN_*.html`, `NN_*.ipynb`) for readers without
the hardware; the site (`make site`) builds its lesson pages from the executed notebooks. Without `--json` the record goes
to results/runs/check.json. `scripts/gpu/check.sh` runs both parts on a GPU node; on a laptop the
same command measures the CPU tier.

Pytest results are written as each test ends (scripts/check_plugin.py), so a part cut off by its
time budget keeps what it finished; `--budget-s` stops starting notebooks that would not finish.

Each notebook's record carries the peak memory of its process tree (the kernel and what it started): host
RSS, and on a GPU what NVML says the tree's processes hold; and the digest of the notebook's source it ran
(`record.refresh.source_digest`), so a test can tell a record older than its notebook. `refresh` writes the
records' times and peaks where a learner reads them (`make numbers` runs the check, then `refresh`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# every record, notebook and doc this script writes goes through record.store: whole or not at all, merges one at a
# time, a malformed record named in one line (RecordError)
from record.store import RecordError, load_record, locked, write_json_atomic, write_text_atomic  # noqa: E402

ITEM_KEYS = {"tests": ("nodeid", "outcome"), "notebooks": ("notebook", "status")}  # each item's name and result


def check_shape(record: dict, where: str, fix: str) -> dict:
    """`record` when it has the shape this script writes (each part an object whose list holds items with a name and
    a result, `runs` a list); else RecordError naming `where`, the first problem and `fix`. Checked before anything is
    written: a brought-back item without a name was written into the record before the KeyError it caused."""
    for part, keys in ITEM_KEYS.items():
        section = record.get(part)
        if section is None:
            continue
        if not isinstance(section, dict):
            raise RecordError(f'{where}: "{part}" is a {type(section).__name__}, not an object; {fix}')
        items = section.get(part) or []
        if not isinstance(items, list):
            raise RecordError(f'{where}: "{part}"."{part}" is a {type(items).__name__}, not a list; {fix}')
        for i, item in enumerate(items):
            missing = [k for k in keys if not isinstance(item, dict) or not isinstance(item.get(k), str) or not item[k]]
            if missing:
                raise RecordError(f'{where}: {part} item {i} has no "{missing[0]}" ({str(item)[:80]}); {fix}')
    if not isinstance(record.get("runs") or [], list):
        raise RecordError(f'{where}: "runs" is a {type(record["runs"]).__name__}, not a list; {fix}')
    return record


def read_record(path: Path) -> dict:
    """The record at `path` ({} when there is none yet), checked (`check_shape`)."""
    fix = f"restore it (git checkout -- {path}) or move it away"
    return check_shape(load_record(path, fix=fix), str(path), fix)


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 — a copy without git still gets checked
        return ""


def kit_digest(root: Path = REPO) -> str:
    """The package's sha256 (16 hex digits) over every `colo_kit/**/*.py` under `root`, names and contents. Each
    item of a check records it: items run at commits that changed only tests, scripts or results still show as
    one version of the kit, and an item run on other package code shows too."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted((Path(root) / "colo_kit").rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _commit() -> dict:
    """The commit the items ran at: COLO_KIT_COMMIT when set (a machine given a copy of the working
    tree, whose .git, if any, is not the tree's: seen on the lent GPU machines), else git's."""
    given = os.environ.get("COLO_KIT_COMMIT")
    if given:
        return {"commit": given, "dirty": None}
    head = _git("rev-parse", "HEAD")
    # results/ is left out: the check itself rewrites its HTML copies there before it records the commit
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!results")
    return {"commit": head or None, "dirty": bool(dirty) if head else None}


def cpu_of(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """The CPU's model and the widest vector ISA it has: two 2-core machines, one seed, one notebook source:
    notebook 00 ended at rewards -20 and -72 and ran in 37 s and 116 s, and only these tell the machines apart."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    isa = next((f for f in ("avx512f", "avx2", "avx", "sse4_2") if f in flags), None)
    return {"cpu_model": fields.get("model name"), "cpu_isa": isa}


def _run(cmd: list[str], timeout_s: float, peaks: dict | None = None, **kwargs):
    """`subprocess.run` in a session of its own, so a timeout ends the whole tree (a vLLM server a
    test started, a notebook's kernel) instead of leaving it on the GPU for the next part. With `peaks`,
    the tree's peak memory is sampled into it while it runs (`_sample_peaks`)."""
    import threading

    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, **kwargs)
    done = threading.Event()
    sampler = None
    if peaks is not None:
        sampler = threading.Thread(target=_sample_peaks, args=(proc.pid, done, peaks), daemon=True)
        sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        out, err = proc.communicate()
        return "timeout", out, err
    finally:
        done.set()
        if sampler is not None:
            sampler.join()


def _kill_tree(pid: int) -> None:
    """SIGKILL process `pid`, its process group and every process it started, in whatever session: jupyter_client
    starts a notebook's kernel in a session of its own, so killing the group alone left a cut notebook's kernel
    holding its engine's GPU memory for whatever ran next (26 GiB on an H100, seen with nvidia-smi; no record
    holds it)."""
    import signal

    import psutil

    try:
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        tree = []
    groups = {pid}
    for p in tree:
        try:
            groups.add(os.getpgid(p.pid))
        except OSError:
            pass
    for g in groups - {os.getpgrp()}:
        try:
            os.killpg(g, signal.SIGKILL)
        except OSError:
            pass
    for p in tree:  # a process that left its group too
        try:
            p.kill()
        except psutil.Error:
            pass
    deadline = time.time() + 30
    while time.time() < deadline and any(_alive(p) for p in tree):  # its memory is free once it is gone
        time.sleep(0.05)


def _alive(p) -> bool:
    """False once `p` has exited, a zombie included (a reparented one waits for a reaper that may never come)."""
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _gpu_holders() -> list[dict] | None:
    """Every process NVML lists on any GPU, as the kit's `read_gpu` names them ({pid, gib, name}); None where there
    is no NVML (a CPU machine)."""
    try:
        import pynvml

        from colo_kit.gpu_free import read_gpu

        pynvml.nvmlInit()
        return [p for i in range(pynvml.nvmlDeviceGetCount()) for p in read_gpu(i, physical=True)["others"]]
    except Exception:  # noqa: BLE001 — no NVIDIA driver here, or one that does not list processes
        return None


def gpu_left_after(timeout_s: float = 60.0, list_processes=_gpu_holders, interval_s: float = 0.5):
    """What still holds GPU memory once a part has ended: polled until no process is listed or `timeout_s` has
    passed, since a killed engine's memory is given back a moment after its process is reaped. Returns None with no
    NVML, else `list_processes`' last list (empty: the GPU was left clean). Only reported, never killed: on a node
    shared by learners the process may be someone else's. Seen once on an H100: right after a budget-cut tests part,
    `nvidia-smi` listed a process holding 24864 MiB that was gone seconds later."""
    deadline = time.time() + timeout_s
    procs = list_processes()
    while procs and time.time() < deadline:
        time.sleep(interval_s)
        procs = list_processes()
    return procs


def _sample_peaks(pid: int, done, peaks: dict, interval_s: float = 0.5) -> None:
    """Peak memory of process `pid` and everything it started (the notebook's kernel, the vLLM servers
    and workers it launched), every `interval_s` until `done`: host memory as the sum of their resident
    sets (`peak_rss_gib`), and on a GPU what NVML says those processes hold (`peak_gpu_gib`, all GPUs)."""
    import psutil

    try:
        import pynvml

        pynvml.nvmlInit()
        gpus = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # noqa: BLE001 — no NVML: a CPU machine
        gpus = []
    rss = gpu = 0
    while not done.wait(interval_s):
        try:
            root = psutil.Process(pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            break
        pids, now = set(), 0
        for p in tree:
            try:
                now += p.memory_info().rss
                pids.add(p.pid)
            except psutil.Error:
                pass
        rss = max(rss, now)
        held = 0
        for h in gpus:
            try:
                held += sum(x.usedGpuMemory or 0 for x in pynvml.nvmlDeviceGetComputeRunningProcesses(h)
                            if x.pid in pids)
            except pynvml.NVMLError:  # a GPU or driver that does not list processes: no GPU figure
                gpus = []
        gpu = max(gpu, held)
    peaks["peak_rss_gib"] = round(rss / 2**30, 2)
    if gpus:
        peaks["peak_gpu_gib"] = round(gpu / 2**30, 2)


def _side_by_side(run_lane, lanes: list) -> None:
    """`run_lane(i, lane)` for every lane at once, each in its own thread; back when all are done."""
    import threading

    threads = [threading.Thread(target=run_lane, args=(i, lane)) for i, lane in enumerate(lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_tests(pytest_args: list[str], budget_s: float, parallel: int = 1, done: set[str] = frozenset(),
              per_file: bool = False) -> dict:
    """The suite, one record per test: outcome, seconds, and the reason of a skip or xfail.

    `parallel` > 1 runs the suite as that many pytest processes at once: one for the tests that start vLLM
    engines, train or need the GPU (marked `slow` or `gpu`), one after another, so two engines never profile one
    GPU's memory at the same time; and the others for the rest, split by test file. A 16-core GPU node then
    checks the CPU-only tests beside the GPU ones instead of after them. Each record says which process ("lane")
    ran it. (With only `slow` in the first lane, the `gpu` tests of test_sleep built an engine beside it on one
    H200: "No available memory for the cache blocks".)

    `done`: node ids already recorded with this package, left out (`--resume`: a suite longer than one call's time
    limit goes on where the last call's budget cut it).

    `per_file`: the first lane (the only one without `parallel`) runs each test file in a pytest process of its
    own, one after another, so what a file's engines keep on the GPU ends with its process. Seen on one H200: two
    in-process engines of test_train, kept by the pytest process, left 27 of 140 GiB free, and the next four tests
    that start vLLM failed with GpuBusy naming that pytest process (`gpu_free_gib_after` shows such drops)."""
    from colo_kit.env import has_cuda

    named = [a for a in pytest_args if not a.startswith("-") and (REPO / a.split("::")[0]).exists()]
    files = sorted({a.split("::")[0] for a in named}) or sorted(str(f.relative_to(REPO))
                                                             for f in (REPO / "tests").glob("test_*.py"))
    if parallel < 2:
        lanes, targets = [[]], named or files
    else:
        pytest_args = [a for a in pytest_args if a not in named]
        fast = [files[i::parallel - 1] for i in range(parallel - 1)]  # round robin by name: small and big mix
        lanes = [["-m", "slow or gpu", *files]] + [["-m", "not slow and not gpu", *chunk] for chunk in fast if chunk]
        targets = files
    options = [a for a in pytest_args if a not in named]
    per_file_args: dict[str, list[str]] = {}  # each file's part of what was named (a file, or some of its tests)
    for a in targets:
        per_file_args.setdefault(a.split("::")[0], []).append(a)
    deadline = time.time() + budget_s
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "scripts"), os.environ.get("PYTHONPATH")])))
    scratch = Path(tempfile.mkdtemp(prefix="colo_kit-check-"))  # the lanes' logs; removed once read
    if done:
        skip = scratch / "done.txt"
        skip.write_text("\n".join(sorted(done)) + "\n")
        env["COLO_KIT_CHECK_DONE"] = str(skip)
    t0, tests, rcs, commands, not_run = time.time(), [], [], [], []

    def run_lane(i: int, lane: list[str]) -> None:
        log = scratch / f"lane{i}.jsonl"
        collected = Path(f"{log}.collected")
        pytest = [sys.executable, "-m", "pytest", "-p", "check_plugin", "-q", "-rN"]
        cmd = [*pytest, *pytest_args, *lane]
        commands.append(shlex.join(cmd[2:]) + (" (a process per file)" if per_file and i == 0 else ""))
        # the GPU lane (or the only one) on a GPU node records the GPU's free memory after each test
        gpu_mem = {"COLO_KIT_CHECK_GPU_MEM": "1"} if i == 0 and has_cuda() else {}
        lane_env = dict(env, COLO_KIT_CHECK_LOG=str(log), **gpu_mem)
        if per_file and i == 0:
            # what the whole lane selects, for the record of what a cut run never reached; then file by file
            _run([*cmd, "--collect-only"], budget_s, env=lane_env, stdout=subprocess.DEVNULL)
            selected = collected.read_text() if collected.exists() else ""
            marks = [a for a in lane if a not in files]
            # only the files something was selected from (most have no slow test): a pytest start costs seconds on a
            # GPU node. Nothing selected at all, say a collection error: every file, so the error is recorded.
            chosen = {Path(n.split("::")[0]).name for n in selected.splitlines()}
            parts = [part for f, part in per_file_args.items() if Path(f).name in chosen] or \
                list(per_file_args.values())
            rc = 0
            for part in parts:
                left = deadline - time.time()
                one = _run([*pytest, *options, *marks, *part], left, env=lane_env)[0] if left > 0 else "timeout"
                if one == "timeout":
                    rc = "timeout"
                    break
                rc = rc or (0 if one == 5 else one)  # 5: a file with nothing selected
            collected.write_text(selected)  # each process wrote its own selection over the lane's
        else:
            rc, _, _ = _run(cmd, budget_s, env=lane_env)
        rcs.append(0 if rc == 5 and len(lanes) > 1 else rc)  # 5: a lane that selected no test
        mine: list[dict] = []
        for line in log.read_text().splitlines() if log.exists() else []:
            item = json.loads(line)
            if "outcome" in item:
                mine.append({**item, **({"lane": i} if len(lanes) > 1 else {})})
            else:  # a test's teardown reading, after its record
                next((t for t in reversed(mine) if t["nodeid"] == item["nodeid"]), {}).update(item)
        tests.extend(mine)
        if collected.exists():  # what the lane selected and never recorded: the budget cut it first
            ran = {t["nodeid"] for t in mine}
            not_run.extend(n for n in collected.read_text().splitlines() if n not in ran)

    try:
        _side_by_side(run_lane, lanes)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    returncode = "timeout" if "timeout" in rcs else next((rc for rc in rcs if rc), 0)
    result = {"returncode": returncode, "seconds": round(time.time() - t0, 1), "counts": counts, "tests": tests,
              "command": " & ".join(commands)}
    if not_run:
        why = f"cut by the {budget_s:.0f} s budget" if "timeout" in rcs else f"pytest ended (exit codes {rcs})"
        result.update(not_run=sorted(not_run), not_run_reason=f"{why} before they ran")
    return result


def run_notebooks(lanes: list[list[str]] | None, html_dir: Path, budget_s: float) -> dict:
    """Every notebook (or those named) executed top to bottom in a fresh kernel, as Run All does.
    `lanes`: lists of notebook numbers; the lanes run at the same time, each one notebook after
    another (a GPU with room for two notebooks' engines checks them in half the time; each record
    says which lane it ran in and beside how many others)."""
    from record.notebooks import SOURCES
    from record.refresh import source_digest

    by_number = _notebook_numbers()  # main() refused numbers that name no notebook
    lanes = lanes or [sorted(by_number)]
    html_dir.mkdir(parents=True, exist_ok=True)
    t0, out = time.time(), []

    def run_lane(i: int, lane: list[str]) -> None:
        for n in lane:
            p = by_number[n]
            left = budget_s - (time.time() - t0)
            if left < 60:
                out.append({"notebook": p.stem, "status": "not run", "reason": f"time budget of {budget_s:.0f} s spent"})
                continue
            start = time.time()
            # into a folder of its own first: the copies beside the record are replaced whole or not at all
            scratch = Path(tempfile.mkdtemp(prefix=f".{p.stem}.", dir=html_dir))
            cmd = [sys.executable, "-m", "colo_kit", "run-notebooks", str(p), "--out", str(scratch)]
            peaks: dict = {}
            rc, stdout, stderr = _run(cmd, left, peaks, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            tail = (stdout or "")[-1500:] + (stderr or "")[-3000:]
            status = {0: "completed", "timeout": f"cut by the time budget ({left:.0f} s were left when it started)"}
            rec = {"notebook": p.stem, "status": status.get(rc, "failed"),
                   "seconds": round(time.time() - start, 1), "lane": i, "lanes": len(lanes), **peaks, **_commit(),
                   "source_sha256": source_digest(SOURCES / (p.stem + ".py"))}
            if rc not in (0, "timeout"):
                rec["error_tail"] = tail
            if (scratch / p.name).exists():  # what the notebook's "What you should see" boxes recorded
                from record.refresh import facts_of

                rec["facts"] = facts_of(scratch / p.name)
            # the HTML copy is what readers open; the executed notebook beside it is what the site's lesson page is
            # built from (docs/site): both kept, each written whole
            for name in (p.stem + ".html", p.name):
                if (scratch / name).exists():
                    write_text_atomic(html_dir / name, (scratch / name).read_bytes())
            shutil.rmtree(scratch, ignore_errors=True)
            out.append(rec)
            print(f"[check] {p.stem}: {rec['status']} in {rec['seconds']} s (lane {i})", flush=True)

    _side_by_side(run_lane, lanes)
    return {"seconds": round(time.time() - t0, 1), "notebooks": out}


def _notebook_numbers() -> dict[str, Path]:
    from colo_kit_cli.notebooks import NOTEBOOKS

    return {p.name[:2]: p for p in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))}


def notebooks_done(path: Path) -> set[str]:
    """The numbers of the notebooks the record at `path` holds as completed with this package and the notebook's
    source as it is now, their HTML copies beside the record (`--resume`: the notebooks part goes on where the last
    call's time limit stopped it, as the tests part does)."""
    from record.notebooks import SOURCES
    from record.refresh import source_digest

    kit, html = kit_digest(), path.with_suffix("")
    records = {n["notebook"]: n for n in (read_record(path).get("notebooks") or {}).get("notebooks", [])}
    done = set()
    for number, nb in _notebook_numbers().items():
        rec = records.get(nb.stem) or {}
        if (rec.get("status") == "completed" and rec.get("kit_sha256") == kit
                and rec.get("source_sha256") == source_digest(SOURCES / (nb.stem + ".py"))
                and (html / (nb.stem + ".html")).exists()):
            done.add(number)
    return done


def merge(path: Path, part: str, result: dict, env: dict | None = None) -> dict:
    """Put `result` into the record at `path` (`merge_into`), read and written under the record's lock, the file
    replaced whole: two merges at once each wrote the record it had read, and one's items were lost."""
    with locked(path):
        record = merge_into(read_record(path), part, result, env)
        write_json_atomic(path, record)
    return record


def merge_into(record: dict, part: str, result: dict, env: dict | None = None) -> dict:
    """`record` with `result` in it: items this run made replace the same items of an
    earlier run; the others are kept with the commit and the machine they ran on. A notebook this run did not run
    (the budget left it out) replaces no item of one that ran: the part names it in `not_run`. `env`: the machine of
    a result made elsewhere (`merge --from`), which keeps its own commit."""
    from colo_kit.env import describe
    from colo_kit.results import machine_label

    foreign = env is not None
    env = env or {**describe(), **cpu_of()}
    if record.get("env"):  # the items so far ran on the machine the record named: keep that with each of them
        before = machine_label(record["env"])
        for earlier in ("tests", "notebooks"):
            for item in (record.get(earlier) or {}).get(earlier, []):
                item.setdefault("machine", before)
    record.update({"what": "the test suite and every notebook, executed as JupyterLab's Run All runs them",
                   "env": env, "updated": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())})
    result = {**result, **_commit()} if not foreign else result
    key = "tests" if part == "tests" else "notebooks"
    old = record.get(part) or {}
    kit = kit_digest() if not foreign else None  # a foreign item's package is the one it ran, not this one's
    for item in result[key]:
        item.setdefault("commit", result.get("commit"))  # a brought-back part may name no commit of its own
        item.setdefault("machine", machine_label(env))
        item.setdefault("date", time.strftime("%Y-%m-%d", time.gmtime()))  # a lesson's footnote: machine, date, file
        if kit:
            item.setdefault("kit_sha256", kit)
    if key == "notebooks" and old.get(key):
        ran = {item["notebook"] for item in old[key] if not _budget_only(item)}
        left_out = [item for item in result[key] if _budget_only(item) and item["notebook"] in ran]
        if left_out:  # the budget says nothing about the notebook: the record of the run that ran it stays
            result[key] = [item for item in result[key] if item not in left_out]
            result.update(not_run=sorted(item["notebook"] for item in left_out),
                          not_run_reason=left_out[0].get("reason") or left_out[0].get("status") or "not run")
    if old.get(key):
        mine = {item.get("nodeid") or item.get("notebook") for item in result[key]}
        kept = [item for item in old[key] if (item.get("nodeid") or item.get("notebook")) not in mine]
        for item in kept:
            item.setdefault("commit", old.get("commit"))
        result[key] = kept + result[key]
    if part == "tests":
        # tests a cut run never reached stay listed until a run records them (`--resume` runs them)
        recorded = {t["nodeid"] for t in result["tests"]}
        missing = sorted((set(old.get("not_run", [])) | set(result.get("not_run", []))) - recorded)
        reason = result.get("not_run_reason") or old.get("not_run_reason")
        result = {k: v for k, v in result.items() if k not in ("not_run", "not_run_reason")}
        result["counts"] = {}
        for t in result["tests"]:
            result["counts"][t["outcome"]] = result["counts"].get(t["outcome"], 0) + 1
        if missing:
            result.update(not_run=missing, not_run_reason=reason)
            result["counts"]["not run"] = len(missing)
    record[part] = result
    return record


def merge_from(path: Path, source: Path, run: str, ended: str | None = None) -> tuple[dict, list[dict]]:
    """Fold a record made on another machine (a GPU node's, brought back by the device tool) into the one at `path`:
    its items replace the same items and keep the commit, package and machine they ran on, each named `run`; the
    executed notebooks' HTML comes along; `runs` says what ran and how it ended. Returns the record and the `runs`
    entries this call added (none: nothing new, nothing written). The record is read and written once, under its
    lock; `source` is checked first (`check_shape`), so a bad item writes nothing."""
    with locked(path):
        record = read_record(path)
        before = len(record.get("runs") or [])
        record, html = _merge_from(record, source, run, ended)
        folded = (record.get("runs") or [])[before:]
        if folded:
            write_json_atomic(path, record)
    for src in html:  # after the record: a record that could not be written leaves the HTML as it was too
        write_text_atomic(path.with_suffix("") / src.name, src.read_bytes())
    return record, folded


def _merge_from(record: dict, source: Path, run: str, ended: str | None) -> tuple[dict, list[Path]]:
    """`merge_from`'s work on the record in memory: the record, and the HTML copies to bring along."""
    from colo_kit.results import machine_label

    fix = "give the JSON scripts/check.py wrote there"
    src = check_shape(load_record(source, fix=fix), f"--from {source}", fix)
    html = []
    for part in ("tests", "notebooks"):
        result = dict(src.get(part) or {})
        # a device record that began as a copy of this one (`--resume`) still holds what earlier runs made, and a
        # notebook the budget left out is listed as "not run": neither is this run's to name
        # items at another commit than the run's came with that copy too (the device tool carries the committed
        # record into every call, so a second call's record holds the first's items again)
        ours = {_made(item) for item in (record.get(part) or {}).get(part, [])}
        made = [item for item in result.get(part) or []
                if item.get("status") != "not run" and _made(item) not in ours
                and item.get("commit", result.get("commit")) == result.get("commit")]
        if not made:
            continue
        made = result[part] = [{**item, "run": run} for item in made]
        record = merge_into(record, part, result, env=src.get("env"))
        for nb in made if part == "notebooks" else []:
            for ext in (".html", ".ipynb"):  # the executed notebook comes along with its HTML copy
                if (copy := source.with_suffix("") / f"{nb['notebook']}{ext}").exists():
                    html.append(copy)
        record.setdefault("runs", []).append(
            {"run": run, "commit": result.get("commit"), "part": part, "machine": machine_label(src.get("env") or {}),
             "seconds": result.get("seconds"),
             "command": result.get("command"),
             # what held the GPU once this run's part had ended (a list, empty when nothing did; absent on a CPU)
             **({"gpu_left_after": result["gpu_left_after"]} if "gpu_left_after" in result else {}),
             "ended": ended or str(
                 {n["notebook"]: n["status"] for n in made} if part == "notebooks" else
                 {o: sum(t["outcome"] == o for t in made) for o in sorted({t["outcome"] for t in made})})})
    return record, html


def _budget_only(item: dict) -> bool:
    """A notebook the time budget left out or cut: its item tells of the call's budget, not of the notebook."""
    status = item.get("status") or ""
    return status == "not run" or status.startswith("cut by the time budget")


def _made(item: dict) -> tuple:
    """What tells one run's item from another's: the test or notebook, where and when it ran, how it ended."""
    return (item.get("nodeid") or item.get("notebook"), item.get("commit"), item.get("seconds"),
            item.get("outcome") or item.get("status"))


def prune(path: Path) -> list[str]:
    """Drop the records of tests the suite no longer has (renamed, re-parametrized or removed since they ran), as
    pytest collects the suite here: a merge keeps every item it does not replace, so such a record would stay, with
    the package it ran, for ever. The suite's parametrizations do not depend on the machine, so a collection on a
    laptop names the node ids a GPU node runs. Returns the node ids dropped; `runs` lists them."""
    read_record(path)  # a malformed record is named before the collection's minute, and again under the lock
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    suite = {line.strip() for line in out.stdout.splitlines() if "::" in line}
    if out.returncode != 0 or not suite:
        raise SystemExit(f"prune: pytest could not collect the suite (exit {out.returncode}); fix the collection "
                         f"error first:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    with locked(path):
        return _prune(path, read_record(path), suite)


def _prune(path: Path, record: dict, suite: set[str]) -> list[str]:
    tests = record.get("tests") or {}
    gone = sorted(t["nodeid"] for t in tests.get("tests", []) if t["nodeid"] not in suite)
    if gone:
        tests["tests"] = [t for t in tests["tests"] if t["nodeid"] in suite]
        tests["not_run"] = [n for n in tests.get("not_run", []) if n in suite]
        if not tests["not_run"]:
            tests.pop("not_run", None)
            tests.pop("not_run_reason", None)
        tests["counts"] = {}
        for t in tests["tests"]:
            tests["counts"][t["outcome"]] = tests["counts"].get(t["outcome"], 0) + 1
        if tests.get("not_run"):
            tests["counts"]["not run"] = len(tests["not_run"])
        record.setdefault("runs", []).append({"run": "prune", "part": "tests",
                                              "ended": f"dropped the records of {len(gone)} tests the suite no "
                                                       f"longer has: {', '.join(n[:200] for n in gone)}"})
        write_json_atomic(path, record)
    return gone


def refresh() -> int:
    """The committed records' times and peaks written where a learner reads them: each notebook's header (built
    from its source), README.md's hardware matrix, docs/INSTRUCTOR.md's schedule and memory tables."""
    from record.notebooks import build_all
    from record.refresh import refresh_tables

    for nb in build_all():  # each file replaced whole: a plain write under a full disk cut a notebook
        print(f"[check] built {nb.relative_to(REPO)}")
    for doc in (REPO / "README.md", REPO / "docs" / "INSTRUCTOR.md"):
        text = doc.read_text(encoding="utf-8")
        if (new := refresh_tables(text)) != text:
            write_text_atomic(doc, new)
            print(f"[check] rewrote {doc.relative_to(REPO)}")
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line naming the value and the fix, instead of the usage text; exit 2 as argparse
        print(f"check.py: {message}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except RecordError as exc:  # a malformed record, or one that could not be written: one line, not a traceback
        print(f"check.py: {exc}", file=sys.stderr)
        return 2


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = _Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=["tests", "notebooks", "refresh", "merge", "prune"])
    ap.add_argument("--from", dest="source", type=Path, help="merge: a record made on another machine (a GPU node's)")
    ap.add_argument("--run", help="merge: the name its items and its `runs` entry get, e.g. S")
    ap.add_argument("--ended", help="merge: how the run ended, in words (default: its counts)")
    ap.add_argument("--json", default=None, help="the record to write (default results/runs/check.json)")
    ap.add_argument("--notebooks", default="", help="numbers in order, e.g. 00,03 (default: all); '+' separates "
                    "lanes that run at the same time, e.g. 01,03+05,00")
    ap.add_argument("--budget-s", type=float, default=3600.0)
    ap.add_argument("--parallel", type=int, default=1, help="tests: pytest processes at once, one for the slow and "
                    "gpu tiers and the rest for the other tests, split by file (e.g. 8 on a 16-core GPU node)")
    ap.add_argument("--per-file", action="store_true", help="tests: the first lane runs each test file in a pytest "
                    "process of its own (a GPU node: what one file's engines keep does not starve the next file's)")
    ap.add_argument("--resume", action="store_true", help="leave out the tests the record already holds for the "
                    "package as it is now, or the notebooks it holds as completed with this package at their sources "
                    "(go on where a call's time limit cut the last run)")
    a = ap.parse_args(argv)
    if a.part == "refresh":
        return refresh()
    if a.part == "prune":
        if not (a.json and Path(a.json).is_file()):
            ap.error(f"prune needs --json naming a record that exists (got {a.json}); e.g. --json results/gpu_check.json")
        gone = prune(Path(a.json))
        print(f"[check] pruned {len(gone)} records of tests the suite no longer has from {a.json}"
              + "".join(f"\n  {n[:200]}" for n in gone))
        return 0
    if a.part == "merge":
        if not (a.json and a.source and a.run):
            ap.error("merge needs --json (the record to update), --from (the other machine's record) and --run")
        if not a.source.is_file():
            ap.error(f"--from {a.source}: no such record; give the JSON the other machine wrote")
        fix = "give the JSON scripts/check.py wrote there"
        src = check_shape(load_record(a.source, fix=fix), f"--from {a.source}", fix)  # every item, before a write
        if not any((src.get(part) or {}).get(part) for part in ("tests", "notebooks")):
            ap.error(f"--from {a.source}: no tests or notebooks in it; {fix}")
        _, folded = merge_from(Path(a.json), a.source, a.run, a.ended)
        print(f"[check] run {a.run} -> {a.json}: " + ("; ".join(f"{r['part']} {r['ended']}" for r in folded) or
              "nothing new (every item in it is in the record already)"))
        return 0
    if a.budget_s != a.budget_s or a.budget_s <= 0:
        ap.error(f"--budget-s {a.budget_s}: give a positive number of seconds")
    if a.parallel < 1:
        ap.error(f"--parallel {a.parallel}: give 1 (one pytest process) or more")
    if a.parallel > 1 and any(x == "-m" or x.startswith("-m") and not x.startswith("--") for x in extra):
        ap.error(f"--parallel {a.parallel} picks each process's -m itself (the slow tier in one, the rest in the "
                 "others); drop -m after --, or run with --parallel 1")
    from colo_kit.paths import runs_dir

    path = Path(a.json) if a.json else runs_dir() / "check.json"
    probe = path.parent
    probe.mkdir(parents=True, exist_ok=True)
    if not os.access(probe, os.W_OK):
        ap.error(f"--json {path}: {probe} is not writable; pick a writable path")
    record = read_record(path)  # a malformed record is named now, not after the run it would have lost
    if a.part == "tests":
        done = set()
        if a.resume and path.exists():
            # by the package a test ran, not the commit: a later commit that changed only tests, scripts or results
            # keeps what the earlier calls of the check recorded (the same rule as the records' own test)
            part, kit = record.get("tests") or {}, kit_digest()
            done = {t["nodeid"] for t in part.get("tests") or [] if t.get("kit_sha256") == kit}
            print(f"[check] --resume: {len(done)} tests already recorded with this package ({kit})", flush=True)
        result = run_tests(extra, a.budget_s, a.parallel, done, per_file=a.per_file)
    else:
        lanes = [[n.strip() for n in lane.split(",") if n.strip()] for lane in a.notebooks.split("+")]
        lanes, numbers = [lane for lane in lanes if lane] or None, sorted(_notebook_numbers())
        unknown = [n for lane in lanes or [] for n in lane if n not in numbers]
        if unknown:
            ap.error(f"--notebooks {','.join(unknown)}: no such notebook; use numbers from {numbers}")
        if a.resume and path.exists():
            done = notebooks_done(path)
            lanes = [[n for n in lane if n not in done] for lane in lanes or [numbers]]
            lanes = [lane for lane in lanes if lane]
            print(f"[check] --resume: notebooks {','.join(sorted(done)) or 'none'} already completed with this "
                  "package at their sources", flush=True)
            if not lanes:
                print(f"[check] notebooks: nothing left to run -> {path}")
                return 0
        result = run_notebooks(lanes, path.with_suffix(""), a.budget_s)
    left = gpu_left_after()
    if left is not None:
        result["gpu_left_after"] = left
        for p in left:
            print(f"[check] still on the GPU 60 s after the {a.part} ended: pid {p['pid']}, {p['gib']} GiB, "
                  f"{p['name']}", flush=True)
    record = merge(path, a.part, result)
    part = record[a.part]
    if a.part == "tests":
        print(f"[check] tests: {part['counts']} in {result['seconds']} s -> {path}")
        bad = part["counts"].get("failed", 0) + part["counts"].get("error", 0)
    else:
        # this run's notebooks: one it did not run leaves an earlier completed record in place, and still counts here
        bad = sum(n["status"] != "completed" for n in result["notebooks"])
        held = sum(n["status"] == "completed" for n in part["notebooks"])
        print(f"[check] notebooks: {len(result['notebooks']) - bad} of {len(result['notebooks'])} completed this run "
              f"({held} of {len(part['notebooks'])} completed in the record) -> {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
