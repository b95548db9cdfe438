"""The kit's proxy or vllm-router in front of the replicas: the measured comparison, as rows notebook 06 shows.

`scripts/router_compare.py` runs the kit's proxy, vllm-router (cache_aware, its defaults) and round-robin on the
same two vLLM-CPU replicas and writes `results/router_vs_proxy_cpu.json`; each row carries `source`, its path in
that JSON (`lookup(result, row["source"]) == row["value"]`), so every number shown can be traced to the run.
"""

from __future__ import annotations

LABELS = {"proxy_affinity": "colo_kit proxy (affinity)", "vllm_router": "vllm-router (cache_aware, defaults)",
          "vllm_router_api_key": "vllm-router with --api-key", "round_robin": "round-robin (colo_kit proxy)",
          "direct": "straight to a replica"}
CHECKS = {"adapter_broadcast": "an adapter load reaches every replica",
          "token_injection": "adds the replicas' API key",
          "pause_broadcast": "/pause reaches every replica",
          "replay_after_restart": "replays its adapters to a restarted replica"}
PER_RUN = (("hit_rate", "prefix-cache hit rate", "fraction of prompt tokens"),
           ("busiest_share", "busiest replica's share of requests", "fraction of requests"),
           ("wall_s", "wall time of the workload", "s"),
           ("render_calls", "tokenise calls (/v1/completions/render) sent to the replicas", "requests"))
PER_GROUPING = (("same_replica_group_fraction", "GRPO groups kept on one replica", "fraction of groups"),
                ("busiest_share", "busiest replica's share of requests", "fraction of requests"))
PARTS = {"stub": "stand-in replicas", "vllm": "vLLM-CPU replicas"}


def lookup(result: dict, source: str):
    """The value at `source`, a dotted path of keys (list indices as digits) into `result`."""
    value = result
    for key in source.split("."):
        value = value[int(key)] if isinstance(value, list) else value[key]
    return value


def router_table(result: dict) -> list[dict]:
    """Rows of {router, label, what, workload, value, unit, source, note} from a router comparison's JSON, one
    per measured number or capability check (value True/False, None when it could not be checked; `note` says
    what was observed). Parts or routers the run lacks give no rows; anything else malformed is one ValueError."""
    try:
        return _rows(result)
    except (AttributeError, KeyError, TypeError, IndexError, ValueError) as exc:
        raise ValueError(f"not a router comparison as scripts/router_compare.py writes it ({type(exc).__name__}: "
                         f"{str(exc)[:100]})") from None


def _rows(result: dict) -> list[dict]:
    rows: list[dict] = []

    def add(router, what, path, unit, workload=None, note=None):
        source = ".".join(str(p) for p in path)
        rows.append({"router": router, "label": LABELS.get(router, router), "what": what, "workload": workload,
                     "value": lookup(result, source), "unit": unit, "source": source, "note": note})

    for workload, entry in result.get("vllm", {}).get("workloads", {}).items():
        for router in LABELS:
            for key, what, unit in PER_RUN:
                if key in entry.get(router, {}):
                    add(router, what, ("vllm", "workloads", workload, router, key), unit, workload)
    for part, where in PARTS.items():
        latency = result.get(part, {}).get("latency", {})
        note = latency.get("note") if latency.get("valid_run", True) else \
            "not a valid run: errors, or the machine could not keep the schedule"
        for router, added in latency.get("added_ms", {}).items():
            for q in ("p50", "p99"):
                add(router, f"added latency {q} vs straight to a replica", (part, "latency", "added_ms", router, q),
                    "ms", f"open loop, {where}", note)
        for router, grouping in latency.get("groups", {}).items():
            for key, what, unit in PER_GROUPING:
                add(router, what, (part, "latency", "groups", router, key), unit, f"open loop, {where}", note)
    for check, per in result.get("capabilities", {}).items():
        for router, c in per.items():
            add(router, CHECKS.get(check, check), ("capabilities", check, router, "ok"), "passed",
                note=f"{c.get('observed', '')} ({PARTS.get(c.get('on'), c.get('on'))})")
    return rows
