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
    """The YAML as a plain TRL script reads it (TrlParser over GRPOConfig and TRL's ModelConfig), its `model:` line
    given as `model_name_or_path`, as its header says."""
    from trl import GRPOConfig, ModelConfig, TrlParser

    path = tmp_path / "recipe.yaml"
    path.write_text(text.replace("\nmodel: ", "\nmodel_name_or_path: "))
    config, model = TrlParser((GRPOConfig, ModelConfig)).parse_args_and_config(
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
    assert f"\nmodel: {r['plan'].model}\n" in text and "model_name_or_path" in lines[1]  # the header says how


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
    from colo_kit_cli import main

    out = tmp_path / "r.yaml"
    assert main(["plan", "--model", "qwen2.5-1.5b", "--recommend", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "predicted peak" in printed and out.read_text() in printed
    assert main(["plan", "--model", "qwen2.5-1.5b", "--recommend", "--mode", "server"]) == 2


# --- the recipe for the GPU it is written for (an H100 80 GB: 79.1 GiB as CUDA reports it; an H200: 139.8) ---

H100_GIB = 79.1


def _fields(r: dict) -> dict:
    return {k: v for k, v, _ in r["fields"]}


def test_on_an_h100_the_recipe_keeps_cispo_on_8_steps_with_expandable_segments():
    """The fast configuration (CISPO, 8 steps per generation, batch 16) at TRL's 0.3 share is over the 92% budget of
    an H100 with PyTorch's default allocator reserve, and under it with expandable segments: the recipe keeps it and
    names the environment variable, in its header's run line too."""
    from dataclasses import replace

    from colo_kit.memory.planner import estimate

    h100 = recipe(model="qwen2.5-1.5b", gpu_mem_gib=H100_GIB)
    f = _fields(h100)
    assert (f["per_device_train_batch_size"], f["steps_per_generation"], f["loss_type"]) == (16, 8, "cispo")
    assert (f["gradient_checkpointing"], f["vllm_enable_sleep_mode"], f["vllm_gpu_memory_utilization"]) == \
        (False, False, 0.3)
    assert h100["environment"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert h100["peak_gib_per_gpu"] <= SAFE_FRACTION * H100_GIB
    default_allocator = estimate(replace(h100["plan"], expandable_segments=False))
    assert default_allocator["peak_gib_per_gpu"] > SAFE_FRACTION * H100_GIB
    assert "# run: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True colo-kit train" in to_yaml(h100)


def test_where_the_fast_configuration_does_not_fit_at_trls_share_the_engine_is_sized_to_one_generation():
    """On a 48 GB card batch 16 at 8 steps per generation does not fit beside the engine the planner sized for batch 8;
    sized to twice what one generation needs it does, so the recipe keeps it instead of falling back to on-policy
    batch 8. On an H200 it fits at TRL's 0.3, which stays."""
    from colo_kit.memory.planner import estimate, generation_share

    r = recipe(model="qwen2.5-1.5b", gpu_mem_gib=47.5)
    f = _fields(r)
    assert (f["per_device_train_batch_size"], f["steps_per_generation"], f["loss_type"]) == (16, 8, "cispo")
    need = estimate(r["plan"])["vllm"]["min_gpu_memory_utilization"]
    assert f["vllm_gpu_memory_utilization"] == generation_share(r["plan"])
    assert 2 * need <= f["vllm_gpu_memory_utilization"] < 0.3  # the margin: twice the modelled need
    assert r["peak_gib_per_gpu"] <= SAFE_FRACTION * 47.5
    why = next(w for k, _, w in r["fields"] if k == "vllm_gpu_memory_utilization")
    assert why.startswith("sized to one generation") and f"{need:.3f}" in why
    h200 = _fields(recipe(model="qwen2.5-1.5b", gpu_mem_gib=139.8))
    assert (h200["vllm_gpu_memory_utilization"], h200["steps_per_generation"], h200["per_device_train_batch_size"]) \
        == (0.3, 8, 16)


def test_at_7b_on_80_gb_the_recipe_recomputes_activations_before_it_offloads_the_optimizer():
    """7B in bfloat16 on one 80 GB GPU: the training state fits unsharded once the engine sleeps and activations are
    recomputed; the recipe takes that (one more forward per step) over ZeRO-3 with a CPU Adam (seconds per step)."""
    r = recipe(model="qwen2.5-7b", gpu_mem_gib=H100_GIB, train_dtype="bfloat16")
    f = _fields(r)
    assert r["fits"] and r["plan"].zero_stage == 0 and not r["plan"].offload_optimizer
    assert (f["gradient_checkpointing"], f["vllm_enable_sleep_mode"], f["steps_per_generation"]) == (True, True, 2)
    assert r["environment"] == {}  # vLLM's sleep mode refuses expandable segments
    assert not any(c.startswith("launch:") for c in r["comments"])


def test_it_falls_back_to_on_policy_only_when_the_sized_engine_does_not_fit_either_and_says_why():
    """2,048-token completions on a 44 GiB GPU: 8 steps per generation do not fit even with the engine sized,
    asleep while training and activations recomputed; the recipe then writes TRL's on-policy default with that
    reason, and a recipe that still fits."""
    r = recipe(model="qwen2.5-1.5b", gpu_mem_gib=44.0, max_completion_length=2048)
    f = _fields(r)
    assert r["fits"] and f["steps_per_generation"] is None and f["loss_type"] == "dapo"
    why = next(w for k, _, w in r["fields"] if k == "steps_per_generation")
    assert why.startswith("TRL's default (on-policy), since 8 steps per generation at batch 16 need") and \
        "over 92% of 44.0 GiB" in why
    assert r["peak_gib_per_gpu"] <= SAFE_FRACTION * 44.0


@pytest.mark.parametrize("gpu_mem_gib", [H100_GIB, 139.8])
@pytest.mark.parametrize("num_generations", [2, 3, 5, 6, 7, 12, 16])
def test_every_recipe_holds_whole_groups_of_g_so_trl_never_refuses_it(gpu_mem_gib, num_generations, tmp_path):
    """TRL refuses a generation (batch x steps per generation) that is not whole groups of G: the recipe raises
    the batch to the next that is, says so, and TRL's own parser takes the YAML."""
    r = recipe(model="qwen2.5-1.5b", gpu_mem_gib=gpu_mem_gib, num_generations=num_generations)
    config = _parse(tmp_path, to_yaml(r))
    assert config.generation_batch_size % num_generations == 0 and config.num_generations == num_generations
    b = config.per_device_train_batch_size
    assert b >= 16 and all((smaller * 8) % num_generations for smaller in range(16, b))
    why = next(w for k, _, w in r["fields"] if k == "per_device_train_batch_size")
    assert (f"whole groups of {num_generations}" in why) == (b != 16)


def test_the_recipes_reasons_on_an_h100_are_one_sentence_each():
    import re

    for r in (recipe(model="qwen2.5-1.5b", gpu_mem_gib=H100_GIB, num_generations=3),
              recipe(model="qwen2.5-1.5b", gpu_mem_gib=44.0, max_completion_length=2048)):
        for name, _, why in r["fields"]:
            assert not re.findall(r"[a-z)\]]\. [A-Z(]", why.rstrip(".")) and len(why) <= 260, (name, why)


def test_a_bad_g_is_one_value_error():
    for bad in (1, 0, -3, 2.5, True):
        with pytest.raises(ValueError, match="at least 2 completions"):
            recipe(model="qwen2.5-1.5b", num_generations=bad)


# --- plan --recommend: which GPU it sized for, the YAML it writes, and colo-kit train on that YAML ---

def _recommend(tmp_path, capsys, *flags):
    from colo_kit_cli import main

    out = tmp_path / "r.yaml"
    rc = main(["plan", "--model", "qwen2.5-1.5b", "--recommend", "--out", str(out), *flags])
    return rc, out, capsys.readouterr()


def test_plan_recommend_sizes_for_the_gpu_nvml_reads_and_says_so(tmp_path, capsys, monkeypatch):
    """NVML cannot run on a machine without an NVIDIA GPU: a stand-in answers as an H100 does. --gpu-mem-gib given,
    NVML is not asked; no GPU, the H200 the recipe's measurements come from, said in the YAML."""
    from colo_kit.memory import planner

    monkeypatch.setattr(planner, "read_gpu_memory", lambda index=0: {"name": "NVIDIA H100 80GB HBM3", "gib": 79.1})
    rc, out, seen = _recommend(tmp_path, capsys)
    text = out.read_text()
    assert rc == 0 and "# sized for the GPU here, NVIDIA H100 80GB HBM3: 79.1 GiB read by NVML" in text
    assert "1 GPU(s) of 79.1 GiB" in text and _fields_of(text)["vllm_gpu_memory_utilization"] == 0.3

    def never(index=0):
        raise AssertionError("NVML read although --gpu-mem-gib was given")

    monkeypatch.setattr(planner, "read_gpu_memory", never)
    for flag in (["--gpu-mem-gib", "139.8"], ["--gpu_mem_gib=139.8"]):
        rc, out, _ = _recommend(tmp_path, capsys, *flag)
        assert rc == 0 and "# sized for --gpu-mem-gib 139.8 GiB per GPU" in out.read_text()
    monkeypatch.setattr(planner, "read_gpu_memory", lambda index=0: None)
    rc, out, _ = _recommend(tmp_path, capsys)
    assert rc == 0 and "# sized for one H200 (139.8 GiB): no NVIDIA GPU here" in out.read_text()
    assert _fields_of(out.read_text())["vllm_gpu_memory_utilization"] == 0.3


def _fields_of(text: str) -> dict:
    import yaml

    return yaml.safe_load(text)


def test_read_gpu_memory_is_what_cuda_reports(monkeypatch):
    """With no NVIDIA GPU the real reader says so (None). Where NVML cannot run here, a stand-in module gives an H100's
    figures: the reader returns NVML's total less the driver's reserve, as CUDA (and vLLM's share) counts it."""
    import sys
    import types

    from colo_kit import env
    from colo_kit.env import has_cuda
    from colo_kit.memory.planner import read_gpu_memory

    if not has_cuda():
        assert read_gpu_memory() is None
    mib = 2**20
    fake = types.SimpleNamespace(
        NVMLError=RuntimeError, nvmlMemory_v2=2, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: ("gpu", i),
        nvmlDeviceGetMemoryInfo=lambda h, version=None: types.SimpleNamespace(
            total=81559 * mib, reserved=535 * mib) if version else types.SimpleNamespace(total=81559 * mib))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(env, "visible_gpus", lambda: [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "mem_gib": 79.6}])
    assert read_gpu_memory() == {"name": "NVIDIA H100 80GB HBM3", "gib": 79.1}
    assert read_gpu_memory(1) is None


@pytest.mark.parametrize("value", ["1e308", "nan", "-1", "0", "inf", "5000"])
def test_a_bad_gpu_memory_is_one_line_and_exit_2(value, tmp_path, capsys):
    rc, out, seen = _recommend(tmp_path, capsys, "--gpu_mem_gib", value)
    assert rc == 2 and not out.exists()
    lines = seen.err.strip().splitlines()
    assert len(lines) == 1 and "gpu_mem_gib=" in lines[0] and "Traceback" not in seen.err


def test_colo_kit_train_runs_the_model_the_yaml_names_and_refuses_what_trl_would(tmp_path, capsys, monkeypatch):
    """`colo-kit train --config r.yaml` as the header says: the model the recipe was sized for, not `tiny`, with its
    fields; a G the generation does not hold whole groups of, given on top, is TRL's refusal in one line."""
    import types

    from colo_kit_cli import main
    from colo_kit.grpo import train

    seen = {}

    def run_grpo(model, mode, **kwargs):
        seen.update(kwargs, model=model, mode=mode)
        return types.SimpleNamespace(rewards=[0.0], elapsed_s=0.0, to_dict=dict)

    monkeypatch.setattr(train, "run_grpo", run_grpo)
    rc, out, _ = _recommend(tmp_path, capsys, "--gpu-mem-gib", str(H100_GIB), "--num-generations", "3")
    assert rc == 0
    assert main(["train", "--config", str(out), "--max_steps", "2"]) == 0
    assert (seen["model"], seen["mode"], seen["num_generations"]) == ("qwen2.5-1.5b", "colocate", 3)
    assert (seen["per_device_train_batch_size"], seen["steps_per_generation"], seen["loss_type"],
            seen["vllm_gpu_memory_utilization"]) == (18, 8, "cispo", 0.3)
    capsys.readouterr()
    assert main(["train", "--config", str(out), "--num_generations", "5"]) == 2  # 18 x 8 = 144 completions
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "divisible by num_generations" in err[0]
