"""Shared fixtures. Importing colo_kit first sets the runtime defaults (OMP threads, vLLM CPU
KV-cache size, in-process engine) before any test imports torch or vLLM."""

import os

import pytest

import colo_kit  # noqa: F401  (applies env defaults)
from colo_kit.env import has_cuda


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from colo_kit.models import build_model

    return str(build_model("tiny"))


def pytest_collection_modifyitems(config, items):
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU; the GPU evidence is committed under results/")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
