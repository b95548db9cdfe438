"""A replica's own port, guarded: the API key on every path, and a proof that a replica holds it. Notebook 06.

vLLM checks its key only under `/v1` and a few other prefixes (serve/middleware/authenticate.py), yet a dev-mode
replica also serves `/collective_rpc` and `/pause` to any local process: `ReplicaAuthMiddleware` asks for the key on
every path but `/health`. A process that binds a dead replica's port must not be handed the token, so each health poll
carries a fresh challenge answered with HMAC-SHA256(key, port, challenge).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
from urllib.parse import urlsplit

from colo_kit.async_lora.routing import bearer_ok

log = logging.getLogger("colo_kit.async_lora.proxy")  # the proxy logs what KeyProof finds

MIDDLEWARE = "colo_kit.async_lora.replica_auth.ReplicaAuthMiddleware"  # the import path vLLM's --middleware takes
KEY_ENV = "VLLM_API_KEY"  # where vLLM reads its key, and the middleware with it
OPEN_PATHS = frozenset({"/health"})  # answered without the key: health checks carry none
CHALLENGE_HEADER = "X-Colo-Kit-Challenge"
PROOF_HEADER = "X-Colo-Kit-Proof"
MAX_CHALLENGE_CHARS = 128


def new_challenge() -> str:
    """A fresh random challenge: a process that never saw it cannot have the proof for it."""
    return secrets.token_hex(16)


def replica_proof(key: str, port: int | None, challenge: str) -> str:
    """What a replica holding `key` and listening on `port` answers to `challenge`."""
    message = f"colo-kit-replica-proof|{port}|{challenge}".encode("utf-8", "surrogateescape")
    return hmac.new(key.encode("utf-8"), message, hashlib.sha256).hexdigest()


def proof_ok(key: str, port: int | None, challenge: str, answer: str | None) -> bool:
    """Whether `answer` is the proof for `challenge` of a replica holding `key` on `port` (constant time)."""
    if not answer:
        return False
    return hmac.compare_digest(answer.strip().encode("utf-8", "surrogateescape"),
                               replica_proof(key, port, challenge).encode())


def _header(scope, name: str) -> str | None:
    wanted = name.lower().encode()
    for k, v in scope.get("headers", ()):
        if k.lower() == wanted:
            return v.decode("latin-1")
    return None


class ReplicaAuthMiddleware:
    """`Authorization: Bearer <key>` on every path but `OPEN_PATHS`, and the proof of the key on `/health` when asked;
    without a key, and for CORS preflights, everything passes, as in vLLM's own check."""

    def __init__(self, app, key: str | None = None):
        self.app = app
        self.key = key if key is not None else (os.environ.get(KEY_ENV) or None)

    async def __call__(self, scope, receive, send):
        if self.key is None or scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", "") or "")
        if path in OPEN_PATHS:  # an exact match: no other spelling is let through unguarded
            challenge = _header(scope, CHALLENGE_HEADER)
            if challenge and len(challenge) <= MAX_CHALLENGE_CHARS:
                return await self.app(scope, receive, self._with_proof(scope, challenge, send))
            return await self.app(scope, receive, send)
        if bearer_ok(_header(scope, "Authorization"), self.key):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":  # closing before accepting refuses the handshake
            await receive()
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _with_proof(self, scope, challenge: str, send):
        server = scope.get("server") or (None, None)  # uvicorn: the address of the socket the request came in on
        proof = replica_proof(self.key, server[1], challenge).encode()

        async def send_with_proof(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (PROOF_HEADER.lower().encode(), proof)]}
            await send(message)

        return send_with_proof


class KeyProof:
    """The proxy's side, for one replica: trust on first proof; one that never proved the key is trusted with a warning."""

    def __init__(self, key: str, base_url: str, shown: str | None = None):
        self.key = key
        self.shown = shown or base_url  # the URL as logs show it (no password)
        self.port = urlsplit(base_url).port or (443 if base_url.startswith("https") else 80)
        self.proves: bool | None = None  # None: not asked yet
        self.trusted = True  # False while what answers on the port cannot prove the key it proved before

    def verify(self, challenge: str, answer: str | None) -> bool:
        """Whether a poll's answer to `challenge` lets the replica be trusted."""
        if proof_ok(self.key, self.port, challenge, answer):
            self.proves = self.trusted = True
        elif self.proves:
            self.trusted = False
        elif self.proves is None:
            self.proves = False
            log.warning("replica %s does not prove it holds the replicas' key (not started by colo_kit.async_lora.lora."
                        "replica_launch?): a process that took its port after it died would be sent the token",
                        self.shown)
        return self.trusted
