"""Small helpers for the runtime's processes: progress lines, the listening socket, and children
that never outlive the server."""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import socket
import sys
import threading
import time


def exit_when_parent_dies(poll_s: float = 1.0, ipc_addr: str | None = None) -> None:
    """A child must not outlive the server (e.g. after SIGKILL of the main process). The one
    that notices also removes the server's private ipc directory (given as one of its socket
    addresses, ipc://DIR/NAME), which the dead server could not."""
    # The pid of the process that started this one, not os.getppid() now: a server stopped
    # while this child still imported torch has died already, and this child was handed to init.
    started_by = multiprocessing.parent_process()
    parent = started_by.pid if started_by is not None else os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                if ipc_addr and ipc_addr.startswith("ipc://"):
                    shutil.rmtree(os.path.dirname(ipc_addr[len("ipc://"):]), ignore_errors=True)
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def exit_now(code: int) -> None:
    """Ends the process once its own cleanup is done (children stopped, files closed, sockets
    gone), skipping the interpreter's teardown: freeing the objects of torch and transformers
    module by module took 1.1-1.3 s of CPU after a server had stopped, on every exit. The logs
    and the standard streams are flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone (a parent that went away)
            pass
    os._exit(code)


def stage(message: str) -> None:
    """A line saying what the server is doing, whatever the log level: a first start takes a
    while (converting a GGUF once, loading) and should explain itself (lang's Runtime relays
    these lines to its user)."""
    print(f"[radixlm] {message}", file=sys.stderr, flush=True)


def bind_port(host: str, port: int) -> socket.socket:
    """The listening socket, taken before the model loads so that a busy port fails in a second,
    not after loading. Raises OSError naming the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e} (is another server running there? "
                      "pick another --port)") from None
    # Listening at once holds the port against a second server started meanwhile (with
    # SO_REUSEADDR two sockets may bind one port until one of them listens); connections wait in
    # the backlog until uvicorn serves.
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


class _TerminalLike:
    """stderr that says it is a terminal, so that tqdm draws its bars into a log file that a
    watcher (lang's Runtime) relays to a real terminal."""

    def __init__(self, stream: object) -> None:
        self._stream = stream

    def isatty(self) -> bool:
        return True

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def show_progress_bars_in_log() -> None:
    """With RADIXLM_PROGRESS=1 in the environment, tqdm bars are drawn although stderr is a file."""
    if os.environ.get("RADIXLM_PROGRESS") == "1" and not sys.stderr.isatty():
        sys.stderr = _TerminalLike(sys.stderr)  # type: ignore[assignment]
