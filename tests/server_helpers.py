"""Starts a real `radixlm serve` process for integration tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *extra_args: str, api_key: str | None = None, startup_timeout: float = 300.0,
                 env: dict[str, str] | None = None, new_session: bool = False, wait: bool = True):
        self.port = free_port()
        self.api_key = api_key
        self.base_url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "radixlm.srt.launch", "--port", str(self.port), *extra_args]
        if api_key and not (env and "RADIXLM_API_KEY" in env):
            args += ["--api-key", api_key]
        self.log_path = f"/tmp/radixlm-test-server-{self.port}.log"
        self._log = open(self.log_path, "w")
        # new_session: a process group of its own, so a test can send it a terminal's Ctrl-C.
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=new_session)
        if wait:
            self._wait_healthy(startup_timeout)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.log()}")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers(), timeout=timeout)

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-5000:]

    def children_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


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
