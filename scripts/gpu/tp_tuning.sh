#!/usr/bin/env bash
# Issue 5 on 2x H200: tensor parallelism for colocated vLLM, TP 1 vs TP 2, for random-weight
# Qwen2.5-1.5B and 7B (post 1, experiments 2 and 4: TP hurts 1.5B, helps 7B up to 1.73x).
#   1. generation only: 256 prompts x 256 tokens over 2 processes (external_launcher engines),
#      TP 1 (two engines, one per GPU) vs TP 2 (one engine over both GPUs);
#   2. TRL colocate GRPO, 4 steps, vllm_tensor_parallel_size 1 vs 2, 7B first, then 1.5B, while
#      time is left.
# Every part is its own process under a timeout (one failure keeps the others' JSON); each part
# forks its 2 GPU workers through colo_kit.parallel.launch (torch's elastic_launch, forked), so this run
# also checks the notebook path on GPUs. vLLM runs eager by default (TP_EAGER=1): an engine start
# is ~20-40 s instead of 50-90 s with torch.compile + CUDA graphs. TP_EAGER=0 for compiled engines.
#
#   source .gpu/env.sh && COLO_KIT_CACHE=/root/cache bash scripts/gpu/tp_tuning.sh          (~5-6 min)
#   ... TP_PARTS=grpo TP_BUDGET_S=500 bash scripts/gpu/tp_tuning.sh   (GRPO parts only, over the committed JSON)
#
# Writes results/tp_gpu.json and copies it and the log to $OUT/.
# CPU check of the same code (tiny model, 2 gloo processes; writes results/runs/tp_smoke.json):
#   PY=.venv/bin/python bash scripts/gpu/tp_tuning.sh --smoke
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="${PYTHONPATH:-.}:." HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
PY=${PY:-python3}
SMOKE=${1:-}
PARTS=$(mktemp -d "${TMPDIR:-/tmp}/tp_tuning.XXXX")
LOG="$PARTS/tp_tuning.log"
START=$(date +%s)
DEADLINE=$((START + ${TP_BUDGET_S:-345}))
mkdir -p results

left() { echo $((DEADLINE - $(date +%s))); }

# part NAME MAX_S ARGS...: one process under a timeout; its JSON is kept even if a later part fails.
part() {
  local name=$1 max_s=$2; shift 2
  local t=$(left); [ "$t" -gt "$max_s" ] && t=$max_s
  if [ "$t" -lt 30 ]; then echo "== $name: skipped, no time left" | tee -a "$LOG"; return; fi
  echo "== $name (timeout ${t}s, $(( $(date +%s) - START )) s since start)" | tee -a "$LOG"
  timeout -k 15 "$t" $PY scripts/tp_tuning.py "$@" > >(sed -u "s/^/[$name] /" | tee -a "$LOG") 2>&1
  echo "== $name exit code $? ($(( $(date +%s) - START )) s since start)" | tee -a "$LOG"
}

if [ "$SMOKE" = "--smoke" ]; then
  part build 120 build --smoke
  part gen_tiny_tp1 200 gen --smoke --model tiny --tp 1 --out "$PARTS/gen_tiny_tp1.json"
  part gen_tiny_tp2 200 gen --smoke --model tiny --tp 2 --out "$PARTS/gen_tiny_tp2.json"
  part grpo_tiny_tp2 200 grpo --smoke --model tiny --tp 2 --out "$PARTS/grpo_tiny_tp2.json"
else
  nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv | tee -a "$LOG"
  # Both models built at once, one per GPU (random init on the GPU, then saved as bf16 safetensors).
  ( export CUDA_VISIBLE_DEVICES=0; part build_1.5b 120 build --model qwen2.5-1.5b ) &
  ( export CUDA_VISIBLE_DEVICES=1; part build_7b 150 build --model qwen2.5-7b ) &
  wait
  case " ${TP_PARTS:-gen grpo} " in *" gen "*)
  for m in qwen2.5-1.5b qwen2.5-7b; do
    for t in 1 2; do
      part "gen_${m}_tp$t" 90 gen --model "$m" --tp "$t" --out "$PARTS/gen_${m}_tp$t.json"
    done
  done ;; esac
  for m in qwen2.5-7b qwen2.5-1.5b; do
    for t in 1 2; do
      part "grpo_${m}_tp$t" 150 grpo --model "$m" --tp "$t" --out "$PARTS/grpo_${m}_tp$t.json"
    done
  done
fi

RESULT=results/tp_gpu.json
SMOKE_FLAG=""
if [ "$SMOKE" = "--smoke" ]; then RESULT=results/runs/tp_smoke.json; SMOKE_FLAG=--smoke; mkdir -p results/runs; fi
BASE=""  # TP_PARTS=grpo: keep the committed generation results, replace the GRPO ones
if [ "${TP_PARTS:-gen grpo}" = "grpo" ] && [ -z "$SMOKE" ]; then BASE="--base $RESULT --drop-base-errors-for grpo"; fi
$PY scripts/tp_tuning.py merge "$PARTS"/*.json --out "$RESULT" $SMOKE_FLAG $BASE 2>&1 | tail -3 | tee -a "$LOG"
echo "== total $(( $(date +%s) - START )) s" | tee -a "$LOG"
if [ -n "${OUT:-}" ]; then cp "$RESULT" "$LOG" "$OUT/"; fi
