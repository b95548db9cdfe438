"""The routing proxy of the second post: several vLLM replicas that TRL sees as one server.

TRL's `AsyncGRPOTrainer` talks to one URL (`vllm_server_base_url`). In the post, two vLLM jobs
serve the base model plus the latest LoRA adapters, and a proxy beside the trainer makes them look
like one server. This module serves that proxy on aiohttp; what it decides is `colo_kit.routing`.

- **Who may use it.** On loopback, any local process, as TRL's client sends no credentials. With
  `client_token_env` every request must carry `Authorization: Bearer <that token>` (401 otherwise);
  binding anything but loopback without it is refused at start. The client's header never travels
  on: upstream requests carry the replicas' own token (`token_env`). Health polls carry none. A
  replica URL's password is shown nowhere (`user:***@`).
- **How long it waits for a client.** A request's head must arrive within `client_timeout_s` of
  the connection opening (or of the previous answer), and its body within as long again; a socket
  that sends nothing is closed, so idle sockets cannot use up the proxy's file descriptors.
- **What it forwards.** The routes of `routing.ROUTES` only (404 otherwise, without touching a
  replica); paths are normalised first. Adapter loads need `adapter_root` and a path inside it.
  Bodies over `max_body_mb` get 413 before they are read whole; prompts are parsed and hashed off
  the event loop, so one huge prompt does not stall `/health` for everyone.
- **Where it sends.** A completion goes to the replica that holds the longest known prefix of its
  prompt (`routing.PrefixIndex`), within a bound on load; a broadcast goes to every healthy replica.
- **Faults, bounded.** Broadcasts and health checks wait at most `upstream_timeout_s`. A replica that
  misses one is taken out of rotation and reported in the answer; its in-flight requests fail over
  at once; when `/health` answers again it is caught up (adapters, pause state) and taken back. A
  replay that fails is logged and skipped: a replica is never locked out by one bad adapter.
  A client that hangs up ends its upstream request and nothing more. Uniform answers of a
  broadcast (every replica said 400, say) pass through as they are; 502 is for mixed results.
- **What it tells.** `/health` (no secrets), `/metrics` (Prometheus text through
  `prometheus_client`, or JSON with `?format=json`): per-replica requests, in-flight, health,
  affinity hits, fallbacks, retries, load imbalance and the proxy's own handler time.

`colo-kit proxy` (colo_kit.proxy_cli) starts it from a shell.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import math
import os
import threading
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from colo_kit.routing import (ADAPTER_NAME, ANY, BROADCAST, OWN, PrefixIndex, PrefixKeyer, bearer_ok, choose_replica,
                              load_bound, normalise_path, replica_base, route_kind, vet_adapter_load)

log = logging.getLogger("colo_kit.proxy")

INLINE_PARSE_BYTES = 64 * 1024  # bodies up to this are parsed on the event loop (well under a millisecond)
MAX_BODY_MB = 1024  # the proxy holds a whole body in memory; aiohttp needs the limit as an int of bytes

# Headers that describe one hop, not the message (RFC 9110 7.6.1), plus the ones aiohttp recomputes
# and the client's credentials (replaced by the replicas' own upstream).
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
    token_env: str | None = None  # the replicas' API key, sent upstream
    client_token_env: str | None = None  # the key clients must send to the proxy
    adapter_root: str | None = None  # the only directory adapter loads may point into
    block_size: int | None = None  # None: ask the replicas (/server_info), else 16
    max_prefix_blocks: int = 64
    prefix_index_size: int = 65536
    policy: str = "affinity"  # or "round_robin", the baseline the post compares against
    imbalance: float = 1.2
    slack: int = 8
    tokenizer: str | None = None
    max_body_mb: float = 16.0
    upstream_timeout_s: float = 30.0  # broadcasts and health checks
    request_timeout_s: float = 600.0  # one generation (thousands of tokens take minutes)
    health_interval_s: float = 1.0
    health_failures_to_drop: int = 2  # consecutive failed polls; a refused connection drops at once
    connect_timeout_s: float = 2.0
    client_timeout_s: float = 30.0  # a request's head, and then its body, from a client
    max_attempts: int = 3
    token: str | None = field(default=None, repr=False)
    client_token: str | None = field(default=None, repr=False)
    # shown replica URL (password as ***) -> the URL requests go to, credentials and all
    upstream_urls: dict[str, str] = field(default_factory=dict, init=False, repr=False)

    def validate(self) -> "ProxyConfig":
        """Check everything that can be checked before serving; raise ValueError naming the fix."""
        if not self.replicas:
            raise ValueError("no replicas: pass at least one --replica http://HOST:PORT (a vLLM OpenAI server)")
        clean, upstream = [], {}
        for url in self.replicas:
            # validated before, a shown URL maps back to the real one
            shown, base = replica_base(self.upstream_urls.get(url, str(url)), self.token_env)
            clean.append(shown)
            upstream[shown] = base
        if len(set(clean)) != len(clean):
            raise ValueError(f"replica listed twice in {clean}: each --replica must be a different server")
        self.replicas, self.upstream_urls = clean, upstream
        self.token = self._secret(self.token_env, "--token-env", "the replicas' --api-key")
        self.client_token = self._secret(self.client_token_env, "--client-token-env", "the key clients must send")
        if not self.client_token and not _is_loopback(self.host):
            raise ValueError(f"--host {self.host}: listening beyond this machine lets anyone who reaches the port "
                             "drive the replicas; give --client-token-env NAME (clients then send that token), "
                             "or keep --host 127.0.0.1")
        for name in ("imbalance", "max_body_mb", "upstream_timeout_s", "request_timeout_s", "health_interval_s",
                     "connect_timeout_s", "client_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name}={value!r}: give a finite number above 0")
        if self.max_body_mb > MAX_BODY_MB:
            raise ValueError(f"max_body_mb={self.max_body_mb:g}: give at most {MAX_BODY_MB} (the proxy holds a whole "
                             "body in memory; TRL's requests are well under the default 16)")
        if self.imbalance < 1.0:
            raise ValueError(f"imbalance={self.imbalance}: the bound is max/mean in-flight load, >= 1.0 (e.g. 1.2)")
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size < 1):
            raise ValueError(f"block_size={self.block_size}: use the replicas' KV block size (vLLM's --block-size: "
                             "16 on a GPU, 32 on vLLM-CPU), or leave it out to ask the replicas")
        if self.policy not in ("affinity", "round_robin"):
            raise ValueError(f"policy={self.policy!r}: choose 'affinity' or 'round_robin'")
        if not (0 <= self.port < 65536):
            raise ValueError(f"port={self.port}: choose 1-65535 (0 picks a free one)")
        for name in ("max_attempts", "slack", "max_prefix_blocks", "prefix_index_size", "health_failures_to_drop"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "slack" else 1):
                raise ValueError(f"{name}={value!r}: give a whole number of at least {0 if name == 'slack' else 1}")
        if self.tokenizer and not os.path.exists(os.path.join(self.tokenizer, "tokenizer.json")):
            raise ValueError(f"--tokenizer {self.tokenizer}: no tokenizer.json there; pass the replicas' model "
                             "folder, or leave it out to route text prompts by a byte stand-in")
        if self.adapter_root is not None and not os.path.isdir(self.adapter_root):
            raise ValueError(f"--adapter-root {self.adapter_root}: not a directory; give the shared directory the "
                             "trainer publishes adapters under")
        if self.adapter_root is not None and os.path.realpath(self.adapter_root) == "/":
            raise ValueError(f"--adapter-root {self.adapter_root}: the adapter root / would let any file on the "
                             "machine be loaded; give the folder that holds your adapters")
        return self

    @staticmethod
    def _secret(env: str | None, flag: str, what: str) -> str | None:
        if not env:
            return None
        value = os.environ.get(env, "")
        if not value:
            raise ValueError(f"{flag} {env}: the environment variable {env} is missing or empty; export it "
                             f"({what}) before starting the proxy")
        return value


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------

class _Replica:
    def __init__(self, url: str, base: str):
        self.url = url  # as shown: in logs, answers and metrics
        self.base = base  # as requested: with the URL's credentials, if any
        self.healthy = True  # optimistic until the first poll says otherwise
        self.dead = asyncio.Event()  # set while out of rotation
        self.waiting: set[asyncio.Task] = set()  # upstream calls in flight: cancelled when it is taken out
        self.inflight = 0
        self.requests = 0
        self.failures = 0
        self.affinity_hits = 0
        self.last_error: str | None = None
        self.failed_polls = 0


class _Retryable(Exception):
    """The request never produced an answer on this replica: try another one."""


class RoutingProxy:
    """The proxy as an object: `await start()`, `await stop()`; or `start_in_thread()` from sync
    code (notebooks, tests), which returns once it is serving."""

    def __init__(self, config: ProxyConfig):
        self.config = config.validate()
        self.keyer: PrefixKeyer | None = None  # made at start, once the block size is known
        self.index = PrefixIndex(config.prefix_index_size)
        self.replicas: dict[str, _Replica] = {}
        self._rr = 0
        self._adapters: dict[str, dict] = {}  # name -> load body, replayed on a recovered replica
        self._loaded: dict[str, set[str]] = {}  # name -> replicas that hold it
        self._partial: dict[str, tuple[dict, set[str]]] = {}  # name -> (load body, replicas that loaded it)
        self._paused = False
        self.counters = {"requests": 0, "routed": 0, "affinity_hits": 0, "fallbacks": 0, "retries": 0,
                         "errors": 0, "refused": 0, "broadcasts": 0, "broadcast_failures": 0, "recoveries": 0,
                         "replay_failures": 0, "client_hangups": 0}
        self._overhead_ms: deque[float] = deque(maxlen=8192)
        self._session = None
        self._runner = None
        self._health_task = None
        self._loop = None
        self._thread = None
        self.url = None

    # -- lifecycle ---------------------------------------------------------------------------
    def _upstream_headers(self, incoming=None) -> dict:
        headers = {k: v for k, v in incoming.items() if k.lower() not in HOP_HEADERS} if incoming is not None else {}
        if self.config.token:
            headers["Authorization"] = f"Bearer {self.config.token}"
        return headers

    async def start(self):
        import aiohttp
        from aiohttp import web

        self.replicas = {u: _Replica(u, self.config.upstream_urls[u]) for u in self.config.replicas}
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s, sock_connect=self.config.connect_timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
                                              connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30))
        if self.config.block_size is None:
            self.config.block_size = await self._ask_block_size()
        self.keyer = PrefixKeyer(self.config.block_size, self.config.max_prefix_blocks, self.config.tokenizer)
        app = web.Application(client_max_size=int(self.config.max_body_mb * 2**20))
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # aiohttp's keep-alive timer starts when a connection opens and closes it if no whole request
        # head has come when it fires (web_protocol.py: connection_made, _process_keepalive): our head
        # timeout. It also closes idle keep-alive connections, as vLLM's uvicorn does after 5 s, so
        # clients already cope. Lingering (draining an unread body after the answer) is bounded too.
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     keepalive_timeout=self.config.client_timeout_s,
                                     lingering_time=min(10.0, self.config.client_timeout_s))
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
        log.info("proxy on %s -> %s (policy=%s, block_size=%d, replica auth=%s, client auth=%s)", self.url,
                 list(self.replicas), self.config.policy, self.config.block_size,
                 "on" if self.config.token else "off", "on" if self.config.client_token else "off")
        return self

    async def _ask_block_size(self) -> int:
        """The replicas' KV block size from `/server_info` (a dev-mode endpoint); 16 if none says."""
        for url in self.config.replicas:
            status, text = await self._send(url, "GET", "/server_info?config_format=json", b"",
                                            self._upstream_headers(), self.config.upstream_timeout_s)
            try:
                return int(json.loads(text)["vllm_config"]["cache_config"]["block_size"])
            except (TypeError, ValueError, KeyError):
                continue
        log.warning("no replica reported its block size: assuming 16 (vLLM's GPU default); pass --block-size")
        return 16

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

        # no credentials: vLLM serves /health without them, and a process that took over a dead
        # replica's port must not be handed the replicas' token
        try:
            timeout = aiohttp.ClientTimeout(total=min(5.0, self.config.upstream_timeout_s))
            async with self._session.get(rep.base + "/health", timeout=timeout) as r:
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
                await self._resync(rep)
                rep.healthy = True
                rep.dead.clear()
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

    async def _resync(self, rep: _Replica) -> None:
        """Replay what a returning replica missed: the adapters, then the pause state. It may have
        restarted with an empty cache, so the prefix index forgets it."""
        self.index.forget(rep.url)
        headers = {**self._upstream_headers(), "Content-Type": "application/json"}
        for name, body in list(self._adapters.items()):
            if rep.url in self._loaded.get(name, set()):
                continue
            status, text = await self._send(rep.url, "POST", "/v1/load_lora_adapter", json.dumps(body).encode(),
                                            headers, self.config.upstream_timeout_s)
            if status == 200 or (status == 400 and "already" in text):
                self._loaded.setdefault(name, set()).add(rep.url)
            else:  # logged and skipped: one bad adapter must not keep a replica out for good
                self.counters["replay_failures"] += 1
                log.warning("replaying adapter %s on %s failed (%s): skipped", name, rep.url, status)
        if self._paused:
            await self._send(rep.url, "POST", "/pause?mode=keep", b"", self._upstream_headers(),
                             self.config.upstream_timeout_s)

    def _mark_dead(self, rep: _Replica, why: str):
        was_healthy = rep.healthy
        rep.healthy = False
        rep.dead.set()
        rep.last_error = why
        if was_healthy:
            log.warning("replica %s out of rotation: %s", rep.url, why)
            for task in list(rep.waiting):  # requests waiting on it fail over now, not at their timeout
                task.colo_kit_dead = rep.url
                task.cancel()
        for names in self._loaded.values():  # it may come back without them
            names.discard(rep.url)

    # -- the front door ----------------------------------------------------------------------
    async def _handle(self, request):
        from aiohttp import web

        t0 = time.perf_counter()
        self.counters["requests"] += 1
        if self.config.client_token and not bearer_ok(request.headers.get("Authorization"), self.config.client_token):
            self.counters["refused"] += 1
            return _error(401, "missing or wrong Authorization: Bearer token for this proxy", "unauthorized")
        path = normalise_path(request.path)
        kind = route_kind(request.method, path)
        if kind is None:
            self.counters["refused"] += 1
            return _error(404, f"{request.method} {path} is not served by this proxy", "not_found")
        length = request.content_length
        if length is not None and length > self.config.max_body_mb * 2**20:
            self.counters["refused"] += 1
            return _error(413, f"body of {length} bytes is over the proxy's {self.config.max_body_mb:g} MB "
                          "(--max-body-mb)", "too_large")
        try:
            body = await asyncio.wait_for(request.read(), self.config.client_timeout_s)
        except web.HTTPRequestEntityTooLarge:
            self.counters["refused"] += 1
            return _error(413, f"body over the proxy's {self.config.max_body_mb:g} MB (--max-body-mb)", "too_large")
        except asyncio.TimeoutError:  # a client that stalls mid-body holds a socket and a handler: let both go
            self.counters["refused"] += 1
            resp = _error(408, f"the body did not arrive within {self.config.client_timeout_s:g} s; send it "
                          "whole, or raise --client-timeout-s", "request_timeout")
            resp.force_close()
            return resp
        if kind == OWN:
            return await self._own(request, path)
        if kind == BROADCAST:
            return await self._broadcast(request, path, body)
        if kind == ANY:
            return await self._to_any(request, path, body)
        return await self._route(request, path, body, t0)

    # -- routed requests ---------------------------------------------------------------------
    def _parse(self, body: bytes) -> tuple[list[bytes] | None, bool]:
        """Prompt chain and stream flag; runs in a thread (a 16 MB prompt takes a while to hash)."""
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):
            return None, False  # the replica answers a malformed request with its own 400
        stream = bool(payload.get("stream")) if isinstance(payload, dict) else False
        return self.keyer.chain(payload), stream

    def _pick(self, chain: list[bytes] | None, exclude: set[str]) -> tuple[_Replica, bool]:
        healthy = [u for u, r in self.replicas.items() if r.healthy and u not in exclude]
        if not healthy:  # everything looks dead: try the ones not yet tried rather than fail outright
            healthy = [u for u in self.replicas if u not in exclude]
        if not healthy:
            raise LookupError("no replica left to try")
        if self.config.policy == "round_robin":
            self._rr += 1
            return self.replicas[healthy[self._rr % len(healthy)]], False
        inflight = {u: self.replicas[u].inflight for u in healthy}
        if chain:
            where, _ = self.index.longest(chain)
            bound = load_bound(inflight, healthy, self.config.imbalance, self.config.slack)
            if where in healthy and inflight[where] + 1 <= bound:
                return self.replicas[where], True
        url, _ = choose_replica(chain[0] if chain else None, healthy, inflight, imbalance=self.config.imbalance,
                                slack=self.config.slack)
        return self.replicas[url], False

    async def _route(self, request, path, body, t0):
        if len(body) <= INLINE_PARSE_BYTES:  # TRL's requests: a thread hop would cost more than the parse
            chain, stream = self._parse(body)
        else:  # a long prompt is hashed (and maybe tokenised) off the event loop, which keeps serving others
            chain, stream = await asyncio.get_running_loop().run_in_executor(None, self._parse, body)
        headers = self._upstream_headers(request.headers)
        tried: set[str] = set()
        last_error = "no replica"
        for attempt in range(self.config.max_attempts):
            try:
                rep, hit = self._pick(chain, tried)
            except LookupError:
                break
            tried.add(rep.url)
            if attempt:
                self.counters["retries"] += 1
            if chain and self.config.policy == "affinity":
                self.index.record(chain, rep.url)
            rep.inflight += 1
            rep.requests += 1
            try:
                return await self._forward(request, rep, path, body, headers, stream, t0, hit, chain)
            except _Retryable as exc:
                last_error = f"{rep.url}: {exc}"
                rep.failures += 1
                self._mark_dead(rep, str(exc))
            finally:
                rep.inflight -= 1
        self.counters["errors"] += 1
        return _error(502, f"no replica could serve {path} (tried {sorted(tried)}; last error: {last_error})",
                      "proxy_upstream_error")

    @asynccontextmanager
    async def _waiting_on(self, rep: _Replica):
        """While the block awaits `rep`, `_mark_dead(rep)` cancels it and the block raises _Retryable
        instead: requests waiting on a replica taken out of rotation fail over at once, not at their
        timeout. A cancellation from elsewhere (the server shutting down) propagates."""
        me = asyncio.current_task()
        rep.waiting.add(me)
        try:
            yield
        except asyncio.CancelledError:
            if getattr(me, "colo_kit_dead", None) == rep.url:
                me.colo_kit_dead = None
                getattr(me, "uncancel", lambda: None)()  # Python 3.11+: the cancel was ours, and is spent
                raise _Retryable("taken out of rotation while the request waited") from None
            raise
        finally:
            rep.waiting.discard(me)

    async def _forward(self, request, rep, path, body, headers, stream, t0, hit, chain):
        import aiohttp
        from aiohttp import web

        url = rep.base + path + (f"?{request.query_string}" if request.query_string else "")
        t_send = time.perf_counter()
        upstream_cm = self._session.request(request.method, url, data=body, headers=headers)
        try:
            async with self._waiting_on(rep):
                up = await upstream_cm.__aenter__()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:  # bytes that are not HTTP too
            raise _Retryable(_describe(exc)) from exc
        try:
            resp_headers = {k: v for k, v in up.headers.items() if k.lower() not in HOP_HEADERS}
            if stream and up.status == 200:
                return await self._relay_stream(request, rep, up, resp_headers, hit, chain, t_send - t0)
            try:
                async with self._waiting_on(rep):
                    data = await up.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise _Retryable(f"died mid-response ({_describe(exc)})") from exc
            t_done = time.perf_counter()
            if up.status in (502, 503, 504):
                raise _Retryable(f"HTTP {up.status}")
            self._record(rep, hit, chain, (t_send - t0) + (time.perf_counter() - t_done))
            return web.Response(status=up.status, body=data, headers=resp_headers)
        finally:
            up.release()
            await upstream_cm.__aexit__(None, None, None)

    async def _relay_stream(self, request, rep, up, resp_headers, hit, chain, own_s):
        """Server-sent events chunk by chunk. Bytes already went to the caller, so a replica that
        fails mid-stream ends the stream with an error event (a retry would duplicate tokens); a
        caller that hangs up ends the upstream request and leaves the replica in rotation."""
        import aiohttp
        from aiohttp import web

        resp = web.StreamResponse(status=up.status, headers=resp_headers)
        await resp.prepare(request)
        first = True
        while True:
            try:
                async with self._waiting_on(rep):
                    chunk = await up.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError, _Retryable) as exc:
                self._mark_dead(rep, type(exc).__name__)
                self.counters["errors"] += 1
                msg = {"error": {"message": f"colo_kit proxy: replica {rep.url} failed mid-stream "
                                            f"({type(exc).__name__}); retry the request", "type": "proxy_upstream_error"}}
                try:
                    await resp.write(f"data: {json.dumps(msg)}\n\n".encode())
                except (ConnectionError, RuntimeError):
                    pass
                break
            if not chunk:
                break
            if first:
                self._record(rep, hit, chain, own_s)
                first = False
            try:
                await resp.write(chunk)
            except (ConnectionError, RuntimeError):  # the caller hung up: not the replica's fault
                self.counters["client_hangups"] += 1
                up.close()
                return resp
        try:
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            self.counters["client_hangups"] += 1
        return resp

    def _record(self, rep, hit, chain, own_s: float):
        self.counters["routed"] += 1
        if chain:
            if hit:
                self.counters["affinity_hits"] += 1
                rep.affinity_hits += 1
            elif self.config.policy == "affinity":
                self.counters["fallbacks"] += 1
        # The proxy's own time in its handler (parse, hash, choose; build the answer). The
        # benchmark measures the full added latency from outside, direct vs through the proxy.
        self._overhead_ms.append(1e3 * own_s)

    async def _to_any(self, request, path, body):
        from aiohttp import web

        query = f"?{request.query_string}" if request.query_string else ""
        for rep in sorted(self.replicas.values(), key=lambda r: not r.healthy):
            status, text = await self._send(rep.url, request.method, path + query, body,
                                            self._upstream_headers(request.headers), self.config.upstream_timeout_s)
            if status is not None:
                return web.Response(status=status, text=text, content_type=_content_type(text))
            self._mark_dead(rep, text)
        return _error(502, f"no replica answered {path}", "proxy_upstream_error")

    # -- broadcast ---------------------------------------------------------------------------
    async def _send(self, url, method, path, body, headers, timeout_s: float):
        """One request with a deadline: (status, text), or (None, why) if it failed or timed out."""
        import aiohttp

        try:
            async with self._session.request(method, self.config.upstream_urls.get(url, url) + path, data=body,
                                             headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status, (await r.read()).decode("utf-8", "replace")
        except asyncio.TimeoutError:
            return None, f"no answer within {timeout_s:g} s (--upstream-timeout-s)"
        except (aiohttp.ClientError, OSError) as exc:
            return None, _describe(exc)

    async def _broadcast(self, request, path, body):
        from aiohttp import web

        try:
            payload = json.loads(body) if body else {}
        except (ValueError, RecursionError):
            payload = None
        name = payload.get("lora_name") if isinstance(payload, dict) else None
        if path == "/v1/load_lora_adapter":
            why, resolved = vet_adapter_load(payload, self.config.adapter_root)
            if why:
                self.counters["refused"] += 1
                return _error(400, why, "invalid_adapter")
            payload = {**payload, "lora_path": resolved}  # the path as checked, not as given
            body = json.dumps(payload).encode()
        elif path == "/v1/unload_lora_adapter" and not (isinstance(name, str) and ADAPTER_NAME.fullmatch(name)):
            self.counters["refused"] += 1
            return _error(400, f"lora_name={name!r}: use letters, digits, '.', '_' and '-' only", "invalid_adapter")
        self.counters["broadcasts"] += 1
        query = f"?{request.query_string}" if request.query_string else ""
        headers = self._upstream_headers(request.headers)
        targets = [r for r in self.replicas.values() if r.healthy]
        skipped = [r.url for r in self.replicas.values() if not r.healthy]
        already: set[str] = set()
        partial = self._partial.get(name) if path == "/v1/load_lora_adapter" else None
        if partial and partial[0] == payload:  # a retry after a partial failure: only where it failed
            already = partial[1]
            targets = [r for r in targets if r.url not in already]
        results = await asyncio.gather(*(self._send(r.url, request.method, path + query, body, headers,
                                                    self.config.upstream_timeout_s) for r in targets))
        answers = {r.url: (s, t) for r, (s, t) in zip(targets, results)}
        for r, (s, t) in zip(targets, results):
            if s is None:
                self._mark_dead(r, t)  # caught up by replay when /health answers again
        ok = sorted(already | {u for u, (s, _) in answers.items() if s is not None and s < 300})
        missed = sorted({u for u, (s, _) in answers.items() if s is None} | set(skipped))
        refused = {u: (s, t) for u, (s, t) in answers.items() if s is not None and s >= 300}
        self._remember(path, name, payload, ok, refused)
        if refused and not ok:
            statuses = {s for s, _ in refused.values()}
            if len(statuses) == 1:  # the same answer everywhere: the caller's problem, pass it through
                s, t = next(iter(refused.values()))
                return web.Response(status=s, text=t, content_type=_content_type(t))
        if refused:
            self.counters["broadcast_failures"] += 1
            log.warning("broadcast %s: mixed answers (%s)", path, {u: s for u, (s, _) in refused.items()})
            return web.json_response({"error": {"message": f"colo_kit proxy: {path} failed on {len(refused)} of "
                                                f"{len(self.replicas)} replicas", "type": "proxy_broadcast_partial_failure"},
                                      "failed": [{"replica": u, "status": s, "error": t[:500]} for u, (s, t) in refused.items()],
                                      "succeeded": ok, "missed": missed}, status=502)
        if not ok:
            return _error(502, f"{path} reached no replica (missed: {missed})", "proxy_upstream_error")
        first = next((answers[u] for u in ok if u in answers), (200, "{}"))
        if missed:  # the healthy ones have it; the others get it by replay when they are back
            return web.json_response({"status": "ok", "succeeded": ok, "missed": missed,
                                      "note": "missed replicas are out of rotation and catch up when healthy"})
        return web.Response(status=first[0], text=first[1], content_type=_content_type(first[1]))

    def _remember(self, path, name, payload, ok, refused):
        if path == "/v1/load_lora_adapter" and ok and not refused:
            self._adapters[name] = payload  # loaded by every healthy replica: replay it to returning ones
            self._loaded.setdefault(name, set()).update(ok)
            self._partial.pop(name, None)
        elif path == "/v1/load_lora_adapter" and ok:
            self._partial[name] = (payload, set(ok))  # a retry goes only to the replicas that refused
        elif path == "/v1/unload_lora_adapter" and ok:
            self._adapters.pop(name, None)
            self._loaded.pop(name, None)
        elif path == "/pause" and ok:
            self._paused = True
        elif path == "/resume" and ok:
            self._paused = False

    # -- own endpoints -----------------------------------------------------------------------
    async def _own(self, request, path):
        from aiohttp import web

        if path == "/health":
            healthy = [u for u, r in self.replicas.items() if r.healthy]
            return web.json_response({"healthy_replicas": len(healthy), "replicas": len(self.replicas)},
                                     status=200 if healthy else 503)
        if path == "/get_world_size":
            sizes = await asyncio.gather(*(self._send(r.url, "GET", "/get_world_size", b"", self._upstream_headers(),
                                                      self.config.upstream_timeout_s)
                                           for r in self.replicas.values() if r.healthy))
            try:
                total = sum(json.loads(t)["world_size"] for s, t in sizes if s == 200)
            except (ValueError, KeyError, TypeError):
                total = 0
            if not total:
                return _error(502, "no replica reported its world size", "proxy_upstream_error")
            return web.json_response({"world_size": total})
        snap = self.snapshot()
        if request.query.get("format") == "json":
            return web.json_response(snap)
        return web.Response(body=_prometheus_text(snap), content_type="text/plain")

    def snapshot(self) -> dict:
        """Counters as a dict: the same numbers /metrics serves, and nothing secret."""
        reqs = [r.requests for r in self.replicas.values()]
        mean = sum(reqs) / len(reqs) if reqs else 0
        lat = sorted(self._overhead_ms)

        def q(p):
            return round(lat[min(len(lat) - 1, int(p * len(lat)))], 4) if lat else None

        return {**self.counters, "policy": self.config.policy, "block_size": self.config.block_size,
                "load_imbalance_max_over_mean": round(max(reqs) / mean, 4) if mean else None,
                "affinity_hit_rate": round(self.counters["affinity_hits"] / self.counters["routed"], 4)
                if self.counters["routed"] else None,
                "prefix_index_entries": len(self.index),
                "proxy_handler_ms": {"p50": q(0.50), "p90": q(0.90), "p99": q(0.99), "n": len(lat)},
                "adapters": sorted(self._adapters),
                "replicas": {u: {"healthy": r.healthy, "requests": r.requests, "inflight": r.inflight,
                                 "failures": r.failures, "affinity_hits": r.affinity_hits, "last_error": r.last_error}
                             for u, r in self.replicas.items()}}


def _describe(exc: BaseException) -> str:
    """An upstream error in one short line (aiohttp's parser errors span several)."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def _content_type(text: str) -> str:
    return "application/json" if text[:1] in "{[" else "text/plain"


def _error(status: int, message: str, kind: str):
    from aiohttp import web

    return web.json_response({"error": {"message": f"colo_kit proxy: {message}", "type": kind}}, status=status)


def _prometheus_text(snap: dict) -> bytes:
    """The snapshot in Prometheus' text format, written by prometheus_client."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

    class Snapshot:
        def collect(self):
            for name in ("requests", "routed", "affinity_hits", "fallbacks", "retries", "errors", "refused",
                         "broadcasts", "broadcast_failures", "recoveries", "replay_failures", "client_hangups"):
                yield CounterMetricFamily(f"colo_proxy_{name}", f"proxy {name.replace('_', ' ')}", value=snap[name])
            for name in ("requests", "inflight", "failures", "affinity_hits", "healthy"):
                g = GaugeMetricFamily(f"colo_proxy_replica_{name}", f"per replica: {name}", labels=["replica"])
                for url, r in snap["replicas"].items():
                    g.add_metric([url], float(r[name]))
                yield g
            yield GaugeMetricFamily("colo_proxy_load_imbalance", "max over mean requests per replica",
                                    value=snap["load_imbalance_max_over_mean"] or 0)
            lat = snap["proxy_handler_ms"]
            yield SummaryMetricFamily("colo_proxy_handler_latency_ms", "the proxy's own time per request",
                                      count_value=lat["n"], sum_value=0.0)
            q = GaugeMetricFamily("colo_proxy_handler_latency_ms_quantile", "handler time quantiles",
                                  labels=["quantile"])
            for p in ("p50", "p90", "p99"):
                q.add_metric([f"0.{p[1:]}"], float(lat[p]) if lat[p] is not None else math.nan)
            yield q

    registry = CollectorRegistry()
    registry.register(Snapshot())
    return generate_latest(registry)


def percentile(values, p: float) -> float:
    """Nearest-rank percentile, for the benchmark and the notebook."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))] if s else float("nan")
