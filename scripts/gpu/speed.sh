#!/usr/bin/env bash
# TRL's colocate defaults against the kit's chain of knobs (record.speed), one process per configuration
# and seed, on one GPU: the same model, prompts, completion length, G and learning rate; each configuration trains
# for SPEED_BUDGET_S seconds per seed. `recipe` is what `colo-kit plan --recommend` writes for the GPU it runs on.
# Writes results/speed_1x<gpu>.json, named after the GPU (speed_1xh200.json, speed_1xh100.json; merged into what is
# there, a configuration run again replacing its earlier records) and copies it and the log to $OUT/.
#
#   source .gpu/env.sh && COLO_KIT_CACHE=/root/cache COLO_KIT_COMMIT=<your tree's commit> bash scripts/gpu/speed.sh
# (COLO_KIT_COMMIT is read on this machine and passed in: git on the GPU machine names an older commit)
#   SPEED_CONFIGS="trl_defaults:0,1 recipe:0,1" SPEED_MODEL=qwen2.5-7b bash scripts/gpu/speed.sh   # bfloat16, no ZeRO
#   SPEED_STOP_PAST=1 ...   # a seed also stops once past the reward threshold: the same race in less device time
#
# CPU check of the same code with the tiny model (writes results/runs/speed_smoke.json, not evidence):
#   PY=.venv/bin/python bash scripts/gpu/speed.sh --smoke
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="${PYTHONPATH:-.}:." HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
PY=${PY:-python3}
SMOKE=${1:-}
MODEL=${SPEED_MODEL:-qwen2.5-1.5b}
BUDGET=${SPEED_BUDGET_S:-60}
# The whole list takes about four 560 s calls: split it with SPEED_CONFIGS (each call merges into the JSON).
CONFIGS=${SPEED_CONFIGS:-"trl_defaults:0,1 recipe:0,1 spg4:0,1 spg2:0,1 spg8:0,1 bucketed_push:0,1 batch32:0 no_grad_ckpt:0 no_detokenize:0 sleep_l2:0 sleep_kv:0"}
# the GPU's name as the result's: "NVIDIA H100 80GB HBM3" -> h100, "NVIDIA H200" -> h200
GPU_NAME=$( [ -n "$(command -v nvidia-smi)" ] && nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
GPU_TAG=$(echo "${GPU_NAME:-H200}" | tr 'A-Z' 'a-z' | grep -oE '[a-z]*[0-9]+[a-z0-9]*' | head -1)
RESULT=${SPEED_RESULT:-results/speed_1x${GPU_TAG:-h200}.json}
DEADLINE=$(( $(date +%s) + ${SPEED_DEADLINE_S:-560} ))
if [ "$SMOKE" = "--smoke" ]; then
  MODEL=tiny BUDGET=${SPEED_BUDGET_S:-6} RESULT=${SPEED_RESULT:-results/runs/speed_smoke.json} SMOKE_ARGS="--max-completion-length 32"
  CONFIGS=${SPEED_CONFIGS:-"trl_defaults:0,1 bucketed_push:0 spg8:0"}
fi
PARTS=$(mktemp -d "${TMPDIR:-/tmp}/speed.XXXX")
LOG="$PARTS/speed.log"
mkdir -p "$(dirname "$RESULT")"
[ -n "$(command -v nvidia-smi)" ] && nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv | tee -a "$LOG"
echo "== result: $RESULT (${GPU_NAME:-no GPU})" | tee -a "$LOG"

# One process per configuration and seed: a second seed in the process of the first found up to 18 GiB of the first
# one's training state still held (1.5B: 87.7 against 69.7 GiB NVML; 7B: out of memory), so every seed starts clean.
for item in $CONFIGS; do
  name=${item%%:*}
  for seed in $(echo "${item#*:}" | tr ',' ' '); do
    left=$(( DEADLINE - $(date +%s) ))
    need=$(( 40 + BUDGET + 10 ))  # a start (15-40 s once vLLM has its compile cache), the seed and its teardown
    if [ "$left" -lt "$need" ]; then echo "== $name seed $seed: skipped, ${left}s left of the call's budget" | tee -a "$LOG"; continue; fi
    echo "== $name seed $seed ($MODEL, ${BUDGET}s)" | tee -a "$LOG"
    timeout -k 10 "$left" $PY scripts/speed_bench.py run --config "$name" --model "$MODEL" --seeds "$seed" \
      --budget-s "$BUDGET" ${SPEED_LR:+--learning-rate $SPEED_LR} ${SPEED_STOP_PAST:+--stop-past-threshold} ${SMOKE_ARGS:-} --out "$PARTS/$name.s$seed.json" > >(sed -u "s/^/[$name $seed] /" | tee -a "$LOG") 2>&1
    echo "== $name seed $seed exit code $?" | tee -a "$LOG"
    [ -n "$(command -v nvidia-smi)" ] && nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tee -a "$LOG"
  done
done

INTO=""; [ "$SMOKE" != "--smoke" ] && INTO="--into $RESULT"
ls "$PARTS"/*.json >/dev/null 2>&1 && $PY scripts/speed_bench.py merge "$PARTS"/*.json --out "$RESULT" $INTO 2>&1 | tee -a "$LOG"
if [ -n "${OUT:-}" ]; then cp "$RESULT" "$LOG" "$OUT/" 2>/dev/null; cp "$PARTS"/*.json "$OUT/" 2>/dev/null; fi
