"""The router's /metrics: per replica its health, requests sent, prefix hits, failures, requests in flight and
the load it last reported; for the router its retries and the requests no replica could take."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvforge.router.proxy import Forwarder
from kvforge.router.replica import Replica

# (name, help, kind, value of a replica)
_PER_REPLICA = (
    ("kvforge_router:replica_healthy", "1 while the replica is in (its health checks pass).", "gauge",
     lambda r: float(r.healthy)),
    ("kvforge_router:replica_requests", "Requests sent to the replica (retries included).", "counter",
     lambda r: r.num_requests),
    ("kvforge_router:replica_prefix_hits", "Requests sent to the replica for the prefix it holds.", "counter",
     lambda r: r.num_prefix_hits),
    ("kvforge_router:replica_failures", "Requests that failed on the replica for a connection error.", "counter",
     lambda r: r.num_failures),
    ("kvforge_router:replica_in_flight", "Requests sent to the replica and not finished.", "gauge",
     lambda r: r.num_in_flight),
    ("kvforge_router:replica_queue_depth", "Requests the replica holds that have not started.", "gauge",
     lambda r: r.queue_depth),
    ("kvforge_router:replica_kv_cache_usage", "Share of the replica's KV cache in use, as it last reported.",
     "gauge", lambda r: r.load.kv_cache_usage),
    ("kvforge_router:replica_prefix_cache_queries", "Prompt tokens the replica looked up in its prefix cache, as "
     "it last reported.", "gauge", lambda r: r.load.prefix_query_tokens),
    ("kvforge_router:replica_prefix_cache_hits", "Prompt tokens the replica found in its prefix cache, as it last "
     "reported.", "gauge", lambda r: r.load.prefix_hit_tokens),
)


class _RouterCollector(Collector):
    def __init__(self, replicas: Sequence[Replica], forwarder: Forwarder) -> None:
        self.replicas = replicas
        self.forwarder = forwarder

    def collect(self) -> Iterator[Metric]:
        for name, text, kind, value_of in _PER_REPLICA:
            family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = family_type(name, text, labels=["replica"])
            for replica in self.replicas:
                family.add_metric([replica.url], value_of(replica))
            yield family
        yield CounterMetricFamily("kvforge_router:retries", "Requests sent again after a replica failed them.",
                                  value=self.forwarder.num_retries)
        yield CounterMetricFamily("kvforge_router:unserved", "Requests answered 503: no replica left to try.",
                                  value=self.forwarder.num_unserved)


def render_metrics(replicas: Sequence[Replica], forwarder: Forwarder) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_RouterCollector(replicas, forwarder))
    return generate_latest(registry)
