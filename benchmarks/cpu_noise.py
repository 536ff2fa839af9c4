"""How much of a run's machine went to somebody else.

On a shared 2-core machine another process's work shows up directly in our latencies, so
the serving and language benchmarks report `others_cpu_share`: the share of all cores that
processes other than the benchmark and its server used during the run (from /proc; Linux only).
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger("bench.serving")


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
