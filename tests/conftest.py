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
    # rank variables behind, after which the launcher rightly refuses to fork; so those run first. The notebooks
    # come next: under `make test`'s two workers (pytest-xdist, one file at a time each) the longest file then
    # starts at once on the second worker while the first runs everything else.
    first = ("tests/test_launch.py", "tests/test_notebooks.py")
    items.sort(key=lambda item: next((i for i, f in enumerate(first) if item.nodeid.startswith(f)), len(first)))
    gpus = gpu_count()
    for item in items:
        if "gpu" in item.keywords and not gpus:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU; the GPU evidence is committed under results/"))
        wanted = item.get_closest_marker("devices")
        if wanted and gpus and gpus < wanted.args[0]:
            # on a CPU "devices" are processes and any number runs; on a GPU node each needs a GPU
            item.add_marker(pytest.mark.skip(reason=f"needs {wanted.args[0]} GPUs, this machine has {gpus}"))


_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


@pytest.fixture(scope="module", autouse=True)
def _collect_after_module():
    """A module's shared engines and servers (module-scoped fixtures) are dropped after its last test: collect them
    before the next module builds its own."""
    yield
    gc.collect()


@pytest.fixture(autouse=True)
def _restore_environ(request):
    """Undo each test's changes to os.environ. TRL's colocate mode and the kit's engine write RANK,
    WORLD_SIZE and MASTER_PORT into the environment of the process that builds an engine; left in
    pytest's environment, every later subprocess (a notebook kernel, a script, torchrun) would try to
    bind the rendezvous port this process still holds (EADDRINUSE)."""
    before = dict(os.environ)
    handlers = {sig: signal.getsignal(sig) for sig in _SIGNALS}
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
    # vLLM's process-global groups) happens between tests. Only after the tests that start engines or trainers
    # (marked slow): a full collection costs 0.4-1 s once vLLM, torch and TRL are loaded, and twice per test it
    # was the largest cost of the suite.
    if request.node.get_closest_marker("slow"):
        gc.collect()
    # On a GPU, hand the collected engines' cached blocks back: vLLM and the servers tests start check
    # that their share of the GPU is free (seen on an H200: 12 of 140 GiB free after the bench tests).
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _collect_only_what_is_new():
    """Whatever is alive when a test starts is moved out of the collector's way (`gc.freeze()`, as vLLM's engine does
    at start-up): the collections `_restore_environ` runs after a slow test then look at the objects made since, not
    at everything torch, vLLM, TRL and earlier tests left (a full pass costs 0.4-3 s on 2 CPU cores). An engine a
    test builds and drops is still collected before the next test; what was alive when a test started and is
    dropped later (a module's fixtures, a cached engine) is collected when its module ends
    (`_collect_everything_at_module_end`). vLLM's own engine shutdown unfreezes everything (gc.unfreeze())."""
    gc.freeze()
    yield


@pytest.fixture(autouse=True, scope="module")
def _collect_everything_at_module_end():
    """After the module's own fixtures are torn down (an autouse fixture is set up before them, so torn down after
    them): everything frozen during the module back to the collector, one full collection, and what survived it
    frozen again, so that a collection after this one (`_collect_after_module`) does not pass over it all again."""
    yield
    gc.unfreeze()
    gc.collect()
    gc.freeze()



@pytest.fixture(autouse=True, scope="session")
def _unfreeze_at_session_end():
    """Nothing left frozen when the interpreter exits: its last collection then sees everything, as without the two
    fixtures above (frozen, triton's nanobind objects were reported as leaked at exit)."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def colocate_grpo_run(tmp_path_factory):
    """One real TRL colocate GRPO run on the tiny model (30 steps of 16 completions, 8 a prompt, 32 tokens, lr 5e-3,
    seed 0, vLLM in this process), recorded through the kit's `Timeline` hooked on its trainer: tests/test_train.py
    checks that it learns the length reward, tests/test_timeline.py that the timeline holds every phase of it (a run
    each cost a vLLM start and a trainer). The environment the run writes (RANK, MASTER_PORT) is put back."""
    import types

    from trl.extras.profiling import ProfilingContext

    from colo_kit.grpo.timeline import Timeline
    from colo_kit.grpo.train import run_grpo

    before = dict(os.environ)
    timeline = Timeline()
    try:
        run = run_grpo("tiny", "colocate", max_steps=30, num_generations=8, per_device_train_batch_size=16,
                       max_completion_length=32, learning_rate=5e-3, seed=0, output_dir=tmp_path_factory.mktemp("grpo"),
                       vllm_enforce_eager=True, on_trainer=timeline.hook)
    finally:
        timeline.unhook()
        os.environ.clear()
        os.environ.update(before)
    return types.SimpleNamespace(run=run, timeline=timeline, enter=ProfilingContext.__enter__.__qualname__)

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


class SharedLoraReplica:
    """One vLLM-CPU replica from the kit's LoRA recipe (`replica_launch`: max_staleness=1, so 3 adapter slots, rank 1,
    block 32, 512 tokens, asking for `key` on every path but /health), started once for the tests that need a real
    replica and nothing else of their own (tests/test_lora.py, tests/test_proxy.py): a vLLM start is most of what
    each of them cost. `reset()` gives a test the replica as a fresh one is: no adapter loaded, no cached block."""

    ENV = "COLO_KIT_TEST_SHARED_REPLICA_KEY"
    key = "k-shared-replica"

    def __init__(self, model_path: str, log_dir):
        self.model_path, self.log_dir, self.reps = model_path, log_dir, None
        self.starts = 0

    @property
    def urls(self) -> list[str]:
        return self.reps.urls

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"}

    def start(self) -> None:
        from colo_kit.async_lora.lora import replica_launch
        from colo_kit.async_lora.replicas import launch_replicas
        from colo_kit.parallel.launch import free_port

        with pytest.MonkeyPatch.context() as mp:  # the recipe reads the key from the variable it is named by
            mp.setenv(self.ENV, self.key)
            launch = replica_launch(self.model_path, port=free_port(), max_staleness=1, lora_rank=1, api_key_env=self.ENV,
                                    block_size=32, max_model_len=512, **gpu_share())
        self.starts += 1
        self.reps = launch_replicas([launch], self.log_dir / f"start{self.starts}")

    def alive(self) -> bool:
        return self.reps is not None and all(p.poll() is None for p in self.reps.procs)

    def reset(self) -> None:
        """Unload every adapter an earlier test loaded (`/v1/models` lists each with its base model as parent) and
        empty the prefix cache (the dev-mode endpoint TRL and notebook 06 call)."""
        import httpx

        if not self.alive():
            self.stop()
            self.start()
        url = self.urls[0]
        models = httpx.get(url + "/v1/models", headers=self.headers, timeout=60)
        models.raise_for_status()
        for card in models.json()["data"]:
            if card.get("parent"):
                httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": card["id"]}, headers=self.headers,
                           timeout=60).raise_for_status()
        httpx.post(url + "/reset_prefix_cache", headers=self.headers, timeout=60).raise_for_status()
        left = httpx.get(url + "/v1/models", headers=self.headers, timeout=60).json()["data"]
        assert [c["id"] for c in left if c.get("parent")] == [], left

    def stop(self) -> None:
        if self.reps is not None:
            self.reps.stop()
            self.reps = None


@pytest.fixture(scope="session")
def _shared_lora_replica(tiny_model_path, tmp_path_factory):
    shared = SharedLoraReplica(tiny_model_path, tmp_path_factory.mktemp("shared-lora-replica"))
    yield shared
    shared.stop()


@pytest.fixture
def lora_replica(_shared_lora_replica, request) -> SharedLoraReplica:
    """The shared LoRA replica (`SharedLoraReplica`), reset for this test; started on first use, and stopped after the
    last selected test that asks for it, so its memory is back before the tests after it. Under pytest-xdist (a
    worker may never run the other module's tests) and on a GPU (its share must not stay held through the notebooks
    between tests/test_lora.py and tests/test_proxy.py) that is the last one of this test's module."""
    _shared_lora_replica.reset()
    yield _shared_lora_replica
    users = [item for item in request.session.items if "lora_replica" in getattr(item, "fixturenames", ())]
    if os.environ.get("PYTEST_XDIST_WORKER") or gpu_count():
        users = [item for item in users if item.module is request.node.module]
    if users and request.node is users[-1]:
        _shared_lora_replica.stop()
