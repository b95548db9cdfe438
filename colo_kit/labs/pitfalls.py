"""Break-it labs: the posts' pitfalls run live on the learner's machine, broken and then fixed, a row per run.

- `top_p_breaks_importance_sampling` (notebook 00): with `top_p < 1` vLLM samples from a truncated distribution the
  trainer scores under its full softmax; TRL's sequence-level importance-sampling ratio collapses towards 0 (TRL #6789).
- `tp_seed_rule` (notebook 03): a TP-2 engine's workers sample with one seed (`rank // tp`, TRL's rule), then one
  each (`rank`, the bug the post bisected, vLLM #15895): the same tokens, then tokens that drift apart.
- `lost_buffers` (notebook 02): vLLM #16564, level-2 sleep lost the buffers (rotary cos/sin) and `load_weights`
  restores parameters only; played by overwriting the buffers (a CPU has no sleep), then restoring a snapshot.
- `share_by_hand` (notebook 04): `vllm_gpu_memory_utilization` is a share of the whole GPU; a share picked by hand
  and the planner's, each trained for two steps in a child process (`try_plan`) while NVML reads the GPU's memory.
- `one_adapter_name` (notebook 06): a LoRA replica keys cached KV blocks by adapter name and path (vLLM's
  `_gen_lora_extra_hash_keys`): one name and folder reuses the first version's blocks, TRL's `trl-policy-vN` none.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time


def top_p_breaks_importance_sampling(model: str, top_ps=(0.8, 1.0), max_steps: int = 3, **run_kwargs) -> list[dict]:
    """Train `max_steps` GRPO steps at each `top_p` with one reused engine; return TRL's importance-sampling logs."""
    from colo_kit.colocate.engine_reuse import release_engines, reuse_engines
    from colo_kit.grpo.train import run_grpo

    from transformers.trainer_callback import PrinterCallback

    def quiet(trainer):  # no progress bar and no per-step dict: the table below is the output
        trainer.remove_callback(PrinterCallback)

    rows = []
    reuse_engines()  # top_p is a sampling setting, not an engine one: both runs share one engine
    try:
        for top_p in top_ps:
            run = run_grpo(model, "colocate", max_steps=max_steps, num_generations=4, per_device_train_batch_size=8,
                           max_completion_length=32, learning_rate=1e-3, top_p=top_p, disable_tqdm=True, on_trainer=quiet,
                           **run_kwargs)
            rows.append({
                "top_p": top_p,
                "IS ratio mean (TRL's log)": run.series("sampling/importance_sampling_ratio/mean")[-1],
                "IS ratio min": run.series("sampling/importance_sampling_ratio/min")[-1],
                "vLLM vs trainer log-prob gap (nats/token)": run.series("sampling/sampling_logp_difference/mean")[-1],
            })
            del run
    finally:
        release_engines()
    return rows


SEED_RULES = {"seed = rank // tp (TRL's rule)": lambda rank, tp: rank // tp,
              "seed = rank (one seed per worker)": lambda rank, tp: rank}


def _seed_rule_worker(model: str, max_tokens: int, enforce_eager: bool | None, rules=tuple(SEED_RULES)) -> dict:
    """One rank of a TP-2 engine (inside `colo_kit.parallel.launch`): sample the group's prompts under each seed rule."""
    import torch.distributed as dist

    from colo_kit.colocate.engine import ColocatedEngine, ColocateSettings
    from colo_kit.parallel.tp import random_prompts, unique_cpu_shm_names

    unique_cpu_shm_names()
    rank, tp = dist.get_rank(), 2
    engine = ColocatedEngine(model, ColocateSettings(vllm_tensor_parallel_size=tp, per_device_train_batch_size=2,
                                                     max_prompt_length=32, max_completion_length=max_tokens),
                             enforce_eager=enforce_eager)
    try:
        prompts = random_prompts(2, 16, seed=rank)
        samples = {}
        for rule in rules:
            seed_of = SEED_RULES[rule]
            # vLLM draws a request's tokens from a generator seeded with the request's seed: the same mechanism as
            # the engine seed TRL sets, per request, so both rules run on one engine
            out = engine.generate(prompts, max_tokens=max_tokens, temperature=1.0, ignore_eos=True, logprobs=False,
                                  whole_group=True, seed=1000 + seed_of(rank, tp))
            samples[rule] = out.completion_ids
    finally:
        engine.close()
    return {"rank": rank, "samples": samples}


def tp_seed_rule(model: str = "tiny", max_tokens: int = 16, enforce_eager: bool | None = True,
                 rules=tuple(SEED_RULES)) -> list[dict]:
    """A TP-2 engine on two processes (GPUs or CPU): per seed rule in `rules` (SEED_RULES' keys), how often its two
    workers sampled the same token."""
    unknown = [r for r in rules if r not in SEED_RULES]
    if unknown:
        raise ValueError(f"seed rule {unknown[0]!r}: use one of {list(SEED_RULES)}")
    from colo_kit.parallel.launch import free_port, launch
    from colo_kit.parallel.tp import remove_cpu_shm

    port = free_port()
    try:
        ranks = launch(_seed_rule_worker, model, max_tokens, enforce_eager, tuple(rules), num_processes=2, port=port,
                       echo=False).results
    finally:
        remove_cpu_shm(port)
    rows = []
    for rule in rules:
        a, b = (r["samples"][rule] for r in ranks)
        pairs = [(x, y) for seq_a, seq_b in zip(a, b) for x, y in zip(seq_a, seq_b)]
        rows.append({"rule": rule, "positions": len(pairs),
                     "same token on both workers": round(sum(x == y for x, y in pairs) / len(pairs), 3),
                     "rank 0 first tokens": a[0][:6], "rank 1 first tokens": b[0][:6]})
    return rows


def lost_buffers(engine, trainer_model, restore: bool) -> list[dict]:
    """On a live `ColocatedEngine`: the greedy probe as built, then after losing the buffers and pushing the weights
    (buffers restored from a snapshot, as `SleepManager` keeps one, when `restore`); log-probs too, as a random model's
    greedy tokens often repeat. The engine gets its buffers back at the end either way."""
    import torch

    before = engine.probe()
    buffers = dict(engine.vllm_model.named_buffers())
    snapshot = {name: b.detach().clone() for name, b in buffers.items()}

    def put_back():
        with torch.no_grad():
            for name, b in buffers.items():
                b.copy_(snapshot[name])

    rows = [{"step": "awake, as built", "buffers": ", ".join(buffers) or "none", "greedy tokens": before["token_ids"][:6],
             "same tokens": True, "max |log-prob change|": 0.0}]
    noise = torch.Generator().manual_seed(0)  # the same "garbage" every run
    try:
        with torch.no_grad():
            for b in buffers.values():  # freed memory mapped again holds whatever it holds
                b.copy_(torch.randn(b.shape, generator=noise).to(b.dtype) * 100)
        engine.push_weights(trainer_model)  # parameters only: load_weights does not touch buffers
        if restore:
            put_back()
        probe = engine.probe()
        rows.append({"step": "weights pushed, buffers " + ("restored from the snapshot" if restore else "lost"),
                     "buffers": "restored" if restore else "overwritten", "greedy tokens": probe["token_ids"][:6],
                     "same tokens": probe["token_ids"] == before["token_ids"],
                     "max |log-prob change|": round(max(abs(a - b) for a, b in zip(probe["logprobs"], before["logprobs"])), 4)})
    finally:
        put_back()
    return rows


# TRL's defaults for colocate mode, as the planner and the speed race name them
TRL_DEFAULTS = dict(model="qwen2.5-1.5b", per_device_train_batch_size=8, gradient_checkpointing=True, max_completion_length=256)


def share_by_hand(vllm_gpu_memory_utilization: float | list[float], gpu_mem_gib: float | None = None,
                  **plan) -> tuple[list[dict], dict]:
    """A row per share picked by hand and for the planner's own, on this GPU (an H100 on a CPU) or `gpu_mem_gib`: the
    planner's peak and, on a GPU, two steps trained (`try_plan`); and the estimate at the first share, for its chart."""
    from colo_kit.env import has_cuda
    from colo_kit.memory.planner import estimate, recommend

    plan = {**TRL_DEFAULTS, **plan}
    gpu = has_cuda()
    if gpu_mem_gib is None:  # what `colo-kit plan --recommend` sizes for: the memory CUDA reports
        from colo_kit.memory.planner import read_gpu_memory

        gpu_mem_gib = read_gpu_memory()["gib"] if gpu else 79.1
    by_hand = vllm_gpu_memory_utilization if isinstance(vllm_gpu_memory_utilization, list) \
        else [vllm_gpu_memory_utilization]
    tried = [("by hand", u, estimate(**plan, gpu_mem_gib=gpu_mem_gib, vllm_gpu_memory_utilization=u)) for u in by_hand]
    ours = recommend(**plan, gpu_mem_gib=gpu_mem_gib)
    rows = []
    for who, u, est in (*tried, ("the planner's", ours["vllm_gpu_memory_utilization"], ours)):
        row = {"share": f"{who}: u = {u}", "GPU GiB": round(gpu_mem_gib, 1),
               "peak GiB (modelled)": round(est["peak_gib_per_gpu"], 1), "fits (modelled)": est["fits"]}
        if gpu:
            run = try_plan(**plan, vllm_gpu_memory_utilization=u, max_steps=2)
            row.update({"two steps (measured)": "ran" if run["completed"] else "stopped",
                        "NVML peak GiB (measured)": run["nvml_peak_gib"], "seconds": run["seconds"],
                        "why it stopped": run["error"] or ""})
        rows.append(row)
    return rows, tried[0][2]


def try_plan(*, model: str, vllm_gpu_memory_utilization: float, per_device_train_batch_size: int,
             gradient_checkpointing: bool, max_completion_length: int, num_generations: int = 8, max_steps: int = 3,
             gpu: int = 0, timeout_s: float = 600, every_s: float = 0.2) -> dict:
    """Train `max_steps` steps of `colo-kit train` in a child process (an out-of-memory death would leave a CUDA context
    in a notebook's kernel). Returns {"completed", "seconds", "nvml_peak_gib" (above what was used before; None without
    a GPU), "error" (why it stopped), "out_of_memory"}."""
    from colo_kit.env import has_cuda

    argv = [sys.executable, "-m", "colo_kit", "train", "--model", model,
            "--vllm_gpu_memory_utilization", str(vllm_gpu_memory_utilization),
            "--per_device_train_batch_size", str(per_device_train_batch_size),
            "--gradient_checkpointing", str(gradient_checkpointing).lower(),
            "--max_completion_length", str(max_completion_length), "--num_generations", str(num_generations),
            "--max_steps", str(max_steps)]
    if has_cuda():
        from colo_kit.gpu_free import read_gpu

        def used() -> float:
            reading = read_gpu(gpu)
            return reading["total_gib"] - reading["free_gib"]
    else:
        used = None
    before, peak = (used(), 0.0) if used else (None, None)
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            while proc.poll() is None:
                if used:
                    peak = max(peak, used() - before)
                if time.perf_counter() - t0 > timeout_s:
                    proc.kill()
                time.sleep(every_s)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        log.seek(0)
        lines = [line.strip() for line in log.read().splitlines() if line.strip()]
    error = None if proc.returncode == 0 else _why(lines, proc.returncode, timeout_s)
    return {"completed": proc.returncode == 0, "seconds": round(time.perf_counter() - t0, 1),
            "nvml_peak_gib": round(peak, 2) if peak is not None else None, "error": error,
            "out_of_memory": bool(error and any(m.lower() in error.lower() for m in OOM_MARKS))}


OOM_MARKS = ("out of memory", "OutOfMemoryError", "less than desired GPU memory utilization", "No available memory",
             "GpuBusy")  # the last: the kit's own check before an engine starts (colo_kit.gpu_free)


def _why(lines: list[str], returncode: int, timeout_s: float) -> str:
    """The child's last line that names an out-of-memory, else its last error line, else how it ended."""
    for marks in (OOM_MARKS, ("Error", "error:")):
        hit = [line for line in lines if any(m in line for m in marks)]
        if hit:
            return hit[-1][:300]
    if returncode in (-9, 137):
        return f"killed (after {timeout_s:.0f} s, or by the kernel's out-of-memory killer)"
    return lines[-1][:300] if lines else f"exit code {returncode}"


PUBLISHING = {"one name": ("one name, one folder", ("policy", "policy")),
              "versioned": ("versioned (trl-policy-vN)", ("policy-v1", "policy-v2"))}


def one_adapter_name(replica_url: str, token: str | None, first, second, workdir,
                     prompt_tokens: int = 128, publish=tuple(PUBLISHING)) -> list[dict]:
    """On a live LoRA replica: prompt tokens served from cached blocks (its own counters) when a second adapter version
    follows the first under one name and folder, or under versioned ones (`publish`: PUBLISHING's keys)."""
    unknown = [p for p in publish if p not in PUBLISHING]
    if unknown:
        raise ValueError(f"publish={unknown[0]!r}: use one of {list(PUBLISHING)}")
    import random
    import shutil
    from pathlib import Path

    import httpx

    from colo_kit.async_lora.replicas import replica_counters, settled_counters

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    prompt = [random.Random(7).randrange(10, 1000) for _ in range(prompt_tokens)]

    def post(path, **body):
        r = httpx.post(replica_url.rstrip("/") + path, json=body, headers=headers, timeout=120)
        r.raise_for_status()

    def reused(name) -> float:  # prompt tokens served from cached blocks for one request
        before = replica_counters(replica_url, token)
        post("/v1/completions", model=name, prompt=prompt, max_tokens=1, temperature=0.0)
        (after,) = settled_counters([replica_url], [before], 1, token)  # once the counters include this request
        return after["hits"] - before["hits"]

    def copy_in(src, dst: Path):
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
        return str(dst)

    workdir = Path(workdir)
    rows = []
    for case, names in (PUBLISHING[p] for p in publish):
        post("/reset_prefix_cache")
        loaded = []
        for version, (name, src) in enumerate(zip(names, (first, second)), start=1):
            if name in loaded:  # the new version replaces the old one under its name, as a fixed-name sync would
                post("/v1/unload_lora_adapter", lora_name=name)
                loaded.remove(name)
            # one folder per name: a fixed-name sync overwrites one folder too
            post("/v1/load_lora_adapter", lora_name=name, lora_path=copy_in(src, workdir / case.split()[0] / name))
            loaded.append(name)
            hits = reused(name)
            rows.append({"publishing": case, "version": version, "adapter name": name,
                         "prompt tokens from cached blocks": int(hits)})
        for name in loaded:
            post("/v1/unload_lora_adapter", lora_name=name)
    return rows
