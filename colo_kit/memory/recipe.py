"""A GRPO recipe for one machine (notebook 04): `GRPOConfig` fields in TRL's names, each with why, as the YAML `TrlParser`
reads (`colo-kit plan --recommend`, then `colo-kit train --config`). Memory comes from the planner (modelled), speed
choices from the H200 runs in `results/speed_1xh200.json` (measured).
"""

from __future__ import annotations

from dataclasses import replace

from colo_kit.memory.planner import SAFE_FRACTION, Plan, estimate, generation_share, model_shape, recommend

MEASURED = "results/speed_1xh200.json"
TRL_DEFAULT_UTILIZATION = 0.3  # TRL's default and the posts' value; the setting the H200 runs used
STALE_FROM_PARAMS = 7e9  # from this size, two steps per generation under TRL's loss (7B); below it, CISPO on 8 (1.5B)
CISPO_STEPS, CISPO_MIN_BATCH = 8, 16
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


def whole_groups(batch: int, steps: int, gpus: int, num_generations: int) -> int:
    """The smallest batch >= `batch` whose generation holds whole groups of `num_generations` (TRL refuses any other)."""
    while (batch * gpus * steps) % num_generations:
        batch += 1
    return batch


def recipe(plan: Plan | None = None, num_generations: int = 8, **settings) -> dict:
    """{"fields": [(name, value, why)], "model", "comments", "plan", "peak_gib_per_gpu", "fits"} for `plan`. Before giving
    up a generation shared between steps it sizes the engine to one generation, then recomputes activations, then sleeps."""
    base = replace(plan or Plan(), **settings).validate()
    if base.mode != "colocate":
        raise ValueError(f"mode={base.mode!r}: the recipe is for colocate mode (server mode sizes its server apart)")
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 2:
        raise ValueError(f"num_generations={num_generations!r}: GRPO compares at least 2 completions per prompt")
    asked_batch = base.per_device_train_batch_size
    base = replace(base, steps_per_generation=1, expandable_segments=True,
                   per_device_train_batch_size=whole_groups(asked_batch, 1, base.gpus, num_generations))
    budget = SAFE_FRACTION * base.gpu_mem_gib

    def fits(candidate: Plan) -> bool:
        est = estimate(candidate)
        return est["peak_gib_per_gpu"] <= budget and est["fits_host"]

    no_ckpt = replace(base, gradient_checkpointing=False)
    at_default = replace(no_ckpt, vllm_gpu_memory_utilization=TRL_DEFAULT_UTILIZATION, sleep_level=0)
    if fits(at_default):
        chosen, ckpt_why = at_default, (f"training fits without recomputing activations, and at 1.5B the step is "
                                        f"about 10% shorter (measured, {MEASURED})")
    else:
        # Cheapest first, ZeRO last: its optimizer offload took 19-20 s per 7B step on two H200s (results/zero3_run.json)
        # against 1.8 s for TRL's defaults unsharded on one (results/speed_1xh200.json).
        for ckpt, add_zero in ((False, False), (True, False), (False, True), (True, True)):
            rec = recommend(replace(base, gradient_checkpointing=ckpt), add_zero=add_zero)
            if rec["fits"]:
                break
        else:
            return {"fits": False, "why": rec["why"], "fields": [], "comments": [], "plan": base,
                    "model": base.model, "peak_gib_per_gpu": None}
        planned = ("vllm_gpu_memory_utilization", "sleep_level", "vllm_tensor_parallel_size", "zero_stage",
                   "offload_optimizer", "expandable_segments")
        chosen = replace(base, gradient_checkpointing=ckpt, **{k: rec[k] for k in planned})
        ckpt_why = ("without it the activations do not fit (modelled)" if ckpt else
                    "training fits without recomputing activations once the engine is sized by the planner")
    big = model_shape(chosen.model).num_params() >= STALE_FROM_PARAMS
    # the engine then holds every sequence of the steps that share one generation
    steps = 2 if big else CISPO_STEPS
    stale_batch = whole_groups(chosen.per_device_train_batch_size if big else max(asked_batch, CISPO_MIN_BATCH),
                               steps, chosen.gpus, num_generations)
    stale = replace(chosen, steps_per_generation=steps, per_device_train_batch_size=stale_batch)
    share = generation_share(stale)
    sized = replace(stale, vllm_gpu_memory_utilization=share, sleep_level=0, expandable_segments=True)
    recomputed = f"without it the activations of batch {stale_batch} do not fit beside the engine (modelled)"
    # (candidate, why checkpointing is on or off, engine sized to one generation?), cheapest first
    as_chosen = [(stale, ckpt_why, False)]
    tries = [*(as_chosen if not stale.sleep_level else []), (sized, ckpt_why, True),
             *(as_chosen if stale.sleep_level else []), (replace(sized, gradient_checkpointing=True), recomputed, True),
             (replace(sized, gradient_checkpointing=True, sleep_level=2, expandable_segments=False), recomputed, True)]
    shared, fallback_why = next(((c, why, s) for c, why, s in tries if fits(c)), None), None
    if shared:
        chosen, ckpt_why, sized_share = shared
    else:
        sized_share = False
        last = estimate(tries[-1][0])
        fallback_why = (f"TRL's default (on-policy), since {steps} steps per generation at batch {stale_batch} need "
                        f"{last['peak_gib_per_gpu']:.1f} GiB even with the engine at {share} of the GPU, asleep while "
                        f"training, and activations recomputed, over {SAFE_FRACTION:.0%} of {chosen.gpu_mem_gib} GiB "
                        "(modelled)")
    cispo = bool(shared) and not big
    chosen = replace(chosen, steps_per_generation=chosen.steps_per_generation if shared else 1)
    est = estimate(chosen)
    u = chosen.vllm_gpu_memory_utilization
    b = chosen.per_device_train_batch_size
    spg = chosen.steps_per_generation
    speed_why = (f"under CISPO at 8 steps per generation batch 16 gave 4.4-5.0x the tokens/s of TRL's defaults at "
                 f"1.5B and every seed reached the reward threshold (measured, {MEASURED})" if cispo else
                 f"a bigger batch buys tokens/s but not reliably time to the reward threshold (measured, {MEASURED})")
    if b == asked_batch:
        batch_why = "yours: " + speed_why
    elif cispo and b == max(asked_batch, CISPO_MIN_BATCH):
        batch_why = f"raised from {asked_batch}: " + speed_why
    else:
        batch_why = (f"raised from {asked_batch} to the smallest batch{' of at least 16 (CISPO, below)' if cispo else ''}"
                     f" whose generation ({b} x {spg} step{'s' if spg > 1 else ''}) holds whole groups of "
                     f"{num_generations} completions, as TRL requires")
    if sized_share:
        u_why = (f"sized to one generation: twice the {est['vllm']['min_gpu_memory_utilization']:.3f} of the GPU its "
                 f"{b * spg * chosen.vllm_tensor_parallel_size} sequences need (modelled), rounded up, since at "
                 f"{stale.vllm_gpu_memory_utilization} the training state of {spg} steps per generation does not fit beside it")
    elif u == TRL_DEFAULT_UTILIZATION and chosen.sleep_level == 0:
        u_why = ("TRL's default, since a bigger KV cache generates no faster once a generation's sequences fit (the "
                 f"engine needs {est['vllm']['min_gpu_memory_utilization']:.3f}, modelled)")
    else:
        u_why = f"the planner's share: the highest that keeps the peak under {SAFE_FRACTION:.0%} of the GPU (modelled)"
    fields: list[tuple[str, object, str]] = [
        ("use_vllm", True, "generation with vLLM"),
        ("vllm_mode", "colocate", "vLLM inside each training process, so no GPU waits for another (notebook 01)"),
        ("per_device_train_batch_size", b, batch_why),
        ("num_generations", num_generations, "the group size G the advantage compares within"),
        ("max_completion_length", chosen.max_completion_length, "the planner sized the KV cache and activations for it"),
        ("vllm_max_model_length", chosen.prompt_length + chosen.max_completion_length,
         f"the longest prompt ({chosen.prompt_length} tokens, the planner's `prompt_length`) plus the completion, "
         "instead of TRL's default of the model's own limit, which sizes the engine for sequences it never sees"),
        ("gradient_checkpointing", chosen.gradient_checkpointing, ckpt_why),
        ("vllm_gpu_memory_utilization", u, u_why),
        ("vllm_enable_sleep_mode", chosen.sleep_level > 0,
         "the trainer and the engine fit together (modelled), so no sleep, wake-up or re-push per step"
         if chosen.sleep_level == 0 else
         "the trainer needs the engine's memory, so TRL sleeps at level 2 and pushes the weights again on waking"),
        ("vllm_tensor_parallel_size", chosen.vllm_tensor_parallel_size,
         "the smallest TP whose share of the vLLM weights fits (TP slows small models down: notebook 03)"),
        ("steps_per_generation", CISPO_STEPS,
         "one generation for 8 optimizer steps under CISPO (below) reached the reward threshold on all sixteen 1.5B "
         f"seeds, each sooner than TRL's defaults (measured, {MEASURED})") if cispo else
        ("steps_per_generation", 2, "one generation for two optimizer steps: at 7B nine of twelve on-policy seeds "
         "stopped learning (identical completions, no advantage left) while nine of ten seeds with 2 reached the "
         f"reward threshold (measured, {MEASURED})") if spg == 2 else
        ("steps_per_generation", None, fallback_why),
        ("loss_type", "cispo", "CISPO (MiniMax-M1) clips each token's importance weight but keeps its gradient, so "
         "the steps on a stale generation still teach where TRL's default ('dapo') drops it") if cispo else
        ("loss_type", "dapo", "TRL's default" + (" (CISPO, which the recipe takes below 7B, has not run at this size)"
                                                 if big else "")),
        *([("epsilon_high", 5.0, "CISPO's cap on the importance weight, TRL's recommended value for it")]
          if cispo else []),
        ("generation_kwargs", {"detokenize": False}, "TRL reads vLLM's token ids and decodes them itself"),
        ("vllm_importance_sampling_correction", True,
         "TRL's default, which corrects for vLLM sampling from a slightly different distribution than the trainer "
         f"computes (mean ratio 0.995 over the H200 runs, measured, {MEASURED})"),
        ("vllm_importance_sampling_mode", "sequence_mask", "TRL's default"),
        ("vllm_importance_sampling_clip_max", 3.0, "TRL's default"),
        ("bf16", True, "bf16 autocast on a GPU, as the H200 runs trained"),
    ]
    if chosen.train_dtype == "bfloat16":
        fields.append(("model_init_kwargs", {"dtype": "bfloat16"},
                       "the planner sized the training state for bfloat16 weights, and TRL loads a model given by "
                       "path in float32 unless told"))
    launch = []
    if chosen.zero_stage:
        from colo_kit.memory.recipes import _slug

        launch = [f"launch: accelerate launch --config_file configs/accelerate/"
                  f"zero3_{_slug(chosen.model)}_{chosen.gpus}gpu.yaml ... (ZeRO-{chosen.zero_stage}"
                  f"{' + optimizer offload to CPU' if chosen.offload_optimizer else ''}, since the training state does "
                  "not fit otherwise (modelled); `colo-kit plan --write-configs` writes the file)"]
    comments = [f"planner's predicted peak: {est['peak_gib_per_gpu']:.1f} GiB per GPU of {chosen.gpu_mem_gib} "
                f"({est['peak_phase']} phase, modelled)",
                "weight push in one load_weights call instead of one per tensor (0.03 s instead of 0.05 s at 1.5B, "
                f"measured, {MEASURED}): `colo-kit train --bucketed-push`, not a GRPOConfig field"] + launch
    if chosen.expandable_segments:
        comments.append(f"environment: {ALLOC_CONF} (PyTorch's allocator then holds little above its live tensors, "
                        "which the planner counts; vLLM refuses it with sleep mode)")
    return {"fits": True, "fields": fields, "model": chosen.model, "comments": comments, "plan": chosen,
            "environment": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if chosen.expandable_segments else {},
            "peak_gib_per_gpu": est["peak_gib_per_gpu"]}


def to_yaml(r: dict) -> str:
    """The recipe as YAML `TrlParser` reads, every field preceded by its reason."""
    import yaml

    p = r["plan"]
    lines = [f"# colo_kit recipe: {p.model}, {p.gpus} GPU(s) of {p.gpu_mem_gib} GiB, prompts up to {p.prompt_length} tokens",
             f"# run: {ALLOC_CONF + ' ' if p.expandable_segments else ''}colo-kit train --config THIS.yaml  (a TRL script "
             "built on TrlParser reads every other line: give it the model as its model_name_or_path instead of `model:`)"]
    lines += [f"# {c}" for c in r["comments"]]
    lines.append("# the model the planner sized this recipe for, which colo-kit train loads (a preset, a folder or a hub id)")
    lines.append(yaml.safe_dump({"model": r["model"]}, default_flow_style=False, width=1000).rstrip("\n"))
    for name, value, why in r["fields"]:
        lines.append(f"# {why}")
        lines.append(yaml.safe_dump({name: value}, default_flow_style=False, width=1000).rstrip("\n"))
    return "\n".join(lines) + "\n"
