# %% [markdown]
# # 00 · Quickstart: GRPO with vLLM colocated in the trainer
#
# **GRPO** (Group Relative Policy Optimization, from the DeepSeekMath paper) is *online* RL: at every
# step the model writes several answers (a *group*) to each prompt, a reward function scores them, and
# the model is pushed towards the answers that scored above their group's average. No value network,
# no fixed dataset of answers — the model learns from what it just generated.
#
# That makes **generation the bottleneck**: every optimizer step waits for fresh completions. TRL
# generates them with **vLLM**, in one of two ways:
#
# | mode | where vLLM runs | what the GPUs do |
# |---|---|---|
# | `server` | its own process on its own GPU(s), reached over HTTP | trainers wait while vLLM generates, vLLM waits while they train: **ping-pong** |
# | `colocate` | inside every training process, on the same GPU | generation and training take turns on one device; nobody waits for another machine |
#
# Colocation (TRL PR #3394) starts vLLM with `distributed_executor_backend="external_launcher"`, so each
# training rank owns an engine in the same `torch.distributed` group. In the first post it was up to
# **1.43×** faster (1.5B) and **1.35×** (7B) than server mode on 8 GPUs, and ran a 72B model on 4 fewer GPUs.
#
# In the next few minutes you will: build a model offline, run TRL's `GRPOTrainer` with
# `use_vllm=True, vllm_mode="colocate"` and the post's **length reward** (`-abs(20 - len(completion))`),
# and watch the reward rise.

# %%
import colo_kit  # sets OMP_NUM_THREADS=1 and vLLM's CPU defaults before torch/vLLM load
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
# Move the sliders, then run the cells below again. `num_generations` is the group size G: the batch must
# hold whole groups, so the per-device batch is set to `2 × G` prompts' worth of completions.
# The reward is highest (0) for completions of exactly `target` characters. A *compiled* engine (vLLM's
# default: torch.compile and, on a GPU, CUDA graphs) decodes faster but takes 50–90 s longer to start on a GPU:
# worth it for long runs, not for forty steps, so the quickstart starts vLLM eager.

# %%
import ipywidgets as widgets
from IPython.display import display

steps_w = widgets.IntSlider(value=40, min=5, max=200, step=5, description="steps")
gen_w = widgets.IntSlider(value=8, min=2, max=16, step=2, description="num_generations")
target_w = widgets.IntSlider(value=20, min=0, max=100, step=5, description="target chars")
compiled_w = widgets.Checkbox(value=False, description="compiled engine (torch.compile + CUDA graphs)")
display(widgets.VBox([steps_w, gen_w, target_w, compiled_w]))

# %% [markdown]
# ## Train
#
# `colo_kit.train.run_grpo` builds TRL's `GRPOConfig(use_vllm=True, vllm_mode="colocate",
# vllm_gpu_memory_utilization=0.3, ...)` and `GRPOTrainer` — read it, it is short. The progress bar is the
# trainer's own; every step generates with the colocated vLLM engine, scores, and updates the weights, and the
# next step first pushes the new weights into vLLM.

# %%
from colo_kit.train import run_grpo

run = run_grpo(
    preset.name, "colocate",
    reward="length", target_length=target_w.value,
    max_steps=steps_w.value, num_generations=gen_w.value, per_device_batch=2 * gen_w.value,
    max_completion_length=32, learning_rate=5e-3, seed=0, vllm_enforce_eager=not compiled_w.value,
)
print(f"{len(run.steps)} steps in {run.elapsed_s} s: mean reward {run.rewards[0]:.1f} -> {run.rewards[-1]:.1f}")

# %%
import plotly.graph_objects as go
from plotly.subplots import make_subplots

steps = run.series("step")
fig = make_subplots(specs=[[{"secondary_y": True}]])
fig.add_scatter(x=steps, y=run.rewards, name="mean reward", mode="lines+markers")
fig.add_scatter(x=steps, y=run.series("completions/mean_length"), name="mean completion length (tokens)",
                mode="lines", line=dict(dash="dot"), secondary_y=True)
fig.update_layout(title=f"GRPO, colocated vLLM, length reward (target {target_w.value} chars)",
                  xaxis_title="optimizer step", height=420)
fig.update_yaxes(title_text="reward = -|target - len(text)|", secondary_y=False)
fig.update_yaxes(title_text="tokens", secondary_y=True)
fig.show()

# %% [markdown]
# The reward climbs because the policy learns to stop early (the end-of-turn token) and to prefer short
# tokens. Nothing here needs a good model: even random weights learn it, which is why the post uses it as a
# smoke test. Two numbers TRL logs tell you the colocated engine really follows the trainer:
# `sampling/sampling_logp_difference/mean` (vLLM's log-probs vs the trainer's for the same tokens) stays near 0,
# and the importance-sampling ratio stays near 1. If weight sync were broken, the gap would grow every step.

# %%
gap = run.series("sampling/sampling_logp_difference/mean")
ratio = run.series("sampling/importance_sampling_ratio/mean")
print(f"vLLM vs trainer log-prob gap: first {gap[0]:.4f}, last {gap[-1]:.4f} (nats)")
print(f"importance-sampling ratio: first {ratio[0]:.3f}, last {ratio[-1]:.3f}")

# %% [markdown]
# ## What the trained policy writes now
#
# The engine inside the trainer is a normal vLLM `LLM`; generate with it directly.

# %%
from vllm import SamplingParams

llm = run.trainer.vllm_generation.llm
prompts = ["SUBREDDIT: r/cooking\n\nTITLE: My roommate keeps eating my leftovers\n\nPOST: Every night the fridge is empty. How do I handle this?\n\nTL;DR:"] * 4
for out in llm.generate(prompts, SamplingParams(max_tokens=32, temperature=1.0, seed=1), use_tqdm=False):
    text = out.outputs[0].text
    print(f"{len(text):>4} chars | {text!r}")

# %% [markdown]
# ## The post's example, for reference
#
# The first post's script trains `Qwen/Qwen2-0.5B-Instruct` on `trl-lib/tldr` with this reward,
# `vllm_gpu_memory_utilization=0.3`, `num_generations=4`, `per_device_train_batch_size=4`, `max_steps=2`.
# Ours is the same call with more steps (so you see learning) and a model that needs no download.
#
# **Next:** `01_ping_pong` (why server mode leaves GPUs idle), `02_sleep_mode`, `03_tp_tuning`,
# `04_zero3_72b_recipe`, `05_rewards_and_math500`, `06_async_lora_proxy`.
