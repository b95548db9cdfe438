#!/usr/bin/env bash
# Two machines on one host: the kit's multi-node launch lines (colo_kit.memory.recipes.node_commands), run for real with
# one CPU process per "machine", and the evidence written to results/runs/two_machines_cpu.json (the committed record
# changes only when named with --out results/two_machines_cpu.json, and only by a run that succeeded).
#
#     bash scripts/two_machines.sh                      # all parts: ddp, zero3, srun, cpu_flag (see the .py)
#     bash scripts/two_machines.sh --parts ddp,srun     # some of them
#
# About 2 minutes on 2 cores. The first run on a machine adds about 4: DeepSpeed, which the CPU tier does not
# carry, is installed into .cache/deepspeed-cpu (pip, the version of requirements/gpu.txt) and JIT-compiles its CPU
# ops (shm comm, CPU Adam) into ~/.cache/torch_extensions. Without network that part is recorded as "not run".
# Exit status: 0 when every part that ran succeeded.
source "$(dirname "$0")/_drive.sh" two_machines "$@"  # exec scripts/two_machines.py drive "$@"
