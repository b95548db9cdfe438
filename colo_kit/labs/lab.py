"""Predict-then-run exercises (`exercises.yaml` beside this module): `lab.check(key, answer)` says right (and why) or
gives a hint, never the answer. Answers are structured (a number within a tolerance, or one of the options), never free
text matched for words; right ones come from the kit's own functions where one exists. Also "What you should see" boxes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from colo_kit.results import CHECKS, UNMEASURED, measured_runs

LETTERS = "abcdefgh"
HEDGES = ("I don't know", "", "maybe", "it depends")


@dataclass(frozen=True)
class Exercise:
    key: str                       # "<notebook>.<name>"
    question: str
    accept: Callable[[Any], bool]  # is this answer right?
    solution: Any                  # what the collapsed solution cell shows
    why: str                       # said when the answer is right
    hint: str                      # said when it is not
    wrong: tuple                   # plausible wrong answers the check must refuse (the test suite runs them all)
    options: tuple[str, ...] = ()  # a choice exercise: the only answers it takes
    share: bool = False            # a number exercise whose answer is a part of a whole (a percentage reads as one)

    def form_error(self, answer) -> str | None:
        """What to write instead when `answer` is not in a form this exercise reads (None: it is)."""
        if self.options:
            if normalise(answer) in {normalise(o) for o in self.options} | set(LETTERS[:len(self.options)]):
                return None
            return "answer with one of: " + ", ".join(f"{LETTERS[i]}) {o!r}" for i, o in enumerate(self.options))
        if read_number(answer, self.share) is None:
            return "write one number, like 0.5" + (" or 50%" if self.share else "") + " (7/8 and two work too)"
        return None


NUMBER_WORDS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve "
                                           "thirteen fourteen fifteen sixteen seventeen eighteen nineteen twenty".split())}
# After a number these are no unit: they make "2 or 16" two answers, hedge one, or change its value ("16 billion",
# and any -th(s): "seven eighths").
NOT_A_UNIT = {"or", "and", "not", "no", "to", "than", "maybe", "probably", "about", "perhaps", "ish", "half", "halves",
              "third", "thirds", "quarter", "quarters", "hundred", "thousand", "million", "billion"}
_WRITTEN = re.compile(r"(?P<num>[-+]?\d*\.?\d+(?:/\d+)?|[a-z]+)\s*(?P<pct>%?)\s*(?P<unit>[a-z ]*)")


def read_number(answer, share: bool = False) -> float | None:
    """One number as a learner writes it: 2, "7/8", "two", "16 bytes", "1.3x"; for a `share` also "87.5%" or 87.5 (more
    than 1 is a percentage). None for anything else: "2 or 16", "maybe", a percentage where no share is asked."""
    if answer is None or isinstance(answer, bool):
        return None
    percent = False
    if isinstance(answer, (int, float)):
        value = float(answer)
    else:
        text = " ".join(str(answer).lower().replace("×", "x").replace("percent", "%").split())
        text = re.sub(r"\s*/\s*", "/", text).rstrip(".")
        m = _WRITTEN.fullmatch(text)
        units = m["unit"].split() if m else []
        if not m or set(units) & (NOT_A_UNIT | set(NUMBER_WORDS)) or any(u.endswith(("th", "ths")) for u in units):
            return None
        num, percent = m["num"], m["pct"] == "%"
        if num.isalpha():
            value = NUMBER_WORDS.get(num)
            if value is None:
                return None
        elif "/" in num:
            top, bottom = num.split("/")
            if float(bottom) == 0:
                return None
            value = float(top) / float(bottom)
        else:
            value = float(num)
    if share and (percent or value > 1):
        return value / 100
    return None if percent or value != value else float(value)


def normalise(answer) -> str:
    """An answer as a choice: lower case, outer quotes and spaces gone, numbers in one spelling (0.0 -> 0)."""
    if answer is None or isinstance(answer, bool):
        return str(answer).lower()
    text = " ".join(str(answer).strip().strip("\"'").split()).lower()
    try:
        return f"{float(text):g}"
    except ValueError:
        return text


def computed() -> dict[str, float]:
    """The right answers the kit's own functions give, by the name `exercises.yaml` uses for them."""
    from colo_kit.async_lora.lora import max_loras_for
    from colo_kit.grpo.rewards import length_reward
    from colo_kit.parallel.tp import expected_step_speedup

    return {"amdahl": round(expected_step_speedup(1.5, 0.7), 2), "twenty": length_reward(["Exactly twenty chars"])[0],
            "slots": max_loras_for(4)}


def _exercise(key: str, d: dict, values: dict) -> Exercise:
    if "options" in d:
        options, right = tuple(d["options"]), d["right"]
        others = tuple(o for o in options if o != right)
        wrong = others + tuple(LETTERS[i] for i, o in enumerate(options) if o != right) + HEDGES + (
            f"not {right}", f"{right} or {others[0]}", f"{others[0]}, not {right}") + tuple(d.get("wrong", ()))
        letter = LETTERS[options.index(right)]
        return Exercise(key, d["question"], lambda a: normalise(a) in (normalise(right), letter),
                        d.get("solution", right), d["why"], d["hint"], wrong, options)
    target = values[d["number"]] if isinstance(d["number"], str) else d["number"]
    tol, share = d.get("tolerance", 0), d.get("share", False)

    def accept(answer) -> bool:
        value = read_number(answer, share)
        return value is not None and abs(value - target) <= tol + 1e-9

    return Exercise(key, d["question"], accept, target, d["why"].replace("{answer}", f"{target:g}"), d["hint"],
                    tuple(d["wrong"]), share=share)


@lru_cache(maxsize=None)
def exercises() -> dict[str, Exercise]:
    import yaml

    data = yaml.safe_load((Path(__file__).with_name("exercises.yaml")).read_text())
    values = computed()
    return {key: _exercise(key, d, values) for key, d in data.items()}


def verdict(key: str, answer) -> bool | None:
    """Whether `answer` is right: True, False, or None while it is still the cell's placeholder `...`."""
    ex = exercises().get(key)
    if ex is None:
        raise KeyError(f"no exercise {key!r}; the notebook's exercises are {sorted(exercises())}")
    return None if answer is ... else bool(ex.accept(answer))


def check(key: str, answer) -> None:
    """Print whether `answer` is right (and why), a hint, the form to write it in, or, while it is `...`, what to do (so
    Run All passes through)."""
    right = verdict(key, answer)
    ex = exercises()[key]
    if right is None:
        print(f"✎ {key}: write your prediction above (replace the ...), then run this cell again")
    elif right:
        print(f"✔ right. {ex.why}")
    elif form := ex.form_error(answer):
        print(f"✎ {key}: {form}")
    else:
        print(f"✘ not yet. Hint: {ex.hint}")


FACT_KEY = "colo_kit_fact"  # a "What you should see" box's values ride along as output metadata, which check runs record


def measured_facts(key: str) -> dict[str, dict]:
    """{tier: {"label" (the machine), "values", "source", "date"}} for `key` from the committed check runs."""
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
    """Show a "What you should see" box: `what` it means, this run's `values`, and what the check runs measured on each
    machine; the values ride along as metadata, which `scripts/check.py` records."""
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
