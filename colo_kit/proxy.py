"""The routing proxy of the second post: several vLLM replicas that TRL sees as one server.

TRL's `AsyncGRPOTrainer` talks to one URL (`vllm_server_base_url`). In the post, two vLLM jobs
serve the base model plus the latest LoRA adapters, and a proxy beside the trainer makes them look
like one server. This module serves that proxy on aiohttp; what it decides is `colo_kit.routing`.

- **Who may use it.** On loopback, any local process, as TRL's client sends no credentials. With
  `client_token_env` every request must carry `Authorization: Bearer <that token>` (401 otherwise);
  binding anything but loopback without it is refused at start. The client's header never travels
  on: upstream requests carry the replicas' own token (`token_env`). Health polls carry none, but a
  challenge: a replica that has proved it holds the key (`colo_kit.replica_auth`) is sent the token
  only while it proves it, so a process that takes its port after it dies learns nothing. A
  replica URL's password is shown nowhere (`user:***@`). Settings: `colo_kit.proxy_config`.
- **How long it waits for a client.** A request's head must arrive within `client_timeout_s` of
  the connection opening (or of the previous answer), and its body within as long again; a socket
  that sends nothing is closed, so idle sockets cannot use up the proxy's file descriptors.
- **What it forwards.** The routes of `routing.ROUTES` only (404 otherwise, without touching a
  replica); paths are normalised first. Adapter loads need `adapter_root` and a path inside it.
  Bodies over `max_body_mb` get 413 before they are read whole; prompts are parsed and hashed off
  the event loop, and a text prompt is tokenised only as far as the blocks routing reads, so one
  huge prompt does not stall `/health` for everyone.
- **Where it sends.** A completion goes to the replica that holds the longest known prefix of its
  prompt (`routing.PrefixIndex`), within a bound on load; a broadcast goes to every healthy replica.
- **Faults, bounded.** Broadcasts and health checks wait at most `upstream_timeout_s`. A request that
  fails on a replica (a 502/503/504, a timeout, a broken answer) fails over alone, and the replica
  gets no new requests until its next good health poll; the others it is answering carry on. A
  replica whose health polls fail is dropped: its in-flight requests fail over at once. When
  `/health` answers again it is caught up (adapters, pause state) and taken back. A replay that
  fails is logged and skipped: a replica is never locked out by one bad adapter. A client that
  hangs up closes its upstream connection (vLLM then aborts the request) and nothing more. Uniform
  answers of a broadcast (every replica said 400, say) pass through as they are; 502 is for mixed
  results, and a retry converges: "already loaded" (the same adapter) or "not found" (an unload)
  counts as done where other replicas did it.
- **What it tells.** `/health` (no secrets), `/metrics` (Prometheus text through
  `prometheus_client`, or JSON with `?format=json`): per-replica requests, in-flight, health,
  affinity hits, fallbacks, retries, load imbalance and the proxy's own handler time.

`colo-kit proxy` (colo_kit.proxy_cli) starts it from a shell.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from collections import deque
from contextlib import asynccontextmanager

from colo_kit.proxy_config import ProxyConfig  # noqa: F401  (colo_kit.proxy.ProxyConfig, as before)
from colo_kit.replica_auth import CHALLENGE_HEADER, PROOF_HEADER, KeyProof, new_challenge
from colo_kit.routing import (ADAPTER_NAME, ANY, BROADCAST, OWN, PrefixIndex, PrefixKeyer, already_done, bearer_ok,
                              choose_replica, load_bound, normalise_path, route_kind, vet_adapter_load)

log = logging.getLogger("colo_kit.proxy")

INLINE_PARSE_BYTES = 64 * 1024  # bodies up to this are parsed on the event loop (well under a millisecond)

# Headers that describe one hop, not the message (RFC 9110 7.6.1), plus the ones aiohttp recomputes
# and the client's credentials (replaced by the replicas' own upstream).
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                         "trailer", "transfer-encoding", "upgrade", "host", "content-length", "authorization"})


# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------

class _Replica:
    def __init__(self, url: str, base: str, token: str | None):
        self.url = url  # as shown: in logs, answers and metrics
        self.base = base  # as requested: with the URL's credentials, if any
        self.healthy = True  # optimistic until the first poll says otherwise; False: no new requests
        self.dropped = False  # its health polls failed: the requests waiting on it were failed over
        self.dead = asyncio.Event()  # set while out of rotation
        self.waiting: set[asyncio.Task] = set()  # upstream calls in flight: cancelled when it is dropped
        self.proof = KeyProof(token, base, url) if token else None  # has it proved it holds the replicas' key?
        self.inflight = 0
        self.requests = 0
        self.failures = 0
        self.affinity_hits = 0
        self.last_error: str | None = None
        self.failed_polls = 0

    @property
    def trusted(self) -> bool:
        """False while what answers on its port cannot prove the key it proved before: never sent the token."""
        return self.proof is None or self.proof.trusted


class _Retryable(Exception):
    """The request never produced an answer on this replica: try another one."""


class _HungUp(Exception):
    """The caller hung up while its answer streamed: not the replica's fault."""

    def __init__(self, response):
        super().__init__("the caller hung up")
        self.response = response


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

        self.replicas = {u: _Replica(u, self.config.upstream_urls[u], self.config.token) for u in self.config.replicas}
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
        # handler_cancellation: a client that hangs up cancels its handler, which closes the upstream
        # connection, and vLLM aborts a request whose connection closes (aiohttp's default since 3.9
        # is to let the handler run on: the replica kept generating for nobody).
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True,
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
        """One health poll: True when `rep` answered 200 and, once it has proved that it holds the
        replicas' key, proved it again (colo_kit.replica_auth)."""
        import aiohttp

        # No credentials: vLLM serves /health without them, and a process that took over a dead
        # replica's port must not be handed the replicas' token. With a token, a fresh challenge:
        # a replica started by colo_kit.lora.replica_launch answers it with a proof of the key, and
        # one that has proved it once is taken back, and sent the token, only while it proves it.
        challenge = new_challenge() if self.config.token else None
        try:
            timeout = aiohttp.ClientTimeout(total=min(5.0, self.config.upstream_timeout_s))
            async with self._session.get(rep.base + "/health", timeout=timeout,
                                         headers={CHALLENGE_HEADER: challenge} if challenge else None) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"/health answered {r.status}")
                answer = r.headers.get(PROOF_HEADER)
        except aiohttp.ClientConnectorError as exc:  # nothing listening: dead now
            rep.last_error = type(exc).__name__
            rep.failed_polls = self.config.health_failures_to_drop
            return False
        except Exception as exc:  # slow or odd answer: dropped only if it repeats (a busy host is not a dead one)
            rep.last_error = type(exc).__name__
            rep.failed_polls += 1
            return False
        if challenge is not None and not rep.proof.verify(challenge, answer):  # colo_kit.replica_auth.KeyProof
            rep.last_error = ("answers /health without the proof of the replicas' key it gave before: another "
                              "process on its port? Not sent the token; restart the replica")
            rep.failed_polls = self.config.health_failures_to_drop
            return False
        rep.failed_polls = 0
        return True

    async def _poll_health(self):
        reps = list(self.replicas.values())
        results = await asyncio.gather(*(self._probe(r) for r in reps))
        for rep, ok in zip(reps, results):
            if ok and not rep.healthy:
                await self._resync(rep)
                rep.healthy = True
                rep.dropped = False
                rep.dead.clear()
                self.counters["recoveries"] += 1
                log.warning("replica %s is back", rep.url)
            elif not ok and rep.failed_polls >= self.config.health_failures_to_drop:
                self._mark_dead(rep, rep.last_error or "health check failed", drop=True)

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
            if status == 200 or (already_done("/v1/load_lora_adapter", status, text)
                                 and await self._holds(rep, name, body.get("lora_path"))):
                self._loaded.setdefault(name, set()).add(rep.url)
            else:  # logged and skipped: one bad adapter must not keep a replica out for good
                self.counters["replay_failures"] += 1
                log.warning("replaying adapter %s on %s failed (%s): skipped", name, rep.url, status)
        if self._paused:
            await self._send(rep.url, "POST", "/pause?mode=keep", b"", self._upstream_headers(),
                             self.config.upstream_timeout_s)

    def _mark_dead(self, rep: _Replica, why: str, *, drop: bool = False):
        """Take `rep` out of rotation for new requests until a health poll finds it well again. With
        `drop` (its health polls failed: it is gone or hung) the requests waiting on it fail over now,
        not at their timeout. A single request's failure does not drop it: the other requests may
        still be answered (one 503 once re-sent four six-second requests that were being served)."""
        was_healthy = rep.healthy
        rep.healthy = False
        rep.dead.set()
        rep.last_error = why
        if was_healthy:
            log.warning("replica %s out of rotation: %s", rep.url, why)
        if drop and not rep.dropped:
            rep.dropped = True
            for task in list(rep.waiting):
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
        if kind == BROADCAST:  # shielded: a caller hanging up must not leave it half-sent and unrecorded
            return await asyncio.shield(self._broadcast(request, path, body))
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
            healthy = [u for u, r in self.replicas.items() if r.trusted and u not in exclude]
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
        if len(body) <= INLINE_PARSE_BYTES and not self.config.tokenizer:  # TRL's: a thread hop costs more
            chain, stream = self._parse(body)
        else:  # a long prompt is hashed, and a text one tokenised, off the event loop, which keeps serving others
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
            except _Retryable as exc:  # this request fails over; the others on `rep` carry on
                last_error = f"{rep.url}: {exc}"
                rep.failures += 1
                self._mark_dead(rep, str(exc))
            except _HungUp as exc:  # counted here only, once: a failed write is followed by the cancellation
                self.counters["client_hangups"] += 1
                return exc.response
            except asyncio.CancelledError:  # the caller hung up (handler_cancellation), or the proxy stops
                self.counters["client_hangups"] += 1
                raise
            finally:
                rep.inflight -= 1
        self.counters["errors"] += 1
        return _error(502, f"no replica could serve {path} (tried {sorted(tried)}; last error: {last_error})",
                      "proxy_upstream_error")

    @asynccontextmanager
    async def _waiting_on(self, rep: _Replica):
        """While the block awaits `rep`, `_mark_dead(rep, drop=True)` cancels it and the block raises
        _Retryable instead: requests waiting on a replica whose health polls failed fail over at once,
        not at their timeout. A cancellation from elsewhere (the server shutting down) propagates."""
        me = asyncio.current_task()
        rep.waiting.add(me)
        try:
            yield
        except asyncio.CancelledError:
            if getattr(me, "colo_kit_dead", None) == rep.url:
                me.colo_kit_dead = None
                getattr(me, "uncancel", lambda: None)()  # Python 3.11+: the cancel was ours, and is spent
                raise _Retryable("dropped by its health polls while the request waited") from None
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
        except asyncio.CancelledError:
            up.close()  # not back to the pool: the replica sees the connection close and aborts the request
            raise
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
                up.close()
                raise _HungUp(resp) from None
        try:
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            raise _HungUp(resp) from None
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
        for rep in sorted((r for r in self.replicas.values() if r.trusted), key=lambda r: not r.healthy):
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
        done = already | {u for u, (s, _) in answers.items() if s is not None and s < 300}
        converged = set()  # "already loaded" (the same adapter) or "not found" where others did it
        if done:  # when every replica says so, it is the caller's answer, passed through below
            for u, (s, t) in answers.items():
                if already_done(path, s, t) and (path != "/v1/load_lora_adapter"
                                                 or await self._holds(self.replicas[u], name, payload["lora_path"])):
                    converged.add(u)
        ok = sorted(done | converged)
        missed = sorted({u for u, (s, _) in answers.items() if s is None} | set(skipped))
        refused = {u: (s, t) for u, (s, t) in answers.items() if s is not None and s >= 300 and u not in converged}
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
        first = next((answers[u] for u in ok if u in answers and u not in converged), (200, '{"status": "ok"}'))
        if missed:  # the healthy ones have it; the others get it by replay when they are back
            return web.json_response({"status": "ok", "succeeded": ok, "missed": missed,
                                      "note": "missed replicas are out of rotation and catch up when healthy"})
        return web.Response(status=first[0], text=first[1], content_type=_content_type(first[1]))

    async def _holds(self, rep: _Replica, name, lora_path) -> bool:
        """Whether `rep` serves adapter `name` from `lora_path` (`/v1/models` lists each adapter with its
        path): "already loaded" is success for the same adapter only, not for a stale one of that name."""
        status, text = await self._send(rep.url, "GET", "/v1/models", b"", self._upstream_headers(),
                                        self.config.upstream_timeout_s)
        try:
            return status == 200 and any(m.get("id") == name and m.get("root") == lora_path
                                         for m in json.loads(text)["data"])
        except (ValueError, KeyError, TypeError, AttributeError):
            return False

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
