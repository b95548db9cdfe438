"""Notebooks executed headless as JupyterLab's Run All runs them, saved with an HTML copy (`make demo`,
`colo-kit run-notebooks`); the runner rewrites nothing, and what it adds against hangs is below."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from colo_kit.paths import REPO_ROOT, runs_dir

log = logging.getLogger(__name__)

NOTEBOOKS = REPO_ROOT / "notebooks"


class NotebookWallTimeout(TimeoutError):
    pass


POLL_SLICE_S = 1.0


def _sliced(get_msg):
    """A channel's `get_msg(timeout)` as a loop of short polls: each new zmq.asyncio poll reads the socket's real state,
    so a message whose edge-triggered wake-up was missed is read within a slice, not at the timeout (or never)."""
    from queue import Empty
    from time import monotonic

    async def get(timeout: float | None = None):
        deadline = None if timeout is None else monotonic() + timeout
        while True:
            left = POLL_SLICE_S if deadline is None else max(0.0, min(POLL_SLICE_S, deadline - monotonic()))
            try:
                return await get_msg(timeout=left)
            except Empty:
                if deadline is not None and monotonic() >= deadline:
                    raise

    return get


def _client_class():
    from nbclient import NotebookClient

    class SlicedPollClient(NotebookClient):
        # a missed zmq wake-up leaves a cell's reply unread until the whole poll expires (300 s, both sides idle)
        async def async_start_new_kernel_client(self):
            kc = await super().async_start_new_kernel_client()
            for channel in (kc.shell_channel, kc.iopub_channel):
                channel.get_msg = _sliced(channel.get_msg)
            return kc

    return SlicedPollClient


def _execute_within(client, wall_s: float, kernel_env: dict) -> None:
    """`client.execute()` in `kernel_env`, cancelled after `wall_s` s (nbclient's cleanup then shuts the kernel down)."""
    import asyncio

    from jupyter_core.utils import run_sync

    async def bounded():
        # nbclient passes these to KernelManager.start_kernel; the kernel gets `env`, not os.environ
        task = asyncio.ensure_future(client.async_execute(env=kernel_env))
        done, _ = await asyncio.wait({task}, timeout=wall_s)
        if task in done:
            return task.result()  # a cell error propagates as nbclient raised it
        task.cancel()  # nbclient turns the cancellation into DeadKernelError on its way out
        try:
            await task
        except BaseException:
            pass
        raise NotebookWallTimeout(f"the notebook ran past its wall limit of {wall_s:.0f} s")

    run_sync(bounded)()


def execute(path: Path, out_dir: Path | None = None, timeout_s: int = 300, html: bool = True,
            wall_s: float | None = None) -> dict:
    """Run a notebook in a fresh kernel (cwd = notebooks/), save the executed copy (and an HTML one) under `out_dir`;
    return where they are and the seconds. A failing cell raises `CellExecutionError`; `timeout_s` bounds each cell,
    `wall_s` (default 2 × timeout_s, or COLO_KIT_NOTEBOOK_WALL_S) the whole notebook."""
    import nbformat

    path = Path(path)
    out_dir = Path(out_dir or runs_dir() / "notebooks")
    out_dir.mkdir(parents=True, exist_ok=True)
    nb = nbformat.read(path, as_version=4)
    # the kernel is a single process: no rank or rendezvous address (other threads read this process's os.environ)
    from colo_kit.procs import without_rank_vars
    from nbclient.exceptions import CellTimeoutError

    kernel_env = without_rank_vars()
    t0 = time.time()
    pristine = nbformat.from_dict(json.loads(json.dumps(nb)))
    wall_s = float(wall_s or os.environ.get("COLO_KIT_NOTEBOOK_WALL_S") or 2 * timeout_s)
    for attempt in (1, 2):
        # below errors the kernel's log is ipykernel 7's warning, on every start, that its loopback TCP is unencrypted
        client = _client_class()(nb, timeout=timeout_s, kernel_name="python3",
                                 extra_arguments=["--IPKernelApp.log_level=ERROR"],
                                 resources={"metadata": {"path": str(path.parent)}})
        try:
            _execute_within(client, wall_s, kernel_env)
            break
        except (CellTimeoutError, NotebookWallTimeout) as exc:
            # the sliced polls' backstop: a timeout is retried once in a new kernel, a cell error never
            if attempt == 2:
                raise
            log.warning("%s: %s; retrying once in a new kernel", path.name, exc)
            nb = nbformat.from_dict(json.loads(json.dumps(pristine)))
        finally:
            executed = out_dir / path.name
            nbformat.write(nb, executed)
    result = {"notebook": str(path), "executed": str(executed), "seconds": round(time.time() - t0, 1)}
    if html:
        result["html"] = str(save_html(nb, out_dir / (path.stem + ".html")))
    return result


def save_html(nb, html_path: Path) -> Path:
    """The HTML copy of an executed notebook, charts included: a plotly figure is a JSON output only JupyterLab draws,
    so each gets an HTML rendering beside it (plotly.js from its CDN)."""
    _find_nbconvert_templates()
    import plotly.io as pio
    from nbconvert import HTMLExporter

    mime = "application/vnd.plotly.v1+json"
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if mime in data and "text/html" not in data:
                data["text/html"] = pio.to_html(dict(data[mime]), include_plotlyjs="cdn", full_html=False)
    body, _ = HTMLExporter().from_notebook_node(nb)
    Path(html_path).write_text(body)
    return Path(html_path)


def _find_nbconvert_templates() -> None:
    """`pip install --target DIR` (the kit's GPU stacks) puts nbconvert's HTML templates in DIR/share/jupyter, off
    Jupyter's data path: add it."""
    import nbconvert

    share = Path(nbconvert.__file__).resolve().parents[1] / "share" / "jupyter"
    if not (share / "nbconvert" / "templates").is_dir():
        return
    paths = [p for p in os.environ.get("JUPYTER_PATH", "").split(os.pathsep) if p]
    if str(share) not in paths:
        os.environ["JUPYTER_PATH"] = os.pathsep.join([*paths, str(share)])


@dataclass
class RunNotebooksArgs:
    out: str | None = field(default=None, metadata={"help": "folder for executed copies (default results/runs/notebooks)"})


def main(argv: list[str]) -> int:
    import nbformat

    from colo_kit_cli.commands import UsageError, parse_dataclasses, writable_dir

    # HfArgumentParser takes flags only: the notebooks, the words before the first flag, are taken off first
    n = next((i for i, a in enumerate(argv) if a.startswith("-")), len(argv))
    (args,) = parse_dataclasses((RunNotebooksArgs,), argv[n:], prog="colo-kit run-notebooks", description=(
        "notebooks (words before the flags): paths (default: every notebooks/NN_*.ipynb)"))
    paths = [Path(p) for p in argv[:n]] or sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    for p in paths:
        if not p.is_file():
            raise UsageError(f"{p}: no such notebook; give .ipynb files, e.g. notebooks/00_quickstart.ipynb")
        try:
            nbformat.read(p, as_version=4)
        except Exception as exc:  # nbformat raises several kinds for a file that is not a notebook
            raise UsageError(f"{p}: not a Jupyter notebook ({type(exc).__name__}); give an .ipynb file") from None
    out = writable_dir(args.out, "--out") if args.out else None
    from nbclient.exceptions import CellExecutionError

    failed = 0
    for p in paths:
        try:
            r = execute(p, out)
        except CellExecutionError as exc:  # one line, not nbclient's frames; the executed copy shows the rest
            executed = Path(out or runs_dir() / "notebooks") / p.name
            cells = nbformat.read(executed, as_version=4).cells
            cell = next((i for i, c in enumerate(cells, 1)
                         if any(o.get("output_type") == "error" for o in c.get("outputs", []))), "?")
            why = (exc.evalue or "").split("\n")[0][:200]
            print(f"colo-kit run-notebooks: {p}: cell {cell} raised {exc.ename}: {why} (the executed copy: {executed})",
                  file=sys.stderr)
            failed += 1
            continue
        print(f"executed {r['notebook']} in {r['seconds']} s -> {r['executed']}" + (f" and {r['html']}" if "html" in r else ""))
    return 1 if failed else 0


@dataclass
class DemoArgs:
    out: str | None = field(default=None, metadata={"help": "folder for the executed copies (default results/runs/demo)"})


def demo(argv: list[str]) -> int:
    """`make demo`: the quickstart, executed headless, saved with an HTML copy."""
    from colo_kit_cli.commands import parse_dataclasses, writable_dir

    (args,) = parse_dataclasses((DemoArgs,), argv, prog="colo-kit demo", description=demo.__doc__)
    r = execute(NOTEBOOKS / "00_quickstart.ipynb", writable_dir(args.out or runs_dir() / "demo", "--out"))
    print(f"\n[colo_kit] quickstart ran in {r['seconds']} s\n  executed notebook: {r['executed']}\n"
          f"  HTML copy:         {r['html']}")
    return 0
