"""The commands' shared plumbing: bad input as one line (`UsageError`, exit code 2), flags from dataclasses
(`parse_dataclasses`), output paths checked before a run (`writable_file`, `writable_dir`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


class UsageError(ValueError):
    """Bad input to a command: printed as one line naming the value and the fix, exit code 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line (a UsageError) instead of usage text and SystemExit."""

    def error(self, message):
        raise UsageError(message)


def parse_dataclasses(types, argv: list[str], prog: str, description: str) -> tuple:
    """`argv` into one instance of each dataclass in `types`, by transformers' HfArgumentParser (a flag per field);
    bad input is one line (UsageError)."""
    from transformers import HfArgumentParser

    def one_line(message):
        raise UsageError(message)

    # no prefixes: `colo-kit proxy --token SECRET` would be taken as --token-env SECRET and echoed
    parser = HfArgumentParser(types, prog=prog, description=description, allow_abbrev=False)
    parser.error = one_line
    try:
        return parser.parse_args_into_dataclasses(argv)
    except UsageError:
        raise
    except ValueError as exc:  # HfArgumentParser's own: "Some specified arguments are not used ..."
        raise UsageError(str(exc).splitlines()[0].rstrip(".") + f" (see {prog} --help)") from None


def run(fn, argv: list[str], prog: str) -> int:
    """`fn(argv)`'s exit code, a UsageError printed as one line (`prog: message`) and exit code 2."""
    try:
        return int(fn(argv) or 0)
    except UsageError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2


def writable_file(path: str | Path, flag: str) -> Path:
    """`path` as a Path once it is sure a file can be written there, so a run's results are never lost."""
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
    """`path` as a Path once it is sure to be a writable folder (made if need be), as `writable_file`."""
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
