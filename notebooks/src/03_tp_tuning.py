# %% [markdown]
# # 03 · Tensor parallelism for colocated vLLM: when sharding helps
#
# **You will**
# - start multi-process cells from a notebook with `colo_kit.parallel.launch`, and see a worker's crash come back as an error;
# - measure generation and colocated GRPO at TP 1 (and TP 2 where the machine has two GPUs);
# - see what the seed of each TP worker does to the tokens the engine samples;
# - weigh the post's explanation of the TP trend against what the kit measured.
#
# **Time** (Run All, measured): {{measured_times}}.
# **Before this:** `02_sleep_mode` (the colocated engine).
#
# Colocated vLLM (TRL's `vllm_mode="colocate"`) can shard each engine over several GPUs with
# `vllm_tensor_parallel_size` (TP). [The first post](https://huggingface.co/blog/vllm-colocate) swept it with GRPO on 8 GPUs and reports two opposite trends
# (quoted):
#
# - **Qwen2.5-1.5B** (experiment 2): more TP is **slower** — "avoid sharding small models".
# - **Qwen2.5-7B** (experiment 4): more TP is **faster**, up to **1.73×** (quoted).
#
# This notebook measures both on the GPUs of one node, TP 1 against TP 2: **generation alone** (N prompts × T
# tokens through colocated engines) and **colocated GRPO steps** with TRL. Each run spans several processes,
# started from a cell with torch elastic's `elastic_launch` through `colo_kit.parallel.launch`, which keeps the kernel
# safe. Then it explains the flip: communication against room for the KV cache.
#
# **On a CPU** (a laptop, or the kit's test machine) the same cells run the kit's tiny model on 2 processes over gloo: a
# *functional demo* of the code path — 2 processes, TP groups, each worker's seed — **not a speed
# result**. The H200 numbers come from the committed `results/tp_gpu.json`.

# %%
import os
import warnings

import ipywidgets as widgets
import plotly.graph_objects as go
from IPython.display import Markdown, display

import colo_kit

colo_kit.quiet()
# On a CPU, vLLM's gloo communicator calls torch's `all_gather_into_tensor`, which this torch marks deprecated: each
# rank of each launch would print that FutureWarning in red. Forked workers inherit the kernel's filters.
warnings.filterwarnings("ignore", message="`torch.distributed.all_gather_into_tensor`", category=FutureWarning)
from colo_kit.labs import lab
from colo_kit.parallel import tp
from colo_kit.env import Machine
from colo_kit.parallel.launch import kernel_problems, launch

MACHINE = Machine.here()
TIER = MACHINE.tier
LIVE = tp.live_plan(MACHINE)
MACHINE.say(LIVE["plan"])

# %% [markdown]
# ## 1 · Multi-process cells that cannot kill the kernel
#
# accelerate's docs start a multi-process run from a notebook with `notebook_launcher(fn, args, num_processes=N)`.
# Run it first, as it is: each worker adds its rank's ones over all workers and says what accelerate makes of it.

# %%
from accelerate import notebook_launcher

from colo_kit.env import gpu_count
from colo_kit.procs import free_port


def whoami_accelerate(tag):
    import torch
    import torch.distributed as dist
    from accelerate import PartialState

    state = PartialState()
    t = torch.ones(1, device=state.device)
    if dist.is_initialized():
        dist.all_reduce(t)  # crosses the processes: the sum is the world size
    print(f"rank {os.environ.get('RANK', 0)}: accelerate sees {state.num_processes} process(es) "
          f"({state.distributed_type.value}), all_reduce sum {t.item():.0f}, says {tag}", flush=True)
    return int(os.environ.get("RANK", 0))


# one process per GPU, or 2 on a CPU; use_port's default is 29500, which another learner's launch may hold
returned = notebook_launcher(whoami_accelerate, ("hello",), num_processes=gpu_count() or 2, use_port=str(free_port()))
print("notebook_launcher returned:", returned)

# %% [markdown]
# It ran, and the workers' sum shows they formed one group. What it left out is what the kit's
# `launch(fn, *args)` adds around the same torch elastic launch ("seen above" marks what this run just showed):
#
# | with `notebook_launcher` | with `colo_kit.parallel.launch` |
# |---|---|
# | the return value is `None` (seen above): `elastic_launch`'s `{rank: value}` is dropped | `{rank: value}`, in rank order |
# | on a CPU, `PartialState()` in each worker says one process, `DistributedType.NO` (seen above), so an `Accelerator` would train each worker alone; the banner says "CUDAs" | every worker starts `PartialState(cpu=True)`: gloo, world size 2 |
# | the workers are forked, and a CUDA context already in the kernel breaks them (accelerate #1751/#3925) | `kernel_problems()` checks first and spawns fresh interpreters instead (the function cloudpickled) when forking is unsafe |
# | a worker's exception is a wall of elastic errors | one `WorkerError` with the worker's traceback; the kernel lives |
# | the workers' lines are interleaved as they come | each line prefixed `[rank N]`, and a log per rank |
# | the port is yours to pick (`use_port`, 29500 unless given) | a free port per launch |
#
# Keep every GPU call inside the launched function. Two small launches in a row with the kit's `launch`:

# %%
print("kernel problems before forking:", kernel_problems() or "none")


def whoami(tag):
    import torch
    import torch.distributed as dist
    from accelerate import PartialState

    t = torch.ones(1, device=PartialState().device)  # a GPU tensor under NCCL, a CPU one under gloo
    dist.all_reduce(t)  # crosses the processes: the sum is the world size
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} ({dist.get_backend()}) says {tag}", flush=True)
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "all_reduce_sum": t.item(), "pid": os.getpid()}


first = launch(whoami, "hello")
second = launch(whoami, "again")
print(first.results)
print(f"ports: {first.port} then {second.port}; launched by {first.how}")

# %% [markdown]
# A worker that raises does not take the kernel down; its error comes back here:

# %%
from colo_kit.parallel.launch import WorkerError


def fails_on_the_last_rank():
    import torch.distributed as dist

    if dist.get_rank() == dist.get_world_size() - 1:
        raise ValueError(f"rank {dist.get_rank()} found a bad value")
    return "ok"


try:
    launch(fails_on_the_last_rank, echo=False)
except WorkerError as exc:
    print(f"WorkerError from rank {exc.rank}:", str(exc).splitlines()[0])
print("the kernel is still here")

# %% [markdown]
# ## 2 · Control panel: what TP changes for a model
#
# Pick a model and a TP size. The panel shows, for 2 H200s with vLLM at `vllm_gpu_memory_utilization = 0.3`
# (the post's setting), what each GPU's engine holds (from `colo_kit.memory.planner`), what TP costs in
# communication, the post's finding, and the H200 measurement once it is committed.

# %%
GPU_RESULTS = tp.load_gpu_results()
ROOM = {(r["model"], r["tp"]): r for r in tp.kv_room()}
RATIOS = {r["model"]: r for r in tp.ratios_table(GPU_RESULTS)}

model_w = widgets.Dropdown(options=[("Qwen2.5-1.5B", "qwen2.5-1.5b"), ("Qwen2.5-7B", "qwen2.5-7b")],
                           value="qwen2.5-7b", description="model")
tp_w = widgets.ToggleButtons(options=[1, 2], value=2, description="TP")
panel = widgets.Output()


def show_panel(*_):
    m, t = model_w.value, tp_w.value
    room, base = ROOM[(m, t)], ROOM[(m, 1)]
    ratio = RATIOS[m]
    measured = ("pending GPU run" if ratio["generation_tp2_over_tp1"] is None
                else f"{ratio['generation_tp2_over_tp1']}× generation, "
                     f"{ratio['grpo_speedup_tp2'] or 'n/a'}× GRPO step (TP 2 over TP 1)")
    with panel:
        panel.clear_output(wait=True)
        display(Markdown(
            f"| {m}, TP {t} | per GPU |\n|---|---|\n"
            f"| engine weights | {room['vllm_weights_gib']:.1f} GiB |\n"
            f"| KV cache (vLLM's 0.3 minus weights and overhead) | {room['kv_cache_gib']:.1f} GiB = "
            f"{room['kv_tokens']:,} tokens ({room['kv_tokens'] / base['kv_tokens']:.2f}× TP 1) |\n"
            f"| all-reduce traffic per generated token | {tp.allreduce_bytes_per_token(m, t):,} bytes |\n"
            f"| the post | {ratio['post']} |\n"
            f"| measured on 2×H200 | {measured} |"))


model_w.observe(show_panel, "value")
tp_w.observe(show_panel, "value")
show_panel()
display(widgets.HBox([model_w, tp_w]), panel)

# %% [markdown]
# ## 3 · Generation only: TP 1 against TP 2
#
# Every process runs one colocated engine (`colo_kit.colocate.engine.ColocatedEngine`: `external_launcher`, TP groups
# over consecutive ranks, `seed = rank // tp`). Each rank brings its share of the prompts. At **TP 1** every
# GPU is its own engine (data parallel); at **TP 2** the two GPUs form one engine: each holds half of every
# weight matrix, the ranks all-gather their prompts, and both generate the same completions. Throughput is
# all generated tokens over the slowest rank's time. (On GPU: 256 prompts × 256 tokens; on CPU: 8 × 16. Engines run eager,
# without CUDA graphs, as in the committed H200 run: they start in seconds.)

# %%
gen_sweeps = [tp.generation_sweep(m, LIVE["generation_tp"], num_processes=LIVE["num_processes"], enforce_eager=True)
              for m in LIVE["models"]]
for sw in gen_sweeps:
    for t, s in sw["tp"].items():
        print(f"{sw['model']} TP {t}: {s['tok_per_s']:,.0f} tok/s, seeds {[r['seed'] for r in s['ranks']]}, "
              f"KV cache {s['kv_tokens_per_engine']:,} tokens per engine, engine start {s['startup_s']} s")
    if len(sw["tp"]) > 1:
        print(f"{sw['model']}: TP 2 / TP 1 = {tp.tp_ratio(sw, 'tok_per_s')}")
first = gen_sweeps[0]
seen = dict(model=first["model"], tp1_tok_per_s=round(first["tp"][1]["tok_per_s"]))
if 2 in first["tp"]:
    lab.see("03.generation", "seeds 0, 0 at TP 2 and 0, 1 at TP 1 with two processes, and a KV cache "
            "at least as large per engine at TP 2", **seen, tp2_over_tp1=tp.tp_ratio(first, "tok_per_s"))
else:  # one GPU: TP 2 cannot run here, so there is no ratio to show (the panel above has the 2×H200 one)
    lab.see("03.generation", "TP 1 alone, seed 0: TP 2 needs two GPUs (the panel above shows the 2×H200 ratio)",
            **seen)
title = "generation throughput, this machine" + ("" if TIER == "gpu" else " — CPU functional demo, not a speed result")
tp.throughput_figure(gen_sweeps, title).show()

# %% [markdown]
# At TP 1 the two engines have seeds 0 and 1 (two independent samplers); at TP 2 both ranks have seed 0
# (`seed = rank // tp`). What would change if the two ranks of one TP-2 engine had seeds 0 and 1 is the exercise.
#
# ### Exercise 1 · Break the seed rule
#
# Under TP 2, suppose rank 1 of a group got seed 1 while rank 0 has seed 0. What happens to the tokens the two
# workers sample: a) they stay identical, b) they diverge?

# %%
answer = ...  # "they stay identical" or "they diverge" (or a / b)
lab.check("03.tp_seed", answer)

# %% [markdown]
# <details><summary>Solution (click)</summary>
#
# **They diverge.** Each TP worker runs its own sampler over the same logits; with different seeds they pick different
# tokens, the shards' sequences drift apart and the engine produces garbage or hangs. TRL and the kit both use
# `seed = rank // tp`, one seed per TP group (`trl/generation/vllm_generation.py`,
# `colo_kit.colocate.engine.ColocatedEngine`): the rule the post bisected its way to in vLLM #15895.
# </details>
#
# ### Break it · one seed per worker
#
# Now see it. The cell builds one TP-2 engine on two processes and samples the group's prompts with the seed
# rule below: `"rank"` gives each worker its own seed (the bug), `"rank // tp"` one seed for the group (TRL's rule).
# vLLM draws a request's tokens from a generator seeded with the request's seed, the same mechanism as the engine
# seed. Each worker reports the tokens the whole group generated. Run it, then change `seed` to `"rank // tp"` and
# run it again.

# %%
from colo_kit.labs.pitfalls import SEED_RULES, tp_seed_rule

seed = "rank"  # <- each TP worker's seed: "rank" (one per worker) or "rank // tp" (one per TP group)
rule = next((k for k in SEED_RULES if k.startswith(f"seed = {seed} (")), f"seed = {seed}")
if TIER == "gpu" and MACHINE.gpus < 2:
    MACHINE.say("a TP-2 engine needs two GPUs: run this cell on a CPU machine (two processes) or a 2-GPU node")
else:
    (r,) = tp_seed_rule("tiny", rules=(rule,))
    print(f"{r['rule']}: rank 0 {r['rank 0 first tokens']} · rank 1 {r['rank 1 first tokens']}")
    same = r["same token on both workers"]
    print(f"✔ the two workers of one engine sampled the same token at all {r['positions']} positions" if same == 1 else
          f"✘ the two workers of one engine agree at only {same:.0%} of {r['positions']} positions: each half of "
          "every weight matrix now computes on a different sequence, and nothing raises")

# %% [markdown]
# Under one seed the two workers agree on every token: they are one model. Under a seed each, they agree only
# where the random draws happen to coincide, and each worker feeds its own token into the next step, so the
# halves of every weight matrix compute on different sequences: the engine's output is garbage, with no error.
#
# ## 4 · Colocated GRPO with `vllm_tensor_parallel_size`
#
# The same comparison inside training: TRL's `GRPOTrainer`, `vllm_mode="colocate"`, on every GPU of the node,
# with `vllm_tensor_parallel_size` 1 and 2 (TRL makes the TP subgroups and gathers the prompts itself). The
# step time is the median after the first step. On a CPU only TP 2 runs, for two steps: it shows that TRL's
# colocate TP works over gloo on 2 processes. On one GPU only TP 1 can run; section 5 has TP 2 from 2×H200.

# %%
grpo_kwargs = tp.GPU_GRPO_SETTINGS if TIER == "gpu" else dict(max_steps=2, per_device_train_batch_size=4, num_generations=4,
                                                              max_completion_length=8)
grpo_sweeps = [tp.grpo_sweep(m, LIVE["grpo_tp"], num_processes=LIVE["num_processes"], vllm_enforce_eager=True,
                             **grpo_kwargs) for m in LIVE["grpo_models"]]
for sw in grpo_sweeps:
    for t, s in sw["tp"].items():
        print(f"{sw['model']} vllm_tensor_parallel_size={t}: TRL's TP group = {s['vllm_tp_group_size']} ranks, "
              f"{len(s['step_s_all'])} steps, median step {s['step_s']:.2f} s, rewards {s['rewards']}")
tp.grpo_figure(grpo_sweeps, "colocated GRPO step time, this machine"
               + ("" if TIER == "gpu" else " — CPU functional demo, not a speed result")).show()

# %% [markdown]
# ## 5 · The reference: 2×H200
#
# `scripts/gpu/tp_tuning.sh` ran the same functions on 2×H200 (vLLM 0.26) with random-weight Qwen2.5-1.5B and
# 7B: generation of 256 prompts × 256 tokens at TP 1 and 2, then colocated GRPO steps at
# `vllm_tensor_parallel_size` 1 and 2 where time allowed. Ratios come from one run.

# %%
if GPU_RESULTS is None:
    display(Markdown("**Pending GPU run**: `results/tp_gpu.json` is not committed yet. What the post reports "
                     "(8 GPUs, TRL colocate, `vllm_gpu_memory_utilization=0.3`):\n\n"
                     + "\n".join(f"- **{m}**: {r['says']}" for m, r in tp.POST_REFERENCE.items()
                                 if m.startswith("qwen"))))
else:
    ref_gen = [GPU_RESULTS["generation"][m] for m in tp.POST_REFERENCE if m in GPU_RESULTS.get("generation", {})]
    if ref_gen:
        tp.throughput_figure(ref_gen, "generation throughput on 2×H200 (committed results/tp_gpu.json)").show()
    ref_grpo = [GPU_RESULTS["grpo"][m] for m in tp.POST_REFERENCE if m in GPU_RESULTS.get("grpo", {})]
    if ref_grpo:
        tp.grpo_figure(ref_grpo, "colocated GRPO step time on 2×H200 (committed results/tp_gpu.json)").show()
    gpus = GPU_RESULTS["describe"].get("gpus", [])
    print("hardware:", ", ".join(g["name"] for g in gpus), "| vLLM", GPU_RESULTS["describe"]["versions"].get("vllm"))
for row in tp.ratios_table(GPU_RESULTS):
    print(row)

# %% [markdown]
# ## 6 · Why the trend might flip: the post's explanation, and what was measured
#
# The usual explanation of the post's two trends has two parts (the numbers are modelled by `colo_kit.memory.planner`):
#
# - **Communication.** TP splits each layer's matrices over the GPUs, so each layer ends with an all-reduce of
#   its output — two per layer per forward pass, for every generated token. The bytes depend on the hidden
#   size, not on the model's total size, while the compute saved shrinks with the model: for 1.5B the matrices
#   are small and the saved time is less than the synchronisation added.
# - **Room for the KV cache.** Colocated, vLLM may use only `vllm_gpu_memory_utilization` of each GPU. The 7B
#   weights (about 14 GiB in bf16, modelled) take a third of 0.3 of an H200; at TP 2 each GPU holds half, so the KV
#   cache gets more room and each decode step reads half the weights per GPU. The 1.5B weights (about 3 GiB)
#   barely dent the budget.
#
# **What the kit measured does not settle it.** Generation alone on 2×H200 came out *slower* at TP 2 for both
# models (0.67× for 1.5B, 0.59× for 7B, measured in `results/tp_gpu.json`, eager engines). The post measured whole
# GRPO steps on 8 GPUs; more KV room pays off only when the batch needs it, and the kit has not yet measured
# colocated GRPO at TP 1 against TP 2 on two GPUs. Read the explanation as the hypothesis those runs will test.

# %%
tp.why_figure().show()

# %% [markdown]
# ### Exercise 2 · Diluted by training
#
# Generation gets 1.5× faster with TP and takes 70% of a GRPO step. What speed-up does the whole step get? Two
# decimals. Predict here; the sliders below then let you check it and explore.

# %%
answer = ...  # a number
lab.check("03.amdahl", answer)

# %% [markdown]
# <details><summary>Solution (click)</summary>
#
# **1.30** = 1 / ((1 − 0.7) + 0.7 / 1.5). Training does not get faster with TP, so the 30% of the step it takes
# dilutes the generation gain — one reason a generation-only ratio and a GRPO-step ratio differ.
# </details>

# %% [markdown]
# **With the ping-pong model** (`colo_kit.serving.pingpong`, notebook 01): a colocated step is generation and
# training taking turns, `step = gen + train + sync + other`. TP only changes `gen`, so a generation speed-up
# `g` on a step that spends a share `f` generating gives `1 / ((1 − f) + f / g)` on the whole step — GRPO's
# gain is the generation gain diluted by training (and TP does not make training any faster). Drag the
# sliders:

# %%
wide = {"description_width": "initial"}
g_w = widgets.FloatSlider(value=1.2, min=0.5, max=2.5, step=0.05, description="generation speed-up g", style=wide)
f_w = widgets.FloatSlider(value=0.5, min=0.0, max=1.0, step=0.05, description="generation share f", style=wide)
amdahl = widgets.Output()


def show_amdahl(*_):
    with amdahl:
        amdahl.clear_output(wait=True)
        fs = [i / 20 for i in range(21)]
        fig = go.Figure(go.Scatter(x=fs, y=[tp.expected_step_speedup(g_w.value, f) for f in fs], mode="lines"))
        fig.add_scatter(x=[f_w.value], y=[tp.expected_step_speedup(g_w.value, f_w.value)], mode="markers",
                        marker_size=12, name="your setting")
        fig.update_layout(height=320, xaxis_title="share of the step spent generating",
                          yaxis_title="GRPO step speed-up from TP", showlegend=False)
        fig.show()


g_w.observe(show_amdahl, "value")
f_w.observe(show_amdahl, "value")
display(widgets.HBox([g_w, f_w]), amdahl)
show_amdahl()

# %% [markdown]
# ## 7 · Closing note: measured against the post

# %%
lines = []
for row in tp.ratios_table(GPU_RESULTS):
    ref = tp.POST_REFERENCE[row["model"]]
    if row["generation_tp2_over_tp1"] is None:
        lines.append(f"- **{row['model']}**: the post — {ref['trend']}"
                     + (f" (up to {ref['max_speedup']}×)" if ref["max_speedup"] else "")
                     + " (quoted). H200 measurement pending.")
        continue
    gen, step = row["generation_tp2_over_tp1"], row["grpo_speedup_tp2"]
    judged = step or gen  # the post measured GRPO steps; generation alone when no step was measured
    agrees = (judged < 1) if ref["max_speedup"] is None else (judged > 1)
    lines.append(f"- **{row['model']}**: TP 2 over TP 1 = **{gen}×** for generation"
                 + (f", **{step}×** per GRPO step" if step else "")
                 + f" on 2×H200 (measured, results/tp_gpu.json); the post: {ref['trend']}"
                 + (f" (up to {ref['max_speedup']}× on 8 GPUs, quoted)" if ref["max_speedup"] else "")
                 + (" — **same direction**." if agrees else " — **not the post's direction** on this setup."))
display(Markdown("\n".join(lines) + "\n\nOn this machine: "
                 + (f"the live runs above were measured on {MACHINE}." if TIER == "gpu"
                    else "the CPU runs above show the code path (2 processes, TP groups, one seed per group, "
                         "TRL colocate with TP 2); their times say nothing about GPUs.")))

# %% [markdown]
# ## Recap
#
# - `colo_kit.parallel.launch` runs a function on every GPU (2 processes on a CPU) from a cell, returns each rank's value,
#   and turns a worker's crash into an ordinary exception.
# - A TP group is one model spread over GPUs: its ranks gather their prompts and must share one seed.
# - TP changes only the generation part of a step: the step's gain is the generation gain diluted by training.
# - The post's TP trends are quoted; on 2×H200 the kit measured generation slower at TP 2 for both sizes, and the
#   GRPO-step comparison is still to be run.
#
# **Next:** `04_zero3_72b_recipe` — what fits where, and the 72B recipe.
