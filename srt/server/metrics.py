"""Prometheus metrics for /metrics: request and token counters, latency histograms, and the
scheduler's gauges (filled from its server info when scraped)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("radixlm_requests", "Finished requests", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("radixlm_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("radixlm_cached_prompt_tokens", "Prompt tokens served from the radix cache", registry=r)
        self.generation_tokens = Counter("radixlm_generation_tokens", "Generated tokens", registry=r)
        # Speculative decoding's mean accepted length is 1 + accepted / verify steps.
        self.spec_verify_steps = Counter("radixlm_spec_verify_steps", "Speculative verify forwards", registry=r)
        self.spec_accepted = Counter("radixlm_spec_accepted_tokens", "Draft tokens accepted by verification",
                                     registry=r)
        self.ttft = Histogram("radixlm_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("radixlm_inter_token_latency_seconds", "Time between output tokens", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("radixlm_e2e_request_latency_seconds", "Request latency", buckets=_LATENCY_BUCKETS, registry=r)
        self.rejected = Counter("radixlm_rejected_requests", "Requests refused before they ran, by reason",
                                ["reason"], registry=r)
        self.running = Gauge("radixlm_num_running_reqs", "Requests in the decode batch", registry=r)
        self.waiting = Gauge("radixlm_num_waiting_reqs", "Requests waiting for admission", registry=r)
        self.kv_usage = Gauge("radixlm_kv_usage", "Fraction of KV slots in use (requests and cache)", registry=r)
        self.cache_hit_rate = Gauge("radixlm_cache_hit_rate", "Prompt tokens matched in the radix cache / queried", registry=r)
        # The hierarchical cache, per tier (device, host, storage): cumulative figures from the
        # scheduler are gauges (they restart at /flush_cache); per-request ones are counters.
        self.tier_cached = Counter("radixlm_cached_prompt_tokens_by_tier", "Prompt tokens served from each cache tier",
                                   ["tier"], registry=r)
        tier_gauges = {
            "capacity_tokens": "Tokens the tier can hold", "used_tokens": "Tokens the tier holds",
            "hit_tokens": "Tokens loaded back from the tier at admission",
            "miss_tokens": "Tokens found in the tier but not loaded (no room on the device)",
            "bytes_read": "Bytes moved out of the tier to the device", "bytes_written": "Bytes written to the tier",
            "load_seconds": "Seconds spent loading the tier's KV back", "corrupt_blocks": "Bad blocks found (misses)",
        }
        self.tier = {name: Gauge(f"radixlm_cache_tier_{name}", text, ["tier"], registry=r)
                     for name, text in tier_gauges.items()}
        # LoRA (--enable-lora): adapters loaded, slots in use, and copies of adapters into slots.
        self.lora_loaded = Gauge("radixlm_lora_adapters_loaded", "LoRA adapters loaded", registry=r)
        self.lora_pinned = Gauge("radixlm_lora_slots_in_use", "Device slots holding adapters of running requests",
                                 registry=r)
        self.lora_slot_loads = Gauge("radixlm_lora_slot_loads", "Adapters copied into a device slot since start",
                                     registry=r)
        # Program sessions (docs/sessions.md): the scheduler's running totals become counter increments.
        self.session_protected = Gauge("radixlm_session_protected_tokens",
                                       "Tokens of sessions' prefixes protected from eviction", registry=r)
        self.sessions_active = Gauge("radixlm_sessions_active", "Live program sessions", registry=r)
        self.session_expiries = Counter("radixlm_session_expiries", "Sessions ended by --session-ttl", registry=r)
        self.session_releases = Counter("radixlm_session_releases", "Sessions' protections let go before their end: "
                                        "budget (--session-total-tokens), pressure (evicted for running work)",
                                        ["reason"], registry=r)
        self._session_totals: dict[str, int] = {}
        # Vision-language models: the encoder cache (srt/multimodal/encoder_cache.py), its
        # counters since start as the scheduler reports them.
        encoder = {"hits": "Image feature lookups the encoder cache answered",
                   "misses": "Image feature lookups that ran the vision encoder",
                   "encoded_images": "Images the vision encoder ran on",
                   "encoder_runs": "Vision encoder forwards (same-size images run together)",
                   "used_bytes": "Bytes of vision features the encoder cache holds"}
        self.encoder_cache = {name: Gauge(f"radixlm_encoder_cache_{name}", text, registry=r)
                              for name, text in encoder.items()}

    def on_request_end(self, state: Any) -> None:
        """`state`: the tokenizer manager's record of a request that ended (finished or not)."""
        reason = (state.finish_reason or {}).get("type", "abort")
        self.requests.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(state.prompt_tokens)
        self.cached_tokens.inc(state.cached_tokens)
        if getattr(state, "cached_tiers", None):
            for tier, n in zip(("device", "host", "storage"), state.cached_tiers):
                self.tier_cached.labels(tier=tier).inc(n)
        self.generation_tokens.inc(state.completion_tokens)
        self.spec_verify_steps.inc(state.spec_verify_ct)
        self.spec_accepted.inc(state.spec_accepted)
        if state.last_token_time is not None:
            self.e2e.observe(state.last_token_time - state.created)

    def on_rejected(self, reason: str) -> None:
        """reason: queue_full, rate_limited, body_too_large, unauthorized, unavailable."""
        self.rejected.labels(reason=reason).inc()

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def update_from_server_info(self, info: dict[str, Any]) -> None:
        self.running.set(info.get("num_running_reqs", 0))
        self.waiting.set(info.get("num_waiting_reqs", 0))
        kv = info.get("kv", {})
        if kv.get("capacity"):
            self.kv_usage.set(1.0 - kv.get("free", 0) / kv["capacity"])
        self.cache_hit_rate.set(info.get("cache", {}).get("hit_rate", 0.0))
        lora = info.get("lora")
        if lora:
            self.lora_loaded.set(len(lora["loaded"]))
            self.lora_pinned.set(lora["pinned_slots"])
            self.lora_slot_loads.set(lora["slot_loads"])
        sessions = info.get("sessions")
        if sessions:
            self.session_protected.set(sessions["protected_tokens"])
            self.sessions_active.set(sessions["active"])
            for key, counter in (("expired", self.session_expiries),
                                 ("budget_releases", self.session_releases.labels(reason="budget")),
                                 ("pressure_releases", self.session_releases.labels(reason="pressure"))):
                counter.inc(max(0, sessions[key] - self._session_totals.get(key, 0)))
                self._session_totals[key] = sessions[key]
        encoder = info.get("encoder_cache")
        if encoder:
            for name, gauge in self.encoder_cache.items():
                gauge.set(encoder[name])
        tiers = info.get("cache_tiers", {})
        figures = {"device": {"capacity_tokens": "capacity_tokens", "used_tokens": "cached_tokens"},
                   "host": {"capacity_tokens": "capacity_tokens", "used_tokens": "used_tokens",
                            "hit_tokens": "hit_tokens", "miss_tokens": "miss_tokens", "bytes_read": "loaded_bytes",
                            "bytes_written": "written_bytes", "load_seconds": "load_seconds"},
                   "storage": {"used_tokens": "used_tokens", "hit_tokens": "hit_tokens", "bytes_read": "bytes_read",
                               "bytes_written": "bytes_written", "load_seconds": "read_seconds",
                               "corrupt_blocks": "corrupt"}}
        for tier, names in figures.items():
            values = tiers.get(tier)
            if values is None:
                continue
            for gauge, key in names.items():
                self.tier[gauge].labels(tier=tier).set(values.get(key, 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
