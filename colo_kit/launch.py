"""Multi-process cells: run a function on every GPU of the node (or on 2 CPU processes) from a
notebook, with accelerate's `notebook_launcher`, without losing the kernel.

`launch(fn, *args)` forks one process per GPU (2 on a CPU), runs `fn(*args)` in each under a
torch.distributed group, and returns what every rank returned. What it adds to a bare
`notebook_launcher(fn, num_processes=...)`, each for a failure seen in practice:

- **A kernel-safety check before the fork.** Forked workers cannot use CUDA if the kernel already
  made a CUDA context ("Cannot re-initialize CUDA in forked subprocess", accelerate #1751/#3925),
  and accelerate refuses to fork once an `Accelerator` exists in the kernel. `kernel_problems()`
  finds both; `launch` then starts the workers in a fresh process instead (torchrun on the
  function pickled by cloudpickle), or with `fresh_process=False` raises `KernelNotSafe` naming
  the fix (restart the kernel; keep every CUDA call inside the function).
- **A free rendezvous port per launch.** `notebook_launcher` defaults to port 29500; a second
  launch while the first one's port is still in TIME_WAIT, or beside another job, hangs or fails
  (TRL #3979). Each launch asks the OS for a free port.
- **Results back in the kernel.** `notebook_launcher` discards return values; each worker pickles
  its own into the launch folder and `launch` returns them in rank order. (torch elastic's
  `elastic_launch` returns `{rank: value}` for a forked launch, but a kernel that cannot fork
  needs a fresh `torchrun` process, whose values can only come back through files: one way for
  both, and a worker's exception comes back the same way, with its traceback.)
- **Worker logs in the cell, and the kernel alive after a crash.** Each worker writes stdout and
  stderr (file descriptors too: vLLM and gloo log from C++) to `rank<N>.log`; the kernel streams
  those files into the cell as `[rank N] ...`. A worker's exception is written down with its
  traceback and raised in the kernel as `WorkerError` — an ordinary exception, the kernel lives.
- **CPU really means 2 processes.** Without `cpu=True`, `PartialState()` on a machine without a
  GPU ignores WORLD_SIZE and quietly makes every process a world of one (accelerate's
  `_prepare_backend` only picks MULTI_CPU when `cpu=True`); likewise `accelerate launch --cpu
  --num_processes 2` runs ONE process (its `--cpu` path is the single-process launcher; measured
  here). Each worker therefore initialises `PartialState(cpu=True)` — gloo, world size 2 — before
  your function runs; `torchrun --nproc_per_node 2` is the command-line equivalent.

Used by notebook 03 (TP tuning) and `colo_kit.tp`.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from colo_kit.env import gpu_count, has_cuda
from colo_kit.paths import runs_dir

log = logging.getLogger(__name__)

_RESULT = "rank{rank}.result.pkl"
_LOG = "rank{rank}.log"


class KernelNotSafe(RuntimeError):
    """The kernel holds state that a forked worker cannot inherit (a CUDA context, an Accelerator)."""


class WorkerError(RuntimeError):
    """A worker failed. `rank`, `worker_traceback` and `log_tail` say where and why."""

    def __init__(self, message: str, rank: int | None = None, worker_traceback: str = "", log_tail: str = ""):
        super().__init__(message)
        self.rank, self.worker_traceback, self.log_tail = rank, worker_traceback, log_tail


@dataclass
class LaunchResult:
    """What every rank returned (index = rank), and how the launch ran."""

    results: list
    num_processes: int
    port: int
    how: str  # "notebook_launcher (fork)" or "torchrun (fresh process)"
    backend: str  # "gloo" on CPU, "nccl" on GPU
    seconds: float
    run_dir: str
    notes: list[str] = field(default_factory=list)

    def __getitem__(self, rank: int):
        return self.results[rank]

    def __len__(self) -> int:
        return len(self.results)


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RANK_VARS = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                       "MASTER_ADDR", "MASTER_PORT"})


def without_rank_vars(environ=None) -> dict:
    """`environ` (default os.environ) for a process that starts its own group: no rank, world or
    rendezvous variables, no torchrun/accelerate state. TRL's colocate mode and vLLM's
    external_launcher write RANK/MASTER_PORT into the environment of the process that builds an
    engine; a child that inherits them binds a port its parent still holds (EADDRINUSE)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items()
            if k not in RANK_VARS and not k.startswith(("TORCHELASTIC_", "ACCELERATE_"))}


def child_env(gpus: str | None = None, **extra: str) -> dict:
    """The environment of a process the kit starts (a vLLM server or replica, a bench worker,
    torchrun): this one's, without its rank and rendezvous variables (`without_rank_vars`), with a
    PYTHONPATH that finds everything this process imports — the kit's checkout and every `sys.path`
    entry (a stack carried on PYTHONPATH, a notebook's folder: cloudpickle sends importable
    functions by name) — and `CUDA_VISIBLE_DEVICES=gpus` when given."""
    env = without_rank_vars()
    paths = [str(Path(__file__).resolve().parent.parent), *env.get("PYTHONPATH", "").split(os.pathsep),
             *(p or os.getcwd() for p in sys.path)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpus)
    env.update(extra)
    return env


def kernel_problems() -> list[str]:
    """Why forking this process would break the workers; empty when it is safe.

    Looks without touching the GPU: `torch.cuda.is_initialized()` only reads a flag, and only if
    torch is already imported.
    """
    problems = []
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        problems.append("CUDA is already initialised in this kernel (a tensor or model was put on a GPU, or "
                        "torch.cuda was queried): forked workers cannot use CUDA after that (accelerate #1751/#3925)")
    acc = sys.modules.get("accelerate.state")
    if acc is not None and (acc.AcceleratorState._shared_state or acc.PartialState._shared_state):
        problems.append("an Accelerator/PartialState already exists in this kernel (a trainer was built here): "
                        "accelerate refuses to fork after that, and the workers would inherit a world of one")
    return problems


_FIX = ("Fix: restart the kernel and keep every GPU call (models, trainers, torch.cuda.*) inside the launched "
        "function, or call launch(..., fresh_process=True) to run the workers in a fresh Python process.")


# ---------------------------------------------------------------------------------------------
# Inside each worker
# ---------------------------------------------------------------------------------------------

class _Worker:
    """The callable each process runs: logs to its file, sets up the process group, runs the
    function, and leaves its result (or its traceback) in the launch folder."""

    def __init__(self, function: Callable, run_dir: str, cpu: bool):
        self.function, self.run_dir, self.cpu = function, run_dir, cpu
        # torch elastic names the workers after the entrypoint
        self.__name__ = getattr(function, "__name__", "function")
        self.__qualname__ = getattr(function, "__qualname__", self.__name__)

    def _redirect_output(self, rank: int) -> None:
        path = Path(self.run_dir) / _LOG.format(rank=rank)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        old_out, old_err = sys.stdout, sys.stderr
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        # In a forked Jupyter kernel sys.stdout is the kernel's stream object; point Python at the file,
        # and move logging handlers made before the fork (vLLM's, transformers') along with it.
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        import logging

        loggers = [logging.root] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                    if isinstance(lg, logging.Logger)]
        for handler in (h for lg in loggers for h in lg.handlers):
            if type(handler) is logging.StreamHandler and handler.stream in (old_out, old_err, sys.__stdout__,
                                                                              sys.__stderr__):
                handler.setStream(sys.stderr)

    @staticmethod
    def _detach_from_kernel() -> None:
        """A forked worker still holds the kernel's IPython shell: progress bars and widgets made in
        it (tqdm.auto, transformers' notebook callback) would try to send through the kernel's
        sockets ("attempted to send message from fork", one warning per update). Silence that
        channel and drop the shell, so display() falls back to text in the worker's log."""
        ipython = sys.modules.get("IPython")
        shell = ipython.get_ipython() if ipython is not None else None
        if shell is None:
            return
        session = getattr(getattr(shell, "kernel", None), "session", None)
        if session is not None:
            session.send = lambda *a, **k: None
        from IPython.core.interactiveshell import InteractiveShell

        InteractiveShell.clear_instance()

    def __call__(self, *args):
        import colo_kit

        colo_kit.setup()  # a forked worker has its launcher's settings; a spawned one starts without them
        rank = int(os.environ.get("RANK", 0))
        self._detach_from_kernel()
        self._redirect_output(rank)
        out = Path(self.run_dir) / _RESULT.format(rank=rank)
        try:
            from accelerate.state import AcceleratorState, PartialState

            # A forked worker inherits the kernel's (empty) accelerate state; start from nothing.
            AcceleratorState._reset_state(True)
            if self.cpu:
                os.environ["ACCELERATE_USE_CPU"] = "true"  # Accelerator()/TrainingArguments follow suit
            state = PartialState(cpu=self.cpu)
            print(f"[colo_kit.launch] rank {state.process_index}/{state.num_processes} "
                  f"backend={state.backend} device={state.device} pid={os.getpid()}", flush=True)
            value = self.function(*args)
            payload = ("ok", value)
        except BaseException as exc:  # noqa: BLE001 — everything a worker raises goes back to the kernel
            tb = traceback.format_exc()
            print(tb, file=sys.stderr, flush=True)
            payload = ("error", {"type": type(exc).__name__, "message": str(exc), "traceback": tb})
        tmp = out.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                pickle.dump(payload, f)
        except Exception as exc:  # an unpicklable return value must not hide the run
            with open(tmp, "wb") as f:
                pickle.dump(("error", {"type": "PicklingError", "message": f"the return value of rank {rank} "
                                       f"could not be pickled ({exc}); return plain data (dict, list, numbers)",
                                       "traceback": ""}), f)
        os.replace(tmp, out)
        sys.stdout.flush()
        sys.stderr.flush()
        if payload[0] == "error":
            raise SystemExit(1)
        return None


def _fresh_process_main(run_dir: str) -> int:
    """`python -m colo_kit.launch <run_dir>` under torchrun: load the pickled payload and run it."""
    with open(Path(run_dir) / "payload.pkl", "rb") as f:
        function, args, cpu = pickle.load(f)
    _Worker(function, run_dir, cpu)(*args)
    return 0


# ---------------------------------------------------------------------------------------------
# In the kernel
# ---------------------------------------------------------------------------------------------

class _Tail(threading.Thread):
    """Copies new lines of the workers' log files into this cell as `[rank N] ...`."""

    BRIEF = ("colo_kit", "Error", "error", "Traceback", "raise ", "File \"")

    def __init__(self, run_dir: Path, num_processes: int, echo: bool | str):
        super().__init__(daemon=True)
        self.paths = [run_dir / _LOG.format(rank=r) for r in range(num_processes)]
        self.pos = [0] * num_processes
        self.partial = [""] * num_processes
        self.echo = echo
        self.done = threading.Event()

    def poll(self) -> None:
        for r, path in enumerate(self.paths):
            if not path.exists():
                continue
            with open(path, "rb") as f:
                f.seek(self.pos[r])
                chunk = f.read()
            if not chunk:
                continue
            self.pos[r] += len(chunk)
            text = self.partial[r] + chunk.decode("utf-8", "replace")
            lines = text.split("\n")
            self.partial[r] = lines.pop()
            for line in lines:
                self._print(r, line)

    def _print(self, rank: int, line: str) -> None:
        if not self.echo or (self.echo == "brief" and not any(k in line for k in self.BRIEF)):
            return
        print(f"[rank {rank}] {line.rstrip()}", flush=True)

    def run(self) -> None:
        while not self.done.is_set():
            self.poll()
            self.done.wait(0.5)

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=5)
        self.poll()
        for r, rest in enumerate(self.partial):
            if rest.strip():
                self._print(r, rest)


def _log_tail(run_dir: Path, rank: int, lines: int = 30) -> str:
    path = run_dir / _LOG.format(rank=rank)
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _collect(run_dir: Path, num_processes: int, launch_exc: BaseException | None) -> list:
    results, errors, missing = [], [], []
    for r in range(num_processes):
        path = run_dir / _RESULT.format(rank=r)
        if not path.exists():
            missing.append(r)
            results.append(None)
            continue
        with open(path, "rb") as f:
            status, value = pickle.load(f)
        if status == "error":
            errors.append((r, value))
        results.append(value if status == "ok" else None)
    if errors:
        r, err = errors[0]
        others = f" (ranks {[e[0] for e in errors]} failed)" if len(errors) > 1 else ""
        raise WorkerError(f"rank {r} raised {err['type']}: {err['message']}{others}\n\n"
                          f"--- worker traceback (rank {r}) ---\n{err['traceback']}",
                          rank=r, worker_traceback=err["traceback"], log_tail=_log_tail(run_dir, r))
    if missing:
        r = missing[0]
        tail = _log_tail(run_dir, r)
        raise WorkerError(f"rank {r} ended without a result (killed, a crash in C++ code, or a hang broken by "
                          f"the launcher){': ' + repr(launch_exc) if launch_exc else ''}\n--- last lines of "
                          f"rank{r}.log ---\n{tail}", rank=r, log_tail=tail)
    return results


def launch(function: Callable, *args: Any, num_processes: int | None = None, cpu: bool | None = None,
           fresh_process: bool | str = "auto", echo: bool | str = True, timeout_s: float | None = None,
           preimport: tuple[str, ...] = (), port: int | None = None,
           run_dir: str | Path | None = None) -> LaunchResult:
    """Run `function(*args)` in `num_processes` processes (default: every GPU, or 2 on a CPU) and
    return each rank's return value.

    Inside `function`, torch.distributed is initialised (gloo on CPU, NCCL on GPU) through
    `PartialState`, and RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT are set, so
    vLLM's `external_launcher` and TRL's trainers join that group. Return plain data (dicts,
    lists, numbers): it is pickled back to the kernel.

    `fresh_process`: "auto" forks with `notebook_launcher` when the kernel is safe to fork and
    otherwise starts a fresh `torchrun` process (the function travels by cloudpickle); True always
    starts a fresh process; False raises `KernelNotSafe` instead of falling back.
    `timeout_s` applies to fresh processes (a forked launch runs until its workers end).
    `echo`: True streams every worker line into the cell, "brief" only the kit's lines and errors,
    False none (the logs stay in `run_dir`).
    `preimport`: modules to import in the kernel before forking, so that every worker inherits them
    instead of importing them again (vLLM takes 10-60 s to import on a busy CPU). Checked again for
    CUDA afterwards: a module that initialises CUDA on import makes the launch use a fresh process.
    `port`: the rendezvous port (default: a free one picked now; never a fixed one, TRL #3979).
    """
    if not callable(function):
        raise TypeError(f"function={function!r} is not callable: pass the function itself, e.g. launch(train, 2)")
    if fresh_process not in ("auto", True, False):
        raise ValueError(f"fresh_process={fresh_process!r}; use 'auto', True or False")
    cpu = (not has_cuda()) if cpu is None else bool(cpu)
    available = 0 if cpu else gpu_count()
    if num_processes is None:
        num_processes = 2 if cpu else max(available, 1)
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes={num_processes!r} must be a positive integer")
    if not cpu and num_processes > available:
        raise ValueError(f"num_processes={num_processes} but this node has {available} GPU(s): use at most "
                         f"{available}, or cpu=True for CPU processes")

    notes = []
    if fresh_process is not True:
        import importlib

        for name in preimport:
            importlib.import_module(name)
    problems = kernel_problems()
    fresh = fresh_process is True
    if problems and fresh_process is False:
        raise KernelNotSafe("cannot fork workers from this kernel:\n- " + "\n- ".join(problems) + "\n" + _FIX)
    if problems and fresh_process == "auto":
        fresh = True
        notes.append("kernel not safe to fork (" + "; ".join(problems) + "): workers start in a fresh process")
    if num_processes == 1 and not fresh:
        notes.append("one process: run in a forked worker all the same, so a crash cannot take the kernel down")

    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="launch-", dir=runs_dir()))
    run_dir.mkdir(parents=True, exist_ok=True)
    port = int(port or free_port())
    worker = _Worker(function, str(run_dir), cpu)
    for note in notes:
        log.info(note)
    if echo:
        log.info("%d %s, rendezvous 127.0.0.1:%d, logs in %s", num_processes,
                 "CPU processes (gloo)" if cpu else "GPU processes (NCCL)", port, run_dir)

    tail = _Tail(run_dir, num_processes, echo)
    tail.start()
    t0 = time.perf_counter()
    launch_exc = None
    try:
        if fresh:
            how = "torchrun (fresh process)"
            _launch_fresh(function, args, num_processes, cpu, run_dir, port, timeout_s)
        else:
            how = "notebook_launcher (fork)"
            _launch_forked(worker, args, num_processes, port)
    except Exception as exc:  # the workers' own errors are read from their files just below
        launch_exc = exc
    finally:
        tail.stop()
    seconds = time.perf_counter() - t0
    results = _collect(run_dir, num_processes, launch_exc)
    if launch_exc is not None and not isinstance(launch_exc, subprocess.CalledProcessError):
        notes.append(f"the launcher reported {launch_exc!r} after every rank returned")
    return LaunchResult(results=results, num_processes=num_processes, port=port, how=how,
                        backend="gloo" if cpu else "nccl", seconds=round(seconds, 2), run_dir=str(run_dir),
                        notes=notes)


def _launch_forked(worker: _Worker, args: tuple, num_processes: int, port: int) -> None:
    """accelerate's notebook_launcher with our port. For one process notebook_launcher calls the
    function in the kernel itself; we fork that case through torch elastic (the engine notebook_launcher
    uses) so that a crash cannot take the kernel with it.

    accelerate 1.15 prints "Launching training on 2 CUDAs." on a CPU too (its device probe falls back
    to "cuda"); the workers' own first line says what they got. torch elastic's error report of a
    failed worker is silenced here: `WorkerError` carries the worker's own traceback instead."""
    import logging

    quiet = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing.spawn")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.CRITICAL)
    # torch's LaunchConfig asks torch.cuda.is_available() in this process; without the NVML check
    # that initialises the CUDA driver here, and every forked worker then fails with "Cannot
    # re-initialize CUDA in forked subprocess" (seen on an H200 node: notebook 03's first cell).
    nvml_check = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        if num_processes > 1:
            from accelerate import notebook_launcher

            notebook_launcher(worker, args=args, num_processes=num_processes, use_port=str(port),
                              master_addr="127.0.0.1")
            return
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, run_id="none",
                              rdzv_endpoint=f"127.0.0.1:{port}", rdzv_backend="static", rdzv_configs={"rank": 0},
                              max_restarts=0, monitor_interval=0.1, start_method="fork")
        elastic_launch(config=config, entrypoint=worker)(*args)
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)
        if nvml_check is None:
            os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = nvml_check


def _launch_fresh(function: Callable, args: tuple, num_processes: int, cpu: bool, run_dir: Path, port: int,
                  timeout_s: float | None) -> None:
    import cloudpickle

    with open(run_dir / "payload.pkl", "wb") as f:
        cloudpickle.dump((function, args, cpu), f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(num_processes),
           "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "colo_kit.launch", str(run_dir)]
    env = child_env()
    # The launcher's own messages go to a file; the workers' lines reach the cell through the tail.
    with open(run_dir / "launcher.log", "wb") as log:
        subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=True)


if __name__ == "__main__":
    import colo_kit

    colo_kit.setup()
    raise SystemExit(_fresh_process_main(sys.argv[1]))
