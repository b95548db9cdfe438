# %% [markdown]
# # 02 · The colocated engine and sleep mode
#
# **You will**
# - build a colocated vLLM engine sized from training settings, and generate with it;
# - push a trainer's weights into it and prove, with a greedy probe, that it holds them;
# - put it to sleep at level 1 and level 2 and read what each frees (on a GPU; the measured H200 numbers otherwise);
# - time the switch one training step pays, part by part.
#
# **Time** (Run All, measured): {{measured_times}}. Uses one device.
# **Before this:** `00_quickstart`; `01_ping_pong` helps (why colocation at all).
#
# In colocate mode ([the first post](https://huggingface.co/blog/vllm-colocate), TRL PR #3394) every training process holds its own vLLM engine, built with
# `distributed_executor_backend="external_launcher"` inside the trainer's `torch.distributed` group. Training and
# generation then take turns on the same GPU, so the engine must **give its memory back while the trainer runs**:
#
# - **sleep level 1** — weights copied to CPU memory, KV cache discarded (the same weights come back);
# - **sleep level 2** — weights and KV cache both discarded (GRPO changes the weights every step anyway; the post
#   uses level 2 for 72B).
#
# One training step then costs a **switch**: `sleep` → `wake(weights)` → **push** the trainer's new weights →
# `wake(kv_cache)`. This notebook builds the kit's engine (`colo_kit.colocate.engine.ColocatedEngine`), generates, pushes
# weights, and — on a GPU — sleeps at both levels with `colo_kit.colocate.sleep.SleepManager`, plotting GPU memory (NVML) at
# each stage and timing each part of the switch. On a CPU, vLLM has no sleep mode: the notebook runs everything
# else and shows the H200 numbers committed under `results/`.

# %%

import ipywidgets as widgets
import pandas as pd
from IPython.display import Markdown, display

import colo_kit

colo_kit.quiet()  # vLLM's start-up log out of the cells
from colo_kit.labs import lab
from colo_kit.colocate.engine import ColocatedEngine, ColocateSettings
from colo_kit.env import Machine, vllm_version
from colo_kit.colocate.sleep import (SleepManager, SleepModeUnavailable, h200_reference, memory_figure, switch_figure,
                            switch_rows)

MACHINE = Machine.here()
GPU = MACHINE.gpus > 0
MACHINE.say(f"vLLM {vllm_version()}; " + ("one engine on GPU 0, sleep levels 1 and 2 live" if GPU else
            "one engine on the CPU; vLLM's CPU engine has no sleep mode, so those cells show the H200 numbers"))

# %% [markdown]
# ## 1 · Control panel
#
# The engine is sized from **training settings**, as in the post: how many sequences it generates at once
# (`max_num_seqs`), the longest sequence it holds (`max_model_len`, prompt plus completion), and
# `vllm_gpu_memory_utilization`, the share of the GPU the engine may take beside the trainer. Change the values and
# re-run the cells below.

# %%
wide = {"description_width": "initial"}
model_w = widgets.Dropdown(options=["tiny", "qwen2.5-0.5b", "qwen2.5-1.5b"],
                           value=("qwen2.5-1.5b" if MACHINE.gpu_mem_gib >= 70 else "qwen2.5-0.5b") if GPU else "tiny",
                           description="model", style=wide)
batch_w = widgets.IntSlider(value=8, min=1, max=64, description="per_device_train_batch_size", style=wide)
util_w = widgets.FloatSlider(value=0.3, min=0.05, max=0.9, step=0.05, description="vllm_gpu_memory_utilization",
                             style=wide, layout=widgets.Layout(width="560px"))  # wide enough to drag past its long label
level_w = widgets.ToggleButtons(options=[1, 2], value=2, description="sleep level", style=wide)
steps_w = widgets.IntSlider(value=3, min=1, max=10, description="switch steps", style=wide)
display(widgets.VBox([model_w, batch_w, util_w, level_w, steps_w]))

# %%
settings = ColocateSettings(per_device_train_batch_size=batch_w.value, max_prompt_length=64, max_completion_length=32,
                            vllm_gpu_memory_utilization=util_w.value, vllm_enable_sleep_mode=GPU)
print(f"max_num_seqs={settings.max_num_seqs}, max_model_len={settings.max_model_len}, "
      f"gpu_memory_utilization={settings.vllm_gpu_memory_utilization}, sleep mode={settings.vllm_enable_sleep_mode}")

# Bad settings fail before any engine is built, each in one line that names the value and the fix:
for bad in (ColocateSettings(vllm_tensor_parallel_size=3), ColocateSettings(vllm_gpu_memory_utilization=1.2)):
    try:
        bad.validate(world_size=2)
    except ValueError as err:
        print("ValueError:", err)

# %% [markdown]
# ### Exercise 1 · Size the engine
#
# `per_device_train_batch_size = 8`, `vllm_tensor_parallel_size = 2`, `gradient_accumulation_steps = 4`: what `max_num_seqs`
# does the colocated engine get? (Try it: `ColocateSettings(...).max_num_seqs`.)

# %%
answer = ...  # a number
lab.check("02.max_num_seqs", answer)

# %% [markdown]
# <details><summary>Solution (click)</summary>
#
# **64** = 8 × 2 × 4. The engine of a TP group generates for every rank of the group, for all micro-batches of one
# optimizer step at once — the post's `max_num_seqs = per_device_train_batch_size × tp × grad_accum`.
# </details>

# %% [markdown]
# ## 2 · Build the engine and generate
#
# One process here, so the engine makes a one-rank process group (gloo on CPU, NCCL on GPU) before vLLM starts —
# `external_launcher` joins an existing group, it never makes one. Under `torchrun --nproc_per_node 2` with
# `vllm_tensor_parallel_size=2` the two processes would form one TP group with the **same seed** (`rank // tp`, the
# fix for vLLM #15895), gather their prompts, and each keep its own completions
# (`torchrun --nproc_per_node 2 -m colo_kit_cli.engine_check --vllm-tensor-parallel-size 2 --sampled` shows
# it).

# %%
engine = ColocatedEngine(model_w.value, settings, enforce_eager=True)  # starts in seconds (notebook 00 says why)
lab.see("02.engine", "an engine up within seconds (eager), and generation of token ids, text and log-probs",
        startup_s=round(engine.startup_s, 1))
print(f"engine up in {engine.startup_s:.1f} s on {engine.device}; seed {engine.seed}, TP {engine.tp}")
out = engine.generate(["Summarise: the cat sat on the mat.", "2 + 2 ="], n=2, max_tokens=12)
pd.DataFrame({"prompt": [engine.tokenizer.decode(p) for p in out.prompt_ids], "completion": out.texts,
              "tokens": [len(c) for c in out.completion_ids],
              "mean logprob": [round(sum(lp) / len(lp), 2) for lp in out.logprobs]})

# %% [markdown]
# The model has random weights (no model hub here), so the text is noise; what matters is the shape: token ids,
# text and the sampled tokens' log-probabilities, which GRPO needs for its importance ratios.
#
# ## 3 · Push the trainer's weights
#
# After each optimizer step the trainer's weights go into the engine (`engine.push_weights(model)`: plain,
# ZeRO-3 gathered, or PEFT merged). A fixed **greedy probe** is a fingerprint of the weights the engine holds: the
# same weights must give the same tokens; different weights, different ones.

# %%
import torch
from transformers import AutoModelForCausalLM

trainer_model = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.bfloat16).to(engine.device)
before = engine.probe()
push_s = engine.push_weights(trainer_model)
same = engine.probe()
print(f"push of the same weights: {push_s * 1000:.1f} ms; probe unchanged: {same['token_ids'] == before['token_ids']}")

original = {k: v.clone() for k, v in trainer_model.state_dict().items()}
with torch.no_grad():
    for p in trainer_model.parameters():
        p.add_(torch.randn_like(p) * 0.02)
engine.push_weights(trainer_model)
changed = engine.probe()
trainer_model.load_state_dict(original)
engine.push_weights(trainer_model)
restored = engine.probe()["token_ids"] == before["token_ids"]
print(f"perturbed weights change the probe: {changed['token_ids'] != before['token_ids']}; "
      f"pushing the originals back restores it: {restored}")
lab.see("02.push", "True, True, True: the same weights keep the probe, other weights change it, the originals "
        "bring it back", same=same["token_ids"] == before["token_ids"],
        changed=changed["token_ids"] != before["token_ids"], restored=restored, push_ms=round(push_s * 1000, 1))

# %% [markdown]
# ### The same code in TRL
#
# `generate` and `push_weights` above are TRL's own: the engine hands them to `VLLMGeneration.generate`,
# `_iter_named_params` and `sync_weights` in `trl/generation/vllm_generation.py`, and builds vLLM with the `LLM(...)`
# arguments of `VLLMGeneration._init_vllm` (a test compares them with the installed TRL's). The table finds each idea's
# line in the TRL installed on this machine: open the file at that line and read it around.

# %%
from colo_kit.colocate.engine import where_in_trl

trl_lines = pd.DataFrame(where_in_trl())
trl_lines["where"] = trl_lines["where"] + "  (" + trl_lines["trl"].str.removeprefix("VLLMGeneration.") + ")"
trl_lines[["idea", "where", "line"]].style.hide(axis="index").set_properties(**{"text-align": "left"})

# %% [markdown]
# ## 4 · Sleep, wake, push: the switch of one training step
#
# `SleepManager.training(model)` is the "train now, generate next" block: the engine sleeps on entry and, on exit,
# wakes its weights, takes the trainer's weights, restores the model buffers from its own snapshot (vLLM #16564
# lost them after level 2), and wakes the KV cache. `self_check` runs a greedy probe before the sleep and after
# the wake + push of the same weights and raises if they differ.
#
# On a CPU this section stops at a clear error: vLLM's CPU engine has no sleep mode (it would log a warning and keep
# all its memory), so the kit refuses rather than pretend.
#
# ### Exercise 2 · The post's buffer pitfall, today
#
# The post hit vLLM #16564: level-2 sleep lost the model's *buffers*, and `load_weights` brings back parameters
# only, so generation after wake-up went wrong. With vLLM 0.26 (this kit's GPU tier), sleep at level 2, wake, push
# the trainer's weights and do **not** restore buffers yourself: does the greedy self-check pass or fail? Read
# `sleep()` and `wake_up()` in `vllm/v1/worker/gpu_worker.py` to decide.

# %%
answer = ...  # "pass" or "fail"
lab.check("02.no_buffer_restore", answer)

# %% [markdown]
# <details><summary>Solution (click)</summary>
#
# **Pass.** vLLM fixed it (PR #16889): before a level-2 sleep its GPU worker copies every `named_buffers()` tensor to
# the CPU, and `wake_up()` copies them back. `SleepManager.restore_buffers` is the post's workaround, still there for
# older vLLM; `SleepManager(...).self_check(model)` is how you would see it fail on one.
# </details>
#
# ### Break it · lose the buffers
#
# What losing them does, on the engine built above. A level-2 sleep on an old vLLM left the memory of the model's
# buffers (here the rotary embedding's cos/sin table) unrestored: memory mapped again holds whatever it holds. On a
# CPU there is no sleep, so the cell plays the loss by overwriting the buffers with arbitrary values. Then it pushes
# the trainer's weights (parameters only, as `load_weights` does) and compares the greedy probe with the one before.
# A random model's greedy output repeats one token whatever the positions say, so the log-probabilities are compared
# too. `restore_buffers` is what `SleepManager` does after a wake-up: put the buffers back from a snapshot taken
# before the sleep. It starts off; run the cell, then set it to `True` and run it again. (The engine gets its buffers
# back after the cell either way, for the cells below.)

# %%
from colo_kit.labs.pitfalls import lost_buffers

restore_buffers = False  # <- change to True: the snapshot goes back before the probe
rows = lost_buffers(engine, trainer_model, restore=restore_buffers)
display(pd.DataFrame(rows).set_index("step"))
after = rows[-1]
print(f"✔ the same greedy tokens and log-probs as before the sleep (change {after['max |log-prob change|']})"
      if after["same tokens"] and after["max |log-prob change|"] == 0 else
      f"✘ the engine now generates from other numbers than the trainer's weights: log-probs moved by up to "
      f"{after['max |log-prob change|']} nats, with no error raised")

# %%
try:
    mgr = SleepManager(engine, level=level_w.value)
except SleepModeUnavailable as err:
    mgr = None
    print("SleepModeUnavailable:", err)

# %%
if mgr is None:
    MACHINE.say("no sleep mode: the switch below is skipped; section 5 shows it measured on an H200")
else:
    check = mgr.self_check(trainer_model)
    print("self-check:", {k: check[k] for k in ("passed", "same_tokens", "max_logprob_diff")})
    for _ in range(steps_w.value):
        with mgr.training(trainer_model):
            pass  # the optimizer step would run here, with the engine's memory free
        engine.generate(["x"] * 4, max_tokens=8)
    times = pd.DataFrame([r for r in mgr.stages if r["seconds"] is not None])
    display(times.groupby("stage")["seconds"].median().to_frame("median s"))
    memory_figure(mgr.stages, f"{model_w.value}: GPU memory at each stage, level {level_w.value} (this run)").show()

# %%
if mgr is None:
    MACHINE.say("no sleep mode: the other level is skipped too; section 5 shows both levels measured on an H200")
else:
    mgr1 = SleepManager(engine, level=1 if level_w.value == 2 else 2)
    mgr1.self_check(trainer_model)
    memory_figure(mgr1.stages, f"{model_w.value}: level {mgr1.level} (this run)").show()

# %% [markdown]
# ## 5 · The H200 reference (measured)
#
# `scripts/gpu/engine_bench.sh` ran on 2×H200 (vLLM 0.26.0): random-init Qwen2.5-1.5B and 7B, the kit's engine at
# `gpu_memory_utilization=0.3` against a plain `vllm.LLM` at 0.9 (256 prompts × 256 tokens, `ignore_eos`), and the
# switch per training step, each part timed over several steps, with NVML memory at each stage
# (`results/engine_bench.json`). That run timed a standalone engine of the kit's, not TRL's, with the weights pushed
# in one batched `load_weights` call; TRL's own push is one call per tensor. In GRPO runs on one H200 (no sleep,
# 1.5B) TRL's push took 0.060 s per step and the one-call push 0.020 s (measured, `results/speed_1xh200.json`;
# notebook 04, section 7).

# %%
ref = h200_reference()
display(Markdown(f"**Source:** {ref['source']}"))
if "summary" in ref:
    scalars = {m: {k: v for k, v in s.items() if not isinstance(v, dict)} for m, s in ref["summary"].items()}
    display(pd.DataFrame(scalars))  # one column per model: the measured values stay on screen
    display(pd.DataFrame(switch_rows(ref)).set_index(["model", "level"]).round(4))
    switch_figure(ref).show()

# %% [markdown]
# The two charts below look alike, and that is the lesson: on the **GPU** both levels free the same memory (NVML sees
# only the GPU). They differ elsewhere. Level 1 keeps a copy of the weights in **CPU memory** (the host needs room
# for it) and wakes by copying it back; level 2 keeps nothing, so waking needs the trainer's weights pushed in — which
# GRPO does every step anyway, hence the post's choice of level 2.

# %%
part = ref.get("parts", {}).get("qwen2.5-1.5b/colocate", {})
if "level2" in part:
    memory_figure(part["level2"]["stages"], "Qwen2.5-1.5B on H200, level 2: NVML memory per stage (measured)").show()
    memory_figure(part["level1"]["stages"], "Qwen2.5-1.5B on H200, level 1 (measured)").show()
else:
    MACHINE.say(ref["source"])

# %% [markdown]
# ## 6 · Shut down cleanly
#
# With sleep mode, vLLM could segfault at interpreter exit (vLLM #16993). `engine.close()` wakes any sleeping
# memory, stops the engine core and collects it while CUDA is still alive, then destroys vLLM's groups (and the
# process group only if the engine made it). It is also registered with `atexit`.

# %%
engine.close()
print("closed")

# %% [markdown]
# ## Recap
#
# - A colocated engine is sized from training settings: `max_num_seqs = per_device_train_batch_size × tp × grad_accum`,
#   `max_model_len = prompt + completion`, and its share of the GPU, `vllm_gpu_memory_utilization`.
# - A greedy probe is a fingerprint of the weights an engine holds: it is how the kit checks every push and wake.
# - Sleep level 1 parks the weights in CPU memory; level 2 drops them and needs a push — the natural fit for GRPO.
# - Every training step pays the switch (sleep, wake, push, wake the KV cache); section 5 shows its parts measured.
#
# **Next:** `03_tp_tuning` — sharding one engine over several GPUs, and when that helps.
