"""A replica's own port, guarded (notebook 06). vLLM checks its key only under `/v1`, yet a dev-mode replica serves
`/collective_rpc` to anyone: `ReplicaAuthMiddleware` asks for it on every path but `/health`, whose polls carry a challenge
answered with HMAC-SHA256(key, host, port, challenge): a process on a dead replica's port, or relaying from another
address, is never sent the token.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import socket
from urllib.parse import urlsplit

from colo_kit.async_lora.routing import bearer_ok

MIDDLEWARE = "colo_kit.async_lora.replica_auth.ReplicaAuthMiddleware"  # the import path vLLM's --middleware takes
KEY_ENV = "VLLM_API_KEY"  # where vLLM reads its key, and the middleware with it
OPEN_PATHS = frozenset({"/health"})  # answered without the key: health checks carry none
CHALLENGE_HEADER = "X-Colo-Kit-Challenge"
PROOF_HEADER = "X-Colo-Kit-Proof"
MAX_CHALLENGE_CHARS = 128


def new_challenge() -> str:
    """A fresh random challenge, so no earlier proof answers it."""
    return secrets.token_hex(16)


def address(host: str) -> str:
    """An IP address as both sides spell it (IPv4 reached through an IPv6 socket as IPv4)."""
    ip = ipaddress.ip_address(host.strip("[]").split("%")[0])
    return str(getattr(ip, "ipv4_mapped", None) or ip)


def replica_proof(key: str, host: str, port: int | None, challenge: str) -> str:
    """What a replica holding `key`, reached at `host`:`port`, answers to `challenge`."""
    message = f"colo-kit-replica-proof|{address(host)}|{port}|{challenge}".encode("utf-8", "surrogateescape")
    return hmac.new(key.encode("utf-8"), message, hashlib.sha256).hexdigest()


def proof_ok(key: str, host: str, port: int | None, challenge: str, answer: str | None) -> bool:
    """Whether `answer` is `replica_proof(key, host, port, challenge)`, compared in constant time."""
    if not answer:
        return False
    return hmac.compare_digest(answer.strip().encode("utf-8", "surrogateescape"),
                               replica_proof(key, host, port, challenge).encode())


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
        host, port = scope.get("server") or ("0.0.0.0", None)  # uvicorn: the socket's own address, as reached
        proof = replica_proof(self.key, host, port, challenge).encode()

        async def send_with_proof(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (PROOF_HEADER.lower().encode(), proof)]}
            await send(message)

        return send_with_proof


class KeyProof:
    """The proxy's side, for one replica: trusted only while its polls prove the key for an address it is reached at."""

    def __init__(self, key: str, base_url: str):
        self.key = key
        parts = urlsplit(base_url)
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            self.hosts = {address(parts.hostname or "")}
        except ValueError:  # a name: what it resolves to now
            try:
                self.hosts = {address(a[4][0]) for a in socket.getaddrinfo(parts.hostname, self.port)}
            except (OSError, UnicodeError):
                self.hosts = set()
        self.proved = False  # has it ever proved the key?
        self.trusted = False  # did its last poll?

    def verify(self, challenge: str, answer: str | None) -> bool:
        """Whether a poll's answer to `challenge` lets the replica be trusted (and sent the token)."""
        self.trusted = any(proof_ok(self.key, h, self.port, challenge, answer) for h in self.hosts)
        self.proved |= self.trusted
        return self.trusted
