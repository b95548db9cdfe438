"""`colo-kit` (or `python -m colo_kit`): one subcommand per module, each a `cli_main(argv) -> int` named in `COMMANDS` and
imported only when called (`colo-kit plan` does not pay for importing vLLM)."""

from __future__ import annotations

import importlib
import sys

from colo_kit.commands import run

# name -> (module:function, one-line help)
COMMANDS = {
    "build-model": ("colo_kit.models:cli_main", "build a preset model (random weights, local tokenizer)"),
    "train": ("colo_kit.grpo.train_cli:cli_main", "GRPO with TRL, colocate or server mode"),
    "demo": ("colo_kit.notebook:cli_demo", "execute notebooks/00_quickstart.ipynb headless, save it and an HTML copy"),
    "run-notebooks": ("colo_kit.notebook:cli_main", "execute notebooks headless"),
    "env": ("colo_kit.env:cli_main", "print the tier, hardware and versions as JSON"),
    "eval-math500": ("colo_kit.answers.math500_eval:cli_main", "evaluate a model on MATH-500 (or the offline set)"),
    "plan": ("colo_kit.memory.planner_cli:cli_main", "estimate per-GPU memory and recommend settings"),
    "bench": ("colo_kit.serving.bench_cli:cli_main", "server-vs-colocate throughput sweep"),
    "proxy": ("colo_kit.async_lora.proxy_cli:cli_main", "prefix-affinity proxy in front of vLLM replicas"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: colo-kit <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`colo-kit <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import colo_kit

    colo_kit.setup()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"colo-kit: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    target, _ = COMMANDS[name]
    module, func = target.split(":")
    try:
        fn = getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as exc:
        print(f"colo-kit: {name!r} is not available in this checkout ({exc})", file=sys.stderr)
        return 2
    return run(fn, rest, f"colo-kit {name}")
