"""`colo-kit` (or `python -m colo_kit`): one entry point, one subcommand per module.

Each subcommand is one `cli_main(argv) -> int`, named in `COMMANDS` and imported only when called, so
`colo-kit plan` does not pay for importing vLLM. It sits in the module whose work it runs (`models`, `data`,
`env`, `notebook`, `answers.math500_eval`), or beside a lesson's module as `<module>_cli.py` when the command
parses settings of its own on top of the lesson's (`grpo.train_cli`: `TrainArgs` beside TRL's `GRPOConfig`;
`memory.planner_cli`, `async_lora.proxy_cli`, `serving.bench_cli`), so the lesson's module reads without them.
Flags come from dataclasses wherever the settings are one (`parse_dataclasses`). Bad input is one line and exit
code 2: commands raise `UsageError`, before anything runs or is written.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

# name -> (module:function, one-line help)
COMMANDS = {
    "build-model": ("colo_kit.models:cli_main", "build a preset model (random weights, local tokenizer)"),
    "data": ("colo_kit.data:cli_main", "regenerate the offline prompt sets under data/"),
    "train": ("colo_kit.grpo.train_cli:cli_main", "GRPO with TRL, colocate or server mode"),
    "demo": ("colo_kit.notebook:cli_demo", "execute notebooks/00_quickstart.ipynb headless, save it and an HTML copy"),
    "run-notebooks": ("colo_kit.notebook:cli_main", "execute notebooks headless"),
    "env": ("colo_kit.env:cli_main", "print the tier, hardware and versions as JSON"),
    "eval-math500": ("colo_kit.answers.math500_eval:cli_main", "evaluate a model on MATH-500 (or the offline set)"),
    "plan": ("colo_kit.memory.planner_cli:cli_main", "estimate per-GPU memory and recommend settings"),
    "bench": ("colo_kit.serving.bench_cli:cli_main", "server-vs-colocate throughput sweep"),
    "proxy": ("colo_kit.async_lora.proxy_cli:cli_main", "prefix-affinity proxy in front of vLLM replicas"),
}


class UsageError(ValueError):
    """Bad input to a command: `main` prints it as one line naming the value and the fix, exit code 2,
    before anything runs or is written."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line (a UsageError) instead of usage text and SystemExit."""

    def error(self, message):
        raise UsageError(message)


def parse_dataclasses(types, argv: list[str], prog: str, description: str) -> tuple:
    """`argv` into one instance of each dataclass in `types`, by transformers' HfArgumentParser: a flag per
    field (`--name_of_field` or `--name-of-field`, `--no-...` for one that is True), its type and default.
    Bad input is one line (UsageError), an unknown flag named; a flag's prefix is not that flag."""
    from transformers import HfArgumentParser

    def one_line(message):
        raise UsageError(message)

    # argparse's prefixes would take `colo-kit proxy --token SECRET` as --token-env SECRET and echo it; with each
    # field spelt two ways (--a_b, --a-b), most prefixes were ambiguous anyway
    parser = HfArgumentParser(types, prog=prog, description=description, allow_abbrev=False)
    parser.error = one_line
    try:
        return parser.parse_args_into_dataclasses(argv)
    except UsageError:
        raise
    except ValueError as exc:  # HfArgumentParser's own: "Some specified arguments are not used ..."
        raise UsageError(str(exc).splitlines()[0].rstrip(".") + f" (see {prog} --help)") from None


def run(fn, argv: list[str], prog: str) -> int:
    """`fn(argv)`'s exit code, a UsageError printed as one line (`prog: message`) and exit code 2: `colo-kit
    <command>` and the modules run as `python -m` alike."""
    try:
        return int(fn(argv) or 0)
    except UsageError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2


def writable_file(path: str | Path, flag: str) -> Path:
    """`path` as a Path once it is sure a file can be written there (its folder is made if need be):
    checked before a run, so a run's results are never lost to an unwritable output."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot create {path.parent} ({exc.strerror}); choose a writable path") from None
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory; give a file name")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable; choose a writable path")
    return path


def writable_dir(path: str | Path, flag: str) -> Path:
    """`path` as a Path once it is sure to be a folder files can be written in (made if need be): checked
    before a run, as `writable_file` is."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path}: is a file, not a folder; give a folder (it is made if need be)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot create it ({exc.strerror}); choose a writable folder") from None
    if not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {path}: not writable; choose a writable folder")
    return path


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


if __name__ == "__main__":
    raise SystemExit(main())
