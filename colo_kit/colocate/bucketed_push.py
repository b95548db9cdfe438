"""The weight push in buckets: one `load_weights` call per bucket instead of TRL's one per tensor (about 340 round
trips for Qwen2.5-1.5B; SkyRL, slime and vLLM's IPC buffers batch it too). Notebook 04. Under ZeRO-3 and PEFT a bucket
would hold tensors freed or unmerged by then, so there TRL's per-tensor loop is kept.
"""

from __future__ import annotations

import logging
import types

log = logging.getLogger(__name__)


def buckets(named_tensors, bucket_bytes: int):
    """Group `(name, tensor)` pairs into lists of at least `bucket_bytes` (the last may be smaller; `<= 0`: one list)."""
    bucket, size = [], 0
    for name, tensor in named_tensors:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if 0 < bucket_bytes <= size:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def use_bucketed_push(trainer, bucket_mb: float = 0) -> bool:
    """Make this trainer's colocated weight push load `bucket_mb` MiB per `load_weights` call (0: one call). Returns
    True when applied; the push counts its calls in `gen.push_calls`."""
    gen = getattr(trainer, "vllm_generation", None)
    if gen is None or getattr(gen, "mode", None) != "colocate":
        return False
    from accelerate.utils import is_peft_model  # the check TRL's walk makes

    if is_peft_model(gen.model):
        log.info("PEFT merges adapters only for the length of TRL's walk: TRL's per-tensor weight push is kept")
        return False
    plugin = getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "deepspeed_plugin", None)
    if getattr(plugin, "zero_stage", 0) == 3:
        log.info("ZeRO-3 gathers one parameter at a time: TRL's per-tensor weight push is kept")
        return False
    from vllm.platforms import current_platform

    from colo_kit.colocate.vllm_compat import load_weights, model_runner

    bucket_bytes = int(bucket_mb * 2**20)
    gen.push_calls = 0

    def sync_weights(self):
        if self.enable_sleep_mode:  # as TRL does: map the weights' memory again before writing into it
            from trl.generation.vllm_generation import empty_cache

            empty_cache()
            self.llm.wake_up(tags=["weights"])
            self._llm_weights_sleeping = False
        if current_platform.is_cpu():  # vLLM-CPU needs its layer-wise reload (colo_kit.colocate.vllm_compat)
            load_weights(self.llm, self._iter_named_params())
            self.push_calls += 1
            return
        model = model_runner(self.llm).model
        for bucket in buckets(self._iter_named_params(), bucket_bytes):
            model.load_weights(bucket)
            self.push_calls += 1
        self.llm.reset_prefix_cache()

    gen.sync_weights = types.MethodType(sync_weights, gen)
    return True
