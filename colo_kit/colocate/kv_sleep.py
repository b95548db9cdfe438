"""Sleep that releases only the KV cache, the weights staying mapped (the speed race's `sleep_kv` in record/speed.py,
notebook 04): both vLLM sleep levels unmap the weights too, and mapping back costs about 5.6 ms per GB (vLLM #45648;
see also vLLM's `release_kv_cache_memory()`, #44890). `wake_up(tags=["kv_cache"])` maps it back. NVIDIA GPUs only.
"""

from __future__ import annotations

import types


def engine_core(llm):
    """The in-process `EngineCore` of an `LLM` (external_launcher, or V1 without multiprocessing)."""
    return llm.llm_engine.engine_core.engine_core


def kv_sleep(llm, pause=None) -> int:
    """Release the engine's KV cache and keep its weights; returns the bytes unmapped. `pause`: vLLM's own sleep."""
    executor = engine_core(llm).model_executor
    if executor.is_sleeping:
        raise RuntimeError(f"the engine is already asleep ({sorted(executor.sleeping_tags)}): wake it before "
                           "releasing its KV cache")
    llm.reset_prefix_cache()
    (pause or llm.sleep)(level=0)  # vLLM pauses its scheduler; no memory moves
    freed = unmap_kv_cache()
    executor.is_sleeping = True
    executor.sleeping_tags = {"kv_cache"}
    return freed


def unmap_kv_cache() -> int:
    """Unmap every allocation tagged `kv_cache` in vLLM's `CuMemAllocator`, as `sleep` itself would."""
    import torch
    from vllm.device_allocator.cumem import CuMemAllocator, unmap_and_release

    torch.cuda.synchronize()
    freed = 0
    for data in CuMemAllocator.get_instance().pointer_to_data.values():
        if data.tag == "kv_cache" and not data.is_asleep:
            unmap_and_release(data.handle)
            data.is_asleep = True
            freed += data.handle[1]
    return freed


def use_kv_sleep(trainer) -> bool:
    """Make this trainer's colocated engine release only its KV cache when TRL puts it to sleep. Returns True
    when applied (colocate mode with `vllm_enable_sleep_mode=True` on a GPU)."""
    gen = getattr(trainer, "vllm_generation", None)
    if gen is None or getattr(gen, "mode", None) != "colocate" or not gen.enable_sleep_mode:
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cuda_alike():
        from colo_kit.colocate.sleep import SleepModeUnavailable

        raise SleepModeUnavailable.for_this_platform("KV-only sleep")
    llm = gen.llm
    sleep, wake_up = llm.sleep, llm.wake_up
    executor = engine_core(llm).model_executor

    def sleep_kv_only(self, level: int = 1, **kw):
        if executor.is_sleeping:  # TRL's very first sleep happened before this patch; keep vLLM's answer
            return sleep(level, **kw)
        kv_sleep(self, pause=sleep)  # vLLM's own sleep: `self.sleep` is this function

    def wake_up_what_sleeps(self, tags=None, **kw):
        if tags is not None:
            tags = [t for t in tags if t in executor.sleeping_tags]
            if not tags:
                return None  # e.g. TRL waking the weights before a push: they never left
        return wake_up(tags, **kw)

    llm.sleep = types.MethodType(sleep_kv_only, llm)
    llm.wake_up = types.MethodType(wake_up_what_sleeps, llm)
    return True
