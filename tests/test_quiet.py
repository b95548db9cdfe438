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
