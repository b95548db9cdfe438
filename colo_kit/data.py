"""Prompt sets: the posts' hub datasets when online, the kit's offline stand-ins when not.

`load_tldr()`: `trl-lib/tldr` (the first post's example script) or `data/tldr_prompts.jsonl`; `load_math()`:
`HuggingFaceH4/MATH-500` or `data/math_problems.jsonl`. Both say which source they used (`dataset.info.description`).
"""

from __future__ import annotations

import json
from pathlib import Path
import logging
import os
import random
from fractions import Fraction
from math import comb, gcd

from colo_kit.paths import data_dir

log = logging.getLogger(__name__)

TLDR_HUB_ID = "trl-lib/tldr"
MATH500_HUB_ID = "HuggingFaceH4/MATH-500"


def _offline_requested() -> bool:
    return any(os.environ.get(v, "0") not in ("", "0", "false", "False")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "COLO_KIT_OFFLINE"))


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the hub's name resolves within seconds (offline, `load_dataset` retries ~25 s before failing)."""
    import concurrent.futures
    import socket

    host = os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("://")[-1].split("/")[0]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        pool.submit(socket.getaddrinfo, host, 443).result(timeout=timeout_s)
        return True
    except Exception:
        return False
    finally:
        pool.shutdown(wait=False)


def _load(hub_id: str, split: str, offline_file: str, source: str):
    from datasets import Dataset, load_dataset

    if source not in ("auto", "hub", "offline"):
        raise ValueError(f"source={source!r}; use 'auto' (hub, else data/), 'hub' or 'offline'")
    if source == "hub" or (source == "auto" and not _offline_requested() and _hub_reachable()):
        try:
            ds = load_dataset(hub_id, split=split)
            log.info("using %s (%s, %d rows) from the hub", hub_id, split, len(ds))
            return ds
        except Exception as exc:  # no network, no cache: fall back, but say so
            if source == "hub":
                raise
            log.info("%s unavailable (%s); using data/%s", hub_id, type(exc).__name__, offline_file)
    path = data_dir() / offline_file
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; run `colo-kit data` to regenerate the offline sets")
    ds = Dataset.from_list(read_jsonl(path))
    ds.info.description = f"colo_kit offline stand-in for {hub_id}: data/{offline_file}"
    log.info("using offline data/%s (%d rows) standing in for %s", offline_file, len(ds), hub_id)
    return ds


def read_jsonl(path, required: tuple[str, ...] = ()) -> list[dict]:
    """The rows of a JSONL file, each a JSON object with `required` keys; ValueError naming the first bad line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it ({exc}); give a UTF-8 JSONL file") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path} line {number}: not JSON ({exc.args[0].split(':')[0]}); one JSON object per "
                             "line") from None
        missing = [k for k in required if not isinstance(row, dict) or k not in row]
        if not isinstance(row, dict) or missing:
            raise ValueError(f"{path} line {number}: needs a JSON object with {', '.join(required) or 'fields'}"
                             + (f" (missing {', '.join(missing)})" if isinstance(row, dict) else ""))
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows; one JSON object per line")
    return rows


def load_problems(path):
    """A math set of your own (JSONL: `problem`, `answer`, optionally `subject`, `level`) as MATH-500 is."""
    from datasets import Dataset

    rows = read_jsonl(path, required=("problem", "answer"))
    for number, row in enumerate(rows, start=1):
        if not isinstance(row["problem"], str) or not isinstance(row["answer"], (str, int, float)):
            raise ValueError(f"{path} row {number}: problem must be text and answer text or a number")
        row["answer"] = str(row["answer"])
        row.setdefault("subject", "unknown")
        row.setdefault("level", 0)
        row.setdefault("unique_id", f"{Path(path).name}:{number}")
    ds = Dataset.from_list(rows)
    ds.info.description = f"problems from {path}"
    return ds


def load_tldr(split: str = "train", source: str = "auto"):
    """Prompts for the length-reward runs: a `prompt` column (plain text ending in 'TL;DR:')."""
    return _load(TLDR_HUB_ID, split, "tldr_prompts.jsonl", source)


def load_math(split: str = "test", source: str = "auto"):
    """Math problems with `problem`, `answer`, `subject`, `level`, `unique_id`."""
    return _load(MATH500_HUB_ID, split, "math_problems.jsonl", source)


def math_prompt(problem: str) -> list[dict]:
    """The one prompt template (chat form) of training and evaluation."""
    return [{"role": "user", "content": problem + "\nPlease reason step by step, and put your final "
             "answer within \\boxed{}."}]


# ---- Offline generators (deterministic; their output is committed under data/) ----

_SUBREDDITS = ["relationships", "AskReddit", "personalfinance", "tifu", "cooking", "running",
               "legaladvice", "cscareerquestions", "gardening", "travel"]
_WHO = ["My roommate", "My sister", "A coworker", "My landlord", "My best friend", "My manager",
        "My neighbour", "My partner", "An old classmate", "My dad"]
_DID = ["keeps borrowing my car without asking", "forgot my birthday for the third year",
        "offered me a job at their startup", "wants to split rent differently",
        "started a sourdough business in our kitchen", "signed us both up for a marathon",
        "asked me to lend them $2,000", "moved our wedding date without telling me",
        "adopted two cats while I was away", "quit their job to travel for a year"]
_FEEL = ["I don't know how to bring it up without a fight.", "Part of me is happy, part of me is furious.",
         "I have been losing sleep over it.", "Everyone else seems to think it's fine.",
         "I said yes before I thought about it.", "We have known each other for ten years."]
_ASK = ["How do I handle this?", "Am I overreacting?", "What would you do?",
        "Is there a fair way to split this?", "Should I just let it go?"]


def make_tldr_rows(n: int = 400, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        sub, who, did = rng.choice(_SUBREDDITS), rng.choice(_WHO), rng.choice(_DID)
        body = " ".join([f"{who} {did}.", rng.choice(_FEEL), rng.choice(_FEEL),
                         f"It has been {rng.randint(2, 11)} weeks.", rng.choice(_ASK)])
        title = f"{who} {did} ({rng.randint(19, 45)}{rng.choice('MF')})"
        prompt = f"SUBREDDIT: r/{sub}\n\nTITLE: {title}\n\nPOST: {body}\n\nTL;DR:"
        rows.append({"prompt": prompt, "completion": f" {who.lower()} {did}; {rng.choice(_ASK).lower()}"})
    return rows


def _frac_tex(q: Fraction) -> str:
    if q.denominator == 1:
        return str(q.numerator)
    sign = "-" if q < 0 else ""
    return f"{sign}\\frac{{{abs(q.numerator)}}}{{{q.denominator}}}"


def make_math_rows(n: int = 300, seed: int = 0) -> list[dict]:
    """Problems in MATH's subjects with gold answers in MATH's LaTeX style, so the checker meets the same forms."""
    rng = random.Random(seed)

    def prealgebra():
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        q = Fraction(a, b) + Fraction(rng.randint(1, 9), rng.randint(2, 9))
        return (f"Compute $\\frac{{{a}}}{{{b}}} + {_frac_tex(q - Fraction(a, b))}$. Express your answer as a "
                "common fraction in lowest terms.", _frac_tex(q), "Prealgebra")

    def algebra():
        r1, r2 = rng.randint(-9, 9), rng.randint(-9, 9)
        b, c = -(r1 + r2), r1 * r2
        return (f"What is the sum of the roots of $x^2 {'+' if b >= 0 else '-'} {abs(b)}x "
                f"{'+' if c >= 0 else '-'} {abs(c)} = 0$?", str(r1 + r2), "Algebra")

    def interval():
        a, b = sorted(rng.sample(range(-12, 13), 2))
        return (f"Solve $(x - {a})(x - {b}) < 0$. Give your answer in interval notation.".replace("- -", "+ "),
                f"({a}, {b})", "Intermediate Algebra")

    def counting():
        n_, k = rng.randint(5, 14), rng.randint(2, 4)
        return (f"In how many ways can a committee of {k} be chosen from {n_} people?",
                str(comb(n_, k)), "Counting & Probability")

    def probability():
        sides = rng.choice([6, 8, 10, 12])
        target = rng.randint(2, sides)
        q = Fraction(sides - target + 1, sides)
        return (f"A fair {sides}-sided die is rolled. What is the probability of rolling at least {target}? "
                "Express your answer as a common fraction.", _frac_tex(q), "Counting & Probability")

    def number_theory():
        a, b = rng.randint(12, 300), rng.randint(12, 300)
        return (f"What is the greatest common divisor of ${a}$ and ${b}$?", str(gcd(a, b)), "Number Theory")

    def geometry():
        n_ = rng.randint(5, 12)
        deg = Fraction(180 * (n_ - 2), n_)
        ans = f"{_frac_tex(deg)}^\\circ" if deg.denominator == 1 else _frac_tex(deg)
        return (f"What is the measure, in degrees, of each interior angle of a regular polygon with {n_} sides?",
                ans, "Geometry")

    def radical():
        k, m = rng.randint(2, 6), rng.choice([2, 3, 5, 6, 7])
        return (f"Simplify $\\sqrt{{{k * k * m}}}$.", f"{k}\\sqrt{{{m}}}", "Algebra")

    def pair():
        x, y = rng.randint(-6, 6), rng.randint(-6, 6)
        return (f"Solve the system $x + y = {x + y}$, $x - y = {x - y}$. Enter your answer as an ordered pair $(x, y)$.",
                f"({x}, {y})", "Algebra")

    def big():
        a = rng.randint(1000, 9999) * rng.randint(11, 99)
        return (f"What is ${a} \\times 10$?", str(a * 10), "Prealgebra")

    def percent():
        p, base = rng.choice([10, 20, 25, 40, 75]), rng.choice([40, 80, 120, 200])
        return (f"What is ${p}\\%$ of ${base}$?", _frac_tex(Fraction(p * base, 100)), "Prealgebra")

    def precalc():
        k = rng.choice([1, 2, 3, 4, 6])
        return (f"Find the smallest positive period of $\\sin({k}x)$.",
                "2\\pi" if k == 1 else ("\\pi" if k == 2 else f"\\frac{{2\\pi}}{{{k}}}"), "Precalculus")

    makers = [prealgebra, algebra, interval, counting, probability, number_theory, geometry, radical,
              pair, big, percent, precalc]
    rows = []
    for i in range(n):
        problem, answer, subject = rng.choice(makers)()
        rows.append({"problem": problem, "answer": answer, "solution": f"The answer is $\\boxed{{{answer}}}$.",
                     "subject": subject, "level": rng.randint(1, 5), "unique_id": f"colo_kit/math/{i:04d}"})
    return rows


def write_offline_data() -> list[str]:
    written = []
    for name, rows in (("tldr_prompts.jsonl", make_tldr_rows()), ("math_problems.jsonl", make_math_rows())):
        path = data_dir() / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        written.append(str(path))
    return written


def cli_main(argv: list[str]) -> int:
    from colo_kit.commands import ArgumentParser

    ArgumentParser(prog="colo-kit data", description="Regenerate data/*.jsonl from fixed seeds.").parse_args(argv)
    for path in write_offline_data():
        print(path)
    return 0
