#!/usr/bin/env bash
# Issue 7 on 1 GPU: notebook 05 at GPU scale. GRPO with the length reward on a random-init
# Qwen2.5-0.5B in colocate mode and in plain mode (no vLLM) from the same seed (reward curves),
# then Math500-style evaluation (the kit's offline problem set, greedy, the training prompt) of
# base vs colocate-trained vs plain-trained on the colocate trainer's own vLLM engine, weights
# swapped in. Random weights: accuracy ~0 by construction; the evidence is the mechanics on
# vLLM 0.26 + CUDA (weight push, evaluation throughput) and the two reward curves.
# Then the checker benchmark (CPU-bound; this host's cores are less crowded than the dev box).
#
#   bash scripts/gpu/math500.sh                                   # on 1 GPU, stack sourced (~3-4 min)
#   PYTHON=.venv/bin/python bash scripts/gpu/math500.sh --smoke   # CPU dress rehearsal, tiny model
#   (MATH500_RESULT=… MATH500_CHECKER_RESULT=… write the two records elsewhere)
#
# Needs math-verify==0.9.0 in the stack (with latex2sympy2_extended, antlr4-python3-runtime, sympy).
# Writes results/math500_gpu.json and results/math500_checker_gpu_host.json, copies both to $OUT.
set -uo pipefail
PY=${PYTHON:-python3}
SMOKE=0
[[ "${1:-}" == "--smoke" ]] && SMOKE=1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
mkdir -p results results/runs
JSON=results/math500_gpu.json
BENCH=results/math500_checker_gpu_host.json
if [[ $SMOKE == 1 ]]; then JSON=results/runs/math500_smoke.json; BENCH=results/runs/math500_checker_smoke.json; fi
JSON=${MATH500_RESULT:-$JSON} BENCH=${MATH500_CHECKER_RESULT:-$BENCH}  # elsewhere, e.g. a test's own folder
t0=$(date +%s)

echo "[math500] 1/2 colocate vs plain GRPO + evaluation -> $JSON"
SMOKE=$SMOKE JSON=$JSON timeout 200 "$PY" - <<'EOF'
import os, time, traceback
import colo_kit
from colo_kit.env import describe
from record.store import commit, publish

smoke = os.environ["SMOKE"] == "1"
out_path = os.environ["JSON"]
out = {"what": "GRPO length reward colocate vs plain (same seed), then Math500-style evaluation of base / "
               "colocate-trained / plain-trained on one vLLM engine", "env": describe(), "smoke": smoke,
       "commit": commit(), "date": time.strftime("%Y-%m-%d"), "runs": {}, "eval": {}, "errors": {}}

def save():
    # whole or not at all; a run still going, or one with an error, goes to results/runs/ when a record is there
    done = set(out["runs"]) == {"colocate", "plain"} and len(out["eval"]) == 3 and not out["errors"]
    return publish(out_path, out, ok=done)

preset = "tiny" if smoke else "qwen2.5-0.5b"
steps = 6 if smoke else 30
common = dict(reward="length", target_length=20, max_steps=steps, num_generations=8, per_device_train_batch_size=16,
              max_completion_length=32, learning_rate=5e-3 if smoke else 1e-3, seed=0)
out["settings"] = {"model": preset, "random_weights": True, **common}
runs = {}
try:
    from colo_kit.models import build_model
    t = time.time(); build_model(preset); out["build_model_s"] = round(time.time() - t, 1)
    from colo_kit.grpo.train import run_grpo
    for mode in ("colocate", "plain"):
        try:
            t = time.time()
            run = run_grpo(preset, mode, **common)
            runs[mode] = run
            out["runs"][mode] = {"total_s": round(time.time() - t, 1), "train_s": run.elapsed_s,
                                 "reward": run.rewards, "steps": run.steps}
            print(f"[math500] {mode}: {len(run.steps)} steps in {run.elapsed_s} s, reward "
                  f"{run.rewards[0]:.1f} -> {run.rewards[-1]:.1f}", flush=True)
        except Exception:
            out["errors"][mode] = traceback.format_exc()[-3000:]
            print(f"[math500] {mode} failed:\n{out['errors'][mode]}", flush=True)
        save()
    if "colocate" in runs:
        from colo_kit.answers.math500_eval import compare_models
        models = {"base": preset, "colocate-trained": runs["colocate"].trainer.model}
        if "plain" in runs:
            models["plain-trained"] = runs["plain"].trainer.model
        engine = runs["colocate"].trainer.vllm_generation.llm
        for name, model in models.items():
            try:
                t = time.time()
                r = compare_models(engine, {name: model}, source="offline", limit=24 if smoke else 300,
                                   max_tokens=32 if smoke else 256)[name]
                r["wall_s"] = round(time.time() - t, 2)
                r["samples"] = r["samples"][:5]
                r.pop("env", None)
                out["eval"][name] = r
                print(f"[math500] eval {name}: {r['correct']}/{r['n']} (95% CI {r['ci95']}), generate "
                      f"{r['generate_s']} s, score {r['score_s']} s", flush=True)
            except Exception:
                out["errors"][f"eval {name}"] = traceback.format_exc()[-3000:]
                print(f"[math500] eval {name} failed:\n{out['errors'][f'eval {name}']}", flush=True)
            save()
except Exception:
    out["errors"]["setup"] = traceback.format_exc()[-3000:]
    print(out["errors"]["setup"], flush=True)
print(f"[math500] wrote {save()}", flush=True)
os._exit(0)  # skip vLLM's teardown at exit; everything is saved
EOF
echo "[math500] 1/2 done (rc=$?) after $(( $(date +%s) - t0 )) s"

echo "[math500] 2/2 checker benchmark on this host -> $BENCH"
timeout 80 "$PY" scripts/bench_checker.py --quick --out "$BENCH"
echo "[math500] 2/2 done (rc=$?) after $(( $(date +%s) - t0 )) s"

if [[ -n "${OUT:-}" ]]; then
  for f in "$JSON" "$BENCH"; do [[ -f $f ]] && cp "$f" "$OUT/"; done
fi
echo "[math500] all done in $(( $(date +%s) - t0 )) s"
