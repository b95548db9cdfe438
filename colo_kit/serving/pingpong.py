"""The ping-pong model: step time and speedup of server vs colocate mode from measured phase costs. Notebook 01.

TRL's server mode is synchronous: k vLLM devices generate all n·b completions (n = N − k trainers, b per device)
while the trainers wait, then the trainers train while vLLM waits (throughput: n·b resp. N·b per step):

    step_server(N, k, b)   = gen(n·b / k) + sync_server + train(b) + other
    step_colocate(N, b)    = gen(b)       + sync_colocate + train(b) + other

gen(x) grows much more slowly than x (decoding is memory-bound), yet at N=8, k=1 one server generates 7·b while seven
trainers wait: the post's 1.43× (1.5B) and 1.35× (7B), which two GPUs cannot show. The model projects them from one GPU's
costs, and `step_time_for` says how long the rest of a step must be for the post's number."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

POST_SPEEDUPS = {"qwen2.5-1.5b": 1.43, "qwen2.5-7b": 1.35}  # post 1, experiments 1 and 3 (8 GPUs, 7+1)


@dataclass
class PhaseCosts:
    """Measured per-phase costs on one device (seconds)."""

    gen_points: list[tuple[float, float]]  # the server's (completions generated in one call, seconds)
    train_fixed_s: float  # forward/backward/optimizer: fixed part per step, plus ...
    train_per_sample_s: float  # ... per completion
    sync_server_s: float = 0.0
    sync_colocate_s: float = 0.0
    other_server_s: float = 0.0  # scoring, data, logging: the rest of a step
    other_colocate_s: float = 0.0
    tokens_per_sample: float = 256.0
    source: str = ""
    notes: list[str] = field(default_factory=list)
    # colocate mode's own costs when measured apart (its engine shares the device); None: the server-mode ones
    gen_points_colocate: list[tuple[float, float]] | None = None
    train_colocate: tuple[float, float] | None = None  # (fixed_s, per_sample_s)

    def gen(self, x: float, mode: str = "server") -> float:
        """Generation seconds for x completions: piecewise-linear through the points, extended from the last two."""
        pts = sorted(self.gen_points_colocate if mode == "colocate" and self.gen_points_colocate else self.gen_points)
        if not pts:
            raise ValueError("no generation measurements: run colo_kit.serving.bench first")
        if len(pts) == 1:
            b0, t0 = pts[0]
            return t0 * max(x, 1) / b0 if x > b0 else t0
        if x <= pts[0][0]:
            return pts[0][1]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if x <= b1:
                return t0 + (t1 - t0) * (x - b0) / (b1 - b0)
        (b0, t0), (b1, t1) = pts[-2], pts[-1]
        return t1 + max(t1 - t0, 0.0) / (b1 - b0) * (x - b1)

    def train(self, b: float, mode: str = "server") -> float:
        if mode == "colocate" and self.train_colocate:
            return self.train_colocate[0] + self.train_colocate[1] * b
        return self.train_fixed_s + self.train_per_sample_s * b

    def with_training(self, factor: float) -> "PhaseCosts":
        """Training × `factor` in both modes: what a slower trainer (an all-reduce over 7 or 8 GPUs, gradient checkpointing,
        longer completions) does to the ratio, where a factor on every cost would cancel."""
        return replace(self, train_fixed_s=self.train_fixed_s * factor, train_per_sample_s=self.train_per_sample_s * factor,
                       train_colocate=tuple(v * factor for v in self.train_colocate) if self.train_colocate else None,
                       notes=self.notes + [f"training x{factor:g} (a what-if)"] if factor != 1 else self.notes)

    def to_dict(self) -> dict:
        return asdict(self)


def predict(costs: PhaseCosts, mode: str, n_devices: int, per_device_train_batch_size: int, k_server: int = 1) -> dict:
    """Step time and throughput of one configuration."""
    b = per_device_train_batch_size
    if mode == "server":
        n = n_devices - k_server
        if n < 1 or k_server < 1:
            raise ValueError(f"server mode with N={n_devices}, k={k_server}: need k >= 1 and N - k >= 1")
        samples = n * b
        parts = {"generation": costs.gen(n * b / k_server), "train": costs.train(b), "sync": costs.sync_server_s,
                 "other": costs.other_server_s}
    elif mode == "colocate":
        samples = n_devices * b
        parts = {"generation": costs.gen(b, "colocate"), "train": costs.train(b, "colocate"), "sync": costs.sync_colocate_s,
                 "other": costs.other_colocate_s}
    else:
        raise ValueError(f"mode={mode!r}; use 'server' or 'colocate'")
    step = parts["generation"] + parts["sync"] + parts["train"] + parts["other"]
    return {"mode": mode, "n_devices": n_devices, "k_server": k_server if mode == "server" else 0,
            "per_device_train_batch_size": b, "step_s": step, "samples_per_s": samples / step,
            "tokens_per_s": samples * costs.tokens_per_sample / step,
            "parts_s": {p: round(v, 4) for p, v in parts.items()}}


def speedup(costs: PhaseCosts, n_devices: int, per_device_train_batch_size: int, k_server: int = 1) -> dict:
    """Colocate on N devices vs server mode with k of them serving: raw and normalised (× N/(N−k))."""
    s = predict(costs, "server", n_devices, per_device_train_batch_size, k_server)
    c = predict(costs, "colocate", n_devices, per_device_train_batch_size)
    raw = c["tokens_per_s"] / s["tokens_per_s"]
    norm = raw / (n_devices / (n_devices - k_server))
    idle_server_trainers = s["parts_s"]["generation"] / s["step_s"]
    idle_server_vllm = 1 - (s["parts_s"]["generation"] + s["parts_s"]["sync"]) / s["step_s"]
    return {"n_devices": n_devices, "k_server": k_server, "per_device_train_batch_size": per_device_train_batch_size,
            "raw": round(raw, 3), "normalised": round(norm, 3), "server_step_s": round(s["step_s"], 4),
            "colocate_step_s": round(c["step_s"], 4), "server_trainer_idle": round(idle_server_trainers, 3),
            "server_vllm_idle": round(idle_server_vllm, 3)}


def _plain_runs(records: list[dict]) -> list[dict]:
    """The sweep's runs (`server-b<b>`, `colocate-b<b>`): one generation per optimizer step."""
    return [r for r in records if "error" not in r and r.get("step_time_s") and r.get("phase_s_per_step")
            and r.get("label", "").startswith(("server-b", "colocate-b"))]


def fit_costs(records: list[dict], gen_probe: list[dict] = ()) -> PhaseCosts:
    """Phase costs from bench records: generation points per batch, train by least squares against the per-device batch,
    sync and other (the rest of a step) as means per mode."""
    gen_pts = {"server": [], "colocate": []}
    train_pts = {"server": [], "colocate": []}
    sync = {"server": [], "colocate": []}
    other = {"server": [], "colocate": []}
    tokens = []
    for r in _plain_runs(records):
        b, world, mode = r["per_device_train_batch_size"], r.get("world_size", 1), r["mode"]
        phases = r["phase_s_per_step"]
        train_dev = [d for d in phases if "vLLM server" not in d]
        server_dev = [d for d in phases if "vLLM server" in d]
        if not train_dev:
            continue
        tp = phases[train_dev[0]]
        train_s = tp.get("forward", 0) + tp.get("backward", 0) + tp.get("optimizer", 0)
        train_pts[mode].append((b, train_s))
        if mode == "server" and server_dev:
            gen_pts["server"].append((b * world, phases[server_dev[0]].get("generation", 0)))
            sync_s = phases[server_dev[0]].get("weight_sync", 0)
            gen_s = phases[server_dev[0]].get("generation", 0)
        else:
            gen_s = tp.get("generation", 0)
            gen_pts["colocate"].append((b, gen_s))
            sync_s = tp.get("weight_sync", 0) + tp.get("sleep", 0) + tp.get("wake_up", 0)
        sync[mode].append(sync_s)
        other[mode].append(max(_step(r) - gen_s - sync_s - train_s, 0.0))
        done = [s for s in r.get("steps", [])[r.get("warmup_steps", 1):] if s.get("tokens")]
        if done:
            tokens.append(sum(s["tokens"] / s["samples"] for s in done) / len(done))
    for p in gen_probe or ():
        if "gen_s" in p:
            gen_pts["server"].append((p["batch"], p["gen_s"]))
    if not train_pts["server"] and not train_pts["colocate"]:
        raise ValueError("no usable bench records (all failed or empty): nothing to fit")
    mean = lambda v: sum(v) / len(v) if v else 0.0  # noqa: E731
    server_gen = _merge_points(gen_pts["server"]) or _merge_points(gen_pts["colocate"])
    server_train = _line(train_pts["server"] or train_pts["colocate"])
    return PhaseCosts(gen_points=server_gen, train_fixed_s=server_train[0], train_per_sample_s=server_train[1],
                      sync_server_s=mean(sync["server"]), sync_colocate_s=mean(sync["colocate"]),
                      other_server_s=mean(other["server"]), other_colocate_s=mean(other["colocate"]),
                      tokens_per_sample=mean(tokens) or 256.0, source="fit_costs",
                      gen_points_colocate=_merge_points(gen_pts["colocate"]) or None,
                      train_colocate=_line(train_pts["colocate"]) if train_pts["colocate"] else None)


def _merge_points(pts):
    """One point per batch: the mean of repeated measurements."""
    merged: dict[float, list] = {}
    for b, t in pts:
        merged.setdefault(b, []).append(t)
    return [(b, sum(v) / len(v)) for b, v in sorted(merged.items())]


def _line(pts) -> tuple[float, float]:
    """Least-squares (fixed_s, per_sample_s), both >= 0."""
    xs = [b for b, _ in pts]
    ys = [t for _, t in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else my / mx, 0.0)
    return max(my - slope * mx, 0.0), slope


def _step(r: dict) -> float:
    return r.get("median_step_time_s") or r["step_time_s"]


def validate(records: list[dict], gen_probe: list[dict] = ()) -> list[dict]:
    """Predicted vs measured step time, never from a run's own phases: `cross-mode` predicts each colocate run from server-mode
    costs, `leave-one-out` each run from costs fitted on the other runs."""
    ok = _plain_runs(records)
    rows = []

    def row(r, costs, method):
        world = r.get("world_size", 1)
        n_dev = world + 1 if r["mode"] == "server" else world
        pred = predict(costs, r["mode"], n_dev, r["per_device_train_batch_size"], 1)
        measured = _step(r)
        return {"method": method, "label": r["label"], "mode": r["mode"],
                "per_device_train_batch_size": r["per_device_train_batch_size"],
                "n_devices": n_dev, "measured_step_s": measured, "predicted_step_s": round(pred["step_s"], 4),
                "error_pct": round(100 * (pred["step_s"] - measured) / measured, 1)}

    server_runs = [r for r in ok if r["mode"] == "server"]
    colocate_runs = [r for r in ok if r["mode"] == "colocate"]
    if server_runs and colocate_runs:
        from_server = fit_costs(server_runs, gen_probe)
        from_server.sync_colocate_s = fit_costs(colocate_runs).sync_colocate_s
        from_server.other_colocate_s = from_server.other_server_s
        for r in colocate_runs:
            rows.append(row(r, from_server, "cross-mode"))
    for i, r in enumerate(ok):
        rest = ok[:i] + ok[i + 1:]
        if not any(x["mode"] == r["mode"] for x in rest):
            continue
        rows.append(row(r, fit_costs(rest, gen_probe), "leave-one-out"))
    return rows


def step_time_for(costs: PhaseCosts, target: float, per_device_train_batch_size: int, n_devices: int = 8,
                  k_server: int = 1) -> dict:
    """What per-step time outside generation (in both modes alike) makes the normalised speedup `target`: normalised =
    step_server / step_colocate, so s = (step_server − target·step_colocate) / (target − 1) seconds more per step.
    Returns the model's own split beside the one `target` needs."""
    if target <= 1:
        raise ValueError(f"target={target}: a speedup above 1 (the post's 1.43 or 1.35)")
    b = per_device_train_batch_size
    s = predict(costs, "server", n_devices, b, k_server)
    c = predict(costs, "colocate", n_devices, b)
    extra = max((s["step_s"] - target * c["step_s"]) / (target - 1), 0.0)
    rest = c["step_s"] - c["parts_s"]["generation"]
    return {"per_device_train_batch_size": b, "gen_server_s": s["parts_s"]["generation"],
            "gen_colocate_s": c["parts_s"]["generation"], "rest_of_step_modelled_s": round(rest, 3),
            "rest_of_step_for_target_s": round(rest + extra, 3),
            "generation_share_modelled": round(c["parts_s"]["generation"] / c["step_s"], 3),
            "generation_share_for_target": round(c["parts_s"]["generation"] / (c["step_s"] + extra), 3)}


def project_post(costs: PhaseCosts, batches=(8, 16, 32, 64), n_devices: int = 8, k_server: int = 1) -> list[dict]:
    """The post's 8-GPU experiments (7 train + 1 vLLM) from these costs."""
    return [speedup(costs, n_devices, b, k_server) for b in batches]


def projection_figure(rows: list[dict], post_value: float | None = None, title: str = ""):
    import plotly.graph_objects as go

    fig = go.Figure()
    xs = [str(r["per_device_train_batch_size"]) for r in rows]
    fig.add_scatter(x=xs, y=[r["normalised"] for r in rows], mode="lines+markers", name="model: normalised speedup")
    fig.add_scatter(x=xs, y=[r["raw"] for r in rows], mode="lines+markers", name="model: raw speedup",
                    line_dash="dot")
    if post_value:
        fig.add_hline(y=post_value, line_dash="dash", annotation_text=f"post: {post_value}× (quoted, its largest batch)")
    fig.add_hline(y=1.0, line_color="gray")
    fig.update_layout(title=title, xaxis_title="per-device batch", yaxis_title="colocate / server")
    return fig
