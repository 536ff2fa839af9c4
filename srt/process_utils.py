"""Small helpers for the runtime's child processes."""

from __future__ import annotations

import os
import threading
import time


def exit_when_parent_dies(poll_s: float = 1.0) -> None:
    """A child must not outlive the server (e.g. after SIGKILL of the main process)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
