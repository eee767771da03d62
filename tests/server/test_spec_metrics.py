"""/metrics shows the engine's speculation counters, per draft position too."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvforge.engine.stats import EngineStats, SpecDecodeStats
from kvforge.server.metrics import ServerMetrics


def test_speculation_counters_are_exported():
    spec = SpecDecodeStats(num_verified_requests=3, num_drafted_per_position=(3, 2),
                           num_accepted_per_position=(2, 1))
    stats = EngineStats(num_running=1, num_waiting=0, num_free_blocks=10, num_usable_blocks=20,
                        num_prefix_query_tokens=0, num_prefix_hit_tokens=0, num_preemptions=0, spec_decode=spec)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(ServerMetrics(lambda: stats, 4, 8).render().decode())
               for s in family.samples}
    assert samples[("kvforge:spec_decode_num_draft_tokens_total", ())] == 5
    assert samples[("kvforge:spec_decode_num_accepted_tokens_total", ())] == 3
    assert samples[("kvforge:spec_decode_num_accepted_tokens_per_pos_total", (("position", "1"),))] == 1
    assert spec.mean_accepted_length == 2.0 and spec.acceptance_per_position == (2 / 3, 0.5)
