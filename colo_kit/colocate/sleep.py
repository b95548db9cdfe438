"""Sleep mode: a colocated engine's GPU memory back to the trainer between generations (notebook 02). Level 2 as in
post 1; waking by tag: `weights` by a push (vLLM's `reload_weights` reads the checkpoint, TRL #5312), the buffers
from a copy outside the sleep pool (vLLM #16564), then `kv_cache`. vLLM-CPU has none: `SleepModeUnavailable`.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from typing import Iterable

from colo_kit.env import has_cuda, vllm_version
from colo_kit.paths import results_dir

TAGS = ("weights", "kv_cache")


class SleepModeUnavailable(RuntimeError):
    @classmethod
    def for_this_platform(cls, what: str = "sleep mode") -> "SleepModeUnavailable":
        try:
            from vllm.platforms import current_platform

            platform = f"{type(current_platform).__name__} (device {current_platform.device_name!r})"
        except Exception:
            platform = "no NVIDIA GPU"
        return cls(f"{what}: vLLM sleep mode needs an NVIDIA GPU, and this process runs on {platform} with vLLM "
                   f"{vllm_version()}: its CPU engine has no sleep mode (it would silently keep all memory). "
                   "Run without sleep mode here (ColocateSettings(vllm_enable_sleep_mode=False)); the H200 numbers are "
                   "in results/engine_bench.json")


class SelfCheckFailed(AssertionError):
    pass


def _nvml_handle(device):
    """The NVML handle of a torch CUDA device, by PCI bus id (CUDA_VISIBLE_DEVICES renumbers for torch only)."""
    import pynvml
    import torch

    pynvml.nvmlInit()
    props = torch.cuda.get_device_properties(device)
    try:
        bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        return pynvml.nvmlDeviceGetHandleByPciBusId(bus)
    except Exception:
        from colo_kit.gpu_free import nvml_device

        return nvml_device(torch.device(device).index or 0)[0]


def device_memory_gib(device) -> dict:
    """Used / free / total memory of the GPU, in GiB, as NVML sees it (all processes)."""
    import pynvml

    info = pynvml.nvmlDeviceGetMemoryInfo(_nvml_handle(device))
    return {"used_gib": round(info.used / 2**30, 3), "free_gib": round(info.free / 2**30, 3),
            "total_gib": round(info.total / 2**30, 3)}


class SleepManager:
    """Sleep and wake a `ColocatedEngine` built with `ColocateSettings(vllm_enable_sleep_mode=True)`.

    >>> mgr = SleepManager(engine, level=2)
    >>> with mgr.training(model):      # engine asleep: the trainer has the GPU
    ...     loss.backward(); opt.step()
    >>> engine.generate(prompts)        # awake, with the trainer's new weights
    """

    def __init__(self, engine, level: int = 2, *, platform_check: bool = True):
        # platform_check=False: for an engine whose sleep and wake_up are not vLLM's (tests on a CPU)
        if platform_check and not has_cuda():
            raise SleepModeUnavailable.for_this_platform("SleepManager")
        if level not in (1, 2):
            raise ValueError(f"level={level!r}: sleep level 1 offloads the weights to CPU memory, level 2 discards "
                             "them; use 1 or 2")
        if not engine.settings.vllm_enable_sleep_mode:
            raise ValueError("the engine was built without sleep mode: build it with "
                             "ColocateSettings(vllm_enable_sleep_mode=True)")
        import torch

        self.engine, self.level = engine, level
        self.device = engine.device
        self.on_gpu = getattr(self.device, "type", str(self.device)) == "cuda"
        # a copy of the buffers outside the engine's sleep pool survives level 2 (vLLM #16564)
        with torch.no_grad():
            self.buffers = {name: b.detach().clone() for name, b in engine.vllm_model.named_buffers()}
        self.stages: list[dict] = []
        self.record("awake")

    def record(self, stage: str, seconds: float | None = None, **extra) -> dict:
        memory = device_memory_gib(self.device) if self.on_gpu else {"used_gib": None, "free_gib": None, "total_gib": None}
        row = {"stage": stage, "seconds": None if seconds is None else round(seconds, 6), **memory, **extra}
        self.stages.append(row)
        return row

    def _timed(self, fn, *args, **kwargs) -> float:
        import torch

        if self.on_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        if self.on_gpu:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def sleep(self, level: int | None = None) -> float:
        level = level or self.level
        if level not in (1, 2):
            raise ValueError(f"level={level!r}: use 1 or 2")
        if self.engine.asleep:
            raise RuntimeError(f"already asleep ({sorted(self.engine.asleep)}); wake it before sleeping again")
        self.engine.llm.reset_prefix_cache()
        seconds = self._timed(self.engine.llm.sleep, level=level)
        self.engine.asleep = set(TAGS)
        self._slept_level = level
        self.record(f"sleep_l{level}", seconds)
        return seconds

    def wake(self, tags: Iterable[str] = TAGS, model=None) -> dict:
        """Wake the given tags, in order. After level 2 the weights are gone: `model` (the trainer's) is pushed
        and the buffers restored; after level 1 a push is optional."""
        tags = list(tags)
        bad = [t for t in tags if t not in TAGS]
        if bad:
            raise ValueError(f"unknown wake tag(s) {bad}; use {list(TAGS)}")
        times = {}
        if "weights" in tags and "weights" in self.engine.asleep:
            if model is None and getattr(self, "_slept_level", self.level) == 2:
                raise ValueError("after a level-2 sleep the weights are discarded: pass model=<the trainer's model> "
                                 "(vLLM's reload_weights would reload the original checkpoint from disk, TRL #5312)")
            times["wake_weights_s"] = self._timed(self.engine.llm.wake_up, tags=["weights"])
            self.engine.asleep.discard("weights")
            self.record("wake_weights", times["wake_weights_s"])
            if model is not None:
                times["push_s"] = self.engine.push_weights(model)
                times["restore_buffers_s"] = self._timed(self.restore_buffers)
                self.record("push_weights", times["push_s"] + times["restore_buffers_s"])
        if "kv_cache" in tags and "kv_cache" in self.engine.asleep:
            times["wake_kv_cache_s"] = self._timed(self.engine.llm.wake_up, tags=["kv_cache"])
            self.engine.asleep.discard("kv_cache")
            self.record("wake_kv_cache", times["wake_kv_cache_s"])
        return times

    def restore_buffers(self) -> None:
        import torch

        with torch.no_grad():
            for name, buf in self.engine.vllm_model.named_buffers():
                if name in self.buffers:
                    buf.copy_(self.buffers[name])

    @contextmanager
    def training(self, model, level: int | None = None):
        """"Train now, generate next": asleep inside the block, awake with `model`'s weights after."""
        self.sleep(level)
        try:
            yield self
        finally:
            self.wake(TAGS, model=model)

    def switch(self, model, level: int | None = None) -> dict:
        """One training step's switch, each part timed: sleep, wake(weights), push, wake(kv_cache)."""
        t = {"sleep_s": self.sleep(level)}
        t.update(self.wake(TAGS, model=model))
        t["switch_s"] = sum(v for k, v in t.items() if k.endswith("_s"))
        return t

    def self_check(self, model, level: int | None = None, logprob_tol: float = 1e-3) -> dict:
        """Greedy probe before sleep == after wake + push of `model` (the same weights), else raise."""
        before = self.engine.probe()
        self.switch(model, level)
        after = self.engine.probe()
        diff = max((abs(a - b) for a, b in zip(before["logprobs"], after["logprobs"])), default=0.0)
        result = {"same_tokens": before["token_ids"] == after["token_ids"], "max_logprob_diff": diff,
                  "before": before["token_ids"], "after": after["token_ids"]}
        result["passed"] = result["same_tokens"] and diff <= logprob_tol
        if not result["passed"]:
            raise SelfCheckFailed(f"greedy probe changed across sleep(level={level or self.level}) + wake + push: "
                                  f"tokens {before['token_ids']} -> {after['token_ids']}, max |dlogprob| {diff:.2e} "
                                  f"(tolerance {logprob_tol}); the weights or buffers were not fully restored")
        return result


def h200_reference() -> dict:
    """The committed GPU benchmark (results/engine_bench.json) labelled with its vLLM, or how to measure it."""
    path = results_dir() / "engine_bench.json"
    if path.exists():
        data = json.loads(path.read_text())
        data.setdefault("source", f"measured, results/engine_bench.json (vLLM "
                                  f"{data.get('env', {}).get('versions', {}).get('vllm')})")
        return data
    return {"source": "not measured here: bash scripts/gpu/engine_bench.sh on a GPU node writes results/engine_bench.json"}


def memory_figure(stages: list[dict], title: str = "GPU memory at each stage (NVML)"):
    """Stacked used/free GiB per stage, in the order the stages happened."""
    import plotly.graph_objects as go

    x = [f"{i}. {s['stage']}" for i, s in enumerate(stages)]
    fig = go.Figure([
        go.Bar(x=x, y=[s["used_gib"] for s in stages], name="used GiB"),
        go.Bar(x=x, y=[s["free_gib"] for s in stages], name="free GiB", opacity=0.35),
    ])
    fig.update_layout(barmode="stack", title=title, yaxis_title="GiB", height=380)
    return fig


SWITCH_PARTS = ("sleep_s", "wake_weights_s", "push_s", "restore_buffers_s", "wake_kv_cache_s")


def switch_rows(reference: dict) -> list[dict]:
    """One row per (model, level): the median seconds of each part of the switch."""
    rows = []
    for name, s in reference.get("summary", {}).items():
        for level in (2, 1):
            med = s.get(f"switch_l{level}_median_s")
            if med:
                rows.append({"model": name, "level": level, **{k: med.get(k) for k in SWITCH_PARTS},
                             "switch_s": med.get("switch_s")})
    return rows


def switch_figure(reference: dict, target_s: float = 0.05):
    """Stacked parts of the switch per model and level (measured), with the kit's target per step."""
    import plotly.graph_objects as go

    rows = switch_rows(reference)
    x = [f"{r['model']} L{r['level']}" for r in rows]
    fig = go.Figure([go.Bar(x=x, y=[r[k] or 0 for r in rows], name=k.removesuffix("_s")) for k in SWITCH_PARTS])
    fig.add_hline(y=target_s, line_dash="dash", annotation_text=f"target {target_s} s per step (1.5B)")
    fig.update_layout(barmode="stack", title=f"Switch cost per training step — {reference.get('source', '')}",
                      yaxis_title="seconds", height=400)
    return fig
