"""The memory planner, its validation against measured NVML peaks, the ZeRO-3 configs and the GPU run script."""

import json
import subprocess
import sys

import pytest

from colo_kit.memory import planner
from record import planner_validation
from colo_kit.models import PRESETS, qwen2_config
from colo_kit.paths import REPO_ROOT
from colo_kit.memory.planner import GIB, Plan, estimate, model_shape, recommend
from colo_kit.memory.recipes import deepspeed_config, write_configs

ISSUE_EXAMPLE = ["--model", "qwen2.5-1.5b", "--gpus", "2", "--gpu-mem-gib", "141", "--mode", "colocate",
                 "--vllm-gpu-memory-utilization", "0.3", "--sleep-level", "2", "--per-device-train-batch-size", "64",
                 "--prompt-length", "96", "--max-completion-length", "256", "--zero-stage", "0", "--json"]


def plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "colo_kit", "plan", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=120)


# ---- shapes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, billions", [("qwen2.5-0.5b", 0.494), ("qwen2.5-1.5b", 1.544),
                                            ("qwen2.5-7b", 7.616), ("qwen2.5-72b", 72.706)])
def test_parameter_counts_match_the_released_models(name, billions):
    assert model_shape(name).num_params() / 1e9 == pytest.approx(billions, rel=1e-3)


def test_an_hf_config_json_gives_the_same_shape_as_the_preset(tmp_path):
    qwen2_config(PRESETS["qwen2.5-7b"]).to_json_file(tmp_path / "config.json")
    from_file = estimate(model=str(tmp_path), gpus=2, zero_stage=3)
    from_preset = estimate(model="qwen2.5-7b", gpus=2, zero_stage=3)
    assert from_file["params_b"] == from_preset["params_b"]
    assert from_file["peak_gib_per_gpu"] == from_preset["peak_gib_per_gpu"]


DENSE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "vocab_size": 100}


def test_a_multimodal_config_gives_its_text_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava",
                                                      "text_config": {"model_type": "qwen2", **DENSE}}))
    m = model_shape(str(tmp_path))
    assert (m.name, m.hidden_size, m.num_hidden_layers, m.num_key_value_heads, m.vocab_size) == (tmp_path.name, 64, 2, 2, 100)


def test_a_config_transformers_does_not_know_still_gives_its_shape():
    m = model_shape({"model_type": "not-in-transformers", **DENSE})
    assert (m.name, m.hidden_size, m.num_key_value_heads, m.tie_word_embeddings) == ("not-in-transformers", 64, 2, False)


def test_a_config_without_kv_heads_has_one_per_head():
    no_kv = {k: v for k, v in DENSE.items() if k != "num_key_value_heads"}
    assert model_shape({"model_type": "qwen2", **no_kv}).num_key_value_heads == 4  # not Qwen2Config's default 32
    assert model_shape(no_kv).num_key_value_heads == 4


@pytest.mark.parametrize("config, words", [
    # Qwen2Config would fill hidden_size=4096: the file's own fields decide
    ({"model_type": "qwen2", **{k: v for k, v in DENSE.items() if k != "hidden_size"}}, "lacks ['hidden_size']"),
    ({"model_type": "llava", "text_config": {"model_type": "qwen2", **{k: v for k, v in DENSE.items() if k != "vocab_size"}}},
     "lacks ['vocab_size']"),
    ({"model_type": "qwen2", **DENSE, "hidden_size": 64.0}, "Field 'hidden_size' expected int, got float (value: 64.0)"),
    ({"model_type": "qwen2", **DENSE, "num_key_value_heads": 0}, "num_key_value_heads=0 is not a positive whole number"),
    ({**DENSE, "num_hidden_layers": True}, "num_hidden_layers=True is not a positive whole number"),
])
def test_a_bad_config_names_the_field(config, words):
    with pytest.raises(ValueError) as err:
        model_shape(config)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_missing_or_unreadable_config_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="neither a preset .* nor an HF config.json"):
        model_shape(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="neither a preset"):
        model_shape(str(tmp_path))  # a folder without config.json
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ValueError, match=r"config.json is not a readable JSON config \(Expecting property name"):
        model_shape(str(tmp_path))


# ---- the estimate ---------------------------------------------------------------------------------

def test_trl_defaults_fp32_weights_grads_and_adam_moments():
    # TRL 1.16 loads a model given by path in float32: 4 + 4 + 8 bytes per parameter.
    r = estimate(model="qwen2.5-1.5b", gpus=1)["parts"]["training"]
    P = model_shape("qwen2.5-1.5b").num_params()
    assert r["weights"] == pytest.approx(4 * P / GIB, abs=0.01)
    assert r["optimizer_states"] == pytest.approx(8 * P / GIB, abs=0.01)
    bf16 = estimate(model="qwen2.5-1.5b", gpus=1, train_dtype="bfloat16")["parts"]["training"]
    assert bf16["weights"] == pytest.approx(r["weights"] / 2, abs=0.01)


def test_without_sleep_vllm_holds_its_share_through_training_and_with_sleep_it_does_not():
    awake = estimate(model="qwen2.5-1.5b", vllm_gpu_memory_utilization=0.5, gpu_mem_gib=100, sleep_level=0)
    asleep = estimate(model="qwen2.5-1.5b", vllm_gpu_memory_utilization=0.5, gpu_mem_gib=100, sleep_level=2)
    assert awake["parts"]["training"]["vllm"] == 50.0
    assert asleep["parts"]["training"]["vllm_asleep"] == planner.VLLM_ASLEEP_GIB
    assert asleep["peak_gib_per_gpu"] < awake["peak_gib_per_gpu"]


def test_kv_only_sleep_keeps_the_engines_weights_through_training():
    level2 = estimate(model="qwen2.5-7b", vllm_gpu_memory_utilization=0.5, sleep_level=2)
    kv = estimate(model="qwen2.5-7b", vllm_gpu_memory_utilization=0.5, sleep_level=2, kv_only_sleep=True)
    weights = kv["parts"]["generation"]["vllm_weights"]
    assert weights > 10  # 7B in bf16
    assert kv["parts"]["training"]["vllm_asleep"] == pytest.approx(planner.VLLM_ASLEEP_GIB + weights)
    assert kv["phase_peaks_gib"]["training"] == pytest.approx(level2["phase_peaks_gib"]["training"] + weights, abs=0.02)
    with pytest.raises(ValueError, match="kv_only_sleep=True.*sleep_level"):
        estimate(model="qwen2.5-1.5b", kv_only_sleep=True)


def test_zero3_shards_by_gpu_count_and_offload_moves_the_optimizer_to_the_host():
    one = estimate(model="qwen2.5-7b", gpus=2, zero_stage=3)["parts"]["training"]
    four = estimate(model="qwen2.5-7b", gpus=4, zero_stage=3)["parts"]["training"]
    assert four["weights"] == pytest.approx(one["weights"] / 2, abs=0.01)
    assert four["optimizer_states"] == pytest.approx(one["optimizer_states"] / 2, abs=0.01)
    off = estimate(model="qwen2.5-7b", gpus=2, zero_stage=3, offload_optimizer=True)
    assert off["parts"]["training"]["optimizer_states"] == 0
    # fp32 master + Adam m, v + fp32 gradients on the CPU: 16 bytes per parameter over the node.
    assert off["host_gib_per_node"]["optimizer_offload"] == pytest.approx(16 * 7.616e9 / GIB, rel=0.01)


def test_lora_trains_a_sliver_of_the_parameters():
    full = estimate(model="qwen2.5-7b", gpus=1)
    lora = estimate(model="qwen2.5-7b", gpus=1, lora_rank=16)
    assert lora["trainable_params_b"] < 0.01 * full["trainable_params_b"]
    assert lora["parts"]["training"]["optimizer_states"] < 0.01 * full["parts"]["training"]["optimizer_states"]


def test_gradient_checkpointing_shrinks_activations_by_an_order_of_magnitude():
    on = estimate(model="qwen2.5-1.5b", per_device_train_batch_size=64)["parts"]["training"]["activations"]
    off = estimate(model="qwen2.5-1.5b", per_device_train_batch_size=64,
                   gradient_checkpointing=False)["parts"]["training"]["activations"]
    assert off > 5 * on


def test_a_kv_cache_too_small_for_one_step_is_flagged():
    r = estimate(model="qwen2.5-7b", vllm_gpu_memory_utilization=0.12, per_device_train_batch_size=256,
                 max_completion_length=1024)
    assert r["vllm"]["kv_cache_gib"] < r["vllm"]["kv_needed_gib"]
    assert any("preempt" in n for n in r["notes"])


@pytest.mark.parametrize("field, value, words", [
    ("mode", "hybrid", "colocate"), ("zero_stage", 4, "0 (DDP)"), ("sleep_level", 3, "level"),
    ("vllm_gpu_memory_utilization", 1.5, "(0, 1]"), ("vllm_tensor_parallel_size", 3, "divides"),
    ("model", "qwen9-1t", "preset"), ("per_device_train_batch_size", 0, "positive"),
])
def test_bad_settings_name_the_value_and_the_fix(field, value, words):
    with pytest.raises(ValueError) as err:
        estimate(Plan(gpus=2), **{field: value})
    assert repr(value) in str(err.value) and words in str(err.value)


def test_offload_without_deepspeed_is_refused():
    with pytest.raises(ValueError, match="zero_stage >= 1"):
        estimate(offload_optimizer=True, zero_stage=0)


# ---- recommendation -------------------------------------------------------------------------------

def test_recommendation_stays_under_the_safe_fraction_and_above_vllms_minimum():
    rec = recommend(model="qwen2.5-1.5b", gpus=2, per_device_train_batch_size=64)
    assert rec["fits"]
    assert rec["peak_gib_per_gpu"] <= planner.SAFE_FRACTION * planner.H200_GIB + 0.01
    assert rec["vllm_gpu_memory_utilization"] >= rec["min_vllm_gpu_memory_utilization"]
    # one step more would cross the line
    over = estimate(model="qwen2.5-1.5b", gpus=2, per_device_train_batch_size=64, sleep_level=rec["sleep_level"],
                    vllm_gpu_memory_utilization=rec["vllm_gpu_memory_utilization"] + 0.02)
    assert over["peak_gib_per_gpu"] > planner.SAFE_FRACTION * planner.H200_GIB


def test_72b_full_finetuning_is_refused_on_one_node_for_host_memory_and_fits_on_four():
    kw = dict(model="qwen2.5-math-72b", zero_stage=3, offload_optimizer=True, sleep_level=2,
              vllm_tensor_parallel_size=4, per_device_train_batch_size=8, prompt_length=512, max_completion_length=1024,
              host_mem_gib=560)
    one_node = estimate(gpus=8, **kw)
    assert one_node["fits_gpu"] and not one_node["fits_host"] and not one_node["fits"]
    assert estimate(gpus=32, **kw)["fits"]


def test_a_model_too_big_for_its_gpus_gets_a_clear_no():
    rec = recommend(model="qwen2.5-72b", gpus=1, gpu_mem_gib=80)
    assert rec["fits"] is False and "add GPUs" in rec["why"]


# ---- validation against the measured peaks ---------------------------------------------------------

# the planner as it is now against every measured row (results/planner_measured_peaks.json, results/zero3_run.json)
NOW = planner_validation.validation_table()


COLOCATE_ROWS = [r for r in planner_validation.measured_rows() if r["source"].startswith("TRL 1.16 on 2×H200")
                 and r["plan"].get("mode", "colocate") == "colocate"]


@pytest.mark.slow
@pytest.mark.parametrize("held_out", range(len(COLOCATE_ROWS)), ids=[r["row"] for r in COLOCATE_ROWS])
def test_each_colocate_row_predicted_within_10_percent_by_constants_fitted_without_it(held_out):
    """Out of sample: fit the three constants on the other seven rows, predict the eighth."""
    row = COLOCATE_ROWS[held_out]
    fit = planner_validation.fit_constants([r for i, r in enumerate(COLOCATE_ROWS) if i != held_out])
    saved = dict(planner.FITTED)
    try:
        planner.FITTED.update(fit["constants"])
        predicted = planner.estimate(planner.Plan(**row["plan"]))["peak_gib_per_gpu"]
    finally:
        planner.FITTED.clear()
        planner.FITTED.update(saved)
    assert abs(predicted / row["measured_gib"] - 1) <= 0.10, (row["row"], predicted, row["measured_gib"])


def test_rows_measured_after_the_fit_are_within_10_percent():
    """The ZeRO-3 7B run was measured after the constants were fitted and never used to fit them."""
    later = [r for r in NOW["rows"] if r["source"] == "results/zero3_run.json"]
    assert later and all(abs(r["error"]) <= 0.10 for r in later), later


@pytest.mark.xfail(strict=True, reason="the server-mode row (50.6 GiB) is ~29% above the model; see the note in "
                                       "results/planner_validation.json: it needs a measured breakdown")
def test_server_row_is_within_10_percent():
    row = next(r for r in NOW["rows"] if r["row"].startswith("server"))
    assert abs(row["error"]) <= 0.10


def test_fitted_constants_are_the_grid_optimum_over_the_colocate_rows():
    fit = planner_validation.fit_constants()
    assert fit["constants"] == pytest.approx(planner.FITTED)
    assert len(fit["rows"]) == 8 and all(r.startswith("colocate") for r in fit["rows"])


# ---- CLI ------------------------------------------------------------------------------------------

def test_cli_prints_the_issue_example_as_json():
    out = plan_cli(*ISSUE_EXAMPLE)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert {"peak_gib_per_gpu", "fits", "parts", "recommendation"} <= set(r)
    assert r["fits"] is True and r["settings"]["sleep_level"] == 2
    assert r["parts"]["generation"]["vllm_kv_cache"] > 30


def test_cli_bad_value_exits_2_with_the_value_named():
    out = plan_cli("--model", "qwen2.5-1.5b", "--gpus", "2", "--vllm-tensor-parallel-size", "3")
    assert out.returncode == 2
    assert "vllm_tensor_parallel_size=3" in out.stderr and "divides" in out.stderr


# ---- configs --------------------------------------------------------------------------------------

def test_deepspeed_config_is_the_posts_recipe():
    z = deepspeed_config(3, offload_optimizer=True)["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"]["device"] == "cpu"
    assert z["overlap_comm"] is True and z["contiguous_gradients"] is True
    with pytest.raises(ValueError, match="zero_stage=3"):
        deepspeed_config(2, offload_params=True)


@pytest.mark.parametrize("model, gpus", [("qwen2.5-7b", 2), ("qwen2.5-72b", 16)])
def test_committed_configs_are_what_the_generator_writes(tmp_path, model, gpus):
    paths = write_configs(model, gpus, out=tmp_path)
    for key, path in paths.items():
        committed = REPO_ROOT / "configs" / path.parent.name / path.name
        assert committed.exists(), f"{committed} missing: run colo_kit.memory.recipes.write_configs({model!r}, {gpus})"
        if key != "accelerate_zero3":  # that one names the JSON by path, which differs under tmp_path
            assert committed.read_text() == path.read_text()


def test_the_72b_recipe_spans_the_nodes_the_planner_says_it_needs():
    from accelerate.commands.config.config_args import load_config_from_file

    from colo_kit.memory.planner import what_fits

    recipe = dict(vllm_tensor_parallel_size=4, per_device_train_batch_size=8, prompt_length=512, max_completion_length=1024,
                  vllm_gpu_memory_utilization=0.3)
    rows = [r for r in what_fits("qwen2.5-math-72b", gpu_counts=(8, 16, 32), host_mem_gib=560, **recipe)
            if r["setup"] == "colocate, sleep 2, offload"]
    smallest = min(r["gpus"] for r in rows if r["fits"])
    cfg = load_config_from_file(str(REPO_ROOT / f"configs/accelerate/zero3_qwen2.5-72b_{smallest}gpu.yaml"))
    assert cfg.num_processes == smallest and cfg.num_machines == smallest // 8 > 1  # one 8-GPU node is too little host
    assert not (REPO_ROOT / "configs/accelerate/zero3_qwen2.5-72b_8gpu.yaml").exists()


def test_accelerate_reads_the_generated_zero3_yaml():
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(REPO_ROOT / "configs/accelerate/zero3_qwen2.5-7b_2gpu.yaml"))
    assert str(cfg.distributed_type).endswith("DEEPSPEED") and cfg.num_processes == 2
    ds = REPO_ROOT / cfg.deepspeed_config["deepspeed_config_file"]
    assert json.loads(ds.read_text())["zero_optimization"]["stage"] == 3
    # accelerate refuses mixed precision / stage / offload in the YAML when a DeepSpeed file is given
    assert not {"mixed_precision", "zero_stage", "offload_optimizer_device"} & set(cfg.deepspeed_config)


# ---- the GPU run's script, on CPU -------------------------------------------------------------------

@pytest.mark.slow
def test_zero3_run_script_smoke_trains_and_writes_its_json(tmp_path):
    out = tmp_path / "zero3.json"
    proc = subprocess.run([sys.executable, "scripts/zero3_run.py", "--smoke", "--out", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["status"] == "ok" and len(r["step_times_s"]) == 2 and all(t > 0 for t in r["step_times_s"])
    assert r["planner_prediction"]["peak_gib_per_gpu"] > 0
    assert any("reward" in row for row in r["trl_log"])
    assert r["env"]["versions"]["trl"] == "1.16.0"


def test_gpu_script_is_valid_bash_and_launches_the_generated_config():
    script = REPO_ROOT / "scripts" / "gpu" / "zero3.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert "configs/accelerate/zero3_${MODEL}_${GPUS}gpu.yaml" in text and "--num_processes" in text
    assert (REPO_ROOT / "configs/accelerate/zero3_qwen2.5-7b_2gpu.yaml").exists()


def test_writing_configs_keeps_a_different_file_and_writes_beside_it(tmp_path):
    first = write_configs("qwen2.5-72b", 16, offload_optimizer=True, out=tmp_path)
    yaml_before = first["accelerate_zero3"].read_text()
    # the recommendation changed (no offload): the YAML now points at another JSON
    second = write_configs("qwen2.5-72b", 16, offload_optimizer=False, out=tmp_path)
    assert first["accelerate_zero3"].read_text() == yaml_before  # what was there is untouched
    assert second["accelerate_zero3"].name == "zero3_qwen2.5-72b_16gpu.proposed.yaml"
    assert "zero3.json" in second["accelerate_zero3"].read_text()
    assert second["accelerate_ddp"] == first["accelerate_ddp"]  # same contents: written in place, no copy
    third = write_configs("qwen2.5-72b", 16, offload_optimizer=False, out=tmp_path, replace=True)
    assert third["accelerate_zero3"] == first["accelerate_zero3"]
    assert "zero3.json" in first["accelerate_zero3"].read_text()


def test_plan_write_configs_never_changes_the_committed_files(monkeypatch, capsys, tmp_path):
    from colo_kit.memory import recipes
    from colo_kit_cli import main

    committed = {p: p.read_text() for p in (REPO_ROOT / "configs").rglob("*") if p.is_file()}
    monkeypatch.setattr(recipes, "CONFIGS", tmp_path)  # the command's default folder, as a copy of the repo's
    for p, text in committed.items():
        dst = tmp_path / p.relative_to(REPO_ROOT / "configs")
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(text)
    assert main(["plan", "--model", "qwen2.5-72b", "--gpus", "16", "--zero-stage", "3", "--write-configs", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for p, text in committed.items():
        assert (tmp_path / p.relative_to(REPO_ROOT / "configs")).read_text() == text
    proposed = [v for v in report["configs"].values() if ".proposed." in v]
    assert all(any(v in n for n in report["notes"]) for v in proposed)


def test_a_config_past_any_model_is_one_line(tmp_path, capsys):
    """hidden_size 10**12 used to end in torch's 51-line overflow while the meta model was laid out."""
    from colo_kit_cli import main

    config = {"model_type": "qwen2", "hidden_size": 10**12, "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 8, "intermediate_size": 100, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hidden_size=1000000000000" in err[0] and "parameters" in err[0]
    real = {**config, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
            "num_key_value_heads": 2, "vocab_size": 151936}
    (tmp_path / "config.json").write_text(json.dumps(real))
    assert main(["plan", "--model", str(tmp_path)]) == 0
