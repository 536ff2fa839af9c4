"""`radixlm serve --dp-size N`: N replicas of `radixlm serve` on this host (each a child process on
127.0.0.1 and a free port; on CUDA each with its own group of tp_size GPUs), the cache-aware
router in front on --host/--port.

All replicas must start: one that fails fails the command with its error. Once serving, a
replica that dies is taken out by the router and the others keep serving (data parallelism is
there for capacity; losing part of it should not stop the service); it is not restarted. The
command exits 1 when no replica is left, 0 on SIGINT/SIGTERM (the router drains, then the
replicas are stopped)."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

from ..process_utils import bind_port, stage
from ..server_args import API_KEY_ENV, ServerArgs
from ..server_flags import to_flags
from .cli import RouterConfig, raise_open_files_limit, serve_router

logger = logging.getLogger("radixlm.dp")

READY_TIMEOUT_S = 900.0
_LOG_TAIL = 40  # lines of a replica's output kept for the error when it fails to start


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def replica_argv(args: ServerArgs, port: int) -> list[str]:
    """The replica's command line: every setting the user changed, but dp_size 1 on
    127.0.0.1:port; the API key travels in the environment (kept out of `ps`)."""
    skip = {"dp_size", "host", "port", "api_key", "dist_init_addr", "log_level"}  # each replica its own rendezvous
    changed = {name: value for name, value in args.changed().items() if name not in skip}
    return [sys.executable, "-m", "radixlm.srt.launch", *to_flags(changed), "--log-level", args.http.log_level,
            "--host", "127.0.0.1", "--port", str(port)]


def gpu_groups(args: ServerArgs) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each replica (None on CPU). Raises ValueError when fewer GPUs are
    visible than dp_size x tp_size."""
    if args.model.resolved_device() != "cuda":
        return [None] * args.parallel.dp_size
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else \
        [str(i) for i in range(torch.cuda.device_count())]
    wanted = args.parallel.dp_size * args.parallel.tp_size
    if wanted > len(ids):
        raise ValueError(f"dp_size: --dp-size {args.parallel.dp_size} x --tp-size {args.parallel.tp_size} needs "
                         f"{wanted} GPUs; "
                         f"{len(ids)} visible" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible else ""))
    tp = args.parallel.tp_size
    return [",".join(ids[i * tp:(i + 1) * tp]) for i in range(args.parallel.dp_size)]


def _die_with_parent() -> None:
    """A replica must not outlive the launcher, even one killed by SIGKILL (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Replica:
    def __init__(self, index: int, argv: list[str], env: dict[str, str], url: str):
        self.index, self.url = index, url
        self.tail: collections.deque[str] = collections.deque(maxlen=_LOG_TAIL)
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        self.reported_exit = False
        threading.Thread(target=self._relay_output, name=f"replica-{index}-log", daemon=True).start()

    def _relay_output(self) -> None:
        """The replica's log lines on our stderr, each tagged with the replica."""
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self.tail.append(line)
            if '"GET /health HTTP/1.1" 200' in line:  # the router's probes, every few seconds
                continue
            print(f"[replica {self.index}] {line}", file=sys.stderr, flush=True)

    def exit_note(self) -> str:
        code = self.proc.returncode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        return f"replica {self.index} ({self.url}) exited ({how})"

    def stop(self, timeout: float) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _wait_ready(replicas: list[Replica], api_key: str | None) -> None:
    """Until every replica's /health says 200. Raises RuntimeError with the failing replica's
    last output lines if one exits, or naming those not ready in time."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    pending = list(replicas)
    deadline = time.monotonic() + READY_TIMEOUT_S
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while pending:
            for r in list(pending):
                if r.proc.poll() is not None:
                    time.sleep(0.2)  # let the log thread read the last lines
                    raise RuntimeError(f"{r.exit_note()} before it was ready; its last lines:\n" + "\n".join(r.tail))
                try:
                    if client.get(r.url + "/health", headers=headers).status_code == 200:
                        pending.remove(r)
                        stage(f"replica {r.index} ready at {r.url}")
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"replicas {', '.join(str(r.index) for r in pending)} not ready after "
                                   f"{READY_TIMEOUT_S:.0f}s")
            time.sleep(0.5)


def launch_dp(args: ServerArgs) -> int:
    if args.parallel.nnodes > 1:
        logger.error("dp_size: --dp-size with --nnodes > 1 is not supported; start the replicas on each host "
                     "and put `radixlm router --worker-urls ...` in front")
        return 1
    try:
        groups = gpu_groups(args)
        sock = bind_port(args.http.host, args.http.port)
    except (ValueError, OSError) as e:
        logger.error("%s", e)
        return 1
    raise_open_files_limit()  # before the replicas start: they inherit it
    env = dict(os.environ)
    if args.http.api_key:
        env[API_KEY_ENV] = args.http.api_key
    if groups[0] is None and "OMP_NUM_THREADS" not in env:
        # CPU replicas share the cores; each spinning on all of them would slow every one down.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.parallel.dp_size))
    replicas: list[Replica] = []
    try:
        stage(f"starting {args.parallel.dp_size} replicas")
        for i, gpus in enumerate(groups):
            port = _free_port()
            replica_env = env if gpus is None else {**env, "CUDA_VISIBLE_DEVICES": gpus}
            replicas.append(Replica(i, replica_argv(args, port), replica_env, f"http://127.0.0.1:{port}"))
            logger.info("replica %d: pid %d, %s%s", i, replicas[-1].proc.pid, replicas[-1].url,
                        f", GPUs {gpus}" if gpus else "")
        _wait_ready(replicas, args.http.api_key)
        config = RouterConfig(worker_urls=[r.url for r in replicas], host=args.http.host, port=args.http.port,
                              api_key=args.http.api_key, max_request_bytes=args.http.max_request_bytes,
                              graceful_shutdown_timeout=args.http.graceful_shutdown_timeout,
                              log_level=args.http.log_level)
        return asyncio.run(serve_router(config, sock, supervise=lambda pool, server: _supervise(replicas, pool,
                                                                                                 server)))
    except RuntimeError as e:
        logger.error("%s", e)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while the replicas start (later, the router takes it: exit 0)
        return 130
    finally:
        sock.close()
        for r in replicas:
            if r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
        for r in replicas:
            r.stop(args.http.graceful_shutdown_timeout + 10)
        stage("stopped")


async def _supervise(replicas: list[Replica], pool: Any, server: Any) -> None:
    """Takes a replica that exited out of the router at once (with why), and stops the router
    with exit code 1 when none is left."""
    while not server.should_exit:
        await asyncio.sleep(0.2)
        for r in replicas:
            if r.proc.poll() is not None and not r.reported_exit:
                r.reported_exit = True
                note = r.exit_note()
                alive = sum(x.proc.poll() is None for x in replicas)
                logger.error("%s; %d of %d replicas left", note, alive, len(replicas))
                worker = pool.by_url(r.url)
                if worker is not None:
                    pool.retire(worker, note)
        if all(r.proc.poll() is not None for r in replicas):
            logger.error("no replica left; stopping")
            server.exit_code = 1
            await asyncio.sleep(1.0)  # let health probes see 503 before the port closes
            server.should_exit = True
            return
