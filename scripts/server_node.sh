#!/usr/bin/env bash
# A separate vLLM node on one host: TRL's server mode with the vLLM server as one "node" (its own process group, its
# own port on 127.0.0.1) and the trainer as another (the generated `accelerate launch --num_machines 1` line), the
# host, ports and weight-sync group port taken from colo_kit.recipes.server_node_commands. The kit's HTTP weight
# sync stands in for NCCL (none on a CPU). Writes results/server_node_cpu.json.
#
#     bash scripts/server_node.sh                  # 2 GRPO steps
#     bash scripts/server_node.sh --steps 3 --out /tmp/server_node.json
#
# About 2 minutes on 2 cores (the server's start-up is most of it). Exit status: 0 when both nodes did their part.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
exec "$PYTHON" scripts/server_node.py drive "$@"
