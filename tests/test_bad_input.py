"""More bad input, answered as tests/test_cli.py's cases are: one line naming the value and the fix, exit code 2,
before any model is loaded or any run starts. Each case here once ended in a traceback after the model loaded
(or after TRL's 240 s wait for a server), or was taken and run."""

import pytest

from colo_kit_cli import main
from colo_kit.env import has_cuda


@pytest.fixture
def files(tmp_path):
    (tmp_path / "temperature.yaml").write_text("temperature: -1\n")
    (tmp_path / "beta.yaml").write_text("beta: [1, 2]\n")
    (tmp_path / "seed.yaml").write_text("seed: -1\n")
    (tmp_path / "a_file").write_text("not a folder\n")
    levels = ["l0: &l0 [0, 0, 0, 0, 0, 0, 0, 0, 0]"] + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 6)]
    (tmp_path / "bomb.yaml").write_text("\n".join(levels) + "\nbeta: *l5\n")  # 9**6 zeros from 300 bytes
    (tmp_path / "reward.yaml").write_text("reward: bogus\n")
    (tmp_path / "etc.yaml").write_text("model: /etc\n")
    (tmp_path / "huge.yaml").write_text(f"beta: [{', '.join(['0'] * 100_000)}]\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "qwen2", "max_position_embeddings": 4096}')
    return tmp_path


@pytest.fixture
def nothing_runs(monkeypatch):
    """A case the checks let through fails here at once, instead of loading a model for a minute."""
    from colo_kit.grpo import train
    from colo_kit_cli import bench, build_model, eval_math500, notebooks

    def ran(*args, **kwargs):
        raise AssertionError(f"the bad input was taken: the run started with {args} {kwargs}")

    for module, name in ((train, "run_grpo"), (bench, "sweep"), (eval_math500, "evaluate"),
                         (notebooks, "execute"), (build_model, "build_model")):
        monkeypatch.setattr(module, name, ran)


CASES = [
    (["train", "--target-length", "-5"], "target_length=-5: give a whole number of at least 0"),
    (["train", "--seed", "-1"], "seed=-1: give a whole number from 0 to 4294967295"),
    (["train", "--seed", "4294967296"], "seed=4294967296: give a whole number from 0 to 4294967295"),
    (["train", "--config", "{files}/seed.yaml"], "seed=-1: give a whole number from 0 to 4294967295"),
    (["train", "--loss_type", "bogus"], "loss_type='bogus': TRL implements grpo, dr_grpo"),
    (["train", "--per-device-train-batch-size", "1000000000"],
     "per_device_train_batch_size=1000000000: more than 65536 completions"),
    (["train", "--per_device_train_batch_size", "131072"], "per_device_train_batch_size=131072: more than 65536"),
    (["train", "--max-completion-length", "1000000000000"],
     "max_completion_length=1000000000000: longer than tiny's context (max_position_embeddings=2048)"),
    (["train", "--model", "{files}/model", "--max-completion-length", "5000"], "(max_position_embeddings=4096)"),
    (["train", "--model", "no-such-org/no-such-model", "--max-completion-length", "2000000"],
     "max_completion_length=2000000: above 1048576 tokens"),
    (["train", "--max_completion_length", "0"], "max_completion_length=0: give a whole number of at least 1"),
    (["train", "--vllm-server-base-url", "notaurl"], "vllm_server_base_url='notaurl': give an http(s) URL with a host"),
    (["train", "--mode", "server", "--vllm_server_base_url", "localhost:8000"], "vllm_server_base_url='localhost:8000'"),
    (["train", "--vllm_server_base_url", "http://"], "vllm_server_base_url='http://': give an http(s) URL"),
    (["train", "--config", "{files}/temperature.yaml"], "temperature=-1: give a finite number above 0"),
    (["train", "--temperature", "0"], "temperature=0.0: give a finite number above 0"),
    (["train", "--config", "{files}/beta.yaml"], "beta=[1, 2]: GRPOConfig's beta is float, not list"),
    (["train", "--beta", "-1"], "beta=-1.0: the KL coefficient is a finite number of at least 0"),
    (["train", "--learning_rate", "-1"], "learning_rate=-1.0: give a finite number above 0"),
    (["train", "--config", "{files}/bomb.yaml"], "bomb.yaml': more than 16 YAML aliases (*name)"),
    (["train", "--config", "{files}/huge.yaml"], "beta=[0, 0, 0, 0, 0, 0, 0, 0, ...]: GRPOConfig's beta is float"),
    (["train", "--config", "{files}/reward.yaml"], "reward='bogus': give one of length, math500"),
    (["train", "--config", "{files}/etc.yaml"], "model='/etc': a folder without a config.json"),
    (["train", "--target_length", "5", "--output_dir", "{files}/a_file"], "a_file: is a file, not a folder"),
    (["train", "--output_dir", "/proc/nope"], "--output_dir /proc/nope: cannot create it"),
    (["train", "--mode", "server", "--vllm_server_base_url", "http://127.0.0.1:1"],
     "vllm server 'http://127.0.0.1:1': nothing answers at 127.0.0.1:1 (Connection refused)"),
    (["train", "--mode", "server", "--vllm_server_host", "127.0.0.1", "--vllm_server_port", "1"],
     "nothing answers at 127.0.0.1:1"),
    (["bench", "--model", "nope"], "'nope' is neither a local folder"),
    (["bench", "--port", "70000"], "--port 70000: give a TCP port from 1 to 65535"),
    (["bench", "--port", "0"], "--port 0: give a TCP port"),
    (["run-notebooks", "--out", "/proc/nope"], "--out /proc/nope: cannot create it"),
    (["run-notebooks", "--out", "{files}/a_file"], "a_file: is a file, not a folder"),
    (["demo", "--out", "/proc/nope"], "--out /proc/nope: cannot create it"),
    (["demo", "--out", "{files}/a_file"], "a_file: is a file, not a folder"),
    (["build-model", "--seed", "100000000000000000000"], "give a whole number from 0 to 2**32 - 1"),
    (["build-model", "--seed", "4294967296"], "--seed 4294967296: give a whole number"),
    (["build-model", "--seed", "1e20"], "argument --seed: invalid int value: '1e20'"),
    (["run-notebooks", "--build"], "not used by the HfArgumentParser: ['--build']"),  # python -m record.notebooks builds
]


@pytest.mark.parametrize("argv, words", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_one_line_and_exit_2(argv, words, files, nothing_runs, capsys):
    argv = [a.replace("{files}", str(files)) for a in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) < 500, captured.err[:2000]  # no value formatted whole
    assert lines[0].startswith(f"colo-kit {argv[0]}: ") and words.replace("{files}", str(files)) in lines[0], lines[0]
    assert "Traceback" not in captured.err + captured.out


@pytest.mark.skipif(has_cuda(), reason="a GPU has sleep mode")
def test_sleep_mode_on_a_cpu_is_the_kits_one_line(nothing_runs, capsys):
    assert main(["train", "--vllm_enable_sleep_mode", "true"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "vllm_enable_sleep_mode=True: vLLM sleep mode needs an NVIDIA GPU" in lines[0], lines


@pytest.mark.parametrize("gpus, argv, words", [
    (0, ["--tensor-parallel-size", "8"], "--tensor-parallel-size 8: the CPU tier runs the evaluation with TP 1"),
    (0, ["--tensor-parallel-size", "2"], "--tensor-parallel-size 2: the CPU tier"),
    (2, ["--tensor-parallel-size", "8"],
     "--tensor-parallel-size 8: only 2 GPU(s) visible; give --tensor-parallel-size 2 or less"),
    (8, ["--tensor-parallel-size", "4", "--model", "qwen2.5-0.5b"],
     "qwen2.5-0.5b's 14 attention heads do not split evenly over 4"),
])
def test_eval_math500_tp_fits_the_machine(gpus, argv, words, nothing_runs, monkeypatch, capsys):
    from colo_kit_cli import eval_math500

    monkeypatch.setattr(eval_math500, "gpu_count", lambda: gpus)
    assert main(["eval-math500", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], lines


def test_good_train_settings_still_reach_the_run(monkeypatch, tmp_path):
    """The checks refuse only what would fail: edge values and TRL's own fields pass through."""
    import socket
    import types

    from colo_kit.grpo import train

    seen = {}

    def run_grpo(model, mode, **kwargs):
        seen.update(kwargs, mode=mode)
        return types.SimpleNamespace(rewards=[0.0], elapsed_s=0.0, to_dict=dict)

    monkeypatch.setattr(train, "run_grpo", run_grpo)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 1e-3\ngeneration_kwargs: {detokenize: false}\ntemperature: 0.7\nbeta: 0\n"
                      "reward: math500\n")
    monkeypatch.setattr("colo_kit.data.load_math", lambda: types.SimpleNamespace(map=lambda f: None))
    with socket.socket() as server:  # a listening socket stands for the server
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert main(["train", "--config", str(recipe), "--seed", "4294967295", "--loss_type", "dr_grpo",
                     "--max-completion-length", "2048", "--per_device_train_batch_size", "65536", "--mode", "server",
                     "--vllm-server-base-url", f"http://127.0.0.1:{server.getsockname()[1]}"]) == 0
    assert (seen["seed"], seen["loss_type"], seen["max_completion_length"], seen["per_device_train_batch_size"]) == \
        (4294967295, "dr_grpo", 2048, 65536)
    assert (seen["learning_rate"], seen["temperature"], seen["beta"], seen["generation_kwargs"]) == \
        (1e-3, 0.7, 0, {"detokenize": False})


def test_a_failed_build_leaves_no_partial_folder(tmp_path, monkeypatch):
    from colo_kit.models import build_model, model_dir

    monkeypatch.setenv("COLO_KIT_CACHE", str(tmp_path))
    with pytest.raises((ValueError, RuntimeError, OverflowError)):
        build_model("tiny", seed=10**20)  # past what torch.manual_seed takes: fails mid-build
    folder = model_dir("tiny-seed" + str(10**20))
    assert not folder.exists() and not list(folder.parent.glob(folder.name + ".partial*"))


@pytest.mark.parametrize("kv_only_sleep", [False, True])
def test_sleep_on_a_cpu_through_run_grpo_is_the_kits_error_before_any_model_loads(kv_only_sleep, monkeypatch):
    """run_grpo (the notebooks' way in) refuses sleep mode, or KV-only sleep, on a CPU with the kit's
    SleepModeUnavailable before it resolves a model: a model name that does not exist is never reached."""
    from colo_kit.colocate.sleep import SleepModeUnavailable
    from colo_kit.grpo import train

    monkeypatch.setattr(train, "has_cuda", lambda: False)
    with pytest.raises(SleepModeUnavailable, match="kv_only_sleep" if kv_only_sleep else "vllm_enable_sleep_mode"):
        train.run_grpo("no-such-model", vllm_enable_sleep_mode=True, kv_only_sleep=kv_only_sleep)
