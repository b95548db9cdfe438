"""Integration: the tiny model in real vLLM (CPU, in-process) and a real TRL GRPO colocate run."""

import pytest

from colo_kit.env import has_cuda
from colo_kit.grpo.train import grpo_config, run_grpo


@pytest.mark.slow
def test_vllm_generates_from_the_tiny_model(tiny_model_path):
    from vllm import LLM, SamplingParams

    # a small share: on a GPU vLLM's default 0.9 must be free at start-up, beside whatever this process holds
    llm = LLM(model=tiny_model_path, max_model_len=256, seed=0, enforce_eager=True, gpu_memory_utilization=0.2)
    outs = llm.generate(["TL;DR:"] * 3, SamplingParams(n=2, max_tokens=16, temperature=1.0, ignore_eos=True),
                        use_tqdm=False)
    assert len(outs) == 3 and all(len(o.outputs) == 2 for o in outs)
    assert all(len(c.token_ids) == 16 and c.text for o in outs for c in o.outputs)


@pytest.mark.slow
def test_grpo_colocate_learns_the_length_reward(colocate_grpo_run):
    """conftest's run: 30 steps of 16 completions (8 a prompt), 32 tokens, lr 5e-3, seed 0, eager vLLM."""
    run = colocate_grpo_run.run
    assert len(run.steps) == 30
    assert all(s["completions/max_length"] <= 32 for s in run.steps)
    cpu = not has_cuda()
    assert run.settings["layerwise_reload_patch"] is cpu  # vLLM-CPU's reload fix; TRL's own sync on a GPU
    assert run.settings["gradient_checkpointing"] is not cpu  # off on a CPU; a GPU keeps TRL's default (on)
    first, last = sum(run.rewards[:5]) / 5, sum(run.rewards[-5:]) / 5
    assert last > first + 30, f"reward did not rise: first five {run.rewards[:5]}, last five {run.rewards[-5:]}"
    # vLLM samples from the trainer's current weights: their log-probs agree (a stale engine drifts to ~2 nats)
    assert max(run.series("sampling/sampling_logp_difference/mean")) < 0.05


def test_config_validation_names_the_bad_value(tmp_path):
    with pytest.raises(ValueError, match="per_device_train_batch_size=6 must be a multiple of num_generations=4"):
        grpo_config(output_dir=tmp_path, per_device_train_batch_size=6, num_generations=4)
    with pytest.raises(ValueError, match="vllm_gpu_memory_utilization=1.5"):
        grpo_config(output_dir=tmp_path, vllm_gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="mode='async'"):
        grpo_config("async", output_dir=tmp_path)
    with pytest.raises(ValueError, match="needs vllm_server_base_url, or vllm_server_host"):
        grpo_config("server", output_dir=tmp_path)
    with pytest.raises(ValueError, match="kv_only_sleep=True .* needs vllm_enable_sleep_mode=True"):
        run_grpo("tiny", "colocate", kv_only_sleep=True, output_dir=tmp_path)


def test_server_mode_takes_trls_base_url_or_host_and_port(tmp_path):
    by_url = grpo_config("server", output_dir=tmp_path, vllm_server_base_url="http://10.0.0.5:8000")
    assert (by_url.vllm_mode, by_url.vllm_server_base_url) == ("server", "http://10.0.0.5:8000")
    by_host = grpo_config("server", output_dir=tmp_path, vllm_server_host="10.0.0.5", vllm_server_port=8001)
    assert (by_host.vllm_server_base_url, by_host.vllm_server_host, by_host.vllm_server_port) == (None, "10.0.0.5", 8001)


def test_checkpointing_is_off_on_cpu_trls_default_on_gpu_and_an_override_wins(tmp_path):
    from trl import GRPOConfig

    assert GRPOConfig(output_dir=str(tmp_path), use_cpu=True).gradient_checkpointing is True  # TRL's default
    assert grpo_config(output_dir=tmp_path).gradient_checkpointing is has_cuda()
    assert grpo_config(output_dir=tmp_path, gradient_checkpointing=True).gradient_checkpointing is True
    assert grpo_config(output_dir=tmp_path, gradient_checkpointing=False).gradient_checkpointing is False


def test_a_server_mode_run_gives_trl_its_own_weight_sync_back_even_when_it_fails(tiny_model_path, tmp_path):
    import requests
    from trl.generation.vllm_client import VLLMClient

    from colo_kit.parallel.launch import free_port

    own = VLLMClient.init_communicator
    with pytest.raises(requests.ConnectionError, match="can't be reached"):  # nobody serves there; TRL gives up after 1 s
        run_grpo("tiny", "server", vllm_server_base_url=f"http://127.0.0.1:{free_port()}", http_weight_sync=True,
                 max_steps=1, num_generations=2, per_device_train_batch_size=2, output_dir=tmp_path, vllm_server_timeout=1)
    assert VLLMClient.init_communicator is own
