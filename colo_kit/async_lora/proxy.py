"""The routing proxy of the second post (notebook 06): several vLLM replicas that TRL's `AsyncGRPOTrainer` sees as one
`vllm_server_base_url`; a completion goes to the replica holding its longest known prefix, a state change to every replica.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

from colo_kit.async_lora.proxy_config import ProxyConfig  # noqa: F401  (notebook 06 imports it from here)
from colo_kit.async_lora.proxy_metrics import ProxyMetrics
from colo_kit.async_lora.proxy_replicas import Broadcaster, HungUp, Replica, Retryable, content_type, describe, error
from colo_kit.async_lora.routing import (ANY, BROADCAST, OWN, PrefixIndex, PrefixKeyer, bearer_ok, choose_replica, load_bound,
                                         normalise_path, route_kind)

log = logging.getLogger("colo_kit.async_lora.proxy")

INLINE_PARSE_BYTES = 64 * 1024  # bodies up to this are parsed on the event loop (well under a millisecond)
RETRY_AFTER_S = 1  # a 503's Retry-After: TRL's client (urllib3's Retry) waits this long before it tries again

# one hop's headers (RFC 9110 7.6.1), those aiohttp recomputes, and the client's credentials
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                         "trailer", "transfer-encoding", "upgrade", "host", "content-length", "authorization"})


def connection_cap() -> int:
    """Client connections the proxy keeps open: 3/4 of its descriptor limit (raised to the hard limit first)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # a hard limit the kernel will not grant: keep the soft one
            pass
    return max(8, 3 * min(soft, 1 << 20) // 4 - 16)


def _close_idle_past(server, cap: int, counters: dict) -> None:
    """Past `cap` client connections, each new one closes the oldest idle ones, so silent sockets cannot starve a trainer."""
    made = server.connection_made

    def connection_made(handler, transport):
        made(handler, transport)
        extra = len(server.connections) - cap
        if extra > 0:
            idle = [h for h in server.connections  # oldest first; an aiohttp without the flag: none counts as idle
                    if h is not handler and not getattr(h, "_request_in_progress", True)]
            for h in idle[:extra]:
                h.force_close()
                counters["idle_closed"] += 1

    server.connection_made = connection_made


class RoutingProxy:
    """The proxy: `await start()`, `await stop()`, or `start_in_thread()` from notebooks and tests."""

    def __init__(self, config: ProxyConfig):
        self.config = config.validate()
        self.keyer: PrefixKeyer | None = None  # made at start, once the block size is known
        self.index = PrefixIndex(config.prefix_index_size)
        self.replicas: dict[str, Replica] = {}
        self._rr = 0
        self.broadcaster = Broadcaster(self)  # what every replica must see, replayed to one that returns
        self.metrics = ProxyMetrics(self.snapshot)
        self.counters = self.metrics.counters
        self._session = None
        self._runner = None
        self._health_task = None
        self._loop = None
        self._thread = None
        self.url = None

    def _upstream_headers(self, incoming=None) -> dict:
        headers = {k: v for k, v in incoming.items() if k.lower() not in HOP_HEADERS} if incoming is not None else {}
        if self.config.token:
            headers["Authorization"] = f"Bearer {self.config.token}"
        return headers

    async def start(self):
        import aiohttp
        from aiohttp import web

        self.replicas = {u: Replica(u, self.config.upstream_urls[u], self.config.token) for u in self.config.replicas}
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s, sock_connect=self.config.connect_timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
                                              connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30))
        await self._poll_health()  # first: the token goes only to replicas that proved the key
        if self.config.block_size is None:
            self.config.block_size = await self._ask_block_size()
        self.keyer = PrefixKeyer(self.config.block_size, self.config.max_prefix_blocks, self.config.tokenizer)
        app = web.Application(client_max_size=int(self.config.max_body_mb * 2**20))
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # keepalive_timeout is also aiohttp's head timeout, so silent sockets cannot use up descriptors;
        # handler_cancellation: a client that hangs up closes the upstream connection, and vLLM aborts the request
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True,
                                     keepalive_timeout=self.config.client_timeout_s,
                                     lingering_time=min(10.0, self.config.client_timeout_s))
        await self._runner.setup()
        _close_idle_past(self._runner.server, connection_cap(), self.counters)
        site = web.TCPSite(self._runner, self.config.host, self.config.port, reuse_address=True)
        try:
            await site.start()
        except OSError:
            await self.stop()
            raise
        port = self._runner.addresses[0][1]
        self.url = f"http://{self.config.host}:{port}"
        self._health_task = asyncio.create_task(self._health_loop())
        log.info("proxy on %s -> %s (policy=%s, block_size=%d, replica auth=%s, client auth=%s)", self.url,
                 list(self.replicas), self.config.policy, self.config.block_size,
                 "on" if self.config.token else "off", "on" if self.config.client_token else "off")
        return self

    async def _ask_block_size(self) -> int:
        """The replicas' KV block size from `/server_info` (a dev-mode endpoint); 16 if none says."""
        for url in (u for u, r in self.replicas.items() if r.healthy):
            status, text = await self._send(url, "GET", "/server_info?config_format=json")
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
        """Serve from a background thread with its own event loop."""
        ready, errors = threading.Event(), []

        def run():
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self.start())
            except BaseException as exc:  # surface bind errors etc. to the caller
                errors.append(exc)
                return
            finally:
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

    async def _poll_health(self):
        reps = list(self.replicas.values())
        results = await asyncio.gather(*(r.probe(self._session, challenge=bool(self.config.token),
                                                 timeout_s=self.config.upstream_timeout_s,
                                                 failures_to_drop=self.config.health_failures_to_drop) for r in reps))
        for rep, ok in zip(reps, results):
            if ok and not rep.healthy:
                self.index.forget(rep.url)  # it may have restarted with an empty cache
                await self.broadcaster.replay(rep)
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

    def _mark_dead(self, rep: Replica, why: str, *, drop: bool = False):
        """Out of rotation; it may come back without its adapters."""
        rep.take_out(why, drop=drop)
        self.broadcaster.forget(rep.url)

    async def _handle(self, request):
        from aiohttp import web

        t0 = time.perf_counter()
        self.counters["requests"] += 1
        if self.config.client_token and not bearer_ok(request.headers.get("Authorization"), self.config.client_token):
            self.counters["refused"] += 1
            return error(401, "missing or wrong Authorization: Bearer token for this proxy", "unauthorized")
        path = normalise_path(request.path)
        kind = route_kind(request.method, path)
        if kind is None:
            self.counters["refused"] += 1
            return error(404, f"{request.method} {path} is not served by this proxy", "not_found")
        length = request.content_length
        if length is not None and length > self.config.max_body_mb * 2**20:
            self.counters["refused"] += 1
            return error(413, f"body of {length} bytes is over the proxy's {self.config.max_body_mb:g} MB "
                          "(--max-body-mb)", "too_large")
        try:
            body = await asyncio.wait_for(request.read(), self.config.client_timeout_s)
        except web.HTTPRequestEntityTooLarge:
            self.counters["refused"] += 1
            return error(413, f"body over the proxy's {self.config.max_body_mb:g} MB (--max-body-mb)", "too_large")
        except ConnectionError:  # the client closed mid-body: counted, not logged as aiohttp's traceback
            self.counters["client_hangups"] += 1
            resp = error(400, "the connection closed before the body arrived", "client_hangup")
            resp.force_close()
            return resp
        except asyncio.CancelledError:  # the same hang-up, read in the handler's task (3.12's wait_for): cancelled
            self.counters["client_hangups"] += 1
            raise
        except asyncio.TimeoutError:  # a client that stalls mid-body holds a socket and a handler: let both go
            self.counters["refused"] += 1
            resp = error(408, f"the body did not arrive within {self.config.client_timeout_s:g} s; send it "
                          "whole, or raise --client-timeout-s", "request_timeout")
            resp.force_close()
            return resp
        if kind == OWN:
            return await self._own(request, path)
        if kind == BROADCAST:  # shielded: a caller hanging up must not leave it half-sent and unrecorded
            return await asyncio.shield(self.broadcaster.send(request, path, body))
        if kind == ANY:
            return await self._to_any(request, path, body)
        return await self._route(request, path, body, t0)

    def _parse(self, body: bytes) -> tuple[list[bytes] | None, bool]:
        """Prompt chain and stream flag; runs in a thread (a 16 MB prompt takes a while to hash)."""
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):
            return None, False  # the replica answers a malformed request with its own 400
        stream = bool(payload.get("stream")) if isinstance(payload, dict) else False
        return self.keyer.chain(payload), stream

    def _pick(self, chain: list[bytes] | None, exclude: set[str]) -> tuple[Replica, bool]:
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
        last_error, busy = "no replica", True  # busy: no replica took the connection (down or overloaded)
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
            except Retryable as exc:  # this request fails over; the others on `rep` carry on
                last_error, busy = f"{rep.url}: {exc}", busy and exc.busy
                rep.failures += 1
                self._mark_dead(rep, str(exc))
            except HungUp as exc:  # counted here only, once: a failed write is followed by the cancellation
                self.counters["client_hangups"] += 1
                return exc.response
            except asyncio.CancelledError:  # the caller hung up (handler_cancellation), or the proxy stops
                self.counters["client_hangups"] += 1
                raise
            finally:
                rep.inflight -= 1
        message = f"no replica could serve {path} (tried {sorted(tried)}; last error: {last_error})"
        if busy:  # shed: the caller retries later, rather than fail on a 502
            self.counters["shed"] += 1
            resp = error(503, f"{message}; retry after {RETRY_AFTER_S} s", "proxy_overloaded")
            resp.headers["Retry-After"] = str(RETRY_AFTER_S)
            return resp
        self.counters["errors"] += 1
        return error(502, message, "proxy_upstream_error")

    async def _forward(self, request, rep, path, body, headers, stream, t0, hit, chain):
        import aiohttp
        from aiohttp import web

        url = rep.base + path + (f"?{request.query_string}" if request.query_string else "")
        t_send = time.perf_counter()
        upstream_cm = self._session.request(request.method, url, data=body, headers=headers)
        try:
            async with rep.waiting_on():
                up = await upstream_cm.__aenter__()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:  # bytes that are not HTTP too
            busy = isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))
            raise Retryable(describe(exc), busy) from exc
        try:
            resp_headers = {k: v for k, v in up.headers.items() if k.lower() not in HOP_HEADERS}
            if stream and up.status == 200:
                return await self._relay_stream(request, rep, up, resp_headers, hit, chain, t_send - t0)
            try:
                async with rep.waiting_on():
                    data = await up.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise Retryable(f"died mid-response ({describe(exc)})") from exc
            t_done = time.perf_counter()
            if up.status in (502, 503, 504):
                raise Retryable(f"HTTP {up.status}")
            self.metrics.record(rep, hit, chain, self.config.policy, (t_send - t0) + (time.perf_counter() - t_done))
            return web.Response(status=up.status, body=data, headers=resp_headers)
        except asyncio.CancelledError:
            up.close()  # not back to the pool: the replica sees the connection close and aborts the request
            raise
        finally:
            up.release()
            await upstream_cm.__aexit__(None, None, None)

    async def _relay_stream(self, request, rep, up, resp_headers, hit, chain, own_s):
        """Server-sent events chunk by chunk; a replica failing mid-stream ends it with an error event (no retry: it would
        duplicate tokens the caller already has)."""
        import aiohttp
        from aiohttp import web

        resp = web.StreamResponse(status=up.status, headers=resp_headers)
        await resp.prepare(request)
        first = True
        while True:
            try:
                async with rep.waiting_on():
                    chunk = await up.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError, Retryable) as exc:
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
                self.metrics.record(rep, hit, chain, self.config.policy, own_s)
                first = False
            try:
                await resp.write(chunk)
            except (ConnectionError, RuntimeError):  # the caller hung up: not the replica's fault
                up.close()
                raise HungUp(resp) from None
        try:
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            raise HungUp(resp) from None
        return resp

    async def _to_any(self, request, path, body):
        from aiohttp import web

        query = f"?{request.query_string}" if request.query_string else ""
        for rep in sorted((r for r in self.replicas.values() if r.trusted), key=lambda r: not r.healthy):
            status, text = await self._send(rep.url, request.method, path + query, body, self._upstream_headers(request.headers))
            if status is not None:
                return web.Response(status=status, text=text, content_type=content_type(text))
            self._mark_dead(rep, text)
        return error(502, f"no replica answered {path}", "proxy_upstream_error")

    async def _send(self, url: str, method: str, path: str, body: bytes = b"", headers: dict | None = None):
        """One request to replica `url` within --upstream-timeout-s: (status, text), or (None, why)."""
        import aiohttp

        timeout_s = self.config.upstream_timeout_s
        try:
            async with self._session.request(method, self.config.upstream_urls.get(url, url) + path, data=body,
                                             headers=self._upstream_headers() if headers is None else headers,
                                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status, (await r.read()).decode("utf-8", "replace")
        except asyncio.TimeoutError:
            return None, f"no answer within {timeout_s:g} s (--upstream-timeout-s)"
        except (aiohttp.ClientError, OSError) as exc:
            return None, describe(exc)

    async def _own(self, request, path):
        from aiohttp import web

        if path == "/health":
            healthy = [u for u, r in self.replicas.items() if r.healthy]
            return web.json_response({"healthy_replicas": len(healthy), "replicas": len(self.replicas)},
                                     status=200 if healthy else 503)
        if path == "/get_world_size":
            sizes = await asyncio.gather(*(self._send(r.url, "GET", "/get_world_size") for r in self.replicas.values()
                                           if r.healthy))
            try:
                total = sum(json.loads(t)["world_size"] for s, t in sizes if s == 200)
            except (ValueError, KeyError, TypeError):
                total = 0
            if not total:
                return error(502, "no replica reported its world size", "proxy_upstream_error")
            return web.json_response({"world_size": total})
        if request.query.get("format") == "json":
            return web.json_response(self.snapshot())
        return web.Response(body=self.metrics.prometheus_text(), content_type="text/plain")

    def snapshot(self) -> dict:
        """Counters as a dict: the same numbers /metrics serves, and nothing secret."""
        reqs = [r.requests for r in self.replicas.values()]
        mean = sum(reqs) / len(reqs) if reqs else 0
        return {**self.counters, "policy": self.config.policy, "block_size": self.config.block_size,
                "load_imbalance_max_over_mean": round(max(reqs) / mean, 4) if mean else None,
                "affinity_hit_rate": round(self.counters["affinity_hits"] / self.counters["routed"], 4)
                if self.counters["routed"] else None,
                "prefix_index_entries": len(self.index),
                "proxy_handler_ms": self.metrics.handler_ms(),
                "adapters": sorted(self.broadcaster.adapters),
                "replicas": {u: {"healthy": r.healthy, "requests": r.requests, "inflight": r.inflight,
                                 "failures": r.failures, "affinity_hits": r.affinity_hits, "last_error": r.last_error}
                             for u, r in self.replicas.items()}}
