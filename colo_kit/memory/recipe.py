"""A GRPO recipe for one machine: `GRPOConfig` fields in TRL's own names, each with the reason it was chosen.

`colo-kit plan --recommend` writes it as YAML that `TrlParser` reads like any TRL config, so the same file runs under
`colo-kit train --config recipe.yaml` and under a plain TRL script. Memory comes from `colo_kit.memory.planner`
(modelled), speed choices from the H200 runs in `results/speed_1xh200.json` (measured, notebook 04 section 7); each
field's reason names its run. In short: no gradient checkpointing when training fits without it; TRL's 0.3
`vllm_gpu_memory_utilization` when it fits (a bigger KV cache is no faster once a generation's sequences fit); sleep
only when trainer and engine do not fit together; below 7B one generation for 8 optimizer steps under CISPO at batch
>= 16 (under TRL's default loss stale steps taught little), from 7B up `steps_per_generation: 2` (most on-policy 7B
seeds stopped learning; CISPO has not run at 7B); `vllm_max_model_length` sized for the sequences; no detokenizing;
TRL's importance-sampling correction kept. The weight push in one `load_weights` call has no `GRPOConfig` field and
stays a comment (`colo-kit train --bucketed-push`).
"""

from __future__ import annotations

from dataclasses import replace

from colo_kit.memory.planner import SAFE_FRACTION, Plan, estimate, model_shape, recommend

MEASURED = "results/speed_1xh200.json"
TRL_DEFAULT_UTILIZATION = 0.3  # TRL's default and the posts' value; the setting the H200 runs used
# From this many parameters the recipe shares each generation between two optimizer steps under TRL's default loss:
# measured at 7B (7.6B parameters), where nine of twelve on-policy seeds got stuck and one of ten with
# steps_per_generation=2 did. Below it, CISPO on one generation for 8 steps (measured at 1.5B only).
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
        chosen, ckpt_why = at_default, (f"training fits without recomputing activations; at 1.5B the step was "
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
        ("vllm_mode", "colocate", "vLLM inside each training process: no GPU waits for another (notebook 01)"),
        ("per_device_train_batch_size", chosen.per_device_train_batch_size,
         (f"raised from {asked_batch}: " if chosen.per_device_train_batch_size
          != asked_batch else "yours: ") +
         ("under CISPO with 8 steps per generation, batch 16 gave 4.39-5.02x the tokens/s at 1.5B over five "
          "races and all sixteen seeds reached the threshold; batch 8 gave 3.12x and one of two seeds got stuck; "
          "batch 32 gave 5.70x, but its steps took twice as long, so the threshold came 1.1-1.7x sooner "
          f"(measured, {MEASURED})" if cispo else
          "a bigger batch bought tokens/s, not reliably time (on-policy batch 32: 3.0-3.7x the tokens/s, "
          "1.02-1.68x sooner to the threshold; batch 32 without recomputing activations peaked at 121-124 GiB; "
          f"measured, {MEASURED})")),
        ("num_generations", num_generations, "the group size G the advantage compares within"),
        ("max_completion_length", chosen.max_completion_length, "the planner sized the KV cache and activations for it"),
        ("vllm_max_model_length", chosen.prompt_length + chosen.max_completion_length,
         f"the longest prompt ({chosen.prompt_length} tokens, the planner's `prompt_length`) plus the completion: "
         "TRL's default leaves vLLM the model's own limit (32,768 tokens for Qwen2.5), and sizes the engine for "
         "sequences it never sees; a longer prompt stops with vLLM's error naming both lengths"),
        ("gradient_checkpointing", chosen.gradient_checkpointing, ckpt_why),
        ("vllm_gpu_memory_utilization", u,
         "TRL's default, measured with this plan; a bigger KV cache does not generate faster once a generation's "
         f"sequences fit (the engine needs {est['vllm']['min_gpu_memory_utilization']:.3f}, modelled)"
         if u == TRL_DEFAULT_UTILIZATION and chosen.sleep_level == 0 else
         "the planner's share: the highest that keeps the peak under "
         f"{SAFE_FRACTION:.0%} of the GPU (modelled)"),
        ("vllm_enable_sleep_mode", chosen.sleep_level > 0,
         "the trainer and the engine fit together (modelled): no sleep, no wake-up or re-push per step"
         if chosen.sleep_level == 0 else
         "the trainer needs the engine's memory: TRL sleeps at level 2 and pushes the weights again on waking"),
        ("vllm_tensor_parallel_size", chosen.vllm_tensor_parallel_size,
         "the smallest TP whose share of the vLLM weights fits (TP slows small models down: notebook 03)"),
        ("steps_per_generation", CISPO_STEPS,
         "one generation for 8 optimizer steps: under TRL's default loss 2, 4 and 8 steps per generation needed as "
         "many generations to the threshold as on-policy runs at 1.5B, since a token whose importance ratio left "
         "[0.8, 1.2] gives no gradient; under CISPO (below) 8 steps per generation at batch 16 reached it in 4-7 "
         "generations on sixteen of sixteen seeds in five races, 15.7-26.2 s against TRL's defaults' 25.1-68.4 s in "
         "the same races (1.04-3.04x sooner per seed, 2.5x on two of fifteen; the sixteenth's defaults never got "
         "there); 16 steps per generation took 4-5 generations "
         "but 62-72 steps, 28-33 s "
         f"(measured, {MEASURED})") if cispo else
        ("steps_per_generation", 2, "one generation for two optimizer steps: at 7B nine of twelve on-policy seeds "
         "stopped learning within 13 steps (eight identical completions per prompt: no advantage left) and never "
         "reached the reward threshold, while nine of ten seeds with 2 did, in 32-56 s, at 1.7x the tokens/s (five "
         f"races; the tenth got stuck the same way by step 15; measured, {MEASURED})") if chosen.steps_per_generation == 2 else
        ("steps_per_generation", None,
         f"TRL's default, on-policy, since 8 steps per generation at batch {CISPO_MIN_BATCH} or more do not fit "
         "(modelled): at 1.5B sharing a generation between 2 or 4 steps gave 1.8-2.4x the tokens/s at "
         "batch 8 but needed as many generations to the reward threshold (2: 33-38, 4: 33-36, on-policy runs 26-63), "
         "each generation cycle longer, so it got there no sooner (4: in 82 s against the defaults' 37 s; measured, "
         f"{MEASURED}); from 7B up the recipe takes 2"),
        ("loss_type", "cispo", "CISPO (MiniMax-M1): clips each token's importance weight (at epsilon_high) and keeps "
         "its gradient, so the 7 steps on a stale generation still teach; TRL's default ('dapo') drops the "
         "gradient of tokens whose ratio left its clip range") if cispo else
        ("loss_type", "dapo", "TRL's default" + ("; CISPO, which the recipe takes below 7B, has not run at this size"
                                                 if big else "")),
        *([("epsilon_high", 5.0, "CISPO's cap on the importance weight, TRL's recommended value for it")]
          if cispo else []),
        ("generation_kwargs", {"detokenize": False}, "TRL reads vLLM's token ids and decodes them itself"),
        ("vllm_importance_sampling_correction", True,
         "TRL's default: corrects for vLLM sampling from a slightly different distribution than the trainer "
         f"computes (ratio means 0.31-1.21, mean 0.995, over the H200 runs, measured, {MEASURED})"),
        ("vllm_importance_sampling_mode", "sequence_mask", "TRL's default"),
        ("vllm_importance_sampling_clip_max", 3.0, "TRL's default"),
        ("bf16", True, "bf16 autocast on a GPU, as the H200 runs trained"),
    ]
    if chosen.train_dtype == "bfloat16":  # without it TRL loads a model given by path in float32: twice the state
        fields.append(("model_init_kwargs", {"dtype": "bfloat16"},
                       "the planner sized the training state for bfloat16 weights; TRL loads a model given by path in "
                       "float32 unless told"))
    launch = []
    if chosen.zero_stage:
        from colo_kit.memory.recipes import _slug

        launch = [f"launch: accelerate launch --config_file configs/accelerate/"
                  f"zero3_{_slug(chosen.model)}_{chosen.gpus}gpu.yaml ... (ZeRO-{chosen.zero_stage}"
                  f"{' + optimizer offload to CPU' if chosen.offload_optimizer else ''}: the training state does not "
                  "fit otherwise, modelled; `colo-kit plan --write-configs` writes the file)"]
    comments = [f"planner's predicted peak: {est['peak_gib_per_gpu']:.1f} GiB per GPU of {chosen.gpu_mem_gib} "
                f"({est['peak_phase']} phase, modelled)",
                "weight push in one load_weights call instead of one per tensor: `colo-kit train --bucketed-push` "
                f"(not a GRPOConfig field; 0.03 s instead of 0.05 s per push at 1.5B, measured, {MEASURED})"] + launch
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
