"""`make lab`'s JupyterLab, holding its working copy: a second `make lab` on the same folder is refused in one line.

Two JupyterLabs on one folder autosave over each other's notebooks (Jupyter moves the second to the next port and
serves the same files). This takes an exclusive lock on `<folder>/.lab.lock`, then becomes the command (exec), which
holds the lock until it exits, however it exits: a crash or a kill leaves no stale lock.

    python scripts/lab_run.py lab jupyter lab lab/ --port=8888
"""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python scripts/lab_run.py FOLDER COMMAND [ARG ...]", file=sys.stderr)
        return 2
    folder, command = Path(argv[0]), argv[1:]
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / ".lab.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        print(f"{folder}/ is open in another JupyterLab ({holder}), and two would autosave over each other's "
              "notebooks: give yours a working copy of its own, make lab LAB_DIR=lab-NAME (e.g. lab-alice)",
              file=sys.stderr)
        return 2
    port = next((a for a in command if a.startswith("--port")), "")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}{', ' + port if port else ''}".encode(), 0)
    os.set_inheritable(fd, True)  # held across exec by the command itself
    os.execvp(command[0], command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
