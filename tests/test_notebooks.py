"""Every notebook is generated from its source and runs headless, top to bottom, on this machine."""

import subprocess
import sys
from pathlib import Path

import pytest

from colo_kit_cli.notebooks import NOTEBOOKS
from record.notebooks import SOURCES, notebook_text

SRCS = sorted(SOURCES.glob("[0-9][0-9]_*.py"))


def test_every_notebook_has_a_source():
    built = {p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")}
    assert built, "no notebooks found"
    assert built == {p.stem for p in SRCS}, "each notebooks/NN_*.ipynb must come from notebooks/src/NN_*.py"


@pytest.mark.parametrize("src", SRCS, ids=[p.stem for p in SRCS])
def test_notebook_is_built_from_source_without_outputs(src: Path):
    ipynb = NOTEBOOKS / (src.stem + ".ipynb")
    assert ipynb.read_text() == notebook_text(src), f"{ipynb.name} is stale: run `python -m record.notebooks`"


@pytest.mark.notebook
@pytest.mark.slow
@pytest.mark.parametrize("src", SRCS, ids=[p.stem for p in SRCS])
def test_notebook_executes(src: Path, tmp_path):
    # Executed from a fresh process, as `make demo` does: the pytest process has by now built vLLM
    # engines, process groups and forked launcher workers, and a notebook client driven from it was
    # seen to wait forever on a kernel that had finished (both sides idle).
    import os

    nb = NOTEBOOKS / (src.stem + ".ipynb")
    env = {k: v for k, v in os.environ.items() if k != "COLO_KIT_VLLM_EAGER"}  # the engines a learner gets
    proc = subprocess.run([sys.executable, "-m", "colo_kit", "run-notebooks", str(nb), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=1500, env=env)  # 2 attempts x 600 s wall
    assert proc.returncode == 0, f"{nb.name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    assert (tmp_path / nb.name).exists() and (tmp_path / (src.stem + ".html")).stat().st_size > 10_000


def test_notebook_sources_leave_hardware_to_the_cells_not_to_tags():
    # JupyterLab's Run All ignores cell tags: a cell that only works on a GPU must check for one itself
    for src in SRCS:
        assert 'tags=["gpu"]' not in src.read_text(), f"{src.name}: a gpu-tagged cell; guard it with colo_kit.env.Machine"


@pytest.mark.notebook
def test_the_runner_runs_every_cell_as_written_tags_included(tmp_path):
    import json

    import nbformat

    from colo_kit_cli.notebooks import execute

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('ran', 6 * 7)")])
    nb.cells[0].metadata["tags"] = ["gpu"]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nbformat.write(nb, tmp_path / "tagged.ipynb")
    execute(tmp_path / "tagged.ipynb", tmp_path / "out", timeout_s=120, html=False)
    cell = json.loads((tmp_path / "out" / "tagged.ipynb").read_text())["cells"][0]
    assert "".join(cell["source"]) == "print('ran', 6 * 7)" and "ran 42" in "".join(cell["outputs"][0]["text"])


def test_run_notebooks_and_demo_take_their_flags(tmp_path, monkeypatch):
    from colo_kit_cli import notebooks as notebook
    from colo_kit_cli import main
    from colo_kit.paths import runs_dir

    ran = []
    monkeypatch.setenv("COLO_KIT_RESULTS", str(tmp_path))  # demo's default folder is under it
    monkeypatch.setattr(notebook, "execute", lambda path, out: ran.append((path, out)) or {
        "notebook": path, "seconds": 0, "executed": "e", "html": "h"})
    first, second = NOTEBOOKS / "00_quickstart.ipynb", NOTEBOOKS / "01_ping_pong.ipynb"
    assert main(["run-notebooks", str(first), str(second), "--out", str(tmp_path)]) == 0
    assert main(["demo"]) == 0 and main(["demo", "--out", str(tmp_path / "demo")]) == 0
    assert ran == [(first, tmp_path), (second, tmp_path), (first, runs_dir() / "demo"), (first, tmp_path / "demo")]


def test_sources_are_read_as_jupytext_percent_format():
    from record.notebooks import parse_source

    text = ('# %% [markdown]\n# # Title\n#\n# prose\n\n# %% tags=["solution"]\n\nx = 1\n\n\n'
            '# %% Named cell\nprint(x)\n\n# %% [raw]\nraw text\n')
    assert parse_source(text) == [
        {"type": "markdown", "source": "# Title\n\nprose", "tags": []},
        {"type": "code", "source": "x = 1", "tags": ["solution"]},  # no blank line at either end
        {"type": "code", "source": "print(x)", "tags": []},
        {"type": "raw", "source": "raw text", "tags": []},
    ]


@pytest.mark.notebook
def test_the_kernel_gets_its_environment_without_this_process_losing_its_own(tmp_path, monkeypatch):
    # The kernel must not inherit a rank (see execute); the process that runs it keeps its variables
    # throughout, since its other threads may read os.environ while the notebook runs.
    import json
    import os
    import threading

    import nbformat

    from colo_kit_cli.notebooks import execute

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("COLO_KIT_PROBE", "kept")
    before = dict(os.environ)
    changes, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            try:
                now = dict(os.environ)
            except RuntimeError as exc:  # changed size while it was copied
                now = {"error": str(exc)}
            if now != before:
                changes.append(sorted(set(before.items()) ^ set(now.items()))[:4])
            stop.wait(0.005)

    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import os; print(os.environ.get('RANK'), os.environ.get('COLO_KIT_PROBE'))"),
        nbformat.v4.new_code_cell("print('done')")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "env.ipynb")
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        execute(tmp_path / "env.ipynb", tmp_path / "out", timeout_s=120, html=False)
    finally:
        stop.set()
        watcher.join()
    cells = json.loads((tmp_path / "out" / "env.ipynb").read_text())["cells"]
    assert "".join(cells[0]["outputs"][0]["text"]).strip() == "None kept"
    assert not changes, f"os.environ changed during the run: {changes[:3]}"
    assert dict(os.environ) == before


@pytest.mark.notebook
def test_a_notebook_past_its_wall_limit_is_retried_once_then_fails_and_its_kernel_is_gone(tmp_path, caplog):
    import json

    import nbformat

    from colo_kit_cli.notebooks import NotebookWallTimeout, execute

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import os; print(os.getpid())"),
                                         nbformat.v4.new_code_cell("import time; time.sleep(60)")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "sleepy.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(NotebookWallTimeout, match="wall limit of 8 s"):
        execute(path, tmp_path / "out", timeout_s=120, html=False, wall_s=8)
    assert "retrying once in a new kernel" in caplog.text
    # the second attempt's kernel printed its pid before it was cut off; it must not outlive us
    pid = int("".join(json.loads((tmp_path / "out" / "sleepy.ipynb").read_text())["cells"][0]["outputs"][0]["text"]))
    import os
    import time

    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"kernel {pid} still alive after the wall timeout")


def test_sliced_polls_keep_asking_until_a_message_or_the_deadline(monkeypatch):
    import asyncio
    import time
    from queue import Empty

    from colo_kit_cli import notebooks as notebook

    monkeypatch.setattr(notebook, "POLL_SLICE_S", 0.05)
    asked = []

    async def get_msg(timeout=None):  # stands in for a channel whose wake-up was lost twice
        asked.append(timeout)
        if len(asked) < 3:
            await asyncio.sleep(timeout)
            raise Empty
        return {"msg_type": "status"}

    get = notebook._sliced(get_msg)
    assert asyncio.run(get(timeout=None)) == {"msg_type": "status"}
    assert asked == [0.05, 0.05, 0.05]  # never one unbounded wait

    async def never(timeout=None):
        await asyncio.sleep(timeout)
        raise Empty

    t0 = time.monotonic()
    with pytest.raises(Empty):
        asyncio.run(notebook._sliced(never)(timeout=0.3))
    assert 0.25 < time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("src", SRCS, ids=[p.stem for p in SRCS])
def test_a_notebook_reads_within_its_slot(src: Path):
    # a 20-minute slot holds about 2,500 words of prose beside running the cells and the exercises
    import json

    nb = json.loads((NOTEBOOKS / (src.stem + ".ipynb")).read_text())
    words = sum(len("".join(c["source"]).split()) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert words <= 2500, f"{src.stem}: {words} words of markdown; a slot holds about 2,500"


# Phrases that give an exercise's answer away (not its listed options): none may stand anywhere above the exercise's
# check cell, in prose or code (the explanation belongs under the check, in its solution or after it).
GIVEAWAYS = {
    "00.prompts_per_step": ["whole groups", "2 × G"],
    "00.reward_value": ["highest (0)", "climbs towards 0", "-|target - len(text)|"],
    "01.two_gpus": ["about tie", "modes tie", "should about"],
    "01.eight_gpus": ["colocation wins", "colocate wins", "gen(7b) > gen(b)"],
    "02.max_num_seqs": ["× tp ×", "* tp *"],
    "03.tp_seed": ["one seed per TP group", "same seed inside", "drift apart"],
    "05.checker": ["`0.5` and", "are one answer", "compare values, not strings"],
    "06.slots": ["check_slots(5, 4)", "max_staleness + 2", "+ 2`"],
    "06.best_hit_rate": ["other seven reuse", "7/8"],
}


@pytest.mark.parametrize("key", sorted(GIVEAWAYS))
def test_no_answer_stands_above_its_question(key):
    from record.notebooks import parse_source

    src = next(SOURCES.glob(f"{key[:2]}_*.py"))
    above = []
    for cell in parse_source(src.read_text()):
        if f'lab.check("{key}"' in cell["source"]:
            break
        above.append(cell["source"])
    else:
        pytest.fail(f"{src.name}: no check cell for {key}")
    text = "\n".join(above)
    assert not [p for p in GIVEAWAYS[key] if p in text], f"{src.name}: {key}'s answer stands above its question"
