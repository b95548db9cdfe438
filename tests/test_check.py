"""scripts/check.py: what a notebook's record says about memory is the peak of its whole process tree (the
kernel and what it started), not of the process the check launched."""

import os
import subprocess
import sys
import time

import psutil
import pytest

from conftest import load_script

# Holds `mb` MB of touched memory, starts the next script if one is given, says it is ready once its memory (and
# its child's) is held, then waits on stdin.
HOLD = """
import pathlib, subprocess, sys, time
mb, ready, nxt = int(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3:]
block = bytearray(mb * 2**20)
for i in range(0, len(block), 4096):
    block[i] = 1
child = subprocess.Popen([sys.executable, *nxt], stdin=subprocess.PIPE) if nxt else None
while child and not pathlib.Path(nxt[2]).exists():
    assert child.poll() is None, "the child died"
    time.sleep(0.02)
ready.touch()
sys.stdin.read()
if child:
    child.stdin.close()
    child.wait()
"""


class _Ticks:
    """`done` for the sampler: not done for `n` samples, then done; no clock involved."""

    def __init__(self, n):
        self.n = n

    def wait(self, _timeout):
        self.n -= 1
        return self.n < 0


def test_peak_memory_sums_the_whole_process_tree(tmp_path):
    check = load_script("scripts/check.py")
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    ready = tmp_path / "parent.ready"
    proc = subprocess.Popen([sys.executable, str(script), "300", str(ready),
                             str(script), "200", str(tmp_path / "child.ready")], stdin=subprocess.PIPE)
    try:
        deadline = time.time() + 60
        while not ready.exists():  # the parent says so once both hold their memory
            assert proc.poll() is None and time.time() < deadline, "the processes did not get ready"
            time.sleep(0.05)
        peaks = {}
        check._sample_peaks(proc.pid, _Ticks(3), peaks, interval_s=0)
        own = psutil.Process(proc.pid).memory_info().rss / 2**30
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    assert own > 0.28  # the parent alone: its 300 MB
    assert peaks["peak_rss_gib"] >= own + 0.18  # and its child's 200 MB on top


FAST_AND_SLOW = """
import pytest


def test_fast_{n}():
    assert True


@pytest.mark.slow
def test_slow_{n}():
    assert True


@pytest.mark.gpu
def test_gpu_{n}():
    assert True
"""


def test_parallel_tests_run_the_slow_tier_in_one_lane_and_split_the_rest_by_file(tmp_path):
    """`check.py tests --parallel 3`: one pytest process for the slow and gpu tiers (engines never start side by
    side), the other tests split by file over the other two, every test recorded once with its lane."""
    files = []
    for n in ("a", "b"):
        f = tmp_path / f"test_lane_{n}.py"
        f.write_text(FAST_AND_SLOW.replace("{n}", n))
        files.append(str(f))
    record = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, "scripts/check.py", "tests", "--json", str(record), "--parallel", "3",
                           "--", "-p", "no:cacheprovider", *files], cwd=load_script("scripts/check.py").REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json

    tests = json.loads(record.read_text())["tests"]["tests"]
    lanes = {t["nodeid"].rsplit("/", 1)[-1]: t["lane"] for t in tests}
    assert len(tests) == len(lanes) == 6 and all(t["outcome"] == "passed" for t in tests)
    assert lanes["test_lane_a.py::test_slow_a"] == lanes["test_lane_b.py::test_slow_b"] == 0
    assert lanes["test_lane_a.py::test_gpu_a"] == lanes["test_lane_b.py::test_gpu_b"] == 0
    assert {lanes["test_lane_a.py::test_fast_a"], lanes["test_lane_b.py::test_fast_b"]} == {1, 2}
    bad = subprocess.run([sys.executable, "scripts/check.py", "tests", "--json", str(record), "--parallel", "0"],
                         cwd=load_script("scripts/check.py").REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--parallel 0: give 1" in bad.stderr
    before = record.read_text()
    marked = subprocess.run([sys.executable, "scripts/check.py", "tests", "--json", str(record), "--parallel", "2",
                             "--", "-m", "gpu", *files], cwd=load_script("scripts/check.py").REPO,
                            capture_output=True, text=True, timeout=60)
    assert marked.returncode == 2 and "drop -m after --" in marked.stderr
    assert record.read_text() == before  # a refused run writes nothing


# Starts a child in a session of its own, as jupyter_client starts a notebook's kernel, writes its pid, then waits.
KERNEL_LIKE = """
import pathlib, subprocess, sys, time
kernel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
pathlib.Path(sys.argv[1]).write_text(str(kernel.pid))
time.sleep(120)
"""


@pytest.mark.slow  # a pytest or a kernel of its own, cut by a real time budget
def test_a_notebook_the_budget_cuts_is_recorded_as_cut_not_as_failed_and_leaves_no_kernel_behind(tmp_path,
                                                                                                  monkeypatch):
    """A notebook still running when the call's time budget ends is killed; its record says it was cut, so a
    reader does not look for an error that never happened. The kill is real and reaches the kernel, which
    jupyter_client starts in a session of its own: a kernel left alive holds its engine's GPU memory."""
    check = load_script("scripts/check.py")
    real_run = check._run
    script, pid_file = tmp_path / "kernel_like.py", tmp_path / "kernel.pid"
    script.write_text(KERNEL_LIKE)

    def cut(cmd, left, peaks, **kw):
        return real_run([sys.executable, str(script), str(pid_file)], 8, peaks, **kw)  # time to write its pid

    monkeypatch.setattr(check, "_run", cut)
    rec = check.run_notebooks([["04"]], tmp_path / "html", budget_s=100)["notebooks"][0]
    assert rec["status"].startswith("cut by the time budget ("), rec
    assert rec["seconds"] < 60 and "error_tail" not in rec
    kernel = psutil.Process(int(pid_file.read_text())) if pid_file.exists() else None
    left = kernel is not None and check._alive(kernel)
    if left:
        kernel.kill()
    assert kernel is not None and not left, "the cut notebook's kernel outlived it" if left else "it never started"


def test_resume_runs_only_the_tests_the_record_lacks_for_this_package(tmp_path):
    """`check.py tests --resume`: a second call goes on where the first one's budget cut the suite. A test recorded
    with this package is not run again (here it would now fail), even from another commit; a new one is, and so is
    one recorded with another package; the record ends up holding them all."""
    import json

    f = tmp_path / "test_resume.py"
    f.write_text("def test_a():\n    assert True\n\n\ndef test_b():\n    assert True\n")
    record = tmp_path / "check.json"
    repo = load_script("scripts/check.py").REPO

    def check(*extra):
        return subprocess.run([sys.executable, "scripts/check.py", "tests", "--json", str(record), *extra, "--",
                               "-p", "no:cacheprovider", str(f)], cwd=repo, capture_output=True, text=True, timeout=120)

    assert check().returncode == 0
    f.write_text("def test_a():\n    assert False\n\n\ndef test_b():\n    assert True\n\n\ndef test_c():\n    assert True\n")
    # a later commit with the same package keeps the records; one of another package (test_b's) does not
    rec = json.loads(record.read_text())
    for t in rec["tests"]["tests"]:
        t["commit"] = "c" * 40
        if t["nodeid"].endswith("::test_b"):
            t["kit_sha256"] = "0" * 16
    record.write_text(json.dumps(rec))
    proc = check("--resume")
    assert proc.returncode == 0 and "--resume: 1 tests already recorded" in proc.stdout, proc.stdout + proc.stderr
    tests = {t["nodeid"].rsplit("::", 1)[-1]: t for t in json.loads(record.read_text())["tests"]["tests"]}
    assert {n: t["outcome"] for n, t in tests.items()} == {"test_a": "passed", "test_b": "passed", "test_c": "passed"}
    assert tests["test_a"]["commit"] == "c" * 40 and tests["test_b"]["commit"] != "c" * 40  # test_b ran again
    assert check().returncode == 1  # without --resume, everything runs again: test_a now fails


@pytest.mark.slow  # a pytest or a kernel of its own, cut by a real time budget
def test_a_run_the_budget_cuts_names_the_tests_it_never_reached(tmp_path):
    """The tests a cut run selected but never recorded are listed as not run, with why; a later run that records
    them takes them off the list. The cut is real: a test that outlives the budget, killed with its pytest."""
    import json

    f = tmp_path / "test_cut.py"
    f.write_text("import time\n\n\ndef test_a():\n    assert True\n\n\ndef test_b():\n    time.sleep(600)\n\n\n"
                 "def test_c():\n    assert True\n")
    record = tmp_path / "check.json"
    repo = load_script("scripts/check.py").REPO
    scratch = tmp_path / "tmp"  # the check's temporary folder: its lane logs and resume list go, read or not
    scratch.mkdir()

    def check(*extra, budget="20"):
        return subprocess.run([sys.executable, "scripts/check.py", "tests", "--json", str(record), "--budget-s", budget,
                               *extra, "--", "-p", "no:cacheprovider", str(f)], cwd=repo, capture_output=True,
                              text=True, timeout=120, env=dict(os.environ, TMPDIR=str(scratch)))

    check()
    assert not list(scratch.iterdir())
    tests = json.loads(record.read_text())["tests"]
    assert {t["nodeid"].rsplit("::", 1)[-1]: t["outcome"] for t in tests["tests"]} == {"test_a": "passed"}
    assert [n.rsplit("::", 1)[-1] for n in tests["not_run"]] == ["test_b", "test_c"], tests
    assert tests["not_run_reason"] == "cut by the 20 s budget before they ran" and tests["counts"]["not run"] == 2
    f.write_text(f.read_text().replace("time.sleep(600)", "assert True"))
    proc = check("--resume", budget="120")
    tests = json.loads(record.read_text())["tests"]
    assert proc.returncode == 0 and "not_run" not in tests and "not run" not in tests["counts"], proc.stdout
    assert sorted(t["nodeid"].rsplit("::", 1)[-1] for t in tests["tests"]) == ["test_a", "test_b", "test_c"]
    assert not list(scratch.iterdir())


def test_on_a_gpu_node_each_test_of_the_gpu_lane_records_the_gpu_left_free(tmp_path, monkeypatch):
    """On a GPU node the first lane records, after each test's teardown, what the GPU has free: the test that leaves
    an engine behind shows itself. This machine has no GPU: `has_cuda` is stood in for, so the value is None here
    (NVML answers nothing) and the GPU check's device run records the real one; what is checked is that the
    reading joins its test's record and adds no record of its own."""
    import colo_kit.env

    f = tmp_path / "test_mem.py"
    f.write_text("def test_a():\n    assert True\n\n\ndef test_b():\n    assert False\n")
    monkeypatch.setattr(colo_kit.env, "has_cuda", lambda: True)
    result = load_script("scripts/check.py").run_tests(["-p", "no:cacheprovider", str(f)], budget_s=120)
    assert sorted((t["nodeid"].rsplit("::", 1)[-1], t["outcome"]) for t in result["tests"]) == \
        [("test_a", "passed"), ("test_b", "failed")]
    assert all("gpu_free_gib_after" in t for t in result["tests"]), result["tests"]


def test_the_kit_digest_follows_the_package_code_only_and_each_item_carries_it(tmp_path):
    """Two checks ran one version of the kit when their items carry one digest: it changes with any package module
    (content or name) and not with anything else, and `merge` stamps it on every item it writes."""
    import json

    check = load_script("scripts/check.py")
    pkg = tmp_path / "colo_kit" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("X = 1\n")
    first = check.kit_digest(tmp_path)
    (tmp_path / "colo_kit" / "notes.md").write_text("not code\n")
    (tmp_path / "README.md").write_text("outside\n")
    assert check.kit_digest(tmp_path) == first
    (pkg / "a.py").write_text("X = 2\n")
    assert check.kit_digest(tmp_path) != first
    (pkg / "a.py").write_text("X = 1\n")
    (pkg / "a.py").rename(pkg / "b.py")
    assert check.kit_digest(tmp_path) != first
    record = check.merge(tmp_path / "check.json", "tests", {"tests": [{"nodeid": "t::a", "outcome": "passed"}]})
    assert record["tests"]["tests"][0]["kit_sha256"] == check.kit_digest() != first
    assert json.loads((tmp_path / "check.json").read_text()) == record


def test_the_record_names_the_cpu_model_and_its_widest_vector_isa(tmp_path):
    """Two 2-core CPUs gave notebook 00 different rewards and times: a record says which CPU it ran on."""
    check = load_script("scripts/check.py")
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse4_2 avx avx2 fma\n\n"
                    "processor\t: 1\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse4_2 avx avx2 fma\n")
    assert check.cpu_of(info) == {"cpu_model": "AMD EPYC 9R14", "cpu_isa": "avx2"}
    info.write_text("model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: avx avx2 avx512f avx512bw\n")
    assert check.cpu_of(info) == {"cpu_model": "Intel(R) Xeon(R) Platinum 8480+", "cpu_isa": "avx512f"}
    assert check.cpu_of(tmp_path / "absent") == {}
    record = check.merge(tmp_path / "check.json", "tests", {"tests": [{"nodeid": "t::a", "outcome": "passed"}]})
    assert record["env"]["cpu_model"] == check.cpu_of()["cpu_model"] and "cpu_isa" in record["env"]


PID_TEST = """
import os, pathlib, time


def test_{n}_first():
    pathlib.Path(r"{out}").joinpath("{n}-first").write_text(str(os.getpid()))


def test_{n}_second():
    pathlib.Path(r"{out}").joinpath("{n}-second").write_text(str(os.getpid()))
    {body}
"""


@pytest.mark.slow  # a pytest or a kernel of its own, cut by a real time budget
def test_per_file_runs_each_test_file_in_a_process_of_its_own_and_a_cut_names_the_files_never_started(tmp_path):
    """`check.py tests --per-file`: what one file's tests keep (on a GPU node, an engine's memory) ends with that
    file's pytest process. Each test writes its process id: the two tests of a file share one, two files do not.
    A file still running when the budget ends is killed and the file after it never starts; both files' remaining
    tests are listed as not run (the lane's selection was collected before the first file ran)."""
    import json

    pids = tmp_path / "pids"
    pids.mkdir()
    files = []
    for n, body in (("a", "pass"), ("b", "time.sleep(600)"), ("c", "pass")):
        f = tmp_path / f"test_pf_{n}.py"
        f.write_text(PID_TEST.format(n=n, out=pids, body=body))
        files.append(str(f))
    # a file none of whose tests is selected gets no process of its own: it is imported once, by the collection
    z = tmp_path / "test_pf_z.py"
    z.write_text(f"import os, pathlib\npathlib.Path(r'{pids}').joinpath(f'z-import-{{os.getpid()}}').touch()\n\n\n"
                 "def test_unselected():\n    pass\n")
    files.insert(0, str(z))
    record = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, "scripts/check.py", "tests", "--json", str(record), "--budget-s", "25",
                           "--per-file", "--", "-p", "no:cacheprovider", "-k", "not unselected", *files],
                          cwd=load_script("scripts/check.py").REPO, capture_output=True, text=True, timeout=180)
    tests = json.loads(record.read_text())["tests"]
    outcomes = {t["nodeid"].rsplit("::", 1)[-1]: t["outcome"] for t in tests["tests"]}
    assert outcomes == {"test_a_first": "passed", "test_a_second": "passed", "test_b_first": "passed"}, \
        proc.stdout + proc.stderr
    assert [n.rsplit("::", 1)[-1] for n in tests["not_run"]] == ["test_b_second", "test_c_first", "test_c_second"]
    assert tests["not_run_reason"] == "cut by the 25 s budget before they ran"
    assert len(list(pids.glob("z-import-*"))) == 1, sorted(p.name for p in pids.iterdir())
    pid = {p.name: p.read_text() for p in pids.iterdir() if not p.name.startswith("z-")}
    assert set(pid) == {"a-first", "a-second", "b-first", "b-second"}  # c never started
    assert pid["a-first"] == pid["a-second"] and pid["b-first"] == pid["b-second"] != pid["a-first"]
    assert "(a process per file)" in tests["command"]


def test_merge_from_folds_another_machines_record_in_and_keeps_its_machine_commit_and_html(tmp_path, capsys):
    """A GPU node's record, brought back: its items replace the same items of the committed record with the commit,
    package and machine they ran on, the rest stay (each naming the machine it ran on, which the record's `env` no
    longer says once another kind of GPU node ran), counts are recounted, its HTML comes along, `runs` names it."""
    import json

    import pytest

    check = load_script("scripts/check.py")
    mine = tmp_path / "results" / "gpu_check.json"
    mine.parent.mkdir()
    mine.write_text(json.dumps({
        "env": {"gpus": [{"index": 0, "name": "NVIDIA H200"}]}, "runs": [{"run": "A"}],
        "tests": {"commit": "a" * 40, "tests": [{"nodeid": "t::kept", "outcome": "passed", "commit": "a" * 40},
                                                {"nodeid": "t::redone", "outcome": "failed", "commit": "a" * 40}]},
        "notebooks": {"commit": "a" * 40, "notebooks": [{"notebook": "00_x", "status": "completed"}]}}))
    there = tmp_path / "device" / "gpu_check.json"
    (there.parent / "gpu_check").mkdir(parents=True)
    (there.parent / "gpu_check" / "01_y.html").write_text("<html>01</html>")
    there.write_text(json.dumps({
        "env": {"gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3"}]},
        "tests": {"commit": "b" * 40, "seconds": 9.5, "command": "pytest t", "counts": {"passed": 1},
                  "gpu_left_after": [{"pid": 7, "gib": 24.3, "name": "?"}],
                  "tests": [{"nodeid": "t::redone", "outcome": "passed", "commit": "b" * 40, "kit_sha256": "k1"},
                            {"nodeid": "t::undigested", "outcome": "passed", "commit": "b" * 40},
                            # the device's record began as a copy of this one (`--resume`): not this run's
                            {"nodeid": "t::kept", "outcome": "passed", "commit": "a" * 40}]},
        "notebooks": {"commit": "b" * 40, "notebooks": [{"notebook": "01_y", "status": "completed",
                                                         "commit": "b" * 40, "kit_sha256": "k1"},
                                                        {"notebook": "00_x", "status": "not run", "commit": "b" * 40}]}}))
    assert check.main(["merge", "--json", str(mine), "--from", str(there), "--run", "S", "--ended", "all ran"]) == 0
    rec = json.loads(mine.read_text())
    tests = {t["nodeid"]: t for t in rec["tests"]["tests"]}
    import time

    assert tests["t::redone"] == {"nodeid": "t::redone", "outcome": "passed", "commit": "b" * 40, "kit_sha256": "k1",
                                  "run": "S", "machine": "1×H100", "date": time.strftime("%Y-%m-%d", time.gmtime())}
    assert tests["t::kept"]["outcome"] == "passed" and tests["t::kept"]["commit"] == "a" * 40
    assert tests["t::kept"]["machine"] == "1×H200"  # it ran on the machine the record named before
    assert "run" not in tests["t::kept"]  # carried in the device's copy, not made by run S
    assert "kit_sha256" not in tests["t::undigested"]  # this machine's package is not the one it ran
    assert rec["tests"]["counts"] == {"passed": 3} and rec["tests"]["commit"] == "b" * 40
    assert rec["env"]["gpus"][0]["name"] == "NVIDIA H100 80GB HBM3"  # the machine the items ran on, not this one
    assert {n["notebook"]: (n.get("run"), n["machine"]) for n in rec["notebooks"]["notebooks"]} == {
        "00_x": (None, "1×H200"), "01_y": ("S", "1×H100")}
    assert (mine.parent / "gpu_check" / "01_y.html").read_text() == "<html>01</html>"
    assert [(r["run"], r.get("part"), r.get("machine"), r.get("ended")) for r in rec["runs"]] == [
        ("A", None, None, None), ("S", "tests", "1×H100", "all ran"), ("S", "notebooks", "1×H100", "all ran")]
    # what held the GPU after the part stays with the run that saw it (the part's own copy is the latest run's)
    assert rec["runs"][1]["gpu_left_after"] == [{"pid": 7, "gib": 24.3, "name": "?"}]
    assert "gpu_left_after" not in rec["runs"][2]
    # the next call's record, still holding run S's items, brings one more notebook: only that one is run T's
    after = json.loads(there.read_text())
    after["notebooks"]["notebooks"][1] = {"notebook": "00_x", "status": "failed", "seconds": 3.0, "commit": "b" * 40}
    there.write_text(json.dumps(after))
    assert check.main(["merge", "--json", str(mine), "--from", str(there), "--run", "T"]) == 0
    rec = json.loads(mine.read_text())
    assert {n["notebook"]: (n.get("run"), n["status"]) for n in rec["notebooks"]["notebooks"]} == {
        "00_x": ("T", "failed"), "01_y": ("S", "completed")}
    assert {t["nodeid"]: t.get("run") for t in rec["tests"]["tests"]} == {
        "t::kept": None, "t::redone": "S", "t::undigested": "S"}
    assert [(r["run"], r["part"], r["ended"]) for r in rec["runs"][3:]] == [("T", "notebooks", "{'00_x': 'failed'}")]
    assert check.main(["merge", "--json", str(mine), "--from", str(there), "--run", "U"]) == 0
    assert "nothing new" in capsys.readouterr().out and len(json.loads(mine.read_text())["runs"]) == 4
    # bad input: one line naming the value and the fix, exit 2, the record untouched
    before = mine.read_text()
    for bad, said in ((tmp_path / "nowhere.json", "no such record"), (mine.parent / "empty.json", "no tests")):
        if bad.name == "empty.json":
            bad.write_text("{}")
        with pytest.raises(SystemExit) as exit_:
            check.main(["merge", "--json", str(mine), "--from", str(bad), "--run", "T"])
        assert exit_.value.code == 2 and f"--from {bad}: {said}" in capsys.readouterr().err
    assert mine.read_text() == before


def test_merge_from_takes_only_the_runs_own_items_and_a_budget_cut_keeps_the_completed_record(tmp_path):
    """Each device call starts from the committed record the device tool carries, so a second call's record holds the
    committed items again even after the first call's were merged here: merged in either order, only items at the
    run's commit are the run's. A notebook the budget cut says nothing about the notebook: the completed record stays
    and the part names it in `not_run`."""
    import json

    check = load_script("scripts/check.py")
    old, new = "a" * 40, "b" * 40
    committed = {"env": {"gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3"}]}, "runs": [],
                 "notebooks": {"commit": old, "notebooks": [
                     {"notebook": n, "status": "completed", "seconds": 1.0, "commit": old} for n in ("00_x", "01_y")]}}
    mine = tmp_path / "results" / "gpu_check.json"
    mine.parent.mkdir()
    mine.write_text(json.dumps(committed))

    def call(name, made):  # the device's record: the committed one with this call's items in place
        there = tmp_path / name / "gpu_check.json"
        there.parent.mkdir()
        items = {n["notebook"]: n for n in committed["notebooks"]["notebooks"]}
        items.update({n: {"notebook": n, "status": status, "seconds": s, "commit": new} for n, status, s in made})
        there.write_text(json.dumps({**committed, "notebooks": {"commit": new, "notebooks": list(items.values())}}))
        return there

    first = call("first", [("00_x", "completed", 2.0)])
    second = call("second", [("01_y", "cut by the time budget (9 s were left when it started)", 9.0)])
    assert check.main(["merge", "--json", str(mine), "--from", str(second), "--run", "S2"]) == 0  # the later first
    rec = json.loads(mine.read_text())
    assert rec["notebooks"]["not_run"] == ["01_y"]
    assert "cut by the time budget" in rec["notebooks"]["not_run_reason"]
    assert check.main(["merge", "--json", str(mine), "--from", str(first), "--run", "S1"]) == 0
    rec = json.loads(mine.read_text())
    got = {n["notebook"]: (n["status"], n["commit"], n.get("run")) for n in rec["notebooks"]["notebooks"]}
    assert got == {"00_x": ("completed", new, "S1"), "01_y": ("completed", old, None)}


def _check_sh_argv(tmp_path, *args, **env) -> list[str]:
    """The arguments scripts/gpu/check.sh hands check.py: its interpreter is a stand-in that writes the arguments it
    got, one per line, so the shell's handling is what is under test."""
    from conftest import clean_env

    stub, out = tmp_path / "py", tmp_path / "args.txt"
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGS_OUT"\n')
    stub.chmod(0o755)
    base = {k: v for k, v in clean_env().items() if k != "OUT"}
    subprocess.run(["bash", "scripts/gpu/check.sh", *args], cwd=load_script("scripts/check.py").REPO, check=True,
                   timeout=60, env={**base, "PY": str(stub), "ARGS_OUT": str(out), **env})
    return out.read_text().splitlines()


def test_the_gpu_check_script_leaves_the_notebook_tests_to_its_notebooks_part(tmp_path):
    """scripts/gpu/check.sh's `tests` part deselects test_notebook_executes when given no pytest args (its
    `notebooks` part runs each notebook as Run All does), and passes the args it is given unchanged."""
    seen = {}
    for args in ([], ["tests/test_tp.py", "-k", "sweep"]):
        argv = _check_sh_argv(tmp_path, "tests", *args)
        seen[len(args)] = argv[argv.index("--") + 1:]
    assert seen[0] == ["-k", "not test_notebook_executes"]
    assert seen[3] == ["tests/test_tp.py", "-k", "sweep"]


@pytest.mark.slow  # a pytest or a kernel of its own, cut by a real time budget
def test_prune_drops_only_the_records_of_tests_the_suite_no_longer_has(tmp_path, capsys):
    """A merge keeps every item it does not replace, so a renamed test's old record would stay for ever, with the
    package it ran; `prune` collects the suite and drops those, and names them in `runs`."""
    import json

    import pytest

    check = load_script("scripts/check.py")
    here = "tests/test_check.py::test_prune_drops_only_the_records_of_tests_the_suite_no_longer_has"
    gone = "tests/test_check.py::test_a_test_that_was_renamed[old id]"
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps({"tests": {
        "counts": {"passed": 1, "failed": 1, "not run": 1}, "not_run": [gone], "not_run_reason": "cut",
        "tests": [{"nodeid": here, "outcome": "passed"}, {"nodeid": gone, "outcome": "failed"}]}}))
    assert check.main(["prune", "--json", str(path)]) == 0
    assert gone in capsys.readouterr().out
    rec = json.loads(path.read_text())
    assert rec["tests"]["tests"] == [{"nodeid": here, "outcome": "passed"}]
    assert rec["tests"]["counts"] == {"passed": 1} and "not_run" not in rec["tests"]
    assert rec["runs"][-1]["run"] == "prune" and gone in rec["runs"][-1]["ended"]
    before = path.read_text()
    assert check.main(["prune", "--json", str(path)]) == 0 and path.read_text() == before  # nothing more to drop
    with pytest.raises(SystemExit) as exit_:
        check.main(["prune", "--json", str(tmp_path / "nowhere.json")])
    assert exit_.value.code == 2 and "nowhere.json" in capsys.readouterr().err


def test_resume_runs_only_the_notebooks_not_completed_with_this_package_at_their_sources(tmp_path, capsys):
    """`check.py notebooks --resume`: a notebook is done only when the record holds it completed, with this package
    and its source as they are now, and its HTML beside the record; the others run again. A budget under a
    notebook's minimum runs none of the selected notebooks, without starting a kernel: the part names them in
    `not_run` and each keeps the record of the run that ran it (tests/test_record_writes.py). With every notebook
    done, nothing runs and nothing is written."""
    import json

    from record.notebooks import SOURCES
    from record.refresh import source_digest

    check = load_script("scripts/check.py")
    kit, numbers = check.kit_digest(), check._notebook_numbers()
    path, html = tmp_path / "gpu_check.json", tmp_path / "gpu_check"
    html.mkdir()
    items = []
    for nb in numbers.values():
        items.append({"notebook": nb.stem, "status": "completed", "kit_sha256": kit, "commit": "c" * 40,
                      "source_sha256": source_digest(SOURCES / (nb.stem + ".py"))})
        (html / (nb.stem + ".html")).write_text("<html></html>")
    path.write_text(json.dumps({"notebooks": {"notebooks": items}}))
    before = path.read_text()
    assert check.main(["notebooks", "--json", str(path), "--resume", "--budget-s", "30"]) == 0
    assert "nothing left to run" in capsys.readouterr().out and path.read_text() == before

    stale = {"01": ("source_sha256", "0" * 64), "03": ("status", "failed"), "04": ("kit_sha256", "0" * 16)}
    for item in items:
        key_value = stale.get(item["notebook"][:2])
        if key_value:
            item[key_value[0]] = key_value[1]
    (html / (numbers["02"].stem + ".html")).unlink()
    path.write_text(json.dumps({"notebooks": {"notebooks": items}}))
    assert check.main(["notebooks", "--json", str(path), "--resume", "--budget-s", "30"]) == 1
    part = json.loads(path.read_text())["notebooks"]
    status = {n["notebook"][:2]: n["status"] for n in part["notebooks"]}
    assert [n[:2] for n in part["not_run"]] == ["01", "02", "03", "04"], part.get("not_run")
    assert status == {**dict.fromkeys(numbers, "completed"), "03": "failed"}, status
    # named notebooks: the ones already done among them are left out too
    path.write_text(json.dumps({"notebooks": {"notebooks": items}}))
    assert check.main(["notebooks", "--json", str(path), "--resume", "--budget-s", "30", "--notebooks", "00,04"]) == 1
    part = json.loads(path.read_text())["notebooks"]
    status = {n["notebook"][:2]: n["status"] for n in part["notebooks"]}
    assert status == {**dict.fromkeys(numbers, "completed"), "03": "failed"} and [n[:2] for n in part["not_run"]] == [
        "04"], (status, part.get("not_run"))

    # a number that names no notebook is refused before anything runs, with or without --resume
    import pytest

    before = path.read_text()
    for extra in ([], ["--resume"]):
        with pytest.raises(SystemExit) as exit_:
            check.main(["notebooks", "--json", str(path), *extra, "--notebooks", "04,09"])
        assert exit_.value.code == 2 and "--notebooks 09: no such notebook" in capsys.readouterr().err
    assert path.read_text() == before

    # scripts/gpu/check.sh hands RESUME=1 to the notebooks part too
    argv = _check_sh_argv(tmp_path, "notebooks", "05", RESUME="1")
    assert argv[:2] == ["scripts/check.py", "notebooks"] and "--resume" in argv and "05" in argv, argv


def test_what_holds_the_gpu_after_a_part_is_polled_until_it_is_gone_and_named_when_it_stays():
    """NVML cannot answer here (no GPU): its process list (the kit's `read_gpu`, run on the device) is stood in for
    by a callable. A process listed for a moment (a killed engine whose memory the driver gives back just after) is
    not reported; one that stays is; no NVML at all is None, not an empty list."""
    check = load_script("scripts/check.py")
    holder = {"pid": 7, "gib": 24.3, "name": "python -m vllm"}
    calls = []

    def briefly(listed=3):
        calls.append(1)
        return [holder] if len(calls) < listed else []

    assert check.gpu_left_after(timeout_s=30, list_processes=briefly, interval_s=0.01) == []
    assert len(calls) == 3  # it waited for the process to go instead of reporting the first reading
    t0 = time.time()
    assert check.gpu_left_after(timeout_s=0.3, list_processes=lambda: [holder], interval_s=0.01) == [holder]
    assert time.time() - t0 >= 0.3
    assert check.gpu_left_after(timeout_s=0.3, list_processes=lambda: None) is None
