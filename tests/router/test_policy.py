"""Which replica the policy picks: the longest prefix unless that replica is loaded past the bound, else the least
loaded; round robin in turn; a replica's /metrics read into its load."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvforge.router.policy import LoadBound, Policy
from kvforge.router.replica import Replica, parse_load

SYSTEM = "You are a terse assistant who answers in one word. "


def _replicas(n: int) -> list[Replica]:
    replicas = [Replica(f"http://replica-{i}:8000") for i in range(n)]
    for replica in replicas:
        replica.mark_up()
    return replicas


def test_a_shared_prefix_follows_its_first_replica() -> None:
    policy, replicas = Policy("prefix"), _replicas(2)
    first = policy.choose(replicas, SYSTEM + "Q: sky colour?")
    assert not first.prefix_hit
    for question in ("Q: grass colour?", "Q: two plus two?", "Q: capital of France?"):
        choice = policy.choose(replicas, SYSTEM + question)
        assert choice.replica is first.replica and choice.prefix_hit
    first.replica.num_in_flight = 4
    other = policy.choose(replicas, "Translate to French: good morning")  # no prefix: the least loaded
    assert other.replica is not first.replica and not other.prefix_hit


def test_an_overloaded_replica_loses_its_prefix_to_the_least_loaded() -> None:
    policy, (a, b) = Policy("prefix", LoadBound(max_queue_depth=2)), _replicas(2)
    b.num_in_flight = 1
    assert policy.choose([a, b], SYSTEM + "Q: 1").replica is a
    a.load.num_waiting = 3  # past the bound of 2 requests not started
    choice = policy.choose([a, b], SYSTEM + "Q: 2")
    assert choice.replica is b and not choice.prefix_hit
    a.load.num_waiting, a.load.kv_cache_usage = 0, 0.99  # its KV cache is full
    assert policy.choose([a, b], "Other prompt entirely, first seen").replica is b
    b.num_in_flight = 100
    assert policy.choose([a, b], SYSTEM + "Q: 3").replica is a  # b holds the prefix too, but is far busier


def test_a_restarted_replica_is_forgotten() -> None:
    policy, (a, b) = Policy("prefix"), _replicas(2)
    b.num_in_flight = 1
    assert policy.choose([a, b], SYSTEM + "Q: 1").replica is a
    policy.forget(a)
    a.num_in_flight, b.num_in_flight = 1, 0
    assert not policy.choose([a, b], SYSTEM + "Q: 2").prefix_hit


def test_round_robin_takes_turns() -> None:
    policy, replicas = Policy("round-robin"), _replicas(3)
    chosen = [policy.choose(replicas, SYSTEM).replica for _ in range(6)]
    assert chosen == replicas + replicas


def test_bad_policy_and_bound_are_named() -> None:
    with pytest.raises(ValueError, match="policy must be one of .*got 'random'"):
        Policy("random")
    with pytest.raises(ValueError, match="max_kv_cache_usage must be in"):
        LoadBound(max_kv_cache_usage=1.5)


def test_the_load_is_read_from_prometheus_text() -> None:
    registry = CollectorRegistry()
    Gauge("kvforge:num_requests_running", "", registry=registry).set(3)
    Gauge("kvforge:num_requests_waiting", "", registry=registry).set(5)
    Gauge("kvforge:kv_cache_usage_perc", "", registry=registry).set(0.25)
    Counter("kvforge:prefix_cache_hits", "", registry=registry).inc(7)
    load = parse_load(generate_latest(registry).decode())
    assert (load.num_running, load.num_waiting, load.kv_cache_usage, load.prefix_hit_tokens) == (3, 5, 0.25, 7)
    replica = _replicas(1)[0]
    replica.load, replica.num_in_flight = load, 10  # 2 sent that it has not seen yet
    assert replica.queue_depth == 7


def test_a_common_opening_alone_is_no_reason_to_follow() -> None:
    policy, (a, b) = Policy("prefix"), _replicas(2)
    assert policy.choose([a, b], "You are a pirate. " * 10).replica is a
    a.num_requests = 1  # as the router counts it: the idle replicas take turns
    choice = policy.choose([a, b], "You are a librarian. " * 10)  # 10 characters in common of 210
    assert choice.replica is b and not choice.prefix_hit
