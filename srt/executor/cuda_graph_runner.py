"""CUDA graphs for decode: one captured forward per batch-size bucket, replayed with padding.

A decode step is hundreds of small kernels; launching them from Python costs more than they
run at small batches. Each bucket's graph reads its inputs from fixed buffers and FlashInfer's
page table from a wrapper made for that bucket; replay copies the batch in, plans the wrapper
on the host (plan cannot be captured) and launches the whole step at once. A batch smaller
than its bucket is padded with requests of one token on the padding page, whose outputs are
dropped. Large buckets have a second graph with cascade attention, for batches whose requests
share long cached prefixes (at those sizes an eager step's launches cost more than the step).
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from radixlm.srt.executor.attention.flashinfer_backend import CASCADE_GRAPH_MIN_BS, FlashInferBackend
from radixlm.srt.executor.forward_batch import ForwardBatch

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
    def __init__(self, model: torch.nn.Module, backend: FlashInferBackend, max_bs: int, max_pages_per_req: int):
        self.model = model
        self.backend = backend
        self.buckets = batch_size_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        device = backend.device
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.full((self.max_bs,), PADDING_SLOT, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.wrappers = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.page_indices = torch.zeros(self.max_bs * max_pages_per_req, dtype=torch.int32, device=device)
        # Cascade graphs: (graph, logits, wrappers) per bucket of at least CASCADE_GRAPH_MIN_BS.
        self.cascade_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, object]] = {}
        cascade_buckets = [b for b in self.buckets if b >= CASCADE_GRAPH_MIN_BS] if backend.cascade else []
        self.prefix_page_indices = (torch.zeros_like(self.page_indices) if cascade_buckets else None)
        started = time.perf_counter()
        pool = None
        # Largest first, so smaller graphs reuse the memory pool the largest one allocated.
        for bs in reversed(self.buckets):
            pool = self._capture(bs, pool)
            if bs in cascade_buckets:
                pool = self._capture_cascade(bs, pool)
        logger.info("captured %d decode CUDA graphs (batch sizes up to %d; %d with cascade attention) in %.1fs",
                    len(self.buckets), self.max_bs, len(cascade_buckets), time.perf_counter() - started)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.is_decode and batch.batch_size <= self.max_bs

    def has_cascade_graph(self, batch: ForwardBatch) -> bool:
        return self._bucket(batch.batch_size) in self.cascade_graphs

    def _bucket(self, num_reqs: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_reqs)]

    def _capture(self, bs: int, pool):
        wrapper = self.backend.make_graph_decode_wrapper(bs, self.page_indices)
        self.wrappers[bs] = wrapper
        self.backend.plan_graph_decode(wrapper, None, bs, self.out_cache_loc[:bs])
        self.logits[bs], graph = self._record(bs, pool)
        self.graphs[bs] = graph
        return graph.pool()

    def _capture_cascade(self, bs: int, pool):
        wrappers = self.backend.make_graph_cascade(bs, self.page_indices, self.prefix_page_indices)
        self.backend.plan_graph_cascade(wrappers, None, bs, self.out_cache_loc[:bs])
        logits, graph = self._record(bs, pool)
        self.cascade_graphs[bs] = (graph, logits, wrappers)
        return graph.pool()

    def _record(self, bs: int, pool) -> tuple[torch.Tensor, torch.cuda.CUDAGraph]:
        """Captures one forward of the first `bs` rows as planned; (its logits, the graph)."""
        run = lambda: self.model(self.input_ids[:bs], self.positions[:bs], self.backend)  # noqa: E731
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: lazy inits and autotuning must not happen while capturing
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = run()
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
        cascade = self.cascade_graphs.get(bs)
        if cascade is not None and self.backend.wants_graph_cascade(batch, bs):
            graph, logits, wrappers = cascade
            self.backend.plan_graph_cascade(wrappers, batch, bs, self.out_cache_loc[:bs])
            graph.replay()
            return logits[:num_reqs]
        self.backend.plan_graph_decode(self.wrappers[bs], batch, bs, self.out_cache_loc[:bs])
        self.graphs[bs].replay()
        return self.logits[bs][:num_reqs]
