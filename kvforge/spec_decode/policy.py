"""When speculating pays, by measurement: per request how likely its drafts are accepted, per engine what a
decode step of n token rows costs, and from both how many drafts each decoding request gets in a step.

A request whose drafts are each accepted with probability a (given that the ones before were) expects
1 + a + a^2 + ... + a^k tokens from a step with k drafts: its j-th draft adds a^j. A step of B decoding
requests with D drafts in all has B + D rows; it yields B plus the D largest gains, in cost(B + D), where
plain decoding yields B in cost(B). The plan takes the D with the most expected tokens per cost (D = 0 when
nothing beats plain decoding), within max_rows. With one request: k drafts when

    1 + a + ... + a^k  >  cost(1 + k) / cost(1)        (and the k that beats it by the most)

    acceptance a     decayed counts per request: accepted drafts, and verifications that rejected one
                     (a = accepted / (accepted + rejected), each verification scaling both by DECAY first),
                     starting from a prior of a = 0.5
    cost(rows)       the median wall time of the engine's recent decode-only steps of that many rows, padded to
                     the runner's compile bucket; rows never measured are extrapolated from the nearest
                     measured row count along the default shape 1 + DEFAULT_ROW_COST * (rows - 1)

A request that gets no drafts for probe_interval decode steps probes with one draft: an accepted probe
restarts its estimate from the prior (a request that starts quoting its prompt is picked up), a rejected
one doubles its interval (up to MAX_PROBE_INTERVAL). Exactness does not depend on any of this: the target
verifies every draft.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

# NOTE: measured on the 2-core CPU (benchmarks/RESULTS.md, speculative decoding): a 5-row verification step
# of the default model costs ~1.95x a 1-row decode step, i.e. ~0.25 of a step per extra row. On GPUs rows are
# nearly free; measurement replaces this guess for every row count the engine runs.
DEFAULT_ROW_COST = 0.25
COST_WINDOW = 15  # steps per row count in the median (one compile or a stall does not move it)
PRIOR_ACCEPTED, PRIOR_REJECTED = 1.0, 1.0
DECAY = 0.8  # weight of the past at each verification: the estimate follows the last ~5 verifications
PROBE_INTERVAL, MAX_PROBE_INTERVAL = 8, 32  # a failed 1-draft probe every 32 steps costs < 1% on the CPU


class StepCosts:
    """Wall seconds of decode-only steps by row count, padded as the runner pads them (buckets: the compiled
    batch sizes; rows above the largest, or without buckets, run as they are)."""

    def __init__(self, buckets: Sequence[int] = (), row_cost: float = DEFAULT_ROW_COST) -> None:
        self.buckets = tuple(buckets)
        self.row_cost = row_cost
        self.samples: dict[int, deque[float]] = {}
        self.medians: dict[int, float] = {}

    def padded(self, num_rows: int) -> int:
        return next((b for b in self.buckets if b >= num_rows), num_rows)

    def _shape(self, num_rows: int) -> float:
        return 1.0 + self.row_cost * (num_rows - 1)

    def record(self, num_rows: int, seconds: float) -> None:
        key = self.padded(num_rows)
        window = self.samples.setdefault(key, deque(maxlen=COST_WINDOW))
        window.append(seconds)
        self.medians[key] = statistics.median(window)

    def cost(self, num_rows: int) -> float:
        """What a step of num_rows rows costs (seconds where measured; only ratios of costs are used)."""
        key = self.padded(num_rows)
        if key in self.medians:
            return self.medians[key]
        if not self.medians:
            return self._shape(key)
        nearest = min(self.medians, key=lambda rows: (abs(rows - key), rows))
        return self.medians[nearest] * self._shape(key) / self._shape(nearest)


@dataclass(slots=True)
class _Acceptance:
    accepted: float = PRIOR_ACCEPTED
    rejected: float = PRIOR_REJECTED
    idle_steps: int = 0  # decode steps since its drafts were last verified
    probe_interval: int = PROBE_INTERVAL
    probing: bool = False  # its drafts this step are a probe

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


class SpeculationPolicy:
    """Plans each step's drafts per decoding request (`plan`), learns from each verification (`record`) and
    from each step's wall time (`costs.record`). adaptive=False: every request drafts up to
    num_speculative_tokens while the step stays within max_rows, whatever it costs."""

    def __init__(self, num_speculative_tokens: int, max_rows: int, costs: StepCosts, adaptive: bool = True) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.max_rows = max_rows
        self.costs = costs
        self.adaptive = adaptive
        self.requests: dict[str, _Acceptance] = {}
        self.num_planned_requests = 0  # decoding requests in the latest plan

    def acceptance(self, request_id: str) -> float:
        """The request's estimated chance that a draft is accepted, given the drafts before it were."""
        return self.requests.setdefault(request_id, _Acceptance()).rate

    def _num_drafts(self, gains: list[float], num_requests: int) -> int:
        """How many of the (descending) gains to take: the most expected tokens per cost."""
        limit = min(len(gains), self.max_rows - num_requests)
        if not self.adaptive:
            return max(limit, 0)
        best, best_value, expected = 0, num_requests / self.costs.cost(num_requests), float(num_requests)
        for num_drafts in range(1, limit + 1):
            expected += gains[num_drafts - 1]
            value = expected / self.costs.cost(num_requests + num_drafts)
            if value > best_value:
                best, best_value = num_drafts, value
        return best

    def _counts(self, states: list[_Acceptance]) -> list[int]:
        """Drafts per request: the largest gains first; a request's j-th draft adds rate^j (adaptive=False:
        every rate 1); ties go to earlier positions, then to earlier requests."""
        counts = [0] * len(states)
        if len(states) >= self.max_rows:
            return counts
        rates = [state.rate if self.adaptive else 1.0 for state in states]
        candidates = sorted(((rate**j, j, i) for i, rate in enumerate(rates)
                             for j in range(1, self.num_speculative_tokens + 1)), key=lambda c: (-c[0], c[1], c[2]))
        num_drafts = self._num_drafts([gain for gain, _, _ in candidates], len(states))
        for _, _, i in candidates[:num_drafts]:
            counts[i] += 1
        return counts

    def plan(self, request_ids: Sequence[str]) -> dict[str, int]:
        """The most drafts each of this step's decoding requests may verify (the proposer may offer fewer);
        probes take rows the plan left within max_rows."""
        states = [self.requests.setdefault(request_id, _Acceptance()) for request_id in request_ids]
        self.num_planned_requests = len(states)
        counts = self._counts(states)
        rows_left = self.max_rows - len(states) - sum(counts)
        plan = {}
        for request_id, state, count in zip(request_ids, states, counts):
            state.probing = (self.adaptive and count == 0 and state.idle_steps >= state.probe_interval
                             and rows_left > 0)
            rows_left -= state.probing
            plan[request_id] = 1 if state.probing else count
            state.idle_steps += 1
        return plan

    def probes_soon(self, request_id: str) -> bool:
        """Whether the request, without drafts in the latest plan, is due to probe with one (if the next step has
        rows left: the latest plan's did)."""
        state = self.requests.get(request_id)
        return (self.adaptive and state is not None and state.idle_steps >= state.probe_interval
                and self.num_planned_requests < self.max_rows)

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """The request verified num_drafts drafts and accepted the first num_accepted."""
        state = self.requests.setdefault(request_id, _Acceptance())
        state.idle_steps = 0
        if state.probing:
            state.probing = False
            if num_accepted:
                self.requests[request_id] = _Acceptance()
                return
            state.probe_interval = min(2 * state.probe_interval, MAX_PROBE_INTERVAL)
        state.accepted = DECAY * state.accepted + num_accepted
        state.rejected = DECAY * state.rejected + (num_accepted < num_drafts)

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
