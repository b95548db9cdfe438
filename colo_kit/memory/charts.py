"""The planner's parts as a chart (notebook 04)."""

from __future__ import annotations


def parts_figure(report: dict, title: str | None = None):
    """Plotly stacked bars of `planner.estimate`'s report: one bar per phase, one colour per part (24 distinct ones,
    so no two parts share a colour), the GPU's memory as a line."""
    import plotly.graph_objects as go
    from plotly.colors import qualitative

    parts = report["parts"]
    names = list(dict.fromkeys(list(parts["training"]) + list(parts["generation"])))
    fig = go.Figure()
    for i, name in enumerate(names):
        ys = [parts[ph].get(name, 0.0) for ph in ("training", "generation")]
        if any(ys):
            fig.add_bar(name=name, x=["training phase", "generation phase"], y=ys,
                        marker_color=qualitative.Dark24[i % len(qualitative.Dark24)])
    mem = report["settings"]["gpu_mem_gib"]
    fig.add_hline(y=mem, line_dash="dash", annotation_text=f"GPU memory {mem:.0f} GiB")
    verdict = "fits" if report["fits"] else "does not fit"
    fig.update_layout(barmode="stack", yaxis_title="GiB per GPU", height=420,
                      title=title or f"{report['model']}: peak {report['peak_gib_per_gpu']:.0f} GiB per GPU, {verdict}")
    return fig
