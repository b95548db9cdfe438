"""TP 1 vs TP 2 on the GPUs of one node, one part per call, run by scripts/gpu/tp_tuning.sh.

  build --model M                     build the random-weight model folder (on the GPU: fast init)
  gen   --model M --tp T --out F      generation-only throughput at TP T (colo_kit.parallel.tp.generation_sweep)
  grpo  --model M --tp T --out F      TRL colocate GRPO step time at vllm_tensor_parallel_size T
  merge PARTS... --out results/tp_gpu.json

Every part runs its processes through colo_kit.parallel.launch (torch's elastic_launch, forked
from this process, which never touches CUDA itself), so the GPU run exercises the notebook path.
`--smoke` runs the same code with the tiny model on 2 CPU processes (not evidence).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import colo_kit  # noqa: E402

colo_kit.setup()  # the runtime defaults, before torch or vLLM is imported
from colo_kit.env import describe, has_cuda  # noqa: E402


def log(msg: str) -> None:
    print(f"[tp_tuning {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _write(path: str, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, default=str))


def cmd_build(a) -> int:
    import torch

    from colo_kit.models import build_model

    t0 = time.perf_counter()
    if has_cuda():
        with torch.device("cuda"):
            path = build_model(a.model)
    else:
        path = build_model(a.model)
    log(f"built {a.model} at {path} in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_gen(a) -> int:
    from colo_kit.parallel import tp

    model = "tiny" if a.smoke else a.model
    part = {"kind": "generation", "model": a.model, "tp": a.tp}
    try:
        sw = tp.generation_sweep(model, (a.tp,), num_prompts=a.num_prompts, prompt_len=a.prompt_len,
                                 max_completion_length=a.max_tokens, vllm_gpu_memory_utilization=a.util,
                                 enforce_eager=bool(a.eager), repeats=a.repeats, echo="brief")
        part["sweep"] = sw
        s = sw["tp"][a.tp]
        log(f"{a.model} gen TP {a.tp}: {s['tok_per_s']:,.0f} tok/s (runs {s['tok_per_s_runs']}), "
            f"KV {s['kv_tokens_per_engine']} tokens/engine, start {s['startup_s']} s")
    except Exception as exc:  # keep the failure in the JSON: one part must not lose the others
        part["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        part["traceback"] = traceback.format_exc()[-4000:]
        log(f"{a.model} gen TP {a.tp} FAILED: {part['error'][:500]}")
    _write(a.out, part)
    return 0 if "error" not in part else 1


def cmd_grpo(a) -> int:
    from colo_kit.parallel import tp

    model = "tiny" if a.smoke else a.model
    part = {"kind": "grpo", "model": a.model, "tp": a.tp}
    overrides = {}
    if has_cuda():
        overrides = {k: v for k, v in tp.GPU_GRPO_SETTINGS.items()
                     if k in ("model_init_kwargs", "gradient_checkpointing")}
    try:
        sw = tp.grpo_sweep(model, (a.tp,), max_steps=a.steps, per_device_train_batch_size=a.per_device_train_batch_size,
                           num_generations=a.num_generations, max_completion_length=a.max_tokens,
                           vllm_gpu_memory_utilization=a.util, vllm_enforce_eager=bool(a.eager), echo="brief", **overrides)
        part["sweep"] = sw
        s = sw["tp"][a.tp]
        log(f"{a.model} GRPO TP {a.tp}: median step {s['step_s']} s, steps {s['step_s_all']}")
    except Exception as exc:
        part["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        part["traceback"] = traceback.format_exc()[-4000:]
        log(f"{a.model} GRPO TP {a.tp} FAILED: {part['error'][:500]}")
    _write(a.out, part)
    return 0 if "error" not in part else 1


def cmd_merge(a) -> int:
    from colo_kit.parallel import tp

    out = {"issue": 5, "what": "TP 1 vs TP 2 for colocated vLLM on the GPUs of one node: generation-only "
                               "throughput (colo_kit.parallel.tp.generation_sweep) and TRL colocate GRPO step time "
                               "(colo_kit.parallel.tp.grpo_sweep), random-weight Qwen2.5 architectures",
           "describe": describe(), "post_reference": tp.POST_REFERENCE, "generation": {}, "grpo": {},
           "errors": [], "script": "scripts/gpu/tp_tuning.sh"}
    if a.base and Path(a.base).exists():
        # A later run's parts laid over an earlier run's JSON (e.g. the GRPO parts a time limit cut):
        # each TP 1 / TP 2 pair still comes from one run; both runs' machines are kept.
        base = json.loads(Path(a.base).read_text())
        for key in ("generation", "grpo"):
            out[key] = base.get(key, {})
        out["errors"] = [dict(e, run="base") for e in base.get("errors", [])
                         if not (a.drop_base_errors_for and e.get("kind") == a.drop_base_errors_for)]
        out["base_run"] = {"describe": base.get("describe"), "from": a.base}
    for p in a.parts:
        try:
            part = json.loads(Path(p).read_text())
        except Exception as exc:
            out["errors"].append({"part": p, "error": repr(exc)})
            continue
        if "error" in part:
            out["errors"].append({"part": Path(p).name, "model": part.get("model"), "kind": part.get("kind"),
                                  "tp": part.get("tp"), "error": part["error"], "traceback": part.get("traceback")})
            continue
        key = "generation" if part["kind"] == "generation" else "grpo"
        sw = part["sweep"]
        dest = out[key].setdefault(part["model"], {"model": part["model"], "settings": sw["settings"], "tp": {}})
        for t, s in sw["tp"].items():
            dest["tp"][str(t)] = s
    out["summary"] = {
        "generation_tp2_over_tp1": {m: tp.tp_ratio(v, "tok_per_s") for m, v in out["generation"].items()},
        "grpo_speedup_tp2": {m: tp.tp_ratio(v, "step_s") for m, v in out["grpo"].items()},
        "post": {m: v["trend"] + (f", up to {v['max_speedup']}x" if v["max_speedup"] else "")
                 for m, v in tp.POST_REFERENCE.items() if m.startswith("qwen")},
    }
    if a.smoke:
        out["label"] = "SMOKE on CPU with the tiny model: not evidence"
    _write(a.out, out)
    log(f"wrote {a.out}: {json.dumps(out['summary'])} ({len(out['errors'])} failed parts)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/tp_tuning.py")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("build", "gen", "grpo"):
        p = sub.add_parser(name)
        p.add_argument("--model", default="qwen2.5-1.5b")
        p.add_argument("--smoke", action="store_true", help="tiny model on 2 CPU processes (not evidence)")
        if name == "build":
            continue
        p.add_argument("--tp", type=int, required=True)
        p.add_argument("--out", required=True)
        p.add_argument("--util", type=float, default=0.3, help="vllm_gpu_memory_utilization (the post: 0.3)")
        p.add_argument("--eager", type=int, default=int(os.environ.get("TP_EAGER", "1")),
                       help="1: vLLM without torch.compile/CUDA graphs (fits the time budget); 0: compiled")
        if name == "gen":
            p.add_argument("--num-prompts", type=int, default=256)
            p.add_argument("--prompt-len", type=int, default=64)
            p.add_argument("--max-tokens", type=int, default=256)
            p.add_argument("--repeats", type=int, default=2)
        else:
            from colo_kit.parallel.tp import GPU_GRPO_SETTINGS as g

            p.add_argument("--steps", type=int, default=g["max_steps"])
            p.add_argument("--per-device-train-batch-size", type=int, default=g["per_device_train_batch_size"])
            p.add_argument("--num-generations", type=int, default=g["num_generations"])
            p.add_argument("--max-tokens", type=int, default=g["max_completion_length"])
    m = sub.add_parser("merge")
    m.add_argument("parts", nargs="*")
    m.add_argument("--out", required=True)
    m.add_argument("--smoke", action="store_true")
    m.add_argument("--base", default=None, help="an earlier run's JSON to keep what these parts do not replace")
    m.add_argument("--drop-base-errors-for", default=None, help="the kind ('grpo') these parts re-run")
    a = ap.parse_args(argv)
    if a.smoke and a.cmd == "gen":  # CPU: the tiny model and a short run, the same output structure
        a.num_prompts, a.max_tokens, a.repeats = 8, 16, 1
    if a.smoke and a.cmd == "grpo":
        a.steps, a.per_device_train_batch_size, a.num_generations, a.max_tokens = 2, 4, 4, 16
    if a.cmd == "build" and a.smoke:
        a.model = "tiny"
    return {"build": cmd_build, "gen": cmd_gen, "grpo": cmd_grpo, "merge": cmd_merge}[a.cmd](a)


if __name__ == "__main__":
    raise SystemExit(main())
