"""The comparison behind `math500.is_correct` (notebook 05), in this process: `check(completion, gold)` reads the
completion's final answer and compares it with the gold one; `is_correct` adds the deadline."""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

# math-verify warns that its timeout is disabled: on purpose, math500 runs the check under its own deadline
logging.getLogger("math_verify").setLevel(logging.ERROR)

MAX_COMPLETION_CHARS = 20_000  # only the end of a completion is read: the final answer is there
MAX_ANSWER_CHARS = 400        # a MATH answer is at most ~100 characters; parsing time grows with length
MAX_TAIL_CHARS = 3_000        # without a box, the stated answer is near the end
MAX_NESTING = 8               # parsing time grows exponentially with nesting (\frac 12 deep: seconds)
MAX_FUNCTION_NESTING = 3      # simplify() of sin(sin(sin(sin(...)))) grows exponentially too
MAX_DIGITS = 10_000           # 2^{2005} has 604 digits; 10^{10^{10}} would need 10^10
MAX_NODES = 2_000             # sympy tree size above which simplify() may not finish
DEFAULT_DEADLINE_S = 4.0      # per comparison, once a worker is ready; the bound is 5 s per input


class UnparseableGold(ValueError):
    """The gold answer itself cannot be read, so no completion can be judged against it."""


class CheckerTimeout(TimeoutError):
    """The comparison did not finish within the deadline: a reward function returns None for it, never 0.0."""


@dataclass
class Verdict:
    correct: bool
    answer: str | None  # what was taken as the completion's final answer (None: nothing found)
    reason: str         # "equal-string", "math-verify", "no-answer", "refused: ...", "timeout", ...
    gold_ok: bool = True
    timed_out: bool = False  # no verdict at all: `correct` is meaningless


_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` that closes (`\\boxed{\\boxed{10}}`: the inner one)."""
    starts = {m.end() - 1 for m in _BOX.finditer(text)}  # index of each box's "{"
    if not starts:
        return None
    stack, best = [], None  # one pass: a scan per box would be quadratic in \boxed{\boxed{...
    for k, ch in enumerate(text):
        if ch == "{" and (k == 0 or text[k - 1] != "\\"):
            stack.append(k)
        elif ch == "}" and stack and text[k - 1] != "\\":
            opened = stack.pop()
            if opened in starts and (best is None or opened > best[0]):
                best = (opened, k)
    return None if best is None else text[best[0] + 1:best[1]]


# ---- Normalisation: the MATH answer forms math-verify 0.9 reads differently from a grader ----

# (?<![\d.]) keeps the match linear: a digit run is tried from its start only.
_REPEATING = re.compile(r"(?<![\d.])(-?)(\d*)\.(\d*)\\overline\s*\{(\d+)\}")
_PERCENT = re.compile(r"\\?%|\\(?:text|mbox|mathrm)\{\s*(?:percent|pct)\s*\}|\bpercent\b")
_PM = re.compile(r"\\pm(?![a-zA-Z])")


def _repeating_to_frac(m: re.Match) -> str:
    sign, whole, fixed, rep = m.groups()
    value = Fraction(int(whole or 0)) + Fraction(int(fixed or 0), 10 ** len(fixed))
    value += Fraction(int(rep), 10 ** len(fixed) * (10 ** len(rep) - 1))
    return f"{sign}\\frac{{{value.numerator}}}{{{value.denominator}}}"


def normalize_answer(answer: str) -> str:
    s = answer.strip()
    s = _REPEATING.sub(_repeating_to_frac, s)
    s = s.replace("°", "^\\circ").replace("\\varnothing", "\\emptyset").replace("\\{\\}", "\\emptyset")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = _PERCENT.sub("", s)
    while True:  # "17." in a box: a sentence's full stop, and trailing spacing commands
        t = s.rstrip()
        t = t[:-1] if t.endswith(".") else t
        for space in ("\\,", "\\;", "\\!", "\\:", "\\ "):
            t = t[:-len(space)] if t.endswith(space) else t
        if t == s:
            break
        s = t
    if len(_PM.findall(s)) == 1 and "," not in s:  # "1 \pm \sqrt{2}" -> both roots
        s = _PM.sub("+", s) + ", " + _PM.sub("-", s)
    return s


def _squash(s: str) -> str:
    """For the exact-string fast path: spacing and \\left/\\right do not change an answer."""
    return re.sub(r"\s+|\\left|\\right|\\[,;!: ]", "", s)


# ---- Fast path: plain numbers compared exactly in microseconds, not by math-verify's ANTLR parser in milliseconds ----

_INT = re.compile(r"\d+|\d{1,3}(?:(?:,|,\\!|\{,\})\d{3})+")  # 1000, 1,000, 10,\!000
_FRAC = re.compile(r"\\frac\{(\d+)\}\{(\d+)\}|(\d+)/(\d+)")
_DECIMAL = re.compile(r"\d*\.\d+")


def simple_number(answer: str) -> tuple[Fraction, bool] | None:
    """(exact value, written as a decimal?) for a signed integer, decimal or plain fraction, with a dollar sign in front or
    a degree sign behind; None for anything else."""
    if len(answer) > 100:
        return None
    t = re.sub(r"\s+|\\[;: ]|\\,(?!\d)", "", answer)
    t = t.removeprefix("\\$").removeprefix("$")
    for suffix in ("^\\circ", "^{\\circ}"):
        t = t.removesuffix(suffix)
    sign = -1 if t.startswith("-") else 1
    t = t[1:] if sign < 0 else t
    if _INT.fullmatch(t):
        return Fraction(sign * int(re.sub(r"\D", "", t))), False
    if _DECIMAL.fullmatch(t):
        return sign * Fraction(t), True
    m = _FRAC.fullmatch(t)
    if m:
        num, den = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        return (sign * Fraction(int(num), int(den)), False) if int(den) else None
    return None


def simple_tuple(answer: str) -> tuple[str, list] | None:
    """(brackets, elements) for a tuple or interval of plain numbers or +-infinity such as `[1, \\infty)` (ANTLR: ~20 ms)."""
    t = _squash(answer)
    if len(t) > 100 or len(t) < 5 or t[0] not in "([" or t[-1] not in ")]":
        return None
    values = []
    for part in t[1:-1].split(","):
        if part in ("\\infty", "+\\infty", "-\\infty"):
            values.append(part.lstrip("+"))
            continue
        v = simple_number(part)
        if v is None or v[1]:  # decimals are left to math-verify's rounding rules
            return None
        values.append(v[0])
    return (t[0] + t[-1], values) if len(values) >= 2 else None


def _fast_verdict(answer: str, gold_norm: str) -> bool | None:
    """True/False when both sides are plain numbers (or tuples of them) that settle it exactly; else None for math-verify
    (which accepts 0.333333 for 1/3 and may read (2, 5) as a point)."""
    a, g = simple_number(answer), simple_number(gold_norm)
    if a is not None and g is not None:
        if a[0] == g[0]:
            return True
        return None if (a[1] or g[1]) else False
    a, g = simple_tuple(answer), simple_tuple(gold_norm)
    if a is not None and g is not None and a[0] == g[0] and len(a[1]) == len(g[1]):
        return a[1] == g[1]
    return None


def _differ_numerically(gold, pred) -> bool:
    """True when two constant expressions (or tuples of them) are clearly different numbers, settled without simplify()."""
    import sympy

    if isinstance(gold, sympy.Interval) and isinstance(pred, sympy.Interval):  # (2, 5) vs (2, 6)
        return _differ_numerically(gold.start, pred.start) or _differ_numerically(gold.end, pred.end)
    if isinstance(gold, sympy.Tuple) and isinstance(pred, sympy.Tuple) and len(gold) == len(pred):
        return any(_differ_numerically(g, p) for g, p in zip(gold, pred))
    if not (isinstance(gold, sympy.Expr) and isinstance(pred, sympy.Expr)) or gold.free_symbols or pred.free_symbols:
        return False
    try:
        a, b = complex(gold.evalf(20)), complex(pred.evalf(20))
    except Exception:
        return False
    if not all(math.isfinite(x) for x in (a.real, a.imag, b.real, b.imag)):
        return False
    return abs(a - b) > 1e-6 * max(1.0, abs(a), abs(b))


# ---- Guards: refuse what sympy cannot finish, before it starts ----

def _nesting(s: str) -> int:
    depth = best = 0
    for ch in s:
        if ch in "{([":
            depth += 1
            best = max(best, depth)
        elif ch in "})]":
            depth = max(0, depth - 1)
    return best


_BIG_LITERAL_OP = re.compile(r"\d{5,}\s*!|\\[dt]?binom\s*\{?\s*\d{5,}")  # parsing evaluates these


def _refuse_text(s: str) -> str | None:
    if len(s) > MAX_ANSWER_CHARS:
        return f"answer longer than {MAX_ANSWER_CHARS} characters"
    if _nesting(s) > MAX_NESTING:
        return f"nesting deeper than {MAX_NESTING}"
    if _BIG_LITERAL_OP.search(s):
        return "factorial or binomial of a number over 10,000"
    return None


def _digits(expr) -> float | None:
    """Digits of |expr| (roughly log10), estimated without evaluating it; None if not a plain number."""
    import sympy

    if expr.is_Integer or expr.is_Rational:
        n, d = abs(int(expr.p)), int(expr.q)
        return (len(str(n)) if n else 0) - (len(str(d)) - 1)
    if expr.is_Float or isinstance(expr, sympy.NumberSymbol):  # 1.5, pi, e
        return math.log10(abs(float(expr))) if expr != 0 else 0.0
    if isinstance(expr, (sympy.Mul, sympy.Add)):  # log|ab| = log|a| + log|b|; |a+b| <= 2 max
        parts = [_digits(a) for a in expr.args]
        if any(p is None for p in parts):
            return None
        return sum(max(p, 0.0) for p in parts) if isinstance(expr, sympy.Mul) else max(parts) + 1
    if isinstance(expr, sympy.exp):
        arg = _digits(expr.args[0])
        if arg is None:
            return None
        return math.inf if arg > 6 else abs(float(expr.args[0])) * 0.4343
    if isinstance(expr, sympy.Pow):
        base, exp = _digits(expr.base), _digits(expr.exp)
        if base is None or exp is None:
            return None
        if exp > 6:                                     # an exponent over a million
            return math.inf
        e = float(expr.exp) if exp < 300 else math.inf
        return abs(e) * max(base, 0.0)
    if isinstance(expr, sympy.factorial):
        n = _digits(expr.args[0])
        if n is None:
            return None
        if n > 6:
            return math.inf
        v = float(expr.args[0])
        return math.lgamma(v + 1) / math.log(10) if v > 0 else 0.0
    return None


def _function_depth(expr, depth: int = 0) -> int:
    import sympy

    if depth > MAX_FUNCTION_NESTING + 1:
        return depth
    here = depth + isinstance(expr, sympy.Function)
    return max([here] + [_function_depth(a, here) for a in expr.args])


def _refuse_expr(parsed) -> str | None:
    import sympy

    for item in parsed:
        if not isinstance(item, (sympy.Basic, sympy.MatrixBase)):
            continue
        if isinstance(item, sympy.Basic) and _function_depth(item) > MAX_FUNCTION_NESTING:
            return f"functions nested deeper than {MAX_FUNCTION_NESTING}"
        for n, node in enumerate(sympy.preorder_traversal(item)):
            if n > MAX_NODES:
                return f"expression over {MAX_NODES} nodes"
            if isinstance(node, (sympy.Pow, sympy.factorial, sympy.binomial)):
                if isinstance(node, sympy.binomial):
                    top = _digits(node.args[0])
                    if top is not None and top > 4:
                        return "binomial of a number over 10,000"
                    continue
                if isinstance(node, sympy.Pow):
                    exp = _digits(node.exp)
                    if exp is not None and exp > 4:      # x^{100000} expands forever too
                        return "exponent over 10,000"
                    if (node.exp.is_Number and abs(float(node.exp)) > 60 and node.base.free_symbols
                            and not node.base.is_Symbol):
                        return "an expression in x raised to a power over 60"  # (x+1)^{999}, sin^{200}(x)
                digits = _digits(node)
                if digits is not None and digits > MAX_DIGITS:
                    return f"a number over {MAX_DIGITS} digits"
    return None


# ---- The in-process check (no hard deadline: the guards bound it; `is_correct` adds the deadline) ----

def _parse(latex: str, anchored_only: bool = False):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    if anchored_only:
        config = [LatexExtractionConfig(try_extract_without_anchor=False),
                  ExprExtractionConfig(try_extract_without_anchor=False)]
        return parse(latex, extraction_config=config, parsing_timeout=None)
    return parse(latex, parsing_timeout=None)


@lru_cache(maxsize=4096)
def _gold_norm(gold: str) -> str | None:
    """The normalised gold answer, None if it cannot be one (cached: GRPO checks each gold G times)."""
    norm = None if _refuse_text(gold) else normalize_answer(gold)
    if norm and (simple_number(norm) is not None or simple_tuple(norm) is not None or _gold_parsed(norm) is not None):
        return norm
    return None


@lru_cache(maxsize=4096)
def _gold_parsed(norm: str):
    """math-verify's reading of a normalised gold answer; None if it reads nothing or the guards refuse it."""
    parsed = _parse("\\boxed{" + norm + "}")
    return None if not parsed or _refuse_expr(parsed) else parsed


def check(completion: str, gold: str) -> Verdict:
    """The whole decision, in this process, bounded by the guards only: use `is_correct` on untrusted completions."""
    from math_verify import verify

    if not isinstance(completion, str) or not isinstance(gold, str):
        raise TypeError(f"check(completion, gold) takes two strings, got {type(completion).__name__} and {type(gold).__name__}")
    gold_norm = _gold_norm(gold)
    if gold_norm is None:
        return Verdict(False, None, "gold unparseable", gold_ok=False)
    completion = completion[-MAX_COMPLETION_CHARS:]
    boxed = last_boxed(completion)
    if boxed is not None:
        refused = _refuse_text(boxed)
        if refused:
            return Verdict(False, boxed[:80], "refused: " + refused)
        answer = normalize_answer(boxed)
        if not answer:
            return Verdict(False, "", "empty box")
        if _squash(answer) == _squash(gold_norm):
            return Verdict(True, answer, "equal-string")
        fast = _fast_verdict(answer, gold_norm)
        if fast is not None:
            return Verdict(fast, answer, "equal-number" if fast else "different-number")
        pred = _parse("\\boxed{" + answer + "}")
    else:
        tail = completion[-MAX_TAIL_CHARS:]
        if _nesting(tail) > MAX_NESTING:
            return Verdict(False, None, f"refused: nesting deeper than {MAX_NESTING}")
        pred = _parse(normalize_answer(tail), anchored_only=True)
        if not pred:
            return Verdict(False, None, "no-answer")
        answer = str(pred[-1]) if isinstance(pred[-1], str) else str(pred[0])
    refused = _refuse_expr(pred)
    if refused:
        return Verdict(False, answer[:80], "refused: " + refused)
    gold_parsed = _gold_parsed(gold_norm)
    if gold_parsed is None:  # a plain-number gold math-verify cannot read
        return Verdict(False, answer, "gold unparseable", gold_ok=False)
    if _differ_numerically(gold_parsed[0], pred[0]):
        return Verdict(False, answer, "different-value")
    ok = verify(gold_parsed, pred, allow_set_relation_comp=True, timeout_seconds=None)
    return Verdict(bool(ok), answer, "math-verify")
