"""Writes of the lab record's files (results/*.json, the notebooks, README.md, docs/) that never lose what was there.

Why: the scripts that rewrite these files can be cut midway, run two at a time, or fail before they measure
anything, and a plain `path.write_text` truncates the file first and writes after. Seen here:

- `prlimit --fsize=65536 python scripts/check.py merge ...`: results/gpu_check.json cut at 64 KB, no longer JSON;
  `check.py refresh` under the same limit cut notebooks/00_quickstart.ipynb.
- two `check.py merge` runs at once: each read the record, added its items and wrote it; 2 of 10 items lost.
- `scripts/server_node.py --timeout-s 1`: the committed results/server_node_cpu.json replaced by an error record.

So: a file is written whole or not at all (`write_json_atomic`, `write_text_atomic`: a temp file in the same folder,
fsync, `os.replace`); a read-modify-write holds `locked`; a record read back is checked (`load_record`), a bad one
named in one line (`RecordError`) instead of a traceback; and `publish` lets only a run that succeeded replace a
record that is there, the rest going to results/runs/ (ignored by git).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from pathlib import Path

from colo_kit_cli.commands import UsageError


def commit() -> str | None:
    """The short commit a result ran at: COLO_KIT_COMMIT when set (a copied tree's .git may be older), else git's."""
    if os.environ.get("COLO_KIT_COMMIT"):
        return os.environ["COLO_KIT_COMMIT"][:7]
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


class RecordError(UsageError):
    """A record that cannot be read back or written, as one line naming the file, the problem and the fix (a
    UsageError: `colo_kit_cli.commands.run` prints it as one line, exit code 2)."""


def write_text_atomic(path: str | Path, text: str | bytes) -> Path:
    """`text` (UTF-8; or bytes, as they are) into `path` whole, or `path` left as it was: written to a temp file beside
    it (same filesystem, so the rename is atomic), flushed to disk, then renamed over it. On failure (disk full,
    RLIMIT_FSIZE's EFBIG) the temp file is removed and RecordError names the file."""
    path = Path(path)
    data = text.encode("utf-8") if isinstance(text, str) else text
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():  # mkstemp makes it 0600; the file keeps the mode it had (a new one gets 0644)
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        else:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise RecordError(f"{path}: not written ({exc.strerror or exc}); it is as it was before, free space or "
                          "raise the file-size limit and run again") from exc
    return path


def write_json_atomic(path: str | Path, data) -> Path:
    """`data` as indented JSON into `path`, whole or not at all (`write_text_atomic`)."""
    return write_text_atomic(path, json.dumps(data, indent=1, default=str) + "\n")


def load_record(path: str | Path, missing: dict | None = None, fix: str | None = None) -> dict:
    """The JSON object at `path`; `missing` (default {}) when there is no file yet. A file that is not JSON or not
    an object raises RecordError naming it and `fix` (default: restore it from git), so a script says so in one
    line instead of a traceback."""
    path = Path(path)
    if not path.exists():
        return {} if missing is None else missing
    fix = fix or f"restore it (git checkout -- {path}) or move it away"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise RecordError(f"{path}: cannot be read ({exc.strerror or exc}); {fix}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        where = f" at line {exc.lineno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise RecordError(f"{path}: not JSON ({getattr(exc, 'msg', None) or exc.reason}{where}); {fix}") from None
    if not isinstance(data, dict):
        raise RecordError(f"{path}: a JSON {type(data).__name__}, not an object of a record; {fix}")
    return data


@contextlib.contextmanager
def locked(path: str | Path):
    """An exclusive lock for one read-modify-write of the record at `path` (read it inside, write it inside), held
    against every other process doing the same. It locks the record's folder: `os.replace` gives the record a new
    inode, so a lock on the file itself would not keep out a process that opened the new one, and a lock file would
    be one more untracked file in results/. Not reentrant: a second `locked` of the same folder in one process
    waits for ever."""
    folder = Path(path).parent
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def publish(path: str | Path, data, ok: bool, fallback: str | Path | None = None) -> Path:
    """Write a run's record: to `path` when the run succeeded (`ok`: it ran and produced something) or nothing is
    there yet; else to `fallback` (default results/runs/<name>, ignored by git), so a failed or empty run never
    replaces a record. Returns where it went."""
    path = Path(path)
    if not ok and path.exists():
        if fallback is None:
            from colo_kit.paths import runs_dir

            fallback = runs_dir() / path.name
        path = Path(fallback)
    return write_json_atomic(path, data)
