"""Which worker holds which stored response, so the router can send the Responses API's follow-ups to it.

A server keeps the responses it made in memory (nvllm.serve.responses): a request whose ``previous_response_id``
names one, and ``GET /v1/responses/{id}``, must reach the worker that made it. The router notes the id of each
response a worker answers (the JSON body's ``id``, or a stream's ``response.created`` event) and routes by it. The
map keeps the latest ``size`` ids, as the workers' own stores keep their latest responses."""

from __future__ import annotations

import json
from collections import OrderedDict

from nvllm.serve.responses import STORE_SIZE


class ResponseOwners:
    def __init__(self, size: int = 4 * STORE_SIZE):
        self.size = size
        self._owner: OrderedDict[str, str] = OrderedDict()  # response id → worker URL

    def owner(self, response_id) -> str | None:
        return self._owner.get(response_id) if isinstance(response_id, str) else None

    def note(self, response_id, url: str) -> None:
        if not isinstance(response_id, str):
            return
        self._owner[response_id] = url
        self._owner.move_to_end(response_id)
        while len(self._owner) > self.size:
            self._owner.popitem(last=False)

    def note_body(self, body: bytes, url: str) -> None:
        """A non-streamed answer: the response object."""
        try:
            data = json.loads(body)
        except ValueError:
            return
        if isinstance(data, dict):
            self.note(data.get("id"), url)

    def note_event(self, event: str, url: str) -> bool:
        """One SSE event of a stream; True once it was the ``response.created`` event (the rest need no look)."""
        for line in event.splitlines():
            if line.startswith("data:"):
                try:
                    data = json.loads(line[5:])
                except ValueError:
                    return False
                if isinstance(data, dict) and data.get("type") == "response.created":
                    self.note((data.get("response") or {}).get("id"), url)
                    return True
        return False
