"""The routing proxy of the second post: several vLLM replicas that TRL sees as one server.

TRL's `AsyncGRPOTrainer` talks to one URL (`vllm_server_base_url`). In the post, two vLLM jobs
serve the base model plus the latest LoRA adapters, and a proxy beside the trainer at
127.0.0.1:8000 makes them look like one server. This module is that proxy, on aiohttp:

- **Auth.** Every upstream request carries `Authorization: Bearer <token>`, read once from the
  environment variable named by `--token-env` (the replicas' ports need it). The token is never
  logged, printed or echoed in an error.
- **Prefix affinity.** A completion / chat-completion request goes to the replica that most
  likely already holds its prompt's KV prefix. vLLM caches prefix KV in blocks of `block_size`
  tokens and keys each block by the chain of blocks before it *and the LoRA adapter name*. So the
  routing key is a hash over the prompt's leading full blocks, salted with the requested `model`
  (the adapter name, `trl-policy-v{N}`). The G requests of one GRPO group share a prompt, hence a
  key, hence a replica: the first one prefills and the other G-1 hit the cache. Round-robin over
  two replicas makes about half of them prefill again.
- **Which tokens.** TRL's rollout worker sends `"prompt": [token ids]` (it tokenises with the
  trainer's tokenizer), so for the requests that matter the proxy hashes exactly the ids vLLM
  blocks. A text prompt is tokenised with the replica's own tokenizer when `--tokenizer` names
  the model folder (the Rust `tokenizers` library, tens of microseconds); without it, and for
  chat `messages` (rendering the chat template per request would cost a Jinja render), the
  proxy uses a stable stand-in: the UTF-8 bytes in blocks of `4 * block_size` (about 4 bytes per
  token). The stand-in keeps the two properties routing needs: the same prompt gives the same
  key, and prompts that share their leading text share their leading blocks.
- **Bounded load.** Replicas are ranked per key by rendezvous hashing (stable across proxy
  restarts, and only the dead replica's keys move when one dies). The top-ranked replica is used
  unless its in-flight count would exceed `ceil(imbalance * mean) + slack`; then the next one, and
  past every bound the least-loaded one ("consistent hashing with bounded loads", Mirrokni et al.
  2018). The bound places a *new* prefix; a request whose prefix is already in flight on a
  replica follows it, up to `slack` requests (default 8 = one GRPO group), so a group is not
  split by a momentary imbalance its own burst created, and one hot prefix still spreads.
- **Broadcast.** State-changing requests (adapter load/unload, pause, resume, the weight-transfer
  endpoints, cache resets, sleep/wake) go to every configured replica; the answer is a success
  only if all succeeded, else 502 with the list of replicas that failed. Successful adapter loads
  are remembered and replayed on a replica that comes back, so a policy name means the same thing
  everywhere (the reason the post broadcasts at all).
- **Streaming.** `"stream": true` responses are relayed chunk by chunk as they arrive (SSE is not
  buffered). Non-streaming responses are read whole first, so a replica that dies mid-request is
  retried on another one and the caller never sees the failure.
- **Health.** Replicas are polled on `/health`; a failed request or poll takes a replica out of
  rotation, its requests are re-routed, and it is taken back when `/health` answers again (after
  its adapters are replayed). The proxy serves its own `/health` and `/metrics` (Prometheus text,
  or JSON with `?format=json`): per-replica requests, in-flight, health, affinity hits,
  fallbacks, retries, load imbalance and the proxy-added latency.

`colo-kit proxy --replica URL [--replica URL ...] --port 8000 --token-env NAME --block-size 16`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from urllib.parse import urlsplit

log = logging.getLogger("colo_kit.proxy")

# Endpoints whose POST changes a replica's state. vLLM 0.31's server exposes them (grep
# `@router.post` under vllm/entrypoints/serve/); TRL 1.16's AsyncGRPO client calls the first
# eight (trl/experimental/async_grpo/vllm_client.py).
BROADCAST_PATHS = frozenset({
    "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
    "/pause", "/resume",
    "/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
    "/update_weight_version", "/start_draft_weight_update",
    "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache",
    "/sleep", "/wake_up", "/abort_requests",
})
ROUTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# Headers that describe one hop, not the message (RFC 9110 7.6.1), plus the ones aiohttp recomputes.
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                         "trailer", "transfer-encoding", "upgrade", "host", "content-length", "authorization"})


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------

@dataclass
class ProxyConfig:
    replicas: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    token_env: str | None = None
    block_size: int = 16
    max_prefix_blocks: int = 64
    policy: str = "affinity"  # or "round_robin", the baseline the post compares against
    imbalance: float = 1.2
    slack: int = 8
    tokenizer: str | None = None
    health_interval_s: float = 1.0
    health_timeout_s: float = 5.0
    health_failures_to_drop: int = 2  # consecutive failed polls; a refused connection drops at once
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 2.0
    max_attempts: int = 3
    token: str | None = field(default=None, repr=False)

    def validate(self) -> "ProxyConfig":
        """Check everything that can be checked before serving; raise ValueError naming the fix."""
        if not self.replicas:
            raise ValueError("no replicas: pass at least one --replica http://HOST:PORT (a vLLM OpenAI server)")
        clean = []
        for url in self.replicas:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"bad replica URL {url!r}: expected http://HOST:PORT, e.g. http://10.0.0.5:8000")
            try:
                parts.port
            except ValueError:
                raise ValueError(f"bad replica URL {url!r}: the port is not a number in 0-65535") from None
            if parts.path not in ("", "/") or parts.query:
                raise ValueError(f"bad replica URL {url!r}: give the server root (no path), e.g. "
                                 f"{parts.scheme}://{parts.netloc}")
            clean.append(f"{parts.scheme}://{parts.netloc}")
        if len(set(clean)) != len(clean):
            raise ValueError(f"replica listed twice in {clean}: each --replica must be a different server")
        self.replicas = clean
        if self.token_env:
            token = os.environ.get(self.token_env, "")
            if not token:
                raise ValueError(f"--token-env {self.token_env}: the environment variable {self.token_env} is "
                                 "missing or empty; export it (the replicas' --api-key) before starting the proxy")
            self.token = token
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size}: use the replicas' KV block size (vLLM's --block-size, "
                             "16 on GPU)")
        if self.policy not in ("affinity", "round_robin"):
            raise ValueError(f"policy={self.policy!r}: choose 'affinity' or 'round_robin'")
        if self.imbalance < 1.0:
            raise ValueError(f"imbalance={self.imbalance}: the bound is max/mean in-flight load, >= 1.0 (e.g. 1.2)")
        if not 0 < self.port < 65536 and self.port != 0:
            raise ValueError(f"port={self.port}: choose 1-65535 (0 picks a free one)")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts={self.max_attempts}: at least 1")
        if self.tokenizer and not os.path.exists(os.path.join(self.tokenizer, "tokenizer.json")):
            raise ValueError(f"--tokenizer {self.tokenizer}: no tokenizer.json there; pass the replicas' model "
                             "folder, or leave it out to route text prompts by a byte stand-in")
        return self


# ---------------------------------------------------------------------------------------------
# Routing: the prefix key and the bounded-load choice (pure, unit-testable)
# ---------------------------------------------------------------------------------------------

def _blocks_digest(chunks, salt: bytes) -> bytes:
    h = hashlib.blake2b(salt, digest_size=8)
    for chunk in chunks:
        h.update(chunk)
    return h.digest()


class PrefixKeyer:
    """Turn a request body into the routing key: a hash of the prompt's leading full blocks."""

    def __init__(self, block_size: int = 16, max_prefix_blocks: int = 64, tokenizer: str | None = None):
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self._tok = None
        if tokenizer:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(os.path.join(tokenizer, "tokenizer.json"))

    def _ids_key(self, ids: list[int], salt: bytes) -> bytes:
        # Only full blocks are cached by vLLM; a prompt shorter than one block still keeps its
        # group together (one key), it just has nothing to reuse.
        n_full = min(len(ids) // self.block_size, self.max_prefix_blocks)
        used = ids[: n_full * self.block_size] if n_full else ids
        return _blocks_digest([struct.pack(f"<{len(used)}i", *used)], salt)

    def _text_key(self, text: str, salt: bytes) -> bytes:
        if self._tok is not None:
            return self._ids_key(self._tok.encode(text, add_special_tokens=False).ids, salt)
        data = text.encode("utf-8", "surrogatepass")
        width = 4 * self.block_size
        n_full = min(len(data) // width, self.max_prefix_blocks)
        return _blocks_digest([data[: n_full * width] if n_full else data], salt)

    def key(self, body: dict) -> bytes | None:
        salt = str(body.get("model", "")).encode()
        prompt = body.get("prompt")
        if prompt is None and "messages" in body:
            parts = []
            for m in body.get("messages") or []:
                content = m.get("content") if isinstance(m, dict) else m
                if not isinstance(content, str):
                    content = json.dumps(content, sort_keys=True)
                parts.append(f"<{m.get('role', '') if isinstance(m, dict) else ''}>{content}")
            prompt = "".join(parts)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]  # a batch of prompts: route by the first
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return self._ids_key(prompt, salt)
        if isinstance(prompt, str):
            return self._text_key(prompt, salt)
        return None


def rendezvous_order(key: bytes, replicas: list[str]) -> list[str]:
    """Replicas ranked for `key` by highest random weight: stable, and removing one replica only
    moves the keys that ranked it first."""
    return sorted(replicas, key=lambda r: hashlib.blake2b(key + r.encode(), digest_size=8).digest(), reverse=True)


def choose_replica(key: bytes | None, healthy: list[str], inflight: dict[str, int], *,
                   imbalance: float = 1.2, slack: int = 8) -> tuple[str, bool]:
    """Pick the replica for one request; returns (replica, affinity_hit).

    The preferred (top-ranked) replica takes the request unless that would push its in-flight
    count past `imbalance * mean + slack`; then the next ranked one within the bound; past every
    bound, the least-loaded one.
    """
    if not healthy:
        raise LookupError("no healthy replica")
    if key is None:
        return min(healthy, key=lambda r: inflight.get(r, 0)), False
    total = sum(inflight.get(r, 0) for r in healthy) + 1
    bound = math.ceil(imbalance * total / len(healthy)) + slack
    order = rendezvous_order(key, healthy)
    for rank, replica in enumerate(order):
        if inflight.get(replica, 0) + 1 <= bound:
            return replica, rank == 0
    return min(healthy, key=lambda r: inflight.get(r, 0)), False


# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------

class _Replica:
    def __init__(self, url: str):
        self.url = url
        self.healthy = True  # optimistic until the first poll says otherwise
        self.inflight = 0
        self.requests = 0
        self.failures = 0
        self.affinity_hits = 0
        self.last_error: str | None = None
        self.failed_polls = 0


class RoutingProxy:
    """The proxy as an object: `await start()`, `await stop()`; or `start_in_thread()` from sync
    code (notebooks, tests), which returns once it is serving."""

    def __init__(self, config: ProxyConfig):
        self.config = config.validate()
        self.keyer = PrefixKeyer(config.block_size, config.max_prefix_blocks, config.tokenizer)
        self.replicas = {u: _Replica(u) for u in config.replicas}
        self._rr = 0
        self._live: dict[bytes, list] = {}  # prefix key -> [replica url, requests in flight]
        self._adapters: dict[str, dict] = {}  # name -> load body, replayed on a recovered replica
        self._paused = False
        self.counters = {"requests": 0, "routed": 0, "affinity_hits": 0, "fallbacks": 0, "retries": 0,
                         "errors": 0, "broadcasts": 0, "broadcast_failures": 0, "recoveries": 0}
        self._overhead_ms: deque[float] = deque(maxlen=8192)
        self._session = None
        self._runner = None
        self._health_task = None
        self._loop = None
        self._thread = None
        self.url = None

    # -- lifecycle ---------------------------------------------------------------------------
    def _upstream_headers(self, incoming=None) -> dict:
        headers = {}
        if incoming is not None:
            headers = {k: v for k, v in incoming.items() if k.lower() not in HOP_HEADERS}
        if self.config.token:
            headers["Authorization"] = f"Bearer {self.config.token}"
        return headers

    async def start(self):
        import aiohttp
        from aiohttp import web

        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s, sock_connect=self.config.connect_timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
                                              connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30))
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/health", self._own_health)
        app.router.add_get("/metrics", self._own_metrics)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port, reuse_address=True)
        try:
            await site.start()
        except OSError:
            await self.stop()
            raise
        port = self._runner.addresses[0][1]
        self.url = f"http://{self.config.host}:{port}"
        await self._poll_health()
        self._health_task = asyncio.create_task(self._health_loop())
        log.info("proxy on %s -> %s (policy=%s, block_size=%d, auth=%s)", self.url, list(self.replicas),
                 self.config.policy, self.config.block_size, "on" if self.config.token else "off")
        return self

    async def stop(self):
        if self._health_task:
            self._health_task.cancel()
        if self._runner:
            await self._runner.cleanup()
        if self._session:
            await self._session.close()

    def start_in_thread(self, timeout_s: float = 30.0) -> "RoutingProxy":
        """Serve from a background thread with its own event loop (for notebooks and tests)."""
        ready, errors = threading.Event(), []

        def run():
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self.start())
            except BaseException as exc:  # surface bind errors etc. to the caller
                errors.append(exc)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self.stop())
            self._loop.close()

        self._thread = threading.Thread(target=run, name="colo-kit-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s):
            raise TimeoutError(f"proxy did not start within {timeout_s} s")
        if errors:
            raise errors[0]
        return self

    def stop_thread(self):
        if self._loop and self._thread:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    # -- health ------------------------------------------------------------------------------
    async def _probe(self, rep: _Replica) -> bool:
        import aiohttp

        try:
            async with self._session.get(rep.url + "/health", headers=self._upstream_headers(),
                                         timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s)) as r:
                await r.read()
                if r.status == 200:
                    rep.failed_polls = 0
                    return True
                raise RuntimeError(f"/health answered {r.status}")
        except aiohttp.ClientConnectorError as exc:  # nothing listening: dead now
            rep.last_error = type(exc).__name__
            rep.failed_polls = self.config.health_failures_to_drop
            return False
        except Exception as exc:  # slow or odd answer: dead only if it repeats (a busy host is not a dead one)
            rep.last_error = type(exc).__name__
            rep.failed_polls += 1
            return rep.failed_polls < self.config.health_failures_to_drop and rep.healthy

    async def _poll_health(self):
        reps = list(self.replicas.values())
        results = await asyncio.gather(*(self._probe(r) for r in reps))
        for rep, ok in zip(reps, results):
            if ok and not rep.healthy:
                if await self._resync(rep):
                    rep.healthy = True
                    self.counters["recoveries"] += 1
                    log.warning("replica %s is back", rep.url)
            elif not ok and rep.healthy:
                self._mark_dead(rep, rep.last_error or "health check failed")

    async def _health_loop(self):
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self._poll_health()
            except Exception as exc:  # never let the health loop die
                log.error("health poll failed: %s", exc)

    async def _resync(self, rep: _Replica) -> bool:
        """Replay the adapters (and pause state) a returning replica missed."""
        for name, body in list(self._adapters.items()):
            status, text = await self._send_one(rep, "POST", "/v1/load_lora_adapter", json.dumps(body).encode(),
                                                {**self._upstream_headers(), "Content-Type": "application/json"})
            if status != 200 and "already" not in text:
                rep.last_error = f"adapter replay {name}: {status} {text[:200]}"
                return False
        if self._paused:
            await self._send_one(rep, "POST", "/pause?mode=keep", b"", self._upstream_headers())
        return True

    def _mark_dead(self, rep: _Replica, why: str):
        if rep.healthy:
            log.warning("replica %s out of rotation: %s", rep.url, why)
        rep.healthy = False
        rep.last_error = why

    # -- routing -----------------------------------------------------------------------------
    def _pick(self, key: bytes | None, exclude: set[str]) -> tuple[_Replica, bool]:
        live = self._live.get(key) if key is not None and self.config.policy == "affinity" else None
        if live and live[1] < self.config.slack and live[0] not in exclude and self.replicas[live[0]].healthy:
            return self.replicas[live[0]], True
        healthy = [u for u, r in self.replicas.items() if r.healthy and u not in exclude]
        if not healthy:  # everything looks dead: try the ones not yet tried rather than fail outright
            healthy = [u for u in self.replicas if u not in exclude]
        if not healthy:
            raise LookupError("no replica left to try")
        if self.config.policy == "round_robin":
            self._rr += 1
            return self.replicas[healthy[self._rr % len(healthy)]], False
        url, hit = choose_replica(key, healthy, {u: self.replicas[u].inflight for u in healthy},
                                  imbalance=self.config.imbalance, slack=self.config.slack)
        return self.replicas[url], hit

    async def _handle(self, request):
        from aiohttp import web

        t0 = time.perf_counter()
        path = request.path
        body = await request.read()
        self.counters["requests"] += 1
        if request.method == "POST" and path in BROADCAST_PATHS:
            return await self._broadcast(request, path, body)
        key, stream = None, False
        if request.method == "POST" and path in ROUTED_PATHS:
            try:
                payload = json.loads(body)
                key = self.keyer.key(payload)
                stream = bool(payload.get("stream"))
            except (ValueError, AttributeError):
                pass  # let the replica answer the malformed request with its own 400
        headers = self._upstream_headers(request.headers)
        tried: set[str] = set()
        last_error = "no replica"
        for attempt in range(self.config.max_attempts):
            try:
                rep, hit = self._pick(key, tried)
            except LookupError:
                break
            tried.add(rep.url)
            if attempt:
                self.counters["retries"] += 1
            rep.inflight += 1
            rep.requests += 1
            live = None
            if key is not None:
                live = self._live.get(key)
                if live is None or live[0] != rep.url:
                    live = self._live[key] = [rep.url, 0]
                live[1] += 1
            try:
                return await self._forward(request, rep, path, body, headers, stream, t0, hit, key)
            except _Retryable as exc:
                last_error = f"{rep.url}: {exc}"
                rep.failures += 1
                self._mark_dead(rep, str(exc))
            finally:
                rep.inflight -= 1
                if live is not None:
                    live[1] -= 1
                    if live[1] <= 0 and self._live.get(key) is live:
                        del self._live[key]
        self.counters["errors"] += 1
        return web.json_response({"error": {"message": f"colo_kit proxy: no replica could serve {path} "
                                            f"(tried {sorted(tried)}; last error: {last_error})",
                                            "type": "proxy_upstream_error"}}, status=502)

    async def _forward(self, request, rep, path, body, headers, stream, t0, hit, key):
        import aiohttp
        from aiohttp import web

        url = rep.url + path + (f"?{request.query_string}" if request.query_string else "")
        t_send = time.perf_counter()
        try:
            upstream_cm = self._session.request(request.method, url, data=body, headers=headers)
            up = await upstream_cm.__aenter__()
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as exc:
            raise _Retryable(type(exc).__name__) from exc
        try:
            resp_headers = {k: v for k, v in up.headers.items() if k.lower() not in HOP_HEADERS}
            if stream and up.status == 200:
                resp = web.StreamResponse(status=up.status, headers=resp_headers)
                await resp.prepare(request)
                first = True
                try:
                    async for chunk in up.content.iter_any():
                        if first:
                            self._record(rep, hit, key, t_send - t0)
                            first = False
                        await resp.write(chunk)
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                    # Bytes already went to the caller, so a retry would duplicate them: end the
                    # stream with an error event the caller can see instead.
                    self._mark_dead(rep, type(exc).__name__)
                    self.counters["errors"] += 1
                    msg = {"error": {"message": f"colo_kit proxy: replica {rep.url} failed mid-stream "
                                                f"({type(exc).__name__}); retry the request",
                                     "type": "proxy_upstream_error"}}
                    await resp.write(f"data: {json.dumps(msg)}\n\n".encode())
                await resp.write_eof()
                return resp
            try:
                data = await up.read()
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                raise _Retryable(f"died mid-response ({type(exc).__name__})") from exc
            t_done = time.perf_counter()
            if up.status >= 500 and path in ROUTED_PATHS and up.status in (502, 503, 504):
                raise _Retryable(f"HTTP {up.status}")
            self._record(rep, hit, key, (t_send - t0) + (time.perf_counter() - t_done))
            return web.Response(status=up.status, body=data, headers=resp_headers)
        finally:
            await upstream_cm.__aexit__(None, None, None)

    def _record(self, rep, hit, key, own_s: float):
        self.counters["routed"] += 1
        if key is not None:
            if hit:
                self.counters["affinity_hits"] += 1
                rep.affinity_hits += 1
            elif self.config.policy == "affinity":
                self.counters["fallbacks"] += 1
        # The proxy's own time in its handler (parse, hash, choose; build the answer). The
        # benchmark measures the full added latency from outside, direct vs through the proxy.
        self._overhead_ms.append(1e3 * own_s)

    # -- broadcast ---------------------------------------------------------------------------
    async def _send_one(self, rep, method, path, body, headers):
        import aiohttp

        try:
            async with self._session.request(method, rep.url + path, data=body, headers=headers) as r:
                return r.status, (await r.read()).decode("utf-8", "replace")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return None, f"{type(exc).__name__}: {exc}"[:300]

    async def _broadcast(self, request, path, body):
        from aiohttp import web

        self.counters["broadcasts"] += 1
        query = f"?{request.query_string}" if request.query_string else ""
        headers = self._upstream_headers(request.headers)
        reps = list(self.replicas.values())
        results = await asyncio.gather(*(self._send_one(r, request.method, path + query, body, headers) for r in reps))
        failed = [{"replica": r.url, "status": s, "error": t[:500]} for r, (s, t) in zip(reps, results)
                  if s is None or s >= 300]
        for r, (s, _) in zip(reps, results):
            if s is None:
                self._mark_dead(r, "broadcast failed to connect")
        ok = [r.url for r, (s, _) in zip(reps, results) if s is not None and s < 300]
        if path == "/v1/load_lora_adapter" and ok:
            try:
                payload = json.loads(body)
                self._adapters[payload["lora_name"]] = payload
            except (ValueError, KeyError):
                pass
        elif path == "/v1/unload_lora_adapter":
            try:
                self._adapters.pop(json.loads(body)["lora_name"], None)
            except (ValueError, KeyError):
                pass
        elif path == "/pause" and ok:
            self._paused = True
        elif path == "/resume" and ok:
            self._paused = False
        if failed:
            self.counters["broadcast_failures"] += 1
            log.warning("broadcast %s failed on %s", path, [f["replica"] for f in failed])
            return web.json_response({"error": {"message": f"colo_kit proxy: {path} failed on "
                                                f"{len(failed)} of {len(reps)} replicas",
                                                "type": "proxy_broadcast_partial_failure"},
                                      "failed": failed, "succeeded": ok}, status=502)
        status, text = results[0]
        return web.Response(status=status, text=text, content_type="application/json"
                            if text[:1] in "{[" else "text/plain")

    # -- own endpoints -----------------------------------------------------------------------
    async def _own_health(self, request):
        from aiohttp import web

        healthy = [u for u, r in self.replicas.items() if r.healthy]
        return web.json_response({"healthy_replicas": healthy, "replicas": len(self.replicas)},
                                 status=200 if healthy else 503)

    def snapshot(self) -> dict:
        """Counters as a dict: the same numbers /metrics serves."""
        reqs = [r.requests for r in self.replicas.values()]
        mean = sum(reqs) / len(reqs) if reqs else 0
        lat = sorted(self._overhead_ms)

        def q(p):
            return round(lat[min(len(lat) - 1, int(p * len(lat)))], 4) if lat else None

        return {**self.counters, "policy": self.config.policy,
                "load_imbalance_max_over_mean": round(max(reqs) / mean, 4) if mean else None,
                "affinity_hit_rate": round(self.counters["affinity_hits"] / self.counters["routed"], 4)
                if self.counters["routed"] else None,
                "proxy_handler_ms": {"p50": q(0.50), "p90": q(0.90), "p99": q(0.99), "n": len(lat)},
                "adapters": sorted(self._adapters),
                "replicas": {u: {"healthy": r.healthy, "requests": r.requests, "inflight": r.inflight,
                                 "failures": r.failures, "affinity_hits": r.affinity_hits, "last_error": r.last_error}
                             for u, r in self.replicas.items()}}

    async def _own_metrics(self, request):
        from aiohttp import web

        snap = self.snapshot()
        if request.query.get("format") == "json":
            return web.json_response(snap)
        lines = []
        for name in ("requests", "routed", "affinity_hits", "fallbacks", "retries", "errors", "broadcasts",
                     "broadcast_failures", "recoveries"):
            lines += [f"# TYPE colo_proxy_{name}_total counter", f"colo_proxy_{name}_total {snap[name]}"]
        for name in ("requests", "inflight", "failures", "affinity_hits", "healthy"):
            lines.append(f"# TYPE colo_proxy_replica_{name} gauge")
            for url, r in snap["replicas"].items():
                lines.append(f'colo_proxy_replica_{name}{{replica="{url}"}} {int(r[name])}')
        lines.append("# TYPE colo_proxy_load_imbalance gauge")
        lines.append(f"colo_proxy_load_imbalance {snap['load_imbalance_max_over_mean'] or 0}")
        lines.append("# TYPE colo_proxy_handler_latency_ms summary")
        for p in ("p50", "p90", "p99"):
            v = snap["proxy_handler_ms"][p]
            lines.append(f'colo_proxy_handler_latency_ms{{quantile="0.{p[1:]}"}} {v if v is not None else "NaN"}')
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


class _Retryable(Exception):
    """The request never produced an answer on this replica: try another one."""


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def cli_main(argv: list[str]) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="colo-kit proxy", description="Prefix-affinity proxy in front of vLLM replicas "
                                 "(TRL's AsyncGRPOTrainer sees one server).")
    ap.add_argument("--replica", action="append", default=[], metavar="URL", help="a vLLM server, repeat per replica")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--token-env", default=None, metavar="NAME",
                    help="environment variable holding the replicas' API key (sent as Authorization: Bearer)")
    ap.add_argument("--block-size", type=int, default=16, help="the replicas' KV block size in tokens")
    ap.add_argument("--max-prefix-blocks", type=int, default=64)
    ap.add_argument("--policy", default="affinity", choices=["affinity", "round_robin"])
    ap.add_argument("--imbalance", type=float, default=1.2, help="bound on max/mean in-flight load")
    ap.add_argument("--slack", type=int, default=8, help="extra in-flight requests allowed above the bound")
    ap.add_argument("--tokenizer", default=None, help="model folder whose tokenizer.json tokenises text prompts")
    ap.add_argument("--health-interval", type=float, default=1.0, metavar="S")
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="[colo_kit.proxy] %(message)s")
    cfg = ProxyConfig(replicas=args.replica, host=args.host, port=args.port, token_env=args.token_env,
                      block_size=args.block_size, max_prefix_blocks=args.max_prefix_blocks, policy=args.policy,
                      imbalance=args.imbalance, slack=args.slack, tokenizer=args.tokenizer,
                      health_interval_s=args.health_interval)
    try:
        proxy = RoutingProxy(cfg)
    except ValueError as exc:
        print(f"colo-kit proxy: {exc}", file=sys.stderr)
        return 2

    async def main():
        try:
            import uvloop  # noqa: F401  (vLLM's server depends on it; ~2x less proxy overhead)
        except ImportError:
            pass
        await proxy.start()
        print(f"colo-kit proxy serving on {proxy.url} -> {', '.join(proxy.replicas)}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await proxy.stop()

    try:
        try:
            import uvloop

            uvloop.run(main())
        except ImportError:
            asyncio.run(main())
    except KeyboardInterrupt:
        pass
    except OSError as exc:  # e.g. the port is taken
        print(f"colo-kit proxy: cannot serve on {args.host}:{args.port}: {exc}; choose another --port", file=sys.stderr)
        return 2
    return 0


def percentile(values, p: float) -> float:
    """Nearest-rank percentile, for the benchmark and the notebook."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))] if s else float("nan")
