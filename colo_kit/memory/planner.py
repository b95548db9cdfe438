"""Memory planner (notebook 04): a GRPO step's per-GPU memory by part in both phases, and the cheapest settings that fit.
TRL's own choices are modelled: float32 weights for a model given by path, checkpointing on, a chunked LM head for
log-probs, sleep at level 2 with `empty_cache()` before waking.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from colo_kit.memory.model_shapes import model_shape
from colo_kit.models import Preset

GIB = 2**30
H200_GIB = 139.8  # what CUDA reports as one H200's total memory (nvidia-smi's 143,771 MiB less the driver's share)
MAX_GPU_MEM_GIB = 4096.0   # no GPU holds more; a bigger number is a typo (and 1e308 overflows the KV token count)

# ---- set from physical facts ----
TOKEN_TILE = 4096          # TRL's chunked log-prob: tokens per tile (trl/kernels/chunked_logprob.py)
VOCAB_TILE = 32768         # ... and vocabulary columns per tile (_CHUNKED_LOGPROB_CHUNK_SIZE)
WEIGHT_SYNC_BUFFERS_GIB = 2.0   # server mode: vLLM's packed NCCL broadcast, 2 buffers of 1 GiB
VLLM_ASLEEP_GIB = 0.25     # what a sleeping engine still holds (CUDA graph pool); GPU README: sleep(2) freed 41.7 of 41.9 GiB
VLLM_OVERHEAD_GIB = 1.5    # inside u × memory but not KV: activation headroom + CUDA graphs (vLLM's profiler)
SAFE_FRACTION = 0.92       # recommend settings whose predicted peak stays under 92% of the GPU
# An engine sized to one generation gets twice what it needs: vLLM's own start-up buffers vary with max_num_seqs and
# its version, and a KV cache short of one generation preempts and recomputes.
GENERATION_SHARE_MARGIN = 2.0
EXPANDABLE_RESERVE = 0.05  # expandable segments reuse a freed block for any size: the reserve is rounding only

# ---- fitted to the measured peaks (record.planner_validation) ----
FITTED = {
    "CUDA_CONTEXT_GIB": 0.5,  # per process: CUDA context, cuBLAS workspaces, vLLM's buffers outside its budget
    "NCCL_GIB": 0.25,  # per process with a communicator (world size > 1, or server mode's link to vLLM)
    "KEPT_AFTER_EMPTY_CACHE": 0.2,  # freed memory empty_cache() cannot hand back (segments pinned by live tensors)
    "ALLOCATOR_RESERVE": 0.6,  # the allocator's reserve above its live tensors, per byte of activations and logits
}


def _finite_positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _help(text: str, **more) -> dict:
    """A field's `colo-kit plan --help` line (HfArgumentParser reads `metadata`)."""
    return {"metadata": {"help": text, **more}}


@dataclass
class Plan:
    model: str = field(default="qwen2.5-1.5b", **_help("a preset, or a folder or JSON file with the model's config"))
    gpus: int = field(default=1, **_help("training GPUs (colocate: each also runs its engine)"))
    gpu_mem_gib: float = field(default=H200_GIB, **_help("memory per GPU in GiB"))
    mode: str = field(default="colocate", **_help("colocate, or server (sized for the training GPU)"))
    zero_stage: int = field(default=0, **_help("DeepSpeed ZeRO stage; 0 is plain DDP"))
    offload_optimizer: bool = field(default=False, **_help("DeepSpeed offload_optimizer: cpu (needs zero_stage >= 1)"))
    offload_params: bool = field(default=False, **_help("DeepSpeed offload_param: cpu (needs zero_stage 3)"))
    vllm_gpu_memory_utilization: float = field(default=0.3, **_help("vLLM's share of the whole GPU (TRL's default)"))
    vllm_tensor_parallel_size: int = field(default=1, **_help("GPUs per vLLM engine", aliases=["--tp"]))
    sleep_level: int = field(default=0, **_help("0: no sleep; TRL's vllm_enable_sleep_mode sleeps at level 2"))
    kv_only_sleep: bool = field(default=False, **_help("with a sleep level: release the KV cache only "
                                                      "(colo_kit.colocate.kv_sleep)"))
    per_device_train_batch_size: int = field(default=8, **_help("completions per GPU per optimizer step"))
    steps_per_generation: int = field(default=1, **_help("optimizer steps fed by one generation"))
    prompt_length: int = field(default=96, **_help("longest prompt in tokens"))
    max_completion_length: int = field(default=256, **_help("longest completion in tokens"))
    lora_rank: int = field(default=0, **_help("0: full fine-tuning; else the LoRA rank"))
    gradient_checkpointing: bool = field(default=True, **_help("recompute activations (TRL GRPOConfig's default)"))
    train_dtype: str = field(default="float32", **_help("float32 (TRL's default for a model given by path) or "
                                                        "bfloat16 (model_init_kwargs: {dtype: bfloat16})"))
    expandable_segments: bool = field(default=False, **_help(
        "PyTorch's allocator grows its segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): less memory "
        "held above the live tensors; not with sleep mode, whose memory pool vLLM keeps apart"))
    gpus_per_node: int = field(default=8, **_help("GPUs per node, for multi-node plans"))
    host_mem_gib: float | None = field(default=None, **_help("CPU memory per node in GiB, to check offload and sleep level 1"))

    def validate(self) -> "Plan":
        def bad(name, value, fix):
            raise ValueError(f"{name}={value!r} is invalid: {fix}")

        if self.mode not in ("colocate", "server"):
            bad("mode", self.mode, "use 'colocate' or 'server'")
        if not isinstance(self.gpus, int) or self.gpus < 1:
            bad("gpus", self.gpus, "use a whole number >= 1")
        if not _finite_positive(self.gpu_mem_gib) or self.gpu_mem_gib > MAX_GPU_MEM_GIB:
            bad("gpu_mem_gib", self.gpu_mem_gib, f"use the GPU's memory in GiB, at most {MAX_GPU_MEM_GIB:g} "
                f"(H200: {H200_GIB}, H100 80 GB: 79.1)")
        if self.host_mem_gib is not None and not _finite_positive(self.host_mem_gib):
            bad("host_mem_gib", self.host_mem_gib, "use the CPU memory per node in GiB (the 8xH200 machine: 560)")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            bad("gpus_per_node", self.gpus_per_node, "use a whole number >= 1")
        if self.zero_stage not in (0, 1, 2, 3):
            bad("zero_stage", self.zero_stage, "use 0 (DDP), 1, 2 or 3")
        if self.offload_optimizer and self.zero_stage == 0:
            bad("offload_optimizer", True, "optimizer offload is a DeepSpeed ZeRO feature: set zero_stage >= 1")
        if self.offload_params and self.zero_stage != 3:
            bad("offload_params", True, "parameter offload needs zero_stage=3")
        if not isinstance(self.vllm_gpu_memory_utilization, (int, float)) or not 0 < self.vllm_gpu_memory_utilization <= 1:
            bad("vllm_gpu_memory_utilization", self.vllm_gpu_memory_utilization, "use a fraction in (0, 1], e.g. 0.3")
        tp = self.vllm_tensor_parallel_size
        if tp < 1 or (self.mode == "colocate" and self.gpus % tp):
            bad("vllm_tensor_parallel_size", tp, f"use a TP size that divides the GPU count ({self.gpus})")
        if self.sleep_level not in (0, 1, 2):
            bad("sleep_level", self.sleep_level, "use 0 (no sleep), 1 (weights to CPU) or 2 (discard weights)")
        if self.kv_only_sleep and not self.sleep_level:
            bad("kv_only_sleep", True, "it changes how the engine sleeps: give a sleep_level of 1 or 2 with it")
        if self.expandable_segments and self.sleep_level:
            bad("expandable_segments", True, "vLLM's sleep mode refuses PyTorch's expandable segments: use sleep_level 0")
        if self.mode == "server" and self.sleep_level:
            bad("sleep_level", self.sleep_level, "sleep is for colocate mode; use 0 with --mode server")
        for name in ("per_device_train_batch_size", "steps_per_generation", "prompt_length", "max_completion_length"):
            if getattr(self, name) < 1:
                bad(name, getattr(self, name), "use a positive whole number")
        if self.lora_rank < 0:
            bad("lora_rank", self.lora_rank, "use 0 for full fine-tuning or a LoRA rank >= 1")
        if self.train_dtype not in ("float32", "bfloat16"):
            bad("train_dtype", self.train_dtype, "use 'float32' (TRL's default) or 'bfloat16'")
        model_shape(self.model)
        return self


def _activation_bytes_per_token(m: Preset, plan: Plan) -> float:
    """Bytes autograd keeps per token for backward: per layer the norms, the bf16 casts, q/k/v, attention output and
    the MLP's four intermediates; with checkpointing only each layer's input, plus one layer recomputed."""
    h, i, kv = m.hidden_size, m.intermediate_size, m.kv_dim
    resid = 4 if plan.train_dtype == "float32" else 2
    casts = 3 if plan.train_dtype == "float32" else 1   # an fp32 model casts its input once per linear
    norms = 2 * (4 * h + resid * h)
    attn = 2 * h * casts + (2 * h + 4 * kv) + (4 * h + 4 * kv) + (2 * h + 4 * kv) + 2 * h
    mlp = 2 * h * (2 if plan.train_dtype == "float32" else 1) + 8 * i
    per_layer = norms + attn + mlp
    if plan.gradient_checkpointing:
        return m.num_hidden_layers * resid * h + 2 * per_layer
    return m.num_hidden_layers * per_layer


def estimate(plan: Plan | None = None, **settings) -> dict:
    """Per-GPU memory (GiB) by part for both phases, the peak, whether it fits, and the host memory."""
    plan = replace(plan or Plan(), **settings).validate()
    m = model_shape(plan.model)
    P = m.num_params()
    n = plan.gpus
    colocate = plan.mode == "colocate"
    w_bytes = 4 if plan.train_dtype == "float32" else 2
    deepspeed = plan.zero_stage >= 1
    lora = plan.lora_rank > 0
    tokens = plan.per_device_train_batch_size * (plan.prompt_length + plan.max_completion_length)
    notes: list[str] = []

    # ---- training state -------------------------------------------------------------------------
    trainable = m.lora_params(plan.lora_rank) if lora else P
    sync_gather = 0.0
    if deepspeed:
        # DeepSpeed with bf16 keeps bf16 weights and gradients, an fp32 master copy and fp32 Adam moments.
        weights = 2 * P / (n if plan.zero_stage == 3 else 1)
        if plan.offload_params:
            weights = 0.0
        grads = 2 * trainable / (n if plan.zero_stage >= 2 else 1)
        optimizer = 0.0 if plan.offload_optimizer else 12 * trainable / n
        ddp_buckets = 0.0
        # ZeRO-3 gathers each layer before use (and prefetches the next); the embedding is the largest piece.
        zero3_gathered = (4 * m.layer_params() + 2 * m.vocab_size * m.hidden_size) if plan.zero_stage == 3 else 0
        zero_buckets = 4 * 2 * m.hidden_size ** 2      # reduce bucket ("auto" = hidden²) in fp32, twice
        if lora and plan.zero_stage == 3:
            notes.append("LoRA + ZeRO-3: TRL gathers the whole model on every GPU to merge the adapter before "
                         "each weight sync (trl/generation/vllm_generation.py); counted in the generation phase.")
            sync_gather = 2 * P
    else:
        weights = w_bytes * P
        grads = (4 if lora else w_bytes) * trainable    # PEFT keeps adapters in fp32
        optimizer = 2 * (4 if lora else w_bytes) * trainable   # torch AdamW keeps m, v in the parameter dtype
        ddp_buckets = grads if n > 1 else 0.0
        zero3_gathered = zero_buckets = 0.0

    # ---- activations and the fused LM head --------------------------------------------------------
    activations = tokens * _activation_bytes_per_token(m, plan)
    lm_grad = 0 if lora else 4 * m.vocab_size * m.hidden_size   # fp32 gradient of the LM head weight
    logits = min(tokens, TOKEN_TILE) * VOCAB_TILE * 2 + lm_grad + 4 * tokens * m.hidden_size

    ctx = FITTED["CUDA_CONTEXT_GIB"] + (FITTED["NCCL_GIB"] if (n > 1 or not colocate) else 0.0)
    g = lambda b: b / GIB  # noqa: E731

    # ---- vLLM -----------------------------------------------------------------------------------
    tp = plan.vllm_tensor_parallel_size
    vllm_total = plan.vllm_gpu_memory_utilization * plan.gpu_mem_gib if colocate else 0.0
    vllm_weights = g(2 * P / tp) if colocate else 0.0
    kv_heads_per_gpu = max(1, m.num_key_value_heads // tp)
    kv_bytes_per_token = 2 * m.num_hidden_layers * kv_heads_per_gpu * m.head_dim * 2
    kv_cache = max(0.0, vllm_total - vllm_weights - VLLM_OVERHEAD_GIB) if colocate else 0.0
    # TRL's colocate engine gets every prompt of its TP group for a whole generation
    seqs = plan.per_device_train_batch_size * tp * plan.steps_per_generation
    kv_needed = g(seqs * (plan.prompt_length + plan.max_completion_length) * kv_bytes_per_token)
    vllm_min_util = (vllm_weights + VLLM_OVERHEAD_GIB + kv_needed) / plan.gpu_mem_gib if colocate else 0.0
    if colocate and kv_cache < kv_needed:
        notes.append(f"vLLM's KV cache ({kv_cache:.1f} GiB) holds less than one step's sequences ({kv_needed:.1f} GiB): "
                     f"it will preempt and recompute (slow), or fail to start if it is below one block; "
                     f"raise vllm_gpu_memory_utilization to >= {vllm_min_util:.2f} or the TP size")

    asleep = VLLM_ASLEEP_GIB if (colocate and plan.sleep_level) else vllm_total
    if colocate and plan.kv_only_sleep:
        asleep += vllm_weights  # the weights stay mapped through training; only the KV cache is released
    # The backward pass frees activations as it makes gradients, so PyTorch's tensors peak at the larger of the
    # two, not at their sum; above that the allocator keeps a reserve that grows with the activations.
    step = activations + logits
    grads_at_peak = 0.0 if deepspeed else max(0.0, grads - step)
    reserve = (EXPANDABLE_RESERVE if plan.expandable_segments else FITTED["ALLOCATOR_RESERVE"]) * step
    training = {
        "cuda_context_nccl": ctx,
        "weights": g(weights),
        "gradients": g(grads) if deepspeed else g(grads_at_peak),
        "optimizer_states": g(optimizer),
        "ddp_buckets": g(ddp_buckets),
        "zero_buffers": g(zero3_gathered + zero_buckets),
        "activations": g(activations),
        "logits": g(logits),
        "allocator_reserve": g(reserve),
        "vllm_asleep" if plan.sleep_level else "vllm": asleep,
        "weight_sync_buffers": 0.0 if colocate else WEIGHT_SYNC_BUFFERS_GIB,
    }
    # The step's transient memory stays reserved by PyTorch's allocator unless empty_cache() runs (TRL calls it before
    # waking a sleeping engine), and even then segments pinned by live tensors stay.
    transient = step + grads_at_peak + reserve + zero3_gathered
    kept = 1.0 if plan.sleep_level == 0 else FITTED["KEPT_AFTER_EMPTY_CACHE"]
    generation = {
        "cuda_context_nccl": ctx,
        "weights": g(weights),
        "gradients": g(grads) if deepspeed else 0.0,
        "optimizer_states": g(optimizer),
        "ddp_buckets": g(ddp_buckets),
        "zero_buffers": g(zero_buckets),
        "training_cache_kept": g(kept * transient),
        "weight_sync_gather": g(sync_gather),
        "vllm_weights": vllm_weights,
        "vllm_kv_cache": kv_cache,
        "vllm_overhead": max(0.0, vllm_total - vllm_weights - kv_cache),
    }
    if not colocate:
        generation = {k: v for k, v in generation.items() if not k.startswith("vllm")}
    train_peak = sum(training.values())
    gen_peak = sum(generation.values())
    peak = max(train_peak, gen_peak)

    # ---- host memory per node -------------------------------------------------------------------
    ranks_per_node = min(n, plan.gpus_per_node)
    host = {
        # DeepSpeed's CPU Adam: fp32 master, m, v and fp32 gradients of each rank's shard.
        "optimizer_offload": g(16 * trainable / n * ranks_per_node) if plan.offload_optimizer else 0.0,
        "param_offload": g(2 * P / n * ranks_per_node) if plan.offload_params else 0.0,
        # Sleep level 1 copies each engine's weights to (pinned) CPU memory.
        "vllm_sleep_level1": g(2 * P / tp) * ranks_per_node if (colocate and plan.sleep_level == 1) else 0.0,
    }
    host_total = sum(host.values())
    fits_gpu = peak <= plan.gpu_mem_gib
    fits_host = plan.host_mem_gib is None or host_total <= plan.host_mem_gib
    if plan.sleep_level == 1:
        notes.append("TRL's vllm_enable_sleep_mode always sleeps at level 2; level 1 is for the kit's own engine "
                     "(colo_kit.colocate.sleep). For GRPO the weights change every step, so level 2 loses nothing.")

    r = lambda d: {k: round(v, 2) for k, v in d.items()}  # noqa: E731
    return {
        "model": m.name,
        "params_b": round(P / 1e9, 3),
        "trainable_params_b": round(trainable / 1e9, 4),
        "settings": asdict(plan),
        "peak_gib_per_gpu": round(peak, 2),
        "peak_phase": "training" if train_peak >= gen_peak else "generation",
        "fits": bool(fits_gpu and fits_host),
        "fits_gpu": bool(fits_gpu),
        "fits_host": bool(fits_host),
        "parts": {"training": r(training), "generation": r(generation)},
        "phase_peaks_gib": {"training": round(train_peak, 2), "generation": round(gen_peak, 2)},
        "vllm": {"kv_cache_gib": round(kv_cache, 2), "kv_needed_gib": round(kv_needed, 2),
                 "kv_tokens": int(kv_cache * GIB / kv_bytes_per_token) if colocate else 0,
                 "min_gpu_memory_utilization": round(vllm_min_util, 3)},
        "host_gib_per_node": {**r(host), "total": round(host_total, 2)},
        "notes": notes,
    }


def generation_share(plan: Plan) -> float:
    """The engine's share sized to one generation: GENERATION_SHARE_MARGIN times what its weights, overhead and the
    KV cache of one generation's sequences need (`min_gpu_memory_utilization`), rounded up to 0.05."""
    need = estimate(plan)["vllm"]["min_gpu_memory_utilization"]
    return min(1.0, math.ceil(round(GENERATION_SHARE_MARGIN * need * 20, 6)) / 20)


def read_gpu_memory(index: int = 0) -> dict | None:
    """{"name", "gib"} of CUDA device `index` by NVML (no CUDA context): the total less what the driver reserves, as CUDA
    reports it; None without an NVIDIA GPU."""
    from colo_kit.env import visible_gpus

    gpus = visible_gpus()
    if len(gpus) <= index:
        return None
    gpu = gpus[index]
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(gpu["index"])
            try:
                mem = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
                total = mem.total - mem.reserved
            except (pynvml.NVMLError, AttributeError):  # a driver without the v2 call: the whole card
                total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML listed the GPU a moment ago: its own rounded total then
        return {"name": gpu["name"], "gib": gpu["mem_gib"]}
    return {"name": gpu["name"], "gib": math.floor(total / GIB * 10) / 10}


def max_safe_utilization(plan: Plan) -> float:
    """The highest vllm_gpu_memory_utilization whose predicted peak stays under SAFE_FRACTION of the GPU. Each phase's
    peak is linear in u once the share holds the engine's weights, so estimates at 0.5 and 1.0 give the slope."""
    lo = estimate(plan, vllm_gpu_memory_utilization=0.5)
    hi = estimate(plan, vllm_gpu_memory_utilization=1.0)
    budget = SAFE_FRACTION * plan.gpu_mem_gib
    bounds = []  # each phase: peak(u) = base + slope × u; the tightest phase sets the bound
    for phase in ("training", "generation"):
        a0, a1 = lo["phase_peaks_gib"][phase], hi["phase_peaks_gib"][phase]
        slope = (a1 - a0) / 0.5
        base = a0 - 0.5 * slope
        if slope <= 1e-9:
            if base > budget:
                return 0.0
            continue
        bounds.append((budget - base) / slope)
    best = min(bounds) if bounds else 1.0
    return max(0.0, min(0.95, math.floor(best * 100) / 100))


def recommend(plan: Plan | None = None, add_zero: bool = True, **settings) -> dict:
    """Settings that fit, cheapest first: no sleep before sleep, the smallest TP (TP slows small models down), DDP before
    ZeRO, no offload before offload. `add_zero=False` keeps the ZeRO stage and offload as given."""
    base = replace(plan or Plan(), **settings).validate()
    if base.mode == "server":
        tried = []
        for zero, off in ((base.zero_stage, base.offload_optimizer), (3, False), (3, True)):
            cand = replace(base, zero_stage=zero, offload_optimizer=off)
            est = estimate(cand)
            tried.append(est["peak_gib_per_gpu"])
            if est["peak_gib_per_gpu"] <= SAFE_FRACTION * base.gpu_mem_gib and est["fits_host"]:
                return {"fits": True, "zero_stage": zero, "offload_optimizer": off,
                        "peak_gib_per_gpu": est["peak_gib_per_gpu"],
                        "why": "training GPU only: the vLLM server's GPUs are sized by the server"}
        return {"fits": False, "why": f"the training state does not fit even with ZeRO-3 + offload (peaks {tried} GiB)"}

    tps = [t for t in (1, 2, 4, 8) if base.gpus % t == 0 and t <= base.gpus_per_node]
    trains = [(base.zero_stage, base.offload_optimizer)]
    trains += [z for z in ((3, False), (3, True)) if z not in trains and add_zero]
    for zero, off in trains:
        for sleep in (0, 2):
            for tp in tps:
                cand = replace(base, zero_stage=zero, offload_optimizer=off, sleep_level=sleep,
                               vllm_tensor_parallel_size=tp, expandable_segments=base.expandable_segments and not sleep)
                u_min = estimate(cand)["vllm"]["min_gpu_memory_utilization"]
                u_max = max_safe_utilization(cand)
                if u_max >= u_min and u_max > 0:
                    est = estimate(cand, vllm_gpu_memory_utilization=u_max)
                    if not est["fits_host"]:
                        continue
                    return {
                        "fits": True,
                        "vllm_gpu_memory_utilization": u_max,
                        "min_vllm_gpu_memory_utilization": round(u_min, 3),
                        "sleep_level": sleep,
                        "vllm_enable_sleep_mode": sleep > 0,
                        "vllm_tensor_parallel_size": tp,
                        "zero_stage": zero,
                        "offload_optimizer": off,
                        "expandable_segments": cand.expandable_segments,
                        "peak_gib_per_gpu": est["peak_gib_per_gpu"],
                        "kv_cache_gib": est["vllm"]["kv_cache_gib"],
                        "why": _why(base, cand, u_max),
                    }
    return {"fits": False, "why": "nothing fits on this many GPUs, even with ZeRO-3, optimizer offload, sleep "
                                  "level 2 and TP 8: add GPUs, use LoRA (--lora-rank) or shorten the sequences"}


def _why(base: Plan, cand: Plan, u: float) -> str:
    parts = [f"highest vllm_gpu_memory_utilization keeping the peak under {SAFE_FRACTION:.0%} of the GPU: {u}"]
    parts.append("no sleep: the engine and the trainer both fit at once, so skip the wake/reload cost"
                 if cand.sleep_level == 0 else
                 "sleep level 2: the trainer needs the engine's memory; GRPO pushes new weights every step, "
                 "so discarding them loses nothing")
    if cand.vllm_tensor_parallel_size > 1:
        parts.append(f"TP={cand.vllm_tensor_parallel_size}: the smallest TP whose per-GPU share of the vLLM weights fits")
    if cand.zero_stage != base.zero_stage or cand.offload_optimizer != base.offload_optimizer:
        parts.append(f"ZeRO-{cand.zero_stage}" + (" + optimizer offload to CPU" if cand.offload_optimizer else "")
                     + ": the training state does not fit otherwise")
    return "; ".join(parts)


def plan_report(plan: Plan | None = None, **settings) -> dict:
    """`estimate` plus `recommendation`: what `colo-kit plan --json` prints."""
    out = estimate(plan, **settings)
    out["recommendation"] = recommend(plan, **settings)
    return out


def what_fits(model: str, gpu_counts=(8, 16, 32), host_mem_gib: float | None = 1800.0, **settings) -> list[dict]:
    """The 72B question as a table: per GPU count, colocate with and without sleep and offload, and server mode (whose
    vLLM needs its own TP-sized group of GPUs on top)."""
    variants = [
        ("colocate, sleep 2, offload", dict(mode="colocate", sleep_level=2, offload_optimizer=True)),
        ("colocate, sleep 2", dict(mode="colocate", sleep_level=2, offload_optimizer=False)),
        ("colocate, no sleep, offload", dict(mode="colocate", sleep_level=0, offload_optimizer=True)),
        ("server (training GPUs), offload", dict(mode="server", sleep_level=0, offload_optimizer=True)),
    ]
    rows = []
    for n in gpu_counts:
        for label, v in variants:
            kw = {"zero_stage": 3, "host_mem_gib": host_mem_gib, **settings, **v}
            tp = kw.get("vllm_tensor_parallel_size", 1)
            r = estimate(Plan(model=model, gpus=n, **kw))
            rows.append({"gpus": n, "setup": label, "total_gpus": n + (tp if v["mode"] == "server" else 0),
                         "peak_gib_per_gpu": r["peak_gib_per_gpu"], "peak_phase": r["peak_phase"],
                         "host_gib_per_node": r["host_gib_per_node"]["total"], "fits": r["fits"],
                         "fits_gpu": r["fits_gpu"], "fits_host": r["fits_host"]})
    return rows

