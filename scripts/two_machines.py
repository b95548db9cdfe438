"""Two machines on one host: the kit's multi-node launch, run for real with one CPU process per "machine".

What it is: `colo_kit.memory.recipes.node_commands` writes the `accelerate launch` line each node of a multi-node run
executes (`--num_machines 2 --machine_rank 0|1 --main_process_ip ... --num_processes <total>`). Here both lines
run on this host, with 127.0.0.1 as node 0, a free port and CPU settings. Each starts this script once (`rank`):
the two processes rendezvous over gloo, prove they form ONE world of 2 (an all-reduce that crosses them), train a
few steps with `colo_kit.grpo.train.run_grpo("tiny", "colocate")` (TRL's GRPOTrainer, one vLLM engine per rank) and
write `rank<R>-pid<P>.json`. `drive` (the default) runs these parts and writes results/runs/two_machines_cpu.json
(ignored by git; name results/two_machines_cpu.json with --out to update the committed record, which only a run where
a part ran and none failed replaces: record.store.publish):

    ddp        the kit's DDP YAML (`accelerate_config(2, num_machines=2)`), colocated GRPO, 2 steps
    zero3      the kit's ZeRO-3 files (`write_configs`: `deepspeed_config(3, offload_optimizer=True)`), same run
    srun       the SLURM line of `node_commands`, under a stand-in `srun`/`scontrol` (no SLURM here): world check only
    cpu_flag   the DDP lines plus `--cpu`, the pitfall: each launcher starts its process, as two worlds of one

What it is not: training. The tiny model has random weights; the reward only proves the loop turns on both ranks.
Two launchers on one host share its cores and loopback; real nodes add a network and NCCL between GPUs.

    python scripts/two_machines.py [--parts ddp,zero3,srun,cpu_flag] [--out results/two_machines_cpu.json]
    accelerate launch ... scripts/two_machines.py rank --out DIR      # what each node's line runs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import colo_kit  # noqa: E402

colo_kit.setup()  # the runtime defaults, before torch or vLLM is imported
from colo_kit.paths import REPO_ROOT, cache_dir  # noqa: E402

SCRIPT = "scripts/two_machines.py"
PARTS = ("ddp", "zero3", "srun", "cpu_flag")
PROBES = ("srun", "cpu_flag")  # world check only, no training



# ---------------------------------------------------------------------------------------------
# One rank (what each node's `accelerate launch` line runs)
# ---------------------------------------------------------------------------------------------

def deepspeed_launch() -> bool:
    """True when `accelerate launch` was given a DeepSpeed config (it exports ACCELERATE_USE_DEEPSPEED)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def cpu_state_kwargs() -> dict:
    """How to ask accelerate for its state on a machine without a GPU so that 2 processes are one world of 2.

    DDP: `cpu=True` (the MULTI_CPU path, gloo); TRL's `use_cpu=True` asks the same. DeepSpeed: accelerate builds a
    DeepSpeed state only with cpu=False (accelerate/state.py, `if not cpu`) and then, finding no GPU, no backend:
    "No backend == no distributed training" sets num_processes=1 on every rank although DeepSpeed's CPU accelerator
    joined a gloo group of 2 (measured here: DeepSpeed then refuses the batch, `train_batch_size is not equal to
    micro_batch_per_gpu * gradient_acc_step * world_size 4 != 4 * 1 * 2`). Naming the backend keeps the world;
    for the Trainer that is `use_cpu=False, ddp_backend="gloo"`."""
    from colo_kit.env import has_cuda

    if has_cuda():
        return {}
    return {"backend": "gloo"} if deepspeed_launch() else {"cpu": True}


def join_world() -> dict:
    """Join the group the launcher described and show whom it spans: rank r adds r + 1, so the all-reduced sum is
    3.0 in one world of 2 and 1.0 in a world of one."""
    import torch
    import torch.distributed as dist
    from accelerate import PartialState

    state = PartialState(**cpu_state_kwargs())
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    t = torch.tensor([rank + 1.0])
    if dist.is_initialized():
        dist.all_reduce(t)
    return {"rank": rank, "world_size": world, "all_reduce_sum": t.item(), "backend": state.backend,
            "distributed_type": str(state.distributed_type),
            # accelerate's own count, which the Trainer sizes batches by: it must agree with torch's
            "accelerate_num_processes": state.num_processes, "accelerate_process_index": state.process_index,
            # torchrun's name for the node rank: accelerate hands --machine_rank to torchrun as --node_rank
            "machine_rank": int(os.environ.get("GROUP_RANK", -1)), "local_rank": int(os.environ.get("LOCAL_RANK", -1)),
            "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
            "slurm_nodeid": os.environ.get("SLURM_NODEID"), "pid": os.getpid(), "host": socket.gethostname()}


def rank_main(out: Path, steps: int, probe: bool) -> int:
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    record = {"rank": int(os.environ.get("RANK", 0)), "status": "started"}
    local_rewards = []
    engine = None

    def on_trainer(trainer):
        nonlocal engine
        engine = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
        acc = trainer.accelerator
        record["trainer"] = {"distributed_type": str(acc.distributed_type), "num_processes": acc.num_processes,
                             "mixed_precision": acc.mixed_precision, "device": str(acc.device),
                             "vllm_mode": getattr(getattr(trainer, "vllm_generation", None), "mode", None)}

    try:
        record.update(join_world())
        if deepspeed_launch():
            import deepspeed
            from deepspeed.accelerator import get_accelerator

            record["deepspeed"] = {"version": deepspeed.__version__, "accelerator": get_accelerator().device_name(),
                                   "comm_backend": get_accelerator().communication_backend_name()}
        if not probe:
            from colo_kit.grpo.rewards import make_length_reward
            from colo_kit.grpo.train import run_grpo

            length = make_length_reward(20)

            def length_reward(completions, **kwargs):
                # this rank's own completions, from its own engine; TRL's logged "reward" is the mean over all ranks
                rewards = length(completions, **kwargs)
                local_rewards.append({"n": len(rewards), "mean": sum(rewards) / len(rewards)})
                return rewards

            cpu = cpu_state_kwargs()
            extra = {"use_cpu": False, "ddp_backend": cpu["backend"]} if "backend" in cpu else {}
            run = run_grpo("tiny", "colocate", reward=length_reward, max_steps=steps, num_generations=4,
                           per_device_train_batch_size=4, max_completion_length=16, num_prompts=32, on_trainer=on_trainer,
                           output_dir=out / f"trainer-rank{record['rank']}", **extra)
            record.update(rewards=run.rewards, local_rewards=local_rewards, train_s=run.elapsed_s,
                          steps=[{k: v for k, v in s.items() if k in ("step", "reward", "reward_std", "loss",
                                                                          "grad_norm", "wall_s")} for s in run.steps])
        record["status"] = "ok"
    except Exception as exc:
        record.update(status="error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-4000:])
        print(record["traceback"], file=sys.stderr, flush=True)
    record["wall_s"] = round(time.perf_counter() - t0, 2)
    # pid in the name: under `--cpu` both processes are rank 0 of their own world
    (out / f"rank{record['rank']}-pid{os.getpid()}.json").write_text(json.dumps(record, indent=1) + "\n")
    leave_world(engine)
    return 0 if record["status"] == "ok" else 1


def leave_world(llm=None) -> None:
    """Leave together and tear the groups down before exit. Measured: without it, a rank whose peer exits first
    sometimes dies at interpreter exit ("terminate called without an active exception", SIGABRT; 2 of 8 probe
    launches) after its work is done, and torchrun reports the machine as failed. With an engine, its shutdown
    goes first: vLLM's teardown destroys its own groups and then the default one
    (parallel_state.cleanup_dist_env_and_memory), and run at exit after ours it raises "Invalid process group"."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    dist.barrier()
    if llm is not None:
        from colo_kit.colocate.vllm_compat import shutdown

        shutdown(llm)
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Both machines (drive)
# ---------------------------------------------------------------------------------------------

FAKE_SRUN = """#!/usr/bin/env bash
# Stand-in for SLURM's srun (no SLURM on this host): `srun --nodes N --ntasks-per-node 1 CMD...` runs CMD once per
# "node", all on this host, with SLURM_NODEID / SLURM_PROCID / SLURM_NNODES set as srun sets them.
n=1
while [[ $1 == --* ]]; do
  case $1 in --nodes) n=$2; shift 2;; --ntasks-per-node) shift 2;; *) echo "stand-in srun: $1 unknown" >&2; exit 2;; esac
done
pids=()
for ((i = 0; i < n; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i SLURM_NNODES=$n "$@" & pids+=($!); done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done; exit $rc
"""
# `scontrol show hostnames LIST`: one host per line; node 0 is this host's loopback
FAKE_SCONTROL = """#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" ]] || { echo "stand-in scontrol: only 'show hostnames'" >&2; exit 2; }
echo 127.0.0.1; echo 127.0.0.2
"""


def _tree(pid: int) -> list[int]:
    import psutil

    try:
        return [pid] + [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _stop(procs: list) -> None:
    """End every process a launch started: the launchers' groups, and torchrun's workers, which it starts in
    sessions of their own. SIGTERM first (torchrun then stops its workers), SIGKILL what is left after 10 s."""
    pids = [pid for p in procs for pid in _tree(p.pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.2)
            for p in procs:
                p.poll()  # reap our own children, so they stop counting as alive
        if not any(_alive(pid) for pid in pids):
            break


def run_nodes(commands: list[list[str]], env: dict, logs: Path, timeout_s: float) -> dict:
    """Start every node's command at once (each its own process group) and poll until all end, one fails, or the
    deadline passes; on failure or timeout every process they started is ended. Returns returncodes and seconds."""
    import subprocess

    logs.mkdir(parents=True, exist_ok=True)
    procs, t0 = [], time.monotonic()
    try:
        for i, argv in enumerate(commands):
            with open(logs / f"node{i}.log", "wb") as log:
                procs.append(subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        while True:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes):
                break
            if time.monotonic() - t0 > timeout_s:
                codes = ["timeout" if c is None else c for c in codes]
                break
            time.sleep(0.5)
    finally:
        if any(p.poll() is None for p in procs):
            _stop(procs)
    return {"returncodes": codes, "seconds": round(time.monotonic() - t0, 1)}


def _tail(path: Path, lines: int = 40) -> str:
    """The end of a log, and before it every line that names an error (torchrun's report buries the cause)."""
    if not path.exists():
        return ""
    text = path.read_text(errors="replace").splitlines()
    errors = [line for line in text[:-lines] if "Error" in line or "error:" in line][-20:]
    return "\n".join(errors + ["..."] + text[-lines:]) if errors else "\n".join(text[-lines:])


def deepspeed_site() -> Path:
    """Where `drive` installs DeepSpeed when the venv has none: the CPU tier does not carry it (requirements/gpu.txt
    does), and a folder of its own keeps it out of every other process of the kit (.cache/ is not committed)."""
    return cache_dir() / "deepspeed-cpu"


def deepspeed_env() -> tuple[dict | None, str]:
    """Extra environment under which DeepSpeed imports, and how it was found; (None, why) when it cannot be had."""
    import importlib.util
    import subprocess

    site = deepspeed_site()
    if importlib.util.find_spec("deepspeed") is not None:
        return {}, "installed in this environment"
    if not (site / "deepspeed").is_dir():
        pin = next((line.strip() for line in (REPO_ROOT / "requirements" / "gpu.txt").read_text().splitlines()
                    if line.startswith("deepspeed==")), "deepspeed")
        # --no-build-isolation: DeepSpeed's setup imports torch (this CPU torch, not a CUDA one from PyPI);
        # --no-deps: the rest of what it needs (ninja, psutil, py-cpuinfo, pydantic, einops) the CPU tier has
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-deps",
                               "--target", str(site), pin, "hjson", "msgpack"],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            return None, f"pip install {pin} failed: {proc.stderr.strip()[-800:]}"
    return {"PYTHONPATH": str(site)}, f"not in this environment: from {_rel(site)} (pip install --target, by this script)"


def _rel(path: Path) -> str:
    """`path` as the commands name it: relative to the repo root (where they run) when inside it."""
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(Path(path).resolve())


def run_part(part: str, work: Path, timeout_s: float) -> dict:
    """One launch of both machines: the commands node_commands gives, run, and what each rank wrote."""
    import yaml

    from colo_kit.parallel.launch import child_env, free_port
    from colo_kit.memory.recipes import accelerate_config, node_commands, write_configs

    ranks_dir, logs = work / part / "ranks", work / part / "logs"
    ranks_dir.mkdir(parents=True, exist_ok=True)
    env = child_env()
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # this venv's accelerate
    record: dict = {"part": part}
    if part == "zero3":
        extra, how = deepspeed_env()
        record["deepspeed"] = how
        if extra is None:
            return {**record, "status": "not run", "why": how}
        if extra.get("PYTHONPATH"):
            env["PYTHONPATH"] = os.pathsep.join([extra["PYTHONPATH"], env["PYTHONPATH"]])
        files = write_configs("tiny", 2, gpus_per_node=1, out=work / part / "configs")
        config, launch_args = files["accelerate_zero3"], []
        record["deepspeed_config"] = json.loads(Path(files["deepspeed"]).read_text())
    else:
        config = work / part / "ddp_2machines.yaml"
        config.write_text(yaml.safe_dump(accelerate_config(num_processes=2, num_machines=2), sort_keys=True))
        # the YAML says bf16 (GPU nodes); on a CPU the Trainer would then autocast to bf16 (measured)
        launch_args = ["--mixed_precision", "no"] + (["--cpu"] if part == "cpu_flag" else [])
    record["config"] = Path(config).read_text()
    probe = part in PROBES
    script_args = ["rank", "--out", _rel(ranks_dir)] + (["--probe"] if probe else [])
    cmds = node_commands("tiny", 2, gpus_per_node=1, config_file=_rel(config), script=SCRIPT, script_args=script_args,
                         main_process_ip="127.0.0.1", main_process_port=free_port(), launch_args=launch_args)
    if part == "srun":
        bin_dir = work / part / "bin"
        bin_dir.mkdir(exist_ok=True)
        for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
        env["PATH"] = os.pathsep.join([str(bin_dir), env["PATH"]])
        env["SLURM_JOB_NODELIST"] = "127.0.0.[1-2]"
        record["commands"] = [cmds["srun"]]
        argvs = [["bash", "-c", cmds["srun"]]]
    else:
        record["commands"] = cmds["lines"]
        argvs = cmds["per_node"]
    run = run_nodes(argvs, env, logs, timeout_s)
    ranks = [json.loads(p.read_text()) for p in sorted(ranks_dir.glob("rank*.json"))]
    record.update(run, ranks=ranks)
    record["status"] = "ok" if all(c == 0 for c in run["returncodes"]) and len(ranks) == 2 else "error"
    if record["status"] != "ok":
        record["log_tails"] = {p.name: _tail(p) for p in sorted(logs.glob("*.log"))}
    return record


def summary(parts: dict) -> list[str]:
    """What the parts showed, one line each."""
    lines = []
    for name, rec in parts.items():
        ranks = rec.get("ranks", [])
        if rec.get("status") == "not run":
            lines.append(f"{name}: not run: {rec['why']}")
            continue
        if any("world_size" not in r for r in ranks):  # a rank that failed before it joined the world
            lines.append(f"{name}: {rec['status']}, exit codes {rec.get('returncodes')}, "
                         f"{[r.get('error', '')[:200] for r in ranks]}; the logs' tails are in the record")
            continue
        worlds = sorted({r['world_size'] for r in ranks})
        lines.append(f"{name}: {len(ranks)} process(es), world size {worlds}, machine ranks "
                     f"{sorted(r['machine_rank'] for r in ranks)}, all-reduce sum {[r['all_reduce_sum'] for r in ranks]}"
                     + (f", rewards {[r.get('rewards') for r in ranks]}" if any('rewards' in r for r in ranks) else "")
                     + f", {rec.get('seconds')} s, {rec['status']}"
                     + (" (the pitfall: --cpu takes accelerate's single-process launcher on each machine)"
                        if name == "cpu_flag" and worlds == [1] else ""))
    return lines


def drive(parts=PARTS, out: Path | None = None, timeout_s: float = 480, work: Path | None = None) -> dict:
    """Run `parts` (the training ones one after another, then the probes together) and write the record:
    hardware, versions, the commands that ran, every rank's record, seconds. It goes to `out` (default
    results/runs/two_machines_cpu.json) when a part ran and none failed, or nothing is there yet; else to
    results/runs/ (a failed or empty run replaced the committed record)."""
    from colo_kit.env import describe
    from colo_kit.paths import runs_dir
    from colo_kit.memory.recipes import node_commands
    from record.store import publish

    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise ValueError(f"parts={list(parts)!r}: {unknown or 'none'} unknown; choose from {list(PARTS)}")
    t0 = time.perf_counter()
    work = Path(work or tempfile.mkdtemp(prefix="two-machines-", dir=runs_dir()))
    record = {"what": "two accelerate launchers on one host, one CPU process per machine, gloo; the commands are "
                      "colo_kit.memory.recipes.node_commands' with 127.0.0.1, a free port and CPU flags",
              "env": describe(), "work_dir": _rel(work),
              # the host's load: other jobs on the same cores stretch every number below
              "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
              # the same function's lines for the post's 72B recipe (2 nodes x 8 GPUs), for comparison
              "recipe_72b_commands": node_commands("qwen2.5-72b", 16)}
    done = {}

    def one(part):
        print(f"[two_machines] {part} ...", flush=True)
        done[part] = run_part(part, work, timeout_s)
        print(f"[two_machines] {summary({part: done[part]})[0]}", flush=True)

    for part in (p for p in parts if p not in PROBES):
        one(part)
    # the probes only import and all-reduce: run together, they share the 2 cores' import time
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(one, [p for p in parts if p in PROBES]))
    record["parts"] = {part: done[part] for part in parts}
    record["summary"] = summary(record["parts"])
    record["seconds"] = round(time.perf_counter() - t0, 1)
    record["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out = Path(out) if out else runs_dir() / "two_machines_cpu.json"
    statuses = [p["status"] for p in record["parts"].values()]
    ok = "ok" in statuses and all(s in ("ok", "not run") for s in statuses)  # measured something, nothing failed
    where = publish(out, record, ok)
    print(f"[two_machines] wrote {where}" + (f" ({out} left as it was: no part ran, or one failed)"
                                             if where != out else ""), flush=True)
    return record


def main(argv=None) -> int:
    from colo_kit_cli.commands import run

    return run(_main, sys.argv[1:] if argv is None else list(argv), SCRIPT)  # bad input: one line, exit 2


def _main(argv: list[str]) -> int:
    import shlex

    from colo_kit_cli.commands import ArgumentParser, UsageError, writable_file

    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", nargs="?", default="drive", choices=("drive", "rank"))
    ap.add_argument("--out", default=None, help="drive: the JSON (default results/runs/two_machines_cpu.json; name "
                                                "results/two_machines_cpu.json to update the committed record); "
                                                "rank: the folder for rank<R>-pid<P>.json")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"drive: comma-separated, from {','.join(PARTS)}")
    ap.add_argument("--timeout-s", type=float, default=480, help="drive: per part")
    ap.add_argument("--steps", type=int, default=2, help="rank: GRPO steps")
    ap.add_argument("--probe", action="store_true", help="rank: join the world and all-reduce, no training")
    args = ap.parse_args(argv)
    if args.role == "rank":
        if not args.out:
            ap.error("rank needs --out DIR")
        return rank_main(Path(args.out), args.steps, args.probe)
    # refused before anything starts: no part (an empty record) or an unknown one, a deadline that never comes
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or any(p not in PARTS for p in parts):
        raise UsageError(f"--parts {shlex.quote(args.parts)}: give one or more of {','.join(PARTS)}, comma-separated, "
                         "e.g. --parts ddp,srun")
    if not (math.isfinite(args.timeout_s) and args.timeout_s > 0):
        raise UsageError(f"--timeout-s {args.timeout_s:g}: give a positive number of seconds a part may take, "
                         "e.g. --timeout-s 480")
    if args.out:
        writable_file(args.out, "--out")  # before the run, so its record is not lost to an unwritable path
    record = drive(parts, args.out, args.timeout_s)
    statuses = [p["status"] for p in record["parts"].values()]
    if all(s == "not run" for s in statuses):
        print("[two_machines] no part ran (" + "; ".join(summary(record["parts"])) + ")", flush=True)
    # 0 when every part that ran succeeded and one did; a run that measured nothing is not a success
    return 0 if "ok" in statuses and all(s in ("ok", "not run") for s in statuses) else 1


if __name__ == "__main__":
    raise SystemExit(main())
