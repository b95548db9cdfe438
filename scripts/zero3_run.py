"""ZeRO-3 + colocated vLLM + sleep level 2: one real GRPO run, measured beside the planner's prediction.

What it is: TRL 1.16's `GRPOTrainer(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True)` on a
random-init Qwen2.5 architecture, DeepSpeed ZeRO stage 3 with the optimizer offloaded to the CPU (the 72B
recipe of the post, scaled down to what 2 H200s hold), a few steps with the length reward. A thread samples
every GPU's used memory through NVML (PyTorch's counters miss what vLLM frees and maps back while it sleeps);
a callback times each optimizer step. Rank 0 writes results/zero3_run.json: the machine, the settings, the
per-GPU NVML peaks, the raw step times, TRL's log, and the planner's estimate for the same settings.

What it is not: a training run. The weights are random; the reward only proves the loop turns.

    accelerate launch --config_file configs/accelerate/zero3_qwen2.5-7b_2gpu.yaml --num_processes 2 \\
        scripts/zero3_run.py --model qwen2.5-7b            # scripts/gpu/zero3.sh does this on 2×H200
    python scripts/zero3_run.py --smoke                    # CPU: tiny model, no DeepSpeed, no vLLM
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import colo_kit  # noqa: E402

colo_kit.setup()  # the runtime defaults, before torch or vLLM is imported

GIB = 2**30


class NvmlPeak:
    """Used memory of every GPU, sampled every `interval_s` in a thread: peak per GPU and a coarse timeline."""

    def __init__(self, interval_s: float = 0.05):
        self.interval_s = interval_s
        self.available = False
        self.peak: list[float] = []
        self.baseline: list[float] = []
        self.total: list[float] = []
        self.timeline: list[list[float]] = []
        self._stop = threading.Event()
        self._thread = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.available = bool(self._handles)
        except Exception:
            self._handles = []

    def _used(self) -> list[float]:
        return [self._nvml.nvmlDeviceGetMemoryInfo(h).used / GIB for h in self._handles]

    def start(self) -> "NvmlPeak":
        if not self.available:
            return self
        self.baseline = self._used()
        self.total = [self._nvml.nvmlDeviceGetMemoryInfo(h).total / GIB for h in self._handles]
        self.peak = list(self.baseline)
        t0 = time.perf_counter()

        def loop():
            last = -1.0
            while not self._stop.is_set():
                used = self._used()
                self.peak = [max(p, u) for p, u in zip(self.peak, used)]
                now = time.perf_counter() - t0
                if now - last >= 0.5:  # keep the timeline small: one point per half second
                    self.timeline.append([round(now, 2)] + [round(u, 2) for u in used])
                    last = now
                self._stop.wait(self.interval_s)

        self._thread = threading.Thread(target=loop, name="nvml-peak", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=2)


def make_step_timer():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step (generation + training), CUDA-synchronised."""

        def __init__(self):
            self.step_times_s: list[float] = []
            self._t = None
            self.after_step = None  # rank 0 saves what it has after every step: a timeout keeps the numbers

        @staticmethod
        def _sync():
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()

        def on_step_begin(self, args, state, control, **kw):
            self._sync()
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self._sync()
            if self._t is not None:
                self.step_times_s.append(round(time.perf_counter() - self._t, 3))
            if self.after_step is not None:
                self.after_step()

    return StepTimer()


def grpo_config(args, output_dir: str):
    """GRPOConfig with the fields TRL 1.16 has (checked against the installed class, not assumed)."""
    import dataclasses

    from trl import GRPOConfig

    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    kw = dict(
        output_dir=output_dir,
        per_device_train_batch_size=args.per_device_train_batch_size,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        max_steps=args.steps,
        learning_rate=1e-6,
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        gradient_checkpointing=not args.no_gradient_checkpointing,
        # Random weights rarely sample EOS: every completion runs to max_completion_length, as in the planner.
        temperature=1.0,
    )
    if args.smoke:
        kw.update(use_vllm=False, use_cpu=True, bf16=False)
    else:
        kw.update(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=not args.no_sleep,
                  vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                  vllm_tensor_parallel_size=args.vllm_tensor_parallel_size, bf16=True)
    missing = [k for k in kw if k not in fields]
    if missing:
        raise SystemExit(f"this TRL's GRPOConfig lacks {missing}; the script is written for TRL 1.16")
    return GRPOConfig(**kw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--per-device-train-batch-size", type=int, default=8)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--max-completion-length", type=int, default=128)
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--vllm-tensor-parallel-size", type=int, default=1)
    ap.add_argument("--no-sleep", action="store_true")
    ap.add_argument("--no-gradient-checkpointing", action="store_true")
    ap.add_argument("--no-offload", action="store_true",
                    help="the DeepSpeed config does not offload the optimizer (fallback when CPU Adam cannot compile)")
    ap.add_argument("--out", default=None, help="JSON path (default results/zero3_run.json; smoke: results/runs/)")
    ap.add_argument("--smoke", action="store_true", help="CPU check: tiny model, no DeepSpeed, no vLLM")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.steps, args.num_generations, args.max_completion_length = "tiny", 2, 4, 16
        args.per_device_train_batch_size = 4

    from accelerate import PartialState

    from colo_kit.env import describe
    from colo_kit.models import resolve_model
    from colo_kit.paths import results_dir, runs_dir
    from colo_kit.memory.planner import Plan, estimate, recommend

    state = PartialState()
    world, rank = state.num_processes, state.process_index
    out = Path(args.out) if args.out else (runs_dir() / "zero3_smoke.json" if args.smoke else results_dir() / "zero3_run.json")
    sampler = NvmlPeak().start() if rank == 0 else None
    record = {"what": "TRL 1.16 GRPOTrainer colocate + DeepSpeed ZeRO-3 (offload_optimizer cpu) + vLLM sleep level 2",
              "status": "started", "settings": {**vars(args), "model": args.model, "gpus": world,
                                                "deepspeed_config": None if args.smoke else (
                                                    "zero3 (no optimizer offload)" if args.no_offload
                                                    else "zero3, offload_optimizer cpu")}}
    timer = make_step_timer()
    t_start = time.perf_counter()
    trainer = None

    def write(final: bool = False) -> None:
        """Rank 0 writes the record: after each step (status 'partial') and at the end."""
        if rank != 0:
            return
        record["wall_s"] = round(time.perf_counter() - t_start, 1)
        if final:
            sampler.stop()
        gib = sampler.total[0] if sampler.total else None
        record["env"] = record.get("env") or describe()
        record["step_times_s"] = list(timer.step_times_s)
        record["trl_log"] = trainer.state.log_history if trainer is not None else []
        if sampler.available:
            record["nvml_peak_gib_per_gpu"] = [round(p, 2) for p in sampler.peak[:world]]
            record["nvml_baseline_gib_per_gpu"] = [round(b, 2) for b in sampler.baseline[:world]]
            record["nvml_total_gib"] = round(gib, 2)
            record["nvml_timeline"] = {"columns": ["t_s"] + [f"gpu{i}_used_gib" for i in range(len(sampler.peak))],
                                       "rows": list(sampler.timeline)}
        planner_settings = dict(
            model=args.model, gpus=world, gpu_mem_gib=round(gib or 139.8, 2),
            zero_stage=0 if args.smoke else 3, offload_optimizer=not (args.smoke or args.no_offload),
            vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            vllm_tensor_parallel_size=args.vllm_tensor_parallel_size,
            sleep_level=0 if (args.smoke or args.no_sleep) else 2, per_device_train_batch_size=args.per_device_train_batch_size,
            prompt_length=record.get("prompt_tokens", {}).get("max", 96),
            max_completion_length=args.max_completion_length,
            gradient_checkpointing=not args.no_gradient_checkpointing,
            mode="server" if args.smoke else "colocate")  # smoke: no vLLM on the device, like server mode's GPU
        record["planner_settings"] = planner_settings
        try:
            pred = estimate(Plan(**planner_settings))
            record["planner_prediction"] = {k: pred[k] for k in ("peak_gib_per_gpu", "peak_phase", "parts",
                                                                 "host_gib_per_node", "fits")}
            if final:
                record["planner_recommendation"] = recommend(Plan(**planner_settings))
            if record.get("nvml_peak_gib_per_gpu"):
                record["planner_error"] = round(pred["peak_gib_per_gpu"] / max(record["nvml_peak_gib_per_gpu"]) - 1, 4)
        except Exception as exc:
            record["planner_prediction"] = {"error": f"{type(exc).__name__}: {exc}"}
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
        tmp.replace(out)
        if final:
            print(f"[zero3] {record['status']}: wrote {out}  peak/GPU {record.get('nvml_peak_gib_per_gpu')} GiB, "
                  f"predicted {record.get('planner_prediction', {}).get('peak_gib_per_gpu')} GiB, "
                  f"step times {record['step_times_s']} s", flush=True)

    def after_step():
        record["status"] = "partial"
        write()

    timer.after_step = after_step
    try:
        with state.main_process_first():
            model_path = resolve_model(args.model)
        from datasets import Dataset
        from transformers import AutoTokenizer
        from trl import GRPOTrainer

        from colo_kit.data import load_tldr

        try:
            from colo_kit.grpo.rewards import length_reward
        except ImportError:  # the rewards module is another issue's; the post's reward, inline
            def length_reward(completions, **kw):
                return [-abs(20 - len(c if isinstance(c, str) else c[-1]["content"])) for c in completions]

        n_prompts = args.steps * args.per_device_train_batch_size * world // args.num_generations + world
        rows = load_tldr(source="offline")
        ds = Dataset.from_list([{"prompt": rows[i % len(rows)]["prompt"]} for i in range(max(n_prompts, 8))])
        tok = AutoTokenizer.from_pretrained(model_path)
        prompt_tokens = [len(tok(p)["input_ids"]) for p in ds["prompt"]]
        record["prompt_tokens"] = {"min": min(prompt_tokens), "max": max(prompt_tokens),
                                   "mean": round(sum(prompt_tokens) / len(prompt_tokens), 1)}

        cfg = grpo_config(args, str(runs_dir() / "zero3_trainer"))
        t0 = time.perf_counter()
        trainer = GRPOTrainer(model=model_path, reward_funcs=length_reward, args=cfg, train_dataset=ds,
                              callbacks=[timer])
        record["init_s"] = round(time.perf_counter() - t0, 1)
        if rank == 0:
            print(f"[zero3] trainer + vLLM ready in {record['init_s']} s; training {args.steps} steps", flush=True)
        t0 = time.perf_counter()
        trainer.train()
        record["train_s"] = round(time.perf_counter() - t0, 1)
        record["status"] = "ok"
    except BaseException as exc:  # keep what was measured; the error goes into the JSON
        record["status"] = "error"
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()[-4000:]
        print(record["traceback"], file=sys.stderr, flush=True)
    finally:
        write(final=True)
    return 0 if record["status"] == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())
