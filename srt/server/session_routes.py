"""Program sessions seen from the main process: which tenant owns each session id, and the
/end_session route. The scheduler keeps the sessions' prefixes (srt/scheduler/sessions.py)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..intake import check_session_id
from .errors import error_response
from .generate_route import json_object_body


class SessionOwners:
    """The tenant (cache salt, LoRA adapter) of each live session id, so that a request naming
    another tenant's session is refused (400) before it runs, and no failed request touches the
    scheduler. An id is forgotten `ttl` seconds after its last use: it is used when its requests
    arrive and when they end, later than the scheduler's uses, so the scheduler forgets it first."""

    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic):
        self.ttl = ttl
        self.clock = clock
        self._owners: OrderedDict[str, tuple[Hashable, float]] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # the intake claims from worker threads

    def claim(self, session_id: str, tenant: Hashable) -> None:
        """Makes `tenant` the owner of a new id, or checks it owns a known one (ValueError)."""
        with self._lock:
            now = self.clock()
            while self._owners:  # forget the expired ones, oldest first
                oldest, (_, deadline) = next(iter(self._owners.items()))
                if deadline > now:
                    break
                del self._owners[oldest]
            owner = self._owners.get(session_id)
            if owner is not None and owner[0] != tenant:
                raise ValueError("session_id: is in use by another tenant (cache_salt or adapter); choose another id")
            self._owners[session_id] = (tenant, now + self.ttl)
            self._owners.move_to_end(session_id)

    def touch(self, session_id: str) -> None:
        with self._lock:
            owner = self._owners.get(session_id)
            if owner is not None:
                self._owners[session_id] = (owner[0], self.clock() + self.ttl)
                self._owners.move_to_end(session_id)

    def drop(self, session_id: str) -> None:
        with self._lock:
            self._owners.pop(session_id, None)


def add_session_routes(app: FastAPI, tm_getter) -> None:
    """/end_session ({"session_id"}): the session's prefix becomes plain cache. "ended" is false
    for an id the scheduler does not know (never used, ended or expired)."""

    @app.post("/end_session")
    async def end_session(request: Request) -> Response:
        body = await json_object_body(request)
        if isinstance(body, Response):
            return body
        try:
            session_id = check_session_id(body.get("session_id"))
        except ValueError as e:
            return error_response(400, str(e), "session_id")
        if session_id is None:
            return error_response(400, "session_id: required", "session_id")
        tm = tm_getter()
        reply = await tm.control("end_session", args={"session_id": session_id})
        if tm.sessions is not None:  # after the scheduler: its owner stays until then
            tm.sessions.drop(session_id)
        return JSONResponse({"session_id": session_id, "ended": bool(reply.data.get("ended"))})
