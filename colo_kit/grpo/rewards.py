"""The two reward functions of the posts, in TRL's reward-function signature (notebooks 00 and 05): one float per
completion, or None where the reward does not apply. `length_reward` needs no model quality (random weights learn it);
`math500_reward` is 1.0 / 0.0 against the gold `answer`.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Sequence
from decimal import Decimal

from colo_kit.answers.answer_check import last_boxed
from colo_kit.answers.math500 import CheckerTimeout, UnparseableGold, is_correct

MAX_TARGET_CHARS = 10**9  # a completion longer than this is not generated
_SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d{1,3}")  # 1e20, as a float gold is written


def completion_text(completion) -> str:
    """The generated text of one completion, whether TRL passed a string or chat messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    if isinstance(completion, Sequence) and not isinstance(completion, (bytes, bytearray)):
        # Chat form: a list of messages; the assistant's turn(s) are what was generated.
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    raise TypeError(f"cannot read a completion of type {type(completion).__name__}; "
                    "expected a string or a list of chat messages")


def _completion_list(completions) -> list:
    """TRL passes a list with one entry per completion; a bare string would be read letter by letter."""
    if isinstance(completions, (str, bytes, bytearray)) or not isinstance(completions, Sequence):
        raise TypeError(f"completions must be a list with one entry per completion (strings or chat messages), "
                        f"not {type(completions).__name__}; wrap a single completion as [text]")
    return list(completions)


def length_reward(completions, target: int = 20, **kwargs) -> list[float]:
    """`-abs(target - len(text))`: 0 for exactly `target` characters, more negative further away."""
    if not isinstance(target, int) or isinstance(target, bool) or target < 0:
        raise ValueError(f"target={target!r}: the target length is a number of characters, an int >= 0")
    if target > MAX_TARGET_CHARS:
        raise ValueError(f"target above {MAX_TARGET_CHARS}: the target length is a number of characters; give at most "
                         f"{MAX_TARGET_CHARS}")
    return [-float(abs(target - len(completion_text(c)))) for c in _completion_list(completions)]


def make_length_reward(target: int = 20):
    """`length_reward` with another target, named so TRL logs it as `rewards/length_reward/mean`."""
    def length_reward_(completions, **kwargs):
        return length_reward(completions, target=target)

    length_reward_.__name__ = "length_reward"
    return length_reward_


def _gold_text(gold) -> str | None:
    """The gold answer as the checker reads it (a number as its string), or None for a label that is no answer."""
    if isinstance(gold, str):
        return gold
    if isinstance(gold, numbers.Real) and not isinstance(gold, bool):  # 1e20 as 100000000000000000000, not 1e+20
        return format(Decimal(repr(gold)), "f") if math.isfinite(gold) else None
    return None


def _same_number(text: str, gold) -> bool:
    """A boxed answer written as Python writes a float (1e20) equal to a number gold: the checker reads `e` as Euler's."""
    boxed = (last_boxed(text) or "").strip()
    return isinstance(gold, numbers.Real) and _SCIENTIFIC.fullmatch(boxed) is not None and float(boxed) == gold


def math500_reward(completions, answer, **kwargs) -> list[float | None]:
    """1.0 / 0.0 per completion against the gold `answer` column; None where gold is unparseable."""
    completions = _completion_list(completions)
    if isinstance(answer, (str, bytes, bytearray, dict, numbers.Number)) or not hasattr(answer, "__len__"):
        answer = [answer] * len(completions)  # one gold answer for every completion (None included)
    if len(answer) != len(completions):
        raise ValueError(f"got {len(completions)} completions but {len(answer)} gold answers; TRL passes one "
                         "`answer` per completion (the dataset needs an `answer` column)")
    rewards: list[float | None] = []
    for completion, raw in zip(completions, answer):
        text, gold = completion_text(completion), _gold_text(raw)
        if gold is None:
            rewards.append(None)  # no usable label: TRL ignores the entry instead of punishing the policy
            continue
        try:
            rewards.append(1.0 if _same_number(text, raw) or is_correct(text, gold) else 0.0)
        except (UnparseableGold, CheckerTimeout):
            # a checker that ran out of time knows nothing about the answer: None, never a 0.0 reward
            rewards.append(None)
    return rewards
