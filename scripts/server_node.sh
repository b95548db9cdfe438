#!/usr/bin/env bash
# A separate vLLM node on one host: TRL's server mode with the vLLM server as one "node" (its own process group, its
# own port on 127.0.0.1) and the trainer as another (the generated `accelerate launch --num_machines 1` line), the
# host, ports and weight-sync group port taken from colo_kit.memory.recipes.server_node_commands. The kit's HTTP weight
# sync stands in for NCCL (none on a CPU). Writes results/runs/server_node_cpu.json; the committed record changes only
# when named (`--out results/server_node_cpu.json`) and the run succeeded.
#
#     bash scripts/server_node.sh                  # 2 GRPO steps
#     bash scripts/server_node.sh --steps 3 --out /tmp/server_node.json
#
# About 2 minutes on 2 cores (the server's start-up is most of it). Exit status: 0 when both nodes did their part.
source "$(dirname "$0")/_drive.sh" server_node "$@"  # exec scripts/server_node.py drive "$@"
