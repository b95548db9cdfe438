"""A GRPO recipe for one machine: `GRPOConfig` fields in TRL's own names, each with the reason it was chosen (notebook 04).

`colo-kit plan --recommend` writes it as YAML that `TrlParser` reads, so the same file runs under `colo-kit train
--config` and under a plain TRL script. Memory comes from the planner (modelled), speed choices from the H200 runs in
`results/speed_1xh200.json` (measured).
"""

from __future__ import annotations

from dataclasses import replace

from colo_kit.memory.planner import SAFE_FRACTION, Plan, estimate, model_shape, recommend

MEASURED = "results/speed_1xh200.json"
TRL_DEFAULT_UTILIZATION = 0.3  # TRL's default and the posts' value; the setting the H200 runs used
# From this size on, two optimizer steps per generation under TRL's loss (measured at 7B); below it, CISPO on 8 (1.5B).
STALE_FROM_PARAMS = 7e9
CISPO_STEPS, CISPO_MIN_BATCH = 8, 16


def recipe(plan: Plan | None = None, num_generations: int = 8, **settings) -> dict:
    """The recipe for `plan`: {"fields": [(name, value, why)], "comments", "plan" it was sized with, "peak_gib_per_gpu",
    "fits"}."""
    base = replace(plan or Plan(), **settings).validate()
    if base.mode != "colocate":
        raise ValueError(f"mode={base.mode!r}: the recipe is for colocate mode (server mode sizes its server apart)")
    fields: list[tuple[str, object, str]] = []
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
        rec = recommend(no_ckpt)
        if rec["fits"]:
            chosen = replace(no_ckpt, **_planned(rec))
            ckpt_why = "training fits without recomputing activations once the engine is sized by the planner"
        else:
            rec = recommend(replace(base, gradient_checkpointing=True))
            if not rec["fits"]:
                return {"fits": False, "why": rec["why"], "fields": [], "comments": [], "plan": base,
                        "peak_gib_per_gpu": None}
            chosen = replace(base, gradient_checkpointing=True, **_planned(rec))
            ckpt_why = "without it the activations do not fit (modelled)"
    big = model_shape(chosen.model).num_params() >= STALE_FROM_PARAMS
    asked_batch = chosen.per_device_train_batch_size
    # the engine then holds every sequence of the steps that share one generation
    stale = replace(chosen, steps_per_generation=2) if big else \
        replace(chosen, steps_per_generation=CISPO_STEPS, per_device_train_batch_size=max(asked_batch, CISPO_MIN_BATCH))
    cispo = False
    if fits(stale):
        chosen, cispo = stale, not big
    est = estimate(chosen)
    u = chosen.vllm_gpu_memory_utilization
    fields += [
        ("use_vllm", True, "generation with vLLM"),
        ("vllm_mode", "colocate", "vLLM inside each training process, so no GPU waits for another (notebook 01)"),
        ("per_device_train_batch_size", chosen.per_device_train_batch_size,
         (f"raised from {asked_batch}: " if chosen.per_device_train_batch_size != asked_batch else "yours: ") +
         (f"under CISPO at 8 steps per generation batch 16 gave 4.4-5.0x the tokens/s of TRL's defaults at 1.5B and "
          f"every seed reached the reward threshold (measured, {MEASURED})" if cispo else
          f"a bigger batch buys tokens/s but not reliably time to the reward threshold (measured, {MEASURED})")),
        ("num_generations", num_generations, "the group size G the advantage compares within"),
        ("max_completion_length", chosen.max_completion_length, "the planner sized the KV cache and activations for it"),
        ("vllm_max_model_length", chosen.prompt_length + chosen.max_completion_length,
         f"the longest prompt ({chosen.prompt_length} tokens, the planner's `prompt_length`) plus the completion, "
         "instead of TRL's default of the model's own limit, which sizes the engine for sequences it never sees"),
        ("gradient_checkpointing", chosen.gradient_checkpointing, ckpt_why),
        ("vllm_gpu_memory_utilization", u,
         "TRL's default, since a bigger KV cache generates no faster once a generation's sequences fit (the engine "
         f"needs {est['vllm']['min_gpu_memory_utilization']:.3f}, modelled)"
         if u == TRL_DEFAULT_UTILIZATION and chosen.sleep_level == 0 else
         f"the planner's share: the highest that keeps the peak under {SAFE_FRACTION:.0%} of the GPU (modelled)"),
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
         f"reward threshold (measured, {MEASURED})") if chosen.steps_per_generation == 2 else
        ("steps_per_generation", None,
         f"TRL's default (on-policy), since 8 steps per generation at batch {CISPO_MIN_BATCH} do not fit (modelled) "
         f"and under TRL's loss 2 or 4 reached the reward threshold no sooner at 1.5B (measured, {MEASURED})"),
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
    return {"fits": True, "fields": fields, "comments": comments, "plan": chosen,
            "peak_gib_per_gpu": est["peak_gib_per_gpu"]}


def _planned(rec: dict) -> dict:
    return {k: rec[k] for k in ("vllm_gpu_memory_utilization", "sleep_level", "vllm_tensor_parallel_size",
                                "zero_stage", "offload_optimizer")}


def to_yaml(r: dict) -> str:
    """The recipe as YAML `TrlParser` reads, every field preceded by its reason."""
    import yaml

    p = r["plan"]
    lines = [f"# colo_kit recipe: {p.model}, {p.gpus} GPU(s) of {p.gpu_mem_gib} GiB, prompts up to {p.prompt_length} "
             "tokens", "# run: colo-kit train --config THIS.yaml   or any TRL script built on TrlParser"]
    lines += [f"# {c}" for c in r["comments"]]
    for name, value, why in r["fields"]:
        lines.append(f"# {why}")
        lines.append(yaml.safe_dump({name: value}, default_flow_style=False, width=1000).rstrip("\n"))
    return "\n".join(lines) + "\n"
