"""colo_kit.memory.recipe / `colo-kit plan --recommend`: GRPOConfig fields in TRL's names that TRL's own parser loads,
each with its reason, sized by the planner; its predicted peak against the H200 run of the same settings."""

import json
from dataclasses import fields

import pytest

from colo_kit.paths import REPO_ROOT
from record import race
from colo_kit.memory.planner import SAFE_FRACTION
from colo_kit.memory.recipe import recipe, to_yaml


def _parse(tmp_path, text):
    from trl import GRPOConfig, TrlParser

    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    (config,) = TrlParser((GRPOConfig,)).parse_args_and_config(
        ["--config", str(path), "--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false"])
    return config


@pytest.mark.parametrize("settings", [dict(model="qwen2.5-1.5b"), dict(model="qwen2.5-7b"),
                                      dict(model="qwen2.5-72b", gpus=8, zero_stage=3, offload_optimizer=True),
                                      dict(model="qwen2.5-1.5b", gpu_mem_gib=40.0, per_device_train_batch_size=16),
                                      dict(model="qwen2.5-7b", train_dtype="bfloat16")])
def test_trls_parser_loads_every_field_with_its_reason(settings, tmp_path):
    from trl import GRPOConfig

    r = recipe(**settings)
    assert r["fits"]
    text = to_yaml(r)
    config = _parse(tmp_path, text)
    names = {f.name for f in fields(GRPOConfig)}
    lines = text.splitlines()
    for name, value, why in r["fields"]:
        assert name in names
        if name != "bf16":  # the command line above turns bf16 off, as the kit does on a CPU
            assert getattr(config, name) == value or (name == "steps_per_generation" and value is None)
        at = next(i for i, line in enumerate(lines) if line.startswith(f"{name}:"))
        assert lines[at - 1].startswith("# ") and len(why) > 10  # the reason sits right above its field
    assert r["peak_gib_per_gpu"] <= SAFE_FRACTION * r["plan"].gpu_mem_gib


def test_speed_choices_follow_what_fits():
    roomy = dict(recipe(model="qwen2.5-1.5b")["fields"] and {k: v for k, v, _ in recipe(model="qwen2.5-1.5b")["fields"]})
    assert roomy["gradient_checkpointing"] is False and roomy["vllm_enable_sleep_mode"] is False
    assert roomy["vllm_gpu_memory_utilization"] == 0.3
    # below 7B: one generation for 8 steps under CISPO, at a batch of at least 16 (cispo_b16 in the H200 race)
    assert (roomy["steps_per_generation"], roomy["loss_type"], roomy["epsilon_high"]) == (8, "cispo", 5.0)
    assert roomy["per_device_train_batch_size"] == 16
    assert {k: v for k, v, _ in recipe(model="qwen2.5-1.5b", per_device_train_batch_size=32)["fields"]}[
        "per_device_train_batch_size"] == 32  # a bigger batch of the learner's own is kept
    # a 40 GiB GPU cannot hold 1.5B's fp32 training state, activations of batch 16 and a 0.3 engine at once
    tight = {k: v for k, v, _ in recipe(model="qwen2.5-1.5b", gpu_mem_gib=40.0, per_device_train_batch_size=16)["fields"]}
    assert tight["vllm_gpu_memory_utilization"] != 0.3 or tight["vllm_enable_sleep_mode"] \
        or tight["gradient_checkpointing"]


def test_the_recipe_shares_a_generation_between_two_steps_from_7b_up(tmp_path):
    """CISPO on 8 steps per generation below 7B, steps_per_generation=2 under TRL's loss from 7B up, as TRL reads
    the YAML; and the 7B races in
    results/speed_1xh200.json say what the reason says: nine of twelve on-policy seeds never reached the
    threshold, nine of ten seeds with 2 did. A seed is counted by the steps_per_generation it ran with, not by
    its configuration's name: the runs named `recipe` were on-policy until the recipe changed."""
    small = {k: v for k, v, _ in recipe(model="qwen2.5-1.5b")["fields"]}
    big = recipe(model="qwen2.5-7b", train_dtype="bfloat16")
    assert small["steps_per_generation"] == 8 and small["loss_type"] == "cispo"
    config = _parse(tmp_path, to_yaml(big))
    assert config.steps_per_generation == 2 and config.loss_type == "dapo"
    assert config.generation_batch_size == 2 * config.per_device_train_batch_size
    why = next(w for k, _, w in big["fields"] if k == "steps_per_generation")
    assert "nine of twelve" in why and "nine of ten" in why

    result = json.loads((REPO_ROOT / "results" / "speed_1xh200.json").read_text())
    reached: dict = {}
    for rec in (r for r in result["records"] if r["model"] == "qwen2.5-7b"):
        target = result["summary"]["qwen2.5-7b"][race.race(rec)]["threshold"]["reward"]
        kind = rec["grpo_config"].get("steps_per_generation") or 1
        reached.setdefault(kind, []).append(race.time_to_reward(rec, target) is not None)
    assert set(reached) == {1, 2}
    assert (len(reached[1]), sum(reached[1])) == (12, 3)
    assert (len(reached[2]), sum(reached[2])) == (10, 9)


def test_a_recipe_sized_for_bfloat16_tells_trl_to_load_bfloat16(tmp_path):
    """TRL loads a model given by path in float32 unless `model_init_kwargs` says otherwise: a recipe sized for
    bfloat16 weights that did not say so would run with twice the training state the planner counted."""
    bf16 = recipe(model="qwen2.5-7b", train_dtype="bfloat16")
    assert _parse(tmp_path, to_yaml(bf16)).model_init_kwargs == {"dtype": "bfloat16"}
    fp32 = recipe(model="qwen2.5-7b")
    assert "model_init_kwargs" not in {k for k, _, _ in fp32["fields"]}
    # bfloat16 trains beside an awake engine on one H200; float32's training state needs the engine's memory while
    # it trains (a plan at 92% of the GPU: modelled, not run)
    assert bf16["plan"].zero_stage == 0 and bf16["plan"].sleep_level == 0
    assert fp32["plan"].sleep_level == 2 or fp32["plan"].zero_stage == 3


def test_server_mode_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="colocate mode"):
        recipe(model="qwen2.5-1.5b", mode="server")


def test_recipe_peak_is_within_10pct_of_the_h200_run_of_its_settings():
    """The recipe for 1.5B on one H200 is the race's `cispo_b16` configuration (batch 16, 8 steps per generation,
    CISPO, no checkpointing, u 0.3, no sleep, one-call push): its seed-0 NVML peak, measured, against the recipe's
    prediction."""
    from record import speed

    r = recipe(model="qwen2.5-1.5b", per_device_train_batch_size=8, max_completion_length=256)
    chosen = {k: v for k, v, _ in r["fields"]}
    race_fields = speed.config("cispo_b16")[0]
    assert all(chosen[k] == v for k, v in race_fields.items()), race_fields
    assert (chosen["gradient_checkpointing"], chosen["vllm_gpu_memory_utilization"], chosen["vllm_enable_sleep_mode"]) \
        == (False, 0.3, False)
    result = json.loads((REPO_ROOT / "results" / "speed_1xh200.json").read_text())
    peaks = [rec["nvml_peak_gib"] for rec in result["records"]
             if rec["config"] == "cispo_b16" and rec["seed"] == 0]
    assert peaks
    for peak in peaks:
        assert abs(r["peak_gib_per_gpu"] / peak - 1) <= 0.10, (r["peak_gib_per_gpu"], peak)


def test_plan_recommend_prints_the_peak_and_writes_where_told(tmp_path, capsys):
    from colo_kit.cli import main

    out = tmp_path / "r.yaml"
    assert main(["plan", "--model", "qwen2.5-1.5b", "--recommend", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "predicted peak" in printed and out.read_text() in printed
    assert main(["plan", "--model", "qwen2.5-1.5b", "--recommend", "--mode", "server"]) == 2
