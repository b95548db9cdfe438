"""Why does one generation take longer inside the GRPO trainer than alone? (notebook 04, section 7)

`gen_latency.py` times vLLM alone: 128 completions of 256 tokens in 1.09 s on an H200 (`seqs128`). Inside the
trainer the recipe's generation of 128 took 2.1 s (TRL's `vLLM.generate` timer, `results/speed_1xh200.json` at
32f45d7), with the same sampling settings; that engine kept TRL's default length, the model's own 32,768 tokens,
where `gen_latency.py` sizes its engine for 64 + 256 (the recipe now sizes it for the longest prompt plus the
completion, `vllm_max_model_length`). This trains one configuration of
`record.speed` for a short budget with `vllm.LLM.generate` wrapped: each call's wall time, the
completion tokens it made, and the pauses of Python's garbage collector inside it (`gc.callbacks`); one call (the
third) also runs under cProfile. One child process per garbage-collector mode:

    on    as the trainer runs today
    off   the collector's automatic runs switched off for the length of each generation and on again after
          (nothing is lost: the garbage made meanwhile goes at the next collection; an explicit `gc.collect()`
          still runs, one per generation on the CPU, none seen on the H200)

Writes results/gen_in_trainer_1xh200.json. On a CPU, `--model tiny --max-completion-length 16` runs the same code.

    source .gpu/env.sh && COLO_KIT_CACHE=/root/cache python scripts/gpu/gen_in_trainer.py [--config recipe]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
MODES = ("on", "off")


def one_mode(mode: str, a) -> dict:
    import vllm

    from record.speed import run_seed

    calls, pauses, profiled = [], [], {}

    def on_gc(phase, info):  # the collector's own start/stop, in every generation of it
        if phase == "start":
            pauses.append([time.perf_counter(), None, info["generation"]])
        elif pauses and pauses[-1][1] is None:
            pauses[-1][1] = time.perf_counter()

    gc.callbacks.append(on_gc)
    original = vllm.LLM.generate

    def generate(self, *args, **kw):
        n = len(calls)
        was_on = gc.isenabled()
        if mode == "off":
            gc.disable()
        prof = cProfile.Profile() if n == 2 else None
        first_pause = len(pauses)
        t0 = time.perf_counter()
        try:
            if prof:
                prof.enable()
            out = original(self, *args, **kw)
            if prof:
                prof.disable()
        finally:
            t1 = time.perf_counter()
            if was_on:
                gc.enable()
        inside = [p for p in pauses[first_pause:] if p[1] is not None]
        calls.append({"seconds": round(t1 - t0, 4), "prompts": len(out),
                      "tokens": sum(len(o.outputs[0].token_ids) for o in out),
                      "gc_pause_s": round(sum(p[1] - p[0] for p in inside), 4),
                      "gc_collections": {g: sum(1 for p in inside if p[2] == g) for g in (0, 1, 2)}})
        if prof:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
            profiled["call"] = n
            profiled["top_by_tottime"] = [line for line in s.getvalue().splitlines() if line.strip()][:40]
        return out

    vllm.LLM.generate = generate
    try:
        rec = run_seed(a.config, model=a.model, seed=0, budget_s=a.budget_s, learning_rate=5e-4,
                       max_completion_length=a.max_completion_length)
    finally:
        vllm.LLM.generate = original
        gc.callbacks.remove(on_gc)
    return {"mode": mode, "config": a.config, "steps_done": rec["steps_done"],
            "phase_s_per_step": rec["phase_s_per_step"], "steady": {k: v for k, v in rec["steady"].items()
                                                                    if k != "per_cycle"},
            "gc_objects_tracked_at_end": len(gc.get_objects()), "calls": calls, "profile": profiled}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="recipe")
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--budget-s", type=float, default=25.0)
    ap.add_argument("--max-completion-length", type=int, default=None)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child: one mode, print its JSON
    ap.add_argument("--out", default=str(ROOT / "results" / "gen_in_trainer_1xh200.json"))
    a = ap.parse_args()
    import colo_kit

    colo_kit.setup()
    if a.one:
        print("RESULT " + json.dumps(one_mode(a.one, a)), flush=True)
        return 0
    from colo_kit.env import describe
    from record.store import commit

    result = {"benchmark": "vLLM.generate inside TRL's GRPO trainer, with and without the garbage collector",
              "model": a.model, "config": a.config, "budget_s": a.budget_s, "commit": commit(), "env": describe(),
              "modes": {}}
    for mode in a.modes.split(","):
        cmd = [sys.executable, __file__, "--one", mode, "--config", a.config, "--model", a.model,
               "--budget-s", str(a.budget_s)]
        if a.max_completion_length:
            cmd += ["--max-completion-length", str(a.max_completion_length)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        result["modes"][mode] = json.loads(line[-1][7:]) if line else {"error": (p.stderr or p.stdout)[-1500:]}
        m = result["modes"][mode]
        print(mode, [(c["seconds"], c["prompts"], c["gc_pause_s"], c["gc_collections"]) for c in m.get("calls", [])]
              or m.get("error"), flush=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
