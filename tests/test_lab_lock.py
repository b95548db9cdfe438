"""A second `make lab` on a working copy that a JupyterLab has open is refused in one line naming LAB_DIR=lab-NAME;
another working copy starts, and the copy is free again once its JupyterLab is gone, even killed. The shell lines
`make lab` runs, for real, with a process that holds the copy as JupyterLab would in place of JupyterLab."""

import os
import shutil
import signal
import subprocess
import sys

from test_lab import _lab_script
from test_proxy_hardening import _wait_for

from colo_kit.paths import REPO_ROOT

HOLD = f"{sys.executable} -c 'import sys, time; print(\"serving\", sys.argv[1:], flush=True); time.sleep(600)'"


def _lab(cwd, lab_dir: str) -> subprocess.Popen:
    script = _lab_script(LAB_DIR=lab_dir, LAB_PORT=8899).replace(f"{sys.executable} -m jupyterlab", HOLD)
    return subprocess.Popen(["bash", "-c", script], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _holder_group(lock) -> int | None:
    """The process group of the process the lock file names (bash may or may not exec its last command)."""
    try:
        return os.getpgid(int(lock.read_text().split(",")[0].removeprefix("pid ")))
    except (OSError, ValueError):
        return None


def test_a_second_lab_on_the_same_working_copy_is_refused(tmp_path):
    shutil.copytree(REPO_ROOT / "notebooks", tmp_path / "notebooks", ignore=shutil.ignore_patterns("src"))
    first = _lab(tmp_path, "lab")
    others = []
    try:
        lock = tmp_path / "lab" / ".lab.lock"
        _wait_for(lambda: lock.is_file() and lock.read_text().startswith("pid"), 60, "the first lab holding lab/")
        second = _lab(tmp_path, "lab")
        out, err = second.communicate(timeout=60)
        assert second.returncode == 2 and "serving" not in out, (out, err)
        (line,) = err.strip().splitlines()
        assert line.startswith("lab/ is open in another JupyterLab (pid ") and "--port=8899" in line
        assert "make lab LAB_DIR=lab-NAME" in line
        others.append(_lab(tmp_path, "lab-bob"))  # a working copy of its own starts
        _wait_for(lambda: (tmp_path / "lab-bob" / ".lab.lock").is_file() and
                  (tmp_path / "lab-bob" / ".lab.lock").read_text().startswith("pid"), 60, "lab-bob starting")
        assert others[0].poll() is None
        os.killpg(first.pid, signal.SIGKILL)  # no clean exit: the lock goes with the process
        first.wait(timeout=30)
        others.append(_lab(tmp_path, "lab"))
        _wait_for(lambda: others[1].poll() is None and _holder_group(lock) == others[1].pid, 60,
                  "lab/ taken again after its JupyterLab died")
    finally:
        for proc in [first, *others]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
