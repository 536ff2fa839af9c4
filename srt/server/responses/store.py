"""Stored responses, so a request can continue a conversation by `previous_response_id`.

Bounded (least recently used out) and in memory: the conversation lives as long as the server,
and its text is re-rendered each turn, which the radix cache turns into a cached prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_RESPONSES = 1024


@dataclass(frozen=True)
class StoredTurn:
    messages: list[dict[str, Any]]  # the whole conversation as chat messages, this turn's output included
    instructions: str | None
    response: dict[str, Any]  # the response object as returned


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES):
        self.max_responses = max_responses
        self._turns: OrderedDict[str, StoredTurn] = OrderedDict()

    def put(self, response_id: str, turn: StoredTurn) -> None:
        self._turns[response_id] = turn
        self._turns.move_to_end(response_id)
        while len(self._turns) > self.max_responses:
            self._turns.popitem(last=False)

    def get(self, response_id: str) -> StoredTurn | None:
        turn = self._turns.get(response_id)
        if turn is not None:
            self._turns.move_to_end(response_id)
        return turn

    def delete(self, response_id: str) -> bool:
        return self._turns.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._turns)
