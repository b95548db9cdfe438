"""Before an engine starts: is its share of the GPU free? vLLM asserts only after the model has loaded (usually another
kernel holds an engine); `check_share(u)` reads NVML first and raises `GpuBusy` naming the holder and the fixes."""

from __future__ import annotations

import os

MARGIN_GIB = 0.5  # vLLM's own buffers beyond its share, and what the trainer allocates before the engine


class GpuBusy(RuntimeError):
    pass


def nvml_device(index: int, physical: bool = False):
    """(NVML handle, NVML index) of CUDA device `index` of this process (with `physical`, of NVML's GPU `index`)."""
    import pynvml

    pynvml.nvmlInit()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    if not physical and visible[0].strip() and index < len(visible) and visible[index].strip().isdigit():
        index = int(visible[index])  # CUDA renumbers the visible GPUs from 0; NVML does not
    return pynvml.nvmlDeviceGetHandleByIndex(index), index


def read_gpu(index: int = 0, physical: bool = False) -> dict:
    """{"gpu", "total_gib", "free_gib", "others": [{"pid", "gib", "name"}]} for `index`, numbered as `nvml_device`."""
    import psutil
    import pynvml

    handle, physical_index = nvml_device(index, physical)
    mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    others = []
    for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if proc.pid == os.getpid():
            continue
        try:
            name = " ".join(psutil.Process(proc.pid).cmdline()[:3])[:80]
        except psutil.Error:
            name = "?"
        others.append({"pid": proc.pid, "gib": round((proc.usedGpuMemory or 0) / 2**30, 1), "name": name})
    return {"gpu": physical_index, "total_gib": mem.total / 2**30, "free_gib": mem.free / 2**30, "others": others}


def check_share(utilization: float, index: int = 0, reading: dict | None = None, *,
                physical: int | None = None) -> dict | None:
    """Raise `GpuBusy` when `utilization` of GPU `index` (this process's CUDA numbering; or NVML's GPU `physical`)
    is not free now; return the reading otherwise (None without an NVIDIA GPU: nothing to check)."""
    from colo_kit.env import has_cuda

    if reading is None:
        if not has_cuda():
            return None
        reading = read_gpu(physical, physical=True) if physical is not None else read_gpu(index)
    need = utilization * reading["total_gib"]
    if reading["free_gib"] >= need + MARGIN_GIB:
        return reading
    fits = max(0.0, (reading["free_gib"] - MARGIN_GIB) / reading["total_gib"])
    held = ", ".join(f"pid {p['pid']} ({p['name']}) {p['gib']} GiB" for p in reading["others"]) or \
        "no other process NVML can see (a container's neighbour, or memory this process holds)"
    raise GpuBusy(f"GPU {reading['gpu']} has {reading['free_gib']:.1f} of {reading['total_gib']:.1f} GiB free, but "
                  f"vllm_gpu_memory_utilization={utilization} needs {need:.1f} GiB: held by {held}. Shut the other "
                  f"notebook's kernel down (Kernel > Shut Down Kernel) or stop that process, or use "
                  f"vllm_gpu_memory_utilization={int(fits * 100) / 100} or less")
