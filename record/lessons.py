"""What the lessons show from the large records, derived once and kept small: `results/lessons.json`.

The notebooks read a number through `colo_kit.results.shown(key)`; the code that judges a record (who won a race,
by how much, what a phase cost) lives here, in the record, and runs when the record changes (`make numbers`, or
`python -m record.lessons --out results/lessons.json`). Each entry names its `source` file, the `machine` it ran
on and the `date` that file was last written, for the lesson's one-line footnote.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from colo_kit.paths import REPO_ROOT, results_dir
from colo_kit.results import machine_label
from colo_kit.serving.pingpong import PhaseCosts, _line, _merge_points
from record import race, speed
from record.router_compare import router_table


def file_date(path: Path) -> str | None:
    """The day `path` was last committed (YYYY-MM-DD), or None outside git."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%cs", "--", str(path)], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


def costs_from_speed(result: dict, learning_rate: float = 5e-3) -> PhaseCosts:
    """H200 phase costs of a colocated 1.5B step from `results/speed_1xh200.json` (measured), for a machine
    without a committed ping-pong sweep: generation per call at 8, 64 and 256 completions, training (no checkpointing) at
    batch 8 and 32, and TRL's weight push, from the learning-rate-5e-3 runs (completions stayed at the 256-token limit).
    Assumed, and named in `notes`: a server generates as fast as the colocated engine (a server's 0.9 of the GPU against
    0.3 only adds KV cache these batches do not need) and its weight sync costs what the colocated push did."""
    from record.race import first_race, race

    key = first_race(result, "qwen2.5-1.5b", learning_rate)
    configs = result["summary"]["qwen2.5-1.5b"][key]["configs"]
    recs = {(r["config"], r["seed"]): r for r in result["records"] if r["model"] == "qwen2.5-1.5b" and race(r) == key}
    gen_points, train_points = [], []
    for name in ("trl_defaults", "spg8", "batch32"):
        rec = recs[(name, 0)]
        per_gen = rec["completions_per_generation"]
        gen_points.append((per_gen, configs[name]["phase_s_per_step"]["generation"] * rec["steps_per_generation"]))
    for name in ("no_grad_ckpt", "batch32"):
        rec = recs[(name, 0)]
        batch = rec["grpo_config"]["per_device_train_batch_size"]
        train_points.append((batch, configs[name]["phase_s_per_step"]["training"]))
    fixed, per_sample = _line(train_points)
    push = configs["trl_defaults"]["switch"]["weight_sync"]["median_s"]
    notes = ["measured on one H200 (results/speed_1xh200.json); a server generates as fast as the colocated engine "
             "did, and its weight sync costs what the colocated push did (assumptions)"]
    return PhaseCosts(gen_points=_merge_points(gen_points), train_fixed_s=fixed, train_per_sample_s=per_sample,
                      sync_server_s=push, sync_colocate_s=push, tokens_per_sample=256.0,
                      source="results/speed_1xh200.json", notes=notes)


def costs_7b_from_speed(result: dict, base: PhaseCosts) -> PhaseCosts:
    """H200 phase costs of a colocated 7B step from `results/speed_1xh200.json` (measured): generation per call at 8
    and 16 completions (`trl_defaults`, `spg2`), training at per-device batch 8 without gradient checkpointing
    (`spg2`, as the 1.5B points) and TRL's weight push, from the newest race that ran both. Where 7B was not
    measured (more completions per call, other batches) each term follows `base`'s (1.5B) measured curve from the
    7B's own point: the rule is named in `notes`."""
    key = next(k for k, g in reversed(result["summary"]["qwen2.5-7b"].items())
               if {"trl_defaults", "spg2"} <= set(g["configs"]))
    configs = result["summary"]["qwen2.5-7b"][key]["configs"]
    recs = {r["config"]: r for r in result["records"] if r["model"] == "qwen2.5-7b" and race.race(r) == key
            and r["seed"] == 0}
    gen = {recs[c]["completions_per_generation"]: configs[c]["phase_s_per_step"]["generation"]
           * recs[c]["steps_per_generation"] for c in ("trl_defaults", "spg2")}
    measured, top = sorted(gen), max(gen)
    for x in (64, 256):  # the 1.5B's growth from `top` completions per call, from the 7B's measured time there
        gen[x] = gen[top] * base.gen(x) / base.gen(top)
    batch = recs["spg2"]["grpo_config"]["per_device_train_batch_size"]
    scale = configs["spg2"]["phase_s_per_step"]["training"] / base.train(batch)
    push = configs["trl_defaults"]["switch"]["weight_sync"]["median_s"]
    notes = [f"measured on one H200 (results/speed_1xh200.json, 7B): generation at {' and '.join(map(str, measured))} "
             f"completions per call, training at batch {batch}, TRL's push; generation beyond {top} completions and "
             "training at other batches follow the 1.5B's measured curves from the 7B's own point (a rule, not a "
             "measurement); a server generates as fast as the colocated engine (assumption)"]
    return PhaseCosts(gen_points=sorted((b, round(t, 4)) for b, t in gen.items()),
                      train_fixed_s=base.train_fixed_s * scale, train_per_sample_s=base.train_per_sample_s * scale,
                      sync_server_s=push, sync_colocate_s=push, tokens_per_sample=256.0,
                      source="results/speed_1xh200.json", notes=notes)


def _entry(results: Path, name: str, machine: str | None = None, **shown) -> dict:
    path = results / f"{name}.json"
    env = json.loads(path.read_text()).get("env") if machine is None else None
    return {**shown, "source": f"results/{name}.json", "machine": machine or machine_label(env or {}),
            "date": file_date(path)}


def current_race(result: dict, model: str = "qwen2.5-1.5b", knobs: bool = False) -> list[dict]:
    """The newest race of `model` that ran TRL's defaults beside the others: the one table a lesson shows (the
    earlier races stay in the record's summary). With `knobs`, the newest that also ran a knob on its own, not only
    the recipe: a race of many seeds of the defaults and the recipe is shown by `seeds_over` instead."""
    rows = race.table(result, model)  # the newest race first
    ran: dict = {}
    for r in rows:
        ran.setdefault((r["learning rate"], r["s per seed"], r["ran at"]), set()).add(r["configuration"])
    key = next(k for k, names in ran.items() if "trl_defaults" in names
               and (not knobs or names - {"trl_defaults", speed.RECIPE}))
    return [{k: v for k, v in r.items() if k != "ran at"} for r in rows
            if (r["learning rate"], r["s per seed"], r["ran at"]) == key]


def seeds_over(result: dict, model: str = "qwen2.5-1.5b", key: str | None = None) -> dict:
    """A race over many seeds (`speed.sh` on one GPU; the newest race unless `key` names one): per configuration the
    tokens/s ratio, the time to the threshold as median and range over seeds, and each seed's running reward curve,
    for the lesson's chart."""
    key = key or next(reversed(result["summary"][model]))
    ran, summary = race.summarize_again(result, model, key)
    per_gen = None
    out = {"race": key.split(", at ")[0], "threshold_reward": summary["threshold"]["reward"], "configs": {}}
    for name, c in summary["configs"].items():
        recs = sorted((r for r in ran if r["config"] == name), key=lambda r: r["seed"])
        per_gen = recs[0]["completions_per_generation"]
        over = c["time_to_reward_over_seeds"]
        out["configs"][name] = {
            "tokens_per_s_vs_defaults": c.get("tokens_per_s_vs_defaults"),
            "median_vs_defaults": c.get("time_to_reward_median_vs_defaults"),
            "median_s": over["median_s"], "range_s": over["range_s"], "reached": over["reached"],
            "seeds": [r["seed"] for r in recs], "time_to_reward_s": c["time_to_reward_s"],
            "nvml_peak_gib": c["nvml_peak_gib"], "planner_peak_gib": c["planner_peak_gib"],
            "curves": [[(round(t, 1), round(m, 1)) for t, m in race.running_reward(r["rows"], per_gen)] for r in recs]}
    # what one seed against one can read: a reached defaults seed over a reached seed of each configuration
    defaults = [t for t in out["configs"].get("trl_defaults", {}).get("time_to_reward_s", []) if t]
    for c in out["configs"].values():
        mine = [t for t in c["time_to_reward_s"] if t]
        c["one_seed_vs_one"] = [round(min(defaults) / max(mine), 2), round(max(defaults) / min(mine), 2)] \
            if defaults and mine else None
    return out


def side_by_side(result: dict, model: str) -> dict:
    """The newest race of `model` as one row per configuration (tokens/s, seconds per step, NVML peak against the
    planner's): a race without TRL's defaults, such as 7B on one 80 GB GPU, where they do not fit."""
    races = result["summary"][model]
    key = next(reversed(races))
    return {"race": key.split(", at ")[0], "configs": {
        name: {k: c.get(k) for k in ("adds", "seeds", "completion_tokens_per_s", "s_per_step", "nvml_peak_gib",
                                     "planner_peak_gib")} for name, c in races[key]["configs"].items()}}


def peaks_at(result: dict, configs=("batch32", "batch32_on_policy")) -> list[dict]:
    """The newest seed-0 record of each batch-32 configuration: NVML's peak and PyTorch's own, at u = 0.3."""
    rows = []
    for config in configs:
        anchor = [r for r in result["records"] if r["config"] == config and r["seed"] == 0][-1]
        torch_peak = anchor.get("torch_peak_gib") or {}
        rows.append({"config": config, "nvml_peak_gib": anchor["nvml_peak_gib"],
                     "torch_allocated_gib": torch_peak.get("allocated"), "torch_reserved_gib": torch_peak.get("reserved")})
    return rows


def break_it_rows(result: dict) -> list[dict]:
    """Notebook 04's break-it on a GPU (`scripts/share_by_hand.py`): per share, the planner's peak, whether two steps
    ran, NVML's peak and the line where a run stopped."""
    keep = ("share", "GPU GiB", "peak GiB (modelled)", "fits (modelled)", "two steps (measured)", "NVML peak GiB (measured)",
            "why it stopped")
    rows = [{k: r.get(k) for k in keep} for r in result["rows"]]
    for r in rows:  # the error's first sentence, what ran out (the rest is PyTorch's accounting and advice)
        r["why it stopped"] = (r["why it stopped"] or "").removeprefix("[rank0]: ").split(". ")[0]
    return rows


def build(results: Path | None = None) -> dict:
    """Every entry the lessons read, from the committed records under `results`."""
    results = Path(results or results_dir())
    sp = json.loads((results / "speed_1xh200.json").read_text())
    latency = json.loads((results / "gen_latency_1xh200.json").read_text())
    router = json.loads((results / "router_vs_proxy_cpu.json").read_text())
    h100 = json.loads((results / "speed_1xh100.json").read_text())
    by_hand = json.loads((results / "share_by_hand_1xh100.json").read_text())
    return {
        "01.h200_costs": _entry(results, "speed_1xh200", "1×H200", costs=costs_from_speed(sp).to_dict()),
        "01.h200_costs_7b": _entry(results, "speed_1xh200", "1×H200",
                                   costs=costs_7b_from_speed(sp, costs_from_speed(sp)).to_dict()),
        "04.speed": _entry(results, "speed_1xh200", "1×H200", rows=current_race(sp, knobs=True)),
        "04.speed_7b": _entry(results, "speed_1xh200", "1×H200", rows=current_race(sp, "qwen2.5-7b")),
        "04.peaks_at_0.3": _entry(results, "speed_1xh200", "1×H200", rows=peaks_at(sp)),
        "04.latency": _entry(results, "gen_latency_1xh200", "1×H200", rows=[{k: v for k, v in r.items() if k != "commit"}
                                                                              for r in speed.latency_table(latency)]),
        "04.seeds_h100": _entry(results, "speed_1xh100", "1×H100 80 GB", **seeds_over(h100)),
        "04.seeds_h200": _entry(results, "speed_1xh200", "1×H200", **seeds_over(sp, key=race.seeds_race(sp))),
        "04.share_by_hand_h100": _entry(results, "share_by_hand_1xh100", "1×H100 80 GB", rows=break_it_rows(by_hand)),
        "04.h100_7b": _entry(results, "speed_1xh100", "1×H100 80 GB", **side_by_side(h100, "qwen2.5-7b")),
        "06.router": _entry(results, "router_vs_proxy_cpu", rows=router_table(router)),
    }


def main(argv: list[str] | None = None) -> int:
    import argparse

    from record.store import write_json_atomic

    parser = argparse.ArgumentParser(prog="python -m record.lessons", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=results_dir() / "lessons.json")
    args = parser.parse_args(argv)
    shown = build()
    write_json_atomic(args.out, shown)
    print(f"wrote {len(shown)} entries to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
