"""One colocated vLLM engine for several TRL trainers in one process: an engine start costs 50-90 s on a GPU, so a
sweep or a break-it lab lets successive trainers share the identical engine TRL would build again (notebook 02)."""

from __future__ import annotations

import gc
import json
import time

_ENGINES: dict = {}
ENGINE_BUILDS: list = []  # every engine built through reuse_engines, in order


def reuse_engines() -> None:
    """Let successive GRPOTrainers in this process share a colocated vLLM engine, keyed by every `LLM(...)` argument
    but `max_num_seqs` (run the largest batch first); sleep-mode engines are never shared."""
    from trl.generation import vllm_generation
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if getattr(vllm_generation, "_colo_kit_real_LLM", None) is not None:
        return
    real = vllm_generation.LLM

    def LLM(*args, **kwargs):
        if kwargs.get("enable_sleep_mode") or args:
            return real(*args, **kwargs)
        key = json.dumps({k: v for k, v in kwargs.items() if k != "max_num_seqs"}, sort_keys=True, default=str)
        hit = _ENGINES.get(key)
        if hit is not None and hit[0] >= (kwargs.get("max_num_seqs") or 0) and model_parallel_is_initialized():
            return hit[1]
        for k in list(_ENGINES):  # one engine at a time: free the smaller one first
            del _ENGINES[k]
        gc.collect()
        llm = real(*args, **kwargs)
        _ENGINES[key] = (kwargs.get("max_num_seqs") or 0, llm)
        ENGINE_BUILDS.append({"max_num_seqs": kwargs.get("max_num_seqs"), "t": time.time()})
        return llm

    vllm_generation.LLM = LLM
    vllm_generation._colo_kit_real_LLM = real


def release_engines() -> None:
    """Drop the cached engines and give TRL back its own `LLM` (a no-op if `reuse_engines` was not called)."""
    from trl.generation import vllm_generation

    _ENGINES.clear()
    real = getattr(vllm_generation, "_colo_kit_real_LLM", None)
    if real is not None:
        vllm_generation.LLM = real
        vllm_generation._colo_kit_real_LLM = None
    gc.collect()
