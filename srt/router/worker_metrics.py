"""/metrics of the router: every worker's Prometheus text with a `worker="URL"` label added to
each sample (one HELP/TYPE per metric family, the workers' samples under it, as the text format
wants), then the router's own counters."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("radixlm_router_requests", "Requests sent to each worker (retries included)",
                                ["worker"], registry=r)
        self.retries = Counter("radixlm_router_retries", "Requests sent again to another worker after a failure",
                               registry=r)
        self.stream_errors = Counter("radixlm_router_stream_errors", "Streams ended with an error event after "
                                     "their worker failed", registry=r)
        self.no_worker = Counter("radixlm_router_unavailable", "Requests answered 503: no worker could serve "
                                 "them", registry=r)
        self.healthy = Gauge("radixlm_router_workers_healthy", "Workers passing health checks", registry=r)
        self.in_flight = Gauge("radixlm_router_in_flight", "Requests in flight through the router", ["worker"],
                               registry=r)

    def render(self) -> str:
        return generate_latest(self.registry).decode()


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def add_label(sample: str, worker: str) -> str:
    """`name{a="1"} 2` -> `name{worker="URL",a="1"} 2`; `name 2` -> `name{worker="URL"} 2`."""
    m = _NAME.match(sample)
    if m is None:
        return sample
    name, rest = sample[:m.end()], sample[m.end():]
    label = f'worker="{_escape(worker)}"'
    if rest.startswith("{}"):
        return f"{name}{{{label}}}{rest[2:]}"
    if rest.startswith("{"):
        return f"{name}{{{label},{rest[1:]}"
    return f"{name}{{{label}}}{rest}"


def merge_worker_metrics(texts: dict[str, str]) -> str:
    """Prometheus texts by worker URL -> one text, families in order of first appearance."""
    families: dict[str, dict[str, list[str]]] = {}
    for worker, text in texts.items():
        family = None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    entry = families.setdefault(family, {"HELP": [], "TYPE": [], "samples": []})
                    if not entry[parts[1]]:
                        entry[parts[1]].append(line)
                continue
            m = _NAME.match(line)
            name = family or (m.group(0) if m else "")
            entry = families.setdefault(name, {"HELP": [], "TYPE": [], "samples": []})
            entry["samples"].append(add_label(line, worker))
    out = []
    for entry in families.values():
        out += entry["HELP"] + entry["TYPE"] + entry["samples"]
    return "\n".join(out) + ("\n" if out else "")
