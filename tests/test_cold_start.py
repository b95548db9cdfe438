"""A notebook's first Run All against its second (scripts/gpu/cold_start.py): per-cell seconds read from a notebook a
real kernel executed, a failed run keeping the cells it finished, and bad input in one line."""

import nbformat
import pytest
from conftest import load_script


def _script():
    return load_script("scripts/gpu/cold_start.py")


def _notebook(path, *sources):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


BUSY = "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < 0.6:\n    pass"


def test_each_cell_gets_the_seconds_its_kernel_spent_and_a_failed_run_keeps_the_cells_before_it(tmp_path):
    nb = _notebook(tmp_path / "nb.ipynb", "x = 1", BUSY, "raise ValueError('stop here')", "y = 2")
    rec = _script().run_once(nb, tmp_path / "out", timeout_s=120)
    assert rec["status"] == "failed" and "stop here" in rec["error_tail"]
    cells = {c["cell"]: c for c in rec["cells"]}
    assert cells[1]["first_line"] == "import time"
    assert 0.6 <= cells[1]["seconds"] < 10  # the busy loop's floor, measured by the kernel's own timestamps
    assert cells[0]["seconds"] < 0.6
    assert 3 not in cells  # never ran: the cell before it raised


def test_the_cells_most_slower_on_the_first_run_come_first():
    first = {"cells": [{"cell": 1, "first_line": "a", "seconds": 9.0}, {"cell": 2, "first_line": "b", "seconds": 50.0},
                       {"cell": 4, "first_line": "c", "seconds": 3.0}]}
    second = {"cells": [{"cell": 1, "first_line": "a", "seconds": 8.0}, {"cell": 2, "first_line": "b", "seconds": 20.0}]}
    gaps = _script().slowest_gaps(first, second, n=5)
    assert [(g["cell"], g["extra_seconds"], g["second_seconds"]) for g in gaps] == [(2, 30.0, 20.0), (1, 1.0, 8.0)]


@pytest.mark.parametrize("args,names", [(["--notebooks", "9"], "--notebooks '9'"), (["--notebooks", ","], "--notebooks"),
                                        (["--budget-s", "-5"], "--budget-s -5")])
def test_bad_input_gets_one_line_and_exit_2_and_writes_nothing(tmp_path, capsys, args, names):
    out = tmp_path / "r.json"
    assert _script().main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and names in err and "e.g." in err
    assert not out.exists()


def test_a_cut_run_takes_its_kernel_with_it(tmp_path):
    """A Run All cut by its time limit ends its whole tree: the kernel (in a session of its own) is gone too."""
    import psutil

    pidfile = tmp_path / "kernel.pid"
    nb = _notebook(tmp_path / "nb.ipynb", f"import os\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))",
                   "while True:\n    pass")
    rec = _script().run_once(nb, tmp_path / "out", timeout_s=20)
    assert rec["status"] == "cut at 20 s" and rec["peak_rss_gib"] > 0
    kernel = int(pidfile.read_text())
    try:
        alive = psutil.Process(kernel).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        alive = False
    assert not alive, f"the cut run's kernel {kernel} is still running"
