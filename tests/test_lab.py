"""`make lab` where labs run: the commands the Makefile gives the shell, run for real in a scratch folder on a free
port. JupyterLab serves a working copy of the notebooks (so a lab never dirties the tracked ones), answers its
API with the token given through the environment (never on a command line `ps` shows), and runs as root too
(containers), where JupyterLab refuses to start without --allow-root."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colo_kit.parallel.launch import free_port
from colo_kit.paths import REPO_ROOT


def _lab_script(**make_vars) -> str:
    """The shell lines `make lab` runs, with this interpreter's JupyterLab in place of the venv's."""
    out = subprocess.run(["make", "-n", "lab", *(f"{k}={v}" for k, v in make_vars.items())], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=30, check=True).stdout
    lines = [ln for ln in out.splitlines() if "notebooks/" in ln or "jupyter lab" in ln]
    return "\n".join(ln.replace(".venv/bin/python", sys.executable)
                     .replace(".venv/bin/jupyter lab", f"{sys.executable} -m jupyterlab") for ln in lines)


@pytest.fixture(scope="module")
def kernel_language_info() -> dict:
    """What the kernel reports about its language on connecting (its kernel_info reply), asked of a real kernel:
    one kernel for the module, as its reply is the same each time."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        return kc.kernel_info(reply=True, timeout=60)["content"]["language_info"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_lab_flags_follow_the_user_and_the_variables():
    script = _lab_script(LAB_IP="0.0.0.0", LAB_PORT="8123")
    assert "--ip=0.0.0.0" in script and "--port=8123" in script and " lab/" in script
    assert ("--allow-root" in script) is (os.geteuid() == 0)
    assert "token" not in script.split("jupyterlab", 1)[1].lower()  # the token goes through the environment


@pytest.mark.parametrize("lab_dir", ["notebooks", "lab-x/../../notebooks", "lab-a b", "lab-", "."])
def test_a_working_copy_outside_lab_names_is_refused_before_anything_is_deleted(tmp_path, lab_dir):
    """`make lab-reset LAB_DIR=...` deletes the folder's notebooks: anything but lab or lab-NAME is refused, one line,
    exit code 2, and the tracked notebooks stay."""
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "00_quickstart.ipynb").write_text("{}")
    proc = subprocess.run(["make", "-f", str(REPO_ROOT / "Makefile"), "lab-reset", f"LAB_DIR={lab_dir}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and f"LAB_DIR={lab_dir}: use lab or lab-NAME" in proc.stderr
    assert (tmp_path / "notebooks" / "00_quickstart.ipynb").read_text() == "{}"


def test_a_working_copy_under_a_lab_name_is_made_with_the_kernels_language_info(tmp_path, kernel_language_info):
    """`make lab-reset LAB_DIR=lab-alice`: a name the check above lets through gets its copies. (Run once here,
    not after each refused name: what it does does not depend on them.)"""
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "00_quickstart.ipynb").write_text("{}")
    ok = subprocess.run(["make", "-f", str(REPO_ROOT / "Makefile"), "lab-reset", "LAB_DIR=lab-alice",
                         f"BIN={Path(sys.executable).parent}"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    copy = json.loads((tmp_path / "lab-alice" / "00_quickstart.ipynb").read_text())
    assert copy == {"metadata": {"language_info": kernel_language_info}}
    assert " lab-alice/" in _lab_script(LAB_DIR="lab-alice")


@pytest.mark.slow
def test_make_lab_serves_a_working_copy_with_the_token_and_leaves_the_notebooks_alone(tmp_path, kernel_language_info):
    pytest.importorskip("jupyterlab", reason="JupyterLab is not installed in this environment")
    import httpx

    shutil.copytree(REPO_ROOT / "notebooks", tmp_path / "notebooks", ignore=shutil.ignore_patterns("src"))
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "00_quickstart.ipynb").write_text("{}")  # a learner's edited copy: kept, not replaced
    port, token = free_port(), "colo-kit-test-token"
    env = {**os.environ, "LAB_TOKEN": token, "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt"),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg")}
    proc = subprocess.Popen(["bash", "-c", _lab_script(LAB_PORT=port) + " --no-browser"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 90
        while time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/api/contents/", params={"token": token}, timeout=2)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("JupyterLab did not answer within 90 s")
        names = {item["name"] for item in r.json()["content"]}
        assert "00_quickstart.ipynb" in names and "06_async_lora_proxy.ipynb" in names
        assert httpx.get(f"http://127.0.0.1:{port}/api/contents/", timeout=5).status_code == 403  # no token
        assert (tmp_path / "lab" / "00_quickstart.ipynb").read_text() == "{}"
        copy, tracked = (json.loads((tmp_path / d / "06_async_lora_proxy.ipynb").read_text()) for d in ("lab", "notebooks"))
        # the copy is the notebook, with what this kernel will report about its language already in its metadata
        assert copy["metadata"].pop("language_info") == kernel_language_info != tracked["metadata"].pop("language_info")
        assert copy == tracked
        import psutil

        shell = psutil.Process(proc.pid)  # bash, or JupyterLab itself when bash exec'd its last command
        cmdlines = [" ".join(p.cmdline()) for p in [shell, *shell.children(recursive=True)]]
        assert any("jupyterlab" in c for c in cmdlines) and not any(token in c for c in cmdlines)  # `ps` shows none
    finally:
        import signal

        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
