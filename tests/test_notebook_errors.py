"""A notebook whose cell raises under `colo-kit run-notebooks`: one line naming the notebook, the cell and the error
(not nbclient's frames with their colour codes), exit code 1, and the executed copy kept to read. A real kernel."""

import nbformat

from colo_kit_cli import main


def test_a_failing_cell_is_one_line_and_the_executed_copy_is_kept(tmp_path, capsys):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# A lesson"),
                                         nbformat.v4.new_code_cell("x = 1"),
                                         nbformat.v4.new_code_cell("def f():\n    return 1 / 0\nf()"),
                                         nbformat.v4.new_code_cell("print('never')")])
    path = tmp_path / "99_broken.ipynb"
    nbformat.write(nb, path)
    assert main(["run-notebooks", str(path), "--out", str(tmp_path / "out")]) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "\x1b[" not in lines[0], captured.err
    executed = tmp_path / "out" / path.name
    assert lines[0] == (f"colo-kit run-notebooks: {path}: cell 3 raised ZeroDivisionError: division by zero "
                        f"(the executed copy: {executed})")
    outputs = nbformat.read(executed, as_version=4).cells[2].outputs
    assert outputs[0]["ename"] == "ZeroDivisionError"
