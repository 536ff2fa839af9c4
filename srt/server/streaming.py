"""Server-sent events, shared by the native and the OpenAI streaming routes."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import StreamingResponse


class EventStream(StreamingResponse):
    """SSE response that always closes its body generator, also when the client went away.

    ASGI servers on spec 2.4 report a disconnect only by a failing send, which leaves Starlette's
    body generator open until garbage collection; closing it runs the generator's cleanup, which
    aborts the requests in the scheduler right away.
    """

    media_type = "text/event-stream"

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


def sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
