#!/usr/bin/env bash
# Builds .venv/ for one tier (cpu|gpu); called by `make venv`. Fails loudly, never hangs on an index.
set -euo pipefail
TIER=${1:?usage: make_venv.sh cpu|gpu}
PY=${PY:-python3}
VENV=${VENV:-.venv}
BIN=$VENV/bin
TORCH_CPU=2.13.0
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
start=$(date +%s)

# pip prints one warning per package for empty local index folders on some machines: hide those
# lines, keep pip's exit status.
pipq() { "$BIN/pip" "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; return "${PIPESTATUS[0]}"; }

# A fresh CPU-tier .venv takes ~4 GiB (the GPU tier's more) and pip unpacks wheels in the temporary
# folder: a disk that fills halfway through leaves a broken venv and pip's "[Errno 28] No space left on device".
# Say so before anything is written: each of the two folders must have VENV_NEED_GIB (default 6) free.
free_gib() { df -Pk "$1" 2>/dev/null | awk 'NR == 2 { printf "%.1f", $4 / 1048576 }'; }
if [ ! -x "$BIN/python" ]; then
  need=${VENV_NEED_GIB:-6}
  [[ $need =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "[colo_kit] VENV_NEED_GIB=$need is not a number of GiB: give one such as 6" >&2; exit 2; }
  for dir in "$(dirname "$VENV")" "${TMPDIR:-/tmp}"; do
    have=$(free_gib "$dir")
    if [ -n "$have" ] && awk -v h="$have" -v n="$need" 'BEGIN { exit !(h < n) }'; then
      echo "[colo_kit] building $VENV needs at least $need GiB free; $(cd "$dir" && pwd) has $have GiB:" \
           "free some space there (or set TMPDIR or VENV to a disk with room) and run again" >&2
      exit 2
    fi
  done
fi

echo "[colo_kit] building $VENV for the $TIER tier"
[ -x "$BIN/python" ] || "$PY" -m venv "$VENV"
if [ "$TIER" = cpu ]; then
  # A CPU wheel pip can already reach (a local wheel folder) wins; else the PyTorch CPU index,
  # with a short timeout so an unreachable index fails fast instead of hanging.
  if ! pipq install -q "torch==$TORCH_CPU+cpu"; then
    echo "[colo_kit] torch==$TORCH_CPU+cpu not found locally; trying $TORCH_CPU_INDEX"
    pipq install -q --timeout 30 --retries 1 --index-url "$TORCH_CPU_INDEX" "torch==$TORCH_CPU"
  fi
fi
pipq install -q -r "requirements/$TIER.txt"
pipq install -q --no-deps --no-build-isolation -e .
if [ "$TIER" = cpu ]; then
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds: beside a CPU torch they break
  # `from trl import GRPOTrainer` (operator torchvision::nms does not exist). The kit needs none.
  pipq uninstall -y -q torchvision torchaudio torchcodec
fi
"$BIN/python" -c "import torch, vllm, trl; from trl import GRPOTrainer; print('[colo_kit] torch', torch.__version__, '| vllm', vllm.__version__, '| trl', trl.__version__)"
"$BIN/python" -m ipykernel install --sys-prefix --name python3 >/dev/null
echo "[colo_kit] $VENV ready ($TIER tier) in $(( $(date +%s) - start )) s"
