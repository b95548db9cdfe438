"""vLLM replicas as subprocesses, their prefix-cache counters, and the affinity experiment of notebook 06: GRPO-shaped
traffic through the proxy, and the hit rate the replicas count in tokens."""

from __future__ import annotations

import os
import random
import subprocess
import time
from pathlib import Path

from colo_kit.async_lora.lora import ReplicaLaunch
from colo_kit.procs import free_port  # noqa: F401  (notebook 06 imports free_port from here)
from colo_kit.procs import start_in_session, stop_groups, wait_all_healthy


class ReplicaSet:
    def __init__(self, launches: list[ReplicaLaunch], log_dir: str | os.PathLike):
        self.launches = launches
        self.urls = [launch.url for launch in launches]
        self.log_dir = Path(log_dir)
        self.procs: list[subprocess.Popen] = []
        self.startup_s: list[float] = []

    def start(self, timeout_s: float = 300.0) -> "ReplicaSet":
        """Start every replica and wait for `/health`; replicas sharing a GPU start one after another (vLLM sizes its KV
        cache from the free memory it sees, and would count the other's growth as its own)."""
        import atexit

        from colo_kit.procs import child_env

        self.log_dir.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)  # a failed notebook cell or test must not leave servers behind
        t0 = time.perf_counter()
        self.startup_s = [0.0] * len(self.urls)
        try:
            for wave in _start_waves(self.launches):
                for i in wave:
                    launch = self.launches[i]
                    _check_gpu_share(launch)
                    # own process group: stop() ends the server and the engine process it spawns
                    self.procs.append(start_in_session(launch.argv, child_env(**launch.env), self._log(i)))
                ready = wait_all_healthy({self.urls[i]: (self.procs[i], self._log(i)) for i in wave}, timeout_s,
                                         t0=t0, what="replica")
                for i in wave:
                    self.startup_s[i] = round(ready[self.urls[i]], 1)
        except BaseException:
            self.stop()
            raise
        return self

    def _log(self, i: int) -> Path:
        return self.log_dir / f"replica{i}.log"

    def stop(self):
        stop_groups(self.procs, timeout_s=20)
        self.procs = []

    def __enter__(self):
        return self.start() if not self.procs else self

    def __exit__(self, *exc):
        self.stop()


def _check_gpu_share(launch: ReplicaLaunch) -> None:
    """Refuse a replica whose GPU share another process holds now, not with an engine failure later."""
    gpu = launch.env.get("CUDA_VISIBLE_DEVICES", "")
    if not gpu.isdigit() or "--gpu-memory-utilization" not in launch.argv:
        return
    from colo_kit.gpu_free import check_share

    check_share(float(launch.argv[launch.argv.index("--gpu-memory-utilization") + 1]), physical=int(gpu))


def _start_waves(launches: list[ReplicaLaunch]) -> list[list[int]]:
    """Indices of the replicas to start together: at most one replica per GPU in each wave."""
    waves: list[list[int]] = []
    for i, launch in enumerate(launches):
        gpu = launch.env.get("CUDA_VISIBLE_DEVICES")
        for wave in waves:
            if gpu is None or all(launches[j].env.get("CUDA_VISIBLE_DEVICES") != gpu for j in wave):
                wave.append(i)
                break
        else:
            waves.append([i])
    return waves


def placement(n: int, machine=None, *, share_gib: float | None = None) -> list[dict]:
    """Where `n` replicas go: a GPU each if enough (the post's layout), else equal shares of 0.9 (`share_gib` at most)."""
    from colo_kit.env import Machine

    machine = machine or Machine.here()
    if not machine.gpus:
        return [{"gpu": None, "gpu_memory_utilization": None} for _ in range(n)]
    per_gpu = -(-n // machine.gpus)
    u = 0.85 if per_gpu == 1 else 0.9 / per_gpu
    if share_gib is not None:
        u = min(u, share_gib / machine.gpu_mem_gib)
    return [{"gpu": i % machine.gpus, "gpu_memory_utilization": round(u, 3)} for i in range(n)]


def launch_replicas(launches: list[ReplicaLaunch], log_dir, timeout_s: float = 300.0) -> ReplicaSet:
    return ReplicaSet(launches, log_dir).start(timeout_s)


def replica_counters(url: str, token: str | None = None) -> dict:
    """Prefix-cache hits and queries (tokens) and finished requests, from the replica's Prometheus `/metrics`."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    text = httpx.get(url.rstrip("/") + "/metrics", headers=headers, timeout=10).text
    wanted = {"prefix_cache_hits": "hits", "prefix_cache_queries": "queries", "request_success": "requests"}
    out = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix("vllm:").removesuffix("_total")
            if name in wanted:  # summed over engines, and finish reasons for request_success
                out[wanted[name]] += sample.value
    return out


def settled_counters(replica_urls: list[str], before: list[dict], requests: int, token: str | None = None,
                     interval_s: float = 0.1, deadline_s: float = 10.0) -> list[dict]:
    """The replicas' counters once they count the `requests` just answered (vLLM answers before it records them)."""
    deadline = time.monotonic() + deadline_s
    last = None
    while True:
        now = [replica_counters(u, token) for u in replica_urls]
        done = sum(a["requests"] - b["requests"] for a, b in zip(now, before)) >= requests
        if (done and now == last) or time.monotonic() >= deadline:
            return now
        last = now
        time.sleep(interval_s)


def measure_prefix_hits(url: str, replica_urls: list[str], prompts: list, group_size: int, model: str, *,
                        token: str | None = None, headers: dict | None = None, concurrent_groups: int = 2,
                        max_tokens: int = 4, seed_rng: random.Random | None = None,
                        timeout_s: float = 600.0) -> dict:
    """Send `prompts` as GRPO groups of `group_size` requests, as TRL's rollout worker does; return counters and latencies."""
    import asyncio

    import aiohttp
    from jupyter_core.utils import run_sync  # also from a Jupyter cell, whose thread already runs an event loop

    before = [replica_counters(u, token) for u in replica_urls]

    async def run():
        sem, latencies = asyncio.Semaphore(concurrent_groups), []
        async with aiohttp.ClientSession(headers=headers or {}, timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
            async def one(prompt):
                body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0}
                if seed_rng is not None:
                    body["seed"] = seed_rng.getrandbits(31)
                t = time.perf_counter()
                async with s.post(url + "/v1/completions", json=body) as r:
                    if r.status != 200:
                        raise RuntimeError(f"completion through {url}: HTTP {r.status} {(await r.text())[:300]}")
                    await r.read()
                latencies.append(time.perf_counter() - t)

            async def group(prompt):
                async with sem:
                    await asyncio.gather(*(one(prompt) for _ in range(group_size)))

            await asyncio.gather(*(group(p) for p in prompts))
        return latencies

    t0 = time.perf_counter()
    latencies = run_sync(run)()
    wall_s = time.perf_counter() - t0
    after = settled_counters(replica_urls, before, len(prompts) * group_size, token)
    return {**{k: [a[k] - b[k] for a, b in zip(after, before)] for k in ("hits", "queries", "requests")},
            "latency_s": latencies, "wall_s": wall_s}


def prefix_hit_rate_experiment(proxy_url: str, replica_urls: list[str], model: str, *, groups: int = 16,
                               group_size: int = 8, prompt_tokens: int = 256, shared_prefix_tokens: int = 0,
                               max_tokens: int = 4, concurrent_groups: int = 2, vocab: int = 1000, seed: int = 0,
                               token: str | None = None, timeout_s: float = 600.0) -> dict:
    """The replicas' prefix-cache hit rate (in tokens) for `groups` GRPO groups of random prompts through the proxy."""
    import httpx

    rng = random.Random(seed)
    shared = [rng.randrange(10, vocab) for _ in range(shared_prefix_tokens)]
    prompts = [shared + [rng.randrange(10, vocab) for _ in range(prompt_tokens - shared_prefix_tokens)]
               for _ in range(groups)]
    r = httpx.post(proxy_url + "/reset_prefix_cache", timeout=60)
    if r.status_code != 200:
        raise RuntimeError(f"prefix-cache reset failed through the proxy: {r.status_code} {r.text[:300]}")
    m = measure_prefix_hits(proxy_url, replica_urls, prompts, group_size, model, token=token,
                            concurrent_groups=concurrent_groups, max_tokens=max_tokens, seed_rng=rng,
                            timeout_s=timeout_s)
    per = [{"replica": u, "hits": h, "queries": q} for u, h, q in zip(replica_urls, m["hits"], m["queries"])]
    hits, queries = sum(m["hits"]), sum(m["queries"])
    return {"hit_rate": hits / queries if queries else None, "hits_tokens": hits, "queries_tokens": queries,
            "per_replica": per, "wall_s": round(m["wall_s"], 3), "requests": groups * group_size,
            "latency_s": sorted(round(x, 4) for x in m["latency_s"]),
            "settings": {"groups": groups, "group_size": group_size, "prompt_tokens": prompt_tokens,
                         "shared_prefix_tokens": shared_prefix_tokens,
                         "max_tokens": max_tokens, "concurrent_groups": concurrent_groups, "model": model}}


def compare_routing(replica_urls: list[str], model: str, *, token_env: str | None = None, block_size: int = 16,
                    policies=("round_robin", "affinity"), **experiment) -> dict:
    """The prefix-cache hit rate of the same GRPO traffic under each routing policy, one proxy per policy."""
    from colo_kit.async_lora.proxy import ProxyConfig, RoutingProxy

    token = os.environ.get(token_env) if token_env else None
    out = {}
    for policy in policies:
        proxy = RoutingProxy(ProxyConfig(replicas=list(replica_urls), port=0, token_env=token_env,
                                         block_size=block_size, policy=policy)).start_in_thread()
        try:
            res = prefix_hit_rate_experiment(proxy.url, replica_urls, model, token=token, **experiment)
            res["proxy"] = {k: v for k, v in proxy.snapshot().items() if k != "replicas"}
            res["requests_per_replica"] = {u: r["requests"] for u, r in proxy.snapshot()["replicas"].items()}
            out[policy] = res
        finally:
            proxy.stop_thread()
    if "affinity" in out and "round_robin" in out and out["round_robin"]["hit_rate"]:
        out["affinity_over_round_robin"] = round(out["affinity"]["hit_rate"] / out["round_robin"]["hit_rate"], 4)
    return out
