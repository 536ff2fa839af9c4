"""Processes for the serving benchmark: the radixlm server it starts and stops, and the CPU
accounting that tells how much of a run's machine went to somebody else.

On a shared 2-core machine another process's work shows up directly in our latencies, so
every run reports `others_cpu_share`: the share of all cores that processes other than the
benchmark and its server used during the run (from /proc; Linux only).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

from typing import Any

import httpx

logger = logging.getLogger("bench.serving")


class ManagedServer:
    """A `radixlm.srt.launch` subprocess in its own process group, so stopping it reaches its
    scheduler and detokenizer children even if it dies uncleanly."""

    def __init__(self, extra_args: list[str], startup_timeout: float):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = f"/tmp/radixlm-bench-server-{self.port}.log"
        args = [sys.executable, "-m", "radixlm.srt.launch", "--host", "127.0.0.1", "--port", str(self.port),
                *extra_args]
        logger.info("starting server: %s (log %s)", shlex.join(args), self.log_path)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_healthy(startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not healthy after {timeout:.0f}s; see {self.log_path}")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("server %d ignored SIGTERM for %.0fs; killing its group", self.proc.pid, timeout)
        try:  # children left behind (or a wedged parent): the group is ours alone
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()
        logger.info("server on port %d stopped (exit %s)", self.port, self.proc.returncode)


def raise_on_sigterm(signum, frame):  # turns SIGTERM into SystemExit so `finally` blocks run
    raise SystemExit(128 + signum)


def _cpu_seconds(pgid: int | None) -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, of this process plus process group `pgid`), to
    tell how much of a run's CPU went to somebody else (2 shared cores make that the noise)."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    machine = (sum(fields[:8]) - fields[3] - fields[4]) / tick  # all but idle, iowait, guest (in user)
    mine = sum(os.times()[:2])
    if pgid is not None:
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(stat[2]) == pgid:
                mine += (int(stat[11]) + int(stat[12])) / tick
    return machine, mine


def measure_noise(fn, pgid: int | None, attributable: bool = True):
    """Runs fn(); returns its result and the share of the machine's CPU that processes other
    than this one and group `pgid` used meanwhile. `attributable`: False when the work also
    runs in processes we cannot name (a server we did not start); the share is then None."""
    machine0, mine0 = _cpu_seconds(pgid)
    start = time.perf_counter()
    out = fn()
    machine1, mine1 = _cpu_seconds(pgid)
    others = max(0.0, (machine1 - machine0) - (mine1 - mine0))
    share = round(others / ((time.perf_counter() - start) * (os.cpu_count() or 1)), 3)
    return out, {"others_cpu_share": share if attributable else None}


def wait_until_quiet(max_wait_s: float, pgid: int | None, threshold: float, window_s: float = 5.0) -> float:
    """Waits (up to `max_wait_s`) for a `window_s` window in which other processes used at most
    `threshold` of the cores; returns the last window's share, for the report."""
    deadline = time.monotonic() + max_wait_s
    next_log = time.monotonic()
    while True:
        _, noise = measure_noise(lambda: time.sleep(window_s), pgid)
        share = noise["others_cpu_share"]
        if share <= threshold or time.monotonic() >= deadline:
            return share
        if time.monotonic() >= next_log:
            logger.info("others use %.0f%% of the cores; waiting for a quiet machine", 100 * share)
            next_log = time.monotonic() + 60


def emit(line: dict[str, Any], args: Any) -> None:
    """Prints a result line and appends it to `args.out` when set."""
    text = json.dumps(line)
    print(text, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")

