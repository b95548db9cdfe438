"""`colo_kit.quiet()`: what a notebook's first cell promises, that vLLM's import-time chatter stays
out of the cells while its errors still show. Run in a fresh interpreter, as a kernel is."""

import importlib.util
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")


def _stderr(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300).stderr


def test_vllm_import_warnings_hidden_errors_kept():
    # A vLLM module's WARNING at import time (before vLLM has configured its logger) and an ERROR.
    code = ("import colo_kit; colo_kit.quiet()\n"
            "from vllm.logger import init_logger\n"
            "log = init_logger('vllm.some_module')\n"
            "log.warning('chatter-warning'); log.error('real-error')\n")
    err = _stderr(code)
    assert "chatter-warning" not in err
    assert "real-error" in err


def test_users_level_wins():
    err = _stderr("import os; os.environ['VLLM_LOGGING_LEVEL'] = 'WARNING'\n"
                  "import colo_kit; colo_kit.quiet()\n"
                  "from vllm.logger import init_logger\n"
                  "init_logger('vllm.some_module').warning('wanted-warning')\n")
    assert "wanted-warning" in err


@pytest.mark.parametrize("setup, where", [("", "stdout"),
                                          ("import logging; logging.basicConfig(level=logging.INFO)\n", "stderr")])
def test_the_kits_lines_are_said_once_where_the_process_wants_them(setup, where):
    """The kit logs instead of printing. With no logging set up (a notebook kernel, a script) its
    INFO lines come out on stdout as `[colo_kit.<module>] ...`; once the process sets up logging
    (a CLI's basicConfig, an application), they go there instead, never both."""
    code = setup + "import colo_kit, logging\nlogging.getLogger('colo_kit.data').info('using offline data/x')\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    said = {"stdout": proc.stdout, "stderr": proc.stderr}
    if where == "stdout":
        assert said["stdout"] == "[colo_kit.data] using offline data/x\n" and "using offline" not in said["stderr"]
    else:
        assert said["stderr"].count("using offline data/x") == 1 and "using offline" not in said["stdout"]
