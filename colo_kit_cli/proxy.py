"""`colo-kit proxy`: the routing proxy (colo_kit.async_lora.proxy) from a shell.

    colo-kit proxy --replica http://10.0.0.5:8000 --replica http://10.0.0.6:8000 \\
        --token-env VLLM_API_KEY --adapter-root /mnt/bucket/run1/.vllm_lora
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass, field

from colo_kit_cli.commands import UsageError, parse_dataclasses
from colo_kit.async_lora.proxy import ProxyConfig, RoutingProxy

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass
class ProxyCommand:
    """What `colo-kit proxy` takes besides the `ProxyConfig` its other flags describe."""

    log_level: str = field(default="warning", metadata={"help": f"one of {', '.join(LOG_LEVELS)}"})


def parse(argv: list[str]) -> tuple[ProxyConfig, ProxyCommand]:
    """`colo-kit proxy`'s flags as the proxy's settings (validated by `RoutingProxy`) and the command's own."""
    cfg, cmd = parse_dataclasses((ProxyConfig, ProxyCommand), argv, prog="colo-kit proxy", description=(
        "Prefix-affinity proxy in front of vLLM replicas (TRL's AsyncGRPOTrainer sees one server)."))
    if cmd.log_level.lower() not in LOG_LEVELS:  # logging.basicConfig would raise its own ValueError with a traceback
        raise UsageError(f"--log-level: {cmd.log_level!r}: choose one of {', '.join(LOG_LEVELS)}")
    return cfg, cmd


def main(argv: list[str]) -> int:
    cfg, cmd = parse(argv)
    logging.basicConfig(level=cmd.log_level.upper(), format="[colo_kit.async_lora.proxy] %(message)s")
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
        print(f"colo-kit proxy: cannot serve on {cfg.host}:{cfg.port}: {exc}; choose another --port", file=sys.stderr)
        return 2
    return 0
