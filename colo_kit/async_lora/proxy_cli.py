"""`colo-kit proxy`: the routing proxy (colo_kit.async_lora.proxy) from a shell.

    colo-kit proxy --replica http://10.0.0.5:8000 --replica http://10.0.0.6:8000 \\
        --token-env VLLM_API_KEY --adapter-root /mnt/bucket/run1/.vllm_lora

Bad flags are refused before anything is served: one line naming the value and the fix, exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from colo_kit.cli import ArgumentParser, UsageError
from colo_kit.async_lora.proxy import ProxyConfig, RoutingProxy

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _port(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: give a port number in 1-65535 (0 picks a free one)")
    return int(text)


def _log_level(text: str) -> str:
    if text.lower() not in LOG_LEVELS:  # logging.basicConfig would raise its own ValueError with a traceback
        raise argparse.ArgumentTypeError(f"{text!r}: choose one of {', '.join(LOG_LEVELS)}")
    return text.upper()


def cli_main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="colo-kit proxy", description="Prefix-affinity proxy in front of vLLM replicas "
                        "(TRL's AsyncGRPOTrainer sees one server).")
    ap.add_argument("--replica", action="append", default=[], metavar="URL", help="a vLLM server, repeat per replica")
    ap.add_argument("--host", default="127.0.0.1", help="anything but loopback needs --client-token-env")
    ap.add_argument("--port", type=_port, default=8000)
    ap.add_argument("--token-env", default=None, metavar="NAME",
                    help="environment variable holding the replicas' API key (sent upstream as Authorization: Bearer)")
    ap.add_argument("--client-token-env", default=None, metavar="NAME",
                    help="environment variable holding the key every client must send (401 otherwise)")
    ap.add_argument("--adapter-root", default=None, metavar="DIR",
                    help="the shared directory adapters are published under; adapter loads outside it are refused, "
                         "and without it every adapter load is")
    ap.add_argument("--block-size", type=int, default=None,
                    help="the replicas' KV block size in tokens (default: ask them; 16 if they do not say)")
    ap.add_argument("--max-prefix-blocks", type=int, default=64)
    ap.add_argument("--policy", default="affinity", choices=["affinity", "round_robin"])
    ap.add_argument("--imbalance", type=float, default=1.2, help="bound on max/mean in-flight load")
    ap.add_argument("--slack", type=int, default=8, help="extra in-flight requests allowed above the bound")
    ap.add_argument("--tokenizer", default=None, help="model folder whose tokenizer.json tokenises text prompts")
    ap.add_argument("--max-body-mb", type=float, default=16.0, help="larger request bodies get 413 (at most 1024)")
    ap.add_argument("--upstream-timeout-s", type=float, default=30.0,
                    help="how long broadcasts and health checks wait for a replica")
    ap.add_argument("--client-timeout-s", type=float, default=30.0,
                    help="how long a client may take to send a request's head, and then its body; silent sockets "
                         "are closed after it")
    ap.add_argument("--health-interval", type=float, default=1.0, metavar="S")
    ap.add_argument("--log-level", type=_log_level, default="WARNING", help=f"one of {', '.join(LOG_LEVELS)}")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="[colo_kit.async_lora.proxy] %(message)s")
    cfg = ProxyConfig(replicas=args.replica, host=args.host, port=args.port, token_env=args.token_env,
                      client_token_env=args.client_token_env, adapter_root=args.adapter_root,
                      block_size=args.block_size, max_prefix_blocks=args.max_prefix_blocks, policy=args.policy,
                      imbalance=args.imbalance, slack=args.slack, tokenizer=args.tokenizer,
                      max_body_mb=args.max_body_mb, upstream_timeout_s=args.upstream_timeout_s,
                      health_interval_s=args.health_interval, client_timeout_s=args.client_timeout_s)
    try:
        proxy = RoutingProxy(cfg)
    except ValueError as exc:
        raise UsageError(str(exc)) from None

    async def main():
        await proxy.start()
        print(f"colo-kit proxy serving on {proxy.url} -> {', '.join(proxy.replicas)}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await proxy.stop()

    try:
        try:
            import uvloop  # vLLM's server depends on it; about half the proxy's overhead

            uvloop.run(main())
        except ImportError:
            asyncio.run(main())
    except KeyboardInterrupt:
        pass
    except OSError as exc:  # e.g. the port is taken
        print(f"colo-kit proxy: cannot serve on {args.host}:{args.port}: {exc}; choose another --port", file=sys.stderr)
        return 2
    return 0
