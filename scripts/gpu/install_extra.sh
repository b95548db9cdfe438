#!/usr/bin/env bash
# Runs ON THE DEVICE, from the project root, right after `bash .gpu/install.sh` (which empties /root/site and unpacks
# the main stack there). Checks the add-on that scripts/gpu/extra_stack.sh builds here (.gpu/extra.tar.xz and
# .gpu/extra.sha256) and unpacks it into /root/site: ruff (its binary in /root/site/bin), JupyterLab, Sphinx with
# myst-nb and furo, and aiohttp 3.14.5, so tests/test_lint.py::test_ruff_finds_nothing, tests/test_lab.py's `make lab`
# test, tests/test_site.py and the proxy's stalled-socket test run there as they do on a learner's machine.
# It reads the two files from .gpu/ when this call carries them, else from /root/stage/, where a call of their own
# copied them (beside .gpu/part02 a call would pass the 64 MiB it may carry):
#   earlier call:  mkdir -p /root/stage && cp .gpu/extra.tar.xz .gpu/extra.sha256 /root/stage/
#   part02 call:   bash .gpu/install.sh && bash scripts/gpu/install_extra.sh && source .gpu/env.sh ...
# SITE and FROM override /root/site and the folder the two files are read from.
set -euo pipefail
SITE=${SITE:-/root/site}
if [ -z "${FROM:-}" ]; then FROM=.gpu; [ -e .gpu/extra.tar.xz ] || FROM=/root/stage; fi
echo "$(cat "$FROM/extra.sha256")  $FROM/extra.tar.xz" | sha256sum -c --quiet \
  || { echo "$FROM/extra.tar.xz missing or stale: build it with scripts/gpu/extra_stack.sh and carry it"; exit 1; }
[ -d "$SITE" ] || { echo "$SITE does not exist: run bash .gpu/install.sh first"; exit 1; }
xz -dc -T0 "$FROM/extra.tar.xz" | tar -xf - -C "$SITE"
echo "ruff, JupyterLab, Sphinx and aiohttp 3.14.5 added to $SITE (from $FROM)"
