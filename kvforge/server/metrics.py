"""Prometheus metrics on the server's own registry: engine gauges, token counters, latency histograms."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvforge.engine.async_engine import EngineStats
from kvforge.engine.stats import SpecDecodeStats
from kvforge.outputs import PoolingRequestOutput, RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_PER_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class _EngineCollector(Collector):
    """Reads the engine's latest stats snapshot at scrape time."""

    def __init__(self, get_stats: Callable[[], EngineStats], num_batch_slots: int, max_queue: int) -> None:
        self.get_stats = get_stats
        self.num_batch_slots = num_batch_slots
        self.max_queue = max_queue

    def collect(self) -> Iterator[Metric]:
        stats = self.get_stats()
        num_queued = max(0, stats.num_running + stats.num_waiting - self.num_batch_slots)
        gauges = [
            ("kvforge:num_requests_running", "Sequences in the running batch.", stats.num_running),
            ("kvforge:num_requests_waiting", "Sequences the scheduler has not started (or preempted).",
             stats.num_waiting),
            ("kvforge:admission_queue_depth", "Sequences beyond the batch slots: what --max-queue bounds.",
             num_queued),
            ("kvforge:admission_queue_limit", "The most sequences beyond the batch slots (--max-queue).",
             self.max_queue),
            ("kvforge:kv_cache_usage_perc", "Share of KV cache blocks in use (0 to 1).",
             stats.kv_cache_usage),
            ("kvforge:kv_cache_free_blocks", "Free KV cache blocks.", stats.num_free_blocks),
            ("kvforge:kv_cache_total_blocks", "Usable KV cache blocks.", stats.num_usable_blocks),
            ("kvforge:prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / tokens looked up.",
             stats.num_prefix_hit_tokens / max(stats.num_prefix_query_tokens, 1)),
        ]
        for name, text, value in gauges:
            yield GaugeMetricFamily(name, text, value=value)
        counters = [
            ("kvforge:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats.num_prefix_query_tokens),
            ("kvforge:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             stats.num_prefix_hit_tokens),
            ("kvforge:num_preemptions", "Sequences preempted (to be recomputed) for lack of KV blocks.",
             stats.num_preemptions),
        ]
        spec = stats.spec_decode
        counters += [
            ("kvforge:spec_decode_num_drafts", "Request-steps that verified draft tokens.", spec.num_verified_requests),
            ("kvforge:spec_decode_num_draft_tokens", "Draft tokens verified.", spec.num_draft_tokens),
            ("kvforge:spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens),
        ]
        for name, text, value in counters:
            yield CounterMetricFamily(name, text, value=value)
        yield from _per_position(spec)


def _per_position(spec: SpecDecodeStats) -> Iterator[Metric]:
    """Drafts verified and accepted at each draft position, labelled by position."""
    for name, text, values in [
        ("kvforge:spec_decode_num_draft_tokens_per_pos", "Draft tokens verified at each draft position.",
         spec.num_drafted_per_position),
        ("kvforge:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each draft position.",
         spec.num_accepted_per_position),
    ]:
        family = CounterMetricFamily(name, text, labels=["position"])
        for position, value in enumerate(values):
            family.add_metric([str(position)], value)
        yield family


class ServerMetrics:
    """All the server's metrics; `track` follows one engine request through its outputs."""

    def __init__(self, get_stats: Callable[[], EngineStats], num_batch_slots: int, max_queue: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(get_stats, num_batch_slots, max_queue))
        self.prompt_tokens = Counter("kvforge:prompt_tokens", "Prompt tokens of admitted requests.",
                                     registry=self.registry)
        self.generation_tokens = Counter("kvforge:generation_tokens", "Generated tokens.",
                                         registry=self.registry)
        self.requests = Counter("kvforge:request_success", "Finished sequences (samples) by finish reason.",
                                ["finished_reason"], registry=self.registry)
        self.rejected = Counter("kvforge:request_rejected", "Requests refused at admission: queue_full (503, "
                                "retry later) or never_fits (400, more sequences than slots + queue).",
                                ["reason"], registry=self.registry)
        self.lora_requests = Counter("kvforge:lora_request_success", "Finished sequences (samples) of each LoRA "
                                     "adapter by finish reason.", ["lora_name", "finished_reason"],
                                     registry=self.registry)
        self.lora_generation_tokens = Counter("kvforge:lora_generation_tokens", "Tokens generated with each LoRA "
                                              "adapter.", ["lora_name"], registry=self.registry)
        for reason in ("queue_full", "never_fits"):  # exposed (as 0) before the first rejection
            self.rejected.labels(reason=reason)
        self.ttft = Histogram("kvforge:time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("kvforge:time_per_output_token_seconds",
                              "Mean time between output tokens of a request, after the first.",
                              buckets=_PER_TOKEN_BUCKETS, registry=self.registry)
        self.e2e = Histogram("kvforge:e2e_request_latency_seconds", "Arrival to the last token.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def track(self, num_prompt_tokens: int, lora_name: str | None = None) -> RequestTracker:
        """lora_name: the LoRA adapter the request runs with, counted under its name too (None: the base model)."""
        self.prompt_tokens.inc(num_prompt_tokens)
        return RequestTracker(self, lora_name)


class RequestTracker:
    """Counts a request's new tokens as its outputs arrive; observes its latencies once it finishes. A pooling
    request finishes in its one output, as a success with finish reason "stop" (it generates nothing)."""

    __slots__ = ("lora_name", "metrics", "num_tokens")

    def __init__(self, metrics: ServerMetrics, lora_name: str | None = None) -> None:
        self.metrics = metrics
        self.lora_name = lora_name
        self.num_tokens = 0

    def update(self, output: RequestOutput | PoolingRequestOutput) -> None:
        if isinstance(output, PoolingRequestOutput):
            self.metrics.requests.labels(finished_reason="stop").inc()
            return
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        self.metrics.generation_tokens.inc(num_tokens - self.num_tokens)
        if self.lora_name is not None:
            self.metrics.lora_generation_tokens.labels(lora_name=self.lora_name).inc(num_tokens - self.num_tokens)
        self.num_tokens = num_tokens
        if not output.finished:
            return
        for completion in output.outputs:
            self.metrics.requests.labels(finished_reason=completion.finish_reason).inc()
            if self.lora_name is not None:
                reason = completion.finish_reason
                self.metrics.lora_requests.labels(lora_name=self.lora_name, finished_reason=reason).inc()
        times = output.metrics
        arrival, end = times["arrival_time"], times["now"]
        self.metrics.e2e.observe(end - arrival)
        first = times.get("first_token_time")
        if first is None:
            return
        self.metrics.ttft.observe(first - arrival)
        num_decoded = max(len(c.token_ids) for c in output.outputs) - 1
        if num_decoded > 0:
            self.metrics.tpot.observe((end - first) / num_decoded)
