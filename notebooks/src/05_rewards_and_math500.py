# %% [markdown]
# # 05 · The two rewards, and the Math500 evaluation
#
# **You will**
# - compute the first post's length reward by hand and with the kit, for strings and chat messages;
# - see what a Math500 checker has to compare, and why it bounds its time on hostile inputs;
# - train the same GRPO run with vLLM colocated and with TRL's own `generate` (no vLLM), and compare the curves;
# - evaluate base and trained models on Math500 with an honest interval.
#
# **Time** (Run All, measured): {{measured_times}}. Uses one device.
# **Before this:** `00_quickstart`.
#
# GRPO learns from a **reward function**: TRL calls it with the completions of a step (and the
# dataset's other columns) and wants one number per completion back. [The first post](https://huggingface.co/blog/vllm-colocate) uses two:
#
# 1. a **length reward**, `-abs(20 - len(completion))` — a smoke test any model, even a random one,
#    learns in a few dozen steps;
# 2. a **Math500 answer checker** — 1 if the completion's final answer equals the gold answer — for
#    the 72B run (experiment 5), whose trained models "beat the base model on Math500, and colocate
#    matches plain TRL", with **nearly identical reward curves** for the two (quoted). The post's "plain TRL" is
#    TRL without colocation; this notebook's second run is TRL without vLLM at all (`use_vllm=False`).
#
# This notebook explains both rewards with examples, trains with the length reward in **colocate** mode and with
# **no vLLM** (`use_vllm=False`, the kit's mode `"plain"`) from the same seed, puts both reward curves on one chart,
# then evaluates base vs the two trained models on Math500.

# %%
import json

import colo_kit

colo_kit.quiet()
from colo_kit import results
from colo_kit.labs import lab
from colo_kit.env import Machine
from colo_kit.models import default_preset

MACHINE = Machine.here()
MACHINE.say(f"model preset {default_preset()}; both training runs and the evaluation run live"
            + ("" if MACHINE.gpus else " (a random tiny model: the mechanics, not the accuracy)"))

# %% [markdown]
# ## 1 · The length reward
#
# `colo_kit.grpo.rewards.length_reward(completions, target=20)` returns `-abs(target - len(text))` per
# completion: 0 for exactly 20 characters, one point less per character too many or too few. TRL may
# pass completions as strings or as chat messages; the reward reads either.

# %%
import pandas as pd
from IPython.display import display

from colo_kit.grpo.rewards import length_reward

examples = ["Too short.", "Exactly twenty chars", "A summary that rambles on for far longer than the target.",
            [{"role": "assistant", "content": "Chat-form, 20 chars."}]]
display(pd.DataFrame({"completion": [e if isinstance(e, str) else f"(chat) {e[0]['content']}" for e in examples],
                      "characters": [len(e if isinstance(e, str) else e[0]["content"]) for e in examples],
                      "length_reward": length_reward(examples)}))

# %% [markdown]
# ## 2 · The Math500 checker
#
# A Math500 reward gives 1 when a completion's final answer is the gold answer. The kit's checker is
# `colo_kit.answers.math500.is_correct(completion, gold)`; predict one of its verdicts before reading how it works.
#
# ### Exercise 1 · Value or string?
#
# Does `is_correct(r"The answer is \boxed{\dfrac{1}{2}}", "0.5")` say True or False? Predict, then run it.

# %%
answer = ...  # True or False
lab.check("05.checker", answer)

# %% [markdown]
# <details><summary>Solution (click)</summary>
#
# **True.** The checker takes the last `\boxed{}` and lets math-verify compare values: ½ and 0.5 are one number.
# A string comparison says False, which is how Math500 scores go wrong.
# </details>
#
# Comparing strings is not enough: `\dfrac{1}{2}`, `0.5` and `\frac{2}{4}` are one answer, `(2, 1)` is not
# `(1, 2)`, and `25\%`, `25` and `30^\circ` vs `30` are what graders accept. `is_correct`
# takes the **last** `\boxed{}` (braces matched by depth), normalises the forms math-verify does not read
# the way a grader does, and lets **math-verify** compare values (LaTeX → sympy). Without a box only an
# answer the text *states* counts, so a random model's noise that contains the number scores 0.
#
# Below, tricky cases from the kit's hand-labelled set (`data/math500_checker_cases.jsonl`): the label a
# careful grader gives, a plain string comparison of the boxed answer, and the checker.

# %%
from colo_kit.answers.math500 import default_checker
from colo_kit.answers.math500 import is_correct, last_boxed
from colo_kit.paths import data_dir


cases = [json.loads(line) for line in (data_dir() / "math500_checker_cases.jsonl").read_text().splitlines()]
picked_ids = ["c000", "c017", "c026", "c035", "c047", "c076", "c087", "c098", "c114", "c119", "c130",
              "c137", "c146", "c150", "c154", "c164", "c166", "c168", "c177"]
picked = [c for c in cases if c["id"] in picked_ids]
default_checker().warm_up()  # start the checker's worker process before timing anything


def plain_compare(completion: str, gold: str) -> bool:
    boxed = last_boxed(completion)
    return boxed is not None and boxed.strip() == gold.strip()


table = pd.DataFrame([{"category": c["category"], "gold": c["gold"],
                       "final answer": last_boxed(c["completion"]) if last_boxed(c["completion"]) is not None
                       else c["completion"][-40:],
                       "label": c["verdict"], "string ==": plain_compare(c["completion"], c["gold"]),
                       "is_correct": is_correct(c["completion"], c["gold"])} for c in picked])
display(table)
print(f"string comparison agrees with the label on {(table['string =='] == table['label']).sum()}/{len(table)}, "
      f"the checker on {(table['is_correct'] == table['label']).sum()}/{len(table)} of these")

# %% [markdown]
# ### Break it · reward by string comparison
#
# What a reward built on `==` would teach, over all 222 labelled cases: every right answer it scores 0 is a
# completion GRPO pushes the policy *away* from. The cell scores them with each function in `scorers`; take
# `is_correct` out of the list, or add your own scorer, and run it again.

# %%
scorers = [plain_compare, is_correct]
right = [c for c in cases if c["verdict"]]
for score in scorers:
    missed = [c for c in right if not score(c["completion"], c["gold"])]
    fooled = [c for c in cases if not c["verdict"] and score(c["completion"], c["gold"])]
    print(f"{score.__name__:<14} right answers scored 0: {len(missed):>3} of {len(right)} · wrong answers scored 1: "
          f"{len(fooled)}" + (f" · e.g. gold {missed[0]['gold']!r}, boxed {last_boxed(missed[0]['completion'])!r}"
                              if missed else ""))

# %% [markdown]
# On the whole labelled set (222 cases, labels decided by reading, not by running any checker), and what
# the committed benchmark (`scripts/bench_checker.py` → `results/math500_checker.json`) measured: agreement,
# checks per second on one core, and the worst time of any input under fuzzing (random and adversarial
# LaTeX — `10^{10^{10}}`, 10,000-deep braces, megabyte strings — from one thread and from four).
#
# The time bound matters because math-verify's own timeout uses `signal.alarm`, which works only in the
# main thread. The kit turns it off, refuses what sympy cannot finish (over-long answers, deep nesting,
# numbers over 10,000 digits), and runs each comparison in a worker process with a 4 s deadline.

# %%
import time

t0 = time.perf_counter()
live = sum(is_correct(c["completion"], c["gold"]) == c["verdict"] for c in cases)
live_s = time.perf_counter() - t0
print(f"this run: {live}/{len(cases)} = {live / len(cases):.1%} agreement ({len(cases) / live_s:.0f} checks/s)")
bench = results.load("math500_checker")
s = bench["summary"]
print(f"measured (results/math500_checker.json): agreement {s['agreement']:.1%} (target 98%), "
      f"{s['checks_per_cpu_s']:.0f} checks per CPU-second (target 200), worst input {s['worst_case_s']:.2f} s "
      f"(limit 5 s)")
lab.see("05.checker", "the checker agrees with the labels on all but one or two of the 222 cases",
        agreement=round(live / len(cases), 4))
for d in bench["agreement"]["disagreements"]:
    print(f"  disagreement {d['id']} ({d['category']}): gold {d['gold']!r}, answer {d['extracted']!r}, "
          f"label {d['label']}, checker {d['checker']}")

# %% [markdown]
# ## 3 · Colocated vLLM vs no vLLM, same seed
#
# Two GRPO runs with the length reward, identical but for where generation happens: **colocate**
# (`use_vllm=True, vllm_mode="colocate"`: vLLM inside the trainer) and **no vLLM** (`use_vllm=False`:
# transformers' `generate`). The post's 72B runs showed nearly identical reward curves for colocate and plain TRL
# (quoted); colocation changes where tokens are sampled, not what is learned. (The two samplers draw different
# random numbers, so the curves are not equal step by step: compare their trend.)

# %%
import ipywidgets as widgets

wide = {"description_width": "initial"}
model_w = widgets.Text(value=default_preset(), description="model", style=wide)
steps_w = widgets.IntSlider(value=30, min=5, max=200, step=5, description="max_steps", style=wide)
gen_w = widgets.IntSlider(value=8, min=2, max=16, step=2, description="num_generations", style=wide)
seed_w = widgets.IntText(value=0, description="seed", style=wide)
problems_w = widgets.IntSlider(value=40, min=4, max=500, step=4, description="Math500 problems", style=wide)
tokens_w = widgets.IntSlider(value=128, min=16, max=1024, step=16, description="answer tokens", style=wide)
display(widgets.VBox([model_w, steps_w, gen_w, seed_w, problems_w, tokens_w]))

# %%
from colo_kit.grpo.train import run_grpo

common = dict(reward="length", target_length=20, max_steps=steps_w.value, num_generations=gen_w.value,
              per_device_train_batch_size=2 * gen_w.value, max_completion_length=32, learning_rate=5e-3, seed=seed_w.value,
              vllm_enforce_eager=True)  # short runs: an eager engine starts in seconds (notebook 00 says why)
runs = {mode: run_grpo(model_w.value, mode, **common) for mode in ("colocate", "plain")}
LABEL = {"colocate": "colocated vLLM", "plain": "no vLLM (use_vllm=False)"}
for mode, run in runs.items():
    print(f"{LABEL[mode]:>26}: {len(run.steps)} steps in {run.elapsed_s} s, reward {run.rewards[0]:.1f} -> "
          f"{run.rewards[-1]:.1f}")
lab.see("05.curves", "both curves rise towards 0; they differ step by step (different samplers) but not in trend",
        colocate_last=runs["colocate"].rewards[-1], no_vllm_last=runs["plain"].rewards[-1])

# %%
import plotly.graph_objects as go

fig = go.Figure()
for mode, run in runs.items():
    fig.add_scatter(x=run.series("step"), y=run.rewards, name=LABEL[mode], mode="lines+markers")
fig.update_layout(title="Length reward, colocated vLLM vs no vLLM, same seed (this run)", xaxis_title="optimizer step",
                  yaxis_title="mean reward = -|20 - len(text)|", height=420)
fig.show()

# %% [markdown]
# The same comparison at GPU scale (Qwen2.5-0.5B's shape, random weights, one GPU), from
# `scripts/gpu/math500.sh` → `results/math500_gpu.json`, when it has been committed. Thirty steps are too few for
# a model this size to climb far from where its random weights start, so read this run for its clock: the same
# steps with colocated vLLM and without. It then scores the base model and both trained ones on the kit's
# problems with the colocate trainer's own engine, as section 4 does here:

# %%
gpu = results.load("math500_gpu")
if gpu:
    fig = go.Figure()
    for mode, r in gpu["runs"].items():
        fig.add_scatter(x=list(range(1, len(r["reward"]) + 1)), y=r["reward"], name=f"{mode} (GPU)", mode="lines")
    fig.update_layout(title=f"GPU (measured): colocate vs no vLLM, {gpu['settings']['model']}, same seed",
                      xaxis_title="optimizer step", yaxis_title="mean reward", height=380)
    fig.show()
    for mode, r in gpu["runs"].items():
        print(f"GPU {mode:>8}: {len(r['reward'])} steps in {r['train_s']} s")
    for name, r in gpu.get("eval", {}).items():
        print(f"GPU eval {name:>16}: {r['correct']}/{r['n']} right, answers generated in {r['generate_s']} s")
    print(results.record_footnote("math500_gpu"))
else:
    MACHINE.say("no GPU run of this comparison is committed (results/math500_gpu.json): "
                "`bash scripts/gpu/math500.sh` on a GPU machine writes it")

# %% [markdown]
# ## 4 · Math500: base vs the two trained models
#
# `colo_kit.answers.math500_eval.evaluate` answers each problem greedily with the **training prompt**
# (`colo_kit.data.math_prompt`: "...put your final answer within \boxed{}"), scores with `is_correct`, and
# reports accuracy with a 95% Wilson interval and per-subject / per-level breakdowns. `compare_models` does it
# for several models on **one** engine — the colocate trainer's own vLLM — loading each model's weights
# into it in turn, the same weight push colocation does every step.
#
# **Offline** (no hub) this uses the kit's stand-in problems (`data/math_problems.jsonl`) and
# random-weight models: accuracy is **~0 by construction** — the point is the mechanics. **Online**, set the
# model to a hub id (the post: `Qwen/Qwen2.5-Math-72B`; small: `Qwen/Qwen2.5-Math-1.5B`) and train with
# `reward="math500"` on a math set; `load_math()` then reads `HuggingFaceH4/MATH-500` from the hub.

# %%
from colo_kit.data import load_math
from colo_kit.answers.math500_eval import compare_models

problems = load_math()
engine = runs["colocate"].trainer.vllm_generation.llm
reports = compare_models(engine, {"base": model_w.value, "trained, colocated vLLM": runs["colocate"].trainer.model,
                                  "trained, no vLLM": runs["plain"].trainer.model},
                         problems=problems, limit=problems_w.value, max_tokens=tokens_w.value)
summary = pd.DataFrame([{"model": name, "problems": r["n"], "correct": r["correct"], "accuracy": r["accuracy"],
                         "95% CI": f"{r['ci95'][0]:.3f} – {r['ci95'][1]:.3f}"} for name, r in reports.items()])
display(summary)

# %%
names = list(reports)
acc = [reports[n]["accuracy"] for n in names]
none_right = not any(reports[n]["correct"] for n in names)
fig = go.Figure(go.Bar(x=[f"{n}<br>{reports[n]['correct']}/{reports[n]['n']} right" for n in names], y=acc,
                       error_y=dict(type="data", symmetric=False,
                                    array=[reports[n]["ci95"][1] - a for n, a in zip(names, acc)],
                                    arrayminus=[a - reports[n]["ci95"][0] for n, a in zip(names, acc)])))
what, whiskers = (("0 right for every model (random weights)", "no bars; a whisker is how high the accuracy could "
                   f"still be: {reports['base']['ci95'][1]:.0%} from {reports['base']['n']} problems") if none_right
                  else ("accuracy", "whiskers: 95% Wilson intervals"))
fig.update_layout(title=f"Math500, this run: {what}<br><sup>{whiskers}</sup><br><sup>{reports['base']['dataset']}</sup>",
                  yaxis_title="accuracy", yaxis_range=[0, 1], height=440, margin_t=120)
fig.show()
if none_right:
    MACHINE.say("random-weight models score 0 by construction; with a hub model (see above) the bars are accuracies")
subjects = pd.DataFrame({n: {k: v["accuracy"] for k, v in r["by_subject"].items()} for n, r in reports.items()})
display(subjects.style.format("{:.2f}").set_caption("accuracy by subject"))

# %% [markdown]
# One completion of the base model, and how the checker read it:

# %%
sample = reports["base"]["samples"][0]
print(f"gold {sample['gold']!r} | extracted {sample['answer']!r} | {sample['reason']} | correct {sample['correct']}")
print(repr(sample["completion"][:300]))  # repr: a random model writes runs of newlines, shown as \n

# %% [markdown]
# ### Exercise 2 · No label, no reward
#
# `math500_reward` gets a row whose gold answer is missing (`None`). Should it return 0.0, 1.0 or None?

# %%
answer = ...  # 0.0, 1.0 or None
lab.check("05.none_gold", answer)

# %% [markdown]
# <details><summary>Solution (click)</summary>
#
# **None.** Without a label nothing can be judged; TRL ignores a None reward, while a 0.0 would push the policy away
# from what may be a right answer. The kit does the same when a comparison runs out of time.
# </details>

# %% [markdown]
# ## Recap
#
# - The **length reward** needs no model quality, so both runs learn it and their curves follow the same
#   trend from the same seed — the post's "nearly identical reward curves", at toy scale.
# - The **checker** is where Math500 numbers are won or lost: a string comparison misses most of the
#   tricky cases above; the checker agrees with a careful grader on the labelled set (numbers above, from
#   `results/math500_checker.json`), and no input can stall a training step for more than its deadline.
# - **Evaluate like you train**: the same prompt template, one engine, weights swapped in — and report an
#   interval, not just a number: with 40 problems a 95% Wilson interval around 50% is about ±15 points wide.
#
# The command-line version: `colo-kit eval-math500 --model <preset|folder|hub id> --limit 500`, or
# `--data your_problems.jsonl` for a set of your own.
#
# **Next:** `06_async_lora_proxy` — [the second post](https://huggingface.co/blog/asyncgrpo-lora-hfjobs): async GRPO
# with LoRA adapters behind a routing proxy.
