"""CUDA graphs for decode: one captured forward per batch-size bucket, replayed with padding.

A decode step is hundreds of small kernels; launching them from Python costs more than they
run at small batches. Each bucket's graph reads its inputs from fixed buffers and the attention
backend's plan from state it made for that bucket; replay copies the batch in, plans the
attention on the host (plan cannot be captured) and launches the whole step at once. A batch
smaller than its bucket is padded with requests of one token on the padding page, whose outputs
are dropped. The backend may capture more than one graph per bucket (FlashInfer adds cascade
attention at large buckets, for batches whose requests share long cached prefixes: at those
sizes an eager step's launches cost more than the step) and picks one per batch.

The runner talks to the backend only through AttentionBackend's CUDA-graph hooks (base.py).

With LoRA adapters (srt/lora/layers.py) each graph is captured twice: without the adapters'
products, for batches of base-model requests only, and with them, reading each row's adapter
slot from a fixed buffer.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from .attention.base import DEFAULT_GRAPH_VARIANT, AttentionBackend, missing_cuda_graph_hooks
from .forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

PADDING_SLOT = 0  # inside page 0, which the allocator never hands out


def batch_size_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64 and every 16 after: padding wastes at most ~20%."""
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, min(max_bs, 64) + 1, 8))
    sizes += list(range(80, max_bs + 1, 16))
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sorted(set(sizes))


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, max_bs: int, max_pages_per_req: int,
                 device: torch.device, lora=None):
        """lora: the adapters' BatchAdapters (srt/lora/layers.py), with --enable-lora."""
        check_capturable(backend)
        self.model = model
        self.backend = backend
        self.lora = lora
        self.buckets = batch_size_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.full((self.max_bs,), PADDING_SLOT, dtype=torch.int64, device=device)
        self.logits: torch.Tensor | None = None  # [max_bs, vocab] float32, every graph's output
        # Each row's LoRA table row (the last one, all zeros, for the base model and padding).
        self.adapter_rows = None if lora is None else torch.full((self.max_bs,), lora.num_slots, dtype=torch.int64,
                                                                 device=device)
        # Per bucket, per variant (the default first): (graph, its logits, the backend's handle);
        # with LoRA the variant's graph with the adapters' products is under (variant, "lora").
        self.graphs: dict[int, dict[str | tuple[str, str], tuple[torch.cuda.CUDAGraph, torch.Tensor, object]]] = {}
        backend.init_cuda_graph_state(self.max_bs, max_pages_per_req)
        started = time.perf_counter()
        pool = None
        # Largest first, so smaller graphs reuse the memory pool the largest one allocated.
        for bs in reversed(self.buckets):
            variants = backend.cuda_graph_variants(bs)
            if not variants or variants[0] != DEFAULT_GRAPH_VARIANT:
                raise ValueError(f"{type(backend).__name__}.cuda_graph_variants({bs}) must start with "
                                 f"{DEFAULT_GRAPH_VARIANT!r}, got {variants!r}")
            self.graphs[bs] = {}
            for variant in variants:
                pool = self._capture(bs, variant, pool, with_lora=False)
                if lora is not None:
                    pool = self._capture(bs, variant, pool, with_lora=True)
        extra: dict[str, int] = {}
        for captured in self.graphs.values():
            for variant in list(captured)[1:]:
                if isinstance(variant, str):  # (variant, "lora") keys are the same graphs with LoRA
                    extra[variant] = extra.get(variant, 0) + 1
        logger.info("captured %d decode CUDA graphs (batch sizes up to %d%s%s) in %.1fs", len(self.buckets),
                    self.max_bs, "".join(f"; {n} with {v} attention" for v, n in extra.items()),
                    "; each also with LoRA" if lora is not None else "", time.perf_counter() - started)

    def should_replay(self, batch: ForwardBatch) -> bool:
        """Whether `batch` runs from a graph rather than eagerly: a decode batch within the
        largest bucket that fits the backend's graph state, unless its bucket has only the
        default graph and the backend would rather plan it eagerly (a bucket with variants lets
        the backend choose among them)."""
        if not (batch.is_decode and batch.batch_size <= self.max_bs and self.backend.graph_can_replay(batch)):
            return False
        variants = len(self.graphs[self._bucket(batch.batch_size)]) // (2 if self.lora is not None else 1)
        return variants > 1 or not self.backend.prefers_eager(batch)

    def _bucket(self, num_reqs: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_reqs)]

    def _capture(self, bs: int, variant: str, pool, with_lora: bool):
        handle = self.backend.capture_cuda_graph_plan(variant, bs, self.out_cache_loc[:bs])
        logits, graph = self._record(bs, pool, with_lora)
        self.graphs[bs][(variant, "lora") if with_lora else variant] = (graph, logits, handle)
        return graph.pool()

    def _record(self, bs: int, pool, with_lora: bool = False) -> tuple[torch.Tensor, torch.cuda.CUDAGraph]:
        """Captures one forward of the first `bs` rows as planned; (its logits, the graph)."""
        def run():
            if self.lora is not None:  # the masks' gather is part of the graph
                self.lora.prepare_from(self.adapter_rows[:bs] if with_lora else None)
            return self.model(self.input_ids[:bs], self.positions[:bs], self.backend)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: lazy inits and autotuning must not happen while capturing
                warm = run()
        torch.cuda.current_stream().wait_stream(stream)
        if self.logits is None:  # the largest bucket comes first
            self.logits = torch.empty(self.max_bs, *warm.shape[1:], dtype=warm.dtype, device=warm.device)
        del warm
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            # Every graph writes into one buffer: a logits tensor kept alive per graph would pin
            # bs x vocab floats for each of ~40 buckets and variants (GBs on an 8B model).
            logits = self.logits[:bs]
            logits.copy_(run())
        return logits, graph

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits [B, vocab] for a decode batch of B <= max_bs."""
        num_reqs = batch.batch_size
        bs = self._bucket(num_reqs)
        self.input_ids[:num_reqs].copy_(batch.input_ids)
        self.positions[:num_reqs].copy_(batch.positions)
        self.out_cache_loc[:num_reqs].copy_(batch.out_cache_loc)
        if bs > num_reqs:  # padding rows: token 0 at position 0, K/V written to the padding slot
            self.input_ids[num_reqs:bs].zero_()
            self.positions[num_reqs:bs].zero_()
            self.out_cache_loc[num_reqs:bs].fill_(PADDING_SLOT)
        captured = self.graphs[bs]
        # The rows the runner's LoRA prepare() put on the device for this batch, copied in place.
        with_lora = self.lora is not None and self.lora.rows is not None
        if with_lora:
            self.adapter_rows[:num_reqs].copy_(self.lora.rows)
            self.adapter_rows[num_reqs:bs].fill_(self.lora.num_slots)
        variant = (self.backend.choose_cuda_graph_variant(batch, bs)
                   if len(captured) > (2 if self.lora is not None else 1) else DEFAULT_GRAPH_VARIANT)
        graph, logits, handle = captured[(variant, "lora") if with_lora else variant]
        self.backend.replay_cuda_graph_plan(variant, handle, batch, bs, self.out_cache_loc[:bs])
        graph.replay()
        return logits[:num_reqs]


def check_capturable(backend: AttentionBackend) -> None:
    """Refuses, by name, a backend that cannot be captured or lacks a capture/replay hook."""
    name = type(backend).__name__
    if not backend.supports_cuda_graph:
        raise ValueError(f"{name} cannot be captured in CUDA graphs (supports_cuda_graph is False); "
                         "run with --disable-cuda-graph")
    missing = missing_cuda_graph_hooks(backend)
    if missing:
        raise TypeError(f"{name} says it supports CUDA graphs but does not implement {', '.join(missing)}")
