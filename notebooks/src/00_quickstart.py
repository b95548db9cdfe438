# %% [markdown]
# # 00 · Quickstart: GRPO with vLLM colocated in the trainer
#
# **You will**
# - run TRL's `GRPOTrainer` with `use_vllm=True, vllm_mode="colocate"` on a model built offline;
# - watch the first post's length reward rise, step by step;
# - read the two numbers that prove the colocated engine follows the trainer's weights;
# - generate with the engine that lives inside the trainer.
#
# **Time** (Run All, measured): {{measured_times}}. Uses one device, whatever the machine has.
# **Before this:** Python and a first idea of reinforcement learning; nothing about vLLM or TRL.
#
# **GRPO** (Group Relative Policy Optimization, from the DeepSeekMath paper) is *online* RL: at every step the
# model writes several answers (a *group*) to each prompt, a reward function scores them, and the model is
# pushed towards the answers that scored above their group's average. No value network, no fixed dataset of
# answers — the model learns from what it just generated.
#
# That makes **generation the bottleneck**: every optimizer step waits for fresh completions. TRL generates
# them with **vLLM**, in one of two ways:
#
# | mode | where vLLM runs | what the GPUs do |
# |---|---|---|
# | `server` | its own process on its own GPU(s), reached over HTTP | trainers wait while vLLM generates, vLLM waits while they train: **ping-pong** |
# | `colocate` | inside every training process, on the same GPU | generation and training take turns on one device; nobody waits for another machine |
#
# Colocation (TRL PR #3394) starts vLLM with `distributed_executor_backend="external_launcher"`, so each
# training rank owns an engine in the same `torch.distributed` group. [The first post](https://huggingface.co/blog/vllm-colocate) quotes it up to
# **1.43×** faster (1.5B) and **1.35×** (7B) than server mode on 8 GPUs, and running a 72B model on 4 fewer GPUs
# (quoted; notebook 01 shows what the kit measured and modelled).

# %%
import math

import colo_kit

colo_kit.quiet()  # the libraries' start-up chatter off; their errors stay
from colo_kit.labs import lab
from colo_kit.env import Machine, describe
from colo_kit.models import default_preset, get_preset

MACHINE = Machine.here()
versions = describe()["versions"]
print(f"torch {versions['torch']} | vllm {versions['vllm']} | trl {versions['trl']}")
MACHINE.say(f"one training process with its colocated engine, the {default_preset()} preset"
            + (" on GPU 0 (this notebook uses one GPU)" if MACHINE.gpus else " on the CPU"))

# %% [markdown]
# ## The model
#
# No hub needed: `colo_kit.models` builds the real Qwen2 architecture with random weights and a tokenizer
# made on the spot (byte-level BPE with Qwen2's pre-tokenizer). On a CPU the preset is `tiny` (2 layers,
# hidden 128 — vLLM's CPU attention needs heads of at least 32 dims); on a GPU it is Qwen2.5-0.5B's exact
# shape. Online, pass a hub id such as `"Qwen/Qwen2-0.5B-Instruct"` (the post's model) instead — same code.

# %%
preset = get_preset(default_preset())
print(f"preset {preset.name}: {preset.num_hidden_layers} layers, hidden {preset.hidden_size}, "
      f"{preset.num_attention_heads} heads ({preset.num_key_value_heads} KV), vocab {preset.vocab_size}, "
      f"{preset.num_params() / 1e6:.1f}M parameters")

# %% [markdown]
# ## Control panel
#
# Move the sliders, then run the cells below again. `num_generations` is the group size G, and the per-device batch
# (`per_device_train_batch_size`) is set from it: twice G completions. The reward scores each completion by how far its
# length is from `target` characters. A *compiled* engine (vLLM's default: torch.compile and, on a GPU,
# CUDA graphs) decodes faster but starts much later; for forty steps the quickstart starts vLLM eager.

# %%
import ipywidgets as widgets
from IPython.display import display

wide = {"description_width": "initial"}
steps_w = widgets.IntSlider(value=40, min=5, max=200, step=5, description="max_steps", style=wide)
gen_w = widgets.IntSlider(value=8, min=2, max=16, step=2, description="num_generations (G)", style=wide)
target_w = widgets.IntSlider(value=20, min=0, max=100, step=5, description="target characters", style=wide)
compiled_w = widgets.Checkbox(value=False, description="compiled engine (torch.compile + CUDA graphs)", style=wide,
                             layout=widgets.Layout(width="auto"))  # the default width cuts the label off
display(widgets.VBox([steps_w, gen_w, target_w, compiled_w]))

# %% [markdown]
# ### Exercise 1 · Predict before you train
#
# With the panel's defaults (`num_generations` = 8, `per_device_train_batch_size` = 16), how many *different
# prompts* does one optimizer step train on? Replace the `...` and run the cell.

# %%
answer = ...  # a number
lab.check("00.prompts_per_step", answer)

# %% [markdown]
# <details><summary>Solution (click)</summary>
#
# **2.** The batch holds whole groups: sixteen completions in groups of eight completions of one prompt, so two
# prompts, each compared within its own group — that comparison is GRPO's "advantage".
# </details>

# %% [markdown]
# ## Train
#
# `colo_kit.grpo.train.run_grpo` builds TRL's `GRPOConfig(use_vllm=True, vllm_mode="colocate",
# vllm_gpu_memory_utilization=0.3, ...)` and `GRPOTrainer` — read it, it is short. The progress bar is the
# trainer's own; every step generates with the colocated vLLM engine, scores, and updates the weights, and the
# next step first pushes the new weights into vLLM.

# %%
from colo_kit.grpo.train import run_grpo

run = run_grpo(
    preset.name, "colocate",
    reward="length", target_length=target_w.value,
    max_steps=steps_w.value, num_generations=gen_w.value, per_device_train_batch_size=2 * gen_w.value,
    max_completion_length=32, learning_rate=5e-3, seed=0, vllm_enforce_eager=not compiled_w.value,
)
print(f"{len(run.steps)} steps in {run.elapsed_s} s: mean reward {run.rewards[0]:.1f} -> {run.rewards[-1]:.1f}")

# %%
from plotly.subplots import make_subplots

steps = run.series("step")
fig = make_subplots(specs=[[{"secondary_y": True}]])
fig.add_scatter(x=steps, y=run.rewards, name="mean reward", mode="lines+markers")
fig.add_scatter(x=steps, y=run.series("completions/mean_length"), name="mean completion length (tokens)",
                mode="lines", line=dict(dash="dot"), secondary_y=True)
fig.update_layout(title=f"GRPO, colocated vLLM, length reward (target {target_w.value} characters), this run",
                  xaxis_title="optimizer step", height=420)
fig.update_yaxes(title_text="mean length reward", secondary_y=False)
fig.update_yaxes(title_text="tokens", secondary_y=True)
fig.show()
lab.see("00.reward", "the mean reward climbs within the first few dozen steps. Read the climb, not the "
        "digits: with the same seed, the start and the end differ from machine to machine, because CPUs with "
        "different instruction sets and GPUs round differently and sample different tokens from there on "
        "(compare the lines below)", steps=len(run.steps), first=run.rewards[0], last=run.rewards[-1],
        climbed=run.rewards[-1] - run.rewards[0])

# %% [markdown]
# The reward climbs because the policy learns to stop early (the end-of-turn token) and to prefer short
# tokens. Nothing here needs a good model: even random weights learn it, which is why the post uses it as a
# smoke test. Two numbers TRL logs tell you the colocated engine really follows the trainer:
# `sampling/sampling_logp_difference/mean` (vLLM's log-probs vs the trainer's for the same tokens) and the
# importance-sampling ratio (the trainer's probability of a sampled token over vLLM's).
#
# ### Exercise 2 · Break it in your head
#
# Suppose the weights stopped reaching vLLM after each optimizer step. What would the log-prob gap do over the
# steps: grow, shrink, or stay near 0?

# %%
answer = ...  # "grow", "shrink" or "stay near 0"
lab.check("00.broken_sync", answer)

# %% [markdown]
# <details><summary>Solution (click)</summary>
#
# **Grow.** vLLM would keep sampling from the old policy while the trainer moves on, so the two disagree more
# every step and the importance ratios drift from 1.
# </details>

# %%
gap = run.series("sampling/sampling_logp_difference/mean")
ratio = run.series("sampling/importance_sampling_ratio/mean")
print(f"vLLM vs trainer log-prob gap: first {gap[0]:.4f}, last {gap[-1]:.4f} (nats)")
print(f"importance-sampling ratio: first {ratio[0]:.3f}, last {ratio[-1]:.3f}")
lab.see("00.sync", "the gap stays near 0 (well under 0.05 nats) and the ratio near 1: the engine samples from the "
        "trainer's current weights", last_gap=gap[-1], last_ratio=ratio[-1])

# %% [markdown]
# ### Break it · sample from a truncated distribution
#
# `GRPOConfig(top_p=...)` reaches vLLM's sampler: with `top_p < 1` vLLM draws each token from the smallest set
# of tokens holding that much probability, renormalised, while the trainer scores the same tokens under its full
# softmax. The cell trains three steps at the `top_p` below and three at 1.0 (one engine for both) and prints
# what TRL's importance-sampling correction logs. Change `top_p` (0.5, 0.95, ...) and run it again.
#
# Its trainers are its own, beside the one above, which this kernel still holds with its engine: they train the
# kit's `tiny` model (random weights, as near-uniform as the preset's) at `vllm_gpu_memory_utilization=0.15`, so
# that both fit on an 80 GB GPU as well as on a 141 GB one.

# %%
from colo_kit.labs.pitfalls import top_p_breaks_importance_sampling

top_p = 0.8
rows = top_p_breaks_importance_sampling("tiny", top_ps=(top_p, 1.0), vllm_gpu_memory_utilization=0.15,
                                        vllm_enforce_eager=not compiled_w.value)
for r in rows:
    print("  ".join(f"{k} {v:.4g}" for k, v in r.items()))
broken = rows[0]
print(f"\nper token vLLM's log-prob exceeds the trainer's by {broken['vLLM vs trainer log-prob gap (nats/token)']:.3f} "
      f"nats; -ln(top_p) = {-math.log(top_p):.3f}. Over 32 tokens the sequence ratio is about "
      f"exp(-32 x that) = {math.exp(-32 * broken['vLLM vs trainer log-prob gap (nats/token)']):.2g}")

# %% [markdown]
# What broke: on this near-uniform model each sampled token's probability under vLLM's truncated distribution is
# its full-softmax probability divided by the kept mass (`top_p`), so the per-token gap is about −ln(`top_p`).
# TRL's default correction (`vllm_importance_sampling_mode="sequence_mask"`) multiplies those ratios over the
# whole completion: far below 1, so the loss of every sequence shrinks towards 0 and the policy barely learns.
# The fix is the last row: sample from the distribution the trainer scores (`top_p=1.0`, TRL's default), or use a
# token-level correction. On a trained model the kept mass is close to 1 and the effect is smaller but real: TRL
# #6789 reports a ratio mean of 0.896 at kept mass 0.895 on Qwen2.5-1.5B (quoted).

# %% [markdown]
# ## What the trained policy writes now
#
# The engine inside the trainer is a normal vLLM `LLM`; generate with it directly. Four samples of one prompt
# (`n=4`), so they differ. The model has random weights: most ids it samples are the tokenizer's *filler*
# tokens (`<fillNNN>`), which pad the kit's small byte-level vocabulary up to Qwen2's 151,936 entries. What it
# learned is the length, not the words.

# %%
from vllm import SamplingParams

llm = run.trainer.vllm_generation.llm
prompt = ("SUBREDDIT: r/cooking\n\nTITLE: My roommate keeps eating my leftovers\n\nPOST: Every night the fridge "
          "is empty. How do I handle this?\n\nTL;DR:")
out = llm.generate([prompt], SamplingParams(n=4, max_tokens=32, temperature=1.0, seed=1), use_tqdm=False)[0]
for sample in out.outputs:
    print(f"{len(sample.text):>4} characters | {sample.text!r}")

# %% [markdown]
# ### Exercise 3 · The reward by hand
#
# The length reward is the first post's `-abs(target - len(completion))`. What does it give (target 20) the
# completion `"Exactly twenty chars"`? Check with `colo_kit.grpo.rewards.length_reward([...])` afterwards if you like.

# %%
answer = ...  # a number
lab.check("00.reward_value", answer)

# %% [markdown]
# <details><summary>Solution (click)</summary>
#
# **0.** The text has exactly 20 characters, spaces included: −|20 − 20| = 0, the best any completion scores —
# the value the reward curve above climbs towards.
# </details>

# %% [markdown]
# ## Recap
#
# - GRPO learns from groups of its own completions, scored by a reward; generation is every step's first cost.
# - Colocated, vLLM lives in the training process (`external_launcher`) and takes turns with training on the
#   same device; TRL pushes the new weights into it before each generation.
# - `sampling/sampling_logp_difference/mean` near 0 and importance ratios near 1 show the engine follows the
#   trainer; a growing gap means a broken weight sync.
# - The post's own example script: `Qwen/Qwen2-0.5B-Instruct` on `trl-lib/tldr`, this reward,
#   `vllm_gpu_memory_utilization=0.3`, `num_generations=4`, `per_device_train_batch_size=4`, `max_steps=2`
#   (quoted). This notebook is the same call with more steps and a model that needs no download.
#
# **Next:** `01_ping_pong` — why server mode leaves GPUs idle, measured. Then `02_sleep_mode`, `03_tp_tuning`,
# `04_zero3_72b_recipe`, `05_rewards_and_math500`, `06_async_lora_proxy`.
