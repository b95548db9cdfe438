"""`make lab` where labs run: the command the Makefile gives JupyterLab, started for real on a free
port, answers its API with the token, as root too (containers), where JupyterLab refuses to start
without --allow-root."""

import os
import shlex
import subprocess
import sys
import time

import pytest

from colo_kit.launch import free_port
from colo_kit.paths import REPO_ROOT


def _lab_command(**make_vars) -> list[str]:
    out = subprocess.run(["make", "-n", "lab", *(f"{k}={v}" for k, v in make_vars.items())], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=30, check=True).stdout
    line = next(ln for ln in out.splitlines() if " lab notebooks/" in ln)
    argv = shlex.split(line)
    return [sys.executable, "-m", "jupyterlab", *argv[2:]]  # this interpreter's JupyterLab, the Makefile's flags


def test_lab_flags_follow_the_user_and_the_variables():
    argv = _lab_command(LAB_IP="0.0.0.0", LAB_PORT="8123", LAB_TOKEN="s3cret")
    assert "--ip=0.0.0.0" in argv and "--port=8123" in argv and "--IdentityProvider.token=s3cret" in argv
    assert ("--allow-root" in argv) is (os.geteuid() == 0)
    assert not any("token" in a for a in _lab_command())  # no token given: JupyterLab makes one and prints it


@pytest.mark.slow
def test_make_lab_serves_the_notebooks_with_the_token(tmp_path):
    pytest.importorskip("jupyterlab", reason="JupyterLab is not installed in this environment")
    import httpx

    port, token = free_port(), "colo-kit-test-token"
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path), "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg")}
    proc = subprocess.Popen(_lab_command(LAB_PORT=port, LAB_TOKEN=token) + ["--no-browser"], cwd=REPO_ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
    finally:
        proc.terminate()
        proc.wait(timeout=30)
