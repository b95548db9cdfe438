"""Every notebook is generated from its source and runs headless, top to bottom, on this machine."""

from pathlib import Path

import pytest

from colo_kit.notebook import NOTEBOOKS, SOURCES, execute, notebook_text

SRCS = sorted(SOURCES.glob("[0-9][0-9]_*.py"))


def test_every_notebook_has_a_source():
    built = {p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")}
    assert built, "no notebooks found"
    assert built == {p.stem for p in SRCS}, "each notebooks/NN_*.ipynb must come from notebooks/src/NN_*.py"


@pytest.mark.parametrize("src", SRCS, ids=[p.stem for p in SRCS])
def test_notebook_is_built_from_source_without_outputs(src: Path):
    ipynb = NOTEBOOKS / (src.stem + ".ipynb")
    assert ipynb.read_text() == notebook_text(src), f"{ipynb.name} is stale: run `colo-kit run-notebooks --build-only`"


@pytest.mark.notebook
@pytest.mark.slow
@pytest.mark.parametrize("src", SRCS, ids=[p.stem for p in SRCS])
def test_notebook_executes(src: Path, tmp_path):
    result = execute(NOTEBOOKS / (src.stem + ".ipynb"), out_dir=tmp_path)
    assert Path(result["executed"]).exists() and Path(result["html"]).stat().st_size > 10_000
