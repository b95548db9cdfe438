#!/usr/bin/env bash
# Issue 4 on 2x H200 (vLLM 0.26, TRL 1.16): the ping-pong lab's GPU evidence.
#   stage 1  server mode: `trl vllm-serve`'s command on GPU 1, TRL GRPOTrainer on GPU 0 (NCCL weight
#            sync), per-device batch 64, 32, 8; then generation-only probes on the server at 7x
#            those batches (what one vLLM GPU feeding seven trainers would generate; the model needs it)
#   stage 2  colocate mode on both GPUs (accelerate launch --num_processes 2), same batches with
#            TRL's default colocate config (u=0.3, no sleep), plus the kit's best config at batch 64
#            (generation batched over 4 optimizer steps: same model, lengths and completions per step)
# Random-init Qwen2.5-1.5B, up to 256-token completions, G=8, 4 steps per
# config (the first discarded as warm-up). One vLLM engine start per stage and mode (engines are
# reused across configs, colo_kit.serving.bench.reuse_engines). Expected wall time ~8-9 min, at most
# ~575 s with the stage limits below: run it in a call of its own, after the stack is installed.
#
#   source .gpu/env.sh && COLO_KIT_CACHE=/root/cache bash scripts/gpu/pingpong.sh
#
# Writes results/pingpong_gpu.json (runs with per-step times and timelines, summary: raw and
# normalised ratios per batch, kit-best vs TRL default, the model's validation and 8-GPU
# projection) and copies it and the log to $OUT/.
# CPU check of the same code paths (worker subprocesses included; not evidence):
#   PY=.venv/bin/python bash scripts/gpu/pingpong.sh --smoke
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="${PYTHONPATH:-.}:." HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
PY=${PY:-python3}
PARTS=$(mktemp -d "${TMPDIR:-/tmp}/pingpong.XXXX")
LOG="$PARTS/pingpong.log"
START=$(date +%s)
mkdir -p results results/runs

if [ "${1:-}" = "--smoke" ]; then
  export COLO_KIT_BENCH_SUBPROCESS=1
  MODEL=tiny; BATCHES=8,4; G=4; LEN=32; STEPS=3; PROBE=16,32; FINAL=results/runs/pingpong_smoke.json
  S1=400; S2=300
else
  MODEL=qwen2.5-1.5b; BATCHES=64,32,8; G=8; LEN=256; STEPS=4; PROBE=448,224,56; FINAL=results/pingpong_gpu.json
  S1=250; S2=210  # the first H200 run: the server took 100 s to start, leaving too little of 190 s
fi
# tokens/s counts the completion lengths TRL logs (random weights rarely emit EOS: ~LEN each)
FIXED="--max-completion-length $LEN --num-generations $G --max-steps $STEPS --batches $BATCHES"

echo "== build $MODEL" | tee -a "$LOG"
$PY -m colo_kit build-model "$MODEL" 2>&1 | tail -1 | tee -a "$LOG"

echo "== stage 1: server mode (budget ${S1}s, $(( $(date +%s) - START )) s since start)" | tee -a "$LOG"
timeout -k 15 $((S1 + 40)) $PY -m colo_kit bench --model "$MODEL" $FIXED --modes server --server-gpus 1 \
  --gen-probe "$PROBE" --budget-s "$S1" --port 8011 --out "$PARTS/server.json" 2>&1 \
  | grep --line-buffered -v "Warning\|warn(" | sed -u 's/^/[server] /' | tee -a "$LOG" | grep --line-buffered "^\[server\] \[\|{\"per\|wrote\|Error\|error"
echo "== stage 1 done ($(( $(date +%s) - START )) s since start)" | tee -a "$LOG"

echo "== stage 2: colocate on 2 GPUs (budget ${S2}s)" | tee -a "$LOG"
timeout -k 15 $((S2 + 40)) $PY -m colo_kit bench --model "$MODEL" $FIXED --modes colocate \
  --extra-colocate '{"colocate-kit-best": {"steps_per_generation": 4}}' \
  --budget-s "$S2" --out "$PARTS/colocate.json" 2>&1 \
  | grep --line-buffered -v "Warning\|warn(" | sed -u 's/^/[colocate] /' | tee -a "$LOG" | grep --line-buffered "^\[colocate\] \[\|wrote\|Error\|error"
echo "== stage 2 done ($(( $(date +%s) - START )) s since start)" | tee -a "$LOG"

$PY -m record.pingpong_merge "$FINAL" "$PARTS/server.json" "$PARTS/colocate.json" 2>&1 | tee -a "$LOG"
echo "== total $(( $(date +%s) - START )) s; wrote $FINAL" | tee -a "$LOG"
if [ -n "${OUT:-}" ]; then cp "$FINAL" "$OUT/" 2>/dev/null; cp "$LOG" "$OUT/pingpong.log"; fi
