"""The memory planner (`colo_kit.memory.planner`) against peaks measured on H200s: the measured rows, the three
constants fitted to them, and the table of every row's error that `python -m record.planner_validation` writes
(`results/planner_validation.json`; notebook 04 shows it)."""

from __future__ import annotations

import json
from pathlib import Path

from colo_kit.memory.planner import (FITTED, H200_GIB, TOKEN_TILE, VLLM_ASLEEP_GIB, VLLM_OVERHEAD_GIB, VOCAB_TILE,
                              WEIGHT_SYNC_BUFFERS_GIB, Plan, estimate)

MEASURED_PEAKS = "planner_measured_peaks.json"  # under results/: the measured rows, their setup and a note


def _measured(results_dir: Path | None = None) -> dict:
    from colo_kit.paths import results_dir as _rd

    return json.loads((Path(results_dir or _rd()) / MEASURED_PEAKS).read_text())


def measured_rows(results_dir: Path | None = None) -> list[dict]:
    """results/planner_measured_peaks.json's rows, plus results/zero3_run.json's per-GPU peak when it exists."""
    from colo_kit.paths import results_dir as _rd

    data = _measured(results_dir)
    common = {**data["common_plan"], "gpu_mem_gib": H200_GIB}
    rows = [dict(r, plan={**common, **r["plan"]}, source="TRL 1.16 on 2×H200 (results/planner_measured_peaks.json)")
            for r in data["rows"]]
    path = Path(results_dir or _rd()) / "zero3_run.json"
    if path.exists():
        run = json.loads(path.read_text())
        # "partial": a run stopped by its time limit after at least one full step still measured a peak.
        if (run.get("status") == "ok" or (run.get("status") == "partial" and run.get("step_times_s"))) \
                and run.get("nvml_peak_gib_per_gpu"):
            offload = ", optimizer offload" if run["planner_settings"].get("offload_optimizer") else ""
            rows.append({"row": f"ZeRO-3{offload} colocate {run['settings']['model']}, {run['settings']['gpus']} GPU, sleep 2",
                         "measured_gib": max(run["nvml_peak_gib_per_gpu"]), "plan": run["planner_settings"],
                         "source": "results/zero3_run.json"})
    return rows


def fit_constants(rows: list[dict] | None = None) -> dict:
    """Grid search of the three fitted constants for the smallest worst-case relative error over `rows`
    (default: the colocate rows). Shown for honesty: this is how the values in FITTED were chosen."""
    import itertools

    rows = rows or [r for r in measured_rows() if r["plan"].get("mode", "colocate") == "colocate"
                    and r["source"].startswith("TRL 1.16 on 2×H200")]
    saved = dict(FITTED)
    grid = {"CUDA_CONTEXT_GIB": [0.5 + 0.25 * k for k in range(11)],
            "NCCL_GIB": [0.25 * k for k in range(1, 13)],  # NCCL buffers are never free
            "KEPT_AFTER_EMPTY_CACHE": [0.05 * k for k in range(21)]}
    best = None
    try:
        for values in itertools.product(*grid.values()):
            FITTED.update(zip(grid, values))
            worst = max(abs(estimate(Plan(**r["plan"]))["peak_gib_per_gpu"] / r["measured_gib"] - 1) for r in rows)
            if best is None or worst < best[0] - 1e-9:
                best = (worst, dict(FITTED))
    finally:
        FITTED.clear()
        FITTED.update(saved)
    return {"max_abs_error": round(best[0], 4), "constants": best[1], "rows": [r["row"] for r in rows]}


def reserve_ratios(results_dir: Path | None = None) -> list[dict]:
    """PyTorch's reserved minus allocated peak per GiB of the planner's activations and logits, in each one-H200 race
    record with those peaks (results/speed_1xh200.json): their median, not NVML, sets FITTED["ALLOCATOR_RESERVE"]."""
    from record.speed import planner_estimate_for_record
    from colo_kit.paths import results_dir as _rd

    result = json.loads((Path(results_dir or _rd()) / "speed_1xh200.json").read_text())
    out = []
    for r in result["records"]:
        torch_peak = r.get("torch_peak_gib")
        if not torch_peak:
            continue
        training = planner_estimate_for_record(r)["parts"]["training"]
        step = training["activations"] + training["logits"]
        out.append({"config": r["config"], "model": r["model"], "seed": r["seed"], "commit": r.get("commit"),
                    "step_gib": step, "reserve_gib": round(torch_peak["reserved"] - torch_peak["allocated"], 2),
                    "ratio": round((torch_peak["reserved"] - torch_peak["allocated"]) / step, 3)})
    return out


def validation_table(results_dir: Path | None = None) -> dict:
    rows = []
    for r in measured_rows(results_dir):
        pred = estimate(Plan(**r["plan"]))
        err = pred["peak_gib_per_gpu"] / r["measured_gib"] - 1
        rows.append({"row": r["row"], "source": r["source"], "measured_gib": r["measured_gib"],
                     "predicted_gib": pred["peak_gib_per_gpu"], "peak_phase": pred["peak_phase"],
                     "error": round(err, 4), "settings": r["plan"]})
    return {
        "rows": rows,
        "max_abs_error": round(max(abs(r["error"]) for r in rows), 4),
        "constants": {
            "fitted": {**FITTED, "fitted_to": "CUDA_CONTEXT_GIB, NCCL_GIB and KEPT_AFTER_EMPTY_CACHE: the 8 colocate "
                                              "rows measured on 2×H200 (minimax relative error over a grid; the server "
                                              "row and the ZeRO-3 run were not used); ALLOCATOR_RESERVE: PyTorch's own "
                                              "reserved minus allocated peak per GiB of activations and logits, the "
                                              "median over the one-H200 races' records (results/speed_1xh200.json), "
                                              "not their NVML peaks"},
            "set": {"H200_GIB": H200_GIB, "VLLM_ASLEEP_GIB": VLLM_ASLEEP_GIB, "VLLM_OVERHEAD_GIB": VLLM_OVERHEAD_GIB,
                    "WEIGHT_SYNC_BUFFERS_GIB": WEIGHT_SYNC_BUFFERS_GIB, "TOKEN_TILE": TOKEN_TILE, "VOCAB_TILE": VOCAB_TILE},
        },
    }


def write_validation(path: Path | None = None) -> Path:
    """results/planner_validation.json: measured vs predicted peak per row, the error, the constants."""
    from colo_kit.env import describe
    from colo_kit.paths import results_dir
    from record.store import write_json_atomic

    path = Path(path or results_dir() / "planner_validation.json")
    table = validation_table()
    table["note"] = _measured()["note"]
    table["env"] = {k: v for k, v in describe().items() if k in ("python", "versions")}
    return write_json_atomic(path, table)


def main(argv: list[str] | None = None) -> int:
    """`python -m record.planner_validation [--out PATH]`: print each row's error; write the table to --out (default
    results/runs/planner_validation.json; the committed results/planner_validation.json changes only when named)."""
    import argparse

    from colo_kit.paths import runs_dir

    parser = argparse.ArgumentParser(prog="python -m record.planner_validation", description=main.__doc__)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    path = write_validation(args.out or runs_dir() / "planner_validation.json")
    table = json.loads(path.read_text())
    for r in table["rows"]:
        print(f"{r['row']:<44} measured {r['measured_gib']:6.1f}  predicted {r['predicted_gib']:6.1f} GiB  "
              f"error {r['error']:+.1%}")
    print(f"max |error| {table['max_abs_error']:.1%}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
