"""colo_kit.procs on real processes: replicas (the stand-in upstream of tests/stub_replica.py)
started in sessions of their own and waited for through `/health`, a process that dies before it
is healthy, nobody answering, and a process group that ignores SIGTERM."""

import os
import sys
import time
from pathlib import Path

import httpx
import pytest

from colo_kit.parallel.launch import child_env, free_port
from colo_kit.async_lora.lora import ReplicaLaunch
from colo_kit.procs import start_in_session, stop_groups, wait_healthy
from colo_kit.async_lora.replicas import ReplicaSet, launch_replicas

STUB = str(Path(__file__).resolve().parent / "stub_replica.py")


def _gone(pid: int) -> bool:
    """Ended: no such process, or a zombie its new parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def _stub(i: int, port: int, *extra: str) -> ReplicaLaunch:
    return ReplicaLaunch(argv=[sys.executable, STUB, "--port", str(port), "--name", f"r{i}", *extra],
                         url=f"http://127.0.0.1:{port}")


def test_replicas_start_together_each_in_a_group_of_its_own_and_stop_together(tmp_path):
    launches = [_stub(i, free_port()) for i in range(2)]
    with launch_replicas(launches, tmp_path / "logs", timeout_s=120) as reps:
        procs = list(reps.procs)
        assert all(os.getpgid(p.pid) == p.pid for p in procs)  # each leads a group: stop() reaches its children
        assert len(reps.startup_s) == 2 and all(s > 0 for s in reps.startup_s)
        assert all(httpx.get(u + "/health").status_code == 200 for u in reps.urls)
    assert all(p.poll() is not None for p in procs) and reps.procs == []


def test_a_replica_that_exits_first_fails_at_once_with_its_log_and_stops_the_others(tmp_path):
    good, bad = _stub(0, free_port()), _stub(1, free_port(), "--no-such-flag")
    reps = ReplicaSet([good, bad], tmp_path / "logs")
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=rf"(?s)replica {bad.url} exited with code 2 .*--no-such-flag"):
        reps.start(timeout_s=120)
    assert time.perf_counter() - t0 < 60 and reps.procs == []  # not the timeout; the good one stopped too
    with pytest.raises(httpx.HTTPError):
        httpx.get(good.url + "/health", timeout=2)


def test_a_server_that_exits_first_fails_at_once_with_its_log(tmp_path):
    log = tmp_path / "server.log"
    proc = start_in_session([sys.executable, "-c", "print('no room for the KV cache'); raise SystemExit(3)"],
                            child_env(), log)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3 before it was healthy.*no room for the KV cache"):
        wait_healthy(f"http://127.0.0.1:{free_port()}", proc, timeout_s=120, log_path=log)
    assert time.perf_counter() - t0 < 60  # not the timeout


def test_nobody_answering_times_out_naming_the_log(tmp_path):
    with pytest.raises(TimeoutError, match="not healthy after 1 s; raise timeout_s or read .*quiet.log"):
        wait_healthy(f"http://127.0.0.1:{free_port()}", None, timeout_s=1, log_path=tmp_path / "quiet.log")


_STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
                          "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
print(child.pid, flush=True)
time.sleep(300)
"""


def test_a_group_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    # a vLLM server's engine core is a child in its group: the kill must reach it too
    log = tmp_path / "stubborn.log"
    proc = start_in_session([sys.executable, "-c", _STUBBORN], child_env(), log)
    for _ in range(300):
        if log.read_text().strip():
            break
        time.sleep(0.1)
    child = int(log.read_text())
    t0 = time.perf_counter()
    stop_groups([proc], timeout_s=1)
    assert proc.poll() is not None and time.perf_counter() - t0 < 15
    for _ in range(100):
        if _gone(child):
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        pytest.fail("the group's other process outlived stop_groups")
    stop_groups([proc])  # a stopped process: nothing to do


def test_a_lone_process_claims_a_rendezvous_port_the_os_chose(monkeypatch):
    """Two trainings started in the same second each asked TRL's picker, which tries 29500 first, and both took it;
    the kit claims a port the OS hands out instead, and leaves a port a launcher set, or a group of several, alone."""
    import socket

    from colo_kit.procs import claim_rendezvous_port

    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with socket.socket() as held:  # 29500 may be taken here already; either way the claim must not use it
        try:
            held.bind(("127.0.0.1", 29500))
        except OSError:
            pass
        claim_rendezvous_port()
        first = int(os.environ["MASTER_PORT"])
        monkeypatch.delenv("MASTER_PORT")
        claim_rendezvous_port()
        second = int(os.environ["MASTER_PORT"])
    assert 29500 not in (first, second) and first > 1024 and second > 1024
    monkeypatch.setenv("MASTER_PORT", "41234")
    claim_rendezvous_port()
    assert os.environ["MASTER_PORT"] == "41234"
    monkeypatch.delenv("MASTER_PORT")
    monkeypatch.setenv("WORLD_SIZE", "2")
    claim_rendezvous_port()
    assert "MASTER_PORT" not in os.environ
