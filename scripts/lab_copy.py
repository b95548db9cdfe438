"""`make lab`'s working copies of the notebooks, with the kernel's `language_info` in their metadata.

JupyterLab writes what the kernel says about its language (Python's version, lexer, file extension) into an open
notebook's metadata once the kernel has started. The tracked notebooks carry only the language's name, the same on
every machine, so each one turned "modified" a few seconds after it was opened, before the learner had done anything.
A working copy made here already holds what this environment's kernel will say, and opens unmodified.

    python scripts/lab_copy.py lab notebooks/*.ipynb            # the notebooks lab/ lacks (a learner's copy stays)
    python scripts/lab_copy.py --replace lab notebooks/*.ipynb  # fresh copies of all of them (make lab-reset)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def language_info() -> dict | None:
    """What this Python's ipykernel reports in its kernel_info reply; None without ipykernel (then a plain copy)."""
    try:
        from ipykernel.ipkernel import IPythonKernel
    except ImportError:
        return None
    return dict(IPythonKernel.language_info)


def copy(src: Path, dest_dir: Path, info: dict | None) -> Path:
    out = dest_dir / src.name
    nb = json.loads(src.read_text())
    if info is not None:
        nb.setdefault("metadata", {})["language_info"] = info
    out.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dest", type=Path, help="the working copy's folder (make lab: lab or lab-NAME)")
    ap.add_argument("notebooks", type=Path, nargs="+")
    ap.add_argument("--replace", action="store_true", help="copy every notebook, replacing the folder's own")
    a = ap.parse_args(argv)
    missing = [str(p) for p in a.notebooks if not p.is_file()]
    if missing:
        ap.error(f"{', '.join(missing)}: no such notebook; run from the kit's folder (make lab does)")
    a.dest.mkdir(parents=True, exist_ok=True)
    info = language_info()
    for src in a.notebooks:
        if a.replace or not (a.dest / src.name).exists():
            copy(src, a.dest, info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
