"""How the proxy of the second post decides, without any I/O (notebook 06): `ROUTES` (routed, broadcast, any replica
or the proxy itself), prefix affinity (`PrefixKeyer`: vLLM's prefix-cache chain salted with the adapter's name;
rendezvous hashing under a bound on load, Mirrokni et al. 2018), `vet_adapter_load` and `bearer_ok`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import re
import struct
from collections import OrderedDict
from pathlib import Path
from urllib.parse import unquote, urlsplit

OWN, ROUTED, BROADCAST, ANY = "own", "routed", "broadcast", "any"

# (method, path) -> how the proxy serves it. Everything not listed is 404 at the proxy.
ROUTES: dict[tuple[str, str], str] = {
    ("GET", "/health"): OWN,
    ("GET", "/metrics"): OWN,
    ("GET", "/get_world_size"): OWN,  # the sum over the replicas the proxy fronts
    ("GET", "/v1/models"): ANY,
    ("GET", "/server_info"): ANY,  # TRL reads lora_config and parallel_config from it
    ("GET", "/version"): ANY,
    ("POST", "/v1/completions"): ROUTED,  # the rollout worker: token-id prompts, model=trl-policy-vN
    ("POST", "/v1/chat/completions"): ROUTED,
    ("POST", "/v1/chat/completions/render"): ROUTED,
    ("POST", "/inference/v1/generate"): ROUTED,
    ("POST", "/tokenize"): ROUTED,
    ("POST", "/detokenize"): ROUTED,
    # state changes: every replica, so a policy name means the same everywhere
    ("POST", "/v1/load_lora_adapter"): BROADCAST,
    ("POST", "/v1/unload_lora_adapter"): BROADCAST,
    ("POST", "/pause"): BROADCAST,
    ("POST", "/resume"): BROADCAST,
    ("POST", "/reset_prefix_cache"): BROADCAST,
    ("POST", "/init_weight_transfer_engine"): BROADCAST,  # merged-weight sync (no LoRA): TRL's NCCL path
    ("POST", "/start_weight_update"): BROADCAST,
    ("POST", "/update_weights"): BROADCAST,
    ("POST", "/finish_weight_update"): BROADCAST,
}
NEVER = frozenset({"/collective_rpc"})  # it runs any method of a dev-mode replica's workers

ADAPTER_NAME = re.compile(r"[A-Za-z0-9._-]+")


def normalise_path(path: str) -> str:
    """One spelling per route: percent-decoded, `//` and `.` collapsed, no trailing slash; `..` is kept, so matches nothing."""
    path = unquote(path)
    parts = [p for p in path.split("/") if p not in ("", ".")]
    return "/" + "/".join(parts)


def route_kind(method: str, path: str) -> str | None:
    """How `method path` is served, or None (404). `path` must be normalised."""
    if path in NEVER:
        return None
    return ROUTES.get((method.upper(), path))


class PrefixKeyer:
    """A request body -> the chained hashes of its prompt's leading blocks (vLLM's prefix-cache key), salted with the model."""

    def __init__(self, block_size: int = 16, max_prefix_blocks: int = 64, tokenizer: str | None = None):
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self._tok = None
        if tokenizer:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(os.path.join(tokenizer, "tokenizer.json"))

    def _chain(self, blocks: list[bytes], salt: bytes) -> list[bytes]:
        h = hashlib.blake2b(salt, digest_size=8)
        out = []
        for block in blocks:
            h.update(block)
            out.append(h.copy().digest())
        return out

    def _blocks(self, seq, width: int) -> list:
        # vLLM caches full blocks only; a prompt shorter than one block still keeps its group together
        n_full = min(len(seq) // width, self.max_prefix_blocks)
        return [seq[i * width:(i + 1) * width] for i in range(n_full)] or [seq]

    def _ids_chain(self, ids: list[int], salt: bytes) -> list[bytes]:
        return self._chain([struct.pack(f"<{len(s)}I", *s) for s in self._blocks(ids, self.block_size)], salt)

    def _text_chain(self, text: str, salt: bytes) -> list[bytes]:
        if self._tok is not None:
            return self._ids_chain(self._leading_ids(text), salt)
        # without a tokenizer, UTF-8 bytes in blocks of 4 x block_size stand in for tokens: a shared text, shared blocks
        return self._chain(self._blocks(text.encode("utf-8", "surrogatepass"), 4 * self.block_size), salt)

    def _leading_ids(self, text: str) -> list[int]:
        """The token ids of `text`'s first `max_prefix_blocks` blocks, from a bounded prefix (a whole 10 MB prompt held the
        event loop for 17 s): 4 characters a token, doubled while too few."""
        need = self.block_size * self.max_prefix_blocks
        chars = 4 * (need + self.block_size)
        while True:
            ids = self._tok.encode(text[:chars], add_special_tokens=False).ids
            if len(ids) >= need + self.block_size or chars >= len(text):
                return ids[:need] if chars < len(text) else ids
            chars *= 2

    def chain(self, body) -> list[bytes] | None:
        """The prefix chain of a completion or chat request; None when it has no readable prompt (routed by load alone)."""
        try:
            return self._chain_or_raise(body)
        except (TypeError, ValueError, AttributeError, struct.error, RecursionError, OverflowError):
            return None

    def _chain_or_raise(self, body) -> list[bytes] | None:
        if not isinstance(body, dict):
            return None
        salt = str(body.get("model", "")).encode()
        prompt = body.get("prompt")
        if prompt is None and isinstance(body.get("messages"), list):
            parts = []
            for m in body["messages"]:
                content = m.get("content") if isinstance(m, dict) else m
                if not isinstance(content, str):
                    content = json.dumps(content, sort_keys=True)
                parts.append(f"<{m.get('role', '') if isinstance(m, dict) else ''}>{content}")
            prompt = "".join(parts)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]  # a batch of prompts: route by the first
        if isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < 2**32 for t in prompt):
            return self._ids_chain(prompt, salt)
        if isinstance(prompt, str):
            return self._text_chain(prompt, salt)
        return None


class PrefixIndex:
    """Which replica last received each chain hash, for at most `capacity` hashes (least recently used first out)."""

    def __init__(self, capacity: int = 65536):
        self.capacity = capacity
        self._where: OrderedDict[bytes, str] = OrderedDict()

    def longest(self, chain: list[bytes]) -> tuple[str | None, int]:
        for depth in range(len(chain), 0, -1):
            replica = self._where.get(chain[depth - 1])
            if replica is not None:
                return replica, depth
        return None, 0

    def record(self, chain: list[bytes], replica: str) -> None:
        for h in chain:
            self._where[h] = replica
            self._where.move_to_end(h)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def forget(self, replica: str) -> None:
        """A replica that restarts comes back with an empty cache."""
        for h in [h for h, r in self._where.items() if r == replica]:
            del self._where[h]

    def __len__(self) -> int:
        return len(self._where)


def rendezvous_order(key: bytes, replicas: list[str]) -> list[str]:
    """Replicas ranked for `key` by highest random weight: removing one moves only the keys that ranked it first."""
    return sorted(replicas, key=lambda r: hashlib.blake2b(key + r.encode(), digest_size=8).digest(), reverse=True)


def load_bound(inflight: dict[str, int], healthy: list[str], imbalance: float, slack: int) -> int:
    """The most requests a replica may have in flight before a new one goes elsewhere."""
    total = sum(inflight.get(r, 0) for r in healthy) + 1
    return math.ceil(imbalance * total / len(healthy)) + slack


def choose_replica(key: bytes | None, healthy: list[str], inflight: dict[str, int], *,
                   imbalance: float = 1.2, slack: int = 8) -> tuple[str, bool]:
    """(replica, top-ranked) for an unseen prefix: the first in rendezvous order within the load bound, else the least loaded."""
    if not healthy:
        raise LookupError("no healthy replica")
    if key is None:
        return min(healthy, key=lambda r: inflight.get(r, 0)), False
    bound = load_bound(inflight, healthy, imbalance, slack)
    for rank, replica in enumerate(rendezvous_order(key, healthy)):
        if inflight.get(replica, 0) + 1 <= bound:
            return replica, rank == 0
    return min(healthy, key=lambda r: inflight.get(r, 0)), False


def vet_adapter_load(body, adapter_root: str | None) -> tuple[str | None, str | None]:
    """(why a `/v1/load_lora_adapter` body is refused, None) or (None, the resolved lora_path to forward as checked)."""
    if adapter_root is None:
        return ("adapter loads are refused: start the proxy with --adapter-root DIR, the shared directory "
                "the trainer publishes its adapters under (TRL: <output_dir>/.vllm_lora)"), None
    if not isinstance(body, dict):
        return "the body must be a JSON object with lora_name and lora_path", None
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name) or name in (".", ".."):
        return f"lora_name={name!r}: use letters, digits, '.', '_' and '-' only (e.g. trl-policy-v3)", None
    if not isinstance(path, str) or not path:
        return f"lora_path={path!r}: give the adapter's directory under {adapter_root}", None
    if "\x00" in path:  # no file name holds one; Path.resolve would raise on it
        return f"lora_path={path!r} holds a NUL byte: give the adapter's directory under {adapter_root}", None
    root = Path(adapter_root).resolve()
    try:
        resolved = Path(path).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop: RuntimeError before Python 3.13
        return f"lora_path={path!r} does not resolve ({type(exc).__name__}): give a directory under {root}", None
    if resolved != root and root not in resolved.parents:
        return f"lora_path={path!r} resolves to {resolved}, outside --adapter-root {root}", None
    return None, str(resolved)


def already_done(path: str, status: int | None, text: str) -> bool:
    """Whether a replica's refusal says it is already in the state asked for (vllm/entrypoints/openai/models/serving.py)."""
    if path == "/v1/load_lora_adapter":
        return status == 400 and "has already been loaded" in text
    if path == "/v1/unload_lora_adapter":
        return status == 404 and any(w in text for w in ("cannot be found", "not found", "not loaded"))
    return False


def bearer_ok(header: str | None, token: str) -> bool:
    """Whether an `Authorization` header carries `token`, checked as vLLM's serve/middleware/authenticate.py does."""
    scheme, _, given = (header or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(given.strip().encode("utf-8", "surrogateescape")).digest()
    return hmac.compare_digest(digest, hashlib.sha256(token.encode("utf-8")).digest())


_URL_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^/?#@:]*):[^/?#]*@")


def redact_url(url: str) -> str:
    """`url` with its password, if any, shown as `***`."""
    return _URL_PASSWORD.sub(r"\1:***@", str(url))


def replica_base(url: str, token_env: str | None = None) -> tuple[str, str]:
    """A `--replica` URL as (shown with its password as `***`, the server root to send requests to)."""
    shown = redact_url(url)
    try:
        parts = urlsplit(url)
        parts.port
    except ValueError:
        raise ValueError(f"bad replica URL {shown!r}: expected http://HOST:PORT with a port in 0-65535, "
                         "e.g. http://10.0.0.5:8000") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"bad replica URL {shown!r}: expected http://HOST:PORT, e.g. http://10.0.0.5:8000")
    base = f"{parts.scheme}://{parts.netloc}"
    if parts.path not in ("", "/") or parts.query:
        raise ValueError(f"bad replica URL {shown!r}: give the server root (no path), e.g. {redact_url(base)}")
    if token_env and (parts.username is not None or parts.password is not None):
        # aiohttp refuses a request with both: say so at start, not as a 500 per request
        raise ValueError(f"replica URL {shown!r} with --token-env {token_env}: the URL's user:password and the "
                         "token would both be the Authorization header; drop one (vLLM's --api-key wants --token-env)")
    return redact_url(base), base
