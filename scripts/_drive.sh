# The body of scripts/server_node.sh and scripts/two_machines.sh, sourced by them (not run on its own):
#
#     source "$(dirname "$0")/_drive.sh" NAME "$@"
#
# runs `scripts/NAME.py drive "$@"` from the repository root with the CPU runtime defaults, under .venv's python
# (or $PYTHON; python3 where neither is there). Its exit status is the script's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
_drive_script=scripts/$1.py
shift
exec "$PYTHON" "$_drive_script" drive "$@"
