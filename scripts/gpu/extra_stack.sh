#!/usr/bin/env bash
# Builds a small add-on to the GPU stack of ../shared/gpu/stack.sh, as one file under ./.gpu/, ready to carry:
# - ruff 0.17.6 and JupyterLab 4.6.6 with what JupyterLab needs that neither that stack nor the device image carries.
#   Without them tests/test_lint.py::test_ruff_finds_nothing (no ruff) and tests/test_lab.py's `make lab` test (no
#   JupyterLab) skip on the GPU node.
# - Sphinx 9.0.4, myst-nb 1.4.0 and furo (what `make site` builds with). Without them tests/test_site.py errors there.
# - aiohttp 3.14.5 with its own dependencies at the versions it was tested with here. pyproject.toml asks for
#   aiohttp>=3.14.4 (the first to close a connection that never sends a request head); the device image's is older,
#   and tests/test_proxy_hardening.py's stalled-socket test fails on it. These seven are the one place the add-on
#   shadows packages of the image, on purpose.
# Usage (from the project root, on your own machine; needs PyPI; ~1 min):
#   bash scripts/gpu/extra_stack.sh        # -> .gpu/extra.tar.xz .gpu/extra.sha256
# then carry the two files to the device and, right after `bash .gpu/install.sh`, run scripts/gpu/install_extra.sh
# (its header and README.md say in which staging calls).
# Versions are .venv's (`.venv/bin/pip freeze`). The list is pip's own closure, not a guess:
#   pip install --dry-run --ignore-installed --target /tmp/x <the flags below> -c <.venv's freeze> \
#     --report r.json jupyterlab==4.6.6 ruff==0.17.6 sphinx==9.0.4 myst-nb==1.4.0 furo==2025.12.19 aiohttp==3.14.5
# less the wheels stack.sh carries (its PKGS and EXTRA) and less what the device image holds (httpx, httpcore,
# anyio, h11, idna, certifi, requests, urllib3, charset-normalizer, jinja2, markupsafe, packaging, psutil, pygments,
# python-dateutil, pyyaml, six, attrs, typing-extensions, tabulate, click, zipp: stack.sh's wheels need them and
# leave them to the image, and the device tool's package list of the image names them all).
# The wheels are installed with `pip install --target` and site/bin/ruff is kept: `python -m ruff` looks for
# its binary in <target>/bin beside the package (ruff/_find_ruff.py). JupyterLab's data files land in
# site/share/jupyter/lab (JUPYTERLAB_DIR=/root/site/share/jupyter/lab on the device: see README.md).
# Local check of the same mechanism on this machine's Python (any other PYVER, DEST away from .gpu/):
#   PYVER=3.11 DEST=/tmp/extra311 bash scripts/gpu/extra_stack.sh
set -euo pipefail
REPO=$(git rev-parse --show-toplevel)
PYVER=${PYVER:-3.12}
CACHE=${CACHE:-/tmp/colo-gpu-extra-cp${PYVER/./}}
DEST=${DEST:-$REPO/.gpu}
mkdir -p "$CACHE/wh" "$DEST"
if [ "$DEST" = "$REPO/.gpu" ]; then
  grep -qxF '/.gpu/' "$REPO/.git/info/exclude" 2>/dev/null || echo '/.gpu/' >> "$REPO/.git/info/exclude"
fi
cd "$CACHE"
PLAT="--python-version $PYVER --implementation cp --only-binary=:all:"
for n in 5 17 24 26 27 28 31; do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
PKGS="ruff==0.17.6 jupyterlab==4.6.6 jupyter-server==2.21.1 jupyterlab-server==2.28.1 jupyter-lsp==2.3.1
notebook-shim==0.2.4 jupyter-builder==1.3.0 jupyter-events==0.12.1 jupyter-server-terminals==0.5.4 terminado==0.18.1
argon2-cffi==25.1.0 argon2-cffi-bindings==26.2.0 async-lru==2.4.0 babel==2.19.0 json5==0.17.3 overrides==7.7.0
send2trash==2.2.0 websocket-client==1.9.2 arrow==1.4.0 tzdata==2026.6 fqdn==1.6.0 isoduration==20.11.0
jsonpointer==3.12 rfc3339-validator==0.1.4 rfc3986-validator==0.1.1 rfc3987-syntax==1.1.0 uri-template==1.3.0
webcolors==25.10.0
sphinx==9.0.4 myst-nb==1.4.0 furo==2025.12.19 myst-parser==5.2.0 jupyter-cache==1.0.1 sqlalchemy==2.1.9
docutils==0.22.4 alabaster==1.0.0 imagesize==2.0.1 snowballstemmer==3.1.1 roman-numerals==4.1.0
sphinxcontrib-applehelp==2.0.0 sphinxcontrib-devhelp==2.0.0 sphinxcontrib-htmlhelp==2.1.0 sphinxcontrib-jsmath==2.0.0
sphinxcontrib-qthelp==2.0.0 sphinxcontrib-serializinghtml==2.0.0 sphinx-basic-ng==1.0.0b2 accessible-pygments==0.0.5
importlib-metadata==10.2.0 lazy-importer==0.1.0
aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4
yarl==1.25.1"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps $PLAT -d wh $PKGS > download.log 2>&1 || { grep -v "is ignored" download.log; exit 1; }
rm -rf site
# By name from the cache, so a wheel left there by an older list is not installed.
# shellcheck disable=SC2086
python3 -m pip install -q --no-index --find-links wh --no-deps --no-compile --target site $PLAT $PKGS > install.log 2>&1 \
  || { grep -v "is ignored\|as the 'root' user" install.log; exit 1; }
# Keep bin/ruff; the console scripts beside it name this machine's interpreter and are of no use on the device.
find site/bin -mindepth 1 ! -name ruff -delete
test -x site/bin/ruff
# Slimmed from 30 MB to ~14 MB (xz), nothing that `jupyter lab` uses:
# share/jupyter/lab/static (the app directory's assets) is a byte-for-byte copy of jupyterlab/static: a link instead.
diff -rq site/jupyterlab/static site/share/jupyter/lab/static
rm -rf site/share/jupyter/lab/static && ln -s ../../../jupyterlab/static site/share/jupyter/lab/static
# jupyterlab/galata/@jupyterlab: the helper extension that only Galata's UI-test configuration loads (5.6 MB).
rm -rf site/jupyterlab/galata/@jupyterlab
# babel's data for every locale (6.4 MB): jupyterlab_server asks babel only about installed language packs and
# treats a locale it cannot find as unknown (English); root and English stay.
find site/babel/locale-data -name '*.dat' ! -name root.dat ! -name en.dat ! -name 'en_*.dat' -delete
tar -C site -cf extra.tar . && xz -T0 -6 -f extra.tar
cp extra.tar.xz "$DEST/extra.tar.xz"
sha256sum extra.tar.xz | cut -d' ' -f1 > "$DEST/extra.sha256"
echo "$(ls site | grep -c 'dist-info$') wheels, $(du -sh site | cut -f1) unpacked"
ls -la "$DEST"/extra.*
