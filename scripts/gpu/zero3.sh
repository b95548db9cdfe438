#!/usr/bin/env bash
# ZeRO-3 + colocated vLLM + sleep level 2, on 2×H200. About 5 minutes.
#
# Run from the repo root after the GPU stack is sourced (`source .gpu/env.sh`; needs deepspeed 0.19.8):
#     bash scripts/gpu/zero3.sh
# 1. builds the random-init qwen2.5-7b folder (build-model) while DeepSpeed JIT-compiles its CPU Adam op;
# 2. `accelerate launch --config_file configs/accelerate/zero3_qwen2.5-7b_2gpu.yaml --num_processes 2
#     scripts/zero3_run.py`: TRL GRPOTrainer colocate + vllm_enable_sleep_mode + ZeRO-3 offload_optimizer cpu,
#     3 steps, NVML peak per GPU, step times, the planner's estimate beside them;
# 3. writes results/zero3_run.json (status "error" with the log tail if the run failed) and copies it to $OUT/.
# Overrides: MODEL=qwen2.5-1.5b GPUS=1 STEPS=3 BATCH=8 COMPLETION=128 UTIL=0.3 RUN_TIMEOUT=300
# Falls back to ZeRO-3 without optimizer offload if DeepSpeed's CPU Adam cannot be compiled (recorded in the JSON).
# The run writes its JSON after every step, so a timeout keeps the steps done (status "partial").
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
MODEL=${MODEL:-qwen2.5-7b}; GPUS=${GPUS:-2}; STEPS=${STEPS:-3}; BATCH=${BATCH:-8}
COMPLETION=${COMPLETION:-128}; UTIL=${UTIL:-0.3}; RUN_TIMEOUT=${RUN_TIMEOUT:-300}
OUT_DIR=${OUT:-results/runs/gpu_out}
JSON=results/zero3_run.json
LOG=results/runs/zero3_run.log
mkdir -p results/runs "$OUT_DIR"
log() { echo "[zero3.sh $(date +%T)] $*"; }

fail_json() {  # keep a record of what failed, so the JSON slot is never empty
  python3 - "$1" <<'EOF'
import json, sys, pathlib
log = pathlib.Path("results/runs/zero3_run.log")
tail = log.read_text(errors="replace")[-6000:] if log.exists() else ""
pathlib.Path("results/zero3_run.json").write_text(json.dumps(
    {"status": "error", "error": sys.argv[1], "log_tail": tail}, indent=1) + "\n")
EOF
}

T0=$(date +%s)
log "versions: $(python3 -c 'import deepspeed, trl, vllm, torch; print("deepspeed", deepspeed.__version__, "trl", trl.__version__, "vllm", vllm.__version__, "torch", torch.__version__)' 2>&1 | tail -1)"
if ! python3 -c "import deepspeed" 2>/dev/null; then
  fail_json "deepspeed is not importable: add deepspeed==0.19.8 to the carried stack"; cp "$JSON" "$OUT_DIR/"; exit 1
fi

CFG=configs/accelerate/zero3_${MODEL}_${GPUS}gpu.yaml
if [ ! -f "$CFG" ]; then
  log "writing $CFG with the planner"
  python3 -m colo_kit plan --model "$MODEL" --gpus "$GPUS" --zero-stage 3 --offload-optimizer --sleep-level 2 \
    --write-configs >/dev/null
fi

log "building $MODEL (random weights) and compiling DeepSpeed's CPU Adam in parallel"
( OMP_NUM_THREADS=12 python3 -m colo_kit build-model "$MODEL" > results/runs/zero3_build.log 2>&1 ) &
BUILD=$!
EXTRA_ARGS=()
if python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" > results/runs/zero3_cpuadam.log 2>&1; then
  log "CPU Adam ready after $(( $(date +%s) - T0 )) s"
else
  # Without DeepSpeed's CPU Adam (needs ninja + nvcc) the optimizer cannot be offloaded; 7B still fits on
  # 2×H200 with ZeRO-3 alone (the planner: ~12 bytes/param / 2 GPUs of optimizer state), so run that instead.
  log "CPU Adam did not build ($(tail -2 results/runs/zero3_cpuadam.log | tr '\n' ' ')); falling back to ZeRO-3 without offload"
  python3 -c "from colo_kit.memory.recipes import write_configs; write_configs('$MODEL', $GPUS, offload_optimizer=False, out='results/runs/cfg')"
  CFG=results/runs/cfg/accelerate/zero3_${MODEL}_${GPUS}gpu.yaml
  EXTRA_ARGS=(--no-offload)
fi
if ! wait $BUILD; then
  tail -20 results/runs/zero3_build.log
  fail_json "build-model $MODEL failed"; cp "$JSON" "$OUT_DIR/"; exit 1
fi
log "model built after $(( $(date +%s) - T0 )) s"

rm -f "$JSON"
log "accelerate launch ($GPUS processes, timeout ${RUN_TIMEOUT}s)"
timeout --kill-after=20 "$RUN_TIMEOUT" python3 -m accelerate.commands.launch --config_file "$CFG" --num_processes "$GPUS" \
  scripts/zero3_run.py --model "$MODEL" --steps "$STEPS" --per-device-train-batch-size "$BATCH" \
  --max-completion-length "$COMPLETION" --vllm-gpu-memory-utilization "$UTIL" ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"} 2>&1 | tee "$LOG" | grep --line-buffered -E "\[zero3|Error|error:|Traceback|OutOfMemory|it/s\]" | cut -c1-300
RC=${PIPESTATUS[0]}
if [ ! -s "$JSON" ]; then
  fail_json "the run exited with code $RC before writing its JSON (124 = timeout)"
fi
cp "$JSON" "$OUT_DIR/"
log "done in $(( $(date +%s) - T0 )) s (exit $RC); $JSON copied to $OUT_DIR/"
python3 -c "import json; d=json.load(open('$JSON')); print({k: d.get(k) for k in ('status','error','nvml_peak_gib_per_gpu','planner_error','step_times_s')})"
