"""Every `colo-kit` command answers bad input with one line naming the value and the fix, exit code 2,
before anything runs or is written; committed results change only when named."""

import json
import os
import types

import pytest

from colo_kit_cli import main
from colo_kit.paths import REPO_ROOT


@pytest.fixture
def files(tmp_path):
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "broken.yaml").write_text("beta: [1\n")
    (tmp_path / "abc.json").write_text(json.dumps({"hidden_size": "abc", "num_hidden_layers": 2, "num_attention_heads": 2,
                                                   "intermediate_size": 8, "vocab_size": 10}))
    (tmp_path / "bad.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n\n{"problem": "2+2" "answer": 4}\n')
    (tmp_path / "noanswer.jsonl").write_text('{"problem": "1+1"}\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "text.md").write_text("# not a notebook\n")
    return tmp_path


CASES = [
    (["bench", "--modes", "bogus"], "--modes 'bogus'"),
    (["bench", "--batches", "8,x"], "--batches '8,x'"),
    (["bench", "--batches", "6", "--num-generations", "4"], "per_device_train_batch_size=6 must be a multiple of "
                                                             "num_generations=4"),
    (["bench", "--num-generations", "0"], "num_generations=0: give a whole number of at least 2"),
    (["bench", "--vllm-gpu-memory-utilization", "nan"], "vllm_gpu_memory_utilization=nan"),
    (["bench", "--max-steps", "1"], "--max-steps 1"),
    (["bench", "--out", "/proc/nope/x.json"], "--out /proc/nope/x.json"),
    (["bench", "--extra-colocate", '{"fast": {"stepz_per_generation": 4}}'], "'fast': ['stepz_per_generation'] are neither"),
    (["train", "--max-steps", "0"], "max_steps=0: give a whole number of at least 1"),
    (["train", "--max-steps", "-1"], "max_steps=-1"),
    (["train", "--num-generations", "0"], "num_generations=0: give a whole number of at least 1"),
    (["train", "--num-generations", "1"], "at least 2 generations per prompt"),
    (["train", "--model", "no-such-model"], "'no-such-model' is neither"),
    (["train", "--per-device-train-batch-size", "6", "--num-generations", "4"],
     "generation_batch_size (6) must be divisible by num_generations (4)"),
    (["train", "--per-device-batch", "8"], "['--per-device-batch', '8']: colo-kit train takes GRPOConfig fields"),
    (["train", "--vllm-gpu-memory-utilization", "nan"], "vllm_gpu_memory_utilization=nan"),
    (["train", "--json", "/proc/nope/x.json"], "--json /proc/nope/x.json"),
    (["train", "--mode", "server"], "needs vllm_server_base_url"),
    (["train", "--beta", "abc"], "argument --beta: invalid float value: 'abc'"),
    (["train", "--no-such-field", "1"], "['--no-such-field', '1']: colo-kit train takes GRPOConfig fields"),
    (["train", "--config={files}/list.json"], "not a YAML mapping of GRPOConfig fields"),
    (["train", "--per_device_train_batch_size", "6", "--num_generations", "4"],
     "generation_batch_size (6) must be divisible by num_generations (4) (TRL's GRPOConfig refused"),
    (["train", "--config", "{files}/list.json"], "not a YAML mapping of GRPOConfig fields"),
    (["train", "--config", "{files}/broken.yaml"], "broken.yaml': cannot read it as YAML"),
    (["train", "--config", "{files}/none.yaml"], "none.yaml': cannot read it as YAML"),
    (["eval-math500", "--out", "/proc/nope/ev.json"], "--out /proc/nope/ev.json"),
    (["eval-math500", "--limit", "0"], "--limit 0: give a whole number of at least 1"),
    (["eval-math500", "--max-tokens", "0"], "--max-tokens 0: give a whole number of at least 1"),
    (["eval-math500", "--source", "web"], "argument --source: invalid choice: 'web'"),
    (["eval-math500", "--data", "{files}/bad.jsonl"], "bad.jsonl line 3: not JSON"),
    (["eval-math500", "--data", "{files}/noanswer.jsonl"], "line 1: needs a JSON object with problem, answer (missing answer)"),
    (["eval-math500", "--data", "{files}/empty.jsonl"], "empty.jsonl: no rows"),
    (["eval-math500", "--model", "nope"], "'nope' is neither"),
    (["plan", "--model", "{files}/list.json"], "is a JSON list, not an object"),
    (["plan", "--model", "{files}/abc.json"], "hidden_size='abc'"),
    (["plan", "--host-mem-gib", "nan"], "host_mem_gib=nan"),
    (["plan", "--gpus", "0"], "gpus=0"),
    (["plan", "--model", "qwen2.5-72b", "--gpus", "8", "--tp", "3"], "vllm_tensor_parallel_size=3"),
    (["plan", "--recommend", "--out", "/proc/nope/r.yaml"], "--out /proc/nope/r.yaml"),
    (["build-model", "--seed", "-3"], "--seed -3: give a whole number from 0 to 2**32 - 1"),
    (["build-model", "nope"], "preset 'nope': choose one of qwen2.5-0.5b, qwen2.5-1.5b,"),
    (["run-notebooks", "/no/such.ipynb"], "/no/such.ipynb: no such notebook"),
    (["run-notebooks", "{files}/text.md"], "not a Jupyter notebook"),
    (["env", "--bogus"], "unrecognized arguments: --bogus"),
    (["proxy", "--replica", "http://127.0.0.1:1", "--upstream-timeout-s", "0"], "upstream_timeout_s=0"),
]


@pytest.mark.parametrize("argv, words", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_one_line_and_exit_2(argv, words, files, capsys):
    argv = [a.replace("{files}", str(files)) for a in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"colo-kit {argv[0]}: ") and words.replace("{files}", str(files)) in lines[0], lines[0]
    assert "Traceback" not in captured.err + captured.out


def test_a_failed_bench_leaves_the_committed_results_alone(capsys):
    committed = REPO_ROOT / "results" / "pingpong_cpu.json"
    before = committed.read_bytes(), committed.stat().st_mtime_ns
    assert main(["bench", "--modes", "bogus"]) == 2
    assert (committed.read_bytes(), committed.stat().st_mtime_ns) == before


def test_bench_writes_under_runs_unless_a_path_is_named(monkeypatch, tmp_path):
    from colo_kit_cli import bench
    from colo_kit.paths import runs_dir

    written = []

    def sweep(model, *, out, **kw):  # stands in for the minute-long sweep: only where it writes matters here
        written.append(out)
        return {"summary": [], "runs": []}

    monkeypatch.setattr(bench, "sweep", sweep)
    monkeypatch.setattr(bench, "write_plots", lambda res, path: path)
    assert main(["bench", "--modes", "colocate"]) == 0
    assert main(["bench", "--modes", "colocate", "--out", str(tmp_path / "named.json")]) == 0
    assert written[0].parent == runs_dir() and written[1] == tmp_path / "named.json"


def test_train_hands_any_other_grpo_field_to_trls_parser(monkeypatch, tmp_path):
    """`colo-kit train --beta 0.04 --config recipe.yaml`: GRPOConfig fields in TRL's spelling, or a
    YAML file of them, parsed by TRL's TrlParser and given to the run; the command line wins over
    the file, as in TRL's own scripts."""
    from colo_kit.grpo import train

    seen = {}

    def run_grpo(model, mode, **kwargs):  # stands in for the run: only what reaches it matters here
        seen.update(kwargs)
        return types.SimpleNamespace(rewards=[0.0], elapsed_s=0.0, to_dict=dict)

    monkeypatch.setattr(train, "run_grpo", run_grpo)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("beta: 0.02\nlr_scheduler_type: cosine\nloss_type: dr_grpo\n")
    assert main(["train", "--max-steps", "3", "--config", str(recipe), "--beta", "0.04", "--num_iterations", "2",
                 "--output_dir", str(tmp_path / "run")]) == 0
    assert seen["max_steps"] == 3 and seen["output_dir"] == str(tmp_path / "run")  # TRL's field, the run's folder
    assert (seen["beta"], seen["lr_scheduler_type"], seen["loss_type"], seen["num_iterations"]) == \
        (0.04, "cosine", "dr_grpo", 2)
    assert "temperature" not in seen and seen["per_device_train_batch_size"] == 8  # the kit's flags, and the fields given


def test_train_is_one_grpo_config_with_run_grpos_defaults(monkeypatch):
    """`colo-kit train` with no flags runs what `run_grpo()` runs (its defaults, not TRL's open-ended ones), hands
    on no other GRPOConfig default, and `--max-steps` is the same field as TRL's `--max_steps`."""
    import inspect

    from colo_kit.grpo import train

    real = inspect.signature(train.run_grpo).parameters
    seen = []

    def run_grpo(model, mode, **kwargs):
        seen.append(dict(kwargs, model=model, mode=mode))
        return types.SimpleNamespace(rewards=[0.0], elapsed_s=0.0, to_dict=dict)

    monkeypatch.setattr(train, "run_grpo", run_grpo)
    assert main(["train"]) == 0
    assert main(["train", "--max-steps", "3"]) == 0 and main(["train", "--max_steps=3"]) == 0
    first = seen[0]
    assert (first["model"], first["mode"]) == ("tiny", "colocate")
    for name in ("max_steps", "num_generations", "per_device_train_batch_size", "max_completion_length",
                 "learning_rate", "seed", "vllm_gpu_memory_utilization"):
        assert first[name] == real[name].default, name
    assert "beta" not in first and "temperature" not in first  # TRL's own defaults stay TRL's
    assert seen[1] == seen[2] and seen[1]["max_steps"] == 3


def test_train_takes_the_planners_recipe_in_trls_names(monkeypatch, tmp_path):
    """`colo-kit plan --recommend --out r.yaml` then `colo-kit train --config r.yaml`: the fields the kit also
    has flags for (batch, sleep, steps, ...) arrive once, in TRL's names as every other GRPOConfig field does;
    `--config=FILE` works as `--config FILE` does."""
    from colo_kit.grpo import train

    seen = {}

    def run_grpo(model, mode, **kwargs):
        seen.update(kwargs, mode=mode)
        return types.SimpleNamespace(rewards=[0.0], elapsed_s=0.0, to_dict=dict)

    monkeypatch.setattr(train, "run_grpo", run_grpo)
    recipe = tmp_path / "r.yaml"
    assert main(["plan", "--model", "qwen2.5-1.5b", "--per-device-train-batch-size", "16", "--recommend",
                 "--out", str(recipe)]) == 0
    assert main(["train", f"--config={recipe}", "--max_steps", "2", "--bucketed-push"]) == 0
    assert seen["mode"] == "colocate" and seen["per_device_train_batch_size"] == 16 and seen["max_steps"] == 2
    assert seen["vllm_enable_sleep_mode"] is False and seen["push_bucket_mb"] == 0
    assert seen["gradient_checkpointing"] is False and seen["generation_kwargs"] == {"detokenize": False}
    assert "use_vllm" not in seen
    assert seen["output_dir"] is None  # not given: run_grpo's own folder under results/runs/


def test_build_model_keeps_one_folder_per_seed(tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file

    from colo_kit.models import build_model

    monkeypatch.setenv("COLO_KIT_CACHE", str(tmp_path))
    zero, five = build_model("tiny"), build_model("tiny", seed=5)
    assert zero != five and build_model("tiny", seed=5) == five
    a, b = load_file(str(zero / "model.safetensors")), load_file(str(five / "model.safetensors"))
    name = next(k for k in a if k.endswith("q_proj.weight"))
    assert not torch.equal(a[name], b[name])  # seed 5 is other weights, not the cached seed 0


def test_an_unwritable_model_cache_is_one_line(tmp_path, monkeypatch, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    monkeypatch.setenv("COLO_KIT_CACHE", str(locked / "cache"))
    try:
        if os.access(locked, os.W_OK):  # root ignores permissions: use a path that cannot be a folder
            monkeypatch.setenv("COLO_KIT_CACHE", "/proc/colo-kit-cache")
        assert main(["build-model"]) == 2
    finally:
        locked.chmod(0o700)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "COLO_KIT_CACHE" in err[0]


def test_build_model_takes_the_preset_first_then_build_models_flags(tmp_path, monkeypatch):
    from colo_kit_cli import build_model

    seen = []
    monkeypatch.setenv("COLO_KIT_CACHE", str(tmp_path))
    monkeypatch.setattr(build_model, "build_model", lambda preset, **kwargs: seen.append((preset, kwargs)) or tmp_path)
    assert main(["build-model", "qwen2.5-0.5b", "--seed", "4294967295", "--force"]) == 0
    assert main(["build-model", "--seed=7"]) == 0
    assert seen == [("qwen2.5-0.5b", {"seed": 4294967295, "force": True}), ("tiny", {"seed": 7, "force": False})]
