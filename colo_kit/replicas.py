"""vLLM replicas as subprocesses, their prefix-cache counters, and the affinity experiment.

`launch_replicas()` starts N vLLM OpenAI servers from `colo_kit.lora.replica_launch` recipes in
parallel (each takes ~20-60 s on CPU, ~75-105 s on a GPU; replicas sharing a GPU one after
another), waits for `/health`, and stops them all on exit, even on error. `placement()` says
where N replicas go on this machine. `prefix_cache_counters()` reads a replica's
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

from colo_kit.launch import die_with_parent, free_port  # noqa: F401  (notebook 06 imports free_port from here)
from colo_kit.lora import ReplicaLaunch


def run_async(coro):
    """`asyncio.run`, also from a Jupyter cell (whose thread already runs an event loop)."""
    import asyncio
    import threading

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box = {}

    def target():
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class ReplicaSet:
    def __init__(self, launches: list[ReplicaLaunch], log_dir: str | os.PathLike, token: str | None = None):
        self.launches = launches
        self.urls = [l.url for l in launches]
        self.token = token
        self.log_dir = Path(log_dir)
        self.procs: list[subprocess.Popen] = []
        self.startup_s: list[float] = []

    def start(self, timeout_s: float = 300.0) -> "ReplicaSet":
        """Start every replica and wait for `/health`. Replicas on different devices start in
        parallel; replicas that share a GPU start one after another, because vLLM sizes its KV
        cache from the memory it sees free while it profiles, and two engines profiling one GPU
        at once each count the other's growth as their own."""
        import atexit

        from colo_kit.launch import child_env

        self.log_dir.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)  # a failed notebook cell or test must not leave servers behind
        t0 = time.perf_counter()
        self.startup_s = [0.0] * len(self.urls)
        try:
            for wave in _start_waves(self.launches):
                for i in wave:
                    launch = self.launches[i]
                    log = open(self.log_dir / f"replica{i}.log", "w")
                    # own process group: stop() ends the server and the engine process it spawns
                    self.procs.append(subprocess.Popen(launch.argv, env=child_env(**launch.env), stdout=log,
                                                       stderr=subprocess.STDOUT, start_new_session=True,
                                                       preexec_fn=die_with_parent))
                self._wait_healthy({i: self.urls[i] for i in wave}, t0, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, pending: dict, t0: float, timeout_s: float) -> None:
        import httpx

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


def _start_waves(launches: list[ReplicaLaunch]) -> list[list[int]]:
    """Indices of the replicas to start together: all at once, unless two share a GPU; then each
    wave holds at most one replica per GPU."""
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
    """Where `n` replicas go on this machine: `{"gpu": index or None, "gpu_memory_utilization": u}`
    each. No GPU: all on the CPU. At least n GPUs: one each (the post's layout). Fewer GPUs: they
    share, round-robin. `share_gib` caps what each replica takes of its GPU (a small model beside a
    trainer on the same GPU); without it a replica takes 0.85 of a GPU of its own, or an equal part
    of 0.9 of a shared one. vLLM refuses to start when the share it asks for is not free."""
    from colo_kit.env import Machine

    machine = machine or Machine.here()
    if not machine.gpus:
        return [{"gpu": None, "gpu_memory_utilization": None} for _ in range(n)]
    per_gpu = -(-n // machine.gpus)
    u = 0.85 if per_gpu == 1 else 0.9 / per_gpu
    if share_gib is not None:
        u = min(u, share_gib / machine.gpu_mem_gib)
    return [{"gpu": i % machine.gpus, "gpu_memory_utilization": round(u, 3)} for i in range(n)]


def launch_replicas(launches: list[ReplicaLaunch], log_dir, token: str | None = None,
                    timeout_s: float = 300.0) -> ReplicaSet:
    return ReplicaSet(launches, log_dir, token).start(timeout_s)


_METRIC = re.compile(r"^vllm:(gpu_)?prefix_cache_(hits|queries)(?:_total)?\{[^}]*\}\s+([0-9.eE+-]+)$", re.M)


def prefix_cache_counters(url: str, token: str | None = None) -> dict:
    """{'hits': tokens, 'queries': tokens} summed over the replica's engines."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    text = httpx.get(url.rstrip("/") + "/metrics", headers=headers, timeout=10).text
    # vLLM v1 names them vllm:prefix_cache_{hits,queries}; older releases also had a
    # vllm:gpu_prefix_cache_* pair (deprecated). Use the first family present, never both.
    found = _METRIC.findall(text)
    new = [f for f in found if not f[0]] or found
    out = {"hits": 0.0, "queries": 0.0}
    for _, kind, value in new:
        out[kind] += float(value)
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
    latencies = run_async(run())
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



def compare_routing(replica_urls: list[str], model: str, *, token_env: str | None = None, block_size: int = 16,
                    policies=("round_robin", "affinity"), **experiment) -> dict:
    """The prefix-cache hit rate of the same GRPO traffic under each routing policy: one proxy per
    policy in front of the same replicas, caches reset before each run."""
    import os as _os

    from colo_kit.proxy import ProxyConfig, RoutingProxy

    token = _os.environ.get(token_env) if token_env else None
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

# ---------------------------------------------------------------------------------------------
# A stand-in upstream: an OpenAI-shaped HTTP server that answers at once, to measure the proxy
# alone (its routing, broadcast and failure handling) without vLLM's own milliseconds.
# `python -m colo_kit.replicas stub --port 9001 --name a [--token-env NAME]`
# ---------------------------------------------------------------------------------------------

def stub_app(name: str, token: str | None = None):
    """The stand-in's aiohttp app. Completions answer `{"replica": name, ...}` (after
    `delay_ms` from the request body, if any); `"stream": true` sends `chunks` SSE events
    `chunk_delay_ms` apart; broadcast endpoints are recorded; `/_stub/state` reports everything;
    `/_stub/fail` makes a path answer 500 (to test partial broadcast failure)."""
    import asyncio
    import json as _json

    from aiohttp import web

    state = {"name": name, "requests": 0, "calls": [], "adapters": {}, "fail": [], "unauthorized": 0}

    @web.middleware
    async def auth(request, handler):
        if token and not request.path.startswith(("/health", "/_stub")) and \
                request.headers.get("Authorization") != f"Bearer {token}":
            state["unauthorized"] += 1
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def health(request):
        return web.Response(text="")

    async def models(request):
        data = [{"id": "base", "root": "base", "parent": None}]
        data += [{"id": k, "root": v, "parent": "base"} for k, v in state["adapters"].items()]
        return web.json_response({"object": "list", "data": data})

    async def complete(request):
        body = await request.json()
        state["requests"] += 1
        if body.get("delay_ms"):
            await asyncio.sleep(body["delay_ms"] / 1000)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(int(body.get("chunks", 3))):
                await resp.write(f"data: {_json.dumps({'replica': name, 'i': i, 't': time.time()})}\n\n".encode())
                await asyncio.sleep(body.get("chunk_delay_ms", 0) / 1000)
            await resp.write(b"data: [DONE]\n\n")
            return resp
        return web.json_response({"replica": name, "model": body.get("model"),
                                  "choices": [{"index": 0, "text": "ok", "token_ids": [1]}]})

    async def record(request):
        body = await request.read()
        state["calls"].append({"path": request.path, "query": request.query_string, "body": body.decode()})
        if request.path in state["fail"]:
            return web.json_response({"error": f"{name} told to fail {request.path}"}, status=500)
        if request.path == "/v1/load_lora_adapter":
            p = _json.loads(body)
            state["adapters"][p["lora_name"]] = p["lora_path"]
        elif request.path == "/v1/unload_lora_adapter":
            state["adapters"].pop(_json.loads(body)["lora_name"], None)
        return web.json_response({"status": "ok", "replica": name})

    async def get_state(request):
        return web.json_response(state)

    async def set_fail(request):
        state["fail"] = [p for p in request.query.get("paths", "").split(",") if p]
        return web.json_response(state["fail"])

    app = web.Application(middlewares=[auth])
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_get("/_stub/state", get_state)
    app.router.add_post("/_stub/fail", set_fail)
    app.router.add_post("/{tail:.*}", record)
    return app


def start_stub(port: int, name: str, token_env: str | None = None, log_path=None) -> subprocess.Popen:
    """Start a stand-in upstream as its own process (so a test can kill it like a crashed replica)."""
    import sys

    import httpx

    argv = [sys.executable, "-m", "colo_kit.replicas", "stub", "--port", str(port), "--name", name]
    if token_env:
        argv += ["--token-env", token_env]
    out = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    for _ in range(200):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.05)
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"stub upstream on port {port} did not start")


def _cli(argv: list[str]) -> int:
    import argparse

    from aiohttp import web

    ap = argparse.ArgumentParser(prog="python -m colo_kit.replicas")
    ap.add_argument("what", choices=["stub"])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name", default="stub")
    ap.add_argument("--token-env", default=None)
    a = ap.parse_args(argv)
    token = os.environ.get(a.token_env) if a.token_env else None
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    kwargs = {"loop": loop_factory()} if loop_factory else {}
    web.run_app(stub_app(a.name, token), host="127.0.0.1", port=a.port, access_log=None, print=None, **kwargs)
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(_cli(sys.argv[1:]))
