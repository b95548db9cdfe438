"""What a notebook kernel leaves on the GPU when it dies, and what a second kernel sees on a GPU the first one holds.

Two checks, each with real Jupyter kernels (jupyter_client, the kernel JupyterLab starts) running the kit's calls:

  killed   a kernel starts a vLLM server (`colo_kit.serving.server.start_server`, as notebook 01's server mode does) and
           is then killed with SIGKILL, as a crashed or force-killed kernel is: no atexit, no cleanup cell. The
           server's process group must be gone, and on a GPU its memory free, within 10 s (`colo_kit.procs`
           starts servers in their own session with a parent-death signal).
  replicas the same with notebook 06's two LoRA replicas (`colo_kit.async_lora.replicas.launch_replicas`), two groups.
  two      kernel A builds a colocated engine (`ColocatedEngine`, notebook 02's call) with a share of the GPU; kernel
           B, while A lives, builds one with a share that no longer fits. B must fail with `colo_kit.gpu_free`'s
           one line (GpuBusy naming the free memory and the fixes), never vLLM's memory-profiling assert. Needs a
           GPU (on a CPU there is no share to check: recorded as not run).

    python scripts/gpu/kernel_kill.py [--out results/kernel_kill_1xh200.json] [--checks killed,replicas,two]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

DEADLINE_S = 10.0


def _gpu_used_gib() -> float | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used / 2**30
    except Exception:
        return None


def _group_pids(pgid: int) -> list[int]:
    """The live pids of process group `pgid` (zombies, which hold no memory, left out)."""
    pids = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                pids.append(proc.pid)
        except (ProcessLookupError, psutil.Error):  # gone between the listing and the look (or unreadable)
            continue
    return pids


class Kernel:
    """A python3 kernel as JupyterLab starts one, and the code it runs."""

    def __init__(self, cwd: Path):
        from jupyter_client.manager import KernelManager

        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=str(cwd), env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid

    def run(self, code: str, timeout_s: float) -> dict:
        """{"stdout", "error": {"ename", "evalue"} or None} of one cell."""
        out, err = [], None

        def hook(msg):
            nonlocal err
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind == "error":
                err = {"ename": content["ename"], "evalue": content["evalue"]}

        self.kc.execute_interactive(code, output_hook=hook, timeout=timeout_s)
        return {"stdout": "".join(out), "error": err}

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.kc.stop_channels()

    def shutdown(self) -> None:
        try:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=True)
        except Exception:
            pass


SERVER_CELL = """from colo_kit.serving.server import start_server
from colo_kit.parallel.launch import free_port
import os
srv = start_server('tiny', port=free_port(), gpu_memory_utilization=0.3, enforce_eager=True,
                   log_path={log!r}, timeout_s=400)
print('PGIDS', os.getpgid(srv.pid))
"""

REPLICAS_CELL = """from colo_kit.env import Machine
from colo_kit.async_lora.lora import replica_launch
from colo_kit.models import resolve_model
from colo_kit.async_lora.replicas import free_port, launch_replicas, placement
import os
gpu = bool(Machine.here().gpus)
launches = [replica_launch(resolve_model('tiny'), port=free_port(), max_staleness=1, lora_rank=1,
                           block_size=16 if gpu else 32, max_model_len=512, gpu=p['gpu'],
                           gpu_memory_utilization=p['gpu_memory_utilization'], enforce_eager=gpu or None)
            for p in placement(2, share_gib=12)]
replicas = launch_replicas(launches, {log!r})
print('PGIDS', *[os.getpgid(p.pid) for p in replicas.procs])
"""


def check_killed(work: Path, what: str = "server") -> dict:
    """SIGKILL a kernel that started a vLLM server (`what="server"`) or notebook 06's replicas (`"replicas"`)."""
    baseline = _gpu_used_gib()
    kernel = Kernel(work)
    cell = (SERVER_CELL if what == "server" else REPLICAS_CELL).format(
        log=str(work / "server.log") if what == "server" else str(work))
    res = kernel.run(cell, timeout_s=420)
    rec = {"cell": cell, "baseline_gpu_used_gib": baseline, "kernel_pid": kernel.pid, "start_error": res["error"]}
    if res["error"]:
        kernel.shutdown()
        return {**rec, "status": "failed to start"}
    pgids = [int(g) for g in res["stdout"].split("PGIDS")[1].split()]
    rec["pgids"] = pgids
    rec["group_pids_before"] = [_group_pids(g) for g in pgids]
    rec["gpu_used_gib_before_kill"] = _gpu_used_gib()
    t0 = time.perf_counter()
    kernel.kill()
    polls = []
    while time.perf_counter() - t0 < 30:
        left = sum(len(_group_pids(g)) for g in pgids)
        used = _gpu_used_gib()
        polls.append({"t_s": round(time.perf_counter() - t0, 2), "group_pids": left,
                      "gpu_used_gib": None if used is None else round(used, 2)})
        freed = used is None or baseline is None or used <= baseline + 0.5
        if not left and freed:
            break
        time.sleep(0.25)
    last = polls[-1]
    done = not last["group_pids"] and (last["gpu_used_gib"] is None or baseline is None
                                       or last["gpu_used_gib"] <= baseline + 0.5)
    for g in pgids:  # leave nothing behind whatever the outcome
        for pid in _group_pids(g):
            os.kill(pid, signal.SIGKILL)
    gone_s = last["t_s"] if done else None
    ok = gone_s is not None and gone_s <= DEADLINE_S
    return {**rec, "polls": polls, "freed_after_s": gone_s, "deadline_s": DEADLINE_S,
            "status": "ok" if ok else "not freed in time"}


def check_two(work: Path) -> dict:
    from colo_kit.env import has_cuda

    if not has_cuda():
        return {"status": "not run", "why": "no NVIDIA GPU: a CPU has no memory share to check"}
    a, b = Kernel(work), Kernel(work)
    cell = ("from colo_kit.colocate.engine import ColocatedEngine, ColocateSettings\n"
            "engine = ColocatedEngine('tiny', ColocateSettings(vllm_gpu_memory_utilization={u}), enforce_eager=True)\n"
            "print('READY')\n")
    try:
        ra = a.run(cell.format(u=0.6), timeout_s=300)
        used_a = _gpu_used_gib()
        t0 = time.perf_counter()
        rb = b.run(cell.format(u=0.6), timeout_s=300)
        b_s = round(time.perf_counter() - t0, 2)
    finally:
        a.shutdown()
        b.shutdown()
    err = rb["error"] or {}
    one_line = "\n" not in err.get("evalue", "").strip()
    ok = (ra["error"] is None and err.get("ename") == "GpuBusy" and one_line
          and "AssertionError" not in json.dumps(rb))
    return {"kernel_a": {"share": 0.6, "error": ra["error"], "gpu_used_gib_after": used_a},
            "kernel_b": {"share": 0.6, "error": rb["error"], "seconds_to_answer": b_s},
            "b_message_is_one_line": one_line, "status": "ok" if ok else "unexpected"}


CHECKS = {"killed": check_killed, "replicas": lambda work: check_killed(work, "replicas"), "two": check_two}


def main(argv=None) -> int:
    import colo_kit

    colo_kit.setup()
    from colo_kit.env import describe
    from colo_kit.paths import runs_dir

    ap = argparse.ArgumentParser(prog="kernel_kill.py")
    ap.add_argument("--out", default="results/kernel_kill_1xh200.json")
    ap.add_argument("--checks", default="killed,replicas,two")
    args = ap.parse_args(argv)
    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    bad = [c for c in checks if c not in CHECKS]
    if bad:
        print(f"kernel_kill.py: --checks {','.join(bad)}: give some of {','.join(CHECKS)} (comma-separated)",
              file=sys.stderr)
        return 2
    work = runs_dir() / "kernel_kill"
    work.mkdir(parents=True, exist_ok=True)
    record = {"what": __doc__.split("\n\n")[0], "env": describe(), "checks": {}}
    for name in checks:
        record["checks"][name] = CHECKS[name](work)
        print(name, json.dumps(record["checks"][name])[:1500], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if all(c["status"] in ("ok", "not run") for c in record["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
