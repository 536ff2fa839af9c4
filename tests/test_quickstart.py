"""The quickstart as a newcomer runs it (issue 15, item 1; issue 31): it says what happens while
the server starts, prints each answer as it comes, and a Ctrl-C ends it with one line, no
traceback, no server left. The tests wait on the quickstart's output, never on fixed sleeps, and
its server writes only under tmp_path (TMPDIR: its log and its ipc directory)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.harness import pid_alive

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "examples", "quickstart.py")
RUN_TIMEOUT_S = 900  # a loaded 2-core machine took 4 minutes for a cold run
STOP_TIMEOUT_S = 120


class Quickstart:
    """`python examples/quickstart.py` as a child, its stdout and stderr read as they come."""

    def __init__(self, tmp_path: Path):
        env = {**os.environ, "TMPDIR": str(tmp_path)}
        self.proc = subprocess.Popen([sys.executable, QUICKSTART], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=env)
        self._output = {"stdout": b"", "stderr": b""}
        self._changed = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(name, getattr(self.proc, name)), daemon=True)
                         for name in self._output]
        for reader in self._readers:
            reader.start()

    def _read(self, name: str, pipe) -> None:
        while chunk := os.read(pipe.fileno(), 65536):  # os.read: an unfinished line counts too
            with self._changed:
                self._output[name] += chunk
                self._changed.notify_all()

    @property
    def stdout(self) -> str:
        with self._changed:
            return self._output["stdout"].decode(errors="replace")

    @property
    def stderr(self) -> str:
        with self._changed:
            return self._output["stderr"].decode(errors="replace")

    def wait_for(self, name: str, text: str, timeout: float) -> None:
        """Until `text` shows in stdout or stderr; fails if the quickstart ends first or times out."""
        def seen_or_ended() -> bool:
            return text.encode() in self._output[name] or self.proc.poll() is not None

        with self._changed:
            self._changed.wait_for(seen_or_ended, timeout)
        assert text in getattr(self, name), (f"no {text!r} in the quickstart's {name} within {timeout:.0f}s "
                                             f"(exit code {self.proc.poll()}):\n{self.stdout[-2000:]}\n"
                                             f"{self.stderr[-3000:]}")

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        for reader in self._readers:
            reader.join(timeout)
        return code

    def server_pids(self) -> list[int]:
        """The server (the quickstart's child that has a --port) and its own children."""
        server = [pid for pid in _children(self.proc.pid) if b"--port" in _cmdline(pid)]
        assert len(server) == 1, f"expected one server process, found {server}"
        return server + _children(server[0])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in found]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError):  # it has just exited
        return b""


def _within(timeout: float, condition: Callable[[], bool]) -> bool:
    """Whether `condition` holds within `timeout` s: for things that end without telling us
    (a process that is not our child, a directory its owner removes)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)
    return condition()


def _left_behind(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("radixlm-"))


@pytest.fixture()
def quickstart(tmp_path: Path):
    started = Quickstart(tmp_path)
    yield started
    started.kill()


def test_quickstart_explains_its_start_and_prints_answers(quickstart: Quickstart, tmp_path: Path):
    code = quickstart.wait(RUN_TIMEOUT_S)
    out, err = quickstart.stdout, quickstart.stderr
    assert code == 0, err[-3000:]
    stages = err.splitlines()
    order = ["starting a server", "loading", "starting the scheduler", "model loaded", "warmed up"]
    positions = [next(i for i, line in enumerate(stages) if key in line) for key in order]
    assert positions == sorted(positions), stages
    # Short and clean: the server's stages only (its log stays in its file), no tqdm redraws.
    assert all(line.startswith("[radixlm]") for line in stages) and len(stages) <= 12, stages
    assert "\r" not in err
    assert "== Paris" in out and "== Tokyo" in out and "radix cache hit rate" in out
    assert "continent: Europe" in out
    for label in ("about:", "continent:", "landmark:", "dish:"):
        assert out.count(f"\n{label}") == 2, out
    assert _left_behind(tmp_path) == []


# When to press Ctrl-C: once the quickstart has printed this (stream, text).
MOMENTS = {"while the server loads": ("stderr", "[radixlm] loading"), "while it answers": ("stdout", "about:")}


@pytest.mark.parametrize("moment", list(MOMENTS), ids=["loading", "answering"])
def test_ctrl_c_in_the_quickstart_is_one_line_and_stops_the_server(quickstart: Quickstart, tmp_path: Path,
                                                                   moment: str):
    quickstart.wait_for(*MOMENTS[moment], RUN_TIMEOUT_S)
    server = quickstart.server_pids()
    quickstart.proc.send_signal(signal.SIGINT)
    assert quickstart.wait(STOP_TIMEOUT_S) == 130, quickstart.stderr[-3000:]
    err = quickstart.stderr
    assert "Traceback" not in err and "Traceback" not in quickstart.stdout, err[-3000:]
    assert err.strip().splitlines()[-1] == "interrupted", err[-3000:]
    assert _within(STOP_TIMEOUT_S, lambda: not any(pid_alive(pid) for pid in server)), (
        f"still running after Ctrl-C {moment}: {[pid for pid in server if pid_alive(pid)]}")
    assert _within(STOP_TIMEOUT_S, lambda: _left_behind(tmp_path) == []), _left_behind(tmp_path)
