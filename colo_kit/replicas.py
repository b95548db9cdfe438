"""vLLM replicas as subprocesses, their prefix-cache counters, and the affinity experiment.

`launch_replicas()` starts N vLLM OpenAI servers from `colo_kit.lora.replica_launch` recipes in
parallel (each takes ~20-60 s on CPU, ~75-105 s on a GPU), waits for `/health`, and stops them
all on exit, even on error. `prefix_cache_counters()` reads a replica's
`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total` (vLLM v1 counts both in
tokens). `prefix_hit_rate_experiment()` sends GRPO-shaped traffic — groups of G requests that
share one prompt, the G of a group at once, as TRL's rollout worker does — through a proxy, and
returns the hit rate the replicas themselves report.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

from colo_kit.lora import ReplicaLaunch


class ReplicaSet:
    def __init__(self, launches: list[ReplicaLaunch], log_dir: str | os.PathLike, token: str | None = None):
        self.launches = launches
        self.urls = [l.url for l in launches]
        self.token = token
        self.log_dir = Path(log_dir)
        self.procs: list[subprocess.Popen] = []
        self.startup_s: list[float] = []

    def start(self, timeout_s: float = 300.0) -> "ReplicaSet":
        import httpx

        self.log_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        for i, l in enumerate(self.launches):
            log = open(self.log_dir / f"replica{i}.log", "w")
            env = {**os.environ, **l.env}
            # own process group: stop() ends the server and the engine process it spawns
            self.procs.append(subprocess.Popen(l.argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True))
        pending = dict(enumerate(self.urls))
        self.startup_s = [0.0] * len(self.urls)
        try:
            while pending:
                for i, url in list(pending.items()):
                    if self.procs[i].poll() is not None:
                        tail = (self.log_dir / f"replica{i}.log").read_text()[-3000:]
                        raise RuntimeError(f"replica {url} exited with {self.procs[i].returncode}; log tail:\n{tail}")
                    try:
                        if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                            self.startup_s[i] = round(time.perf_counter() - t0, 1)
                            del pending[i]
                    except httpx.HTTPError:
                        pass
                if time.perf_counter() - t0 > timeout_s:
                    raise TimeoutError(f"replicas {list(pending.values())} not healthy after {timeout_s} s; "
                                       f"logs in {self.log_dir}")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs = []

    def __enter__(self):
        return self.start() if not self.procs else self

    def __exit__(self, *exc):
        self.stop()


def launch_replicas(launches: list[ReplicaLaunch], log_dir, token: str | None = None,
                    timeout_s: float = 300.0) -> ReplicaSet:
    return ReplicaSet(launches, log_dir, token).start(timeout_s)


_METRIC = re.compile(r"^(vllm:prefix_cache_(?:hits|queries)(?:_total)?)\{[^}]*\}\s+([0-9.eE+-]+)$", re.M)


def prefix_cache_counters(url: str, token: str | None = None) -> dict:
    """{'hits': tokens, 'queries': tokens} summed over the replica's engines."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    text = httpx.get(url.rstrip("/") + "/metrics", headers=headers, timeout=10).text
    out = {"hits": 0.0, "queries": 0.0}
    for name, value in _METRIC.findall(text):
        out["hits" if "hits" in name else "queries"] += float(value)
    return out


def prefix_hit_rate_experiment(proxy_url: str, replica_urls: list[str], model: str, *, groups: int = 16,
                               group_size: int = 8, prompt_tokens: int = 256, max_tokens: int = 4,
                               concurrent_groups: int = 2, vocab: int = 1000, seed: int = 0,
                               token: str | None = None, timeout_s: float = 600.0) -> dict:
    """Send `groups` GRPO groups through the proxy; return the replicas' prefix-cache hit rate.

    Each group is one random prompt of `prompt_tokens` token ids sent as `group_size` separate
    requests at once (TRL's rollout worker sends n=1 requests with `"prompt": [ids]`). The
    replicas' caches are reset first (a broadcast through the proxy), so the rate measures this
    traffic only. Hit rate = cached prompt tokens / queried prompt tokens, summed over replicas.
    """
    import asyncio

    import aiohttp

    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(prompt_tokens)] for _ in range(groups)]
    import httpx

    r = httpx.post(proxy_url + "/reset_prefix_cache", timeout=60)
    if r.status_code != 200:
        raise RuntimeError(f"prefix-cache reset failed through the proxy: {r.status_code} {r.text[:300]}")
    before = [prefix_cache_counters(u, token) for u in replica_urls]

    async def run():
        sem = asyncio.Semaphore(concurrent_groups)
        latencies = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
            async def one(ids):
                t = time.perf_counter()
                async with s.post(proxy_url + "/v1/completions", json={
                        "model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 1.0,
                        "seed": rng.getrandbits(31)}) as resp:
                    body = await resp.json()
                    if resp.status != 200:
                        raise RuntimeError(f"completion failed: {resp.status} {str(body)[:300]}")
                latencies.append(time.perf_counter() - t)

            async def group(ids):
                async with sem:
                    await asyncio.gather(*(one(ids) for _ in range(group_size)))

            await asyncio.gather(*(group(p) for p in prompts))
        return latencies

    t0 = time.perf_counter()
    latencies = asyncio.run(run())
    wall_s = time.perf_counter() - t0
    # The counters are updated by the engine's stats logger; give it a moment to publish.
    time.sleep(1.0)
    after = [prefix_cache_counters(u, token) for u in replica_urls]
    per = [{"replica": u, "hits": a["hits"] - b["hits"], "queries": a["queries"] - b["queries"]}
           for u, a, b in zip(replica_urls, after, before)]
    hits, queries = sum(p["hits"] for p in per), sum(p["queries"] for p in per)
    return {"hit_rate": hits / queries if queries else None, "hits_tokens": hits, "queries_tokens": queries,
            "per_replica": per, "wall_s": round(wall_s, 3), "requests": groups * group_size,
            "latency_s": sorted(round(x, 4) for x in latencies),
            "settings": {"groups": groups, "group_size": group_size, "prompt_tokens": prompt_tokens,
                         "max_tokens": max_tokens, "concurrent_groups": concurrent_groups, "model": model}}
