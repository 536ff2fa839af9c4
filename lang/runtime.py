"""Runtime: starts `radixlm serve` as a child process and is a backend for it.

The server runs in its own process tree (HTTP front, scheduler, detokenizer) on a free port;
this object waits until /health answers, then delegates every backend call to `.endpoint`, a
RuntimeEndpoint. `shutdown()` (also run at interpreter exit) stops the child. The server's
command line is the only contract with the runtime: nothing here imports it, and the flags it
takes are read from its `--help` (exact names: its parser would take a typo that is the prefix
of a flag for that flag).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Iterator

from .backend import Backend, Generation, Prompt
from .chat_template import ChatRenderer
from .choices import ChoiceDecision, ChoicesMethod
from .runtime_endpoint import RuntimeEndpoint
from .sampling import SglSamplingParams

logger = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 30.0
_SERVER_COMMAND = [sys.executable, "-m", "radixlm.srt.launch"]


class Runtime(Backend):
    """`Runtime(model_path=None, **server_args)`: server_args are `radixlm serve` flags with
    underscores (max_total_tokens=16384, api_key="...", ...); `port` defaults to a free one.
    With `verbose` (the default) the server's progress lines (loading, converting the weights on
    a first run, warming up) are relayed to stderr while it starts: a first start takes a while."""

    def __init__(self, model_path: str | None = None, *, startup_timeout: float = 600.0, log_level: str = "warning",
                 verbose: bool = True, **server_args: Any):
        unknown = sorted(set(server_args) - _server_flags())
        if unknown:
            raise TypeError(f"Runtime() got unexpected server arguments {unknown}")
        self.port = int(server_args.pop("port", None) or _free_port())
        host = server_args.pop("host", "127.0.0.1")
        self.url = f"http://{host}:{self.port}"
        self.api_key = server_args.pop("api_key", None)
        self._relay = _ProgressRelay() if verbose else None
        args = [*_SERVER_COMMAND, "--host", host, "--port", str(self.port), "--log-level", log_level]
        if model_path is not None:
            args += ["--model-path", str(model_path)]
        for name, value in server_args.items():
            args += _flag(name, value)
        self.log_path = os.path.join(tempfile.gettempdir(), f"radixlm-runtime-{self.port}.log")
        self._log = open(self.log_path, "w")
        env = dict(os.environ)
        env.pop("RADIXLM_API_KEY", None)  # the server asks for the key this object was given, or none
        if self.api_key:  # through the environment: a command line is visible to every user
            env["RADIXLM_API_KEY"] = str(self.api_key)
        if self._relay is not None:
            env["RADIXLM_PROGRESS"] = "1"  # progress bars even though the log is not a terminal
            print(f"[radixlm] starting a server on port {self.port} (log: {self.log_path})", file=sys.stderr,
                  flush=True)
        # Own session: a Ctrl-C meant for the user's program does not hit the server first.
        self._proc: subprocess.Popen | None = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        atexit.register(self.shutdown)
        try:
            self._wait_healthy(startup_timeout)
            # Token ids and the chat template come from the server itself.
            self.endpoint = RuntimeEndpoint(self.url, self.api_key)
        except BaseException:
            self.shutdown()
            raise
        logger.info("radixlm server ready at %s (log: %s)", self.url, self.log_path)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                raise RuntimeError(f"the server exited with code {code} while starting:\n{self.log_tail()}")
            if self._relay is not None:
                self._relay.relay(self.log_path)
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        if self._relay is not None:
                            self._relay.relay(self.log_path)
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server did not become healthy within {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's log (kept in a temp file until shutdown)."""
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]

    def shutdown(self) -> None:
        """Stops the server (SIGTERM, then SIGKILL after a timeout). Safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._log.close()
        with contextlib.suppress(OSError):  # startup failures already quoted its tail
            os.remove(self.log_path)
        atexit.unregister(self.shutdown)

    # ---- the backend interface, delegated -------------------------------------------------

    def generate(self, prompt: Prompt, params: SglSamplingParams) -> Generation:
        return self.endpoint.generate(prompt, params)

    def generate_stream(self, prompt: Prompt, params: SglSamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        return self.endpoint.generate_stream(prompt, params)

    def select(self, prompt: Prompt, choices: list[str], temperature: float, method: ChoicesMethod) -> ChoiceDecision:
        return self.endpoint.select(prompt, choices, temperature, method)

    def cache_prefix(self, text: str) -> None:
        self.endpoint.cache_prefix(text)

    def get_chat_template(self) -> ChatRenderer:
        return self.endpoint.get_chat_template()

    def flush_cache(self) -> bool:
        return self.endpoint.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return self.endpoint.get_server_info()

    def get_model_info(self) -> dict[str, Any]:
        return self.endpoint.get_model_info()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


@functools.cache
def _server_flags() -> frozenset[str]:
    """The server's flags as keyword names (`--max-total-tokens` -> max_total_tokens)."""
    usage = subprocess.run([*_SERVER_COMMAND, "--help"], capture_output=True, text=True, check=True,
                           timeout=120).stdout
    return frozenset(f[2:].replace("-", "_") for f in re.findall(r"--[a-z][a-z0-9-]*", usage)) - {"help"}


class _ProgressRelay:
    """Copies the server log's progress lines ("[radixlm] ..." and tqdm bars) to stderr."""

    def __init__(self) -> None:
        self._offset = 0
        self._bar_open = False

    def relay(self, log_path: str) -> None:
        with open(log_path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        end = max(chunk.rfind(b"\n"), chunk.rfind(b"\r"))
        if end < 0:
            return
        self._offset += end + 1
        for raw in re.split(rb"(\r|\n)", chunk[:end + 1]):
            line = raw.decode(errors="replace").strip()
            if line.startswith("[radixlm]"):
                self._end_bar()
                print(line, file=sys.stderr, flush=True)
            elif "%|" in line:  # a tqdm bar
                print(f"\r[radixlm] {line}", end="", file=sys.stderr, flush=True)
                self._bar_open = True

    def _end_bar(self) -> None:
        if self._bar_open:
            print(file=sys.stderr, flush=True)
            self._bar_open = False


def _flag(name: str, value: Any) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag] if value else []
    return [] if value is None else [flag, str(value)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
