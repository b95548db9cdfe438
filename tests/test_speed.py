"""record.speed: the chain of knobs, how its numbers are computed, the committed H200 runs, and the CPU smoke
of scripts/gpu/speed.sh (the same code the GPU runs, with the tiny model)."""

import json
import subprocess
import sys

import pytest
import torch

from record import race, speed
from colo_kit.colocate.bucketed_push import buckets
from colo_kit.paths import REPO_ROOT

RESULT = REPO_ROOT / "results" / "speed_1xh200.json"


def test_each_configuration_is_the_one_before_plus_its_knob():
    assert speed.config("trl_defaults") == ({"per_device_train_batch_size": 8}, {})
    fields, knobs = speed.config("spg8")
    assert fields == {"per_device_train_batch_size": 8, "gradient_checkpointing": False,
                      "generation_kwargs": {"detokenize": False}, "steps_per_generation": 8}
    assert knobs == {"push_bucket_mb": 0}
    assert speed.config("batch32")[0]["per_device_train_batch_size"] == 32
    with pytest.raises(ValueError, match="spg9"):
        speed.config("spg9")


def test_7b_races_in_bfloat16_without_zero_and_the_planner_says_it_fits_one_h200():
    """Every 7B configuration loads bfloat16 weights (TRL's model_init_kwargs), the recipe included, and is
    sized as such: in float32 TRL's defaults alone would not fit one H200 beside a 0.3 engine."""
    from colo_kit.memory.planner import estimate

    for name in ["trl_defaults", "no_grad_ckpt", "spg2", "sleep_l2", speed.RECIPE]:
        fields, _ = speed.config(name, "qwen2.5-7b")
        assert fields["model_init_kwargs"] == {"dtype": "bfloat16"}, name
        assert speed.planner_peak_for(name, "qwen2.5-7b") < 139.8 * 0.92, name
    assert "model_init_kwargs" not in speed.config("trl_defaults")[0]
    assert estimate(model="qwen2.5-7b", per_device_train_batch_size=8)["peak_gib_per_gpu"] > 139.8


def test_chain_and_side_fields_are_grpo_config_fields():
    from dataclasses import fields

    from trl import GRPOConfig

    names = {f.name for f in fields(GRPOConfig)}
    for cfg in [c[2] for c in speed.CHAIN] + [v[2] for v in speed.SIDE.values()]:
        assert set(cfg) <= names, f"not GRPOConfig fields: {set(cfg) - names}"


def test_side_configurations_build_on_their_base_and_a_cycle_counts_every_step_on_one_generation():
    fields, knobs = speed.config("mu4")
    assert fields == {**speed.config("bucketed_push")[0], "num_iterations": 4} and knobs == {"push_bucket_mb": 0}
    assert speed.config("batch32_on_policy")[0]["per_device_train_batch_size"] == 32
    assert "steps_per_generation" not in speed.config("batch32_on_policy")[0]
    assert speed.ADDS["mu4"] == "bucketed_push + num_iterations=4"
    # TRL generates once per steps_per_generation * num_iterations optimizer steps
    assert speed.cycle_steps({"steps_per_generation": 2, "num_iterations": 4}) == 8
    assert speed.cycle_steps({"steps_per_generation": None, "num_iterations": 2}) == 2
    assert speed.cycle_steps({}) == 1


def test_buckets_group_tensors_by_bytes_in_order():
    named = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([256, 256, 512, 128, 64])]
    # a bucket closes once it holds at least the limit: 256 floats are 1 KiB, so at 1 KiB each of the first
    # three closes its own bucket, and the last two (0.75 KiB) are what is left over
    got = [[name for name, _ in b] for b in buckets(named, 1024)]
    assert got == [["t0"], ["t1"], ["t2"], ["t3", "t4"]]
    got = [[name for name, _ in b] for b in buckets(named, 3000)]  # 1 + 1 + 2 KiB >= 3000 bytes
    assert got == [["t0", "t1", "t2"], ["t3", "t4"]]
    assert [[n for n, _ in b] for b in buckets(named, 0)] == [["t0", "t1", "t2", "t3", "t4"]]
    assert list(buckets([], 0)) == []


def test_steady_state_counts_whole_cycles_after_the_first():
    # spg 2, 4 completions per generation; steps 1 and 3 generated (lengths 100 and 50), step 5 starts a third
    # cycle that the budget cut short
    rows = [{"step": 1, "completions/mean_length": 100.0}, {"step": 2}, {"step": 3, "completions/mean_length": 50.0},
            {"step": 4}, {"step": 5, "completions/mean_length": 10.0}]
    s = speed.steady_state(rows, [3.0, 1.0, 0.5, 0.5, 9.0], cycle=2, per_gen=4)
    assert s["cycles"] == 1                      # the first cycle is warm-up, the third is incomplete
    assert s["seconds"] == pytest.approx(1.0)
    assert s["completion_tokens_per_s"] == pytest.approx(50 * 4 / 1.0)
    assert s["s_per_step"] == pytest.approx(0.5)


def test_phase_totals_count_seconds_inside_the_window_and_phase_per_step_divides_them_by_the_steps():
    from colo_kit.grpo.timeline import Timeline

    tl = Timeline(meta={"steps": [{"step": 1, "start_s": 0.0, "end_s": 10.0}, {"step": 2, "start_s": 10.0, "end_s": 20.0}]})
    tl.add("trainer", "waiting", 10.0, 14.0)
    tl.add("trainer", "forward", 14.0, 16.0)
    tl.add("trainer", "forward", 1.0, 9.0)  # the first step: outside the window
    tl.add("server", "generation", 8.0, 12.0, rank=-1)  # cut at the window's start
    assert speed.phase_totals(tl, skip_steps=1) == {"trainer": {"waiting": 4.0, "forward": 2.0},
                                                    "server": {"generation": 2.0}}
    assert speed.phase_per_step(tl, skip_steps=1) == {"waiting": 4.0, "forward": 2.0, "generation": 2.0,
                                                      "training": 2.0}


def test_running_reward_needs_64_completions_and_time_to_reward_reads_it():
    rows = [{"t_s": float(i), "reward": r} for i, r in enumerate([-100, -90, -80, -10, -10, -10, -10, -10, -10])]
    curve = race.running_reward(rows, per_gen=16)  # 4 generations make a window
    assert [t for t, _ in curve] == [3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    assert curve[0][1] == pytest.approx((-100 - 90 - 80 - 10) / 4)
    record = {"rows": rows, "completions_per_generation": 16}
    assert race.time_to_reward(record, -50) == 4.0   # (-90-80-10-10)/4 = -47.5 at t=4
    assert race.time_to_reward(record, -5) is None


def test_generations_to_reward_counts_the_rows_that_logged_a_reward_up_to_the_threshold():
    # steps_per_generation=2: a reward row every other step, as TRL logs a generation's reward once
    rows = [{"t_s": float(i), **({"reward": r} if i % 2 == 0 else {})}
            for i, r in enumerate([-100, None, -100, None, -100, None, -100, None, -10, None, -10, None, -10])]
    record = {"rows": rows, "completions_per_generation": 16}  # 4 generations make a window
    assert race.time_to_reward(record, -60) == 10.0        # (-100-100-10-10)/4 = -55 at the 6th generation
    assert race.generations_to_reward(record, -60) == 6
    assert race.generations_to_reward(record, -5) is None


def test_the_budget_stops_after_its_time_but_never_inside_the_second_cycle():
    from types import SimpleNamespace

    control = SimpleNamespace(should_training_stop=False)
    spent = speed._Budget(0.0, {}, min_steps=16)   # time is up at once; steps_per_generation=8 needs 16 steps
    spent.on_train_begin(None, None, control)
    spent.on_step_end(None, SimpleNamespace(global_step=15), control)
    assert not control.should_training_stop
    spent.on_step_end(None, SimpleNamespace(global_step=16), control)
    assert control.should_training_stop
    control.should_training_stop = False
    fresh = speed._Budget(3600.0, {}, min_steps=2)  # steps enough, time not up
    fresh.on_train_begin(None, None, control)
    fresh.on_step_end(None, SimpleNamespace(global_step=100), control)
    assert not control.should_training_stop


def test_the_budget_can_stop_a_seed_once_its_running_reward_is_past_the_threshold():
    from types import SimpleNamespace

    marks, control = {}, SimpleNamespace(should_training_stop=False)
    # 32 completions per generation: the running mean is over the last 2 generations
    cb = speed._Budget(3600.0, marks, min_steps=2, stop_past=0.45, per_gen=32)
    cb.on_train_begin(None, None, control)
    for step, reward in enumerate([-2000.0, -1500.0, -1000.0, -780.0], start=1):
        cb.on_log(None, SimpleNamespace(global_step=step), control, logs={"reward": reward, "loss": 0.1})
        cb.on_log(None, SimpleNamespace(global_step=step), control, logs={"loss": 0.1})  # a step that did not generate
        if step < 4:  # one generation only, then -1750 and -1250: not yet at 0.45 x -2000 = -900
            assert not control.should_training_stop, step
    assert control.should_training_stop and marks["stopped_past_reward"] == 4  # (-1000 - 780) / 2 = -890
    plain = speed._Budget(3600.0, {}, min_steps=2, per_gen=32)  # without stop_past the reward never stops it
    control.should_training_stop = False
    plain.on_log(None, SimpleNamespace(global_step=9), control, logs={"reward": -1.0})
    assert not control.should_training_stop


def test_threshold_is_half_the_defaults_first_generation():
    record = {"rows": [{"t_s": 1.0}, {"t_s": 2.0, "reward": -2800.0}, {"t_s": 3.0, "reward": -100.0}],
              "completions_per_generation": 8}
    assert race.threshold(record) == pytest.approx(-1400.0)
    assert race.threshold({"rows": [{"t_s": 1.0}], "completions_per_generation": 8}) is None


def _record(config, seed, tps, rewards, lr=5e-4, per_gen=64):
    return {"config": config, "seed": seed, "grpo_config": {"learning_rate": lr},
            "completions_per_generation": per_gen, "rows": [{"t_s": float(t), "reward": r} for t, r in rewards],
            "steady": {"completion_tokens_per_s": tps, "s_per_step": 1.0, "per_cycle": []},
            "nvml_peak_gib": 70.0, "planner_peak_gib": 66.5, "phase_s_per_step": {}, "switch": {}}


def test_summary_compares_seed_by_seed_and_keeps_learning_rates_apart():
    records = [_record("trl_defaults", 0, 1000.0, [(1, -2000), (10, -900)]),
               _record("trl_defaults", 1, 1200.0, [(1, -2000), (20, -900)]),
               _record("spg8", 0, 3300.0, [(1, -2000), (5, -900)]),
               _record("spg8", 1, 3300.0, [(1, -2000), (40, -1500)]),
               _record("trl_defaults", 0, 10.0, [(1, -3000)], lr=1e-4)]
    s = race.summarize(records)
    assert set(s) == {"lr=0.0005", "lr=0.0001"}
    g = s["lr=0.0005"]
    assert g["threshold"]["reward"] == pytest.approx(-1000.0)
    spg8 = g["configs"]["spg8"]
    assert spg8["tokens_per_s_vs_defaults"] == pytest.approx(3.0)
    assert spg8["time_to_reward_s"] == [5.0, None]
    assert spg8["time_to_reward_speedup_per_seed"] == [2.0, None]
    assert spg8["time_to_reward_speedup_at_least_per_seed"] == [None, None]  # the defaults reached it: a ratio
    assert spg8["planner_error_seed0"] == pytest.approx(-0.05)


def test_ratios_are_taken_only_against_the_defaults_of_the_same_race():
    def at(rec, budget, commit):
        return {**rec, "budget_s": budget, "commit": commit, "model": "qwen2.5-1.5b"}

    records = [at(_record("trl_defaults", 0, 1000.0, [(1, -2000), (30, -900)]), 60.0, "aaa"),
               at(_record("spg4", 0, 2000.0, [(1, -2000), (10, -900)]), 60.0, "aaa"),
               at(_record("trl_defaults", 0, 500.0, [(1, -2000), (20, -900)]), 150.0, "bbb"),
               at(_record("spg4", 0, 1500.0, [(1, -2000), (80, -900)]), 150.0, "bbb"),
               at(_record("sleep_kv", 0, 900.0, [(1, -2000)]), 60.0, "bbb")]
    s = race.summarize(records)
    assert set(s) == {"lr=0.0005, 60 s, at aaa", "lr=0.0005, 150 s, at bbb", "lr=0.0005, 60 s, at bbb"}
    assert s["lr=0.0005, 60 s, at aaa"]["configs"]["spg4"]["time_to_reward_speedup_per_seed"] == [3.0]
    assert s["lr=0.0005, 150 s, at bbb"]["configs"]["spg4"]["time_to_reward_speedup_per_seed"] == [0.25]
    assert s["lr=0.0005, 150 s, at bbb"]["configs"]["spg4"]["tokens_per_s_vs_defaults"] == pytest.approx(3.0)
    alone = s["lr=0.0005, 60 s, at bbb"]["configs"]["sleep_kv"]  # no defaults ran beside it: no ratio at all
    assert "tokens_per_s_vs_defaults" not in alone and "time_to_reward_speedup_per_seed" not in alone
    rows = race.table({"summary": {"qwen2.5-1.5b": s}})
    assert {(r["s per seed"], r["ran at"]) for r in rows} == {("60", "aaa"), ("150", "bbb"), ("60", "bbb")}


def test_merge_keeps_runs_of_another_commit_and_stamps_each_record_with_its_commit(tmp_path):
    def part(commit, tps):
        rec = {**_record("trl_defaults", 0, tps, [(1, -2000), (30, -900)]), "budget_s": 60.0, "model": "qwen2.5-1.5b"}
        path = tmp_path / f"{commit}.json"
        path.write_text(json.dumps({"config": "trl_defaults", "model": "qwen2.5-1.5b", "commit": commit, "env": {},
                                    "records": [rec]}))
        return str(path)

    out = tmp_path / "merged.json"
    script = [sys.executable, str(REPO_ROOT / "scripts" / "speed_bench.py"), "merge"]
    subprocess.run(script + [part("aaa", 1000.0), "--out", str(out)], check=True, capture_output=True)
    subprocess.run(script + [part("bbb", 1100.0), "--into", str(out), "--out", str(out)], check=True, capture_output=True)
    subprocess.run(script + [part("bbb", 1200.0), "--into", str(out), "--out", str(out)], check=True, capture_output=True)
    merged = json.loads(out.read_text())
    # the same configuration and seed run again at the same commit replaces; at another commit it is kept
    assert sorted((r["commit"], r["steady"]["completion_tokens_per_s"]) for r in merged["records"]) == \
        [("aaa", 1000.0), ("bbb", 1200.0)]
    assert len(merged["summary"]["qwen2.5-1.5b"]) == 2


def test_a_race_without_the_defaults_says_so_instead_of_a_ratio():
    records = [_record("trl_defaults", 0, 1000.0, [(1, -2000), (10, -900)]),
               _record("spg4", 0, 2000.0, [(1, -2000), (5, -900)]),
               _record("sleep_kv", 0, 900.0, [(1, -2000), (30, -1900)], lr=1e-4)]  # a race of its own, no defaults
    rows = {(r["learning rate"], r["configuration"]): r
            for r in race.table({"summary": {"qwen2.5-1.5b": race.summarize(records)}})}
    assert rows[("0.0001", "sleep_kv")]["× defaults (tok/s)"] == "no defaults in this race"
    assert rows[("0.0001", "sleep_kv")]["× defaults (time)"] == "no defaults in this race"
    assert rows[("0.0005", "spg4")]["× defaults (tok/s)"] == "2.00"


def test_where_only_the_configuration_reached_the_threshold_the_table_gives_a_lower_bound():
    records = [_record("trl_defaults", 0, 1000.0, [(1, -2000), (30, -1500)]),  # never reaches -1000
               _record("spg4", 0, 2000.0, [(1, -2000), (10, -900)]),
               _record("spg2", 0, 1500.0, [(1, -2000), (20, -1900)])]
    summary = race.summarize(records)
    g = summary["lr=0.0005"]
    assert g["configs"]["spg4"]["time_to_reward_speedup_per_seed"] == [None]
    assert g["configs"]["spg4"]["time_to_reward_speedup_at_least_per_seed"] == [3.0]  # 30 s of defaults / 10 s
    rows = {r["configuration"]: r for r in race.table({"summary": {"qwen2.5-1.5b": summary}})}
    assert rows["spg4"]["× defaults (time)"] == "≥ 3.00"
    assert rows["spg2"]["× defaults (time)"] == "not reached"


def test_a_seed_the_defaults_did_not_run_gets_no_time_ratio():
    """7B at 0cfd418: the defaults' seed 1 ran out of memory, the recipe's seed 1 reached the threshold."""
    records = [_record("trl_defaults", 0, 1000.0, [(1, -2000), (30, -1500)]),  # never reaches -1000
               _record("recipe", 0, 1100.0, [(1, -2000), (30, -1600)]),
               _record("recipe", 1, 1100.0, [(1, -2000), (12, -700)])]
    table = race.table({"summary": {"qwen2.5-1.5b": race.summarize(records + [
        _record("spg8", 0, 1500.0, [(1, -2000), (20, -1900)])])}})
    # the defaults, then the recipe, then the chain's knobs: pandas hides a long race's middle rows, never these two
    assert [r["configuration"] for r in table] == ["trl_defaults", "recipe", "spg8"]
    rows = {r["configuration"]: r for r in table}
    assert rows["recipe"]["× defaults (time)"] == "not reached / no defaults run"
    assert rows["recipe"]["time to threshold s"] == "not reached / 12.0"


def _planner_errors() -> list[tuple]:
    """The newest seed-0 record of each configuration and model against the planner's peak for the settings that
    record ran with (the runs named `recipe` ran the recipe of their day). Only the newest: batch32 at 15a2adc
    ran before the one-call push joined the chain, at learning rate 5e-3, and peaked 19 GiB under its f024d00 run."""
    result = json.loads(RESULT.read_text())
    newest = {}
    for rec in result["records"]:
        if rec["seed"] == 0 and rec["nvml_peak_gib"]:
            newest[(rec["config"], rec["model"])] = rec  # merges append: the last one is the newest
    out = []
    for (config, model), rec in newest.items():
        pred = speed.planner_estimate_for_record(rec)["peak_gib_per_gpu"]
        out.append((config, model, rec.get("commit"), pred, rec["nvml_peak_gib"], pred / rec["nvml_peak_gib"] - 1))
    return out


# Where the planner misses by more than 10%, and why. CISPO at batch 32 holds the same tensors as batch 32 under
# TRL's default loss (PyTorch's allocated peak 98.4 GiB in both), but its caching allocator reserved 5.1-5.4 GiB above
# them where the default loss's runs reserved 21-24: the reserve is not a function of the settings alone (cispo_b16's
# four seeds reserved 2.9-12.2 GiB), and the planner's median overshoots, on the safe side.
PLANNER_MISSES = {("cispo_b32", "qwen2.5-1.5b")}


def test_committed_h200_peaks_are_within_10pct_of_the_planner_now():
    """Every configuration run on one H200, batch 32 without activation recomputing included, its NVML peak out of
    sample: the planner's allocator reserve comes from PyTorch's own peaks, not from these NVML peaks. The prediction
    is recomputed from the planner as it is now, not read back from the file. A miss in PLANNER_MISSES is over, on
    the safe side, by at most 20%."""
    errors = _planner_errors()
    assert len(errors) >= 15 and {"batch32", "batch32_on_policy", "cispo_b16"} <= {e[0] for e in errors}
    hits = [e for e in errors if (e[0], e[1]) not in PLANNER_MISSES]
    assert all(abs(e[-1]) <= 0.10 for e in hits), [e for e in hits if abs(e[-1]) > 0.10]
    assert all(0 < e[-1] <= 0.20 for e in errors if (e[0], e[1]) in PLANNER_MISSES)


@pytest.mark.xfail(strict=True, reason="owed: the planner within 10% of cispo_b32's NVML peak (122.7 GiB predicted, "
                                       "105.2 measured at e271166): its allocator reserve was 5.1 GiB where batch 32 "
                                       "under TRL's default loss reserved 21-24; a race with PyTorch's "
                                       "expandable_segments allocator, which should shrink the reserve everywhere, or a "
                                       "reserve term that sees the difference, is owed")
def test_the_planner_misses_are_within_10pct():
    assert all(abs(e[-1]) <= 0.10 for e in _planner_errors() if (e[0], e[1]) in PLANNER_MISSES)


def test_the_planners_tensors_and_reserve_each_match_pytorchs_own_peaks():
    """The two halves of the planner's training peak, each against what PyTorch itself reported in the same run:
    its tensors (everything but the allocator's reserve) against `max_memory_allocated`, within 10%; the reserve
    against `max_memory_reserved` minus that, within 6 GiB of the range reserved by every seed the planner cannot
    tell apart from it (the same model and training estimate, any race or name): the reserve is not a function of
    the settings alone, since CISPO at batch 16 reserved 2.7-3.1 GiB in seven seeds and 12.2 in one, where batch 32
    under TRL's loss reserved 21-24 GiB and batch 8 3-6. PLANNER_MISSES are left to their strict xfail."""
    result = json.loads(RESULT.read_text())
    # a sleeping engine's memory comes from vLLM's own pool, which PyTorch's counters see while it is awake (sleep_l2
    # at 2f0b343: 70.8 GiB "allocated" against 60.9 NVML): its training half cannot be read from them, so sleep runs
    # are judged by NVML alone (planner_error_seed0)
    recs = [r for r in result["records"] if r.get("torch_peak_gib") and not r["grpo_config"].get("vllm_enable_sleep_mode")]
    assert len({(r["config"], r["model"]) for r in recs}) >= 8
    trainings = [speed.planner_estimate_for_record(r)["parts"]["training"] for r in recs]
    alike = [(r["model"], tuple(sorted((k, round(v, 3)) for k, v in t.items()))) for r, t in zip(recs, trainings)]
    seen: dict = {}
    for r, key in zip(recs, alike):
        seen.setdefault(key, []).append(r["torch_peak_gib"]["reserved"] - r["torch_peak_gib"]["allocated"])
    assert max(len(v) for v in seen.values()) >= 8  # the recipe's records and cispo_b16's are one group
    for r, training, key in zip(recs, trainings, alike):
        reserve = training["allocator_reserve"]
        tensors = sum(v for k, v in training.items() if k not in ("allocator_reserve", "vllm"))
        allocated = r["torch_peak_gib"]["allocated"]
        # NVML also sees vLLM's share and the CUDA context, which PyTorch's counters do not
        assert abs((tensors - training["cuda_context_nccl"]) / (allocated - training["vllm"]) - 1) <= 0.10, \
            (r["config"], r["model"], tensors, allocated)
        if (r["config"], r["model"]) in PLANNER_MISSES:
            continue
        spread = seen[key]
        assert min(spread) - 6 <= reserve <= max(spread) + 6, (r["config"], r["model"], reserve, spread)


def test_the_allocator_reserve_is_the_median_of_pytorchs_own_ratios():
    import statistics

    from colo_kit.memory import planner
    from record import planner_validation

    ratios = [r["ratio"] for r in planner_validation.reserve_ratios()]
    assert len(ratios) >= 20
    assert planner.FITTED["ALLOCATOR_RESERVE"] == pytest.approx(round(statistics.median(ratios) / 0.05) * 0.05)


def test_committed_generation_latency_has_raw_times_hardware_and_versions():
    import statistics

    result = json.loads((REPO_ROOT / "results" / "gen_latency_1xh200.json").read_text())
    for name, v in result["variants"].items():  # each variant names the machine it ran on, or the note says why not
        if v["env"] is None:
            assert v["commit"] in result["note"], name
            continue
        assert v["env"]["gpus"][0]["name"] == "NVIDIA H200"
        assert v["env"]["versions"]["vllm"] and v["env"]["versions"]["trl"] == "1.16.0"
    runs = [r for v in result["variants"].values() for r in v.get("runs", [])]
    assert len(runs) >= 5
    for r in runs:
        assert len(r["seconds"]) == result["reps"]
        assert r["median_s"] == pytest.approx(statistics.median(r["seconds"]), abs=1e-3)
    rows = speed.latency_table(result)
    assert len(rows) == len(runs)
    assert {r["sampling"] for r in rows} >= {"TRL's (logprobs=0, detokenize=False)", "logprobs=None"}


def test_committed_chain_has_raw_step_times_hardware_and_versions():
    result = json.loads(RESULT.read_text())
    for rec in result["records"]:
        assert len(rec["step_times_s"]) == rec["steps_done"] > 10
    for part in result["parts"]:
        assert part["env"]["gpus"][0]["name"] == "NVIDIA H200"
        assert part["env"]["versions"]["trl"] == "1.16.0"


def test_a_switch_counts_each_part_as_often_as_it_comes_per_push():
    """TRL wakes a level-2 engine twice per switch (weights, then KV cache): its wake-up median counts twice."""
    parts = {"weight_sync": {"n": 10, "median_s": 0.06}, "sleep": {"n": 10, "median_s": 0.03},
             "wake_up": {"n": 20, "median_s": 0.02}}
    assert speed.switch_total(parts) == pytest.approx(0.06 + 0.03 + 2 * 0.02)
    assert speed.switch_total({"weight_sync": {"n": 5, "median_s": 0.02}}) == pytest.approx(0.02)
    assert speed.switch_total({"sleep": {"n": 3, "median_s": 0.01}, "wake_up": {"n": 6, "median_s": 0.02}}) == \
        pytest.approx(0.03)  # no push to count by: each part once


def test_committed_in_trainer_generation_times_say_what_the_notebook_says():
    """`scripts/gpu/gen_in_trainer.py`: the garbage collector's pauses are under 3% of each generation (what
    notebook 04 says: most of it is vLLM's own per-token work), and each generation made 128 x ~256 tokens."""
    result = json.loads((REPO_ROOT / "results" / "gen_in_trainer_1xh200.json").read_text())
    assert result["env"]["gpus"][0]["name"] == "NVIDIA H200" and result["config"] == "recipe"
    on, off = result["modes"]["on"]["calls"], result["modes"]["off"]["calls"]
    assert all(c["prompts"] == 128 and c["tokens"] > 0.95 * 128 * 256 for c in on + off)
    assert max(c["gc_pause_s"] / c["seconds"] for c in on) < 0.03
    assert all(c["gc_pause_s"] == 0 for c in off)
    assert result["modes"]["on"]["profile"]["call"] == 2


@pytest.mark.parametrize("model", ["qwen2.5-1.5b", "qwen2.5-7b"])
def test_the_recipe_row_notebook_04_shows_ran_the_recipe_plan_recommend_writes(model):
    """Notebook 04's speed table (the race record.lessons shows: the newest that ran TRL's defaults) has a row named
    `recipe`, "colo-kit plan --recommend": the records behind it ran the GRPOConfig that command writes for the model
    now, and the table shows their seeds."""
    result = json.loads(RESULT.read_text())
    rows = race.table(result, model)
    shown = next(r for r in rows if r["configuration"] == "trl_defaults")
    key = (shown["learning rate"], shown["s per seed"], shown["ran at"])
    (row,) = [r for r in rows if r["configuration"] == speed.RECIPE
              and (r["learning rate"], r["s per seed"], r["ran at"]) == key]
    ran = [r for r in result["records"] if r["model"] == model and r["config"] == speed.RECIPE
           and r.get("commit") == key[2] and f"{r['grpo_config'].get('learning_rate'):g}" == key[0]]
    assert ran and row["seeds"] == ", ".join(str(r["seed"]) for r in sorted(ran, key=lambda r: r["seed"]))
    # the record keeps generation_kwargs beside grpo_config, and the training dtype every 7B configuration shares
    # (model_init_kwargs) is the race's, checked by test_7b_races_in_bfloat16_...
    fields, _ = speed.config(speed.RECIPE, model)
    compared = {k: v for k, v in fields.items() if k not in ("generation_kwargs", "model_init_kwargs")}
    for r in ran:
        assert {k: r["grpo_config"].get(k) for k in compared} == compared, (model, r["seed"])


def test_notebook_04s_chain_table_stays_when_a_newer_race_ran_only_the_defaults_and_the_recipe():
    """A race of many seeds of TRL's defaults and the recipe (the seed spread notebook 04 charts) is newer than the
    race of knobs one at a time; the chain table keeps showing the knobs, the plain newest race is the seeds'."""
    import copy

    from record.lessons import current_race

    result = json.loads(RESULT.read_text())
    races = result["summary"]["qwen2.5-1.5b"]
    chain_key = next(k for k, g in reversed(races.items()) if set(g["configs"]) - {"trl_defaults", speed.RECIPE}
                     and "trl_defaults" in g["configs"])
    seeds = copy.deepcopy(races[chain_key])
    seeds["configs"] = {k: v for k, v in seeds["configs"].items() if k in ("trl_defaults", speed.RECIPE)}
    seeds["race"]["commit"] = "newer"
    races["a newer race of seeds"] = seeds  # merges append: the last race is the newest
    shown = {r["configuration"] for r in current_race(result)}
    chain = {r["configuration"] for r in current_race(result, knobs=True)}
    assert shown == {"trl_defaults", speed.RECIPE}
    assert chain == set(races[chain_key]["configs"]) and len(chain) > 2


def test_the_h200_seed_chart_reads_the_newest_race_of_only_the_defaults_and_the_recipe():
    """Notebook 04's H200 seed chart: the newest race that ran TRL's defaults and the recipe and nothing else, every
    seed of it, summarized again from its records (the file's own summary predates the spreads)."""
    import copy
    import statistics

    from record.lessons import seeds_over
    from record.race import seeds_race

    result = json.loads(RESULT.read_text())
    races = result["summary"]["qwen2.5-1.5b"]
    key = seeds_race(result)
    assert set(races[key]["configs"]) == {"trl_defaults", speed.RECIPE}
    # a newer race that ran a knob as well is not a race of seeds; a newer one of only the two is
    with_knob, of_seeds = copy.deepcopy(result), copy.deepcopy(result)
    with_knob["summary"]["qwen2.5-1.5b"]["newer, with a knob"] = copy.deepcopy(
        next(g for g in races.values() if set(g["configs"]) - {"trl_defaults", speed.RECIPE}))
    of_seeds["summary"]["qwen2.5-1.5b"]["newer, of seeds"] = copy.deepcopy(races[key])
    assert seeds_race(with_knob) == key and seeds_race(of_seeds) == "newer, of seeds"
    shown = seeds_over(result, key=key)
    assert shown["race"] == key.split(", at ")[0]
    for name, c in shown["configs"].items():
        ran = sorted(r["seed"] for r in result["records"] if r["config"] == name and race.race(r) == key)
        assert c["seeds"] == ran and len(c["curves"]) == len(ran)
        reached = [t for t in c["time_to_reward_s"] if t is not None]
        if len(reached) == len(ran):  # every seed got there: the median is the plain one
            assert c["median_s"] == pytest.approx(statistics.median(reached), abs=0.01)


def test_the_recipe_below_7b_is_cispo_on_8_steps_per_generation_with_vllm_sized_for_the_task():
    """The recipe at 1.5B is cispo_b16 (CISPO, 8 steps per generation, batch 16) with vLLM sized for the task's
    longest prompt plus the completion, where cispo_b16 keeps TRL's default (the model's own limit)."""
    assert speed.config("recipe")[0] == {**speed.config("cispo_b16")[0], "vllm_gpu_memory_utilization": 0.3,
                                         "vllm_max_model_length": 96 + 256,
                                         "vllm_enable_sleep_mode": False, "vllm_tensor_parallel_size": 1,
                                         "vllm_importance_sampling_correction": True,
                                         "vllm_importance_sampling_mode": "sequence_mask",
                                         "vllm_importance_sampling_clip_max": 3.0}


@pytest.mark.slow
def test_speed_smoke_runs_the_chain_on_cpu(tmp_path):
    from conftest import clean_env

    out = tmp_path / "speed_smoke.json"
    # clean_env: without the MASTER_PORT pytest's own process groups leave in its environment, each seed's process
    # gets a free rendezvous port from TRL; with it, two seeds one after the other bound one port (EADDRINUSE)
    env = {**clean_env(), "PY": sys.executable, "SPEED_RESULT": str(out), "SPEED_BUDGET_S": "8",
           "SPEED_CONFIGS": "trl_defaults:0,1 spg8:0", "TMPDIR": str(tmp_path), "OUT": ""}
    proc = subprocess.run(["bash", "scripts/gpu/speed.sh", "--smoke"], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    recs = {r["config"]: r for r in result["records"]}
    assert set(recs) == {"trl_defaults", "spg8"}
    # "0,1" is two seeds, each in a process of its own (speed.sh), both merged into one result
    assert sorted(r["seed"] for r in result["records"] if r["config"] == "trl_defaults") == [0, 1]
    assert len(result["parts"]) == 3
    # spg8 is the chain up to it: the bucketed push included
    assert recs["spg8"]["bucketed_push_applied"] and recs["spg8"]["push_calls"] >= 2
    assert recs["trl_defaults"]["push_calls"] is None   # TRL's own push ran there
    assert recs["spg8"]["steps_per_generation"] == 8
    assert recs["spg8"]["steady"]["completion_tokens_per_s"] > 0
    assert all(r["rows"] and r["rows"][0]["reward"] < 0 for r in recs.values())


@pytest.mark.slow
def test_gen_in_trainer_runs_on_cpu_and_switches_the_collector_off(tmp_path):
    """`scripts/gpu/gen_in_trainer.py`'s CPU path (tiny model, the recipe, 16-token completions): it wraps
    `vllm.LLM.generate` inside TRL's trainer; with the collector off only explicit `gc.collect()` calls (one per
    generation here, none on the H200) run inside a generation, against a dozen or more automatic ones with it on."""
    from conftest import clean_env

    out = tmp_path / "gen_in_trainer.json"
    proc = subprocess.run([sys.executable, "scripts/gpu/gen_in_trainer.py", "--model", "tiny", "--config", "recipe",
                           "--budget-s", "6", "--max-completion-length", "16", "--out", str(out)],
                          cwd=REPO_ROOT, env=clean_env(), capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    modes = json.loads(out.read_text())["modes"]
    on, off = modes["on"].get("calls"), modes["off"].get("calls")
    assert on and off, (modes["on"].get("error"), modes["off"].get("error"))
    assert all(c["prompts"] == 128 and 0 < c["tokens"] <= 128 * 16 for c in on + off)
    collections = [sum(c["gc_collections"].values()) for c in on], [sum(c["gc_collections"].values()) for c in off]
    assert max(collections[1]) <= 2 < min(collections[0]), collections


# -- the speed knobs inside TRL's trainer, on a GPU (and the bucketed push on a CPU, where its load is vLLM's layer-wise reload)

def _short_run(tmp_path, **kw):
    from colo_kit.grpo.train import run_grpo

    return run_grpo("tiny", "colocate", max_steps=4, num_generations=4, per_device_train_batch_size=8, max_completion_length=16,
                    learning_rate=1e-3, output_dir=tmp_path, vllm_enforce_eager=True, **kw)


def _gap(run) -> float:
    return max(s.get("sampling/sampling_logp_difference/mean", 0.0) for s in run.steps)


@pytest.mark.slow
def test_bucketed_push_keeps_vllm_on_the_trainers_weights(tmp_path):
    """A push that lost tensors would leave vLLM sampling from old weights: TRL's own log-prob gap between
    vLLM and the trainer (sampling/sampling_logp_difference) would grow step by step (notebook 00's exercise)."""
    run = _short_run(tmp_path, push_bucket_mb=0)
    assert run.settings["bucketed_push"] is True
    assert run.trainer.vllm_generation.push_calls >= 3  # one per optimizer step after the first
    assert _gap(run) < 0.05, [s.get("sampling/sampling_logp_difference/mean") for s in run.steps]


_KV_ONLY_RUN = """
import json, sys
import colo_kit
colo_kit.setup()
from colo_kit.colocate.kv_sleep import engine_core
from colo_kit.grpo.train import run_grpo
run = run_grpo("tiny", "colocate", max_steps=4, num_generations=4, per_device_train_batch_size=8,
               max_completion_length=16, learning_rate=1e-3, output_dir=sys.argv[1], vllm_enforce_eager=True,
               push_bucket_mb=0, vllm_enable_sleep_mode=True, kv_only_sleep=True)
print("RESULT", json.dumps({
    "kv_only_sleep": run.settings["kv_only_sleep"],
    "sleeping_tags": sorted(engine_core(run.trainer.vllm_generation.llm).model_executor.sleeping_tags),
    "gaps": [s.get("sampling/sampling_logp_difference/mean", 0.0) for s in run.steps]}))
"""


@pytest.mark.gpu
def test_kv_only_sleep_inside_trls_trainer_keeps_vllm_on_the_trainers_weights(tmp_path):
    # In a process of its own: vLLM's sleep-mode allocator serves one engine per process, and the trainer's engine
    # lives as long as the run, so in pytest's process it would refuse test_sleep's engines after it.
    proc = subprocess.run([sys.executable, "-c", _KV_ONLY_RUN, str(tmp_path)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert got["kv_only_sleep"] is True
    assert got["sleeping_tags"] == ["kv_cache"]  # after the last generation: asleep, weights kept
    assert max(got["gaps"]) < 0.05, got["gaps"]


# --- the race's recipe is the one for the GPU it runs on; time to the threshold over seeds ---

def test_the_races_recipe_is_the_recipe_for_the_gpu_it_runs_on():
    """On an H100 (79.1 GiB) and an H200 `recipe` is cispo_b16 at TRL's 0.3 share with PyTorch's expandable segments
    (a knob of the race's: an environment variable); on a 48 GB card the engine is sized to one generation. The chain
    and its side configurations do not depend on the GPU. A record keeps the GPU memory it ran on, and the planner's
    peak for it is computed there (an H200 for records older than that field)."""
    from colo_kit.memory.recipe import recipe

    h100, knobs = speed.config(speed.RECIPE, "qwen2.5-1.5b", 79.1)
    h200, _ = speed.config(speed.RECIPE, "qwen2.5-1.5b")
    assert h100 == h200 and h100["vllm_gpu_memory_utilization"] == 0.3
    assert knobs == {"push_bucket_mb": 0, "expandable_segments": True}
    assert speed.config(speed.RECIPE, "qwen2.5-1.5b", 47.5)[0]["vllm_gpu_memory_utilization"] < 0.3
    assert {k: h100[k] for k in speed.config("cispo_b16")[0]} == speed.config("cispo_b16")[0]
    written = {k: v for k, v, _ in recipe(model="qwen2.5-1.5b", gpu_mem_gib=79.1, per_device_train_batch_size=8,
                                          max_completion_length=256)["fields"]}
    assert all(written[k] == v for k, v in h100.items())
    assert speed.config("spg8", "qwen2.5-1.5b", 79.1) == speed.config("spg8")
    rec = {"model": "qwen2.5-1.5b", "kit_knobs": knobs, "gpu_mem_gib": 79.1,
           "grpo_config": {**h100, "max_completion_length": 256}}
    assert speed.planner_estimate_for_record(rec)["settings"]["gpu_mem_gib"] == 79.1
    assert speed.planner_estimate_for_record({**rec, "gpu_mem_gib": None})["settings"]["gpu_mem_gib"] == 139.8
    assert speed.planner_peak_for(speed.RECIPE, "qwen2.5-1.5b", 256, 79.1) == \
        speed.planner_estimate_for_record(rec)["peak_gib_per_gpu"]


def test_speed_sh_names_its_result_after_the_gpu(tmp_path):
    """`speed.sh` on an H100 writes results/speed_1xh100.json, beside the H200's (nvidia-smi stood in for here)."""
    for name, tag in (("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100")):
        fake = tmp_path / tag / "nvidia-smi"
        fake.parent.mkdir()
        fake.write_text(f"#!/bin/sh\necho '{name}'\n")
        fake.chmod(0o755)
        env = {"PATH": f"{fake.parent}:/usr/bin:/bin", "SPEED_CONFIGS": " ", "TMPDIR": str(tmp_path), "OUT": ""}
        proc = subprocess.run(["bash", "scripts/gpu/speed.sh"], cwd=REPO_ROOT, env=env, capture_output=True,
                              text=True, timeout=60)
        assert f"== result: results/speed_1x{tag}.json ({name})" in proc.stdout, proc.stdout + proc.stderr


def test_time_to_the_threshold_over_seeds_is_a_median_and_a_range():
    spread = race.seed_spread([40.0, 27.6, 69.5, 33.0, 51.0])
    assert spread == {"median_s": 40.0, "range_s": [27.6, 69.5], "reached": "5 of 5", "slowest_over_fastest": 2.52}
    # a seed that never reached the threshold is slower than any that did: it moves the median, and the range is open
    assert race.seed_spread([10.0, None, 30.0]) == {"median_s": 30.0, "range_s": [10.0, None], "reached": "2 of 3",
                                                    "slowest_over_fastest": None}
    assert race.seed_spread([10.0, None, None])["median_s"] is None
    assert race.seed_spread([None])["range_s"] == [None, None]


def test_the_summary_gives_each_configuration_its_median_beside_the_defaults_spread():
    base = [(1, -200.0), (2, -200.0)]
    records = [_record("trl_defaults", s, 100.0, base + [(t, -60.0)]) for s, t in enumerate([20, 40, 60, 30, 50])]
    records += [_record(speed.RECIPE, s, 400.0, base + [(t, -60.0)]) for s, t in enumerate([10, 12, 30, 14, 11])]
    (summary,) = race.summarize(records).values()
    rec = summary["configs"][speed.RECIPE]
    assert rec["time_to_reward_over_seeds"]["median_s"] == 12.0
    assert rec["defaults_time_to_reward_over_seeds"] == summary["configs"]["trl_defaults"]["time_to_reward_over_seeds"]
    assert rec["defaults_time_to_reward_over_seeds"]["median_s"] == 40.0
    assert rec["time_to_reward_median_vs_defaults"] == round(40.0 / 12.0, 2)
    assert rec["tokens_per_s_vs_defaults"] == 4.0


H100_RESULT = REPO_ROOT / "results" / "speed_1xh100.json"


def test_the_h100_race_ran_the_recipe_for_an_h100_over_at_least_five_seeds_each():
    """results/speed_1xh100.json: every record names the H100 it ran on; in each race the `recipe` seeds ran one
    recipe (the one `plan --recommend` wrote for 79.1 GiB at that commit), and the summary gives each configuration's
    time to the threshold as a median and range over at least five seeds, the defaults' beside it."""
    result = json.loads(H100_RESULT.read_text())
    assert all("H100" in r["gpu"] and r["gpu_mem_gib"] == 79.1 for r in result["records"])
    races = result["summary"]["qwen2.5-1.5b"]
    assert races
    for name, summary in races.items():
        ran = [r for r in result["records"] if r["config"] == speed.RECIPE and race.race(r) == name]
        configs = {json.dumps({k: v for k, v in r["grpo_config"].items() if k != "seed"}, sort_keys=True) for r in ran}
        assert len(configs) == 1, name
        for config in ("trl_defaults", speed.RECIPE):
            row = summary["configs"][config]
            assert len(row["seeds"]) >= 5
            assert row["time_to_reward_over_seeds"] == race.seed_spread(row["time_to_reward_s"])
            assert row["defaults_time_to_reward_over_seeds"] == summary["configs"]["trl_defaults"][
                "time_to_reward_over_seeds"]


def test_the_planner_is_within_10pct_of_every_h100_peak_of_the_newest_race():
    """Out of sample: every configuration of the newest H100 race of each model (1.5B: TRL's defaults and the recipe
    with expandable segments, whose reserve term was set before that race; 7B: the recipe and the defaults with sleep)
    against the planner for the settings each seed ran. The older race's recipe ran PyTorch's default allocator, whose
    reserve landed at 2.6-3.0 GiB in some seeds and 12.0-12.2 in others: no single prediction is within 10% of both,
    which is why the recipe now sets expandable segments."""
    result = json.loads(H100_RESULT.read_text())
    checked = set()
    for model, races in result["summary"].items():
        newest = next(reversed(races))
        for r in result["records"]:
            if r["model"] == model and race.race(r) == newest:
                error = speed.planner_estimate_for_record(r)["peak_gib_per_gpu"] / r["nvml_peak_gib"] - 1
                assert abs(error) <= 0.10, (model, r["config"], r["seed"], error)
                checked.add((model, r["config"]))
    assert {("qwen2.5-1.5b", "trl_defaults"), ("qwen2.5-1.5b", "recipe"), ("qwen2.5-7b", "recipe")} <= checked
