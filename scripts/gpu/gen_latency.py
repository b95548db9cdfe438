"""How long does one GRPO generation take in vLLM alone, and what sets it? (notebook 04, section 7)

At batch 8 a colocated step at 1.5B spends about 0.63 s of ~0.94 s in `vLLM.generate` (results/speed_1xh200.json):
8 completions of 256 tokens, 2.4 ms per decoding step. Reading 3 GB of weights once takes ~0.65 ms on an H200
(modelled from 4.8 TB/s), so most of a step is not the weights. This measures the same generation in an engine
that TRL 1.16's own `VLLMGeneration` constructor builds (`colo_kit.colocate.engine_build.build_trl_generation`: TRL's
`_init_vllm` makes the `LLM(...)` call, the variant's arguments on top), one process per variant:

    trl          TRL's arguments: max_num_seqs = the per-device batch (8), vLLM's default CUDA graphs and scheduling
    no_async     the same with async_scheduling=False (vLLM turns it on by default for this executor)
    eager        the same with enforce_eager=True: no CUDA graphs
    seqs64       max_num_seqs=64: batches of 8, 16, 32 and 64 in one engine (how the time grows with the batch)
    seqs128      max_num_seqs=128, what TRL sizes for the recipe below 7B (batch 16 x 8 steps per generation):
                 batches of 64 and 128, and 128 without logprobs (inside the trainer one generation of 128 took
                 2.1 s, 0.265 s per step: is that vLLM's, or the trainer's around it?)
    seqs128_len32k  seqs128 with max_model_len=32768, what the trainer's engine gets from TRL when
                 `vllm_max_model_length` is left at None (Qwen2.5's own limit); the others are sized for 64 + 256
    seqs256      max_num_seqs=256: batches of 128 and 256 (does a decoding step grow with the batch, so that a
                 bigger generation buys nothing per completion?)

Each timing is `llm.generate` of B prompts (64 random token ids each) for 256 tokens each (`ignore_eos`, so every
completion is full length), temperature 1, `logprobs=0` and `detokenize=False` as TRL asks, after two warm-ups.
`trl` also times logprobs off and detokenization on. Writes results/gen_latency_1xh200.json; `--variants` re-runs
only those, keeping the file's other variants, and each variant records the commit it ran at (the first four ran at
baa0b71, in the version before, which listed TRL's arguments by hand: the same values TRL passes, its `llm_args`,
which the constructor now supplies itself). On a CPU, `GEN_LATENCY_TOKENS=16 ... --model tiny` runs the
same code in about three minutes.

    source .gpu/env.sh && COLO_KIT_CACHE=/root/cache python scripts/gpu/gen_latency.py [--model qwen2.5-1.5b]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VARIANTS = {"trl": {}, "no_async": {"async_scheduling": False}, "eager": {"enforce_eager": True},
            "seqs64": {"max_num_seqs": 64}, "seqs128": {"max_num_seqs": 128}, "seqs256": {"max_num_seqs": 256},
            "seqs128_len32k": {"max_num_seqs": 128, "max_model_len": 32768}}
PROMPT_LEN, COMPLETION_LEN, REPS = 64, int(os.environ.get("GEN_LATENCY_TOKENS", 256)), 5


def one_variant(name: str, model: str) -> dict:
    """Build the engine of variant `name` in this process, by TRL's own `VLLMGeneration` constructor (so the
    `LLM(...)` arguments are TRL's, with only the variant's on top), and time its generations."""
    import torch
    from vllm import SamplingParams

    from colo_kit.colocate.engine_build import ColocateSettings, build_trl_generation
    from colo_kit.models import resolve_model

    os.environ.setdefault("MASTER_PORT", "29517")
    overrides = dict(VARIANTS[name])
    # TRL sizes max_num_seqs from the per-device batch (x TP x steps_per_generation): batch 8, or the variant's
    settings = ColocateSettings(per_device_train_batch_size=overrides.pop("max_num_seqs", 8), max_prompt_length=PROMPT_LEN,
                                max_completion_length=COMPLETION_LEN, vllm_gpu_memory_utilization=0.3)
    t = time.perf_counter()
    gen, _trl_args, built = build_trl_generation(resolve_model(model), settings, rank=0, local_rank=0, world_size=1,
                                                **overrides)
    startup_s = time.perf_counter() - t
    llm = gen.llm
    args = {k: v for k, v in built.items() if k != "model"}
    vocab = llm.get_tokenizer().vocab_size
    g = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # the CPU smoke run

    def timed(batch: int, **sampling) -> dict:
        prompts = [{"prompt_token_ids": torch.randint(0, vocab, (PROMPT_LEN,), generator=g).tolist()}
                   for _ in range(batch)]
        params = SamplingParams(max_tokens=COMPLETION_LEN, ignore_eos=True, temperature=1.0,
                                **{"logprobs": 0, "detokenize": False, **sampling})
        times = []
        for i in range(2 + REPS):
            sync()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            sync()
            if i >= 2:
                times.append(round(time.perf_counter() - t0, 4))
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        med = statistics.median(times)
        return {"batch": batch, "sampling": sampling, "seconds": times, "median_s": med, "tokens": tokens,
                "ms_per_decoding_step": round(1000 * med / COMPLETION_LEN, 3), "tok_per_s": round(tokens / med, 1)}

    runs = []
    if name == "seqs64":
        runs += [timed(b) for b in (8, 16, 32, 64)]
    elif name.startswith("seqs128"):
        runs += [timed(64), timed(128), timed(128, logprobs=None)]
    elif name == "seqs256":
        runs += [timed(128), timed(256)]
    else:
        runs.append(timed(8))
    if name == "trl":
        runs += [timed(8, logprobs=None), timed(8, detokenize=True)]
    from colo_kit.env import describe
    from record.store import commit

    return {"variant": name, "commit": commit(), "env": describe(), "llm_args": args, "overrides": VARIANTS[name],
            "startup_s": round(startup_s, 1),
            "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling),
            "cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode), "runs": runs}



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child: run one variant, print its JSON
    ap.add_argument("--out", default=str(ROOT / "results" / "gen_latency_1xh200.json"))
    a = ap.parse_args()
    import colo_kit

    colo_kit.setup()
    if a.one:
        print("RESULT " + json.dumps(one_variant(a.one, a.model)), flush=True)
        return 0
    from colo_kit.models import resolve_model

    resolve_model(a.model)  # build once, before the children time anything
    result = {"benchmark": "vLLM generation latency with TRL 1.16's colocate LLM arguments", "model": a.model,
              "prompt_len": PROMPT_LEN, "completion_len": COMPLETION_LEN, "reps": REPS, "variants": {}}
    out = Path(a.out)
    if out.exists():  # keep the variants not re-run, each with the commit and the machine it ran on
        old = json.loads(out.read_text())
        if (old.get("model"), old.get("completion_len")) == (a.model, COMPLETION_LEN):
            result["note"] = old.get("note")
            result["variants"].update(old.get("variants", {}))
    for name in a.variants.split(","):
        p = subprocess.run([sys.executable, __file__, "--one", name, "--model", a.model], capture_output=True, text=True)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        result["variants"][name] = json.loads(line[-1][7:]) if line else {"error": (p.stderr or p.stdout)[-1500:]}
        v = result["variants"][name]
        print(name, {k: v[k] for k in ("startup_s", "async_scheduling", "cudagraph_mode") if k in v},
              [(r["batch"], r["sampling"], r["median_s"], r["ms_per_decoding_step"]) for r in v.get("runs", [])]
              or v.get("error"), flush=True)
        out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
