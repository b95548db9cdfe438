"""The notebooks a learner opens, generated from their sources with the measured Run All times in each header
(`python -m record.notebooks`; `make numbers` runs it through `scripts/check.py refresh`).

`notebooks/NN_name.ipynb` comes from `notebooks/src/NN_name.py` in jupytext's "percent" format, so sources review and
diff like code; a test fails on a notebook older than its source.
"""

from __future__ import annotations

from pathlib import Path

from colo_kit_cli.notebooks import NOTEBOOKS
from colo_kit.paths import REPO_ROOT
from colo_kit.results import CHECKS, UNMEASURED, measured_runs
from record.store import write_text_atomic

SOURCES = NOTEBOOKS / "src"
# A source's header says `**Time** (Run All, measured): {{measured_times}}` and the build writes the times the
# committed check runs measured there: a typed time would go stale.
TIMES = "{{measured_times}}"


def parse_source(text: str) -> list[dict]:
    """Percent-format text, read by jupytext -> a list of {'type', 'source', 'tags'}, without the blank
    lines jupytext keeps right after a `# %%` marker (a notebook would open with an empty first line)."""
    import jupytext

    cells = []
    for cell in jupytext.reads(text, fmt="py:percent").cells:
        lines = cell.source.split("\n")
        while len(lines) > 1 and not lines[0].strip():
            lines.pop(0)
        cells.append({"type": cell.cell_type, "source": "\n".join(lines), "tags": list(cell.metadata.get("tags", []))})
    return cells


def minutes(rec: dict | None) -> str:
    return f"~{rec['seconds'] / 60:.1f} min" if rec else "not measured"


def measured_times(stem: str) -> str:
    """A notebook header's Run All times on each kind of machine, with the files they come from."""
    runs = measured_runs().get(stem, {})
    times = [f"{runs[t]['machine']} {minutes(runs[t])}" if t in runs else f"{UNMEASURED[t]}: not measured"
             for t in CHECKS]
    where = [f"`results/{name}`" for t, name in CHECKS.items() if t in runs]
    return " · ".join(times + ["8 GPUs: not measured"]) + (f" ({', '.join(where)})" if where else "")


def build_notebook(src: Path):
    import nbformat

    nb = nbformat.v4.new_notebook()
    # the kernelspec as JupyterLab writes it, so a notebook does not open as modified
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"},
                   "language_info": {"name": "python"},
                   "colo_kit": {"source": str(src.relative_to(REPO_ROOT))}}
    makers = {"code": nbformat.v4.new_code_cell, "markdown": nbformat.v4.new_markdown_cell, "raw": nbformat.v4.new_raw_cell}
    for i, c in enumerate(parse_source(src.read_text())):
        text = c["source"].replace(TIMES, measured_times(src.stem)) if TIMES in c["source"] else c["source"]
        cell = makers[c["type"]](text)
        cell.id = f"cell-{i:02d}"
        if c["tags"]:
            cell.metadata["tags"] = c["tags"]
        nb.cells.append(cell)
    return nb


def notebook_text(src: Path) -> str:
    import nbformat

    return nbformat.writes(build_notebook(src)) + "\n"


def build_all(only=()) -> list[Path]:
    """Every notebook (or those whose names start with one of `only`, e.g. "04") whose text differs from its
    source's, rewritten whole or not at all (a write cut by a full disk would leave a notebook that no longer opens)."""
    written = []
    for src in sorted(SOURCES.glob("[0-9][0-9]_*.py")):
        if only and not src.stem.startswith(tuple(only)):
            continue
        dst = NOTEBOOKS / (src.stem + ".ipynb")
        text = notebook_text(src)
        if not dst.exists() or dst.read_text(encoding="utf-8") != text:
            write_text_atomic(dst, text)
        written.append(dst)
    return written


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Build notebooks/NN_*.ipynb from notebooks/src/NN_*.py.")
    ap.add_argument("only", nargs="*", help="the notebooks to build, by number or name (default: all), e.g. 04")
    for path in build_all(ap.parse_args().only):
        print(f"built {path.relative_to(REPO_ROOT)}")
