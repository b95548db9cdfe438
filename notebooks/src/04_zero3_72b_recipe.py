# %% [markdown]
# # 04 · The 72B recipe: ZeRO-3, sleep level 2 and a memory planner
#
# **You will**
# - split one GRPO step's GPU memory into its parts, phase by phase, with `colo_kit.memory.planner`;
# - check the planner against peaks measured on H200s;
# - work out what the post's 72B recipe needs (GPUs, sleep level, offload, host memory) and generate its configs;
# - see on one GPU why more tokens per second is not a faster lesson.
#
# **Time** (Run All, measured): {{measured_times}}. No GPU needed: the planner is arithmetic.
# **Before this:** `02_sleep_mode` (what sleep frees).
#
# The last experiment of [the first post](https://huggingface.co/blog/vllm-colocate) trained **Qwen2.5-Math-72B**
# with colocated vLLM: **4 fewer GPUs** than plain TRL (whose vLLM server needed its own) and still **~1.26×
# faster**, with nearly identical reward curves (quoted). Two things made 72B fit beside a vLLM engine:
#
# - **vLLM sleep, level 2**: between generations the engine discards its weights and KV cache, handing the GPU
#   to the trainer. GRPO pushes new weights every step anyway, so nothing worth keeping is lost.
# - **DeepSpeed ZeRO stage 3** (weights, gradients and optimizer states partitioned over the GPUs) with
#   `"offload_optimizer": {"device": "cpu"}`, `"overlap_comm": true`, `"contiguous_gradients": true`,
#   launched with Accelerate.
#
# Whether a run fits is a sum of parts. This notebook adds them up with `colo_kit.memory.planner`, checks the sum
# against measured peaks, sizes the 72B recipe and its configs, and ends on one GPU, where the question becomes how
# fast a run learns.

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
from colo_kit.memory.charts import parts_figure
from colo_kit.memory.planner import Plan, estimate, plan_report, what_fits
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
# What TRL 1.16 keeps, read in its source: a model given by path is loaded in **float32** (16 bytes per parameter
# with AdamW), `gradient_checkpointing` is on by default, and the per-token log-probs use a fused, chunked LM head,
# so the `(tokens × 151,936)` logits are never materialised. Here is a setting that ran on H200s: Qwen2.5-1.5B,
# 2 GPUs, `u = 0.3`, sleep level 2, 64 completions per GPU. Every number below is modelled by the planner.

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
# GiB of activations, was read from PyTorch's own peaks in the one-H200 runs of section 7; everything else comes
# from the shapes.

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
server = next(r for r in rows if r["row"].startswith("server"))
lab.see("04.planner", f"every colocate row within 10% (the server-mode row is the known exception, {server['error']:+.0%} "
        "in the chart above)", worst_colocate_error=max(abs(r["error"]) for r in colocate))

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
# over all nodes. The same function's commands were tested as two machines on one host: two `accelerate launch`
# processes, machine ranks 0 and 1, the tiny model over gloo, plain data parallelism and this ZeRO-3 JSON (measured,
# `results/two_machines_cpu.json`).

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
# `trl vllm-serve` at TP 8. The cross-node knobs are `GRPOConfig` fields (`vllm_server_host`, `vllm_server_port`,
# and `vllm_group_port`, the weight sync's NCCL rendezvous on training node 0);
# `colo_kit.memory.recipes.server_node_commands` writes the server's line, each training node's line and a SLURM
# batch script that starts the server first and waits for its `/health`. Its commands were tested as two "nodes" on
# one host, HTTP weight sync standing in for NCCL on a CPU (measured, `results/server_node_cpu.json`).

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
# completions needs about 149 GiB per GPU instead of about 82 (modelled), more than an H200 has.

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
# ## 7 · Faster on one GPU: a faster token is not a faster lesson
#
# The planner says what fits; what runs fastest is measured. `scripts/gpu/speed.sh` trains random-init Qwen2.5-1.5B
# on one H200 with the length reward (256-token completions, G = 8), one process per seed, every configuration under
# the same learning rate and the same seconds per seed. It starts from TRL's colocate defaults and adds one knob at a
# time: `gradient_checkpointing=False`, `generation_kwargs={"detokenize": False}`, the weight push in one
# `load_weights` call (`colo_kit.colocate.bucketed_push`), `steps_per_generation=8`, per-device batch 32. Beside them
# run TRL's level-2 sleep and the recipe `colo-kit plan --recommend` writes. Each is timed on two clocks:
#
# - **completion tokens/s**, steady state (whole generation cycles, the first left out);
# - **time to the threshold**: seconds of training until the running mean reward gets halfway from where the
#   untrained model starts to the best reward (0), per seed.
#
# Time ratios are against TRL's defaults on the same seed; "not reached" means not within the budget, and "≥" is a
# bound against defaults that never got there. The 7B rows train in bfloat16 without ZeRO (7B's float32 training
# state does not fit one H200 beside vLLM), and its recipe shares each generation between two steps.

# %%
import pandas as pd

from colo_kit import results

speed, speed_7b = results.shown("04.speed"), results.shown("04.speed_7b")
budget = sorted({(r["learning rate"], r["s per seed"]) for r in speed["rows"] + speed_7b["rows"]})
print(results.footnote(speed), "· learning rate and seconds per seed:", ", ".join(" and ".join(b) for b in budget))
table = pd.concat({"1.5B": pd.DataFrame(speed["rows"]), "7B": pd.DataFrame(speed_7b["rows"])}, names=["model", "row"])
table = table.reset_index("row", drop=True).set_index("configuration", append=True)
table.drop(columns=["learning rate", "s per seed"])


# %%
def seed0(cell):
    """A table cell's first seed ("1.82 / ≥ 3.66" -> 1.82, "≥ 2.01" -> 2.01), or None where it was not reached."""
    try:
        return float(str(cell).split("/")[0].replace("≥", "").replace(",", ""))
    except ValueError:
        return None


names = [r["configuration"] for r in speed["rows"]]
fig = go.Figure()
fig.add_bar(name="× the defaults' completion tokens/s", x=names,
            y=[seed0(r["× defaults (tok/s)"]) for r in speed["rows"]])
fig.add_bar(name="× sooner to the threshold (seed 0)", x=names,
            y=[seed0(r["× defaults (time)"]) for r in speed["rows"]])
fig.add_hline(y=1, line_dash="dash", annotation_text="TRL's defaults")
fig.update_layout(barmode="group", yaxis_title="× TRL's defaults", height=420,
                  title="1.5B on one H200: more tokens per second is not sooner to the reward (measured)")
fig.show()
errors = [r["planner GiB"] / seed0(r["NVML peak GiB"]) - 1 for r in speed["rows"] + speed_7b["rows"]
          if seed0(r["NVML peak GiB"])]
print(f"the planner against seed 0's NVML peak, every row of both models: {min(errors):+.1%} to {max(errors):+.1%} "
      "(modelled against measured)")

# %% [markdown]
# What the table says:
#
# - **Tokens/s is not time to the reward** (measured, `results/speed_1xh200.json`, as every number below). Every
#   knob buys tokens/s, but on seed 0 only the on-policy ones also got there sooner: `gradient_checkpointing=False`
#   1.22× the tokens/s and 1.43× sooner, while `steps_per_generation=8` made 3.54× the tokens/s and got there 0.97×
#   as fast, and batch 32 on top 5.06× and 0.71×.
# - **Stale steps teach little under TRL's default loss.** With `steps_per_generation=8`, seven of every eight
#   optimizer steps learn from completions of an older policy: it needed 17 generations, 136 optimizer steps, where
#   the defaults needed 33 generations of one step each. CISPO (`loss_type="cispo"`) clips each token's importance
#   weight but keeps its gradient, and with it the stale steps teach.
# - **The recipe puts it together** (CISPO, 8 steps per generation, batch 16, no activation recomputing, vLLM sized
#   for the longest prompt plus the completion): 4.39× the tokens/s, and the threshold after 4 and 6 generations,
#   in 19.0 and 22.1 s: 1.82× sooner on seed 0, at least 3.66× on seed 1, where the defaults never got there.
# - **Seeds differ.** The defaults reached the threshold on seed 0 and never on seed 1. A random
#   model can also cheat the length reward by collapsing onto one short token repeated: eight identical completions
#   leave GRPO nothing to compare. Read the spread between seeds before a ratio.
# - **At 7B the recipe is less stuck, not faster**: 1.69× the tokens/s, and both recipe seeds reached the threshold;
#   the defaults' seed 1 got there sooner (0.59×) and their seed 0 got stuck and never did.

# %% [markdown]
# ### Over many seeds, on an 80 GB GPU and on the H200
#
# Two seeds cannot carry a time ratio, so `scripts/gpu/speed.sh` also races only TRL's defaults and the recipe over
# many seeds. On the H100, `plan --recommend` keeps CISPO on 8 steps per generation at batch 16 by setting PyTorch's
# expandable segments (the default allocator's reserve would not fit). Each line is one seed's running mean reward;
# the dashed line is the threshold (measured, `results/speed_1xh100.json` and `results/speed_1xh200.json`).

# %%
def seed_race(entry, gpu):
    """One race of seeds: each seed's running mean reward as a line, and the medians and spreads in words."""
    print(results.footnote(entry), "·", entry["race"], "per seed")
    fig = go.Figure()
    for name, colour in (("trl_defaults", "#7f7f7f"), ("recipe", "#d62728")):
        c = entry["configs"][name]
        for seed, curve in zip(c["seeds"], c["curves"]):
            fig.add_scatter(x=[t for t, _ in curve], y=[m for _, m in curve], mode="lines", line_color=colour,
                            name=name, legendgroup=name, showlegend=seed == c["seeds"][0], opacity=0.7)
        low, high = c["range_s"]
        print(f"{name:<13} {c['tokens_per_s_vs_defaults']:.2f}x the tokens/s; time to the threshold: median "
              f"{c['median_s']:.1f} s, {c['reached']} seeds reached it, fastest {low:.1f} s, slowest "
              f"{f'{high:.1f} s' if high else 'not within the budget'}; NVML peak {min(c['nvml_peak_gib']):.1f}-"
              f"{max(c['nvml_peak_gib']):.1f} GiB against the planner's {c['planner_peak_gib']:.1f} (measured, modelled)")
    fig.add_hline(y=entry["threshold_reward"], line_dash="dash", annotation_text="threshold")
    fig.update_layout(xaxis_title="seconds of training", yaxis_title="running mean reward", height=420,
                      title=f"1.5B on one {gpu}: every seed of TRL's defaults and of the recipe (measured)")
    fig.show()
    d, r = entry["configs"]["trl_defaults"], entry["configs"]["recipe"]
    low, high = r["one_seed_vs_one"]
    print(f"the medians: {d['median_s']:.1f} / {r['median_s']:.1f} s = {r['median_vs_defaults']:.2f}x sooner; one "
          f"reached recipe seed against one reached defaults seed: {low:.1f}x to {high:.1f}x (measured)")


seed_race(results.shown("04.seeds_h100"), "H100 80 GB")

# %%
seed_race(results.shown("04.seeds_h200"), "H200")

# %% [markdown]
# What "N× sooner" means here: half the recipe's seeds reached the threshold within its median, half the defaults'
# within theirs, and the ratio is of those two medians (a seed that never got there counts as slower than all that
# did). It is a statement about the middle of two spreads, not about every seed: one seed against one reads anything
# in the ranges printed above, and a seed of either can miss the budget. The tokens/s ratio holds on every seed; the
# time holds as a median.
#
# **7B on the H100 80 GB.** TRL's defaults do not fit (83 GiB, modelled), so the recipe races their fastest variant
# that does: the defaults with sleep mode. The recipe recomputes activations rather than hand the optimizer to
# DeepSpeed's CPU Adam (19-20 s a step in `results/zero3_run.json`), and shares each generation between two steps:

# %%
seven = results.shown("04.h100_7b")
print(results.footnote(seven), "·", seven["race"], "per seed")
base = seven["configs"]["defaults_sleep"]["completion_tokens_per_s"][0]
for name, c in seven["configs"].items():
    print(f"{name:<15} {c['completion_tokens_per_s'][0]:>7.1f} tokens/s ({c['completion_tokens_per_s'][0] / base:.2f}x), "
          f"{c['s_per_step'][0]:.2f} s a step, NVML peak {c['nvml_peak_gib'][0]:.1f} GiB against the planner's "
          f"{c['planner_peak_gib']:.1f} ({c['planner_peak_gib'] / c['nvml_peak_gib'][0] - 1:+.1%}) (measured, modelled)")

# %% [markdown]
# ### The recipe for the GPU you have
#
# `colo-kit plan --recommend` reads your GPU's memory (NVML) and writes the recipe that fits it. For the 1.5B and 7B
# models on GPUs of four sizes (modelled), with the races marked: on the H100 this recipe ran; on the H200, the same
# training settings ran with PyTorch's default allocator.

# %%
from colo_kit.memory.planner import Plan

KEYS = ("per_device_train_batch_size", "steps_per_generation", "loss_type", "gradient_checkpointing",
        "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode")
# each card by the memory CUDA can use on it (the H100's and the H200's as NVML read them on the machines that raced)
CARDS = {"24 GB": 23.5, "48 GB": 44.4, "H100 80 GB": 79.1, "H200 141 GB": 139.8}
RACED = {("qwen2.5-1.5b", "H100 80 GB"): "1×H100 (results/speed_1xh100.json)",
         ("qwen2.5-7b", "H100 80 GB"): "1×H100 (results/speed_1xh100.json)",
         ("qwen2.5-1.5b", "H200 141 GB"): "1×H200 (results/speed_1xh200.json)"}
sizes = []
for model, dtype in (("qwen2.5-1.5b", "float32"), ("qwen2.5-7b", "bfloat16")):
    for card, gib in CARDS.items():
        r = recipe(Plan(model=model, gpu_mem_gib=gib, train_dtype=dtype))
        fields = {name: value for name, value, _ in r["fields"]}
        sizes.append({"model": model, "GPU": card, **{k: fields.get(k, "") for k in KEYS},
                      "expandable segments": bool(r.get("environment")),
                      "predicted peak GiB (modelled)": round(r["peak_gib_per_gpu"], 1) if r["fits"] else "does not fit",
                      "raced on": RACED.get((model, gib), "")})
pd.DataFrame(sizes).set_index(["model", "GPU"])

# %% [markdown]
# ### Where a step's time goes
#
# At batch 8 most of a defaults step is generation (the `generation · push · training` column).
# `scripts/gpu/gen_latency.py` timed generation alone, with TRL 1.16's own `LLM(...)` arguments, the 1.5B model and
# 256 tokens per completion:

# %%
latency = results.shown("04.latency")
print(results.footnote(latency))
for r in latency["rows"]:
    if r["variant"] in ("trl", "no_async", "eager") or (r["variant"] == "seqs64" and r["sequences"] <= 32):
        print(f"{r['variant']:<9} {r['sequences']:>3} sequences  {r['sampling']:<38} {r['median s']:.2f} s "
              f"({r['ms per decoding step']:.1f} ms a decoding step)")

# %% [markdown]
# - **8, 16 or 32 sequences take about the same time** (measured, above): a decoding step at this size is mostly
#   the engine's own work, not the GPU's. That is why a bigger batch, or one generation shared by several steps,
#   buys tokens/s so cheaply.
# - **vLLM already does the rest** under TRL's arguments: CUDA graphs (eager mode is about 6× slower) and
#   asynchronous scheduling. What is left are the log-probabilities TRL asks for and vLLM's text, which the recipe
#   turns off.
# - **Inside TRL's trainer** most of a generation is vLLM's scheduler and output handling, in Python, once per token
#   of every sequence; Python's garbage collector is under 3% of it (measured on one H200,
#   `results/gen_in_trainer_1xh200.json`).
#
# So an on-policy step cannot get much shorter than one generation plus one training step: reaching the reward
# sooner needs fewer generations, not shorter ones, and that is what CISPO's shared generations give.

# %% [markdown]
# ### Break it · pick the memory share by hand
#
# `vllm_gpu_memory_utilization` is a share of the *whole* GPU, not of what training leaves free. Take TRL's
# defaults (1.5B, batch 8, checkpointing on) with a share picked by hand, and ask the planner; then ask it for its
# own share. On a GPU the cell then **runs** both, two GRPO steps each in a process of its own, while NVML reads the
# GPU's memory (on a CPU, it shows the same runs on one H100). Set `u_by_hand` to 0.9, run the cell, read where the
# run stopped, then set it back.

# %%
from colo_kit.env import has_cuda
from colo_kit.labs.pitfalls import share_by_hand

u_by_hand = 0.3  # <- the marked value: the engine's share of the whole GPU
rows, hand = share_by_hand(u_by_hand)
display(pd.DataFrame(rows).set_index("share"))
parts_figure(hand, title=f"u = {u_by_hand} by hand: {'fits' if hand['fits'] else 'over the GPU'} (modelled)").show()
if not has_cuda():
    ran = results.shown("04.share_by_hand_h100")
    print(f"On a CPU vLLM has no share of a GPU to exceed (its KV cache is VLLM_CPU_KVCACHE_SPACE GiB), so nothing "
          f"trains here. The same runs on one H100, by hand at 0.3 and 0.9 ({results.footnote(ran)}):")
    display(pd.DataFrame(ran["rows"]).set_index("share"))

# %% [markdown]
# Each 0.1 of `u` is a tenth of the GPU that the engine reserves at start-up, whatever it needs. Past the planner's
# share the engine and the trainer together want more than the GPU has: the run stops in vLLM's start-up check or in
# the first backward pass (on a GPU the table says which). The planner's share is the largest that keeps the
# predicted peak under its safety margin; the recipe (`colo-kit plan --recommend`) keeps 0.3 when that already holds
# a generation's sequences and spends the rest on training.

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
# - On one GPU, tokens/s and time to the reward are two clocks: sharing a generation between steps buys the first,
#   and only a loss that lets stale steps teach (CISPO) turns it into the second.
#
# **Next:** `05_rewards_and_math500` — the rewards the posts train with, and an honest evaluation.
