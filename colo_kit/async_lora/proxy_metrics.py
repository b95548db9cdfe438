"""The routing proxy's counters and handler time, served by `/metrics` as JSON or Prometheus text. Notebook 06."""

from __future__ import annotations

import math
from collections import deque

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

COUNTERS = ("requests", "routed", "affinity_hits", "fallbacks", "retries", "errors", "refused", "broadcasts",
            "broadcast_failures", "recoveries", "replay_failures", "client_hangups", "shed", "idle_closed")
PER_REPLICA = ("requests", "inflight", "failures", "affinity_hits", "healthy")

# tens of microseconds for TRL's short prompts, milliseconds for a long one hashed in a thread; past 0.1 s is a fault
HANDLER_BUCKETS_S = (25e-6, 50e-6, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


class ProxyMetrics:
    """Counters, handler time, and their Prometheus registry; `snapshot` (the proxy's) is read at each scrape."""

    def __init__(self, snapshot):
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.snapshot = snapshot
        self._handler_ms: deque[float] = deque(maxlen=8192)  # recent samples: the JSON's p50/p90/p99
        self.registry = CollectorRegistry()
        self.handler_seconds = Histogram("colo_proxy_handler_seconds", "the proxy's own time per routed request",
                                         buckets=HANDLER_BUCKETS_S, registry=self.registry)
        self.registry.register(self)  # a custom collector: `collect` below

    def record(self, rep, hit: bool, chain, policy: str, own_s: float) -> None:
        """A routed request's first answer came back from `rep`."""
        self.counters["routed"] += 1
        if chain:
            if hit:
                self.counters["affinity_hits"] += 1
                rep.affinity_hits += 1
            elif policy == "affinity":
                self.counters["fallbacks"] += 1
        self._handler_ms.append(1e3 * own_s)
        self.handler_seconds.observe(own_s)

    def handler_ms(self) -> dict:
        """p50/p90/p99 (ms) of the recent handler times, and their count."""
        lat = self._handler_ms
        out = {f"p{p}": round(percentile(lat, p), 4) if lat else None for p in (50, 90, 99)}
        return {**out, "n": len(lat)}

    def prometheus_text(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self):
        """The snapshot's counters and gauges, read at each scrape."""
        snap = self.snapshot()
        for name in COUNTERS:
            yield CounterMetricFamily(f"colo_proxy_{name}", f"proxy {name.replace('_', ' ')}", value=snap[name])
        for name in PER_REPLICA:
            g = GaugeMetricFamily(f"colo_proxy_replica_{name}", f"per replica: {name}", labels=["replica"])
            for url, r in snap["replicas"].items():
                g.add_metric([url], float(r[name]))
            yield g
        yield GaugeMetricFamily("colo_proxy_load_imbalance", "max over mean requests per replica",
                                value=snap["load_imbalance_max_over_mean"] or 0)


def percentile(values, p: float) -> float:
    """Nearest-rank percentile of raw samples."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))] if s else float("nan")
