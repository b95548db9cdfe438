"""Building the colocated engine of notebook 02: `ColocateSettings` (its sizes from the training settings) and TRL's
own `VLLMGeneration` made with the `LLM(...)` arguments the kit changes (`kit_llm_overrides`)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

from colo_kit.env import has_cuda, vllm_eager

# TRL's prefill step: vLLM's profiler, fed its default (up to 32768), finds no room in a small utilisation
DEFAULT_MAX_NUM_BATCHED_TOKENS = 4096


@dataclass(frozen=True)
class ColocateSettings:
    """The training settings an engine is sized from, named as in TRL's `GRPOConfig`."""

    vllm_tensor_parallel_size: int = 1
    per_device_train_batch_size: int = 4
    gradient_accumulation_steps: int = 1
    max_prompt_length: int = 256
    max_completion_length: int = 256
    vllm_gpu_memory_utilization: float = 0.3
    vllm_enable_sleep_mode: bool = False

    @property
    def max_num_seqs(self) -> int:
        """Sequences one engine runs at once: its TP group's prompts for a whole accumulation."""
        return self.per_device_train_batch_size * self.vllm_tensor_parallel_size * self.gradient_accumulation_steps

    @property
    def max_model_len(self) -> int:
        return self.max_prompt_length + self.max_completion_length

    def validate(self, world_size: int, model_max_len: int | None = None) -> "ColocateSettings":
        """Raise ValueError naming the bad value and the fix; return self when all is well."""
        for name in ("vllm_tensor_parallel_size", "per_device_train_batch_size", "gradient_accumulation_steps",
                     "max_prompt_length", "max_completion_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        tp = self.vllm_tensor_parallel_size
        if world_size % tp:
            choices = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(f"vllm_tensor_parallel_size={tp} does not divide the world size {world_size}: every TP "
                             f"group needs the same number of ranks; use one of {choices}")
        u = self.vllm_gpu_memory_utilization
        if not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"vllm_gpu_memory_utilization={u!r} is outside (0, 1]: it is the share of each GPU "
                             "the engine may take (the post uses 0.3 for a 1.5B model beside its trainer)")
        if model_max_len is not None and self.max_model_len > model_max_len:
            raise ValueError(f"max_prompt_length + max_completion_length = {self.max_prompt_length} + "
                             f"{self.max_completion_length} = {self.max_model_len} exceeds the model's limit of "
                             f"{model_max_len} tokens (max_position_embeddings); shorten the prompt or the completion")
        return self


def kit_llm_overrides(settings: ColocateSettings, *, enforce_eager: bool | None = None) -> dict:
    """What the kit changes in the `LLM(...)` call of TRL's `VLLMGeneration._init_vllm` (TRL's value in brackets):
    - `max_num_batched_tokens` (4096): raised to `max_model_len`, which vLLM needs without chunked prefill (CPU).
    - `dtype`, `enforce_eager` (vLLM's defaults): on a CPU torch.compile costs ~8 s and buys nothing.
    - `enable_sleep_mode` (TRL sleeps at level 2 after every generation): `colo_kit.colocate.sleep` sleeps by tags."""
    return {"max_num_batched_tokens": max(DEFAULT_MAX_NUM_BATCHED_TOKENS, settings.max_model_len),
            "dtype": "auto",
            "enforce_eager": vllm_eager(not has_cuda()) if enforce_eager is None else enforce_eager,
            "enable_sleep_mode": settings.vllm_enable_sleep_mode}


class _Accelerator(SimpleNamespace):
    """What TRL's `VLLMGeneration` reads from accelerate's `Accelerator`, for a process group made without one."""

    def wait_for_everyone(self):
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()


@contextmanager
def trl_llm_overrides(**overrides):
    """While the block runs, TRL's `LLM(...)` call gets `overrides` on top of its own arguments; yields a dict then
    holding `"trl"` (TRL's arguments) and `"built"` (what `LLM` got)."""
    from trl.generation import vllm_generation

    real_llm, seen = vllm_generation.LLM, {}

    def llm_with_overrides(*args, **trl_kwargs):
        seen["trl"] = dict(trl_kwargs)
        seen["built"] = {**trl_kwargs, **overrides}
        return real_llm(*args, **seen["built"])

    vllm_generation.LLM = llm_with_overrides
    try:
        yield seen
    finally:
        vllm_generation.LLM = real_llm


def build_trl_generation(model_path: str, settings: ColocateSettings, *, rank: int, local_rank: int, world_size: int,
                         **overrides):
    """TRL's colocate-mode `VLLMGeneration`, made by its own `__init__`; returns it, TRL's `LLM` args and the engine's."""
    import torch
    from trl.generation.vllm_generation import VLLMGeneration

    stand_in = torch.nn.Module()  # TRL reads the model's path from it, and scans it for bitsandbytes layers
    stand_in.name_or_path = model_path
    accelerator = _Accelerator(process_index=rank, local_process_index=local_rank, num_processes=world_size,
                               is_main_process=rank == 0, state=_backend_state(stand_in))
    with trl_llm_overrides(**overrides) as seen:
        gen = VLLMGeneration(
            stand_in, accelerator, None, mode="colocate", tensor_parallel_size=settings.vllm_tensor_parallel_size,
            gpu_memory_utilization=float(settings.vllm_gpu_memory_utilization),
            max_model_length=settings.max_model_len, max_num_seqs=settings.max_num_seqs,
            enable_sleep_mode=False)  # TRL's own sleeping stays off: colo_kit.colocate.sleep sleeps by tags
    return gen, seen.get("trl", {}), seen.get("built", {})


def _backend_state(model) -> SimpleNamespace:
    """What TRL's `DistributedBackend` reads from `accelerator.state`: ZeRO-3 when DeepSpeed partitioned the model."""
    zero3 = any(hasattr(p, "ds_id") for p in model.parameters())
    return SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3) if zero3 else None, fsdp_plugin=None)
