"""Who waits for whom: a phase timeline of every device during GRPO (post 1's "ping-pong"; notebook 01), from TRL's
profiling timers. Timestamps are `time.time()`, one clock for every process on the host, taken after
`torch.cuda.synchronize()` so a phase ends when its kernels do."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# TRL profiling names (after the "GRPOTrainer." prefix) -> the post's phases.
TRL_PHASES = {"vLLM.generate": "generation", "transformers.generate": "generation", "sync_weights": "weight_sync",
              "compute_loss": "forward", "_calculate_rewards": "scoring"}
BUSY = ("generation", "weight_sync", "scoring", "forward", "backward", "optimizer", "sleep", "wake_up")
COLORS = {"generation": "#1f77b4", "weight_sync": "#9467bd", "scoring": "#8c564b", "forward": "#2ca02c",
          "backward": "#98df8a", "optimizer": "#bcbd22", "sleep": "#7f7f7f", "wake_up": "#c7c7c7",
          "waiting": "#ff9896"}


@dataclass
class Interval:
    device: str
    phase: str
    start_s: float
    end_s: float
    rank: int = 0
    step: int = -1


_MISSING = object()


def _put_back(obj, name: str):
    """A function that gives `obj` back the `name` it has now (its own attribute, or none: its class's method)."""
    own = vars(obj).get(name, _MISSING)

    def put_back():
        if own is _MISSING:
            vars(obj).pop(name, None)
        else:
            setattr(obj, name, own)

    return put_back


@dataclass
class Timeline:
    """Intervals of one process (a rank) or of a merged run; utilisation samples alongside."""

    intervals: list[Interval] = field(default_factory=list)
    util: list[dict] = field(default_factory=list)  # {"device", "t_s", "util_pct", "mem_gib"}
    meta: dict = field(default_factory=dict)
    _undo: list = field(default_factory=list, init=False, repr=False, compare=False)  # hook()'s, for unhook()

    def add(self, device: str, phase: str, start_s: float, end_s: float, rank: int = 0, step: int = -1) -> None:
        self.intervals.append(Interval(device, phase, start_s, end_s, rank, step))

    def hook(self, trainer, *, server_device: str | None = None):
        """Record `trainer`'s phases from now on on `gpu<NVML index>` or `cpu:rank<r>` and the server's `server_device`
        (default "vLLM server"); returns the callback (already added)."""
        from transformers import TrainerCallback
        from trl.extras import profiling

        rank = trainer.accelerator.process_index
        mode = getattr(getattr(trainer, "vllm_generation", None), "mode", "plain") if trainer.use_vllm else "plain"
        cuda = trainer.accelerator.device.type == "cuda"
        if cuda:  # the physical GPU index, as NVML (and nvidia-smi) number it
            idx = trainer.accelerator.device.index or 0
            visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
            device = f"gpu{visible[idx] if idx < len(visible) else idx}"
        else:
            device = f"cpu:rank{rank}"
        server_device = server_device or "vLLM server"
        self.meta.update(mode=mode, rank=rank, device=device, server_device=server_device if mode == "server" else None)
        tl = self

        def now() -> float:
            if cuda:
                import torch

                torch.cuda.synchronize()
            return time.time()

        def step() -> int:
            return trainer.state.global_step

        # 1) TRL's profiling timers
        original_enter, original_exit = profiling.ProfilingContext.__enter__, profiling.ProfilingContext.__exit__

        def enter(ctx):
            ctx._colo_t0 = now()
            return original_enter(ctx)

        def exit_(ctx, *exc):
            out = original_exit(ctx, *exc)
            short = ctx.name.split(".", 1)[1] if "." in ctx.name else ctx.name
            phase = TRL_PHASES.get(short)
            t0 = getattr(ctx, "_colo_t0", None)
            if phase is not None and t0 is not None:
                t1 = now()
                if mode == "server" and phase in ("generation", "weight_sync"):
                    tl.add(server_device, phase, t0, t1, rank=-1, step=step())
                    if phase == "generation":
                        phase = "waiting"
                tl.add(device, phase, t0, t1, rank, step())
            return out

        undo = self._undo
        profiling.ProfilingContext.__enter__ = enter
        profiling.ProfilingContext.__exit__ = exit_
        undo.append(lambda: (setattr(profiling.ProfilingContext, "__enter__", original_enter),
                             setattr(profiling.ProfilingContext, "__exit__", original_exit)))

        # 2) sleep / wake-up of the colocated engine (vLLM sleep mode, GPU only)
        llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
        if llm is not None:
            for name, phase in (("sleep", "sleep"), ("wake_up", "wake_up")):
                fn = getattr(llm, name, None)
                if fn is None:
                    continue

                def wrapped(*a, _fn=fn, _phase=phase, **kw):
                    t0 = now()
                    try:
                        return _fn(*a, **kw)
                    finally:
                        tl.add(device, _phase, t0, now(), rank, step())

                # a bench reuses one engine for many trainers: the wrappers must not stack
                undo.append(_put_back(llm, name))
                setattr(llm, name, wrapped)

        # 3) backward and optimizer: between the last forward and the optimizer step
        class PhaseCallback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                self.t_step = now()

            def on_pre_optimizer_step(self, args, state, control, **kw):
                t = now()
                fwd = [iv for iv in tl.intervals if iv.device == device and iv.phase == "forward"]
                if fwd:
                    tl.add(device, "backward", fwd[-1].end_s, t, rank, state.global_step)
                self.t_opt = t

            def on_optimizer_step(self, args, state, control, **kw):
                tl.add(device, "optimizer", self.t_opt, now(), rank, state.global_step)

            def on_step_end(self, args, state, control, **kw):
                tl.meta.setdefault("steps", []).append({"step": state.global_step, "start_s": self.t_step,
                                                        "end_s": now()})

        cb = PhaseCallback()
        trainer.add_callback(cb)
        undo.append(lambda: trainer.remove_callback(cb))
        return cb

    def unhook(self) -> None:
        """Undo all `hook()` did (timers, engine `sleep`/`wake_up`, callback), newest first; records stay."""
        while self._undo:
            self._undo.pop()()

    def devices(self) -> list[str]:
        return list(dict.fromkeys(iv.device for iv in self.intervals))

    def window(self, skip_steps: int = 1) -> tuple[float, float]:
        """The measured window: from the end of the first `skip_steps` steps (warm-up) to the end."""
        steps = sorted(self.meta.get("steps", []), key=lambda s: s["end_s"])
        if len(steps) > skip_steps:
            start = steps[skip_steps - 1]["end_s"] if skip_steps else steps[0]["start_s"]
            return start, steps[-1]["end_s"]
        return min(iv.start_s for iv in self.intervals), max(iv.end_s for iv in self.intervals)

    def idle_fraction(self, skip_steps: int = 1) -> dict[str, float]:
        """Per device: the share of the window covered by no busy phase (waiting counts as idle)."""
        lo, hi = self.window(skip_steps)
        out = {}
        for dev in self.devices():
            spans = sorted((max(iv.start_s, lo), min(iv.end_s, hi)) for iv in self.intervals
                           if iv.device == dev and iv.phase in BUSY and iv.end_s > lo and iv.start_s < hi)
            busy, reached = 0.0, lo  # the union of the spans: each adds what lies past the ones before it
            for s, e in spans:
                busy += max(e - max(s, reached), 0.0)
                reached = max(reached, e)
            out[dev] = round(1 - busy / (hi - lo), 4) if hi > lo else float("nan")
        return out

    def phase_per_step(self, skip_steps: int = 1) -> dict[str, dict[str, float]]:
        """Median seconds per device per phase per step after the first `skip_steps` (robust to one disturbed step)."""
        steps = sorted(s["step"] for s in self.meta.get("steps", []))[skip_steps:]
        per: dict[str, dict[str, dict[int, float]]] = {}
        for iv in self.intervals:
            if iv.step + 1 in steps:  # an interval recorded while global_step = s - 1 belongs to step s
                d = per.setdefault(iv.device, {}).setdefault(iv.phase, {})
                d[iv.step + 1] = d.get(iv.step + 1, 0.0) + (iv.end_s - iv.start_s)
        return {dev: {p: round(statistics.median([v.get(s, 0.0) for s in steps]), 4) for p, v in ph.items()}
                for dev, ph in per.items()} if steps else {}

    def to_dict(self) -> dict:
        return {"intervals": [asdict(iv) for iv in self.intervals], "util": self.util, "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict) -> "Timeline":
        return cls([Interval(**iv) for iv in d.get("intervals", [])], list(d.get("util", [])), dict(d.get("meta", {})))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def merge(cls, parts: list["Timeline"]) -> "Timeline":
        """Ranks of one run -> one timeline (same wall clock). Server intervals are kept once (rank 0's)."""
        out = cls(meta={"parts": [p.meta for p in parts]})
        for p in parts:
            out.intervals += [iv for iv in p.intervals if iv.rank != -1 or p.meta.get("rank", 0) == 0]
            if p.meta.get("rank", 0) == 0:  # every rank samples every GPU: keep one copy
                out.util += p.util
        main = next((p for p in parts if p.meta.get("rank", 0) == 0), parts[0]) if parts else None
        if main is not None:
            out.meta.update({k: v for k, v in main.meta.items() if k in ("mode", "steps", "server_device")})
        return out


def gantt(tl: Timeline, title: str = "", skip_steps: int = 0):
    """A plotly Gantt chart: one row per device, one bar per phase interval (seconds from start)."""
    import plotly.graph_objects as go

    lo, hi = tl.window(skip_steps) if skip_steps else (min(iv.start_s for iv in tl.intervals),
                                                       max(iv.end_s for iv in tl.intervals))
    idle = tl.idle_fraction(skip_steps=skip_steps)
    label = {d: f"{d} (idle {idle.get(d, float('nan')):.0%})" for d in tl.devices()}
    fig = go.Figure()
    for phase in list(BUSY) + ["waiting"]:
        ivs = [iv for iv in tl.intervals if iv.phase == phase and iv.end_s > lo and iv.start_s < hi]
        if not ivs:
            continue
        fig.add_bar(y=[label[iv.device] for iv in ivs], x=[iv.end_s - iv.start_s for iv in ivs],
                    base=[iv.start_s - lo for iv in ivs], orientation="h", name=phase,
                    marker_color=COLORS.get(phase), hovertext=[f"step {iv.step}, rank {iv.rank}" for iv in ivs])
    fig.update_layout(barmode="overlay", title=title, xaxis_title="seconds", height=220 + 40 * len(label),
                      legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0), margin=dict(t=110))
    return fig


class UtilSampler:
    """Samples in a thread until `stop()` NVML's utilisation and used memory of every GPU (torch's counters miss vLLM's
    allocations), or on a CPU each process in `pids` in % of one core."""

    def __init__(self, interval_s: float = 0.2, pids: dict[str, int] | None = None):
        self.interval_s = interval_s
        self.pids = pids or {"trainer": os.getpid()}
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:
            handles = []
        procs = {}
        if not handles:
            import psutil

            for name, pid in self.pids.items():
                try:
                    procs[name] = psutil.Process(pid)
                    procs[name].cpu_percent(None)
                except psutil.Error:
                    pass
        while True:
            t = time.time()
            for i, h in enumerate(handles):
                u = pynvml.nvmlDeviceGetUtilizationRates(h)
                m = pynvml.nvmlDeviceGetMemoryInfo(h)
                self.samples.append({"device": f"gpu{i}", "t_s": t, "util_pct": u.gpu, "mem_gib": m.used / 2**30})
            for name, p in procs.items():
                try:
                    cpu = p.cpu_percent(None) + sum(c.cpu_percent(None) for c in p.children(recursive=True))
                except Exception:
                    continue
                self.samples.append({"device": name, "t_s": t, "util_pct": cpu, "mem_gib": p.memory_info().rss / 2**30})
            if self._stop.wait(self.interval_s):
                break

    def start(self) -> "UtilSampler":
        self._thread.start()
        return self

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.samples

    def peak_mem_gib(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.samples:
            out[s["device"]] = round(max(out.get(s["device"], 0.0), s["mem_gib"]), 2)
        return out

    def mean_util_pct(self) -> dict[str, float]:
        acc: dict[str, list] = {}
        for s in self.samples:
            acc.setdefault(s["device"], []).append(s["util_pct"])
        return {d: round(sum(v) / len(v), 1) for d, v in acc.items()}
