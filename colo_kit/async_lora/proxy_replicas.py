"""The replicas behind the routing proxy (notebook 06): health, key proof, taking one out of rotation, and the broadcasts
every replica must see, replayed to one that comes back."""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager

from colo_kit.async_lora.replica_auth import CHALLENGE_HEADER, PROOF_HEADER, KeyProof, new_challenge
from colo_kit.async_lora.routing import ADAPTER_NAME, already_done, vet_adapter_load

log = logging.getLogger("colo_kit.async_lora.proxy")


class Retryable(Exception):
    """No answer from this replica: try another. `busy`: it took no connection (refused, or a full accept queue)."""

    def __init__(self, why: str, busy: bool = False):
        super().__init__(why)
        self.busy = busy


class HungUp(Exception):
    """The caller hung up while its answer streamed: not the replica's fault."""

    def __init__(self, response):
        super().__init__("the caller hung up")
        self.response = response


class Replica:
    """One replica: where it is, whether it gets new requests, and its counters."""

    def __init__(self, url: str, base: str, token: str | None):
        self.url = url  # as shown: in logs, answers and metrics
        self.base = base  # as requested: with the URL's credentials, if any
        self.healthy = True  # optimistic until the first poll says otherwise; False: no new requests
        self.dropped = False  # its health polls failed: the requests waiting on it were failed over
        self.dead = asyncio.Event()  # set while out of rotation
        self.waiting: set[asyncio.Task] = set()  # upstream calls in flight: cancelled when it is dropped
        self.proof = KeyProof(token, base) if token else None  # has it proved it holds the replicas' key?
        self.inflight = 0
        self.requests = 0
        self.failures = 0
        self.affinity_hits = 0
        self.last_error: str | None = None
        self.failed_polls = 0

    @property
    def trusted(self) -> bool:
        """Whether its last health poll proved the replicas' key (else it is never sent the token)."""
        return self.proof is None or self.proof.trusted

    async def probe(self, session, *, challenge: bool, timeout_s: float, failures_to_drop: int) -> bool:
        """One health poll: True on a 200 with the key's proof; it sends only a fresh challenge, never credentials."""
        import aiohttp

        nonce = new_challenge() if challenge else None
        try:
            timeout = aiohttp.ClientTimeout(total=min(5.0, timeout_s))
            async with session.get(self.base + "/health", timeout=timeout,
                                   headers={CHALLENGE_HEADER: nonce} if nonce else None) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"/health answered {r.status}")
                answer = r.headers.get(PROOF_HEADER)
        except aiohttp.ClientConnectorError as exc:  # nothing listening: dead now
            self.last_error = type(exc).__name__
            self.failed_polls = failures_to_drop
            return False
        except Exception as exc:  # slow or odd answer: dropped only if it repeats (a busy host is not a dead one)
            self.last_error = type(exc).__name__
            self.failed_polls += 1
            return False
        if nonce is not None and not self.proof.verify(nonce, answer):
            self.last_error = ("answers /health without the proof of the replicas' key it gave before: another "
                               "process on its address? Not sent the token; restart the replica" if self.proof.proved
                               else "has not proved it holds the replicas' key (start it with colo_kit.async_lora."
                               "lora.replica_launch(api_key_env=...)): not sent the token until it does")
            self.failed_polls = failures_to_drop
            return False
        self.failed_polls = 0
        return True

    def take_out(self, why: str, *, drop: bool = False) -> None:
        """Out of rotation until a health poll finds it well; with `drop` (failed polls) its waiting requests fail over now."""
        was_healthy = self.healthy
        self.healthy = False
        self.dead.set()
        self.last_error = why
        if was_healthy:
            log.warning("replica %s out of rotation: %s", self.url, why)
        if drop and not self.dropped:
            self.dropped = True
            for task in list(self.waiting):
                task.colo_kit_dead = self.url
                task.cancel()

    @asynccontextmanager
    async def waiting_on(self):
        """While the block awaits this replica, `take_out(drop=True)` cancels it and the block raises Retryable."""
        me = asyncio.current_task()
        self.waiting.add(me)
        try:
            yield
        except asyncio.CancelledError:
            if getattr(me, "colo_kit_dead", None) == self.url:
                me.colo_kit_dead = None
                getattr(me, "uncancel", lambda: None)()  # Python 3.11+: the cancel was ours, and is spent
                raise Retryable("dropped by its health polls while the request waited") from None
            raise
        finally:
            self.waiting.discard(me)


class Broadcaster:
    """What every replica must see (adapter loads, pause, cache resets...) and what each holds, to catch up a returning one."""

    def __init__(self, proxy):
        self.proxy = proxy
        self.adapters: dict[str, dict] = {}  # name -> load body, replayed on a recovered replica
        self.loaded: dict[str, set[str]] = {}  # name -> replicas that hold it
        self.partial: dict[str, tuple[dict, set[str]]] = {}  # name -> (load body, replicas that loaded it)
        self.paused = False

    async def send(self, request, path, body):
        """One broadcast from a caller, and the one answer it gets."""
        from aiohttp import web

        p, counters = self.proxy, self.proxy.counters
        try:
            payload = json.loads(body) if body else {}
        except (ValueError, RecursionError):
            payload = None
        name = payload.get("lora_name") if isinstance(payload, dict) else None
        if path == "/v1/load_lora_adapter":
            why, resolved = vet_adapter_load(payload, p.config.adapter_root)
            if why:
                counters["refused"] += 1
                return error(400, why, "invalid_adapter")
            payload = {**payload, "lora_path": resolved}  # the path as checked, not as given
            body = json.dumps(payload).encode()
        elif path == "/v1/unload_lora_adapter" and not (isinstance(name, str) and ADAPTER_NAME.fullmatch(name)):
            counters["refused"] += 1
            return error(400, f"lora_name={name!r}: use letters, digits, '.', '_' and '-' only", "invalid_adapter")
        counters["broadcasts"] += 1
        query = f"?{request.query_string}" if request.query_string else ""
        headers = p._upstream_headers(request.headers)
        targets = [r for r in p.replicas.values() if r.healthy]
        skipped = [r.url for r in p.replicas.values() if not r.healthy]
        already: set[str] = set()
        partial = self.partial.get(name) if path == "/v1/load_lora_adapter" else None
        if partial and partial[0] == payload:  # a retry after a partial failure: only where it failed
            already = partial[1]
            targets = [r for r in targets if r.url not in already]
        results = await asyncio.gather(*(p._send(r.url, request.method, path + query, body, headers) for r in targets))
        answers = {r.url: (s, t) for r, (s, t) in zip(targets, results)}
        for r, (s, t) in zip(targets, results):
            if s is None:
                p._mark_dead(r, t)  # caught up by replay when /health answers again
        done = already | {u for u, (s, _) in answers.items() if s is not None and s < 300}
        converged = set()  # "already loaded" (the same adapter) or "not found" where others did it
        if done:  # when every replica says so, it is the caller's answer, passed through below
            for u, (s, t) in answers.items():
                if already_done(path, s, t) and (path != "/v1/load_lora_adapter"
                                                 or await self.holds(p.replicas[u], name, payload["lora_path"])):
                    converged.add(u)
        ok = sorted(done | converged)
        missed = sorted({u for u, (s, _) in answers.items() if s is None} | set(skipped))
        refused = {u: (s, t) for u, (s, t) in answers.items() if s is not None and s >= 300 and u not in converged}
        self.remember(path, name, payload, ok, refused)
        if refused and not ok and len({s for s, _ in refused.values()}) == 1:  # the same answer everywhere: pass it on
            s, t = next(iter(refused.values()))
            return web.Response(status=s, text=t, content_type=content_type(t))
        if refused:
            counters["broadcast_failures"] += 1
            log.warning("broadcast %s: mixed answers (%s)", path, {u: s for u, (s, _) in refused.items()})
            return web.json_response({"error": {"message": f"colo_kit proxy: {path} failed on {len(refused)} of "
                                                f"{len(p.replicas)} replicas", "type": "proxy_broadcast_partial_failure"},
                                      "failed": [{"replica": u, "status": s, "error": t[:500]} for u, (s, t) in refused.items()],
                                      "succeeded": ok, "missed": missed}, status=502)
        if not ok:
            return error(502, f"{path} reached no replica (missed: {missed})", "proxy_upstream_error")
        first = next((answers[u] for u in ok if u in answers and u not in converged), (200, '{"status": "ok"}'))
        if missed:  # the healthy ones have it; the others get it by replay when they are back
            return web.json_response({"status": "ok", "succeeded": ok, "missed": missed,
                                      "note": "missed replicas are out of rotation and catch up when healthy"})
        return web.Response(status=first[0], text=first[1], content_type=content_type(first[1]))

    async def holds(self, rep: Replica, name, lora_path) -> bool:
        """Whether `rep` serves adapter `name` from `lora_path`."""
        p = self.proxy
        status, text = await p._send(rep.url, "GET", "/v1/models")
        try:
            return status == 200 and any(m.get("id") == name and m.get("root") == lora_path
                                         for m in json.loads(text)["data"])
        except (ValueError, KeyError, TypeError, AttributeError):
            return False

    def remember(self, path, name, payload, ok, refused):
        if path == "/v1/load_lora_adapter" and ok and not refused:
            self.adapters[name] = payload  # loaded by every healthy replica: replay it to returning ones
            self.loaded.setdefault(name, set()).update(ok)
            self.partial.pop(name, None)
        elif path == "/v1/load_lora_adapter" and ok:
            self.partial[name] = (payload, set(ok))  # a retry goes only to the replicas that refused
        elif path == "/v1/unload_lora_adapter" and ok:
            self.adapters.pop(name, None)
            self.loaded.pop(name, None)
        elif path == "/pause" and ok:
            self.paused = True
        elif path == "/resume" and ok:
            self.paused = False

    async def replay(self, rep: Replica) -> None:
        """Replay the adapters, then the pause state, to a returning replica."""
        p = self.proxy
        headers = {**p._upstream_headers(), "Content-Type": "application/json"}
        for name, body in list(self.adapters.items()):
            if rep.url in self.loaded.get(name, set()):
                continue
            status, text = await p._send(rep.url, "POST", "/v1/load_lora_adapter", json.dumps(body).encode(), headers)
            if status == 200 or (already_done("/v1/load_lora_adapter", status, text)
                                 and await self.holds(rep, name, body.get("lora_path"))):
                self.loaded.setdefault(name, set()).add(rep.url)
            else:  # logged and skipped: one bad adapter must not keep a replica out for good
                p.counters["replay_failures"] += 1
                log.warning("replaying adapter %s on %s failed (%s): skipped", name, rep.url, status)
        if self.paused:
            await p._send(rep.url, "POST", "/pause?mode=keep")

    def forget(self, url: str) -> None:
        for names in self.loaded.values():
            names.discard(url)


def describe(exc: BaseException) -> str:
    """An upstream error in one short line (aiohttp's parser errors span several)."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def content_type(text: str) -> str:
    return "application/json" if text[:1] in "{[" else "text/plain"


def error(status: int, message: str, kind: str):
    """The proxy's own error answer, in OpenAI's shape."""
    from aiohttp import web

    return web.json_response({"error": {"message": f"colo_kit proxy: {message}", "type": kind}}, status=status)

