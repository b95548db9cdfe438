"""Benchmark of colo_kit's colocated engine and its sleep switch.

What it measures, for one model per call (run by scripts/gpu/engine_bench.sh on 2x H200):
- `colocate`: `ColocatedEngine` at vllm_gpu_memory_utilization=0.3 with sleep mode on —
  generation throughput (N prompts x T tokens, ignore_eos), the self-check, and the switch cost of
  a training step (sleep + wake(weights) + push + wake(kv_cache)), each part timed over several
  steps at levels 2 and 1, with NVML memory at each stage; then a clean exit (vLLM #16993).
- `plain`: a plain `vllm.LLM` at gpu_memory_utilization=0.9, same prompts.
- `merge`: the parts into results/engine_bench.json, with ratios and the issue's goals.

`--smoke` runs the same code on a CPU with the tiny model (no sleep: vLLM's CPU engine has none).
Raw per-run and per-step times are kept; the summary quotes medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import colo_kit  # noqa: E402

colo_kit.setup()  # the runtime defaults, before torch or vLLM is imported
from colo_kit.env import describe, has_cuda  # noqa: E402

GOALS = {"throughput_ratio_min": 0.9, "switch_s_max_at_1.5b": 0.05}
TRL_REFERENCE = {"trl_1.16_colocate_sleep_switch_s": [0.15, 0.27],
                 "plain_vllm_0.26_at_0.3_tok_per_s": 37000,
                 "note": "measured earlier on the same machine; not re-measured here"}


_PARTIAL: dict = {}


def save_partial(out: dict) -> None:
    """Write what a run has so far: a part killed by its timeout still leaves its finished phases."""
    path = _PARTIAL.get("path")
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({**out, "partial": True, "env": describe()}, indent=1, default=str))


def log(msg: str) -> None:
    print(f"[engine_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    # Ids well inside the learned BPE range of the kit's tokenizer, away from special tokens.
    return [[rng.randrange(10, min(vocab, 1000)) for _ in range(length)] for _ in range(n)]


def nvml(device_index: int = 0) -> dict | None:
    if not has_cuda():
        return None
    from colo_kit.colocate.sleep import device_memory_gib

    return device_memory_gib(device_index)


def build(args) -> dict:
    """Build the model folder; on a GPU the random init runs there (7B on 16 CPU cores is slow)."""
    import torch
    from colo_kit.models import build_model

    t0 = time.perf_counter()
    path = None
    if has_cuda():
        try:
            with torch.device("cuda"):
                path = build_model(args.model)
        except Exception as exc:
            log(f"building on the GPU failed ({exc!r}); building on the CPU")
    if path is None:
        path = build_model(args.model)
    return {"path": str(path), "build_s": round(time.perf_counter() - t0, 2)}


def time_generation(gen_fn, prompts, tokens: int, repeats: int) -> dict:
    gen_fn(prompts[: max(1, len(prompts) // 8)], tokens)  # warm-up: CUDA graphs, allocator
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        n_tokens = gen_fn(prompts, tokens)
        dt = time.perf_counter() - t0
        runs.append({"seconds": round(dt, 4), "output_tokens": n_tokens, "tok_per_s": round(n_tokens / dt, 1)})
    return {"runs": runs, "median_tok_per_s": statistics.median(r["tok_per_s"] for r in runs)}


def run_colocate(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from colo_kit.colocate.engine import ColocatedEngine, ColocateSettings

    gpu = has_cuda()
    out: dict = {"mode": "colocate", "model": args.model}
    out.update(build(args))
    settings = ColocateSettings(per_device_train_batch_size=args.prompts, max_prompt_length=args.prompt_len,
                                max_completion_length=args.tokens, vllm_gpu_memory_utilization=args.util,
                                vllm_enable_sleep_mode=gpu)
    out["settings"] = {**settings.__dict__, "max_num_seqs": settings.max_num_seqs,
                       "max_model_len": settings.max_model_len}
    out["memory_before_engine"] = nvml()
    log(f"colocate {args.model}: building the engine")
    engine = ColocatedEngine(out["path"], settings)
    out["startup_s"] = round(engine.startup_s, 2)
    vocab = engine.tokenizer.vocab_size if hasattr(engine.tokenizer, "vocab_size") else 1000
    prompts = random_prompts(args.prompts, args.prompt_len, vocab)

    def gen(ps, tokens):
        g = engine.generate(ps, max_tokens=tokens, ignore_eos=True, logprobs=False)
        return g.num_completion_tokens

    log("colocate: throughput")
    out["throughput"] = time_generation(gen, prompts, args.tokens, args.repeats)
    log(f"colocate: {out['throughput']['median_tok_per_s']:.0f} tok/s")
    save_partial(out)

    log("colocate: loading the trainer's copy of the model")
    dev = engine.device
    t0 = time.perf_counter()
    if gpu:
        model = AutoModelForCausalLM.from_pretrained(out["path"], dtype=torch.bfloat16, device_map={"": dev.index or 0})
    else:
        model = AutoModelForCausalLM.from_pretrained(out["path"], dtype=torch.bfloat16)
    out["trainer_model_load_s"] = round(time.perf_counter() - t0, 2)
    model.eval()
    pushes = [engine.push_weights(model) for _ in range(args.steps)]
    out["push_awake_s"] = [round(p, 5) for p in pushes]
    save_partial(out)

    if not gpu:
        out["sleep"] = "skipped: vLLM's CPU engine has no sleep mode"
    else:
        from colo_kit.colocate.sleep import SleepManager

        small = prompts[:8]
        for level in (2, 1):
            mgr = SleepManager(engine, level=level)
            log(f"colocate: self-check, level {level}")
            try:
                check = mgr.self_check(model)
            except Exception as exc:  # recorded, not fatal: the timings still matter
                check = {"passed": False, "error": repr(exc)}
            steps = []
            try:
                for _ in range(args.steps):
                    engine.generate(small, max_tokens=16, ignore_eos=True, logprobs=False)  # a generation phase
                    steps.append({k: round(v, 5) for k, v in mgr.switch(model).items()})
            except Exception as exc:
                import traceback

                out[f"level{level}_error"] = traceback.format_exc()
                log(f"colocate: level {level} failed: {exc!r}")
                if engine.asleep:
                    try:
                        mgr.wake(model=model)
                    except Exception:
                        pass
            out[f"level{level}"] = {
                "self_check": check,
                "steps": steps,
                "median_s": {k: statistics.median(s[k] for s in steps) for k in steps[0]} if steps else {},
                "stages": mgr.stages,  # NVML memory at each stage, self-check cycle first
            }
            log(f"colocate: level {level} switch median {out[f'level{level}']['median_s'].get('switch_s')} s")
            save_partial(out)
        after = engine.probe()
        out["probe_after_all_switches"] = after["token_ids"]
        if args.zero3_check:
            out["zero3_push"] = zero3_push_check(engine, model)
            save_partial(out)
    out["memory_awake"] = nvml()
    del model
    engine.close()
    return out


def zero3_push_check(engine, model) -> dict:
    """Push from a DeepSpeed ZeRO-3 engine (parameters partitioned, gathered batch by batch in
    push_weights): the greedy probe must equal the one after a push of the same plain model."""
    try:
        import deepspeed

        log("colocate: ZeRO-3 push check")
        want = engine.probe()
        cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
        ds_engine, *_ = deepspeed.initialize(model=model, config=cfg)
        partitioned = sum(1 for p in ds_engine.module.parameters() if hasattr(p, "ds_id") and p.numel() == 0)
        push_s = engine.push_weights(ds_engine)
        got = engine.probe()
        return {"push_s": round(push_s, 5), "partitioned_params": partitioned,
                "same_probe": got["token_ids"] == want["token_ids"],
                "max_logprob_diff": max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"]))}
    except Exception as exc:
        return {"error": repr(exc)}


def run_plain(args) -> dict:
    from vllm import LLM, SamplingParams

    out: dict = {"mode": "plain", "model": args.model}
    out.update(build(args))
    log(f"plain {args.model}: building LLM at gpu_memory_utilization={args.util}")
    t0 = time.perf_counter()
    llm = LLM(model=out["path"], gpu_memory_utilization=args.util, seed=0,
              enforce_eager=not has_cuda())
    out["startup_s"] = round(time.perf_counter() - t0, 2)
    tok = llm.get_tokenizer()
    prompts = random_prompts(args.prompts, args.prompt_len, getattr(tok, "vocab_size", 1000))

    def gen(ps, tokens):
        outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                            SamplingParams(max_tokens=tokens, ignore_eos=True), use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    out["throughput"] = time_generation(gen, prompts, args.tokens, args.repeats)
    log(f"plain: {out['throughput']['median_tok_per_s']:.0f} tok/s")
    out["memory"] = nvml()
    return out


def merge(args) -> dict:
    parts = {}
    for p in args.parts:
        path = Path(p)
        if not path.exists():
            continue
        rec = json.loads(path.read_text())
        rc_file = path.with_suffix(".rc")
        if rc_file.exists():
            rec["exit_code"] = int(rc_file.read_text().strip() or -1)
            # vLLM #16993: a segfault at exit shows as 139 (shell) or -11 (signal)
            rec["clean_exit"] = rec["exit_code"] == 0
        parts[f"{rec['model']}/{rec['mode']}"] = rec
    summary = {}
    for name in sorted({k.split("/")[0] for k in parts}):
        c, p = parts.get(f"{name}/colocate"), parts.get(f"{name}/plain")
        s: dict = {}
        if c and p and "throughput" in c and "throughput" in p:
            s["colocate_tok_per_s"] = c["throughput"]["median_tok_per_s"]
            s["plain_tok_per_s"] = p["throughput"]["median_tok_per_s"]
            s["throughput_ratio"] = round(s["colocate_tok_per_s"] / s["plain_tok_per_s"], 3)
            s["throughput_goal_met"] = s["throughput_ratio"] >= GOALS["throughput_ratio_min"]
        if c and "level2" in c:
            s["switch_l2_median_s"] = c["level2"]["median_s"]
            s["switch_l1_median_s"] = c.get("level1", {}).get("median_s")
            s["self_check_passed"] = all(bool(c[k]["self_check"].get("passed")) for k in ("level2", "level1") if k in c)
            stages = {r["stage"]: r for r in reversed(c["level2"]["stages"])}  # first occurrence wins
            if "awake" in stages and "sleep_l2" in stages:
                s["sleep_l2_freed_gib"] = round(stages["awake"]["used_gib"] - stages["sleep_l2"]["used_gib"], 2)
            if name == "qwen2.5-1.5b" and "switch_s" in c["level2"]["median_s"]:
                s["switch_goal_met"] = c["level2"]["median_s"]["switch_s"] <= GOALS["switch_s_max_at_1.5b"]
        if c and "push_awake_s" in c:
            s["push_awake_median_s"] = statistics.median(c["push_awake_s"])
        if c and "zero3_push" in c:
            s["zero3_push"] = c["zero3_push"]
        if c and "clean_exit" in c:
            s["colocate_clean_exit"] = c["clean_exit"]
        summary[name] = s
    return {"benchmark": "colo_kit engine + sleep switch", "goals": GOALS, "reference": TRL_REFERENCE,
            "env": describe(), "summary": summary, "parts": parts}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["colocate", "plain", "merge", "build"])
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--util", type=float, default=None, help="gpu_memory_utilization (0.3 colocate, 0.9 plain)")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="switch steps timed per sleep level")
    ap.add_argument("--zero3-check", action="store_true", help="also push from a DeepSpeed ZeRO-3 engine (GPU)")
    ap.add_argument("--smoke", action="store_true", help="CPU check: tiny model, 8 prompts x 16 tokens")
    ap.add_argument("--out", default=None)
    ap.add_argument("parts", nargs="*", help="merge: the part JSON files")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.prompts, args.prompt_len, args.tokens, args.repeats, args.steps = "tiny", 8, 16, 16, 2, 2
    if args.util is None:
        args.util = 0.9 if args.mode == "plain" else 0.3
    if args.mode in ("colocate", "plain"):
        _PARTIAL["path"] = args.out
    if args.mode == "build":
        print(json.dumps(build(args)))
        return 0
    result = merge(args) if args.mode == "merge" else {"colocate": run_colocate, "plain": run_plain}[args.mode](args)
    if args.mode != "merge":
        result["env"] = describe()
        result["args"] = {k: v for k, v in vars(args).items() if k != "parts"}
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        log(f"wrote {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
