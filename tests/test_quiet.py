"""`colo_kit.quiet()`: what a notebook's first cell promises, that vLLM's import-time chatter stays
out of the cells while its errors still show. Run in a fresh interpreter, as a kernel is."""

import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")


def _shown(code: str) -> str:
    """What the process printed, both streams: a cell shows both, and where vLLM's lines go depends on its
    version (vLLM 0.26 configures its logger on import, to stdout; the CPU build's 0.31 only when an engine's
    config is built, so before that the kit's handler writes to stderr)."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return proc.stdout + proc.stderr


def test_vllm_import_warnings_hidden_errors_kept():
    # A vLLM module's WARNING at import time (before vLLM has configured its logger) and an ERROR.
    code = ("import colo_kit; colo_kit.quiet()\n"
            "from vllm.logger import init_logger\n"
            "log = init_logger('vllm.some_module')\n"
            "log.warning('chatter-warning'); log.error('real-error')\n")
    err = _shown(code)
    assert "chatter-warning" not in err
    assert "real-error" in err


def test_users_level_wins():
    err = _shown("import os; os.environ['VLLM_LOGGING_LEVEL'] = 'WARNING'\n"
                  "import colo_kit; colo_kit.quiet()\n"
                  "from vllm.logger import init_logger\n"
                  "init_logger('vllm.some_module').warning('wanted-warning')\n")
    assert "wanted-warning" in err


@pytest.mark.parametrize("quiet", [True, False])
def test_a_shared_memory_block_left_at_exit_is_removed_without_a_warning_in_a_quiet_process(quiet):
    """The resource tracker removes a block a process leaves behind and warns on stderr (seen under notebook 03's
    TP 2 cell); `quiet()` hides that warning, and only in its processes: without it the warning shows."""
    code = ("import colo_kit; colo_kit.quiet()\n" if quiet else "") + (
        "from multiprocessing import shared_memory\n"
        "block = shared_memory.SharedMemory(create=True, size=64); block.close()  # left, not unlinked\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("leaked shared_memory" in proc.stderr) is not quiet, proc.stderr[-2000:]


@pytest.mark.parametrize("setup, where", [("", "stdout"),
                                          ("import logging; logging.basicConfig(level=logging.INFO)\n", "stderr")])
def test_the_kits_lines_are_said_once_where_the_process_wants_them(setup, where):
    """The kit logs instead of printing. With no logging set up (a notebook kernel, a script) its
    INFO lines come out on stdout as `[colo_kit.<module>] ...`; once the process sets up logging
    (a CLI's basicConfig, an application), they go there instead, never both."""
    code = setup + ("import colo_kit, logging\ncolo_kit.setup()\n"
                    "logging.getLogger('colo_kit.data').info('using offline data/x')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    said = {"stdout": proc.stdout, "stderr": proc.stderr}
    if where == "stdout":
        assert said["stdout"] == "[colo_kit.data] using offline data/x\n" and "using offline" not in said["stderr"]
    else:
        assert said["stderr"].count("using offline data/x") == 1 and "using offline" not in said["stdout"]


# The modules that import torch when imported: the colocated engine's, which hold and move torch tensors.
# Every other module imports torch (and vLLM) inside the functions that use them.
TORCH_AT_IMPORT = {"colo_kit.colocate.engine", "colo_kit.colocate.vllm_compat", "colo_kit_cli.engine_check"}


def test_importing_any_kit_module_has_no_side_effects():
    """Importing sets no environment variable, installs no log handler, initialises no NVML and imports no
    vLLM (and torch only for the modules in TORCH_AT_IMPORT): `colo_kit.setup()` (the CLI, a notebook's
    `colo_kit.quiet()`, the test suite, every engine build) sets the defaults, explicitly."""
    import json

    from colo_kit.paths import REPO_ROOT

    modules = sorted(".".join((package, *p.relative_to(REPO_ROOT / package).with_suffix("").parts)).removesuffix(".__init__")
                     for package in ("colo_kit", "colo_kit_cli") for p in (REPO_ROOT / package).rglob("*.py")
                     if p.stem != "__main__")
    assert TORCH_AT_IMPORT <= set(modules)
    light = [m for m in modules if m not in TORCH_AT_IMPORT]
    code = (
        "import json, os, sys, logging\n"
        "before = dict(os.environ)\n"
        "nvml_inits = []\n"
        "try:\n"  # a spy on NVML's init: pynvml is looked up when called, so every caller meets the spy
        "    import pynvml\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    for fn in ('nvmlInit', 'nvmlInitWithFlags'):\n"
        "        real = getattr(pynvml, fn)\n"
        "        setattr(pynvml, fn, lambda *a, _fn=fn, _real=real: (nvml_inits.append(_fn), _real(*a))[1])\n"
        "def imp(m):\n"
        "    __import__(m)\n"
        f"for m in {light!r}:\n"
        "    imp(m)\n"
        "torch_before = 'torch' in sys.modules\n"
        f"for m in {sorted(TORCH_AT_IMPORT)!r}:\n"
        "    imp(m)\n"
        "changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))\n"
        "print(json.dumps({'changed': changed, 'handlers': [type(h).__name__ for h in "
        "logging.getLogger('colo_kit').handlers], 'root_handlers': len(logging.getLogger().handlers), "
        "'nvml_inits': nvml_inits, 'torch_before': torch_before, "
        "'vllm': sorted(m for m in sys.modules if m.split('.')[0] == 'vllm')[:5]}))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "COLO_KIT_QUIET"))}
    for name in ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "PYTORCH_NVML_BASED_CUDA_CHECK", "WANDB_MODE"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env,
                          cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    # torch's own import sets nothing of ours; the kit's names are what setup() would have set
    ours = {"OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING",
            "VLLM_TARGET_DEVICE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK", "WANDB_DISABLED", "WANDB_MODE",
            "VLLM_USE_FLASHINFER_SAMPLER", "PYTORCH_NVML_BASED_CUDA_CHECK", "COLO_KIT_QUIET"}
    assert not ours & set(seen["changed"]), seen["changed"]
    assert seen["handlers"] == [] and seen["root_handlers"] == 0
    assert seen["nvml_inits"] == []
    assert seen["vllm"] == []
    assert not seen["torch_before"], f"a module outside {sorted(TORCH_AT_IMPORT)} imports torch when imported"


def test_setup_sets_the_defaults_once_and_keeps_what_the_user_set():
    code = ("import os\nos.environ['OMP_NUM_THREADS'] = '3'\nimport colo_kit\ncolo_kit.setup(); colo_kit.setup()\n"
            "import logging\nprint(os.environ['OMP_NUM_THREADS'], os.environ.get('TOKENIZERS_PARALLELISM'), "
            "len(logging.getLogger('colo_kit').handlers))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.stdout.split() == ["3", "false", "1"], out.stderr[-2000:]
