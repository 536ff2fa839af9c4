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
import threading
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
    a first run, warming up) are relayed to stderr while it starts: a first start takes a while.
    `shutdown()` fails the requests still in flight at once (graceful_shutdown_timeout=0) unless
    a graceful_shutdown_timeout is given."""

    def __init__(self, model_path: str | None = None, *, startup_timeout: float = 600.0, log_level: str = "warning",
                 verbose: bool = True, **server_args: Any):
        unknown = sorted(set(server_args) - _server_flags())
        if unknown:
            raise TypeError(f"Runtime() got unexpected server arguments {unknown}")
        # shutdown() stops the server at once: the requests still in flight are this process's
        # own, and a Ctrl-C should not wait for them (a server's default drain is 30 s).
        server_args.setdefault("graceful_shutdown_timeout", 0)
        self.port = int(server_args.pop("port", None) or _free_port())
        host = server_args.pop("host", "127.0.0.1")
        self.url = f"http://{host}:{self.port}"
        self.api_key = server_args.pop("api_key", None)
        self._relay: _ProgressRelay | None = None
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
        if verbose:
            env["RADIXLM_PROGRESS"] = "1"  # progress bars even though the log is not a terminal
            print(f"[radixlm] starting a server on port {self.port} (log: {self.log_path})", file=sys.stderr,
                  flush=True)
        # Own session: a Ctrl-C meant for the user's program does not hit the server first.
        self._proc: subprocess.Popen | None = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        atexit.register(self.shutdown)
        try:
            if verbose:
                self._relay = _ProgressRelay(self.log_path)
            self._wait_healthy(startup_timeout)
            self._stop_relay()
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
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
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

    def _stop_relay(self) -> None:
        relay, self._relay = self._relay, None
        if relay is not None:
            relay.stop()

    def shutdown(self) -> None:
        """Stops the server (SIGTERM, then SIGKILL after a timeout). Safe to call twice."""
        self._stop_relay()
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

    def cache_prefix(self, text: str, images: tuple[str, ...] = ()) -> None:
        self.endpoint.cache_prefix(text, images)

    def image_token(self) -> str:
        return self.endpoint.image_token()

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
    """Copies the server log's progress lines ("[radixlm] ..." and tqdm bars) to stderr as they
    are written, from a thread (the health checks block for seconds while the server loads).
    On a terminal a bar is redrawn in place; elsewhere only its last state is written."""

    _POLL_S = 0.2

    def __init__(self, log_path: str) -> None:
        self._log_path = log_path
        self._offset = 0
        self._bar: str | None = None  # the open bar's latest state
        self._to_terminal = sys.stderr.isatty()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radixlm-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Relays what is left, then stops (a line written at the last moment is not lost)."""
        self._stopped.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            stopping = self._stopped.wait(self._POLL_S)
            self._relay()
            if stopping:
                self._end_bar()
                return

    def _relay(self) -> None:
        with open(self._log_path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        end = max(chunk.rfind(b"\n"), chunk.rfind(b"\r"))
        if end < 0:
            return
        self._offset += end + 1
        for raw in re.split(rb"\r|\n", chunk[:end + 1]):
            line = raw.decode(errors="replace").strip()
            if line.startswith("[radixlm]"):
                self._end_bar()
                print(line, file=sys.stderr, flush=True)
            elif "%|" in line:  # a tqdm bar
                self._bar = f"[radixlm] {line}"
                if self._to_terminal:
                    print(f"\r{self._bar}", end="", file=sys.stderr, flush=True)

    def _end_bar(self) -> None:
        if self._bar is not None:
            print("" if self._to_terminal else self._bar, file=sys.stderr, flush=True)
            self._bar = None


def _flag(name: str, value: Any) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag] if value else []
    return [] if value is None else [flag, str(value)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
