"""A non-streamed OpenAI request run to its end: each choice's final result, or the response
that answers instead (the request's error, or 499 when the client left first). Shared by
/v1/completions and /v1/chat/completions (and /v1/responses through it)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncGenerator

from fastapi import Request
from fastapi.responses import Response

from .openai_common import as_openai_error, error_response
from .openai_protocol import finish_reason_of
from .openai_runner import call_on_disconnect


async def run_to_end(request: Request, results: AsyncGenerator[tuple[int, dict[str, Any]], None],
                     renames: dict[str, str], num_choices: int) -> list[dict[str, Any]] | Response:
    """The last finished result of each choice in `results` ((choice index, result) pairs), in
    choice order, or the error response.

    A disconnect cancels the current task rather than one runner, since `results` may run
    several in turn (a chat's reasoning, then its answer); the cancellation reaches the runner
    being awaited, and closing it aborts what still runs.
    """
    finals: dict[int, dict[str, Any]] = {}
    task = asyncio.current_task()
    watcher = asyncio.get_running_loop().create_task(call_on_disconnect(request, task.cancel))
    try:
        async with contextlib.aclosing(results):
            async for index, out in results:
                if finish_reason_of(out["meta_info"]) is not None:
                    finals[index] = out
        return [finals[i] for i in range(num_choices)]
    except asyncio.CancelledError:
        return Response(status_code=499)
    except Exception as e:
        return error_response(as_openai_error(e, renames))
    finally:
        watcher.cancel()
