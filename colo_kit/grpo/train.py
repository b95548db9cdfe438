"""GRPO runs with TRL's `GRPOTrainer`, the way every notebook starts one (notebook 00 first): `run_grpo` in one of three
modes, `colocate` (vLLM inside the training process, TRL PR #3394), `server` (a vLLM server over HTTP) or `plain`
(transformers' `generate`, the reference curve), returning the per-step log; on CPU with `use_cpu=True`."""

from __future__ import annotations

import inspect
import os
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path

import colo_kit
from colo_kit.data import load_tldr
from colo_kit.env import has_cuda, vllm_eager
from colo_kit.gpu_free import check_share
from colo_kit.grpo.train_checks import check_settings
from colo_kit.models import resolve_model
from colo_kit.paths import runs_dir
from colo_kit.procs import claim_rendezvous_port


@dataclass
class GRPORun:
    """What a notebook plots: one dict per optimizer step, plus the settings that produced it."""

    mode: str
    settings: dict
    steps: list[dict] = field(default_factory=list)
    elapsed_s: float = 0.0
    output_dir: str = ""

    def series(self, key: str) -> list[float]:
        return [s[key] for s in self.steps if key in s]

    @property
    def rewards(self) -> list[float]:
        return self.series("reward")

    def to_dict(self) -> dict:
        return asdict(self)


def use_layerwise_reload(trainer) -> bool:
    """On vLLM's CPU engine, whose per-tensor load fails or leaves a tied LM head stale (colocate.vllm_compat), make TRL's
    colocate weight sync correct; True when applied (never on a GPU)."""
    gen = getattr(trainer, "vllm_generation", None)
    if gen is None or getattr(gen, "mode", None) != "colocate":
        return False
    from vllm.platforms import current_platform

    from colo_kit.colocate.vllm_compat import load_weights

    if not current_platform.is_cpu():
        return False
    original = type(gen).sync_weights

    def sync_weights(self):
        if self.enable_sleep_mode:  # vLLM-CPU has no sleep mode; keep TRL's path so its error shows
            return original(self)
        load_weights(self.llm, self._iter_named_params())

    gen.sync_weights = types.MethodType(sync_weights, gen)
    return True


def grpo_config(mode: str = "colocate", *, output_dir: str | Path, max_steps: int = 20,
                num_generations: int = 4, per_device_train_batch_size: int = 8, max_completion_length: int = 32,
                learning_rate: float = 1e-3, seed: int = 0, vllm_gpu_memory_utilization: float = 0.3,
                vllm_enable_sleep_mode: bool = False, vllm_server_base_url: str | None = None, beta: float = 0.0,
                **overrides):
    """A `GRPOConfig` for one of the three modes, with settings that work on CPU and GPU."""
    from trl import GRPOConfig

    check_settings(mode, max_steps=max_steps, num_generations=num_generations,
                   per_device_train_batch_size=per_device_train_batch_size,
                   vllm_gpu_memory_utilization=vllm_gpu_memory_utilization, vllm_server_base_url=vllm_server_base_url,
                   vllm_server_host=overrides.get("vllm_server_host"))
    gpu = has_cuda()
    kwargs = dict(
        output_dir=str(output_dir), max_steps=max_steps, num_generations=num_generations,
        per_device_train_batch_size=per_device_train_batch_size, max_completion_length=max_completion_length,
        learning_rate=learning_rate, seed=seed, beta=beta, logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=not gpu, bf16=gpu, use_vllm=mode != "plain", disable_tqdm=False,
    )
    if not gpu:  # a tiny model has no memory to save by recomputing; on a GPU TRL's default (on) stays
        kwargs["gradient_checkpointing"] = False
        kwargs["ddp_find_unused_parameters"] = False  # nothing in the tiny model goes unused
    if mode == "colocate":
        kwargs.update(vllm_mode="colocate", vllm_gpu_memory_utilization=vllm_gpu_memory_utilization,
                      vllm_enable_sleep_mode=vllm_enable_sleep_mode)
    elif mode == "server":
        kwargs.update(vllm_mode="server", vllm_server_base_url=vllm_server_base_url)
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


def _reward_funcs(reward, target_length: int):
    from colo_kit.grpo.rewards import make_length_reward, math500_reward

    if callable(reward):
        return [reward]
    if reward == "length":
        return [make_length_reward(target_length)]
    if reward == "math500":
        return [math500_reward]
    raise ValueError(f"reward={reward!r}; use 'length', 'math500' or a TRL reward function")


def _step_log(run: GRPORun, on_step=None):
    """A TrainerCallback that keeps each logged step's numbers (reward, lengths, timings) in `run.steps`."""
    from transformers import TrainerCallback

    class StepLog(TrainerCallback):
        def __init__(self):
            self.t_last = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if not logs or "reward" not in logs:
                return
            now = time.perf_counter()
            row = {"step": state.global_step, "wall_s": round(now - self.t_last, 4)}
            self.t_last = now
            row.update({key: float(value) for key, value in logs.items() if isinstance(value, (int, float))})
            run.steps.append(row)
            if on_step is not None:
                on_step(row)

    return StepLog()


def run_grpo(model: str = "tiny", mode: str = "colocate", *, reward="length", dataset=None, num_prompts: int = 256,
             max_steps: int = 20, num_generations: int = 4, per_device_train_batch_size: int = 8,
             max_completion_length: int = 32, learning_rate: float = 1e-3, seed: int = 0, target_length: int = 20,
             vllm_gpu_memory_utilization: float = 0.3, vllm_enable_sleep_mode: bool = False,
             vllm_server_base_url: str | None = None, output_dir: str | Path | None = None, callbacks=(), on_step=None,
             on_trainer=None, http_weight_sync: bool = False, vllm_enforce_eager: bool | None = None,
             push_bucket_mb: float | None = None, kv_only_sleep: bool = False, **config_overrides) -> GRPORun:
    """Train with TRL's GRPOTrainer and return the per-step log.

    `GRPOConfig` fields take TRL's names and any other passes through (`beta=0.04`); `dataset` defaults to the tl;dr
    prompts. `on_step(row)` runs after each logged step, `on_trainer(trainer)` before training. The kit's own:
    `http_weight_sync` (serving.server), `vllm_enforce_eager` (an engine starts in seconds, decodes more slowly),
    `push_bucket_mb` (colocate.bucketed_push), `kv_only_sleep` (colocate.kv_sleep).
    """
    if kv_only_sleep and not vllm_enable_sleep_mode:  # refused before a model loads
        raise ValueError("kv_only_sleep=True changes how the engine sleeps: it needs vllm_enable_sleep_mode=True")
    if mode == "colocate" and vllm_enable_sleep_mode and not has_cuda():  # pydantic's error would come after the load
        from colo_kit.colocate.sleep import SleepModeUnavailable

        raise SleepModeUnavailable.for_this_platform("kv_only_sleep=True" if kv_only_sleep else "vllm_enable_sleep_mode=True")
    expandable = "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower()
    if expandable and vllm_enable_sleep_mode:  # vLLM's sleep-mode memory pool asserts this after the model loads
        raise ValueError("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True cannot run with vllm_enable_sleep_mode=True: "
                         "unset the variable, or turn sleep mode off")
    colo_kit.setup()  # before TRL builds an engine: vLLM-CPU's settings, thread counts
    from trl import GRPOTrainer

    from colo_kit.colocate.engine import trl_llm_overrides
    from colo_kit.colocate.vllm_compat import make_room_for_an_engine, stdout_with_fd

    model_path = resolve_model(model)
    if dataset is None:
        dataset = load_tldr()
        dataset = dataset.select(range(min(num_prompts, len(dataset))))
    output_dir = Path(output_dir or runs_dir() / f"grpo-{mode}-{int(time.time())}")
    fields = dict(max_steps=max_steps, num_generations=num_generations, per_device_train_batch_size=per_device_train_batch_size,
                  max_completion_length=max_completion_length, learning_rate=learning_rate, seed=seed,
                  vllm_gpu_memory_utilization=vllm_gpu_memory_utilization, vllm_enable_sleep_mode=vllm_enable_sleep_mode,
                  **config_overrides)
    settings = dict(model=model, mode=mode, target_length=target_length, **fields)
    if vllm_enforce_eager is not None:
        settings["vllm_enforce_eager"] = vllm_enforce_eager
    args = grpo_config(mode, output_dir=output_dir, vllm_server_base_url=vllm_server_base_url, **fields)
    settings["gradient_checkpointing"] = args.gradient_checkpointing
    settings["expandable_segments"] = expandable
    run = GRPORun(mode=mode, settings=settings, output_dir=str(output_dir))
    sync = None
    if mode == "server":
        from colo_kit.serving.server import send_server_key, use_http_weight_sync

        send_server_key()  # the server's key, from the process that started it or $VLLM_API_KEY
        sync = use_http_weight_sync(force=http_weight_sync)
        settings["http_weight_sync"] = bool(sync)
    try:
        if mode == "colocate":
            claim_rendezvous_port()  # vLLM's group in this process; TRL's picker would try 29500 first
            make_room_for_an_engine()  # TRL builds an engine: free what dropped ones held, a graph pool of its own
            # another kernel's engine on this GPU: one line now, not vLLM's assert after the model loads
            check_share(vllm_gpu_memory_utilization, int(os.environ.get("LOCAL_RANK", 0)))
        if vllm_enforce_eager is None and vllm_eager(False):  # COLO_KIT_VLLM_EAGER=1 (GPU test suites)
            vllm_enforce_eager = settings["vllm_enforce_eager"] = True
        extra_llm_kwargs = {"enforce_eager": True} if vllm_enforce_eager and mode == "colocate" else {}
        # colocate mode builds vLLM here; in a Jupyter kernel it needs a real fd
        with stdout_with_fd(), trl_llm_overrides(**extra_llm_kwargs):
            trainer = GRPOTrainer(model=model_path, reward_funcs=_reward_funcs(reward, target_length), args=args,
                                  train_dataset=dataset, callbacks=[_step_log(run, on_step), *callbacks])
        settings["layerwise_reload_patch"] = use_layerwise_reload(trainer)
        if push_bucket_mb is not None:
            from colo_kit.colocate.bucketed_push import use_bucketed_push

            settings["bucketed_push"] = use_bucketed_push(trainer, push_bucket_mb)
        if kv_only_sleep:
            from colo_kit.colocate.kv_sleep import use_kv_sleep

            settings["kv_only_sleep"] = use_kv_sleep(trainer)
        if on_trainer is not None:
            on_trainer(trainer)
        t0 = time.perf_counter()
        trainer.train()
    finally:
        if sync is not None:  # TRL's own NCCL sync back for whatever this process runs next
            sync.restore()
    run.elapsed_s = round(time.perf_counter() - t0, 2)
    run.trainer = trainer  # not serialised; lets a notebook save or evaluate the trained model
    return run


# run_grpo's defaults, read once at import, so `colo-kit train` runs what `run_grpo()` runs
RUN_DEFAULTS = {k: p.default for k, p in inspect.signature(run_grpo).parameters.items()
                if p.default is not inspect.Parameter.empty}
