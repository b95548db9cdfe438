#!/usr/bin/env bash
# A GPU node's check: the whole test suite and every notebook as JupyterLab's Run All runs them, on this
# node's GPUs, recorded in results/gpu_check.json (hardware, versions, commit, each test's and notebook's
# status and seconds) with the executed notebooks as HTML in results/gpu_check/.
#
#   bash scripts/gpu/check.sh                 # both parts, one after the other
#   bash scripts/gpu/check.sh tests           # the suite only        (pytest args after --)
#   bash scripts/gpu/check.sh notebooks 01,03 # some notebooks only
#   PARALLEL=8 bash scripts/gpu/check.sh tests  # the slow tier (engines, training) in one pytest process, the
#                                              # other tests split by file over 7 more, beside it (16 cores)
#   RESUME=1 bash scripts/gpu/check.sh tests     # only the tests the record lacks for this package: the next call
#                                              # goes on where the last one's budget cut the suite
#   RESUME=1 bash scripts/gpu/check.sh notebooks # only the notebooks not yet completed with this package at their
#                                              # sources (with their HTML beside the record)
#   PER_FILE=0 bash scripts/gpu/check.sh tests   # the slow tier in one pytest process, not one per test file (the
#                                              # default: on one H200 the engines test_train's process kept starved
#                                              # the engines of the files after it)
#
# On a one-H200 machine whose calls are cut at 600 s (../shared/gpu/README.md) the notebooks take two calls and the
# tests three (PARALLEL=8, then RESUME=1 twice; the GPU lane alone runs ~20 min); keep JSON on the machine between them:
#   source .gpu/env.sh && COLO_KIT_COMMIT=<sha> bash scripts/gpu/check.sh tests
#   source .gpu/env.sh && COLO_KIT_COMMIT=<sha> bash scripts/gpu/check.sh notebooks
# The device tool carries the tree's committed results/gpu_check.json into every call, over the one the call before
# wrote: for RESUME to see the earlier calls, keep the record off the tree, e.g. JSON=/root/rec/gpu_check.json
# (merge its copy in $OUT/results/ as below).
# <sha> written out from your own clone: the device copy's .git can be older than the tree it carries (seen: it
# said the session's first commit while the tree was a later one), so `$(git rev-parse HEAD)` there can lie.
# A part re-run replaces only what it ran; every item keeps the commit it ran at. Copies the record
# and the HTML to $OUT when that is set (the device tool brings them back); fold it into the committed one with
#   python scripts/check.py merge --json results/gpu_check.json --from <files_at>/results/gpu_check.json --run S
# With 2 GPUs: JSON=results/gpu_check_2gpu.json bash scripts/gpu/check.sh
set -u
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
JSON=${JSON:-results/gpu_check.json}
BUDGET=${BUDGET:-560}
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export COLO_KIT_CACHE=${COLO_KIT_CACHE:-$HOME/.cache/colo_kit}
part=${1:-all}; shift || true
rc=0
if [ "$part" = all ] || [ "$part" = tests ]; then
  # --per-file: the GPU lane's files one pytest process each, so engines a file's tests keep die with it
  [ "${PER_FILE:-1}" = 0 ] && per_file= || per_file=--per-file
  # test_notebook_executes is the notebooks part's work (each notebook as Run All runs it, with its HTML): left out
  # here unless pytest args are given, or the suite would run every notebook twice (~17 min on one H200)
  [ $# = 0 ] && set -- -k "not test_notebook_executes"
  $PY scripts/check.py tests --json "$JSON" --budget-s "$BUDGET" ${PARALLEL:+--parallel "$PARALLEL"} $per_file \
    ${RESUME:+--resume} -- "$@" || rc=1
fi
if [ "$part" = all ] || [ "$part" = notebooks ]; then
  $PY scripts/check.py notebooks --json "$JSON" --budget-s "$BUDGET" --notebooks "${1:-}" ${RESUME:+--resume} || rc=1
fi
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT/results"
  cp -r "$JSON" "${JSON%.json}" "$OUT/results/" 2>/dev/null
fi
exit $rc
