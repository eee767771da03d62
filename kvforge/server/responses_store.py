"""The responses a server keeps for GET /v1/responses/{id}, cancel, and `previous_response_id`.

Kept in memory, bounded: once `capacity` responses are stored, storing one more forgets the oldest. Nothing
survives a restart. A response is stored when it starts (status "in_progress"), so it can be retrieved and
cancelled while it runs; its entry is updated when it ends.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field

from kvforge.server.errors import APIError
from kvforge.server.responses_protocol import InputItem, ResponseObject


@dataclass(slots=True)
class StoredResponse:
    """One response and the conversation it ends: the earlier turns' items, its input items and its output
    items (instructions are not carried over, as with OpenAI). `stop` asks it to end while it runs; `ended`
    is set once it has."""

    response: ResponseObject
    items: list[InputItem]
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class ResponseStore:
    """The last `capacity` stored responses, by id (0: none are kept)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._entries[entry.response.id] = entry
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The entry of response_id; a 404 in OpenAI's shape when none is stored (param: the field naming it)."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", param=param)
        return entry

    def delete(self, response_id: str) -> StoredResponse:
        entry = self.get(response_id)
        del self._entries[response_id]
        return entry
