"""The speculation policy stepped by hand: how many drafts each request gets for given acceptance histories
and step costs, when a request stops drafting, how it probes and comes back."""

from __future__ import annotations

import pytest

from kvforge.spec_decode.policy import SpeculationPolicy, StepCosts

BUCKETS = (1, 2, 4, 5, 8, 10, 15, 16)  # the default compile buckets with 4 drafts, up to 16 rows


def _policy(costs: StepCosts | None = None, k: int = 4, max_rows: int = 16) -> SpeculationPolicy:
    return SpeculationPolicy(k, max_rows, costs or StepCosts(BUCKETS))


def _run(policy: SpeculationPolicy, num_steps: int, num_accepted) -> list[int]:
    """Drafts planned for request "a" over num_steps steps; num_accepted(k) of each verification's k drafts
    are accepted (the proposer always offers as many as planned)."""
    planned = []
    for _ in range(num_steps):
        k = policy.plan(["a"])["a"]
        planned.append(k)
        if k:
            policy.record("a", k, num_accepted(k))
    return planned


def test_unmeasured_costs_follow_the_default_shape_padded_to_the_buckets():
    costs = StepCosts(BUCKETS)
    assert [costs.cost(rows) for rows in (1, 2, 3, 4, 5, 6)] == [1.0, 1.25, 1.75, 1.75, 2.0, 2.75]
    for _ in range(3):
        costs.record(1, 0.010)
        costs.record(5, 0.030)
    costs.record(5, 9.0)  # a stall (a compile, another process): the median ignores it
    # measured rows as measured; others from the nearest measured row count along the default shape
    assert [round(costs.cost(rows), 5) for rows in (1, 2, 3, 5)] == [0.010, 0.0125, 0.02625, 0.030]


def test_a_new_request_drafts_one_token_then_more_as_its_drafts_are_accepted():
    # prior a = 0.5: 1 + 0.5 = 1.5 beats cost(2) / cost(1) = 1.25 by the most (1.2x)
    policy = _policy()
    assert _run(policy, 3, lambda k: k) == [1, 3, 4]
    assert policy.acceptance("a") == pytest.approx(0.9365, abs=1e-4)


def test_measured_costs_decide_the_number_of_drafts():
    policy = _policy()
    _run(policy, 3, lambda k: k)  # a = 0.94
    for _ in range(3):
        policy.costs.record(1, 0.010)
        policy.costs.record(5, 0.030)
    # a 5-row step at 3x: 4 drafts expect 1 + a + .. + a^4 = 4.2 tokens in 3x (1.40x); 1 draft 1.94 in 1.25x (1.55x)
    assert policy.plan(["a"]) == {"a": 1}
    for _ in range(3):
        policy.costs.record(2, 0.020)
    assert policy.plan(["a"]) == {"a": 4}  # a 2-row step at 2x: now 4 drafts pay most
    for _ in range(4):  # the median of the last 7: 5x
        policy.costs.record(5, 0.050)
    assert policy.plan(["a"]) == {"a": 0}  # 5 rows at 5x and 2 rows at 2x: nothing beats plain decoding


def test_a_request_whose_drafts_are_rejected_stops_and_probes_ever_less_often():
    policy = _policy()
    planned = _run(policy, 80, lambda k: 0)
    # a: 0.5 -> 0.31 (1.31 > 1.25: one more try) -> 0.21: off; probes after 8, then 16, then 32 steps
    assert [step for step, k in enumerate(planned) if k] == [0, 1, 10, 27, 60]
    assert all(k == 1 for k in planned if k)


def test_a_request_that_starts_quoting_is_picked_up_by_a_probe():
    policy = _policy()
    _run(policy, 12, lambda k: 0)  # off since step 2; the probe at step 10 was rejected
    planned = _run(policy, 20, lambda k: k)  # from now on every draft is accepted
    assert planned[:16] == [0] * 15 + [1]  # the next probe, 16 steps after the last
    assert planned[16:] == [1, 3, 4, 4]  # accepted: the estimate restarts from the prior and climbs


def test_drafts_go_to_the_requests_that_accept_them():
    policy = _policy()
    for request_id, accepted in (("a", lambda k: k), ("b", lambda k: 0)):
        for _ in range(3):
            k = policy.plan([request_id])[request_id]
            if k:
                policy.record(request_id, k, accepted(k))
    # a = 0.94, b = 0.21: 2 + a + a^2 + a^3 = 4.6 tokens in cost(5) = 2.0 beats every other split
    assert policy.plan(["a", "b"]) == {"a": 3, "b": 0}


def test_max_rows_bounds_the_step():
    policy = SpeculationPolicy(4, 16, StepCosts(BUCKETS), adaptive=False)
    assert policy.plan(["a", "b", "c"]) == dict.fromkeys("abc", 4)  # 15 rows
    plan = policy.plan([str(i) for i in range(14)])  # 2 rows left: the first two requests' first drafts
    assert [plan[str(i)] for i in range(14)] == [1, 1] + [0] * 12
    assert set(_policy().plan([str(i) for i in range(16)]).values()) == {0}


def test_probes_stay_within_max_rows():
    policy = _policy()
    fifteen = [str(i) for i in range(15)]
    # 15 requests at the prior: one more row (15.5 tokens in cost(16) = 4.75) does not beat 15 in cost(15) = 4.5
    plans = [policy.plan(fifteen) for _ in range(9)]
    assert all(set(plan.values()) == {0} for plan in plans[:8])
    assert [plans[8][i] for i in fifteen] == [1] + [0] * 14  # probes are due: the one row left takes one
