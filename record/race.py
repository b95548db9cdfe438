"""Who won the race, and by how much: the judgment of `record.speed`'s records (notebook 04's speed table).
A faster token is not a faster lesson: each configuration's steady-state tokens/s, and its wall time and generations
to one reward threshold, as ratios to TRL's defaults of the same race (learning rate, budget per seed, commit) and
seed; runs of another day, budget or code are not compared.
"""

from __future__ import annotations

import math
import statistics

from record.speed import (ADDS, NAMES, RECIPE, THRESHOLD_FRACTION, WINDOW_COMPLETIONS, planner_estimate_for_record,
                                    switch_total, window_mean)


def running_reward(rows: list[dict], per_gen: int) -> list[tuple[float, float]]:
    """(t_s, running mean reward, `speed.window_mean`) at every generation from the first whole window on."""
    gens = [(r["t_s"], r["reward"]) for r in rows if r.get("reward") is not None]
    rewards = [reward for _, reward in gens]
    means = [(t, window_mean(rewards[:i + 1], per_gen)) for i, (t, _) in enumerate(gens)]
    return [(t, m) for t, m in means if m is not None]


def threshold(defaults_record: dict) -> float | None:
    """Half the way from where TRL's defaults (seed 0) start to the best reward, 0: their first generation's mean
    reward, halved. Every configuration starts from the same random model, so no run's luck moves it."""
    first = next((r["reward"] for r in defaults_record["rows"] if r.get("reward") is not None), None)
    return None if first is None else first * THRESHOLD_FRACTION


def time_to_reward(record: dict, target: float) -> float | None:
    for t, reward in running_reward(record["rows"], record["completions_per_generation"]):
        if reward >= target:
            return round(t, 2)
    return None


def generations_to_reward(record: dict, target: float) -> int | None:
    """Generations made when the run reached the threshold (TRL logs a generation's reward at its first step): with
    `steps_per_generation` or `num_iterations` k, k times fewer than steps. Does reward move per step or generation?"""
    t = time_to_reward(record, target)
    return None if t is None else sum(1 for r in record["rows"] if r.get("reward") is not None and r["t_s"] <= t)


def race(record: dict) -> str:
    """Which race a record ran in (learning rate, budget per seed, commit): ratios are taken only inside one."""
    parts = [f"lr={record['grpo_config'].get('learning_rate')}"]
    if record.get("budget_s"):
        parts.append(f"{record['budget_s']:g} s")
    if record.get("stop_past"):
        parts.append("each seed stops past the threshold")
    if record.get("commit"):
        parts.append(f"at {record['commit']}")
    return ", ".join(parts)


def summarize(records: list[dict]) -> dict:
    """Per race, per configuration: tokens/s and time to the threshold per seed, their ratios to TRL's defaults."""
    by_race: dict = {}
    for r in records:
        by_race.setdefault(race(r), []).append(r)
    out = {}
    for key, rs in by_race.items():
        out[key] = _summarize_one(rs)
        out[key]["race"] = {"learning_rate": rs[0]["grpo_config"].get("learning_rate"),
                            "budget_s": rs[0].get("budget_s"), "commit": rs[0].get("commit")}
    return out


def seeds_race(result: dict, model: str = "qwen2.5-1.5b") -> str | None:
    """The key of the newest race of `model` that ran TRL's defaults and the recipe and nothing else (a race of
    seeds), None when none did."""
    return next((k for k, g in reversed(result["summary"][model].items())
                 if set(g.get("configs", {})) == {"trl_defaults", RECIPE}), None)


def summarize_again(result: dict, model: str, key: str) -> tuple[list[dict], dict | None]:
    """One race's records and its summary made again from them (None when the file keeps no records of it): a file
    merged before the summary had its spreads stores no medians."""
    ran = [r for r in result.get("records") or [] if r.get("model") == model and race(r) == key]
    return ran, summarize(ran)[key] if ran else None


def first_race(result: dict, model: str, learning_rate: float) -> str:
    """The key of `model`'s first race at `learning_rate` in a merged result's summary."""
    return next(k for k, g in result["summary"][model].items() if g["race"]["learning_rate"] == learning_rate)


def _planner_now(record: dict) -> float | None:
    """The planner's peak as it is now for a record's settings (it keeps its day's); the recorded one otherwise."""
    try:
        return planner_estimate_for_record(record)["peak_gib_per_gpu"]
    except (KeyError, ValueError):
        return record["planner_peak_gib"]


def _mean_length(record: dict) -> float | None:
    cycles = record["steady"]["per_cycle"][1:]
    tokens = sum(c["tokens"] for c in cycles)
    return round(tokens / (len(cycles) * record["completions_per_generation"]), 1) if cycles else None


def seed_spread(times: list[float | None]) -> dict:
    """Time to the threshold over seeds: the median (a seed that never reached it counts as slower than any that
    did; None when the median seed did not), the range (its top None when a seed did not), how many reached, and the
    slowest over the fastest (None when a seed did not)."""
    reached = sorted(t for t in times if t is not None)
    ranked = reached + [math.inf] * (len(times) - len(reached))
    median = statistics.median(ranked) if ranked else math.inf
    whole = len(reached) == len(times) and reached
    return {"median_s": round(median, 2) if math.isfinite(median) else None,
            "range_s": [reached[0] if reached else None, reached[-1] if whole else None],
            "reached": f"{len(reached)} of {len(times)}",
            "slowest_over_fastest": round(reached[-1] / reached[0], 2) if whole and reached[0] else None}


def _summarize_one(records: list[dict]) -> dict:
    by: dict = {}
    for r in records:
        by.setdefault(r["config"], []).append(r)
    base = sorted(by.get("trl_defaults", []), key=lambda r: r["seed"])
    # a race without the defaults (a configuration run again alone) takes its threshold from its lowest seed
    # (ties by name): every run starts from the same random model, so the start is the same
    start = base[0] if base else min(records, key=lambda r: (r["seed"], r["config"]))
    target = threshold(start)
    base_tps = [r["steady"]["completion_tokens_per_s"] for r in base]
    base_ttr = {r["seed"]: time_to_reward(r, target) for r in base} if target is not None else {}
    # how long the defaults trained without reaching the threshold: a configuration that got there in t s is at
    # least this / t times faster (a lower bound, not a ratio)
    base_span = {r["seed"]: max((row["t_s"] for row in r["rows"]), default=None) for r in base}
    base_spread = seed_spread(list(base_ttr.values())) if base_ttr else None
    out = {"threshold": {"rule": f"the mean reward of {start['config']}'s (seed {start['seed']}) first generation times "
                                 f"{THRESHOLD_FRACTION}; reached when the running mean over >= "
                                 f"{WINDOW_COMPLETIONS} completions gets there",
                         "reward": round(target, 2) if target is not None else None}, "configs": {}}
    for name in [n for n in NAMES if n in by] + [n for n in by if n not in NAMES]:
        runs = sorted(by[name], key=lambda r: r["seed"])
        tps = [r["steady"]["completion_tokens_per_s"] for r in runs]
        ttr = [time_to_reward(r, target) if target is not None else None for r in runs]
        row = {"adds": ADDS.get(name), "seeds": [r["seed"] for r in runs],
               "completion_tokens_per_s": tps, "mean_completion_length": [_mean_length(r) for r in runs],
               "s_per_step": [r["steady"]["s_per_step"] for r in runs], "time_to_reward_s": ttr,
               "generations_to_reward": [generations_to_reward(r, target) if target is not None else None for r in runs],
               "nvml_peak_gib": [round(r["nvml_peak_gib"], 1) if r["nvml_peak_gib"] else None for r in runs],
               "planner_peak_gib": _planner_now(runs[0]),
               "phase_s_per_step": runs[0]["phase_s_per_step"],
               # records before switch_total counted a wake-up once where TRL wakes twice: summed again here
               "switch": {**runs[0]["switch"], "switch_median_s": switch_total(runs[0]["switch"])}
               if runs[0]["switch"] else runs[0]["switch"]}
        if target is not None:
            row["time_to_reward_over_seeds"] = seed_spread(ttr)
        if base_spread:
            # medians over each configuration's own seeds: one seed's luck moves a per-seed ratio, not this one
            mine = row["time_to_reward_over_seeds"]["median_s"]
            row["defaults_time_to_reward_over_seeds"] = base_spread
            row["time_to_reward_median_vs_defaults"] = (round(base_spread["median_s"] / mine, 2)
                                                        if mine and base_spread["median_s"] else None)
        if base_tps and all(base_tps) and all(tps):
            row["tokens_per_s_vs_defaults"] = round(statistics.mean(tps) / statistics.mean(base_tps), 2)
        if base_ttr:
            # seed by seed against the defaults' same seed; None where either never reached the threshold
            row["time_to_reward_speedup_per_seed"] = [
                round(base_ttr[r["seed"]] / t, 2) if t and base_ttr.get(r["seed"]) else None
                for r, t in zip(runs, ttr)]
            row["time_to_reward_speedup_at_least_per_seed"] = [
                round(base_span[r["seed"]] / t, 2) if t and base_ttr.get(r["seed"], 0) is None
                and base_span.get(r["seed"]) else None for r, t in zip(runs, ttr)]
            row["defaults_ran_seed"] = [r["seed"] in base_ttr for r in runs]  # no defaults of a seed: no ratio
        peak, pred = runs[0]["nvml_peak_gib"], row["planner_peak_gib"]
        if peak and pred:
            row["planner_error_seed0"] = round(pred / peak - 1, 3)  # seed 0: the first trainer in its process
        out["configs"][name] = row
    return out


# --- what notebook 04 shows -----------------------------------------------------------------------------

def _speedups(c: dict) -> str:
    """Per seed: the time ratio to the defaults, or '≥ x' where only this configuration reached the threshold (the
    defaults' training time over this one's), 'not reached', or 'no defaults run' for that seed."""
    at_least = c.get("time_to_reward_speedup_at_least_per_seed") or []
    ran = c.get("defaults_ran_seed") or []
    out = []
    for i, ratio in enumerate(c.get("time_to_reward_speedup_per_seed") or []):
        bound = at_least[i] if i < len(at_least) else None
        if i < len(ran) and not ran[i]:
            out.append("no defaults run")
            continue
        out.append(f"{ratio:.2f}" if ratio is not None else f"≥ {bound:.2f}" if bound is not None else "not reached")
    return " / ".join(out)


def table(result: dict, model: str = "qwen2.5-1.5b") -> list[dict]:
    """One row per race and configuration of a merged `speed_1xh200.json`: what a learner compares, per seed."""
    def seeds(values, fmt):
        return " / ".join("not reached" if v is None else fmt.format(v) for v in values)

    rows = []
    for g in reversed(list(result["summary"].get(model, {}).values())):  # the newest race first: merges append
        r = g["race"]
        # the defaults, then what the kit recommends, then each knob: the two rows a learner compares come first
        for name, c in sorted(g["configs"].items(), key=lambda kv: {"trl_defaults": 0, RECIPE: 1}.get(kv[0], 2)):
            gen = c["phase_s_per_step"]
            rows.append({
                "learning rate": f"{r['learning_rate']:g}", "s per seed": f"{r['budget_s']:g}" if r["budget_s"] else "",
                "ran at": r["commit"] or "", "configuration": name, "adds": c.get("adds") or "",
                "seeds": ", ".join(map(str, c["seeds"])),
                "completion tok/s": seeds(c["completion_tokens_per_s"], "{:,.0f}"),
                "× defaults (tok/s)": (f"{c['tokens_per_s_vs_defaults']:.2f}" if c.get("tokens_per_s_vs_defaults")
                                       is not None else "no defaults in this race"),
                "s/step": seeds(c["s_per_step"], "{:.3f}"),
                "generation · push · training s/step": f"{gen.get('generation', 0):.3f} · "
                                                       f"{gen.get('weight_sync', 0):.3f} · {gen.get('training', 0):.3f}",
                "time to threshold s": seeds(c["time_to_reward_s"], "{:.1f}"),
                "generations to threshold": seeds(c.get("generations_to_reward") or [], "{:d}"),
                "× defaults (time)": _speedups(c) or "no defaults in this race",
                "NVML peak GiB": seeds(c["nvml_peak_gib"], "{:.1f}"), "planner GiB": c["planner_peak_gib"],
            })
    return rows
