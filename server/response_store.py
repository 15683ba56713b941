"""The finished answers of POST /v1/responses that later requests may name: the newest
`capacity` response objects in memory, each with the conversation it ends, so that a request with
`previous_response_id` continues it without resending it. Lost on restart; a client that needs more
sends the whole conversation in `input` (with store=false, as Codex CLI does)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from server.errors import APIError


@dataclass(frozen=True)
class Kept:
    response: dict          # the response object as it was answered
    inputs: list[dict]      # the request's own input items, each with an id
    context: list           # the conversation's items up to and including this answer, as a next turn reads them


class ResponseStore:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._kept: OrderedDict[str, Kept] = OrderedDict()

    def storing(self, store: bool | None) -> bool:
        """Whether a request's answer will be kept: OpenAI's default is to keep it."""
        if store and not self.capacity:
            raise APIError(400, "store is not supported: this server keeps no responses (responses_store = 0); "
                                "start it with --responses-store N, or send store=false and the whole "
                                "conversation in `input`", param="store", code="unsupported_value")
        return self.capacity > 0 and store is not False

    def put(self, rid: str, kept: Kept) -> None:
        self._kept[rid] = kept
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def get(self, rid: str, param: str | None = None) -> Kept:
        """The kept answer `rid`, else a 404 (naming `param`, the request field that named it)."""
        kept = self._kept.get(rid)
        if kept is None:
            why = (f"this server keeps its last {self.capacity} finished responses (responses_store), in memory"
                   if self.capacity else "this server keeps no responses (responses_store = 0)")
            raise APIError(404, f"response {rid!r} is not here: {why}; send the whole conversation in "
                                "`input` instead", param=param,
                           code="previous_response_not_found" if param else "not_found")
        return kept

    def delete(self, rid: str) -> None:
        self.get(rid)
        del self._kept[rid]
