"""Child processes the kit serves from (vLLM servers and replicas): started, waited for on `/health`, stopped. A
server's engine core, which holds the GPU memory, is its child, so each server leads a process group of its own."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def claim_rendezvous_port() -> None:
    """A MASTER_PORT the OS chose, unless one is set, for one process forming its own group (colocated engine or trainer):
    TRL's picker tries 29500 first, and two trainings started in the same second both took it (EADDRINUSE in vLLM)."""
    if not os.environ.get("MASTER_PORT") and os.environ.get("WORLD_SIZE", "1") == "1":
        os.environ["MASTER_PORT"] = str(free_port())


RANK_VARS = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                       "MASTER_ADDR", "MASTER_PORT"})


def without_rank_vars(environ=None) -> dict:
    """`environ` (default os.environ) without the rank, rendezvous and torchrun/accelerate variables an engine's builder
    writes: a child inheriting them binds a port its parent still holds."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items()
            if k not in RANK_VARS and not k.startswith(("TORCHELASTIC_", "ACCELERATE_"))}


def child_env(gpus: str | None = None, **extra: str) -> dict:
    """The environment of a process the kit starts: this one's without rank variables, `CUDA_VISIBLE_DEVICES=gpus`
    when given, and a PYTHONPATH with the kit's checkout and every `sys.path` entry."""
    env = without_rank_vars()
    paths = [str(Path(__file__).resolve().parent.parent), *env.get("PYTHONPATH", "").split(os.pathsep),
             *(p or os.getcwd() for p in sys.path)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpus)
    env.update(extra)
    return env


def die_with_parent() -> None:
    """`preexec_fn` of a server the kit starts: SIGTERM when its starter dies, even by SIGKILL (no atexit then)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_in_session(argv: list[str], env: dict, log_path: str | Path) -> subprocess.Popen:
    """Start `argv` as the leader of a new session, stdout and stderr to `log_path`, ended when this process dies."""
    with open(log_path, "w") as log:  # the child holds its own copy of the file descriptor
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent)


def log_tail(log_path: str | Path | None, chars: int = 3000) -> str:
    """The last `chars` characters of a log; empty when there is none."""
    try:
        return Path(log_path).read_text(errors="replace")[-chars:] if log_path else ""
    except OSError:
        return ""


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def wait_all_healthy(children: dict[str, tuple[subprocess.Popen | None, str | Path | None]], timeout_s: float,
                     *, t0: float | None = None, what: str = "vLLM server") -> dict[str, float]:
    """Poll `GET {url}/health` of every `url: (process, log_path)` until each answers 200; return the seconds from `t0`
    until each did. RuntimeError with the log's tail when a process exits first, TimeoutError after `timeout_s`."""
    t0 = time.perf_counter() if t0 is None else t0
    pending, ready = dict(children), {}
    while True:
        for url, (proc, log_path) in list(pending.items()):
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{what} {url} exited with code {proc.returncode} before it was healthy; "
                                   f"log tail:\n{log_tail(log_path)}")
            if _answers(url):
                ready[url] = time.perf_counter() - t0
                del pending[url]
        if not pending:
            return ready
        if time.perf_counter() - t0 > timeout_s:
            logs = ", ".join(str(log) for _, log in pending.values() if log) or "its log"
            raise TimeoutError(f"{what} {', '.join(pending)} not healthy after {timeout_s:.0f} s; "
                               f"raise timeout_s or read {logs}")
        time.sleep(0.5)


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 300.0, log_path=None) -> float:
    """One server's `wait_all_healthy`: the seconds until `/health` answered."""
    return wait_all_healthy({url: (proc, log_path)}, timeout_s)[url]


def stop_groups(procs: list[subprocess.Popen], timeout_s: float = 30.0) -> None:
    """SIGTERM each of `procs`' process groups (server + engine core), wait up to `timeout_s`, then SIGKILL."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in running:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
