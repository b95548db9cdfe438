"""Adapter-only sync for async GRPO (notebook 06): TRL's `AsyncGRPOTrainer` publishes the rank-1 LoRA to a shared folder
and POSTs its path to `/v1/load_lora_adapter`. Here: the slot arithmetic, the replica launch recipe, and a probe that
every replica serves the version."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from colo_kit.env import vllm_eager

LORA_NAME = "trl-policy"  # TRL 1.16: AsyncGRPOTrainer._lora_name
LORA_SUBDIR = ".vllm_lora"  # TRL 1.16: <output_dir>/.vllm_lora


def adapter_name(version: int) -> str:
    return f"{LORA_NAME}-v{version}"


def adapter_dir(output_dir: str | os.PathLike, version: int) -> Path:
    """Where TRL publishes version N; absolute, because the *server* resolves the path."""
    return Path(os.path.abspath(output_dir)) / LORA_SUBDIR / adapter_name(version)


def published_versions(output_dir: str | os.PathLike) -> list[int]:
    """Versions present in the shared directory (staging `.trl-policy-vN.tmp` folders excluded)."""
    root = Path(output_dir) / LORA_SUBDIR
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        if p.name.startswith(LORA_NAME + "-v") and (p / "adapter_config.json").exists():
            try:
                out.append(int(p.name.rsplit("-v", 1)[1]))
            except ValueError:
                pass
    return sorted(out)


def max_loras_for(max_staleness: int) -> int:
    """Adapter slots a replica needs: the current policy, `max_staleness` older ones, and one as a sync loads before unloading."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness={max_staleness}: must be >= 0 (TRL's default is 4)")
    return max_staleness + 2


def check_slots(max_loras: int, max_staleness: int) -> None:
    need = max_loras_for(max_staleness)
    if max_loras < need:
        raise ValueError(
            f"--max-loras {max_loras} is too few for max_staleness={max_staleness}: requests in flight can name "
            f"{max_staleness + 1} policy versions and each sync loads the next before unloading the oldest, so vLLM "
            f"needs {need} slots; with fewer it silently evicts a policy that still has rollouts in flight. Start "
            f"the replicas with --max-loras {need}, or lower max_staleness to {max_loras - 2}.")


def vllm_lora_ranks() -> tuple[int, ...]:
    """The `--max-lora-rank` values vLLM accepts (`vllm.config.lora.MaxLoRARanks`, else TRL's copy of the list)."""
    try:
        import typing

        from vllm.config.lora import MaxLoRARanks

        ranks = tuple(sorted(int(r) for r in typing.get_args(MaxLoRARanks)))
        if ranks:
            return ranks
    except Exception:
        pass
    from trl.experimental.async_grpo.async_grpo_trainer import VLLM_LORA_RANKS

    return tuple(VLLM_LORA_RANKS)


def max_lora_rank_for(adapter_rank: int) -> int:
    """Round a LoRA rank up to a `--max-lora-rank` vLLM accepts (a larger one only costs buffer memory)."""
    if adapter_rank < 1:
        raise ValueError(f"LoRA rank {adapter_rank}: must be >= 1 (the post uses 1)")
    for r in vllm_lora_ranks():
        if r >= adapter_rank:
            return r
    raise ValueError(f"LoRA rank {adapter_rank} is above the largest rank vLLM serves ({vllm_lora_ranks()[-1]}); "
                     "lower r, or sync merged weights")


def check_sleep_level(sleep_level: int | None, adapter_only: bool = True) -> None:
    """Refuse level-2 sleep with adapter-only sync, which never re-sends the base weights level 2 discards."""
    if sleep_level in (None, 0, 1):
        return
    if sleep_level != 2:
        raise ValueError(f"sleep_level={sleep_level}: vLLM knows levels 1 and 2")
    if adapter_only:
        raise ValueError("sleep_level=2 with adapter-only sync: level 2 discards the base weights and adapter sync "
                         "never re-sends them, so a woken replica would serve every adapter on an empty base model. "
                         "Use sleep_level=1 (weights kept in CPU memory), no sleep, or merged-weight sync.")


@dataclass
class ReplicaLaunch:
    """One replica's command line and environment (run it with `subprocess.Popen(argv, env=...)`)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    url: str = ""

    def shell(self) -> str:
        """The command line as a shell would run it; the API key shows as `***`."""
        import shlex

        return " ".join(f"{k}={shlex.quote(_shown(k, v))}" for k, v in self.env.items()) + " " + shlex.join(self.argv)

    def __repr__(self) -> str:
        env = {k: _shown(k, v) for k, v in self.env.items()}
        return f"ReplicaLaunch(argv={self.argv!r}, env={env!r}, url={self.url!r})"


def _shown(name: str, value: str) -> str:
    return "***" if "KEY" in name or "TOKEN" in name else value


def replica_launch(model: str, *, port: int, host: str = "127.0.0.1", max_staleness: int = 4, lora_rank: int = 1,
                   max_loras: int | None = None, api_key_env: str | None = None, block_size: int | None = None,
                   max_model_len: int | None = None, gpu: int | None = None, dtype: str | None = None,
                   gpu_memory_utilization: float | None = None, sleep_level: int | None = None,
                   enforce_eager: bool | None = None) -> ReplicaLaunch:
    """One vLLM replica serving `model` and runtime-loaded adapters; the API key goes in its environment, never its argv."""
    max_loras = max_loras_for(max_staleness) if max_loras is None else max_loras
    check_slots(max_loras, max_staleness)
    check_sleep_level(sleep_level, adapter_only=True)
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_SERVER_DEV_MODE": "1"}  # dev mode serves TRL's /pause, /resume
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    if api_key_env:
        key = os.environ.get(api_key_env, "")
        if not key:
            raise ValueError(f"api_key_env={api_key_env!r}: the variable is missing or empty; export it first")
        env["VLLM_API_KEY"] = key
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", host, "--port", str(port), "--enable-lora", "--max-loras", str(max_loras),
            "--max-lora-rank", str(max_lora_rank_for(lora_rank)), "--enable-prefix-caching",
            # TRL's VLLMClient.get_sequence_logprobs asks for top_logprobs=100; vLLM's default allows 20
            "--max-logprobs", "100"]
    if api_key_env:
        from colo_kit.async_lora.replica_auth import MIDDLEWARE

        argv += ["--middleware", MIDDLEWARE]
    if block_size:
        argv += ["--block-size", str(block_size)]
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    if dtype:
        argv += ["--dtype", dtype]
    if gpu_memory_utilization:
        argv += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if sleep_level:
        argv += ["--enable-sleep-mode"]
    if enforce_eager or (enforce_eager is None and gpu is not None and vllm_eager(False)):
        argv += ["--enforce-eager"]
    return ReplicaLaunch(argv=argv, env=env, url=f"http://{host}:{port}")


class AdapterMismatch(RuntimeError):
    pass


def probe_adapters(replica_urls: list[str], lora_name: str, lora_path: str | None = None, *,
                   token: str | None = None, generate: bool = True, timeout_s: float = 60.0) -> list[dict]:
    """Check every replica lists `lora_name` (from `lora_path`) and, with `generate`, completes with it; else AdapterMismatch."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    reports = []
    for url in replica_urls:
        rep = {"replica": url, "listed": False, "root": None, "generated": None, "ok": False, "error": None}
        try:
            r = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=timeout_s)
            r.raise_for_status()
            entry = next((m for m in r.json()["data"] if m["id"] == lora_name), None)
            rep["listed"] = entry is not None
            rep["root"] = entry and entry.get("root")
            rep["adapters"] = [m["id"] for m in r.json()["data"] if m.get("parent")]
            path_ok = entry is not None and (lora_path is None or
                                             os.path.abspath(entry.get("root") or "") == os.path.abspath(lora_path))
            if entry is not None and not path_ok:
                rep["error"] = f"serves {lora_name} from {entry.get('root')}, expected {lora_path}"
            if path_ok and generate:
                g = httpx.post(url.rstrip("/") + "/v1/completions", headers=headers, timeout=timeout_s,
                               json={"model": lora_name, "prompt": [1, 2, 3], "max_tokens": 1})
                rep["generated"] = g.status_code == 200 and g.json().get("model") == lora_name
                if not rep["generated"]:
                    rep["error"] = f"completion with model={lora_name}: HTTP {g.status_code} {g.text[:200]}"
            rep["ok"] = path_ok and (rep["generated"] is not False)
            if not rep["listed"]:
                rep["error"] = f"{lora_name} not loaded (loaded adapters: {rep['adapters']})"
        except Exception as exc:
            rep["error"] = f"{type(exc).__name__}: {exc}"[:300]
        reports.append(rep)
    bad = [r for r in reports if not r["ok"]]
    if bad:
        raise AdapterMismatch(f"{len(bad)} of {len(reports)} replicas do not serve {lora_name}: "
                              + "; ".join(f"{r['replica']}: {r['error']}" for r in bad))
    return reports


def staleness_table(max_staleness: int, syncs: int) -> list[dict]:
    """After each sync: which versions must stay loaded, and the slot count."""
    rows = []
    for v in range(1, syncs + 1):
        live = list(range(max(1, v - max_staleness), v + 1))
        rows.append({"sync": v, "current": v, "servable": live,
                     "loaded_during_sync": min(v, max_staleness + 2),
                     "unloaded_after": v - max_staleness - 1 if v > max_staleness + 1 else None})
    return rows
