#!/usr/bin/env bash
# Issue 3 on 2x H200: the colocated engine's throughput (0.3 of a GPU) against plain vLLM (0.9),
# and the sleep switch cost per training step, for random-init Qwen2.5-1.5B (GPU 0) and 7B (GPU 1)
# side by side. Each model: a colocate run, then a plain run, each in its own process under a
# timeout, so one failure keeps the other parts. Whole script <= ~5 min.
#
#   source .gpu/env.sh && COLO_KIT_CACHE=/root/cache bash scripts/gpu/engine_bench.sh
#
# Writes results/engine_bench.json (and copies it plus the log to $OUT/).
# CPU check of the same code (writes results/runs/engine_bench_smoke.json, not evidence):
#   PYTHONPATH=. PY=.venv/bin/python bash scripts/gpu/engine_bench.sh --smoke
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="${PYTHONPATH:-.}:." HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
PY=${PY:-python3}
SMOKE=${1:-}
PARTS=$(mktemp -d "${TMPDIR:-/tmp}/engine_bench.XXXX")
LOG="$PARTS/engine_bench.log"
START=$(date +%s)
DEADLINE=$((START + ${ENGINE_BENCH_BUDGET_S:-285}))
mkdir -p results

left() { echo $((DEADLINE - $(date +%s))); }

# run_part NAME GPU MAX_S ARGS...: one process, its exit code kept beside its JSON.
run_part() {
  local name=$1 gpu=$2 max_s=$3; shift 3
  local t=$(left); [ "$t" -gt "$max_s" ] && t=$max_s
  if [ "$t" -lt 20 ]; then echo "== $name: skipped, no time left" | tee -a "$LOG"; return; fi
  echo "== $name on GPU $gpu (timeout ${t}s)" | tee -a "$LOG"
  CUDA_VISIBLE_DEVICES=$gpu timeout -k 10 "$t" $PY scripts/engine_bench.py "$@" --out "$PARTS/$name.json" \
    > >(sed -u "s/^/[$name] /" | tee -a "$LOG") 2>&1
  local rc=$?
  echo "$rc" > "$PARTS/$name.rc"
  echo "== $name exit code $rc ($(( $(date +%s) - START )) s since start)" | tee -a "$LOG"
}

if [ "$SMOKE" = "--smoke" ]; then
  run_part tiny_colocate "" 300 colocate --smoke
  run_part tiny_plain "" 300 plain --smoke
else
  nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv | tee -a "$LOG"
  ( run_part q15_colocate 0 170 colocate --model qwen2.5-1.5b --zero3-check
    run_part q15_plain 0 120 plain --model qwen2.5-1.5b ) &
  ( run_part q7_colocate 1 190 colocate --model qwen2.5-7b --repeats 2 --steps 3
    run_part q7_plain 1 120 plain --model qwen2.5-7b --repeats 2 ) &
  wait
fi

# A smoke run is not evidence: it goes to the ignored results/runs/, never results/engine_bench.json.
RESULT=results/engine_bench.json
if [ "$SMOKE" = "--smoke" ]; then RESULT=results/runs/engine_bench_smoke.json; mkdir -p results/runs; fi
$PY scripts/engine_bench.py merge "$PARTS"/*.json --out "$RESULT" 2>&1 | tail -3 | tee -a "$LOG"
RESULT=$RESULT $PY -c 'import json, os; print(json.dumps(json.load(open(os.environ["RESULT"]))["summary"], indent=1))' \
  | tee -a "$LOG"
echo "== total $(( $(date +%s) - START )) s" | tee -a "$LOG"
if [ -n "${OUT:-}" ]; then cp "$RESULT" "$LOG" "$OUT/"; fi
