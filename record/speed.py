"""How fast can colocated GRPO go on one GPU, and does it still learn as fast? (notebook 04's speed table)

TRL's defaults (`use_vllm=True, vllm_mode="colocate"`) leave most of a big GPU idle: a small batch, every activation
recomputed, a fresh generation for every optimizer step, a weight push of one `load_weights` call per tensor.
`CHAIN` adds one knob at a time, in TRL's `GRPOConfig` names where TRL has the knob (`SIDE`: variants beside it).
Every configuration trains the same random-weight model on the same prompts, group size, completion length and
learning rate for a fixed wall-time budget per seed (`run_seed`), and records steady-state completion tokens/s
(whole generation cycles of `steps_per_generation` optimizer steps, the first cycle left out: it holds the first
weight push, CUDA warm-up and the allocator's growth), the step split from TRL's own profiling timers
(`colo_kit.grpo.timeline`), NVML's peak beside the planner's, and the reward curve against wall time.

`record.race` judges the records against a threshold fixed by rule, not read off a run: half the distance
from where TRL's defaults (seed 0) start to the best reward (0, exactly `target_length` characters), reached when the
running mean over >= 64 completions gets there. A random-weight model under the length reward often *collapses* onto
one repeated short token (reward stuck near -236, zero spread in the group) instead of learning to stop early, and
which happens varies by seed: read the time to the threshold with its spread between seeds.
"""

from __future__ import annotations

import gc
import logging
import os
import statistics
import time

from colo_kit.memory.planner import H200_GIB

log = logging.getLogger(__name__)

# The task: the length reward on the tl;dr stand-ins, 256-token completions, G = 8. The learning rate is a tenth of
# notebook 00's 5e-3: at 5e-3 the random 1.5B model collapsed onto one repeated token within about 10 steps in
# every H200 run, so the race measured which token it collapsed onto; at 5e-4 the reward moves over 30-40 s and
# some runs learn to stop early (results/speed_1xh200.json). lr_scheduler "constant": the runs stop on a
# wall-time budget, not at max_steps, and a linear decay to max_steps would give each configuration a different
# learning rate at the same step.
TASK = dict(reward="length", target_length=20, num_generations=8, max_completion_length=256,
            learning_rate=5e-4, lr_scheduler_type="constant", vllm_gpu_memory_utilization=0.3, max_steps=100_000)
# A model whose float32 training state does not fit one GPU beside vLLM trains in bfloat16 (TRL's
# `model_init_kwargs`), every configuration alike and ZeRO-free: 7B's weights, gradients and AdamW states take about
# 113 GiB in float32 and about 57 GiB in bfloat16 (modelled, `colo-kit plan --model qwen2.5-7b --gpus 1`).
TRAIN_DTYPE = {"qwen2.5-7b": "bfloat16"}
WINDOW_COMPLETIONS = 64  # the running mean reward is over at least this many completions


def window_mean(rewards: list[float], per_gen: int) -> float | None:
    """The running mean reward (one entry per generation of `per_gen` completions) over the fewest last generations
    holding >= WINDOW_COMPLETIONS completions; None before. `race.running_reward` and `_Budget` both read it."""
    window = -(-WINDOW_COMPLETIONS // per_gen)
    return None if len(rewards) < window else sum(rewards[-window:]) / window
THRESHOLD_FRACTION = 0.5  # of the first generation's mean reward: half the distance to the best reward (0)
STOP_PAST_FRACTION = 0.45  # `speed.sh --stop-past-threshold` stops a seed here, a little past the threshold

# Each entry: (name, what it adds, GRPOConfig fields, the kit's own knobs). Each is the one before plus its knob.
CHAIN = [
    ("trl_defaults", "TRL 1.16's defaults for colocate mode", {"per_device_train_batch_size": 8}, {}),
    ("no_grad_ckpt", "gradient_checkpointing=False", {"gradient_checkpointing": False}, {}),
    ("no_detokenize", "generation_kwargs={'detokenize': False}", {"generation_kwargs": {"detokenize": False}}, {}),
    ("bucketed_push", "the weight push in one load_weights call", {}, {"push_bucket_mb": 0}),
    ("spg8", "steps_per_generation=8", {"steps_per_generation": 8}, {}),
    ("batch32", "per_device_train_batch_size=32", {"per_device_train_batch_size": 32}, {}),
]
NAMES = [c[0] for c in CHAIN]
# Beside the chain, each on top of another configuration: what `colo-kit plan --recommend` writes for the model
# (RECIPE, at the chain's batch of 8); two ways to sleep; less staleness than spg8; more training per generation.
# Each entry: (the configuration it builds on, what it adds, GRPOConfig fields, the kit's own knobs).
SIDE = {
    "sleep_l2": ("bucketed_push", "TRL's level-2 sleep", {"vllm_enable_sleep_mode": True}, {}),
    # the fastest of TRL's defaults where the engine and the trainer do not fit awake together (7B on 80 GB)
    "defaults_sleep": ("trl_defaults", "vllm_enable_sleep_mode=True", {"vllm_enable_sleep_mode": True}, {}),
    "sleep_kv": ("bucketed_push", "sleep that releases the KV cache only (colo_kit.colocate.kv_sleep)",
                 {"vllm_enable_sleep_mode": True}, {"kv_only_sleep": True}),
    # at batch 8 a step is mostly generation latency (0.6 s for 8 completions of 256 tokens), so sharing one
    # generation between 2 or 4 steps cuts most of it; whether the policy still learns as fast is what these measure
    "spg2": ("bucketed_push", "steps_per_generation=2", {"steps_per_generation": 2}, {}),
    "spg4": ("bucketed_push", "steps_per_generation=4", {"steps_per_generation": 4}, {}),
    # the reward moves per generation, not per optimizer step (generations_to_reward): num_iterations (GRPO's mu)
    # trains several times on each generation's completions, asking whether a generation can teach more
    "mu2": ("bucketed_push", "num_iterations=2", {"num_iterations": 2}, {}),
    "mu4": ("bucketed_push", "num_iterations=4", {"num_iterations": 4}, {}),
    # a generation of 32 costs about what one of 8 does (results/gen_latency_1xh200.json); still on-policy
    "batch32_on_policy": ("bucketed_push", "per_device_train_batch_size=32",
                          {"per_device_train_batch_size": 32}, {}),
    # steps on a stale generation learn little under DAPO's clip: a token whose ratio left [0.8, 1.2] in the
    # direction of its advantage gives no gradient. CISPO (TRL's loss_type="cispo") clips the importance weight and
    # keeps every token's gradient, so the 7 stale steps of each spg8 cycle might count as fresh ones do
    "cispo_spg8": ("spg8", "loss_type='cispo', epsilon_high=5.0", {"loss_type": "cispo", "epsilon_high": 5.0}, {}),
    "cispo_b16": ("spg8", "per_device_train_batch_size=16, loss_type='cispo', epsilon_high=5.0",
                  {"per_device_train_batch_size": 16, "loss_type": "cispo", "epsilon_high": 5.0}, {}),
    "cispo_b32": ("batch32", "loss_type='cispo', epsilon_high=5.0", {"loss_type": "cispo", "epsilon_high": 5.0}, {}),
    # twice the completions per generation for the same completions per step: only vLLM's bigger batch saves time
    # (at 32f45d7 generation fell from 0.265 to 0.220 s per step), and the staler steps needed 62-72 against 41-53
    "cispo_b16_spg16": ("cispo_b16", "steps_per_generation=16", {"steps_per_generation": 16}, {}),
}
RECIPE = "recipe"
ADDS = {**{c[0]: c[1] for c in CHAIN}, **{k: f"{v[0]} + {v[1]}" for k, v in SIDE.items()},
        RECIPE: "colo-kit plan --recommend"}
RECIPE_SKIPS = {"use_vllm", "vllm_mode", "bf16", "num_generations", "max_completion_length", "deepspeed"}


def config(name: str, model: str = "qwen2.5-1.5b", gpu_mem_gib: float = H200_GIB) -> tuple[dict, dict]:
    """GRPOConfig fields and kit knobs of configuration `name`: CHAIN up to it, a SIDE entry, or `model`'s recipe
    for a GPU of `gpu_mem_gib` (`run_seed` passes the one it runs on; the others do not depend on it)."""
    if name == RECIPE:
        from colo_kit.memory.recipe import recipe

        r = recipe(model=model, per_device_train_batch_size=8, max_completion_length=TASK["max_completion_length"],
                   train_dtype=TRAIN_DTYPE.get(model, "float32"), gpu_mem_gib=gpu_mem_gib)
        if not r["fits"]:
            raise ValueError(f"no recipe for {model}: {r['why']}")
        if r["plan"].zero_stage:  # the race launches one plain process per configuration, no DeepSpeed
            raise ValueError(f"the recipe for {model} needs ZeRO-{r['plan'].zero_stage}, which the race does not launch")
        fields = {k: v for k, v, _ in r["fields"] if k not in RECIPE_SKIPS and v is not None}
        return fields, {"push_bucket_mb": 0, **({"expandable_segments": True} if r["environment"] else {})}
    if name in SIDE:
        base, _, extra_fields, extra_knobs = SIDE[name]
        fields, knobs = config(base, model, gpu_mem_gib)
        return {**fields, **extra_fields}, {**knobs, **extra_knobs}
    if name not in NAMES:
        raise ValueError(f"configuration {name!r} is not one of {', '.join(NAMES + list(SIDE) + [RECIPE])}")
    fields, knobs = {}, {}
    if model in TRAIN_DTYPE:
        fields["model_init_kwargs"] = {"dtype": TRAIN_DTYPE[model]}
    for _, _, f, k in CHAIN[:NAMES.index(name) + 1]:
        fields.update(f)
        knobs.update(k)
    return fields, knobs


class _Budget:
    """A TrainerCallback that notes when training began and stops it `budget_s` later, but not before `min_steps`
    optimizer steps (two whole cycles: the steady state leaves the first out; a slow CPU had ended
    `steps_per_generation=8` inside its first cycle). With `stop_past` (a fraction of the first generation's mean
    reward) it also stops once `window_mean` gets that far: past the race's threshold (every run starts from the same
    model, so its first generation is within a fraction of a percent of the defaults'), the rest measures nothing."""

    def __new__(cls, budget_s: float, marks: dict, min_steps: int = 0, stop_past: float | None = None,
                per_gen: int = 1):
        from transformers import TrainerCallback

        rewards: list[float] = []

        class Budget(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                marks["train_begin"] = time.time()

            def on_step_end(self, args, state, control, **kw):
                if time.time() - marks["train_begin"] >= budget_s and state.global_step >= min_steps:
                    control.should_training_stop = True

            def on_log(self, args, state, control, logs=None, **kw):
                if stop_past is None or (logs or {}).get("reward") is None:
                    return
                rewards.append(logs["reward"])
                mean = window_mean(rewards, per_gen)
                if mean is not None and state.global_step >= min_steps and mean >= stop_past * rewards[0]:
                    marks["stopped_past_reward"] = state.global_step
                    control.should_training_stop = True

        return Budget()


def run_seed(name: str, *, model: str, seed: int, budget_s: float, num_prompts: int = 512,
             learning_rate: float | None = None, max_completion_length: int | None = None,
             stop_past: float | None = None) -> dict:
    """One configuration, one seed, in this process: train `budget_s` s (or to `stop_past`, see `_Budget`). The recipe
    is the one for the GPU here (its memory read by NVML; an H200's without one)."""
    from colo_kit.env import has_cuda
    from colo_kit.grpo.timeline import Timeline, UtilSampler
    from colo_kit.grpo.train import run_grpo
    from colo_kit.memory.planner import read_gpu_memory

    gpu = read_gpu_memory() if has_cuda() else None
    gpu_mem_gib = gpu["gib"] if gpu else H200_GIB
    fields, knobs = config(name, model, gpu_mem_gib)
    if knobs.get("expandable_segments"):  # the recipe's environment, set before this process's first CUDA allocation
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    tl, marks, hooked = Timeline(), {}, {}
    sampler = UtilSampler(pids={"trainer": os.getpid()}).start()

    def on_trainer(trainer):
        hooked["gen"] = getattr(trainer, "vllm_generation", None)
        tl.hook(trainer)

    settings = {**TASK, **fields}  # the recipe sizes the engine itself (vllm_gpu_memory_utilization)
    if learning_rate is not None:
        settings["learning_rate"] = learning_rate
    if max_completion_length is not None:  # the CPU smoke run: a cycle of the tiny model in about a second
        settings["max_completion_length"] = max_completion_length
    batch = settings["per_device_train_batch_size"]
    t_start = time.time()
    try:
        run = run_grpo(model, "colocate", seed=seed, num_prompts=num_prompts,
                       callbacks=[_Budget(budget_s, marks, min_steps=2 * cycle_steps(settings), stop_past=stop_past,
                                          per_gen=batch * (settings.get("steps_per_generation") or 1))],
                       on_trainer=on_trainer,
                       push_bucket_mb=knobs.get("push_bucket_mb"), kv_only_sleep=knobs.get("kv_only_sleep", False),
                       **settings)
    finally:
        tl.unhook()
        samples = sampler.stop()
    t0 = marks["train_begin"]
    spg = run.settings.get("steps_per_generation") or 1
    per_gen = batch * spg
    cycle = cycle_steps(run.settings)
    step_marks = sorted(tl.meta.get("steps", []), key=lambda s: s["end_s"])
    ends = {m["step"]: m["end_s"] for m in step_marks}
    rows = []
    for row in run.steps:
        step = int(row["step"])
        if step not in ends:
            continue
        keep = {k: v for k, v in row.items() if k.startswith(("sampling/", "completions/", "rewards/", "clip_ratio"))
                or k in ("reward", "reward_std", "loss", "entropy", "learning_rate")}
        rows.append({"step": step, "t_s": round(ends[step] - t0, 4), **keep})
    step_times = [round(b["end_s"] - a["end_s"], 4) for a, b in zip([{"end_s": t0}] + step_marks[:-1], step_marks)]
    rec = {
        "config": name, "seed": seed, "model": model, "budget_s": budget_s,
        "gpu": gpu["name"] if gpu else None, "gpu_mem_gib": gpu_mem_gib,
        "stop_past": stop_past, "stopped_past_reward_at_step": marks.get("stopped_past_reward"),
        "grpo_config": {k: v for k, v in run.settings.items() if isinstance(v, (int, float, str, bool, type(None)))},
        "generation_kwargs": fields.get("generation_kwargs"), "kit_knobs": knobs,
        "bucketed_push_applied": run.settings.get("bucketed_push", False),
        "push_calls": getattr(hooked.get("gen"), "push_calls", None),
        "completions_per_generation": per_gen, "steps_per_generation": spg, "steps_per_cycle": cycle,
        "startup_s": round(t0 - t_start, 2), "steps_done": len(step_marks),
        "step_times_s": step_times, "rows": rows,
        "steady": steady_state(rows, step_times, cycle, per_gen),
        "phase_s_per_step": phase_per_step(tl, skip_steps=cycle),
        "switch": switch_parts(tl, skip_steps=cycle),
        "nvml_peak_gib": max((s["mem_gib"] for s in samples if s.get("device", "").startswith("gpu")), default=None),
        "planner_peak_gib": planner_peak_for(name, model, settings["max_completion_length"], gpu_mem_gib)
        if has_cuda() else None,
        "torch_peak_gib": _torch_peaks() if has_cuda() else None,
    }
    del run
    gc.collect()
    if has_cuda():
        import torch

        torch.cuda.empty_cache()
    return rec


def _torch_peaks() -> dict:
    """PyTorch's peak allocated and reserved GiB here. vLLM without sleep allocates through the same allocator, so
    NVML's peak minus `reserved` is CUDA context, workspaces and the rest; `reserved` minus `allocated`, the slack."""
    import torch

    return {"allocated": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "reserved": round(torch.cuda.max_memory_reserved() / 2**30, 2)}


def cycle_steps(settings: dict) -> int:
    """Optimizer steps on one generation: TRL generates once per `steps_per_generation * num_iterations` steps."""
    return (settings.get("steps_per_generation") or 1) * (settings.get("num_iterations") or 1)


def steady_state(rows: list[dict], step_times: list[float], cycle: int, per_gen: int) -> dict:
    """Completion tokens/s over whole generation cycles, the first left out: a cycle's tokens are its generation's
    mean completion length (TRL logs it on the step that generated) times the completions it generated."""
    lengths = {r["step"]: r.get("completions/mean_length") for r in rows}
    cycles = []
    for i in range(0, len(step_times) - cycle + 1, cycle):
        first_step = i + 1  # TRL's global_step after the cycle's first optimizer step
        length = lengths.get(first_step)
        if length is None:
            continue
        cycles.append({"first_step": first_step, "seconds": round(sum(step_times[i:i + cycle]), 4),
                       "tokens": round(length * per_gen, 1)})
    measured = cycles[1:]
    seconds = sum(c["seconds"] for c in measured)
    return {"cycles": len(measured), "seconds": round(seconds, 3),
            "completion_tokens_per_s": round(sum(c["tokens"] for c in measured) / seconds, 1) if seconds else None,
            "s_per_step": round(seconds / (len(measured) * cycle), 4) if measured else None,
            "per_cycle": cycles}


def phase_totals(tl, skip_steps: int = 1) -> dict[str, dict[str, float]]:
    """Seconds per device per phase inside the timeline's window (`Timeline.window`)."""
    lo, hi = tl.window(skip_steps)
    out: dict[str, dict[str, float]] = {}
    for iv in tl.intervals:
        d = min(iv.end_s, hi) - max(iv.start_s, lo)
        if d > 0:
            out.setdefault(iv.device, {}).setdefault(iv.phase, 0.0)
            out[iv.device][iv.phase] += d
    return {dev: {p: round(v, 4) for p, v in ph.items()} for dev, ph in out.items()}


def phase_per_step(tl, skip_steps: int) -> dict:
    """Mean seconds per optimizer step in each phase after the first cycle, summed over TRL's timers."""
    totals = phase_totals(tl, skip_steps=skip_steps)
    marks = tl.meta.get("steps", [])
    n = max(len(marks) - skip_steps, 1)
    out = {}
    for phases in totals.values():
        for phase, seconds in phases.items():
            out[phase] = round(out.get(phase, 0.0) + seconds / n, 4)
    out["training"] = round(sum(out.get(p, 0.0) for p in ("forward", "backward", "optimizer")), 4)
    return out


def switch_total(parts: dict) -> float:
    """One switch from the parts' medians, each part counted as often as it comes per weight push: TRL wakes a
    level-2 engine twice per switch (its weights, then its KV cache), so a wake-up counts twice."""
    phases = {k: v for k, v in parts.items() if isinstance(v, dict)}
    pushes = phases.get("weight_sync", {}).get("n")
    return round(sum(v["median_s"] * (max(1, round(v["n"] / pushes)) if pushes else 1) for v in phases.values()), 4)


def switch_parts(tl, skip_steps: int) -> dict:
    """The switch from training to generation, by part: each weight push (and sleep/wake-up, if on), medians."""
    marks = sorted(tl.meta.get("steps", []), key=lambda s: s["end_s"])
    start = marks[skip_steps - 1]["end_s"] if len(marks) >= skip_steps > 0 else float("-inf")
    out = {}
    for phase in ("weight_sync", "sleep", "wake_up"):
        times = [iv.end_s - iv.start_s for iv in tl.intervals if iv.phase == phase and iv.start_s >= start]
        if times:
            out[phase] = {"n": len(times), "median_s": round(statistics.median(times), 4)}
    out["switch_median_s"] = switch_total(out)
    return out


def planner_estimate(model: str, per_device_train_batch_size: int, gradient_checkpointing: bool,
                     max_completion_length: int = TASK["max_completion_length"],
                     vllm_gpu_memory_utilization: float = TASK["vllm_gpu_memory_utilization"], sleep_level: int = 0,
                     kv_only_sleep: bool = False, gpu_mem_gib: float = H200_GIB,
                     expandable_segments: bool = False) -> dict:
    from colo_kit.memory.planner import estimate

    return estimate(model=model, per_device_train_batch_size=per_device_train_batch_size,
                    expandable_segments=expandable_segments,
                    gradient_checkpointing=gradient_checkpointing, max_completion_length=max_completion_length,
                    vllm_gpu_memory_utilization=vllm_gpu_memory_utilization, sleep_level=sleep_level,
                    kv_only_sleep=kv_only_sleep, train_dtype=TRAIN_DTYPE.get(model, "float32"), gpu_mem_gib=gpu_mem_gib)


def _planner_estimate_for(name: str, model: str, max_completion_length: int, gpu_mem_gib: float = H200_GIB) -> dict:
    fields, knobs = config(name, model, gpu_mem_gib)
    return planner_estimate_for_record({"model": model, "kit_knobs": knobs, "gpu_mem_gib": gpu_mem_gib,
                                        "grpo_config": {**fields, "max_completion_length": max_completion_length}})


def planner_estimate_for_record(rec: dict) -> dict:
    """The planner's estimate for the settings a race record ran with (its own `grpo_config`, not what its
    configuration's name means now: the runs named `recipe` ran each recipe of their day), on the GPU it ran on (an
    H200 for records older than `gpu_mem_gib`)."""
    g = rec["grpo_config"]
    sleeps = bool(g.get("vllm_enable_sleep_mode") or g.get("sleep"))  # `sleep`: the kit's name before 40e0da9
    return planner_estimate(rec["model"], g["per_device_train_batch_size"], g.get("gradient_checkpointing", True),
                            g.get("max_completion_length", TASK["max_completion_length"]),
                            g.get("vllm_gpu_memory_utilization", TASK["vllm_gpu_memory_utilization"]),
                            2 if sleeps else 0, bool(sleeps and (rec.get("kit_knobs") or {}).get("kv_only_sleep")),
                            rec.get("gpu_mem_gib") or H200_GIB, bool((rec.get("kit_knobs") or {}).get("expandable_segments")))


def planner_peak_for(name: str, model: str, max_completion_length: int = TASK["max_completion_length"],
                     gpu_mem_gib: float = H200_GIB) -> float:
    """The planner's peak for configuration `name` (its batch, checkpointing, memory share and sleep) on a GPU of
    `gpu_mem_gib`."""
    return _planner_estimate_for(name, model, max_completion_length, gpu_mem_gib)["peak_gib_per_gpu"]


def latency_table(result: dict) -> list[dict]:
    """One row per variant and batch of `scripts/gpu/gen_latency.py`'s JSON: how long one generation takes alone."""
    return [{"variant": name, "commit": v.get("commit", result.get("commit")), "sequences": r["batch"],
             "sampling": ", ".join(f"{k}={v}" for k, v in r["sampling"].items()) or "TRL's (logprobs=0, detokenize=False)",
             "median s": r["median_s"], "ms per decoding step": r["ms_per_decoding_step"], "tokens/s": r["tok_per_s"]}
            for name, v in result["variants"].items() for r in v.get("runs", [])]
