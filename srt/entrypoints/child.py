"""What every child process of the runtime does the same way at its start: it logs under its
own name, leaves Ctrl-C to its parent, exits when its parent is gone, and reports on the ready
socket whether it started (with the error when it did not)."""

from __future__ import annotations

import logging
import signal
import sys
import traceback
from typing import Any, NoReturn

import zmq

from .. import io_struct
from ..io_struct import ReadySignal
from ..process_utils import exit_when_parent_dies

logger = logging.getLogger(__name__)

# How long a ready signal may wait to be delivered (ms): a failed start exits right after
# sending it, and with LINGER 0 the report could be dropped (the parent would only time out).
READY_LINGER_MS = 2000


class ChildStart:
    """`start = ChildStart(name, ready_addr)`, build the process's parts, then `start.ready()`,
    or `start.failed(e)` (which exits 1). `watch_addr`: one of the server's ipc addresses, whose
    private directory the child removes if it outlives the server."""

    def __init__(self, name: str, ready_addr: str, watch_addr: str | None = None):
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
        # Ctrl-C in a terminal reaches the whole process group; the server stops its children
        # itself (SIGTERM) once it has failed what was in flight, so a child ignores SIGINT
        # rather than dying mid-step with a traceback.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        exit_when_parent_dies(ipc_addr=watch_addr)
        self.name = name
        self._ctx = zmq.Context()
        self._ready = self._ctx.socket(zmq.PUSH)
        self._ready.setsockopt(zmq.LINGER, READY_LINGER_MS)
        self._ready.connect(ready_addr)

    def ready(self, info: dict[str, Any] | None = None) -> None:
        self._report(ReadySignal(self.name, True, info=info or {}))

    def failed(self, e: BaseException) -> NoReturn:
        logger.error("%s failed to start:\n%s", self.name, traceback.format_exc())
        self._report(ReadySignal(self.name, False, error=f"{type(e).__name__}: {e}"))
        sys.exit(1)

    def _report(self, message: ReadySignal) -> None:
        self._ready.send(io_struct.encode(message))
        self._ready.close()
        self._ctx.term()
