"""The runtime's child processes (scheduler, detokenizer, tensor-parallel ranks), started with
multiprocessing's spawn, their private ipc directory, and the wait for their ready signals."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time
from typing import Any

import zmq

from . import io_struct

READY_TIMEOUT_S = 900.0
CHILD_STOP_TIMEOUT_S = 10.0


class ChildProcesses:
    """Child processes of one launcher and their private ipc directory (mode 0700)."""

    def __init__(self) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix="radixlm-ipc-")  # mode 0700: private sockets
        self.procs: dict[str, mp.Process] = {}

    def addr(self, name: str) -> str:
        return f"ipc://{os.path.join(self.ipc_dir, name)}"

    def start(self, name: str, target: Any, *args: Any) -> None:
        proc = mp.get_context("spawn").Process(target=target, args=args, name=f"radixlm-{name}", daemon=False)
        proc.start()
        self.procs[name] = proc

    def dead(self) -> list[str]:
        return [f"{n} exited with code {p.exitcode}" for n, p in self.procs.items() if not p.is_alive()]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + CHILD_STOP_TIMEOUT_S
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def wait_ready(ready: zmq.Socket, children: ChildProcesses, names: set[str]) -> dict[str, Any]:
    info: dict[str, Any] = {}
    deadline = time.monotonic() + READY_TIMEOUT_S
    while names:
        if ready.poll(500):
            signal_msg = io_struct.decode(ready.recv())
            if not signal_msg.ok:
                raise RuntimeError(f"{signal_msg.process} failed to start: {signal_msg.error}")
            names.discard(signal_msg.process)
            info.update(signal_msg.info)
        elif children.dead():
            raise RuntimeError("; ".join(children.dead()))
        elif time.monotonic() > deadline:
            raise RuntimeError(f"{', '.join(sorted(names))} not ready after {READY_TIMEOUT_S:.0f}s")
    return info
