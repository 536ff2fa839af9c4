"""What the benchmarks share, and the tests with them: timing, one JSON line per result, and
`radixlm serve` / `radixlm router` processes started, waited for and stopped.

A result line names the baseline it was measured against in the same run, and `ratio` divides
a figure by its baseline's.
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
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import httpx

logger = logging.getLogger("benchmarks")

T = TypeVar("T")


# ---- timing ---------------------------------------------------------------------------------------

def timed(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, float]:
    """fn(*args, **kwargs)'s result and the wall seconds the call took."""
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def best_seconds(fn: Callable[[], object], repeats: int, sync: Callable[[], None] | None = None) -> float:
    """The best wall time of `repeats` calls; `sync` (e.g. torch.cuda.synchronize) runs before
    and after each, so that a device's queued work counts."""
    best = float("inf")
    for _ in range(repeats):
        if sync:
            sync()
        start = time.perf_counter()
        fn()
        if sync:
            sync()
        best = min(best, time.perf_counter() - start)
    return best


def wait_until(condition: Callable[[], T], timeout: float, interval: float = 0.1) -> T:
    """Calls `condition` until it returns something true or `timeout` seconds have passed, and
    returns its last answer (false after a timeout: the caller asserts or raises)."""
    deadline = time.monotonic() + timeout
    while True:
        answer = condition()
        if answer or time.monotonic() >= deadline:
            return answer
        time.sleep(interval)


# ---- reporting --------------------------------------------------------------------------------------

def ratio(ours: float, baseline: float, digits: int = 3) -> float | None:
    """ours / baseline, rounded; None when the baseline is 0 (nothing to compare to)."""
    return round(ours / baseline, digits) if baseline else None


def run_frame(device: str) -> dict[str, str]:
    """The date and machine every results line carries."""
    import datetime

    return {"date": datetime.date.today().isoformat(), "machine": f"{device}, {os.cpu_count()} CPU cores"}


def command_line() -> str:
    """How this benchmark was started, as one types it again (`python -m benchmarks.bench_x ...`)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    program = ["-m", spec.name] if spec is not None else [sys.argv[0]]
    return shlex.join(["python", *program, *sys.argv[1:]])


class Reporter:
    """Prints each result as one JSON line and appends it to `out` when set. `device` (called at
    each line, so a GPU is only touched once the benchmark has) and `command` frame every line."""

    def __init__(self, out: str | None, command: str | None = None, device: Callable[[], str] | None = None,
                 framing: Callable[[], dict[str, Any]] | None = None):
        """framing: keys (date, machine) every line gets unless it has them itself."""
        self.out, self.command, self.device, self.framing = out, command, device, framing

    def emit(self, line: dict[str, Any]) -> None:
        framed = {**({"device": self.device()} if self.device else {}), **line,
                  **{k: v for k, v in (self.framing() if self.framing else {}).items() if k not in line},
                  **({"command": self.command} if self.command else {})}
        text = json.dumps(framed)
        print(text, flush=True)
        if self.out:
            Path(self.out).parent.mkdir(parents=True, exist_ok=True)
            with open(self.out, "a") as f:
                f.write(text + "\n")


# ---- processes ---------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); check its state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def raise_on_sigterm(signum, frame):  # turns SIGTERM into SystemExit so `finally` blocks stop servers
    raise SystemExit(128 + signum)


class ServerProcess:
    """`radixlm serve` as a subprocess on a free port of 127.0.0.1, its output in a log file,
    ready once /health answers 200 (the server has loaded and warmed up).

    own_group: a process group of its own, so that a test can send it a terminal's Ctrl-C, and
    so that stop() reaches children a server that died uncleanly left behind.
    """

    # Where each server gets a folder of its own for its log and its TMPDIR (so its private ipc
    # directory too); the tests set pytest's temporary directory. None: logs go to the system's
    # temporary directory and servers use the system's TMPDIR.
    temp_root: ClassVar[Path | None] = None
    kind: ClassVar[str] = "server"
    entry: ClassVar[tuple[str, ...]] = ("-m", "radixlm.srt.launch")

    def __init__(self, *args: str, api_key: str | None = None, env: dict[str, str] | None = None,
                 startup_timeout: float = 300.0, own_group: bool = False, wait: bool = True):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.own_group = own_group
        argv = [sys.executable, *self.entry, "--host", "127.0.0.1", "--port", str(self.port), *args]
        if api_key and not (env and "RADIXLM_API_KEY" in env):
            argv += ["--api-key", api_key]
        child_env = {**os.environ, **(env or {})}
        if self.temp_root is not None:
            # Short: the ipc socket paths inside must stay under the OS limit (~107 bytes).
            folder = Path(tempfile.mkdtemp(prefix=f"{self.port}-", dir=self.temp_root))
            self.log_path = str(folder / f"{self.kind}.log")
            child_env["TMPDIR"] = str(folder)
        else:
            self.log_path = os.path.join(tempfile.gettempdir(), f"radixlm-bench-{self.kind}-{self.port}.log")
        logger.info("starting %s: %s (log %s)", self.kind, shlex.join(argv), self.log_path)
        self._log = open(self.log_path, "w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=child_env,
                                     start_new_session=own_group)
        if wait:
            try:
                self.wait_ready(startup_timeout)
            except BaseException:
                self.stop()
                raise

    def ready(self, health: int | None) -> bool:
        """Whether a /health status (None: no answer) means ready."""
        return health == 200

    def wait_ready(self, timeout: float) -> float:
        """Waits until ready(); returns the seconds since the process started."""
        # One client for all the polls: httpx.get makes a client (and an SSL context, ~20 ms of
        # CPU) per call, which at 10 polls a second slows the start it waits for on 2 cores.
        with httpx.Client(timeout=2, trust_env=False) as client:
            def health() -> int | None:
                try:
                    return client.get(f"{self.base_url}/health").status_code
                except httpx.HTTPError:
                    return None

            if not wait_until(lambda: self.proc.poll() is not None or self.ready(health()), timeout):
                raise RuntimeError(f"{self.kind} not ready after {timeout:.0f}s:\n{self.log()}")
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.kind} exited with {self.proc.returncode}:\n{self.log()}")
        return time.perf_counter() - self.started

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers(), timeout=timeout, trust_env=False)

    def log(self) -> str:
        """The end of the log (the last 5000 characters)."""
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-5000:]

    def children_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Sends `sig` and waits (SIGKILL after `timeout`); returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("%s %d ignored signal %d for %.0fs; killing it", self.kind, self.proc.pid, sig, timeout)
                self.proc.kill()
        if self.own_group:  # children left behind (or a wedged parent): the group is ours alone
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self._log.close()
        return self.proc.returncode


class RouterProcess(ServerProcess):
    """`radixlm router` (no model) as a subprocess. wait_for_workers: ready once /health is 200
    (its workers answer); False: once it answers at all."""

    kind = "router"
    entry = ("-c", "from radixlm.srt.launch import cli; cli()", "router")  # what the `radixlm` script runs

    def __init__(self, *args: str, wait_for_workers: bool = True, startup_timeout: float = 60.0, **kwargs: Any):
        self.wait_for_workers = wait_for_workers
        super().__init__(*args, startup_timeout=startup_timeout, **kwargs)

    def ready(self, health: int | None) -> bool:
        return health == 200 or (health is not None and not self.wait_for_workers)
