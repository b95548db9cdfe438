"""Loading new weights into a running vLLM engine, on a GPU and on vLLM's CPU build.

On a CPU `load_weights` is more than `model.load_weights(...)`: vLLM-CPU repacks each linear weight for its GEMM
kernels after loading and keeps the packed copy in a closure, so a later load fails (`'Parameter' object has no
attribute 'weight_loader'`, vLLM-CPU 0.31) or is never seen by the kernel; vLLM's layer-wise reload
(`model_runner.reload_weights(weights_iterator=...)`) re-runs that processing, for every tensor in one call. It
processes a tied parameter for one of its layers only (documented in vllm/model_executor/model_loader/reload):
with tied embeddings (Qwen2.5 0.5B/1.5B, the kit's tiny model) the LM head kept its stale copy and generation
drifted from the trainer (an exploratory run: a 2-nat log-prob gap in 20 steps, GRPO's importance ratios at 0),
so the head is re-tied and re-processed after every load.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager

import torch


def model_runner(llm):
    """The in-process model runner of an `LLM` (external_launcher, or V1 without multiprocessing)."""
    return llm.llm_engine.model_executor.driver_worker.model_runner


def load_weights(llm, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load `(name, tensor)` pairs (Hugging Face names) into the engine's model, then reset the
    prefix cache (cached KV blocks were computed with the old weights)."""
    load_into_runner(model_runner(llm), named_tensors)
    llm.reset_prefix_cache()


def load_into_runner(runner, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """The load itself, on a worker's model runner (in-process, or via `colo_kit.serving.server.HttpWeightSync`)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and hasattr(runner, "reload_weights"):
        runner.reload_weights(weights_iterator=iter(named_tensors), is_checkpoint_format=True)
        _refresh_tied_lm_head(runner.get_model())
    else:
        # GPU: vLLM's per-layer loaders stay in place, so a plain load works; one call for all
        # tensors instead of one per tensor.
        runner.get_model().load_weights(list(named_tensors))


def _refresh_tied_lm_head(model) -> None:
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    config = getattr(model, "config", None)
    if lm_head is None or embed is None or not getattr(config, "tie_word_embeddings", False):
        return
    lm_head.weight = embed.weight
    method = getattr(lm_head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(lm_head)


def shutdown(llm) -> None:
    """Stop an in-process engine and free its memory while CUDA is still alive (an engine collected at
    interpreter exit, after CUDA, is how vLLM #16993's segfault happened)."""
    import gc

    engine = getattr(llm, "llm_engine", None)
    for target in (getattr(engine, "engine_core", None), engine, llm):
        if target is not None and hasattr(target, "shutdown"):
            try:
                target.shutdown()
                break
            except Exception:  # a half-built engine: collect what there is
                pass
    del llm, engine
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def make_room_for_an_engine() -> None:
    """Before this process builds another engine: collect unreferenced engines and hand PyTorch's cached GPU
    blocks back to the driver (vLLM checks at start-up that its share is free, and a dropped engine's 0.3 of an
    H200 still counts as used while cached), then give the engine its own CUDA-graph pool."""
    import gc

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    fresh_cuda_graph_pool()


def fresh_cuda_graph_pool() -> bool:
    """Give the next engine of this process its own CUDA-graph pool; True if the old one was dropped. vLLM captures
    every engine's graphs into one process-wide handle (`Platform._global_graph_pool`), which PyTorch keeps listing
    once released, so after an earlier engine is gone the next capture fails: `it->second->use_count > 0 INTERNAL
    ASSERT FAILED at CUDACachingAllocator.cpp` (H200, vLLM 0.26: a cell run twice, a test suite). A new handle
    makes a new pool."""
    from vllm.platforms import current_platform

    cls = type(current_platform)
    if not current_platform.is_cuda_alike() or getattr(cls, "_global_graph_pool", None) is None:
        return False
    cls._global_graph_pool = None
    return True


@contextmanager
def stdout_with_fd():
    """vLLM silences C-level prints while making its groups by dup2-ing `sys.stdout.fileno()`, which a Jupyter
    kernel's stdout may lack (io.UnsupportedOperation: fileno): use the process's real stdout meanwhile."""
    import sys

    try:
        sys.stdout.fileno()
        swap = False
    except Exception:
        swap = sys.__stdout__ is not None
    saved = sys.stdout
    if swap:
        sys.stdout = sys.__stdout__
    try:
        yield
    finally:
        sys.stdout = saved
