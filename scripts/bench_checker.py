"""Benchmark and fuzz the Math500 checker; write results/math500_checker.json.

    .venv/bin/python scripts/bench_checker.py            # full run (~2-4 min on 2 cores)
    .venv/bin/python scripts/bench_checker.py --quick    # smaller fuzz, for a smoke check

What it measures (the targets in brackets):
1. agreement with the hand-labelled cases in data/math500_checker_cases.jsonl  [>= 98%],
   every disagreement listed;
2. checks per second on one core (per CPU-second, so other load on the machine does not count;
   wall-clock too), through `is_correct` (the worker process) and in-process,
   on a workload of distinct completions built from the offline MATH set's gold answers
   (right, wrong, unboxed and noise completions), after a warm-up that is timed separately
   [>= 200 checks/s];
3. the worst time of any single input under fuzz — random LaTeX token soup and an adversarial
   list (deep nesting, huge numbers such as 10^{10^{10}}, long strings, pathological regex
   input) — in the main thread and from 4 threads at once  [<= 5 s].
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import colo_kit  # noqa: E402

colo_kit.setup()  # the runtime defaults, before torch or vLLM is imported
from colo_kit.env import describe  # noqa: E402
from colo_kit.answers.math500 import Checker  # noqa: E402
from colo_kit.answers.answer_check import check  # noqa: E402
from colo_kit.paths import data_dir, results_dir  # noqa: E402
from record.store import commit, write_json_atomic  # noqa: E402

TOKENS = [r"\frac", r"\dfrac", r"\sqrt", "{", "}", "{", "}", "(", ")", "[", "]", "^", "_", "+", "-", r"\cdot",
          "=", "<", r"\le", ",", ".", "!", "%", r"\%", r"\pi", r"\infty", r"\pm", r"\circ", r"\text{cm}",
          r"\left(", r"\right)", r"\begin{pmatrix}", r"\end{pmatrix}", "&", r"\\", r"\boxed{", r"\cup",
          r"\overline", r"\{", r"\}", "$", "x", "y", "i", "e", " ", "0", "1", "2", "3", "7", "9", "10", "99",
          "123456789", r"\sin", r"\log", r"\binom", r"\int", r"\sum", r"\lim", "\\", "#", "~"]


def load_cases() -> list[dict]:
    return [json.loads(line) for line in (data_dir() / "math500_checker_cases.jsonl").read_text().splitlines() if line]


def agreement(check_fn) -> dict:
    cases = load_cases()
    disagreements, by_cat = [], {}
    for c in cases:
        v = check_fn(c["completion"], c["gold"])
        ok = v.correct == c["verdict"]
        by_cat.setdefault(c["category"], [0, 0])
        by_cat[c["category"]][0] += ok
        by_cat[c["category"]][1] += 1
        if not ok:
            disagreements.append({"id": c["id"], "category": c["category"], "gold": c["gold"],
                                  "extracted": v.answer, "label": c["verdict"], "checker": v.correct,
                                  "reason": v.reason, "note": c["note"]})
    agree = len(cases) - len(disagreements)
    return {"cases": len(cases), "agree": agree, "agreement": agree / len(cases),
            "by_category": {k: {"agree": a, "cases": n} for k, (a, n) in sorted(by_cat.items())},
            "disagreements": disagreements}


def workload(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """Distinct (completion, gold) pairs shaped like GRPO's: the offline set's golds, each with a
    right, a wrong, an unboxed or a noise completion."""
    rng = random.Random(seed)
    golds = [json.loads(line)["answer"] for line in (data_dir() / "math_problems.jsonl").read_text().splitlines()]
    pairs = []
    for i in range(n):
        gold = rng.choice(golds)
        kind = i % 4
        if kind == 0:
            ans = gold
        elif kind == 1:  # wrong: perturb a digit
            digits = [j for j, ch in enumerate(gold) if ch.isdigit()]
            j = rng.choice(digits) if digits else None
            ans = gold if j is None else gold[:j] + str((int(gold[j]) + rng.randint(1, 8)) % 10) + gold[j + 1:]
        elif kind == 2:
            ans = None
        else:
            ans = "".join(rng.choice(TOKENS[36:]) for _ in range(rng.randint(3, 30)))
        pad = f"Step {i}: we compute carefully. " * rng.randint(1, 20)
        if ans is None:
            completion = pad + f"So the final answer is ${gold if rng.random() < 0.5 else '7'}$."
        else:
            completion = pad + f"Therefore the answer is $\\boxed{{{ans}}}$."
        pairs.append((completion, gold))
    return pairs


def _cpu_s(pid: int) -> float:
    """user + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def throughput(fn, pairs, worker_pids: list[int] | None = None) -> dict:
    """Wall-clock checks/s, and checks per CPU-second (what one core does, whatever else the
    machine runs): this process's CPU time plus the worker's."""
    pids = worker_pids or []
    cpu0 = time.process_time() + sum(_cpu_s(p) for p in pids)
    t0 = time.perf_counter()
    for completion, gold in pairs:
        fn(completion, gold)
    s = time.perf_counter() - t0
    cpu = time.process_time() + sum(_cpu_s(p) for p in pids) - cpu0
    return {"checks": len(pairs), "seconds": round(s, 3), "cpu_seconds": round(cpu, 3),
            "checks_per_s": round(len(pairs) / s, 1), "checks_per_cpu_s": round(len(pairs) / cpu, 1),
            "load_avg_1min": os.getloadavg()[0]}


def adversarial() -> list[tuple[str, str, str]]:
    """(name, completion, gold)."""
    big = [r"10^{10^{10}}", r"10^10^10", r"9^{9^{9^{9}}}", r"2^{2^{2^{2^{2^{2}}}}}", r"99999999999!", r"10^{10}!",
           r"\binom{1000000000}{500000000}", r"(10^{100})!", r"2^{99999999}", r"\frac{1}{2}^{99999999}",
           r"10^{-10^{10}}", r"1" + "0" * 5000, r"1.5e999999999", r"(x+1)^{999}", r"(x+y+z)^{200}",
           r"x^{1000000}", r"\sqrt[1000000]{2}", r"e^{e^{e^{e^{10}}}}", r"\sin(10^{10^{10}})", r"999^{999}"]
    out = [(f"huge {s}", rf"The answer is $\boxed{{{s}}}$.", "5") for s in big]
    out += [(f"huge gold {s}", r"\boxed{5}", s) for s in big[:6]]
    for depth in (10, 39, 45, 100, 1000, 10000):
        out.append((f"braces x{depth}", r"\boxed{" + "{" * depth + "1" + "}" * depth + "}", "1"))
        out.append((f"parens x{depth}", r"\boxed{" + "(" * depth + "1" + ")" * depth + "}", "1"))
        out.append((f"frac x{depth}", r"\boxed{" + r"\frac{1}{" * depth + "2" + "}" * depth + "}", "1"))
        out.append((f"sqrt x{depth}", r"\boxed{" + r"\sqrt{" * depth + "2" + "}" * depth + "}", "2"))
        out.append((f"unclosed x{depth}", r"\boxed{" * depth + "1", "1"))
    for n in (10**3, 10**5, 10**6):
        out.append((f"digits {n}", rf"\boxed{{{'9' * n}}}", "9"))
        out.append((f"no box {n}", "1 + " * (n // 4) + "1", "2"))
        out.append((f"text then box {n}", "x" * n + r" \boxed{2}", "2"))
        out.append((f"dollars {n}", "$" * n, "1"))
        out.append((f"display brackets {n}", r"\[" * (n // 2), "1"))
        out.append((f"answer words {n}", "answer: " * (n // 8), "1"))
        out.append((f"final answer is {n}", "final answer is $1$ " * (n // 20), "1"))
        out.append((f"many boxes {n}", r"\boxed{1}" * (n // 9), "1"))
        out.append((f"sum {n}", r"\boxed{" + "+".join(["1"] * min(n // 2, 20000)) + "}", "1"))
    m = 40
    mat = r"\begin{pmatrix}" + r"\\".join("&".join(str((i * j) % 7) for j in range(m)) for i in range(m)) + r"\end{pmatrix}"
    out.append(("matrix 40x40", rf"\boxed{{{mat}}}", mat))
    out.append(("matrix 40x40 vs 1", rf"\boxed{{{mat}}}", "1"))
    out.append(("trig power", r"\boxed{\sin^{200}(x)+\cos^{200}(x)}", "1"))
    out.append(("nested trig", r"\boxed{" + r"\sin(" * 30 + "x" + ")" * 30 + "}", "x"))
    out.append(("long sum symbolic", r"\boxed{" + "+".join(f"x^{{{k}}}" for k in range(300)) + "}", "x"))
    # Within every guard, yet simplify() works for a while (~1 s on the dev box).
    out.append(("nested trig sum", r"\boxed{\sin(\sin(\sin(x)))+\cos(\cos(\cos(x)))+\tan(\tan(\tan(x)))"
                r"+\sin(\cos(\tan(x)))+\cos(\tan(\sin(x)))}", "1"))
    out.append(("nul and unicode", "\x00\u202e\\boxed{\u00bd}\ufffd", r"\frac12"))
    return out


def random_latex(rng: random.Random) -> str:
    n = rng.choice([1, 5, 20, 80, 300, 1500])
    body = "".join(rng.choice(TOKENS) for _ in range(n))
    return body if rng.random() < 0.3 else rf"The answer is $\boxed{{{body}}}$"


def fuzz(checker: Checker, inputs: list[tuple[str, str, str]], threads: int = 1) -> dict:
    times: list[tuple[float, str, str]] = []
    lock = threading.Lock()

    def run(items):
        for name, completion, gold in items:
            t0 = time.perf_counter()
            v = checker.check(completion, gold)
            dt = time.perf_counter() - t0
            with lock:
                times.append((dt, name, v.reason))

    t0 = time.perf_counter()
    if threads == 1:
        run(inputs)
    else:
        parts = [inputs[i::threads] for i in range(threads)]
        ts = [threading.Thread(target=run, args=(p,)) for p in parts]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    times.sort(reverse=True)
    return {"inputs": len(inputs), "threads": threads, "wall_s": round(time.perf_counter() - t0, 2),
            "worst_s": round(times[0][0], 3), "timeouts": sum("timeout" in r for _, _, r in times),
            "slowest": [{"seconds": round(t, 3), "input": n, "reason": r} for t, n, r in times[:10]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer random fuzz inputs, smaller workload")
    ap.add_argument("--out", default=str(results_dir() / "math500_checker.json"))
    args = ap.parse_args(argv)
    rng = random.Random(0)
    n_work, n_random = (300, 100) if args.quick else (2000, 600)

    report: dict = {"env": describe(), "commit": commit(), "date": time.strftime("%Y-%m-%d"),
                    "settings": {"quick": args.quick, "workload_checks": n_work, "random_fuzz_inputs": n_random}}
    checker = Checker()
    t0 = time.perf_counter()
    checker.warm_up()
    report["worker_start_s"] = round(time.perf_counter() - t0, 3)

    # 1. agreement (through the worker, as the reward uses it); the first pass is also the warm-up
    t0 = time.perf_counter()
    report["agreement"] = agreement(checker.check)
    report["agreement"]["seconds_cold"] = round(time.perf_counter() - t0, 3)
    a = report["agreement"]
    print(f"agreement {a['agree']}/{a['cases']} = {a['agreement']:.2%} ({a['seconds_cold']} s, cold)", flush=True)
    for d in a["disagreements"]:
        print(f"  disagree {d['id']} {d['category']}: gold {d['gold']!r} extracted {d['extracted']!r} "
              f"label {d['label']} checker {d['checker']} ({d['reason']})")

    # 2. throughput on distinct completions, warm
    pairs = workload(n_work)
    check(*pairs[0])  # warm this process's parser too, for the in-process number
    pids = [w.proc.pid for w in checker._idle]
    report["throughput"] = {"worker": throughput(checker.check, pairs, pids),
                            "in_process": throughput(check, workload(n_work, seed=1))}
    print("throughput", json.dumps(report["throughput"]), flush=True)

    # 3. fuzz: adversarial list + random LaTeX, main thread then 4 threads
    inputs = adversarial() + [(f"random {i}", random_latex(rng), rng.choice(["1", r"\frac{1}{2}", "(1,2)", "x+1"]))
                              for i in range(n_random)]
    report["fuzz"] = {"main_thread": fuzz(checker, inputs)}
    checker.warm_up(4)  # one worker per thread, started before the clock runs (as a trainer would)
    report["fuzz"]["threads_4"] = fuzz(checker, inputs, threads=4)
    report["worker_restarts"] = checker.restarts
    for k, f in report["fuzz"].items():
        print(f"fuzz {k}: {f['inputs']} inputs, worst {f['worst_s']} s, {f['timeouts']} timeouts, wall {f['wall_s']} s",
              flush=True)
    report["worst_case_s"] = max(f["worst_s"] for f in report["fuzz"].values())
    tp = report["throughput"]
    report["summary"] = {"agreement": round(a["agreement"], 4),
                         "checks_per_cpu_s": tp["worker"]["checks_per_cpu_s"],
                         "checks_per_s_wall": tp["worker"]["checks_per_s"],
                         "checks_per_cpu_s_in_process": tp["in_process"]["checks_per_cpu_s"],
                         "load_avg_1min": tp["worker"]["load_avg_1min"],
                         "worst_case_s": report["worst_case_s"],
                         "bars": {"agreement": 0.98, "checks_per_s": 200, "worst_case_s": 5.0}}
    checker.close()
    out = write_json_atomic(args.out, report)  # whole or not at all: a full disk leaves the committed record as it was
    print("summary", json.dumps(report["summary"]))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
