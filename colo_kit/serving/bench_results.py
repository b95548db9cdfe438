"""What a server-vs-colocate sweep (colo_kit.serving.bench) leaves behind: its JSON merged and loaded, its model
attached, and its throughput charts."""

from __future__ import annotations

from pathlib import Path

from colo_kit.results import load as load_result  # noqa: F401  (notebook 01 reads the committed sweeps here)
from colo_kit.grpo.timeline import Timeline, gantt
from colo_kit.serving.pingpong import fit_costs, project_post, validate


def summarize(records: list[dict], n_devices: int, k_server: int) -> list[dict]:
    """Per batch: raw ratio colocate/server and the post's normalised ratio (server × N/(N−k))."""
    rows = []
    by = {r["label"]: r for r in records}
    for b in sorted({r["per_device_train_batch_size"] for r in records if r["mode"] == "server"}):
        s, c = by.get(f"server-b{b}", {}), by.get(f"colocate-b{b}", {})
        if not s.get("tokens_per_s") or not c.get("tokens_per_s"):
            continue
        norm = s["tokens_per_s"] * n_devices / (n_devices - k_server)
        rows.append({"per_device_train_batch_size": b, "server_tok_per_s": s["tokens_per_s"],
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
        base = by.get(f"colocate-b{r['per_device_train_batch_size']}")
        out.append({"label": r["label"], "per_device_train_batch_size": r["per_device_train_batch_size"],
                    "tokens_per_s": r["tokens_per_s"],
                    "trl_default_tok_per_s": base and base["tokens_per_s"],
                    "vs_trl_default": round(r["tokens_per_s"] / base["tokens_per_s"], 3) if base else None})
    return out


def throughput_figure(result: dict, title: str = ""):
    """Tokens/s per batch: colocate, server raw, server normalised (× N/(N−k))."""
    import plotly.graph_objects as go

    rows = result["summary"]
    s = result["settings"]
    fig = go.Figure()
    xs = [str(r["per_device_train_batch_size"]) for r in rows]
    fig.add_bar(x=xs, y=[r["server_tok_per_s"] for r in rows],
                name=f"server, raw ({s['n_devices'] - s['k_server']} train + {s['k_server']} vLLM)")
    fig.add_bar(x=xs, y=[r["server_normalised_tok_per_s"] for r in rows],
                name=f"server × {s['n_devices']}/{s['n_devices'] - s['k_server']} (post's normalisation)")
    fig.add_bar(x=xs, y=[r["colocate_tok_per_s"] for r in rows], name=f"colocate ({s['n_devices']} devices)")
    fig.update_layout(barmode="group", title=title, xaxis_title="per-device batch (completions)",
                      yaxis_title="completion tokens / s")  # legend at the right: a horizontal one covers the x title
    return fig


def write_plots(result: dict, path: str | Path) -> Path:
    """One HTML page: the throughput chart and every run's Gantt chart."""
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


def attach_model(result: dict) -> dict:
    """Add the ping-pong model's validation table and 8-GPU projection to a results dict."""
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
