"""The kit's proxy vs vllm-router (scripts/router_compare.py): the committed evidence read back through
`record.router_compare.router_table`, every number traced to its place in the JSON; and, slow, the capability
checks run against the kit's proxy on stand-in replicas (vllm-router is not in the kit's environment: its part
runs only where `VLLM_ROUTER_BIN` names one)."""

import importlib.util
import json
import os

import pytest

from colo_kit.paths import REPO_ROOT
from record.router_compare import CHECKS, lookup, router_table

RESULT = REPO_ROOT / "results" / "router_vs_proxy_cpu.json"
ROUTERS = {"proxy_affinity", "vllm_router", "round_robin"}
WORKLOADS = {"groups_ids", "groups_text", "shared_prefix_ids", "shared_prefix_text"}


@pytest.fixture(scope="module")
def result():
    return json.loads(RESULT.read_text())


def test_every_row_has_its_shape_and_its_number_comes_from_the_json(result):
    rows = router_table(result)
    assert rows
    for row in rows:
        assert set(row) == {"router", "label", "what", "workload", "value", "unit", "source", "note"}
        assert row["value"] is None or isinstance(row["value"], (bool, int, float)), row
        assert lookup(result, row["source"]) == row["value"], row  # the number is the one at its source
        assert row["unit"] and row["label"] and row["what"]


def test_the_committed_run_covers_every_router_workload_and_check(result):
    rows = router_table(result)
    hit = [r for r in rows if r["what"] == "prefix-cache hit rate"]
    assert {r["router"] for r in hit} == ROUTERS and {r["workload"] for r in hit} == WORKLOADS
    assert len(hit) == len(ROUTERS) * len(WORKLOADS)
    assert all(0 < r["value"] <= 1 for r in hit)
    added = {(r["router"], r["what"]) for r in rows if r["unit"] == "ms" and "stand-in" in r["workload"]}
    assert {router for router, _ in added} == ROUTERS and len(added) == 2 * len(ROUTERS)
    checks = {(r["router"], r["what"]): r for r in rows if r["unit"] == "passed"}
    for check in CHECKS.values():
        assert ("proxy_affinity", check) in checks and ("vllm_router", check) in checks
    # what the kit's notebook says of its proxy holds in the evidence, each check observed, not assumed
    assert all(r["value"] is True for (router, _), r in checks.items() if router == "proxy_affinity")
    assert all(r["note"] for r in checks.values())


def test_the_evidence_says_where_it_ran_and_with_which_versions(result):
    assert result["vllm_router"]["version"] and result["vllm_router"]["not_run"] is None
    for part in ("stub", "vllm"):
        assert "error" not in result[part], result[part].get("error")
        assert result[part]["env"]["versions"]["vllm"] and result[part]["env"]["cpu_count"]
    assert result["stub"]["latency"]["valid_run"] is True
    for workload in WORKLOADS:
        settings = result["vllm"]["workloads"][workload]["settings"]
        assert settings["group_size"] in (2, 8) and settings["prompt_form"] in ("ids", "text")


def test_a_run_without_vllm_router_or_a_part_gives_fewer_rows_not_an_error():
    partial = {"vllm_router": {"version": None, "not_run": "no vllm-router executable"},
               "stub": {"latency": {"valid_run": False, "added_ms": {"proxy_affinity": {"p50": 0.5, "p99": 2.0}},
                                    "groups": {}}},
               "capabilities": {"token_injection": {"proxy_affinity": {"ok": True, "observed": "HTTP 200", "on": "stub"}}}}
    rows = router_table(partial)
    assert [(r["router"], r["what"], r["value"]) for r in rows] == [
        ("proxy_affinity", "added latency p50 vs straight to a replica", 0.5),
        ("proxy_affinity", "added latency p99 vs straight to a replica", 2.0),
        ("proxy_affinity", "adds the replicas' API key", True)]
    assert rows[0]["note"].startswith("not a valid run") and rows[2]["note"] == "HTTP 200 (stand-in replicas)"
    assert router_table({}) == []


@pytest.mark.parametrize("bad", [[], {"vllm": []}, {"vllm": {"workloads": {"w": {"proxy_affinity": 3}}}},
                                 {"stub": {"latency": {"added_ms": {"proxy_affinity": {"p50": 1}}}}},
                                 {"capabilities": {"token_injection": {"proxy_affinity": "yes"}}}])
def test_a_malformed_comparison_is_one_line(bad):
    with pytest.raises(ValueError, match="not a router comparison as scripts/router_compare.py writes it"):
        router_table(bad)


def _script():
    spec = importlib.util.spec_from_file_location("router_compare_script", REPO_ROOT / "scripts" / "router_compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_checks_pass_for_the_kits_proxy_on_stand_in_replicas(tmp_path):
    """The script's stub part, for real and short: stand-ins, the kit's proxy under both policies as processes,
    the open-loop latency run, and each capability check with a stand-in restarted. Every process the part starts
    has a deadline and is stopped in its `finally` (process groups)."""
    script = _script()
    router_bin = os.environ.get("VLLM_ROUTER_BIN")  # CI has none: the kit's side alone
    out = script.stub_part(router_bin, rate=100, seconds=4, log_dir=tmp_path, replay_wait_s=15)  # a slice each
    latency = out["latency"]
    assert not latency["errors"], latency["first_error"]
    assert latency["groups"]["proxy_affinity"]["same_replica_group_fraction"] >= 0.9  # the load bound may split one
    assert latency["groups"]["round_robin"]["same_replica_group_fraction"] == 0.0
    caps = out["capabilities"]
    for check in CHECKS:
        assert caps[check]["proxy_affinity"]["ok"] is True, caps[check]["proxy_affinity"]["observed"]
    if router_bin:  # where vllm-router is at hand, it shows what the committed evidence says
        committed = json.loads(RESULT.read_text())["stub"]["capabilities"]
        for check in CHECKS:
            for name, c in caps[check].items():
                assert c["ok"] == committed[check][name]["ok"], (check, name, c["observed"])
