"""The prefix-cache hit rate the proxy's routing buys, measured by the replicas themselves.

Two vLLM replicas of the kit's tiny model behind `colo_kit.async_lora.proxy`, on this machine (vLLM-CPU here, one
replica per GPU on a GPU node), and two GRPO-shaped workloads, each under round-robin and under
prefix affinity, caches reset before each run:

- `groups`: every group of G = 8 requests shares one prompt (TRL's rollout worker, post 2);
- `shared_prefix`: every prompt starts with the same long preamble (a system prompt, few-shot
  examples) and ends in a question of its own, G = 2 each.

The hit rate is the replicas' own counters (`vllm:prefix_cache_hits / queries`, in tokens), so it
does not depend on how fast the machine is: a CPU run measures it as well as a GPU run.

    python scripts/prefix_hit_rate.py --out results/proxy_prefix_hits.json     (~4 min on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import colo_kit  # noqa: E402

colo_kit.setup()  # the runtime defaults, before torch or vLLM is imported


def main(argv=None) -> int:
    from colo_kit_cli.commands import writable_file
    from colo_kit.env import describe
    from colo_kit.parallel.launch import free_port
    from colo_kit.async_lora.lora import replica_launch
    from colo_kit.models import resolve_model
    from colo_kit.paths import runs_dir
    from colo_kit.async_lora.replicas import compare_routing, launch_replicas, placement

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(runs_dir() / "proxy_prefix_hits.json"))
    a = ap.parse_args(argv)
    out_path = writable_file(a.out, "--out")
    os.environ.setdefault("COLO_KIT_PREFIX_KEY", "prefix-hit-rate-key")
    model = resolve_model("tiny")
    places = placement(2, share_gib=12)
    block = 16 if places[0]["gpu"] is not None else 32  # vLLM-CPU needs a multiple of 32
    launches = [replica_launch(model, port=free_port(), max_staleness=1, api_key_env="COLO_KIT_PREFIX_KEY",
                               block_size=block, max_model_len=1024, gpu=p["gpu"],
                               gpu_memory_utilization=p["gpu_memory_utilization"],
                               enforce_eager=p["gpu"] is not None or None)
                for p in places]
    workloads = {
        "groups": dict(groups=16, group_size=8, prompt_tokens=8 * block + 1, shared_prefix_tokens=0),
        "shared_prefix": dict(groups=32, group_size=2, prompt_tokens=16 * block + 5, shared_prefix_tokens=12 * block),
    }
    out = {"what": __doc__.split("\n\n")[0], "env": describe(), "model": "tiny (random weights)",
           "block_size": block, "workloads": {}}
    t0 = time.time()
    with launch_replicas(launches, tempfile.mkdtemp(prefix="colo_kit_prefix_")) as reps:
        out["replica_startup_s"] = reps.startup_s
        for name, load in workloads.items():
            res = compare_routing(reps.urls, model, token_env="COLO_KIT_PREFIX_KEY", block_size=block,
                                  max_tokens=4, concurrent_groups=2, vocab=1900, **load)
            out["workloads"][name] = res
            print(f"{name}: round-robin {res['round_robin']['hit_rate']:.3f}, affinity {res['affinity']['hit_rate']:.3f}"
                  f" (x{res.get('affinity_over_round_robin')}); requests per replica "
                  f"{res['round_robin']['requests_per_replica']} vs {res['affinity']['requests_per_replica']}",
                  flush=True)
    out["wall_s"] = round(time.time() - t0, 1)
    out_path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
