"""Multi-process cells (notebook 03, whose table compares it with accelerate's `notebook_launcher`): run a function on
every GPU of the node (or 2 CPU processes) through torch elastic's `elastic_launch` and get each rank's return value,
without losing the kernel. Fork when safe (workers inherit the kernel's imports), else spawn (accelerate #1751/#3925);
a free port per launch (a fixed one is in TIME_WAIT after a launch, TRL #3979); per-rank logs at the fd level (vLLM and
gloo log from C++); one `WorkerError`; `PartialState(cpu=True)` in each worker, or each CPU process is a world of one.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import signal
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
from colo_kit.procs import child_env, free_port, without_rank_vars  # noqa: F401  (callers import them here)

log = logging.getLogger(__name__)


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
    how: str  # "elastic_launch (fork)" or "elastic_launch (spawn)"
    backend: str  # "gloo" on CPU, "nccl" on GPU
    seconds: float
    run_dir: str
    notes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.results)


def kernel_problems() -> list[str]:
    """Why forking this process would break the workers; empty when safe (it never touches the GPU itself)."""
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


class _Worker:
    """What each process runs: the process group, then the function (cloudpickled, so a notebook's function travels)."""

    def __init__(self, function: Callable, args: tuple, cpu: bool):
        self.function, self.args, self.cpu = function, args, cpu
        # torch elastic names the workers after the entrypoint
        self.__name__ = getattr(function, "__name__", "function")
        self.__qualname__ = getattr(function, "__qualname__", self.__name__)

    def __reduce__(self):
        import cloudpickle

        return _worker_from, (cloudpickle.dumps((self.function, self.args, self.cpu)),)

    @staticmethod
    def _streams_to_log() -> None:
        """Point `sys.stdout`, `sys.stderr` and pre-fork log handlers at fds 1 and 2, where elastic put the logs."""
        old = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__, *(getattr(s, "_stream", None)
                                                                           for s in (sys.stdout, sys.stderr)))
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        loggers = [logging.root] + [lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
        for handler in (h for lg in loggers for h in lg.handlers):
            if type(handler) is logging.StreamHandler and handler.stream in old:
                handler.setStream(sys.stderr)

    @staticmethod
    def _detach_from_kernel() -> None:
        """Drop the kernel's IPython shell a forked worker inherits, whose widgets would send through its sockets."""
        ipython = sys.modules.get("IPython")
        shell = ipython.get_ipython() if ipython is not None else None
        if shell is None:
            return
        session = getattr(getattr(shell, "kernel", None), "session", None)
        if session is not None:
            session.send = lambda *a, **k: None
        from IPython.core.interactiveshell import InteractiveShell

        InteractiveShell.clear_instance()

    def __call__(self) -> bytes:
        import cloudpickle

        import colo_kit

        colo_kit.setup()  # a spawned worker starts without its launcher's settings
        self._detach_from_kernel()
        self._streams_to_log()
        rank = int(os.environ.get("RANK", 0))
        try:
            from accelerate.state import AcceleratorState, PartialState

            AcceleratorState._reset_state(True)
            if self.cpu:
                os.environ["ACCELERATE_USE_CPU"] = "true"  # Accelerator()/TrainingArguments follow suit
            state = PartialState(cpu=self.cpu)
            print(f"[colo_kit.parallel.launch] rank {state.process_index}/{state.num_processes} "
                  f"backend={state.backend} device={state.device} pid={os.getpid()}", flush=True)
            value = self.function(*self.args)
            try:  # cloudpickle here, so that an unpicklable value fails in the worker, with a clear message
                return cloudpickle.dumps(value)
            except Exception as exc:
                raise TypeError(f"the return value of rank {rank} could not be pickled ({exc}); "
                                "return plain data (dict, list, numbers)") from exc
        except BaseException:
            traceback.print_exc()  # into the rank's log; elastic's `record` sends it to the launcher
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()


class _Fd:
    """The kernel's `sys.stdout`/`sys.stderr` with fileno() 1 and 2 during a launch, so elastic's dup2 of the log
    catches what C++ writes there (a Jupyter kernel's own stdout has another fd, or none)."""

    def __init__(self, stream, fd: int):
        self._stream, self._fd = stream, fd

    def fileno(self) -> int:
        return self._fd

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _worker_from(payload: bytes) -> _Worker:
    import cloudpickle

    return _Worker(*cloudpickle.loads(payload))


def _read(path: str | None, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:]) if path else ""
    except OSError:
        return ""


def _worker_error(exc, run_dir: Path, ended: list, timeout_s: float | None) -> WorkerError:
    """`WorkerError` for the rank that failed first, a Python exception before a kill."""
    failures = exc.failures  # {global rank: ProcessFailure}; `record` leaves {"message": {...}} for an exception
    recorded = {r: f.error_file_data.get("message") for r, f in failures.items()}
    rank = min(failures, key=lambda r: (not isinstance(recorded[r], dict), failures[r].timestamp, r))
    failure, message = failures[rank], recorded[rank]
    # DefaultLogsSpecs writes <run_dir>/<run id>_<random>/attempt_0/<rank>/std{out,err}.log
    tail = "\n".join(_read(p) for p in sorted(run_dir.glob(f"*/attempt_*/{rank}/std*.log"), reverse=True))
    if ended:
        return WorkerError(f"rank {rank} was still running after timeout_s={timeout_s} s: the launch's {len(ended)} "
                           f"workers were ended (SIGTERM, then SIGKILL)\n--- last lines of rank {rank}'s log ---\n"
                           f"{tail}", rank=rank, log_tail=tail)
    if isinstance(message, dict):
        text, tb = message.get("message", ""), message.get("extraInfo", {}).get("py_callstack", "")
        others = f" (ranks {sorted(failures)} failed)" if len(failures) > 1 else ""
        return WorkerError(f"rank {rank} raised {text}{others}\n\n--- worker traceback (rank {rank}) ---\n{tb}",
                           rank=rank, worker_traceback=tb, log_tail=tail)
    return WorkerError(f"rank {rank} ended with exit code {failure.exitcode} without a Python exception "
                       f"(killed, or a crash in C++ code)\n--- last lines of rank {rank}'s log ---\n{tail}",
                       rank=rank, log_tail=tail)


def _end_on_timeout(timeout_s: float, before: set, ended: list, done: threading.Event) -> None:
    """After `timeout_s`, SIGTERM the workers this launch started, then SIGKILL those alive 10 s later (a worker
    blocked in a collective runs no Python signal handler)."""
    if done.wait(timeout_s):
        return
    workers = [p for p in multiprocessing.active_children() if p not in before]
    ended.extend(workers)
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
        for p in workers:
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while any(p.is_alive() for p in workers) and time.monotonic() < deadline and not done.is_set():
            time.sleep(0.1)


def launch(function: Callable, *args: Any, num_processes: int | None = None, cpu: bool | None = None,
           fresh_process: bool | str = "auto", echo: bool | str = True, timeout_s: float | None = None,
           preimport: tuple[str, ...] = (), port: int | None = None) -> LaunchResult:
    """Run `function(*args)` in `num_processes` processes (default: every GPU, or 2 on a CPU) with torch.distributed
    initialised, so vLLM's `external_launcher` and TRL's trainers join it; return each rank's return value.
    `fresh_process`: "auto" forks when safe, else spawns; `echo`: True tees every worker line into the cell, "brief"
    only stderr; `preimport`: modules to import before forking, for the workers to inherit."""
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
        for name in preimport:
            importlib.import_module(name)
    problems = kernel_problems()
    if problems and fresh_process is False:
        raise KernelNotSafe("cannot fork workers from this kernel:\n- " + "\n- ".join(problems) + "\nFix: restart the kernel "
                            "and keep every GPU call (models, trainers, torch.cuda.*) inside the launched function, or call "
                            "launch(..., fresh_process=True) to spawn the workers as fresh Python processes.")
    if problems and fresh_process == "auto":
        notes.append("kernel not safe to fork (" + "; ".join(problems) + "): workers spawned instead")
    method = "spawn" if fresh_process is True or problems else "fork"
    if num_processes == 1:
        notes.append("one process: run in a worker all the same, so a crash cannot take the kernel down")

    run_dir = Path(tempfile.mkdtemp(prefix="launch-", dir=runs_dir()))
    port = int(port or free_port())
    for note in notes:
        log.info(note)
    if echo:
        log.info("%d %s, %s, rendezvous 127.0.0.1:%d, logs in %s", num_processes,
                 "CPU processes (gloo)" if cpu else "GPU processes (NCCL)", method, port, run_dir)

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    tee = {True: Std.ALL, "brief": Std.ERR}.get(echo, Std.NONE)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=num_processes, run_id=run_dir.name,
                          rdzv_endpoint=f"127.0.0.1:{port}", rdzv_backend="static", rdzv_configs={"rank": 0}, max_restarts=0,
                          monitor_interval=0.1, start_method=method, log_line_prefix_template="[rank ${rank}] ",
                          logs_specs=DefaultLogsSpecs(log_dir=str(run_dir), redirects=Std.ALL, tee=tee))
    # elastic's failure reports are quieted (WorkerError says it all) and its signal handlers removed afterwards
    quiet = {name: logging.getLogger(name).level for name in ("torch.distributed.elastic", "torch.distributed.launcher",
                                                              "torch.multiprocessing.spawn")}
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    # LaunchConfig asks torch.cuda.is_available(), which without the NVML check initialises CUDA before the fork
    nvml_check = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    done, ended = threading.Event(), []
    if timeout_s is not None:
        before = set(multiprocessing.active_children())
        threading.Thread(target=_end_on_timeout, args=(timeout_s, before, ended, done), daemon=True).start()
    streams = sys.stdout, sys.stderr
    t0 = time.perf_counter()
    try:
        sys.stdout, sys.stderr = _Fd(streams[0], 1), _Fd(streams[1], 2)
        for name in quiet:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        returned = elastic_launch(config=config, entrypoint=_Worker(function, args, cpu))()
    except ChildFailedError as exc:
        raise _worker_error(exc, run_dir, ended, timeout_s) from None
    finally:
        sys.stdout, sys.stderr = streams
        done.set()
        for name, level in quiet.items():
            logging.getLogger(name).setLevel(level)
        for sig, handler in handlers.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        if nvml_check is None:
            os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = nvml_check
    import cloudpickle

    return LaunchResult(results=[cloudpickle.loads(returned[r]) for r in range(num_processes)], num_processes=num_processes,
                        port=port, how=f"elastic_launch ({method})", backend="gloo" if cpu else "nccl",
                        seconds=round(time.perf_counter() - t0, 2), run_dir=str(run_dir), notes=notes)

