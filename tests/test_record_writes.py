"""The lab record never loses data. The scripts that write committed files (results/*.json, the notebooks, README.md,
docs/) write a file whole or not at all, merge one process at a time, check what they were given before they write
anything, refuse bad arguments before anything runs, and never let a failed or empty run replace a record
(record/store.py is the one mechanism).

Every test works on copies in tmp_path: COLO_KIT_RESULTS points results/ there, and `refresh` is pointed at copies
of the notebooks, README.md and docs/. Nothing here starts vLLM or trains: each case fails before that, or the part
that would is stood in for.
"""

import json
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import clean_env, load_script

from colo_kit.paths import REPO_ROOT

H100 = {"gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3"}]}


def _env(tmp_path) -> dict:
    return {**clean_env(), "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
            "COLO_KIT_RESULTS": str(tmp_path / "results")}


def _file_size_limit(limit: int):
    """A child's preexec_fn: files it writes stop at `limit` bytes, as on a full disk. SIGXFSZ ignored, so the write
    that crosses the limit fails with EFBIG instead of killing the process (Python ignores it too; said here)."""
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


def _code(main, argv) -> int:
    """A script's exit code from its main, returned or raised."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def _one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def _big_record(n: int = 700) -> dict:
    """A check record of more than 64 KB, with the shape scripts/check.py writes."""
    tests = [{"nodeid": f"tests/test_x.py::test_{i}[{'p' * 40}]", "outcome": "passed", "seconds": 1.5, "commit": "a" * 40,
              "machine": "1×H100"} for i in range(n)]
    return {"env": H100, "runs": [{"run": "A"}], "tests": {"commit": "a" * 40, "counts": {"passed": n}, "tests": tests},
            "notebooks": {"notebooks": [{"notebook": "00_quickstart", "status": "completed", "seconds": 91.0}]}}


def _brought_back(*notebooks: str, env=H100) -> dict:
    return {"env": env, "notebooks": {"commit": "b" * 40, "seconds": 10.0, "notebooks": [
        {"notebook": name, "status": "completed", "seconds": 5.0, "commit": "b" * 40} for name in notebooks]}}


# ---------------------------------------------------------------------------------------------
# 1. a full disk mid-write: the file stays whole
# ---------------------------------------------------------------------------------------------

def test_a_merge_cut_by_a_full_disk_leaves_the_record_whole(tmp_path):
    """`prlimit --fsize=65536 check.py merge ...` cut results/gpu_check.json at 64 KB, no longer JSON. Now the new
    record goes to a temp file first: the limit fails that, the record stays as it was, no temp file is left, and
    the error is one line naming the record."""
    record = tmp_path / "results" / "gpu_check.json"
    record.parent.mkdir()
    record.write_text(json.dumps(_big_record(), indent=1) + "\n")
    assert record.stat().st_size > 65536
    one = tmp_path / "one.json"
    one.write_text(json.dumps(_brought_back("03_tp_tuning")))
    before = record.read_text()
    proc = subprocess.run([sys.executable, "scripts/check.py", "merge", "--json", str(record), "--from", str(one),
                           "--run", "Z"], cwd=REPO_ROOT, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=120, preexec_fn=_file_size_limit(65536))
    assert record.read_text() == before, f"the record was changed: {len(record.read_text())} bytes now"
    assert proc.returncode != 0
    assert str(record) in _one_line(proc.stderr) and "not written" in proc.stderr
    assert sorted(p.name for p in record.parent.iterdir()) == ["gpu_check.json"]  # no temp file left behind
    # without the limit the same merge goes through
    proc = subprocess.run([sys.executable, "scripts/check.py", "merge", "--json", str(record), "--from", str(one),
                           "--run", "Z"], cwd=REPO_ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    notebooks = {n["notebook"]: n.get("run") for n in json.loads(record.read_text())["notebooks"]["notebooks"]}
    assert notebooks == {"00_quickstart": None, "03_tp_tuning": "Z"}


REFRESH = r"""
import importlib.util, pathlib, sys
root = pathlib.Path(sys.argv[2])
spec = importlib.util.spec_from_file_location("check", sys.argv[1])
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)
import record.notebooks
check.REPO, record.notebooks.NOTEBOOKS = root, root / "notebooks"  # copies, never the committed files
sys.exit(check.main(["refresh"]))
"""


def test_a_refresh_cut_by_a_full_disk_leaves_the_notebook_whole(tmp_path):
    """`check.py refresh` rewrites the notebooks, README.md and docs/INSTRUCTOR.md; under a file-size limit it cut
    notebooks/00_quickstart.ipynb. Now the notebook stays as it was; without the limit it is rebuilt from its
    source."""
    from record.notebooks import SOURCES, notebook_text

    root = tmp_path / "repo"
    (root / "notebooks").mkdir(parents=True)
    (root / "docs").mkdir()
    for doc in ("README.md", "docs/INSTRUCTOR.md"):
        (root / doc).write_text((REPO_ROOT / doc).read_text())
    nb = root / "notebooks" / "00_quickstart.ipynb"
    stale = (REPO_ROOT / "notebooks" / "00_quickstart.ipynb").read_text().rstrip("\n") + " \n"  # differs: rewritten
    nb.write_text(stale)
    limit = 8192
    assert len(notebook_text(SOURCES / "00_quickstart.py")) > limit
    cmd = [sys.executable, "-c", REFRESH, str(REPO_ROOT / "scripts" / "check.py"), str(root)]
    env = {k: v for k, v in _env(tmp_path).items() if k != "COLO_KIT_RESULTS"}  # the headers read the records
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
                          preexec_fn=_file_size_limit(limit))
    assert nb.read_text() == stale, f"the notebook was changed: {len(nb.read_text())} bytes now"
    assert proc.returncode != 0 and str(nb) in _one_line(proc.stderr)
    assert not [p.name for p in nb.parent.iterdir() if p.name.startswith(".")]  # no temp file left behind
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert nb.read_text() == notebook_text(SOURCES / "00_quickstart.py")


# ---------------------------------------------------------------------------------------------
# 2. two merges at once
# ---------------------------------------------------------------------------------------------

MERGE_AT_GO = r"""
import importlib.util, pathlib, sys, time
spec = importlib.util.spec_from_file_location("check", sys.argv[1])
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)
import colo_kit.env, colo_kit_cli.notebooks  # what a merge imports: only the merge itself runs after the gate
ready, go = pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
ready.write_text("ready")
while not go.exists():
    time.sleep(0.01)
sys.exit(check.main(sys.argv[4:]))
"""


def test_merges_at_the_same_time_lose_no_item(tmp_path):
    """Two `check.py merge` runs at once lost 2 of 10 items: each read the record, added its items and wrote it over
    the other's. Five merges of two notebooks each, held at a gate until all five are ready and then let go
    together, into a record big enough that their reads and writes overlap: all ten items and five runs are there."""
    record = tmp_path / "results" / "gpu_check.json"
    record.parent.mkdir()
    record.write_text(json.dumps(_big_record(6000), indent=1) + "\n")
    go, procs = tmp_path / "go", []
    names = []
    for i in range(5):
        src = tmp_path / f"device{i}" / "gpu_check.json"
        src.parent.mkdir()
        pair = [f"{i}{j}_nb" for j in "ab"]
        names += pair
        src.write_text(json.dumps(_brought_back(*pair)))
        procs.append(subprocess.Popen(
            [sys.executable, "-c", MERGE_AT_GO, str(REPO_ROOT / "scripts" / "check.py"), str(tmp_path / f"ready{i}"),
             str(go), "merge", "--json", str(record), "--from", str(src), "--run", f"R{i}"],
            cwd=REPO_ROOT, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready{i}").exists() for i in range(5)):
            assert time.monotonic() < deadline, "the merges did not reach the gate within 120 s"
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
            time.sleep(0.05)
        go.write_text("go")
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * 5, outs
    rec = json.loads(record.read_text())
    have = {n["notebook"] for n in rec["notebooks"]["notebooks"]}
    assert set(names) <= have, f"lost {sorted(set(names) - have)}"
    assert sorted(r["run"] for r in rec["runs"][1:]) == [f"R{i}" for i in range(5)]
    assert len(rec["tests"]["tests"]) == 6000


# ---------------------------------------------------------------------------------------------
# 3. a brought-back record is checked before anything is written
# ---------------------------------------------------------------------------------------------

def test_a_brought_back_item_without_a_name_is_refused_before_anything_is_written(tmp_path, capsys):
    """An item without "nodeid"/"notebook" was written into the record, and a KeyError came after. Now the whole
    brought-back record is checked first: one line naming it and the item, exit 2, the record untouched."""
    check = load_script("scripts/check.py")
    mine = tmp_path / "gpu_check.json"
    mine.write_text(json.dumps(_big_record(3), indent=1) + "\n")
    good_test = {"nodeid": "t::new", "outcome": "passed", "commit": "b" * 40}
    for part, nameless in (("notebooks", {"status": "completed", "seconds": 3.0, "commit": "b" * 40}),
                           ("tests", {"outcome": "passed", "commit": "b" * 40})):
        there = tmp_path / f"brought_{part}.json"
        src = _brought_back("03_tp_tuning")
        src["tests"] = {"commit": "b" * 40, "tests": [good_test]}
        src[part][part].append(nameless)
        there.write_text(json.dumps(src))
        before = mine.read_text()
        assert _code(check.main, ["merge", "--json", str(mine), "--from", str(there), "--run", "Q"]) == 2
        line = _one_line(capsys.readouterr().err)
        name = "nodeid" if part == "tests" else "notebook"
        assert str(there) in line and f'{part} item 1 has no "{name}"' in line, line
        assert mine.read_text() == before


# ---------------------------------------------------------------------------------------------
# 4. bad arguments refused before anything runs; a failed or empty run replaces no record
# ---------------------------------------------------------------------------------------------

def _never(*args, **kwargs):
    raise AssertionError("the run started although its arguments were bad")


@pytest.mark.parametrize("name, argv, said", [
    ("server_node", ["--timeout-s", "nan"], "--timeout-s nan"), ("server_node", ["--timeout-s", "-5"], "--timeout-s -5"),
    ("server_node", ["--timeout-s", "inf"], "--timeout-s inf"), ("server_node", ["--steps", "0"], "--steps 0"),
    ("two_machines", ["--parts", ""], "--parts ''"), ("two_machines", ["--parts", "ddp,bogus"], "--parts ddp,bogus"),
    ("two_machines", ["--timeout-s", "nan"], "--timeout-s nan"), ("two_machines", ["--timeout-s", "-5"], "--timeout-s -5")])
def test_the_drive_scripts_refuse_bad_arguments_before_anything_runs(name, argv, said, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLO_KIT_RESULTS", str(tmp_path / "results"))
    script = load_script(f"scripts/{name}.py")
    monkeypatch.setattr(script, "drive", _never)
    assert _code(script.main, argv) == 2
    assert _one_line(capsys.readouterr().err).startswith(f"scripts/{name}.py: {said}:")


def test_a_failed_server_node_run_replaces_no_record(tmp_path, monkeypatch, capsys):
    """`server_node.py --timeout-s 1` replaced results/server_node_cpu.json with an error record. The vLLM node is
    stood in for by one that never answers (what 1 s gives): the committed record stays, by default and when named
    with --out; the failed run's record goes to results/runs/."""
    import colo_kit.serving.server

    results = tmp_path / "results"
    monkeypatch.setenv("COLO_KIT_RESULTS", str(results))
    committed = results / "server_node_cpu.json"
    committed.parent.mkdir()
    committed.write_text(json.dumps({"status": "ok", "summary": "the committed run"}, indent=1) + "\n")
    before = committed.read_text()

    def no_answer(*args, **kwargs):
        raise TimeoutError("the server did not answer /health within 1 s")

    monkeypatch.setattr(colo_kit.serving.server, "start_server", no_answer)
    script = load_script("scripts/server_node.py")
    for argv in (["--timeout-s", "1"], ["--timeout-s", "1", "--out", str(committed)]):
        assert script.main(argv) == 1
        assert committed.read_text() == before, argv
        failed = json.loads((results / "runs" / "server_node_cpu.json").read_text())
        assert failed["status"] == "error" and "1 s" in failed["error"]
        assert "results/runs/server_node_cpu.json" in capsys.readouterr().out


@pytest.mark.parametrize("status", ["error", "not run"])
def test_a_failed_or_empty_two_machines_run_replaces_no_record(status, tmp_path, monkeypatch, capsys):
    """A run whose parts failed, or ran none (DeepSpeed missing: zero3 "not run"), leaves the committed
    results/two_machines_cpu.json as it was, by default and when named with --out."""
    results = tmp_path / "results"
    monkeypatch.setenv("COLO_KIT_RESULTS", str(results))
    committed = results / "two_machines_cpu.json"
    committed.parent.mkdir()
    committed.write_text(json.dumps({"parts": {"ddp": {"status": "ok"}}}, indent=1) + "\n")
    before = committed.read_text()
    script = load_script("scripts/two_machines.py")
    monkeypatch.setattr(script, "run_part", lambda part, work, timeout_s: {
        "part": part, "status": status, "why": "stood in", "returncodes": [1, 1], "ranks": []})
    for argv in (["--parts", "zero3"], ["--parts", "zero3", "--out", str(committed)]):
        assert script.main(argv) == 1  # failed, or nothing measured
        assert committed.read_text() == before, argv
        assert json.loads((results / "runs" / "two_machines_cpu.json").read_text())["parts"]["zero3"]["status"] == status
        capsys.readouterr()


def test_router_compare_refuses_unknown_parts_on_the_command_line(tmp_path):
    """`router_compare.py --parts bogus` ran no part and wrote its record over results/router_vs_proxy_cpu.json."""
    results = tmp_path / "results"
    results.mkdir()
    committed = results / "router_vs_proxy_cpu.json"
    committed.write_text(json.dumps({"stub": {"latency": {}}, "vllm_router": {"version": "0.1.17"}}, indent=1) + "\n")
    before = committed.read_text()
    for parts in ("bogus", "", "stub,bogus"):
        proc = subprocess.run([sys.executable, "scripts/router_compare.py", "--router-bin", "/nonexistent",
                               "--parts", parts], cwd=REPO_ROOT, env=_env(tmp_path), capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2, (parts, proc.stdout, proc.stderr)
        assert f"--parts {parts or repr(parts)}:" in _one_line(proc.stderr)
        assert committed.read_text() == before


@pytest.mark.parametrize("argv, said", [(["--stub-rate", "nan"], "--stub-rate nan"),
                                        (["--vllm-seconds", "-5"], "--vllm-seconds -5")])
def test_router_compare_refuses_bad_numbers_before_anything_runs(argv, said, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLO_KIT_RESULTS", str(tmp_path / "results"))
    script = load_script("scripts/router_compare.py")
    monkeypatch.setattr(script, "stub_part", _never)
    monkeypatch.setattr(script, "vllm_part", _never)
    assert _code(script.main, ["--router-bin", "/nonexistent", "--parts", "stub", *argv]) == 2
    assert _one_line(capsys.readouterr().err).startswith(f"scripts/router_compare.py: {said}:")


def test_a_failed_router_compare_run_replaces_no_record(tmp_path, monkeypatch, capsys):
    results = tmp_path / "results"
    monkeypatch.setenv("COLO_KIT_RESULTS", str(results))
    committed = results / "router_vs_proxy_cpu.json"
    committed.parent.mkdir()
    committed.write_text(json.dumps({"stub": {"latency": {}}, "vllm": {"workloads": {}}}, indent=1) + "\n")
    before = committed.read_text()
    script = load_script("scripts/router_compare.py")

    def broken(*args, **kwargs):
        raise RuntimeError("the stand-in replicas did not start")

    monkeypatch.setattr(script, "stub_part", broken)
    for argv in ([], ["--out", str(committed)]):
        assert script.main(["--router-bin", "/nonexistent", "--parts", "stub", *argv]) == 1
        assert committed.read_text() == before, argv
        failed = json.loads((results / "runs" / "router_vs_proxy_cpu.json").read_text())
        assert "did not start" in failed["stub"]["error"]
        assert failed["vllm"] == {"workloads": {}}  # the part not run keeps the committed numbers
        shutil.rmtree(failed["logs"], ignore_errors=True)  # the folder the script made for the parts' logs
        capsys.readouterr()


# ---------------------------------------------------------------------------------------------
# 5. a notebook that did not run never replaces one that did
# ---------------------------------------------------------------------------------------------

def test_a_notebook_the_budget_left_out_keeps_its_completed_record(tmp_path, capsys):
    """A budget too small for a notebook made its completed record "not run". Now the completed record stays and
    the part names what it left out; the exit code still says the run did not complete what it was asked."""
    check = load_script("scripts/check.py")
    path = tmp_path / "gpu_check.json"
    done = {"notebook": "00_quickstart", "status": "completed", "seconds": 91.0, "commit": "c" * 40, "run": "AB"}
    path.write_text(json.dumps({"notebooks": {"notebooks": [done]}}))
    assert check.main(["notebooks", "--json", str(path), "--notebooks", "00,01", "--budget-s", "30"]) == 1
    part = json.loads(path.read_text())["notebooks"]
    by_name = {n["notebook"]: n for n in part["notebooks"]}
    assert by_name["00_quickstart"] == done
    assert by_name["01_ping_pong"]["status"] == "not run"  # nothing was there: the record shows it was selected
    assert part["not_run"] == ["00_quickstart"] and "budget" in part["not_run_reason"]
    assert "0 of 2 completed" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# 6. a malformed record is named in one line
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, said", [("{\"tests\": {", "not JSON"), ("[1, 2]", "a JSON list"),
                                        ('{"notebooks": []}', '"notebooks" is a list'),
                                        ('{"tests": {"tests": [{"outcome": "passed"}]}}', 'tests item 0 has no "nodeid"')])
def test_a_malformed_record_is_named_in_one_line(text, said, tmp_path, capsys):
    check = load_script("scripts/check.py")
    bad = tmp_path / "gpu_check.json"
    bad.write_text(text)
    one = tmp_path / "one.json"
    one.write_text(json.dumps(_brought_back("03_tp_tuning")))
    for argv in (["merge", "--json", str(bad), "--from", str(one), "--run", "Z"],  # the record
                 ["merge", "--json", str(tmp_path / "new.json"), "--from", str(bad), "--run", "Z"],  # brought back
                 ["notebooks", "--json", str(bad), "--resume", "--budget-s", "30"],
                 ["tests", "--json", str(bad), "--resume", "--budget-s", "30"],
                 ["prune", "--json", str(bad)]):
        assert _code(check.main, argv) == 2, argv
        line = _one_line(capsys.readouterr().err)
        assert str(bad) in line and said in line, (argv, line)
        assert bad.read_text() == text and not (tmp_path / "new.json").exists()


def test_router_compare_names_a_malformed_record_in_one_line(tmp_path):
    out = tmp_path / "results" / "router_vs_proxy_cpu.json"
    out.parent.mkdir()
    out.write_text('{"stub": ')
    proc = subprocess.run([sys.executable, "scripts/router_compare.py", "--router-bin", "/nonexistent", "--parts",
                           "stub", "--out", str(out)], cwd=REPO_ROOT, env=_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and str(out) in _one_line(proc.stderr) and "not JSON" in proc.stderr
    assert out.read_text() == '{"stub": '
