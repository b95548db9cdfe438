# %% [markdown]
# # 04 · The 72B recipe: ZeRO-3, sleep level 2 and a memory planner
#
# **You will**
# - split one GRPO step's GPU memory into its parts, phase by phase, with `colo_kit.memory.planner`;
# - check the planner against peaks measured on H200s, out of sample;
# - work out what the post's 72B recipe needs: GPUs, sleep level, offload and host memory;
# - generate the DeepSpeed and accelerate configs, and read a real scaled-down ZeRO-3 run.
#
# **Time** (Run All, measured): {{measured_times}}. No GPU needed: the planner is arithmetic.
# **Before this:** `02_sleep_mode` (what sleep frees).
#
# The last experiment of [the first post](https://huggingface.co/blog/vllm-colocate) trained **Qwen2.5-Math-72B** with colocated vLLM: it used **4 fewer GPUs**
# than plain TRL (whose vLLM server needed its own GPUs) and was still **~1.26× faster**, with nearly identical
# reward curves (quoted). Two things made 72B fit beside a vLLM engine on the same GPUs:
#
# - **vLLM sleep, level 2**: between generations the engine discards its weights and KV cache, handing the GPU
#   to the trainer. GRPO pushes new weights every step anyway, so nothing worth keeping is lost.
# - **DeepSpeed ZeRO stage 3** (weights, gradients and optimizer states partitioned over the GPUs) with
#   `"offload_optimizer": {"device": "cpu"}`, `"overlap_comm": true`, `"contiguous_gradients": true`,
#   launched with Accelerate.
#
# Whether a run fits is a sum of parts: this notebook uses `colo_kit.memory.planner` to show them, checks the planner
# against memory measured on H200s, asks what the 72B recipe needs, writes the configs, and shows the real
# scaled-down ZeRO-3 run (7B on 2×H200) beside the planner's prediction.

# %%
import json

import ipywidgets as widgets
import plotly.graph_objects as go
from IPython.display import Markdown, display

import colo_kit

colo_kit.quiet()
from colo_kit.labs import lab
from colo_kit.memory import planner
from colo_kit.models import PRESETS
from colo_kit.paths import REPO_ROOT, results_dir
from colo_kit.memory.planner import SAFE_FRACTION as SAFE
from colo_kit.memory.planner import Plan, estimate, parts_figure, plan_report, what_fits
from colo_kit.memory.recipe import recipe, to_yaml

# %% [markdown]
# ## 1 · What takes memory in one GRPO step
#
# Before the parts, one number to predict.
#
# ### Exercise 1 · Bytes per parameter
#
# Full fine-tuning with AdamW, everything in fp32 as TRL loads a model given by path: how many bytes per parameter
# do the weights, the gradients and both Adam moments take?

# %%
answer = ...  # a number
lab.check("04.bytes_per_param", answer)

# %% [markdown]
# <details><summary>Solution (click)</summary>
#
# **16** = 4 (weights) + 4 (gradients) + 4 + 4 (Adam's first and second moments). Offloading the optimizer moves
# this state to the host's memory, which is why host memory decides the 72B recipe.
# </details>

# %% [markdown]
# A GRPO step has two phases on each GPU, and the peak is the larger:
#
# | phase | the vLLM engine | the trainer |
# |---|---|---|
# | **generation** | awake: `u × GPU memory` (its weights, KV cache, activations) | weights, optimizer states, what the allocator still holds |
# | **training** | asleep (≈ 0) — or, without sleep, still `u × GPU memory` | + gradients, activations, the LM head's log-prob tiles, the allocator's reserve |
#
# Two things in the training column are easy to miss. The backward pass frees activations as it makes gradients,
# so the two peak together at the larger of them, not their sum: where the activations are larger, the chart
# shows no separate gradients bar. And PyTorch's caching allocator keeps freed blocks reserved: the planner adds
# 0.6 GiB per GiB of activations, the ratio PyTorch itself reported in the H200 runs (measured,
# `results/speed_1xh200.json`; section 7).
#
# What TRL 1.16 really keeps, read in its source: a model given by path is loaded in **float32** (weights,
# gradients and both AdamW moments in fp32: 16 bytes per parameter), `gradient_checkpointing` is on by
# default, and the per-token log-probs use a fused, chunked LM head, so the `(tokens × 151,936)` logits are
# never materialised. Here is a setting the kit ran on H200s: Qwen2.5-1.5B, 2 GPUs, `u = 0.3`, sleep level 2, 64
# completions per GPU. Every number below is modelled by the planner.

# %%
report = plan_report(model="qwen2.5-1.5b", gpus=2, gpu_mem_gib=141, vllm_gpu_memory_utilization=0.3,
                     sleep_level=2, per_device_train_batch_size=64, prompt_length=96, max_completion_length=256)
parts_figure(report, title=f"this setting: peak {report['peak_gib_per_gpu']:.0f} GiB per GPU "
             f"({report['peak_phase']} phase), modelled").show()
rec = report["recommendation"]
print(f"this setting (modelled): peak {report['peak_gib_per_gpu']} GiB per GPU in the {report['peak_phase']} "
      f"phase; fits: {report['fits']}")
print(f"the planner's recommendation (modelled): vllm_gpu_memory_utilization={rec['vllm_gpu_memory_utilization']}, "
      f"sleep level {rec['sleep_level']}, peak {rec['peak_gib_per_gpu']} GiB per GPU — {rec['why']}")

# %% [markdown]
# The same question from a shell: `colo-kit plan --model qwen2.5-1.5b --gpus 2 --gpu-mem-gib 141 --mode colocate
# --vllm-gpu-memory-utilization 0.3 --sleep-level 2 --per-device-train-batch-size 64 --prompt-length 96
# --max-completion-length 256 --zero-stage 0 --json`.
#
# ## 2 · Is the planner right? Measured NVML peaks on H200
#
# TRL 1.16 colocate on 2×H200 (random-init 1.5B, `u = 0.3`, 256-token completions, G = 8), peak device memory
# read by NVML, beside the planner. Three constants (CUDA context, NCCL buffers, the share of freed memory
# `empty_cache()` cannot return) were fitted to the colocate rows; a fourth, the caching allocator's reserve per
# GiB of activations, was read from PyTorch's own peaks in the one-H200 races; everything else comes from the
# shapes.

# %%
validation = json.loads((results_dir() / "planner_validation.json").read_text())
rows = validation["rows"]
fig = go.Figure()
fig.add_bar(name="measured (NVML)", x=[r["row"] for r in rows], y=[r["measured_gib"] for r in rows])
fig.add_bar(name="planner", x=[r["row"] for r in rows], y=[r["predicted_gib"] for r in rows],
            text=[f"{r['error']:+.0%}" for r in rows], textposition="outside")
fig.update_layout(barmode="group", yaxis_title="peak GiB per GPU", height=450,
                  title="Planner (modelled) vs NVML peaks (measured)")
fig.show()
display(Markdown(validation["note"]))
colocate = [r for r in rows if r["row"].startswith("colocate")]
lab.see("04.planner", "every colocate row within 10% (the server-mode row is the known exception, +29%)",
        worst_colocate_error=max(abs(r["error"]) for r in colocate))

# %% [markdown]
# ## 3 · What does the 72B recipe need?
#
# Predict first, then read the table.
#
# ### Exercise 2 · One node?
#
# Qwen2.5-Math-72B, ZeRO-3 with the optimizer offloaded to the CPU, on one 8-GPU node with 560 GiB of host memory:
# does the offloaded state fit? Answer yes or no; the table below then shows it.

# %%
answer = ...  # "yes" or "no"
lab.check("04.host_memory", answer)

# %% [markdown]
# <details><summary>Solution (click)</summary>
#
# **No.** 16 bytes × 72.7B parameters ≈ 1.1 TiB of fp32 master weights, Adam moments and gradients on the host,
# twice the node's 560 GiB. Spread over two nodes it is about 540 GiB each (modelled): the recipe below spans them.
# </details>

# %% [markdown]
# Qwen2.5-Math-72B (72.7B parameters), full fine-tuning, ZeRO-3, vLLM TP = 4 (its bf16 weights are 135 GiB, modelled:
# one GPU cannot hold them), 8 completions per GPU of up to 512 + 1024 tokens. The host column is CPU memory per
# 8-GPU node: optimizer offload keeps DeepSpeed's fp32 master weights, Adam moments and gradients there —
# 16 bytes per parameter, spread over the nodes. An 8×H200 node here has 560 GiB of host memory.

# %%
RECIPE_72B = dict(vllm_tensor_parallel_size=4, per_device_train_batch_size=8, prompt_length=512, max_completion_length=1024,
                  vllm_gpu_memory_utilization=0.3)
table = what_fits("qwen2.5-math-72b", gpu_counts=(8, 16, 32), host_mem_gib=560, **RECIPE_72B)
fig = go.Figure()
for setup in dict.fromkeys(r["setup"] for r in table):
    sub = [r for r in table if r["setup"] == setup]
    fig.add_bar(name=setup, x=[f"{r['gpus']} training GPUs" for r in sub], y=[r["peak_gib_per_gpu"] for r in sub],
                text=["fits" if r["fits"] else ("host RAM" if r["fits_gpu"] else "OOM") for r in sub],
                textposition="outside")
fig.add_hline(y=planner.H200_GIB, line_dash="dash", annotation_text="H200")
fig.update_layout(barmode="group", yaxis_title="peak GiB per GPU", height=450, title="Qwen2.5-Math-72B, ZeRO-3")
fig.show()
for r in table:
    print(f"{r['gpus']:>3} GPUs  {r['setup']:<34} peak {r['peak_gib_per_gpu']:6.1f} GiB/GPU  host "
          f"{r['host_gib_per_node']:6.0f} GiB/node  GPUs in total {r['total_gpus']:>3}  "
          f"{'fits' if r['fits'] else 'does not fit'}")

# %%
def cheapest(setup):
    fits = [r for r in table if r["setup"] == setup and r["fits"]]
    return min(fits, key=lambda r: r["gpus"]) if fits else None


offload, no_offload = cheapest("colocate, sleep 2, offload"), cheapest("colocate, sleep 2")
eight = next(r for r in table if r["setup"] == "colocate, sleep 2, offload" and r["gpus"] == 8)
display(Markdown(
    "Reading the table (all modelled by `colo_kit.memory.planner`):\n\n"
    "- **Without sleep** the engine's `u × memory` stays on the GPU during the backward pass: the training phase "
    "carries both. **With sleep level 2** the training phase only carries the trainer.\n"
    f"- **With offload** 8 GPUs would hold the model ({eight['peak_gib_per_gpu']:.0f} GiB per GPU), but that one "
    f"node's host memory must hold 16 bytes × 72.7B ≈ {eight['host_gib_per_node']:.0f} GiB, more than its 560 GiB: "
    f"the smallest fit is **{offload['gpus']} GPUs** ({offload['gpus'] // 8} nodes, "
    f"{offload['host_gib_per_node']:.0f} GiB of host memory each). Without offload the optimizer state stays on the "
    f"GPUs: {no_offload['gpus']} GPUs hold it at {no_offload['peak_gib_per_gpu']:.0f} GiB each.\n"
    "- **Server mode** needs the same training GPUs **plus** a TP-sized group for the vLLM server: here 4 more "
    "GPUs, the post's \"4 fewer GPUs\" for colocate (quoted, with ~1.26× faster on top)."))

# %% [markdown]
# ## 4 · The configs, generated
#
# `colo-kit plan --model qwen2.5-72b --gpus 16 --zero-stage 3 --offload-optimizer --sleep-level 2 --write-configs`
# writes the DeepSpeed JSON and the accelerate YAML (`colo_kit.memory.recipes`) for the smallest fit above: 16 GPUs on two
# 8-GPU nodes (`num_machines: 2`). "auto" values are filled by the Trainer from `GRPOConfig`, which sets
# `use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True, vllm_tensor_parallel_size=4`.

# %%
for path in ("configs/deepspeed/zero3_offload.json", "configs/accelerate/zero3_qwen2.5-72b_16gpu.yaml"):
    print(f"--- {path}\n{(REPO_ROOT / path).read_text()}")

# %% [markdown]
# The command for each node, and one line for a SLURM allocation (each node's shell fills in its own rank and
# node 0's address), written by `colo_kit.memory.recipes.node_commands` from the plan. `--num_processes` is the total
# over all nodes. The same function wrote the commands of the two-machine run below: two `accelerate launch`
# processes on one host, machine ranks 0 and 1, a colocated GRPO run with the tiny model on each over gloo — plain
# data parallelism and this ZeRO-3 JSON with its optimizer offload (measured, `results/two_machines_cpu.json`).

# %%
from colo_kit.memory.recipes import node_commands

nodes = node_commands("qwen2.5-72b", 16, script="your_grpo_script.py")
for rank, line in enumerate(nodes["lines"]):
    print(f"node {rank}: {line}")
print(f"SLURM:  {nodes['srun']}")
two = json.loads((results_dir() / "two_machines_cpu.json").read_text())
for name, part in two["parts"].items():
    ranks = part.get("ranks", [])
    worlds = sorted({r.get("world_size") for r in ranks})
    print(f"tested on one host ({name}): {len(part.get('commands', []))} launchers, exit codes "
          f"{part.get('returncodes')}, world size {worlds}, machine ranks {[r.get('machine_rank') for r in ranks]}"
          + (" <- with accelerate's --cpu flag each launcher makes a world of one, and both exit 0"
             if name == "cpu_flag" else ""))

# %% [markdown]
# TRL's own 72B recipe takes the other road: server mode, 4 training nodes with ZeRO-3 and a fifth node running
# `trl vllm-serve` at TP 8. The cross-node knobs become `GRPOConfig` fields in TRL's names (`vllm_server_host`,
# `vllm_server_port`, and `vllm_group_port`, the weight sync's NCCL rendezvous on training node 0), passed to the
# script as flags (the accelerate YAML is the one `colo-kit plan --gpus 32 --write-configs` writes);
# `colo_kit.memory.recipes.server_node_commands` writes the server's line, each training node's line and
# a SLURM batch script that starts the server first and waits for its `/health`. The same function wrote the
# commands of a two-"node" run on one host: the server as one process group on its own port, the trainer as
# another through its `accelerate launch` line, HTTP weight sync standing in for NCCL on a CPU (measured,
# `results/server_node_cpu.json`).

# %%
from colo_kit.memory.recipes import server_node_commands

server_nodes = server_node_commands("Qwen/Qwen2.5-72B", training_gpus=32, server_tp=8, script="your_grpo_script.py")
print(f"vLLM node:       {server_nodes['server_node']['line']}")
for rank, line in enumerate(server_nodes["training_nodes"]["lines"]):
    print(f"training node {rank}: {line}")
print(f"GRPOConfig:      {server_nodes['grpo_config']}")
tested = json.loads((results_dir() / "server_node_cpu.json").read_text())
print(f"tested on one host ({tested['status']}): {tested['summary']}")

# %% [markdown]
# ## 5 · The real run, scaled down: 7B, ZeRO-3, sleep level 2, 2×H200
#
# `scripts/gpu/zero3.sh` runs TRL's `GRPOTrainer` colocated with vLLM (sleep on) under the ZeRO-3 config above
# on a random-init Qwen2.5-7B, samples every GPU's memory through NVML, and writes `results/zero3_run.json`
# with the planner's estimate for the same settings.

# %%
run_path = results_dir() / "zero3_run.json"
run = json.loads(run_path.read_text()) if run_path.exists() else None
if run is None:
    display(Markdown("**Pending:** `results/zero3_run.json` is not committed yet; run `bash scripts/gpu/zero3.sh` "
                     "on 2 GPUs. Below is the planner's prediction for that run."))
    pred = plan_report(model="qwen2.5-7b", gpus=2, zero_stage=3, offload_optimizer=True, sleep_level=2,
                       per_device_train_batch_size=8, prompt_length=80, max_completion_length=128, host_mem_gib=256)
    parts_figure(pred, title="qwen2.5-7b, ZeRO-3 + offload, sleep 2, 2 GPUs: planner only").show()
elif run.get("status") not in ("ok", "partial") or not run.get("nvml_peak_gib_per_gpu"):
    display(Markdown(f"**The GPU run failed:** `{run.get('error')}` — see `log_tail` in {run_path.name}."))
else:
    if run["status"] == "partial":
        display(Markdown(f"*The run hit its time limit after {len(run['step_times_s'])} step(s); the numbers "
                         "below are from the steps it finished.*"))
    measured = run["nvml_peak_gib_per_gpu"]
    pred = estimate(Plan(**run["planner_settings"]))
    display(Markdown(
        f"Measured peak per GPU (NVML): **{', '.join(f'{m:.1f}' for m in measured)} GiB**; planner: "
        f"**{pred['peak_gib_per_gpu']:.1f} GiB** ({pred['peak_phase']} phase), error "
        f"{pred['peak_gib_per_gpu'] / max(measured) - 1:+.1%}. Step times: {run['step_times_s']} s "
        f"(the first includes warm-up). GPUs: {[g['name'] for g in run['env'].get('gpus', [])]}."))
    parts_figure(pred, title="qwen2.5-7b ZeRO-3 run: planner parts").show()
    tl = run.get("nvml_timeline")
    if tl:
        fig = go.Figure()
        for i, col in enumerate(tl["columns"][1:], start=1):
            fig.add_scatter(x=[r[0] for r in tl["rows"]], y=[r[i] for r in tl["rows"]], name=col)
        fig.update_layout(xaxis_title="s", yaxis_title="GiB used (NVML)", height=350,
                          title="Device memory through the run: vLLM wakes and sleeps every step")
        fig.show()

# %% [markdown]
# ## 6 · Your turn: the control panel
#
# Pick a model, GPU count, batch, lengths, ZeRO stage, sleep level and offload; the bars show the parts of each phase
# (modelled), and below them the recipe for your model, GPUs and batch: `GRPOConfig` fields in TRL's names, each
# with the reason it was chosen (from the planner and the measured runs of section 7). Try gradient checkpointing
# too (TRL's `GRPOConfig` turns it on by default): with it off, 1.5B colocate at per-device batch 64 and 256-token
# completions needs about 149 GiB per GPU instead of about 82 (modelled), more than an H200 has. The kit's first
# H200 ping-pong sweep ran with it off, and its batch-64 colocate runs failed (measured,
# `results/pingpong_gpu_partial.json`).

# %%
wide = {"description_width": "initial"}
model_w = widgets.Dropdown(options=[n for n in PRESETS if n != "tiny"], value="qwen2.5-7b", description="model",
                           style=wide)
gpus_w = widgets.Dropdown(options=[1, 2, 4, 8, 16, 32], value=2, description="GPUs", style=wide)
zero_w = widgets.Dropdown(options=[0, 1, 2, 3], value=3, description="ZeRO stage", style=wide)
sleep_w = widgets.Dropdown(options=[("no sleep", 0), ("level 1", 1), ("level 2", 2)], value=2,
                           description="sleep", style=wide)
offload_w = widgets.Checkbox(value=True, description="offload optimizer to CPU", style=wide)
util_w = widgets.FloatSlider(value=0.3, min=0.05, max=0.95, step=0.05, description="vllm_gpu_memory_utilization",
                             style=wide, layout=widgets.Layout(width="560px"))  # wide enough to drag past its long label
tp_w = widgets.Dropdown(options=[1, 2, 4, 8], value=1, description="vllm_tensor_parallel_size", style=wide)
mem_w = widgets.Dropdown(options=[("H200 (139.8 GiB)", planner.H200_GIB), ("80 GiB", 79.1)], description="GPU",
                         style=wide)
ckpt_w = widgets.Checkbox(value=True, description="gradient_checkpointing", style=wide)
batch_w = widgets.Dropdown(options=[4, 8, 16, 32, 64, 128], value=8, description="per_device_train_batch_size", style=wide)
completion_w = widgets.Dropdown(options=[128, 256, 512, 1024, 2048], value=512, description="max_completion_length",
                                style=wide)
out = widgets.Output()


def show(*_):
    with out:
        out.clear_output(wait=True)
        try:
            r = plan_report(model=model_w.value, gpus=gpus_w.value, zero_stage=zero_w.value,
                            sleep_level=sleep_w.value, offload_optimizer=offload_w.value and zero_w.value > 0,
                            vllm_gpu_memory_utilization=util_w.value, vllm_tensor_parallel_size=tp_w.value,
                            gpu_mem_gib=mem_w.value, per_device_train_batch_size=batch_w.value, prompt_length=256,
                            max_completion_length=completion_w.value, gradient_checkpointing=ckpt_w.value)
        except ValueError as exc:
            print(f"not a valid setting: {exc}")
            return
        parts_figure(r, title=f"your setting: peak {r['peak_gib_per_gpu']:.0f} GiB per GPU, "
                     f"{'fits' if r['fits'] else 'does not fit'} (modelled)").show()
        rec = r["recommendation"]
        print(f"the planner's recommendation (modelled, peak {rec['peak_gib_per_gpu']} GiB per GPU):",
              {k: v for k, v in rec.items() if k not in ("why", "peak_gib_per_gpu")})
        print(rec["why"])
        for note in r["notes"]:
            print("note:", note)
        rcp = recipe(model=model_w.value, gpus=gpus_w.value, gpu_mem_gib=mem_w.value, per_device_train_batch_size=batch_w.value,
                     prompt_length=256, max_completion_length=completion_w.value, zero_stage=zero_w.value,
                     offload_optimizer=offload_w.value and zero_w.value > 0)
        if rcp["fits"]:
            print("\nThe recipe for this model, GPU count and batch (`colo-kit plan --recommend` writes it; "
                  "TRL's TrlParser reads it):\n")
            print(to_yaml(rcp))


for w in (model_w, gpus_w, zero_w, sleep_w, offload_w, util_w, tp_w, mem_w, ckpt_w, batch_w, completion_w):
    w.observe(show, names="value")
display(widgets.VBox([widgets.HBox([model_w, gpus_w, zero_w]), widgets.HBox([batch_w, completion_w, tp_w]),
                      widgets.HBox([sleep_w, offload_w]), widgets.HBox([util_w, mem_w, ckpt_w]), out]))
show()

# %% [markdown]
# ## 7 · Faster on one GPU: TRL's defaults, one knob at a time
#
# The planner says what fits; what runs fastest is measured. `scripts/gpu/speed.sh` trained random-init
# Qwen2.5-1.5B on one H200 with the length reward (256-token completions, G = 8), one process per configuration,
# each adding one knob to the one before (`colo_kit.memory.speed.CHAIN`, in `GRPOConfig`'s names where TRL has the knob):
# TRL's colocate defaults, then `gradient_checkpointing=False`, `generation_kwargs={"detokenize": False}`, the weight
# push in one `load_weights` call (`colo_kit.colocate.bucketed_push`), `steps_per_generation=8`, per-device batch 32.
# Beside the chain, each on top of the one-call push (`speed.SIDE`): the recipe `colo-kit plan --recommend` writes,
# `steps_per_generation` 2 and 4, `num_iterations` 2 and 4, an on-policy batch of 32, two ways to sleep, and CISPO
# (`loss_type="cispo"`) on `steps_per_generation=8` at batch 8, 16 and 32.
# Two numbers per configuration, because a faster token is not a faster lesson:
#
# - **completion tokens/s**, steady state: whole generation cycles, the first left out;
# - **time to the threshold**: seconds of training until the running mean reward first gets halfway from where
#   the untrained model starts to the best reward (0), per seed.
#
# All numbers below are measured (`results/speed_1xh200.json`). Each block of rows is one *race*: one learning
# rate, one training budget per seed ("s per seed") and one version of the kit ("ran at"), with TRL's defaults
# run in the same race; a ratio is only ever taken against those. "not reached" means not within the budget. The
# newest race comes first.

# %%
import pandas as pd

from colo_kit import results

speed_shown = results.shown("04.speed")
print(results.footnote(speed_shown))
pd.DataFrame(speed_shown["rows"]).set_index(["learning rate", "s per seed", "configuration"])

# %% [markdown]
# What the table says, and what it does not:
#
# - **The newest race: the whole chain at one version of the kit** (80 s per seed, learning rate 5e-4, at 2f0b343,
#   each seed stopped once its running mean passed the threshold, one process per seed; measured,
#   `results/speed_1xh200.json`). The defaults ran at 2,029 and 2,383 tokens/s; seed 0 reached the threshold in
#   34.5 s (33 generations), seed 1 trained the whole 80 s (94 steps) without reaching it.
#   - The recipe: 4.39× the tokens/s; both seeds reached the threshold, in 4 and 6 generations, in 19.0 and
#     22.1 s: 1.82× sooner on seed 0, and at least 3.66× on seed 1, a bound against defaults that never got
#     there. A step took 0.39–0.46 s: 0.242 s of generation, 0.183 s of training and 0.005 s of push per step
#     (one push of 0.032 s per 8 steps). NVML peaked at 84.8 and 84.9 GiB against the planner's 92.1 (9% over,
#     the safe side).
#   - One knob at a time, seed 0, tokens/s and time to the threshold against the defaults:
#     `gradient_checkpointing=False` 1.22× and 1.43× sooner (24.1 s); `detokenize: False` 1.14× and 1.16×; the
#     push in one `load_weights` call 1.24× and 0.86× (0.019 s a push against 0.037–0.063 s for TRL's
#     per-tensor loop in this race); `steps_per_generation=8` 3.54× and 0.97× (17 generations); batch 32 on top
#     5.06× and 0.71× (8 generations of 0.72 s steps). Each knob buys tokens/s; of the on-policy ones the first
#     two also got there sooner on this one seed, and the stale ones got there later: the recipe's CISPO is what
#     lets the stale steps of a shared generation teach.
#   - TRL's level-2 sleep (`vllm_enable_sleep_mode=True`, on top of the one-call push): a switch of 0.133 s per
#     step (medians: sleep 0.035 s, two wake-ups of 0.018 s, the push 0.062 s), the cheapest level-2 switch of
#     any race and still over the 0.12 s aimed for; NVML 60.9 GiB against the planner's 63.1, 18 GiB under the
#     same settings awake (78.8), at 0.96× the defaults' tokens/s where awake ran at 1.24×.
#   - Every peak of this race sits within 10% of the planner's (−4% to +9%).
# - **At bda5752: the recipe on seeds it was not chosen on** (80 s per seed, learning rate 5e-4, at bda5752,
#   seeds 4–7, which no earlier race used; each seed stopped once its running mean passed the threshold; measured,
#   `results/speed_1xh200.json`). This machine ran slower than the one before: the defaults stepped in 1.08–1.40 s,
#   ran at 1,457–1,901 tokens/s and reached the threshold in 68.4, 38.8, 49.2 and 26.6 s (47, 32, 43 and 24
#   generations).
#   - The recipe: 5.02× the tokens/s; all four seeds reached the threshold, in 5, 5, 5 and 7 generations, in 22.8,
#     21.5, 16.2 and 25.6 s: 3.00×, 1.80×, 3.04× and 1.04× sooner than the defaults' same seed. A step took
#     0.43–0.52 s: 0.294 s of generation, 0.194 s of training and 0.005 s of push per step. NVML peaked at
#     94.0–94.3 GiB against the planner's 92.1.
# - **Across the four races before it** (bda5752, 9e1f313, 32f45d7 and e271166): fourteen
#   seeds, 4× the tokens/s in every race (4.79–5.02×), the threshold reached on every seed, 1.04–3.04× sooner
#   than the defaults' same seed: 2.5× on two of fourteen. Pooled, the recipe's median time was 20.8 s against the
#   defaults' 39.0 s, and its fourteen times add up to half of theirs (2.02×). Why not 2.5× on every seed: the
#   time is generations × steps per generation × step time. A recipe step (0.39–0.52 s) is about 2.4× shorter
#   than a defaults step (0.88–1.40 s), but the recipe saw the threshold at its 5th to 7th generation, after 32–48
#   optimizer steps, where the defaults saw it after 23–48 (24–49 generations of one step). On the seeds where the
#   defaults learned fastest (24 generations: 25.1, 26.6 and 30.7 s) the recipe was 1.11×, 1.04× and 1.71×
#   sooner: there its stale steps would have had to teach as much as on-policy ones.
# - **At 9e1f313: the recipe as `colo-kit plan --recommend` now writes it** (80 s per seed, learning rate
#   5e-4, four seeds each, each seed stopped once its running mean passed the threshold; measured,
#   `results/speed_1xh200.json`). The defaults ran at 1,867–2,322 tokens/s and reached the threshold in 38.6,
#   25.1, 33.5 and 39.2 s (35, 24, 36 and 34 generations).
#   - The recipe (CISPO on 8 steps per generation at batch 16, and vLLM sized for the longest prompt plus the
#     completion, `vllm_max_model_length: 352`): 4.79× the tokens/s; all four seeds reached the threshold in 5 or 6
#     generations, in 15.7, 22.5, 18.0 and 16.1 s: 2.46×, 1.11×, 1.86× and 2.43× sooner than the defaults' same
#     seed. A step took 0.39–0.44 s: 0.182 s of generation, 0.181 s of training and 0.004 s of push per step.
#   - Sizing vLLM for the task is not shown to be faster. The recipe's generation fell from 0.265 s per step at
#     32f45d7 to 0.182 s, but the defaults, whose engine kept TRL's default size, also ran faster here (0.88–1.10
#     s per step against 1.15–1.25 s), and the tokens/s ratio did not grow (4.79× against 4.90×).
#   - Where a generation's time goes (`scripts/gpu/gen_in_trainer.py`, the recipe inside TRL's trainer; measured,
#     `results/gen_in_trainer_1xh200.json`): one generation of 128 completions took 1.2–1.8 s, of which Python's
#     garbage collector paused 0.02–0.04 s; with the collector off it took 1.0–1.7 s, so the collector is not the
#     cause. Profiled, most of it is vLLM's own scheduler and output handling, in Python, once per token of every
#     sequence (32,753 calls for 128 × 256 tokens). TRL runs the engine inside the training process
#     (`external_launcher`), so that work cannot overlap with anything. Alone, an engine built by TRL's
#     constructor and sized alike made 128 × 256 tokens in 1.09 s, 0.79 s without the log-probabilities TRL asks
#     for (`gen_latency.py`, below).

# - **At 32f45d7** (the defaults' seeds 0–2 reached the threshold in 40.2 and 64.9 s, and seed 2
#   got stuck at −2,540 from step 37): the recipe without the engine sizing, 4.90× the tokens/s, 20.1 and 26.2 s
#   (2.00× and 2.48× sooner), a step of 0.49–0.50 s (0.265 s of generation, 0.187 s of training per step).
#   16 steps per generation (`cispo_b16_spg16`): 5.25× the tokens/s, but 1.43× and 1.94× sooner. Twice the
#   completions per generation are the same completions per step, so only vLLM's bigger batch saved time (0.220 s
#   of generation per step), and the staler steps needed 62–72 optimizer steps against 41–53.
# - **At e271166: CISPO makes the stale steps teach** (80 s per seed, learning rate 5e-4, four
#   seeds of the defaults, each seed stopped once its running mean passed the threshold; measured,
#   `results/speed_1xh200.json`). Under TRL's default loss a step on a stale generation teaches little: a token
#   whose importance ratio has left [0.8, 1.2] in the direction of its advantage gives no gradient, so the
#   races below needed as many generations with 2, 4 or 8 steps per generation as on-policy. CISPO
#   (`loss_type="cispo"`, `epsilon_high=5.0`) clips the importance weight instead and keeps every token's gradient.
#   The defaults ran at 1,692–1,877 tokens/s and reached the threshold in 44.2, 54.3, 33.2 and 30.7 s (39, 44, 27
#   and 24 generations).
#   - CISPO, 8 steps per generation, batch 16 (`cispo_b16`, what the recipe now writes below 7B): 4.97× the
#     tokens/s; all four seeds reached the threshold in 5 or 6 generations, in 18.6, 25.2, 23.5 and 17.9 s:
#     2.38×, 2.16×, 1.41× and 1.71× sooner than the defaults' same seed. A step took 0.43–0.51 s: a generation of
#     128 completions (1.7 s) shared by 8 steps, 0.18 s of training and one push per 8 steps.
#   - Batch 32 (`cispo_b32`): 5.70× the tokens/s, but a step took 0.80–0.83 s, so 1.14× and 1.74× sooner.
#   - Batch 8 (`cispo_spg8`): 3.12× the tokens/s; seed 1 got there in 15.2 s (3.57× sooner), seed 0 got stuck at
#     −2,540 from step 49 and never did.
#
#   So the recipe's configuration meets 4× the tokens/s and misses 2.5× sooner: by 1.05× on seed 0 and 1.16× on
#   seed 1, more on seeds 2 and 3, where the defaults learned faster. The time is now steps × step time: about as
#   many optimizer steps as on-policy (40–48), each 2.3× shorter. Its NVML peaks, 84.7–94.2 GiB, sit beside the
#   planner's 92.1; batch 32's, 105.2 and 105.6 GiB, sit 17% under the planner's 122.7, the planner's one miss over
#   10% (PyTorch's allocator reserved 5 GiB above the tensors there, where batch 32 under TRL's loss reserved 21–24).
# - **At 33d43ba: the on-policy recipe** (80 s per seed, learning rate 5e-4, each seed stopped once its running mean passed the threshold; measured,
#   `results/speed_1xh200.json`). The defaults ran at 2,157–2,210 tokens/s. Their seed 1 reached the threshold in
#   44.3 s (45 generations); their seed 0 got stuck at step 23 (eight identical completions per prompt, reward
#   −2,540) and trained the whole 80 s without reaching it.
#   - The recipe: 1.08× the tokens/s, threshold in 34.4 and 33.7 s (42 and 36 generations): 1.32× sooner on
#     seed 1, and at least 2.35× on seed 0, a bound against defaults that never got there.
#   - On-policy batch 32: 3.01× the tokens/s, threshold in 34.7 and 33.0 s (27 and 26 generations): 1.34× and at
#     least 2.32×. Its NVML peaks, 120.9 and 123.7 GiB, sit beside the planner's 122.7 (the planner
#     bullet below).
#
#   So the recipe falls short of 4× the tokens/s at 1.5B by a factor of 3.7 and of 2.5× sooner by 1.9 on the seed
#   where the defaults learned; batch 32 by 1.3 and 1.9. Generation is 0.60–0.69 s of the recipe's 0.81–0.93 s
#   step, and at batch 8 no knob of the recipe makes one generation shorter.
# - **At f024d00: every knob at one commit** (80 s per seed, learning rate 5e-4, each seed
#   stopped once its running mean passed the threshold; measured, `results/speed_1xh200.json`). The defaults
#   reached the threshold in 55.3 and 45.0 s (58 and 48 generations) at 2,048–2,262 tokens/s.
#   - **On-policy batch 32**: 3.29× the tokens/s and 1.68× and 1.46× sooner (28 and 27 generations): the best
#     on-policy time of any race, and still short of 2.5×.
#   - The recipe: 1.23× the tokens/s, 1.43× and 1.16× sooner (50 and 48 generations).
#   - One knob at a time, seed 0: `steps_per_generation=2` 1.82× and 1.42× sooner; no activation recomputing
#     1.06× and 1.41×; `steps_per_generation=8` 2.91× and 1.24× (17 generations); batch 32 with it 5.27× and 1.13×
#     (9 generations of 256 completions). Token ids without text (1.12×) and the one-call push (1.14×) did not
#     reach the threshold inside 80 s.
#
#   Here `steps_per_generation=8` needed 17 generations, not the 33–38 of earlier races: one seed, one race, so
#   the next bullet's rule is a tendency, not a law.
# - **An earlier race: can one generation teach more?** (two seeds each, 80 s per seed, learning rate 5e-4, at
#   05ffdbb; measured, `results/speed_1xh200.json`). The defaults reached the threshold in 37.3 and 48.0 s
#   (31 and 50 generations): the same seeds, 18 s and 3 s sooner than in the f024d00 race.
#   - `num_iterations=4` (GRPO's μ: four optimizer steps on each generation's completions) needed 56–65
#     generations: 0.47× and 0.65× the defaults' speed to the reward. Training again on the same completions
#     taught *less* per generation. `num_iterations=2`: 35 generations for both seeds, 1.16× and 1.40× sooner.
#   - **On-policy batch 32** (`per_device_train_batch_size=32`, one optimizer step per generation): 3.69× the
#     defaults' tokens/s, because a generation of 32 completions takes about what one of 8 does (the latency table
#     below), yet 1.02× and 1.50× sooner: 28 and 27 generations against the defaults' 31 and 50. Four times the
#     completions per generation saved 10% of the generations on one seed and 46% on the other, no more than the
#     defaults' own two seeds differ from each other.
#   - The recipe: 1.53× the tokens/s (0.81–0.87 s per step against 0.60–1.16), 1.11× and 1.40× sooner.
#
#   In none of these races did a knob move the reward 2.5× sooner where the defaults got there. Read
#   the defaults' seed 1 of the race before with care: it reached the threshold, then collapsed onto a long token (reward −3,052, 107
#   tokens per completion), so its tokens/s fell with its completions.
# - **An earlier race: the same step, a different clock** (defaults and recipe, two seeds each, 90 s per seed,
#   learning rate 5e-4, at 0cfd418; measured, `results/speed_1xh200.json`). The recipe again ran 1.23× the
#   defaults' tokens/s (0.94–0.95 s per step against 1.13–1.18), yet reached the threshold in 59.0 and 35.3 s
#   against the defaults' 40.8 and 37.5 s: 0.69× and 1.06×. One race earlier the same recipe was 1.41× and 1.20×
#   sooner (next bullet). The step time came back; the time to the reward did not.
# - **The race before, four configurations, two seeds each** (90 s per seed, learning rate 5e-4, at 40e0da9;
#   measured). The defaults reached the threshold in 55.2 and 51.9 s at 1,720–1,920 tokens/s.
#   - The recommended recipe (what `colo-kit plan --recommend` writes for 1.5B: no activation recomputing, token
#     ids without vLLM's text, the one-call push, no sleep): 1.21× the tokens/s (0.92–0.93 s per step against
#     1.06–1.19) and the threshold in 39.0 and 43.1 s, 1.41× and 1.20× sooner: faster on both seeds.
#   - `steps_per_generation=2`: 1.78× the tokens/s, 1.25× and 1.26× sooner.
#   - No activation recomputing alone: 1.04× the tokens/s yet 1.22× and 1.62× sooner.
#
#   That last row is the warning, and the later races confirm it: a knob that barely changes the step time
#   moved the time to the reward as much as the recipe did, and in an earlier 120 s race the defaults' own two seeds were 9 s apart (34.7 and 43.5 s)
#   while the recipe's were 0.85× and 1.18× of them. A time ratio under about 1.6× is within the policy's luck;
#   the step time, not the time to the reward, is what the recipe reliably buys. 2.5× sooner is out of reach
#   on-policy: generation is 0.68 s of a 0.92 s step, and sharing a generation between steps does not help
#   either (the next bullet).
# - **The reward moves per generation, not per optimizer step** (the column "generations to threshold", all
#   1.5B races at 5e-4). The on-policy runs (defaults, recipe and the single knobs, 20 seeds in all) got there
#   after 26–63 generations, half of them within 40. `steps_per_generation=2` got there after 33–38 generations
#   (67–77 optimizer steps, five seeds) and `steps_per_generation=4` after 33–36 (129–141 steps, three seeds):
#   twice and four times the steps bought no fewer generations. So the time to the reward is the number of
#   generations times one generation cycle, and the cycle is shortest on-policy: one generation, one push, one
#   training step.
# - **Tokens/s went up 5×, learning did not.** A per-device batch of 32 with `steps_per_generation=8` generates
#   256 completions at once and trains on them in 8 steps: about 5× the defaults' tokens/s, yet it needed about
#   3× *longer* to reach the threshold. Each optimizer step sees 32 completions instead of 8 and the learning rate
#   is the same, so it takes about as many steps — each of them longer.
# - **Staleness is a cost.** `steps_per_generation=8` at batch 8 trains 3.3× more steps per second, but 7 of
#   every 8 steps learn from completions of an older policy: at learning rate 5e-4 it reached the threshold no
#   sooner than the defaults, and one seed not at all. It is not PPO's clipping that holds it back: TRL's
#   `clip_ratio/region_mean` stayed at 0 in every run and under 0.2% of tokens in `steps_per_generation=8`; the
#   extra steps on an old generation simply move the reward little (the bullet above).
# - **Sharing a generation between fewer steps** (`steps_per_generation` 2 and 4, on top of the one-call push):
#   1.75× and 2.4× the defaults' tokens/s in a 60 s race, where both seeds of each reached the threshold
#   (38–42 s and 46–52 s) and the defaults, that day, did not: only a bound, "≥" (the defaults' 60 s over the
#   configuration's time). The longer race settles it: with 150 s per seed the defaults got there in 37 s and
#   `steps_per_generation=4` in 82 s — 1.9× the tokens/s, 0.45× the speed to the reward: 36 generations, as
#   many as an on-policy run needs, each of them four steps long.
# - **Sleep costs tokens here.** TRL's level-2 sleep at 1.5B switches in 0.17 s per step (sleep 0.05 s, two
#   wake-ups of 0.02 s, the push 0.08 s; the 90 s race) and ran at 0.8–0.99× the defaults' tokens/s; it buys
#   18 GiB of peak, which a 1.5B model on an H200 does not need. Releasing only the KV cache (`sleep_kv`,
#   `colo_kit.colocate.kv_sleep`) keeps the weights mapped: 0.15 s per switch (sleep 0.045 s, two wake-ups of 0.011 s, the same push) and a peak of
#   60.9 GiB. At 1.5B the push, not the re-mapping, is most of the switch, so keeping the weights saves little.
# - **The switch got cheap.** One `load_weights` call instead of one per tensor: 0.031 s per push instead
#   of 0.048 s (medians), and under 0.004 s per step with one push every 8 steps. At batch 8 most of a step is
#   generation: 256 decode steps of 8 sequences take about 0.6 s whatever else changes.
# - **The planner holds, batch 32 included:** the newest seed-0 NVML peak of every configuration run before the
#   CISPO race (17 at 1.5B and 7B) is within 4.2% of the prediction (measured against modelled); with it, all but
#   CISPO at batch 32 within 8.6%. It took one more part. PyTorch's own peaks
#   showed batch 32's tensors at 98.2–98.5 GiB and its caching allocator keeping 21–24 GiB more reserved above
#   them (2.9 GiB for the defaults, 6.4 for the recipe at batch 8), which the planner did not count: it had
#   predicted 104.8 GiB against 120.9 and 124.2. It now adds 0.6 GiB of reserve per GiB of activations and logits
#   (the median of PyTorch's own reserved-over-allocated ratio in these runs, not fitted to NVML) and counts
#   gradients and activations at the larger of the two rather than their sum (the backward pass frees one as it
#   makes the other): 122.7 GiB for batch 32.
#   Read seed 0:
#   up to 0cfd418 both seeds of a configuration ran in one process, and the second trainer's peak carries up to
#   18 GiB the first left behind (87.7 against 69.7 GiB for the defaults). Each seed now runs in a process of its own.
# - **A random model can cheat the length reward.** Many runs *collapse*: every completion becomes one short
#   token repeated (reward about -236, the same for all eight completions, so GRPO learns nothing more) instead of
#   learning to stop early (reward near 0). Which happens, and when, varies by seed — read the spread between
#   seeds before reading a ratio.

# %% [markdown]
# ### The same race at 7B
#
# Qwen2.5-7B's float32 training state (weights, gradients, AdamW) does not fit one H200 beside vLLM, so every
# 7B configuration trains in bfloat16 (`model_init_kwargs={"dtype": "bfloat16"}`), without ZeRO: 120 s per seed in
# the two oldest races, 180 s in the next two and 80 s in the two newest (each seed of the last four stops once
# past the threshold).

# %%
speed_7b = results.shown("04.speed_7b")
print(results.footnote(speed_7b))
pd.DataFrame(speed_7b["rows"]).set_index(["learning rate", "s per seed", "configuration"])

# %% [markdown]
# Measured (`results/speed_1xh200.json`). Read the newest race first: the defaults and the recipe as it now is
# (`steps_per_generation: 2` from 7B up), two seeds each, 80 s per seed, each seed stopped once past the
# threshold, at 2f0b343, in the same run as the 1.5B chain above.
#
# - **Tokens/s: the recipe 1.69×** (1,914 and 1,949 against the defaults' 1,146 and 1,147).
# - **Both recipe seeds reached the threshold**, in 40.2 and 43.6 s (17 and 19 generations). The defaults' seed 1
#   got there sooner, in 25.7 s (0.59×); their seed 0 was stuck from step 13 (−2,796, eight identical completions,
#   spread 0) and never did, so the recipe's seed 0 is at least 2.01× sooner, a bound. So at 7B the recipe is
#   less stuck, not faster: over the five races, nine of twelve on-policy seeds never reached the threshold and
#   nine of ten `steps_per_generation=2` seeds did.
# - **The planner holds:** NVML 114.2 and 114.7 GiB against 118.1 predicted; the defaults 101.4 and 101.9 against
#   101.6.
#
# The race before, at 32f45d7, the same settings:
#
# - **Tokens/s: the recipe 1.69×** (1,884–1,926 against the defaults' 1,127–1,129).
# - **Both recipe seeds reached the threshold, in 34.3 s** (15 and 16 generations). The defaults' seed 1 got there
#   sooner, in 29.9 s (0.87×); their seed 0 was stuck from step 7 (−2,796, eight identical completions) and never
#   did, so the recipe's seed 0 is at least 2.35× sooner, a bound.
# - **The planner holds:** NVML 114.2 and 114.7 GiB against 118.1 predicted; the defaults 101.4 and 101.9 against
#   101.6.
#
# The race before: the recipe alone, two seeds, 180 s per seed, at 33d43ba. With no defaults in that
# race its threshold (−1,428) comes from the recipe's own seed 0 first generation, and its "× defaults" columns
# are empty.
#
# - **Tokens/s: 1,935–1,960**, 1.69× the defaults' 1,148–1,158 of the race before (measured at another commit, the
#   defaults' code unchanged between them; a ratio across races, so read it as a guide).
# - **Seed 1 reached the threshold in 33.2 s (15 generations); seed 0 did not**: its reward reached −2,796 by
#   step 7 and from step 15 on its eight completions per prompt were identical (spread 0, entropy 0) until the
#   180 s were up — the same collapse as the on-policy seeds, and the first of six `steps_per_generation=2` seeds
#   to show it.
# - **The planner holds:** NVML 114.2 and 114.7 GiB against 119.8 predicted.
#
# The race before it: every configuration at one commit (8518be0), two seeds each, 180 s per seed, one process
# per seed.
#
# - **Tokens/s: the recipe 1.06×, `steps_per_generation=2` 1.67×** the defaults' 1,148–1,158 tok/s. Far from the 4×
#   goal: a 7B generation of 8 × 256 tokens takes 1.28 s of the defaults' 1.77 s step, and only a knob that
#   generates less often (`steps_per_generation`) makes it cheaper per step (generation 0.66–0.68 s per step at 2).
# - **Time to the threshold (−1,423): only `steps_per_generation=2` got there**, in 34.2 and 44.6 s (15 and 20
#   generations). All four on-policy seeds got stuck first: the defaults' two at step 9 (reward −2,540), the
#   recipe's at steps 11 and 13 (−2,796), with eight identical completions per prompt from then on (reward spread
#   0, entropy 0, loss 0) until the 180 s were up. Against defaults that trained 180 s without getting there,
#   `steps_per_generation=2` is at least 5.3× and 4.1× sooner: past the 2.5× goal, as a lower bound.
# - **The planner holds at 7B:** NVML 101.9 GiB against 103.3 predicted for the defaults, 113.2–114.7 against 119.8
#   for the recipe and `steps_per_generation=2` (1–6% over, the safe side).
# - **So the recipe changed at 7B.** The rows named `recipe` in this race and the ones before ran the on-policy
#   recipe; over those three races, seven of eight on-policy seeds (the defaults' and the recipe's) never got past
#   the threshold, and all four `steps_per_generation=2` seeds did. `colo-kit plan --recommend` now writes
#   `steps_per_generation: 2` from 7B up (its reason says why); below 7B it now takes CISPO on 8 steps per
#   generation (the newest 1.5B race, above), which has not run at 7B. The two newest races ran that recipe under
#   the name `recipe`: with their four seeds, seven of eight `steps_per_generation=2` seeds have reached the
#   threshold. Less stuck, not never stuck.
#
# Two seeds per configuration are few, but the two older races (at 0cfd418 and baa0b71, 120 s per seed; measured,
# the same file) went the same way, so read it as what these runs did, not yet as a rule:
# - **The recipe buys less at 7B: 1.10× the tokens/s** (1.70 s per step against 1.87). Generation is 1.30–1.32 s
#   of either step, and the recipe's knobs cut only the rest: training 0.36 → 0.27 s, the push 0.082 → 0.030 s.
# - **On-policy runs got stuck at 7B.** Both seeds of the defaults and the recipe's seed 0 were making eight
#   identical completions by step 8 or 9 (reward −2,796 and −2,540, spread 0): GRPO's advantage is then 0 for every
#   completion, nothing more is learned, and the threshold (−1,426) is never reached. The recipe's seed 1 got there
#   in 34.9 s (19 generations) and then stuck at −748.
# - **`steps_per_generation=2` reached the threshold with both seeds:** in 56.1 and 31.7 s (25 and 14
#   generations), at 1.73× the defaults' tokens/s (1.07–1.08 s per step: one generation of 16 completions every
#   two steps costs about what one of 8 did). Against the defaults' seed 1 of the same race, which trained 120 s
#   without getting there, seed 1 is at least 3.84× sooner; the defaults' seed 0 ran in the other race and did
#   not get there either. These runs got stuck too, later (steps 31 and 57), past the threshold. Four on-policy
#   seeds and two stale ones are few: read this as what happened in these runs, not yet as a rule.

# %% [markdown]
# ### How short can one generation be?
#
# If the reward moves per generation, the fastest run is the one with the shortest generation cycle, and most of
# a cycle is generating. `scripts/gpu/gen_latency.py` timed that alone: TRL 1.16's own `LLM(...)` arguments, the
# 1.5B model, 256 tokens per completion, one process per variant (measured, `results/gen_latency_1xh200.json`).

# %%
latency = results.shown("04.latency")
print(results.footnote(latency))
pd.DataFrame(latency["rows"])

# %% [markdown]
# - **8, 16 or 32 sequences take the same time**: 0.68–0.77 s for 256 decoding steps, about 2.9 ms a step, far
#   above the ~0.65 ms it takes to read 3 GB of weights once (modelled from 4.8 TB/s). A decoding step at this
#   size is mostly the engine's own work per step, not the GPU's.
# - **What vLLM already does for you:** CUDA graphs (eager mode: 4.83 s, 6.3× longer) and asynchronous scheduling
#   (off: 1.03 s, 1.34× longer) are both on under TRL's arguments.
# - **What is left:** the log-probabilities TRL asks for (`logprobs=0`, for its importance-sampling correction):
#   0.65 s without them, 17% less; vLLM's text (`detokenize=True`): 0.88 s, which the recipe already turns off.
# - **So on-policy has a floor.** One cycle is at least one generation (~0.65 s), one push (0.03 s) and one training
#   step (0.12 s without recomputing activations): about 0.8 s against the defaults' 0.89–1.30 s per step in the
#   races, at most about 1.1–1.6× sooner if every run needs as many generations (modelled from these measured
#   costs). Reaching the reward 2.5× sooner needs fewer generations, not a shorter one: CISPO's 5–7 generations of
#   8 steps each (the four newest races) are that.
# - **From 128 sequences on, a step grows with the batch** (`seqs128` and `seqs256`, one machine, at ee58631): 128
#   sequences in 1.09–1.13 s (4.3–4.4 ms a step), 256 in 1.88 s (7.3 ms), and 128 without log-probabilities in
#   0.79 s. The engine's Python work per token of every sequence now sets the pace, so sharing one generation
#   between 16 steps instead of 8 buys little (`cispo_b16_spg16`, above). The `commit` column says when each row
#   ran; compare rows of one commit (the 64-sequence rows, 1.45 s and 0.85 s, ran on different machines and days).
# - **An engine sized for the model's own limit** (`seqs128_len32k`: `max_model_len` 32,768, what TRL leaves when
#   `vllm_max_model_length` is unset; at bda5752): 128 sequences in 1.67 s, 64 in 0.91 s, 128 without
#   log-probabilities in 1.03 s. It ran on the bda5752 race's machine, which stepped slower, not beside `seqs128`:
#   so it is no ratio, and whether sizing the engine for the task makes a generation shorter stays unmeasured.

# ### Break it · pick the memory share by hand
#
# `vllm_gpu_memory_utilization` is a share of the *whole* GPU, not of what training leaves free. Pick it by hand
# for the fastest row above (batch 32, no checkpointing) and ask the planner; then ask it for its own share. The
# prediction stands on measurements: the same plan at 0.3 ran on an H200, and its peaks print beside the
# prediction. Change `u_by_hand` and run it again.

# %%
from colo_kit.memory.planner import recommend

u_by_hand = 0.6
fast = dict(model="qwen2.5-1.5b", per_device_train_batch_size=32, gradient_checkpointing=False, max_completion_length=256)
hand = estimate(**fast, vllm_gpu_memory_utilization=u_by_hand)
print(f"by hand, u = {u_by_hand}: peak {hand['peak_gib_per_gpu']:.1f} GiB per GPU of {planner.H200_GIB} -> "
      f"{'fits' if hand['fits'] else 'out of memory'} (modelled)")
at_03 = estimate(**fast, vllm_gpu_memory_utilization=0.3)["peak_gib_per_gpu"]
peaks = results.shown("04.peaks_at_0.3")
for row, how in zip(peaks["rows"], ["steps_per_generation=8", "on-policy"]):
    print(f"the same plan at u = 0.3, {how}: NVML peak {row['nvml_peak_gib']:.1f} GiB, PyTorch allocated "
          f"{row['torch_allocated_gib']:.1f} and reserved {row['torch_reserved_gib']:.1f} GiB "
          f"({results.footnote(peaks)}); planner {at_03:.1f} GiB (modelled)")
rec = recommend(**fast)
print(f"the planner's share: u = {rec['vllm_gpu_memory_utilization']} -> peak {rec['peak_gib_per_gpu']:.1f} GiB, "
      f"{SAFE:.0%} of the GPU at most (modelled)")

# %% [markdown]
# Each 0.1 of `u` is 14 GiB of an H200 that the engine reserves at start-up, whatever it needs: at 0.6 the engine
# and this trainer together want more than the GPU has, and the run dies in vLLM's memory profiler or in the first
# backward pass. The planner's share is the largest that keeps the predicted peak under its safety margin; the
# recipe (`colo-kit plan --recommend`) goes further and keeps 0.3 when that already holds a generation's sequences.
# The batch-32 rows back it: at 0.3 they peaked within 2% of the prediction, a fifth of it the allocator's
# reserve, so the planner's share for that batch stays close to the 0.3 it was measured at.

# %% [markdown]
# ## Closing note
#
# The errors of the planner (modelled) against every measured peak (`results/planner_validation.json`):

# %%
for r in validation["rows"]:
    print(f"{r['row']:<44} measured {r['measured_gib']:6.1f}  planner {r['predicted_gib']:6.1f} GiB  {r['error']:+.1%}")
fitted = validation["constants"]["fitted"]
print(f"\nfitted constants: { {k: v for k, v in fitted.items() if k != 'fitted_to'} } ({fitted['fitted_to']})")

# %% [markdown]
# ## Recap
#
# - A GRPO step has a generation phase and a training phase; the peak is the larger, and sleep moves the engine's
#   share out of the training phase.
# - Full fine-tuning in fp32 with AdamW costs 16 bytes per parameter; ZeRO-3 splits it over GPUs, offload moves the
#   optimizer's part to host memory — which then decides how many nodes a 72B run needs.
# - The planner is checked against measured NVML peaks; its recommendation says why it picked each setting.
#
# **Next:** `05_rewards_and_math500` — the rewards the posts train with, and an honest evaluation.
