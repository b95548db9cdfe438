"""Loading new weights into a running vLLM engine, on a GPU and on vLLM's CPU build (notebook 02). vLLM-CPU repacks
linear weights after loading, and its layer-wise `reload_weights` re-processes one layer of a tied parameter only, so
with tied embeddings (Qwen2.5 0.5B/1.5B, the tiny model) the LM head is re-tied and re-processed after every load.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterable
from contextlib import contextmanager

import torch


def model_runner(llm):
    """The in-process model runner of an `LLM` (external_launcher, or V1 without multiprocessing)."""
    return llm.llm_engine.model_executor.driver_worker.model_runner


def load_weights(llm, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load `(name, tensor)` pairs (Hugging Face names) into the engine's model, then reset the prefix cache."""
    load_into_runner(model_runner(llm), named_tensors)
    llm.reset_prefix_cache()


def load_into_runner(runner, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """The load itself, on a worker's model runner (in-process, or via `colo_kit.serving.server.HttpWeightSync`)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and hasattr(runner, "reload_weights"):
        runner.reload_weights(weights_iterator=iter(named_tensors), is_checkpoint_format=True)
        _refresh_tied_lm_head(runner.get_model())
    else:
        # on a GPU vLLM's per-layer loaders stay in place: a plain load, one call for all tensors
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
    """Stop an in-process engine and free its memory while CUDA is still alive (vLLM #16993's segfault at exit)."""
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
    """Before this process builds another engine: collect dropped engines, hand PyTorch's cached blocks back to the
    driver (vLLM checks at start-up that its share is free), and give the engine its own CUDA-graph pool: vLLM's
    process-wide pool fails the next capture (`use_count > 0 INTERNAL ASSERT`) once an earlier engine is gone."""
    from vllm.platforms import current_platform

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    platform_cls = type(current_platform)
    if current_platform.is_cuda_alike() and getattr(platform_cls, "_global_graph_pool", None) is not None:
        platform_cls._global_graph_pool = None


@contextmanager
def stdout_with_fd():
    """Use the process's real stdout while vLLM dup2s `sys.stdout.fileno()`, which a Jupyter kernel's stdout lacks."""
    saved = sys.stdout
    try:
        sys.stdout.fileno()
    except Exception:
        if sys.__stdout__ is not None:
            sys.stdout = sys.__stdout__
    try:
        yield
    finally:
        sys.stdout = saved
