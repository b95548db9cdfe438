"""`colo-kit` (or `python -m colo_kit`): the kit's command line, kept apart from the library a learner reads. One
module per subcommand, each a `main(argv) -> int` named in `COMMANDS` and imported only when called (`colo-kit plan`
does not pay for importing vLLM); `commands` holds their shared plumbing (bad input as one line, exit code 2)."""

from __future__ import annotations

import importlib
import sys

from colo_kit_cli.commands import run

# name -> (module in colo_kit_cli, one-line help)
COMMANDS = {
    "build-model": ("build_model", "build a preset model (random weights, local tokenizer)"),
    "train": ("train", "GRPO with TRL, colocate or server mode"),
    "demo": ("notebooks:demo", "execute notebooks/00_quickstart.ipynb headless, save it and an HTML copy"),
    "run-notebooks": ("notebooks", "execute notebooks headless"),
    "env": ("env", "print the tier, hardware and versions as JSON"),
    "eval-math500": ("eval_math500", "evaluate a model on MATH-500 (or the offline set)"),
    "plan": ("plan", "estimate per-GPU memory and recommend settings"),
    "bench": ("bench", "server-vs-colocate throughput sweep"),
    "proxy": ("proxy", "prefix-affinity proxy in front of vLLM replicas"),
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
    module, _, func = target.partition(":")
    try:
        fn = getattr(importlib.import_module(f"colo_kit_cli.{module}"), func or "main")
    except (ImportError, AttributeError) as exc:
        print(f"colo-kit: {name!r} is not available in this checkout ({exc})", file=sys.stderr)
        return 2
    return run(fn, rest, f"colo-kit {name}")
