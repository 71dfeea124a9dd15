"""The framing of a Responses event stream (POST /v1/responses with ``stream``; the router passes workers' streams
through it too): no ``[DONE]`` after the events (OpenAI's and vLLM's streams end with the last one), and a failure
mid-stream as OpenAI reports it: an ``error`` event, then ``response.failed`` with the response as it stood, both
numbered on from the events before them (the `openai` client validates ``sequence_number`` and ends its stream
state on ``response.failed``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from nvllm.serve.errors import APIError


class EventTrack:
    """What a Responses stream has sent so far: how many events, and the response its first event carried."""

    def __init__(self):
        self.sent = 0
        self.response: dict | None = None

    def note(self, chunk: str) -> None:
        """One event's text (``event: …\\ndata: {…}\\n\\n``) on its way out."""
        self.sent += 1
        if self.response is None:
            data = next((line[6:] for line in chunk.splitlines() if line.startswith("data: ")), None)
            try:
                response = json.loads(data).get("response") if data else None
            except (ValueError, AttributeError):
                response = None
            self.response = response if isinstance(response, dict) else None

    def failure(self, code: str | None, message: str, param: str | None) -> list[str]:
        """The events that end the stream on a failure: ``error``, then ``response.failed`` when a response was
        opened."""
        events = [_event("error", self.sent, code=code, message=message, param=param)]
        if self.response is not None:
            failed = {**self.response, "status": "failed", "error": {"code": code or "server_error",
                                                                       "message": message}}
            events.append(_event("response.failed", self.sent + 1, response=failed))
        return events


def _event(kind: str, seq: int, **data) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **data})}\n\n"


async def response_events(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Frame the Responses events (see the module's docstring)."""
    track = EventTrack()
    try:
        async for chunk in chunks:
            track.note(chunk)
            yield chunk
    except APIError as e:
        for chunk in track.failure(e.code, e.message, e.param):
            yield chunk
    except Exception as e:  # noqa: BLE001 - the status line is long gone; report inside the stream
        for chunk in track.failure("server_error", f"{type(e).__name__}: {e}", None):
            yield chunk
