"""`radixlm router --worker-urls URL [URL ...]`: the router in front of replicas started anywhere
(by hand, Kubernetes, Slurm). Also run in-process by `radixlm serve --dp-size N`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass, field
from types import FrameType
from typing import Awaitable, Callable

import httpx
import uvicorn

from ..process_utils import bind_port, stage
from .app import create_router_app
from .policy import POLICIES, make_policy
from .proxy import Proxy
from .worker_metrics import RouterMetrics
from .workers import WorkerPool

logger = logging.getLogger("radixlm.router")

API_KEY_ENV = "RADIXLM_API_KEY"


@dataclass
class RouterConfig:
    worker_urls: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    policy: str = "cache_aware"
    balance_threshold: int = 32
    cache_threshold: float = 0.5
    max_tree_chars: int = 4_000_000
    health_interval: float = 2.0
    health_timeout: float = 5.0
    connect_timeout: float = 5.0
    request_timeout: float = 600.0
    max_request_bytes: int = 8 * 2**20
    graceful_shutdown_timeout: float = 30.0
    log_level: str = "info"


def build_parser() -> argparse.ArgumentParser:
    d = RouterConfig()
    p = argparse.ArgumentParser(prog="radixlm router", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description="Spread requests over `radixlm serve` replicas, each to the replica "
                                            "most likely to hold its prefix in cache.")
    p.add_argument("--worker-urls", nargs="+", required=True, metavar="URL",
                   help="the replicas, e.g. http://10.0.0.5:30000 (http:// is assumed without a scheme)")
    p.add_argument("--host", default=d.host, help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=d.port, help="HTTP port")
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer <key> on every route but "
                   "/health and send it to the workers; unset: $RADIXLM_API_KEY if set")
    p.add_argument("--policy", default=d.policy, choices=POLICIES, help="how a worker is picked")
    p.add_argument("--balance-threshold", type=int, default=d.balance_threshold,
                   help="cache_aware: go to the least-loaded worker when the best-matching one has this many "
                        "more requests in flight")
    p.add_argument("--cache-threshold", type=float, default=d.cache_threshold,
                   help="cache_aware: a match shorter than this share of the request's text counts as none "
                        "(least-loaded worker)")
    p.add_argument("--max-tree-chars", type=int, default=d.max_tree_chars,
                   help="cache_aware: characters of request text remembered per worker (least recently used "
                        "forgotten first)")
    p.add_argument("--health-interval", type=float, default=d.health_interval, help="seconds between health "
                   "checks of each worker")
    p.add_argument("--health-timeout", type=float, default=d.health_timeout, help="seconds a worker's /health "
                   "may take before it counts as failed")
    p.add_argument("--connect-timeout", type=float, default=d.connect_timeout, help="seconds to connect to a "
                   "worker before trying another")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout, help="seconds a worker may stay "
                   "silent (no answer, no stream event) before the request fails naming it")
    p.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes, help="larger bodies get 413")
    p.add_argument("--graceful-shutdown-timeout", type=float, default=d.graceful_shutdown_timeout,
                   help="seconds SIGTERM waits for requests in flight")
    p.add_argument("--log-level", default=d.log_level, help="debug | info | warning | error")
    return p


def parse_args(argv: list[str]) -> RouterConfig:
    ns = build_parser().parse_args(argv)
    config = RouterConfig(**{k: v for k, v in vars(ns).items()})
    config.api_key = config.api_key or os.environ.get(API_KEY_ENV) or None
    if config.balance_threshold < 0 or not 0.0 <= config.cache_threshold <= 1.0:
        build_parser().error("--balance-threshold must be >= 0 and --cache-threshold within [0, 1]")
    for name in ("health_interval", "health_timeout", "connect_timeout", "request_timeout"):
        if getattr(config, name) <= 0:
            build_parser().error(f"--{name.replace('_', '-')} must be > 0")
    return config


def raise_open_files_limit() -> None:
    """Every request in flight holds two sockets in the router (and one in its worker, which
    inherits the limit when the DP launcher starts it): 1024 requests at once would pass the
    usual soft limit of 1024 open files."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 1 << 20), hard))
    except (ImportError, ValueError, OSError):
        pass


class RouterServer(uvicorn.Server):
    """uvicorn's server, except that SIGINT/SIGTERM end it with exit code 0 as they end `radixlm
    serve` (uvicorn would raise the signal again after shutting down); a second SIGINT forces."""

    exit_code = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True


async def serve_router(config: RouterConfig, sock: socket.socket,
                       supervise: Callable[[WorkerPool, RouterServer], Awaitable[None]] | None = None) -> int:
    """Serves until SIGINT/SIGTERM (0) or until `supervise` (the DP launcher's watch over its
    replicas) returns after setting server.should_exit (its exit code on the server: 1)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per forwarded request
    raise_open_files_limit()
    timeout = httpx.Timeout(connect=config.connect_timeout, read=config.request_timeout, write=60.0, pool=None)
    # Idle connections expire before uvicorn's own 5 s keep-alive closes them from the other end
    # (a request on a connection the worker is closing would look like a dead worker).
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=2.0)
    auth = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    policy = make_policy(config.policy, config.max_tree_chars, config.balance_threshold, config.cache_threshold)
    metrics = RouterMetrics()
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        pool = WorkerPool(config.worker_urls, client, auth, config.health_interval, config.health_timeout,
                          on_revive=policy.forget)
        proxy = Proxy(pool, policy, client, metrics, config.request_timeout)
        app = create_router_app(pool, proxy, config.policy, config.api_key, config.max_request_bytes)
        await pool.check_all()
        for w in pool.workers:
            if not w.healthy:
                logger.warning("worker %s not healthy yet: %s", w.url, w.reason)
        host, port = sock.getsockname()[:2]
        server = RouterServer(uvicorn.Config(app, host=host, port=port, log_level=config.log_level,
                                             timeout_graceful_shutdown=int(config.graceful_shutdown_timeout)))
        tasks = [asyncio.ensure_future(pool.run_health_checks())]
        if supervise is not None:
            tasks.append(asyncio.ensure_future(supervise(pool, server)))
        stage(f"router ({config.policy}) at http://{host}:{port} over {len(pool.workers)} workers, "
              f"{len(pool.healthy())} healthy")
        try:
            await server.serve(sockets=[sock])
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return server.exit_code


def main(argv: list[str] | None = None) -> None:
    config = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        sock = bind_port(config.host, config.port)
    except OSError as e:
        logger.error("%s", e)
        sys.exit(1)
    try:
        code = asyncio.run(serve_router(config, sock))
    except KeyboardInterrupt:
        code = 0
    finally:
        sock.close()
    stage("router stopped")
    sys.exit(code)


if __name__ == "__main__":
    main()
