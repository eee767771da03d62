"""What every proposer of draft tokens offers the scheduler."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    """Proposes draft tokens to follow a request's tokens; the target model verifies them in the next step.

    propose: up to max_num_tokens draft ids to follow token_ids (the request's prompt and output so far),
    possibly none. finish: the request is gone (its tokens are final); forget its state. Proposers that
    keep state per request see each request's tokens only grow between calls, except after finish."""

    def propose(self, request_id: str, token_ids: Sequence[int], max_num_tokens: int) -> list[int]: ...

    def finish(self, request_id: str, token_ids: Sequence[int]) -> None: ...
