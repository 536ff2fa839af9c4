"""Runs raw forwards through the engine's runner, for comparing logits against the reference."""

from __future__ import annotations

import torch

from radixlm.srt.executor.batch_builder import build_extend_batch
from radixlm.srt.core.step import ExtendPlan
from radixlm.srt.core.request import Req
from radixlm.srt.sampling_params import SamplingParams


def extend_logits(engine, chunks: list[list[list[int]]]) -> list[torch.Tensor]:
    """For each request (a list of token-id chunks), extends chunk by chunk -- later chunks
    attend over the KV of earlier ones as a cached prefix -- and returns the logits of every
    position, [total_len, vocab]. All requests run batched, one forward per chunk index."""
    sched = engine.scheduler
    reqs, rows = [], []
    for i, req_chunks in enumerate(chunks):
        req = Req(rid=f"probe-{i}", origin_input_ids=[t for c in req_chunks for t in c],
                  sampling_params=SamplingParams())
        req.req_pool_idx = sched.req_table.alloc()
        reqs.append(req)
        rows.append([])
    owned: list[int] = []
    try:
        for step in range(max(len(c) for c in chunks)):
            plans = []
            for req, req_chunks in zip(reqs, chunks):
                if step >= len(req_chunks):
                    continue
                n = len(req_chunks[step])
                last = int(sched.req_table.table[req.req_pool_idx, req.kv_len - 1]) if req.kv_len else None
                slots = sched.allocator.alloc(req.kv_len, n, last)
                owned.extend(slots)
                sched.req_table.table[req.req_pool_idx, req.kv_len:req.kv_len + n] = slots
                plans.append(ExtendPlan(req, req.kv_len, n, slots, req.kv_len, n))
            logits = sched.engine.runner.forward(build_extend_batch(plans, sched.engine.device))
            offset = 0
            for plan in plans:
                rows[reqs.index(plan.req)].append(logits[offset:offset + plan.extend_len])
                offset += plan.extend_len
                plan.req.kv_len += plan.extend_len
    finally:
        sched.allocator.free(owned)
        for req in reqs:
            sched.req_table.free(req.req_pool_idx)
    return [torch.cat(r) for r in rows]


def write_stub_gguf(path, architecture: str) -> None:
    """A GGUF file that names `architecture` and holds one small tensor: enough for the loader
    to read its header and decide whether it supports it."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
