#!/usr/bin/env bash
# Issue 8 on 2 GPUs: two vLLM replicas (one per GPU) of a random-init Qwen2.5-1.5B launched from
# colo_kit's LoRA recipe, the routing proxy in front, a rank-1 adapter loaded on both through the
# proxy's broadcast and probed, then the prefix-cache hit rate of GRPO traffic (G=8 requests per
# prompt) under round-robin vs prefix-affinity routing, read from the replicas' own /metrics.
# Also the proxy's loopback latency benchmark on this (less crowded) host.
#
#   bash scripts/gpu/async_lora.sh            # on 2 GPUs, from the repo root, stack sourced (~3-4 min)
#   PYTHON=.venv/bin/python bash scripts/gpu/async_lora.sh --smoke   # CPU dress rehearsal, tiny model
#
# Writes results/async_lora_gpu.json and results/proxy_bench_gpu_host.json, copies both to $OUT.
set -uo pipefail
PY=${PYTHON:-python3}
SMOKE=0
[[ "${1:-}" == "--smoke" ]] && SMOKE=1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1
mkdir -p results
JSON=results/async_lora_gpu.json
[[ $SMOKE == 1 ]] && JSON=results/runs/async_lora_smoke.json && mkdir -p results/runs
t0=$(date +%s)

echo "[async_lora] 1/2 replicas + proxy + hit rate -> $JSON"
SMOKE=$SMOKE JSON=$JSON timeout 270 "$PY" - <<'EOF'
import json, os, sys, time, tempfile, traceback
import colo_kit
from colo_kit.env import describe, has_cuda
from colo_kit.async_lora.lora import replica_launch, probe_adapters, max_loras_for, max_lora_rank_for
from colo_kit.models import build_model
from colo_kit.async_lora.replicas import launch_replicas, compare_routing
from colo_kit.async_lora.proxy import ProxyConfig, RoutingProxy

smoke = os.environ["SMOKE"] == "1"
out_path = os.environ["JSON"]
os.environ.setdefault("COLO_KIT_REPLICA_KEY", "gpu-run-key")
out = {"what": "two vLLM replicas behind colo_kit's proxy: adapter broadcast + probe, prefix-cache hit rate "
               "round-robin vs affinity (G=8)", "env": describe(), "smoke": smoke, "steps": {}}

def save():
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)

t = time.time()
preset = "tiny" if smoke else "qwen2.5-1.5b"
model = str(build_model(preset))
out["steps"]["build_model_s"] = round(time.time() - t, 1)
out["model"] = {"preset": preset, "path": model, "random_weights": True}
print(f"[async_lora] model {preset} ready in {out['steps']['build_model_s']} s", flush=True)

block = 32 if smoke else 16          # vLLM's CPU attention needs multiples of 32
staleness = 4
n = 2
kw = dict(max_staleness=staleness, lora_rank=1, api_key_env="COLO_KIT_REPLICA_KEY", block_size=block)
if smoke:
    kw.update(max_model_len=1024)
else:
    kw.update(max_model_len=4096, gpu_memory_utilization=0.85, dtype="bfloat16")
launches = [replica_launch(model, port=18201 + i, gpu=None if smoke else i, **kw) for i in range(n)]
out["recipe"] = {"max_loras": max_loras_for(staleness), "max_lora_rank": max_lora_rank_for(1), "block_size": block,
                 "launch": [l.shell() for l in launches]}
save()
log_dir = tempfile.mkdtemp(prefix="colo_kit_async_lora_")
try:
    t = time.time()
    with launch_replicas(launches, log_dir, timeout_s=200) as reps:
        out["steps"]["replicas_up_s"] = round(time.time() - t, 1)
        out["replica_startup_s"] = reps.startup_s
        print(f"[async_lora] replicas healthy after {reps.startup_s} s", flush=True)
        save()
        # a rank-1, alpha-2 adapter (the post's), loaded on both replicas through one broadcast
        try:
            import torch, httpx
            from peft import LoraConfig, get_peft_model
            from transformers import AutoModelForCausalLM
            from colo_kit.async_lora.lora import adapter_dir
            m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
            pm = get_peft_model(m, LoraConfig(r=1, lora_alpha=2, target_modules="all-linear", init_lora_weights=False))
            shared = tempfile.mkdtemp(prefix="colo_kit_bucket_")
            path = adapter_dir(shared, 1)  # where TRL's AsyncGRPOTrainer publishes version 1
            pm.save_pretrained(path)
            proxy = RoutingProxy(ProxyConfig(replicas=reps.urls, port=0, token_env="COLO_KIT_REPLICA_KEY",
                                             block_size=block, adapter_root=str(path.parent))).start_in_thread()
            try:
                t = time.time()
                r = httpx.post(proxy.url + "/v1/load_lora_adapter", timeout=120,
                               json={"lora_name": "trl-policy-v1", "lora_path": str(path), "load_inplace": False})
                out["adapter"] = {"load_status": r.status_code, "load_s": round(time.time() - t, 3),
                                  "bytes": sum(f.stat().st_size for f in path.iterdir()),
                                  "probe": probe_adapters(reps.urls, "trl-policy-v1", str(path),
                                                          token=os.environ["COLO_KIT_REPLICA_KEY"])}
            finally:
                proxy.stop_thread()
            served = "trl-policy-v1"
        except Exception as exc:
            out["adapter"] = {"error": traceback.format_exc()[-2000:]}
            served = model
        print(f"[async_lora] adapter: {str(out['adapter'])[:300]}", flush=True)
        save()
        try:
            t = time.time()
            exp = dict(groups=12, group_size=8, prompt_tokens=8 * block + 1, max_tokens=8, concurrent_groups=2,
                       vocab=1900) if smoke else \
                  dict(groups=64, group_size=8, prompt_tokens=64 * block + 1, max_tokens=32, concurrent_groups=8,
                       vocab=150000)
            out["prefix_cache"] = compare_routing(reps.urls, served, token_env="COLO_KIT_REPLICA_KEY",
                                                  block_size=block, **exp)
            out["steps"]["hit_rate_s"] = round(time.time() - t, 1)
            print("[async_lora] hit rate: " + json.dumps({k: (v["hit_rate"] if isinstance(v, dict) else v)
                                                         for k, v in out["prefix_cache"].items()}), flush=True)
        except Exception:
            out["prefix_cache"] = {"error": traceback.format_exc()[-2000:]}
        save()
except Exception:
    out["error"] = traceback.format_exc()[-3000:]
    for i in range(n):
        p = os.path.join(log_dir, f"replica{i}.log")
        if os.path.exists(p):
            out.setdefault("replica_log_tails", {})[i] = open(p).read()[-3000:]
    print(out["error"], flush=True)
save()
print(f"[async_lora] wrote {out_path}", flush=True)
EOF
echo "[async_lora] part 1 exit $? after $(( $(date +%s) - t0 )) s"

echo "[async_lora] 2/2 proxy loopback benchmark on this host"
BENCH=results/proxy_bench_gpu_host.json
[[ $SMOKE == 1 ]] && BENCH=results/runs/proxy_bench_smoke.json
timeout 60 "$PY" scripts/bench_proxy.py --skip-vllm --seconds 10 --out "$BENCH" | tail -25
echo "[async_lora] part 2 exit $? after $(( $(date +%s) - t0 )) s"

if [[ -n "${OUT:-}" ]]; then
  cp -f "$JSON" "$BENCH" "$OUT"/ 2>/dev/null || true
  ls -l "$OUT"
fi
echo "[async_lora] done in $(( $(date +%s) - t0 )) s"
