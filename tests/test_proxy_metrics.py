"""The proxy's numbers without a server: the handler-time histogram and what /metrics shows of it."""

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from colo_kit.async_lora.proxy_metrics import percentile
from colo_kit.async_lora.proxy_metrics import HANDLER_BUCKETS_S, ProxyMetrics


def _metrics():
    rep = SimpleNamespace(affinity_hits=0, requests=3, inflight=0, failures=0, healthy=True)

    def snapshot():
        return {**m.counters, "load_imbalance_max_over_mean": 1.0,
                "replicas": {"http://r0": {k: getattr(rep, k) for k in ("requests", "inflight", "failures",
                                                                        "affinity_hits", "healthy")}}}

    m = ProxyMetrics(snapshot)
    return m, rep


def test_handler_time_is_a_histogram_in_seconds():
    m, rep = _metrics()
    for own_s in (30e-6, 200e-6, 0.004):
        m.record(rep, hit=True, chain=[b"k"], policy="affinity", own_s=own_s)
    families = {f.name: f for f in text_string_to_metric_families(m.prometheus_text().decode())}
    hist = families["colo_proxy_handler_seconds"]
    assert hist.type == "histogram"
    samples = {(s.name, s.labels.get("le")): s.value for s in hist.samples}
    assert samples[("colo_proxy_handler_seconds_count", None)] == 3
    assert abs(samples[("colo_proxy_handler_seconds_sum", None)] - 0.00423) < 1e-9
    assert samples[("colo_proxy_handler_seconds_bucket", "5e-05")] == 1
    assert samples[("colo_proxy_handler_seconds_bucket", "0.00025")] == 2
    assert samples[("colo_proxy_handler_seconds_bucket", "+Inf")] == 3
    assert sum(name.endswith("_bucket") for name, _ in samples) == len(HANDLER_BUCKETS_S) + 1
    assert families["colo_proxy_routed"].samples[0].value == 3
    assert families["colo_proxy_affinity_hits"].samples[0].value == 3 and rep.affinity_hits == 3
    assert not any("quantile" in name for name in families)


def test_json_percentiles_come_from_the_samples():
    m, rep = _metrics()
    assert m.handler_ms() == {"p50": None, "p90": None, "p99": None, "n": 0}
    for ms in range(1, 101):
        m.record(rep, hit=False, chain=None, policy="round_robin", own_s=ms / 1e3)
    assert m.handler_ms() == {"p50": 50.0, "p90": 90.0, "p99": 99.0, "n": 100}  # nearest rank
    assert m.counters["routed"] == 100 and m.counters["fallbacks"] == 0
    assert percentile(range(1, 101), 50) == 50 and percentile([], 99) != percentile([], 99)  # nan when empty
