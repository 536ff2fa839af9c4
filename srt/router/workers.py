"""The workers behind the router: their loads (requests in flight through the router) and their
health. A worker is taken out when its /health check fails or a connection to it fails, and put
back when /health answers 200 again; its entries in the prefix tree are forgotten then (it may
have restarted with an empty cache)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

import httpx

logger = logging.getLogger("radixlm.router")


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else "http://" + url


def describe_error(e: BaseException, timeout_s: float | None = None) -> str:
    """A transport failure in words a user can act on."""
    if isinstance(e, httpx.ConnectTimeout):
        return "did not accept a connection in time"
    if isinstance(e, httpx.TimeoutException):
        return f"did not answer within {timeout_s:.0f}s" if timeout_s else "did not answer in time"
    if isinstance(e, httpx.ConnectError):
        return f"connection failed ({e or 'refused'})"
    if isinstance(e, (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError)):
        return f"connection lost ({e or type(e).__name__})"
    return f"{type(e).__name__}: {e}"


def error_message(response_body: bytes) -> str:
    """The message of a worker's JSON error body, else its first bytes."""
    import orjson

    try:
        return str(orjson.loads(response_body)["error"]["message"])
    except Exception:
        return response_body[:200].decode(errors="replace").strip()


@dataclass
class Worker:
    url: str
    healthy: bool = False
    reason: str = "not checked yet"  # why it is unhealthy
    in_flight: int = 0
    requests: int = 0  # sent to it by the router, retries included
    ever_healthy: bool = False
    retired: bool = False  # gone for good (a local replica that exited): no more health checks


class WorkerPool:
    def __init__(self, urls: list[str], client: httpx.AsyncClient, auth_headers: dict[str, str],
                 health_interval_s: float, health_timeout_s: float,
                 on_revive: Callable[[Worker], None] = lambda w: None):
        self.workers = [Worker(normalize_url(u)) for u in dict.fromkeys(urls)]
        self.client = client
        self.auth_headers = auth_headers
        self.interval = health_interval_s
        self.timeout = health_timeout_s
        self.on_revive = on_revive

    def by_url(self, url: str) -> Worker | None:
        return next((w for w in self.workers if w.url == url), None)

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers if w.healthy]

    def mark_down(self, worker: Worker, reason: str) -> None:
        if worker.healthy:
            logger.warning("worker %s taken out: %s", worker.url, reason)
        worker.healthy, worker.reason = False, reason

    def retire(self, worker: Worker, reason: str) -> None:
        self.mark_down(worker, reason)
        worker.retired = True

    def _mark_up(self, worker: Worker) -> None:
        if not worker.healthy:
            logger.info("worker %s is healthy%s", worker.url, " again" if worker.ever_healthy else "")
            self.on_revive(worker)
        worker.healthy, worker.reason, worker.ever_healthy = True, "", True

    def unhealthy_summary(self) -> str:
        return "; ".join(f"{w.url}: {w.reason}" for w in self.workers if not w.healthy)

    async def check(self, worker: Worker) -> None:
        try:
            resp = await self.client.get(worker.url + "/health", headers=self.auth_headers, timeout=self.timeout)
        except httpx.HTTPError as e:
            if not worker.retired:
                self.mark_down(worker, "/health: " + describe_error(e, self.timeout))
            return
        if worker.retired:
            return
        if resp.status_code == 200:
            self._mark_up(worker)
        else:
            self.mark_down(worker, f"/health: HTTP {resp.status_code} {error_message(resp.content)}".rstrip())

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.workers if not w.retired))

    async def run_health_checks(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.check_all()
