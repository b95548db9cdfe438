"""The routing proxy's settings (`colo_kit.async_lora.proxy`), checked before anything is served. Notebook 06."""

from __future__ import annotations

import ipaddress
import math
import os
from dataclasses import dataclass, field

from colo_kit.async_lora.routing import replica_base

MAX_BODY_MB = 1024  # the proxy holds a whole body in memory


@dataclass
class ProxyConfig:
    # Every init field is a flag of `colo-kit proxy`; tokens are read from the variables --token-env and
    # --client-token-env name, never typed on a command line.
    replicas: list[str] = field(default_factory=list, metadata={
        "aliases": ["--replica"], "action": "extend", "metavar": "URL",
        "help": "a vLLM server's root URL; repeat the flag, once per replica"})
    host: str = field(default="127.0.0.1", metadata={"help": "anything but loopback needs --client-token-env"})
    port: int = field(default=8000, metadata={"help": "1-65535; 0 picks a free one"})
    token_env: str | None = field(default=None, metadata={
        "metavar": "NAME", "help": "environment variable holding the replicas' API key (sent upstream as a Bearer token)"})
    client_token_env: str | None = field(default=None, metadata={
        "metavar": "NAME", "help": "environment variable holding the key every client must send (401 otherwise)"})
    adapter_root: str | None = field(default=None, metadata={
        "metavar": "DIR", "help": "the shared directory adapters are published under; adapter loads outside it "
                                  "are refused, and without it every adapter load is"})
    block_size: int | None = field(default=None, metadata={
        "help": "the replicas' KV block size in tokens; None asks them (16 if they do not say)"})
    max_prefix_blocks: int = field(default=64, metadata={"help": "leading KV blocks of a prompt that pick its replica"})
    prefix_index_size: int = field(default=65536, metadata={"help": "prefix hashes kept for routing, least recently used out"})
    policy: str = field(default="affinity", metadata={
        "choices": ["affinity", "round_robin"], "help": "round_robin is the baseline the post compares against"})
    imbalance: float = field(default=1.2, metadata={"help": "bound on max/mean in-flight load"})
    slack: int = field(default=8, metadata={"help": "extra in-flight requests allowed above the bound"})
    tokenizer: str | None = field(default=None, metadata={"help": "model folder whose tokenizer.json tokenises text prompts"})
    max_body_mb: float = field(default=16.0, metadata={"help": f"larger request bodies get 413 (at most {MAX_BODY_MB})"})
    upstream_timeout_s: float = field(default=30.0, metadata={"help": "how long broadcasts and health checks wait for a replica"})
    request_timeout_s: float = field(default=600.0, metadata={"help": "how long one generation may take (a long one: minutes)"})
    health_interval_s: float = field(default=1.0, metadata={
        "aliases": ["--health-interval"], "metavar": "S", "help": "seconds between health polls of each replica"})
    health_failures_to_drop: int = field(default=2, metadata={
        "help": "consecutive failed health polls that drop a replica (a refused connection drops it at once)"})
    connect_timeout_s: float = field(default=2.0, metadata={"help": "how long a connection to a replica may take"})
    client_timeout_s: float = field(default=30.0, metadata={
        "help": "how long a client may take to send a request's head, and then its body; silent sockets are closed after it"})
    max_attempts: int = field(default=3, metadata={"help": "replicas a request is tried on before a 502"})
    token: str | None = field(default=None, init=False, repr=False)
    client_token: str | None = field(default=None, init=False, repr=False)
    # shown replica URL (password as ***) -> the URL requests go to, credentials and all
    upstream_urls: dict[str, str] = field(default_factory=dict, init=False, repr=False)

    def validate(self) -> "ProxyConfig":
        """Check everything that can be checked before serving; raise ValueError naming the fix."""
        if not self.replicas:
            raise ValueError("no replicas: pass at least one --replica http://HOST:PORT (a vLLM OpenAI server)")
        clean, upstream = [], {}
        for url in self.replicas:
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
