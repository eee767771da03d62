"""One engine replica as the router sees it: its URL, health, load (read from its /metrics) and counters."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

# The replica's /metrics gauges the router reads (see kvforge.server.metrics).
_GAUGES = {"kvforge:num_requests_running": "num_running", "kvforge:num_requests_waiting": "num_waiting",
           "kvforge:kv_cache_usage_perc": "kv_cache_usage",
           "kvforge:prefix_cache_queries": "prefix_query_tokens", "kvforge:prefix_cache_hits": "prefix_hit_tokens"}


@dataclass(slots=True)
class ReplicaLoad:
    """What a replica's last /metrics said (zeros before the first read)."""

    num_running: float = 0.0
    num_waiting: float = 0.0
    kv_cache_usage: float = 0.0
    prefix_query_tokens: float = 0.0
    prefix_hit_tokens: float = 0.0


def parse_load(text: str) -> ReplicaLoad:
    """The gauges of a replica's Prometheus text (those it lacks stay 0)."""
    load = ReplicaLoad()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = _GAUGES.get(sample.name) or _GAUGES.get(sample.name.removesuffix("_total"))
            if name is not None:
                setattr(load, name, sample.value)
    return load


@dataclass(eq=False)
class Replica:
    """A replica behind the router.

    healthy: whether its last health check passed (a connection failure while proxying also clears it);
    num_in_flight: requests the router has sent it and not finished; down: set while it is out, so the
    streams still reading from it end at once instead of waiting on a dead connection."""

    url: str
    healthy: bool = False
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    num_in_flight: int = 0
    num_requests: int = 0  # sent to it, retries included
    num_prefix_hits: int = 0  # sent to it because its prefix was the longest
    num_failures: int = 0  # requests that failed on it for a connection error
    num_failed_checks: int = 0  # health checks failed in a row
    down: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.down.set()  # out until its first health check passes

    @property
    def queue_depth(self) -> float:
        """Requests it holds that have not started: waiting in its scheduler, or sent and not yet seen there."""
        unseen = self.num_in_flight - self.load.num_running - self.load.num_waiting
        return self.load.num_waiting + max(unseen, 0.0)

    def mark_up(self) -> None:
        if not self.healthy:
            logger.info("replica %s is up: taken in", self.url)
        self.healthy = True
        self.down.clear()

    def mark_down(self, reason: str) -> None:
        if self.healthy:
            logger.warning("replica %s is down (%s): taken out", self.url, reason)
        self.healthy = False
        self.down.set()

    async def check(self, http: httpx.AsyncClient, timeout: float, unhealthy_after: int) -> bool:
        """GET /health, then /metrics for its load. A refused connection takes it out at once, other failures
        (a timeout, a 503) after `unhealthy_after` in a row. True only when it was out and is in again (the
        caller forgets what it sent it: a restart empties its cache)."""
        was_healthy = self.healthy
        try:
            health = await http.get(f"{self.url}/health", timeout=timeout)
            if health.status_code != 200:
                raise ValueError(f"/health answered {health.status_code}")
            metrics = await http.get(f"{self.url}/metrics", timeout=timeout)
            self.load = parse_load(metrics.text) if metrics.status_code == 200 else ReplicaLoad()
        except (httpx.HTTPError, ValueError) as error:
            self.num_failed_checks += 1
            if isinstance(error, httpx.ConnectError) or self.num_failed_checks >= unhealthy_after:
                self.mark_down(f"{type(error).__name__}: {error}")
            return False
        self.num_failed_checks = 0
        self.mark_up()
        return not was_healthy
