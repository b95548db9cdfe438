"""Shared fixtures. Importing colo_kit first sets the runtime defaults (OMP threads, vLLM CPU
KV-cache size, in-process engine) before any test imports torch or vLLM."""

import gc
import os
import signal

import pytest

import colo_kit
from colo_kit.env import gpu_count

colo_kit.setup()  # the runtime defaults, before any test imports torch or vLLM


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from colo_kit.models import build_model

    return str(build_model("tiny"))


def pytest_collection_modifyitems(config, items):
    # The launcher's tests check what it does in a pristine interpreter (fork through
    # notebook_launcher). Tests that start vLLM or a TRL trainer in-process leave a process group and
    # rank variables behind, after which the launcher rightly refuses to fork; so those run first.
    items.sort(key=lambda item: 0 if item.nodeid.startswith("tests/test_launch.py") else 1)
    gpus = gpu_count()
    for item in items:
        if "gpu" in item.keywords and not gpus:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU; the GPU evidence is committed under results/"))
        wanted = item.get_closest_marker("devices")
        if wanted and gpus and gpus < wanted.args[0]:
            # on a CPU "devices" are processes and any number runs; on a GPU node each needs a GPU
            item.add_marker(pytest.mark.skip(reason=f"needs {wanted.args[0]} GPUs, this machine has {gpus}"))


_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


@pytest.fixture(autouse=True)
def _restore_environ():
    """Undo each test's changes to os.environ. TRL's colocate mode and the kit's engine write RANK,
    WORLD_SIZE and MASTER_PORT into the environment of the process that builds an engine; left in
    pytest's environment, every later subprocess (a notebook kernel, a script, torchrun) would try to
    bind the rendezvous port this process still holds (EADDRINUSE)."""
    before = dict(os.environ)
    handlers = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    gc.collect()
    yield
    os.environ.clear()
    os.environ.update(before)
    # torch.distributed.elastic (under accelerate's notebook_launcher) installs SIGTERM/SIGINT/SIGHUP/
    # SIGQUIT handlers in the launching process and leaves them; a process forked later inherits
    # them, and a multiprocessing Pool's terminate() was seen to hang on a worker that survived SIGTERM.
    for sig, handler in handlers.items():
        if signal.getsignal(sig) is not handler and handler is not None:
            signal.signal(sig, handler)
    # Collect engines a test dropped before the next test builds one, so their teardown (which touches
    # vLLM's process-global groups) happens between tests. A precaution; the cause of the "pipeline
    # model parallel group is not initialized" seen here was a stale cached engine (tests/test_bench.py).
    gc.collect()
    # On a GPU, hand the collected engines' cached blocks back: vLLM and the servers tests start check
    # that their share of the GPU is free (seen on an H200: 12 of 140 GiB free after the bench tests).
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def load_script(relpath: str):
    """The module of a script under the repository, e.g. `load_script("scripts/gpu/kernel_kill.py")`: scripts are
    files, not a package, so the tests import them by path (each call runs the file afresh). The module is named
    after the file's stem."""
    import importlib.util

    from colo_kit.paths import REPO_ROOT

    path = REPO_ROOT / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpu_share() -> dict:
    """A tiny replica's `replica_launch` keywords: on a GPU a small share of GPU 0 (vLLM's default
    0.9 would not start beside an engine this process still holds); nothing on a CPU."""
    return {"gpu": 0, "gpu_memory_utilization": 0.15} if gpu_count() else {}


def clean_env() -> dict:
    """os.environ for a child process that starts its own group (colo_kit.parallel.launch.without_rank_vars).
    Module-scoped engine fixtures are set up before `_restore_environ` takes its snapshot, so the
    MASTER_PORT they write stays in pytest's environment while this process still holds that port."""
    from colo_kit.parallel.launch import without_rank_vars

    return without_rank_vars()


@pytest.fixture
def free_port() -> int:
    from colo_kit.parallel.launch import free_port

    return free_port()


if gpu_count():
    # GPU node: the suite's engines hold the tiny model, whose torch.compile + CUDA graphs would cost
    # 50-90 s per engine start for nothing (the one test that needs graphs turns this off in its script).
    os.environ.setdefault("COLO_KIT_VLLM_EAGER", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
