"""The attention-backend interface: plan once per batch, then run every layer over the paged pool.

Eager steps use `plan` + `forward`. Decode steps may instead replay CUDA graphs
(cuda_graph_runner.py); a backend takes part in that only by declaring `supports_cuda_graph`
and implementing the capture/replay hooks below, which are all the graph runner calls.
"""

from __future__ import annotations

import abc

import torch

from ..forward_batch import ForwardBatch

# The graph variant every captured bucket has: plain decode, able to replay any decode batch
# of the bucket's size or smaller.
DEFAULT_GRAPH_VARIANT = "decode"

# What a backend claiming `supports_cuda_graph` must implement (see AttentionBackend).
CUDA_GRAPH_HOOKS = ("init_cuda_graph_state", "cuda_graph_variants", "capture_cuda_graph_plan",
                    "replay_cuda_graph_plan", "choose_cuda_graph_variant")


class AttentionBackend(abc.ABC):
    """Stores each layer's new K/V in the pool and attends over prefix + new tokens.

    `plan` is called once per forward with the batch metadata; `forward` then runs for every
    layer and must not depend on anything but the plan, the pool and its arguments.

    CUDA graphs (decode only). A graph records `forward` for every layer of one padded batch
    size (a bucket) and replays it with new inputs, so whatever `forward` reads must live at
    addresses fixed at capture time; only the host-side plan may change between replays. The
    graph runner calls, in this order:
      1. `init_cuda_graph_state(max_bs, max_pages_per_req)` once, before any capture;
      2. for each bucket, largest first (so later buckets can reuse what the first sized), and
         each of its `cuda_graph_variants(bs)`: `capture_cuda_graph_plan(variant, bs, loc)`,
         then it records the model's forward;
      3. per replayed decode batch of B <= bs requests: `choose_cuda_graph_variant(batch, bs)`
         when the bucket has more than one variant, then `replay_cuda_graph_plan(...)`, then
         the graph replays.
    Rows B..bs-1 are padding (token 0 at position 0, K/V written to slot 0, on the padding
    page that the allocator never hands out): the plan must give them a valid one-token
    sequence there; their outputs are dropped. Only one graph runs at a time, so every bucket
    may share the buffers made in step 1.
    """

    @abc.abstractmethod
    def plan(self, batch: ForwardBatch) -> None: ...

    def graph_can_replay(self, batch: ForwardBatch) -> bool:
        """False when this decode batch does not fit the fixed-size state the graphs were
        captured with (it then runs eagerly, whatever the bucket's variants)."""
        return True

    def prefers_eager(self, batch: ForwardBatch) -> bool:
        """True when this batch should be planned and run eagerly even though a CUDA graph could
        replay it (an attention plan the graph does not hold, such as cascade, is worth more).
        Asked only for a bucket captured with the default variant alone: where a bucket has more
        variants, `choose_cuda_graph_variant` picks among them instead."""
        return False

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] -> [T, num_heads * head_dim]."""

    def forward_with_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                            positions: torch.Tensor, rotary, ops) -> torch.Tensor:
        """forward after rotating q and k (`rotary`, a models.rotary.RotaryEmbedding, with `ops`).
        A backend may fold the rotation into its KV store."""
        q, k = rotary(positions, q, k, ops)
        return self.forward(q, k, v, layer_id)

    # ---- CUDA-graph capture and replay -------------------------------------------------------

    @property
    def supports_cuda_graph(self) -> bool:
        """Whether decode steps may be captured and replayed as CUDA graphs with this backend.
        False unless a backend implements every hook in CUDA_GRAPH_HOOKS; the model runner
        then runs every step eagerly."""
        return False

    def init_cuda_graph_state(self, max_bs: int, max_pages_per_req: int) -> None:
        """Allocates the fixed-address buffers the graphs read (e.g. page tables), sized for
        `max_bs` requests of up to `max_pages_per_req` pages each."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def cuda_graph_variants(self, bs: int) -> tuple[str, ...]:
        """Names of the attention plans that get their own graph at bucket `bs`; the first is
        always DEFAULT_GRAPH_VARIANT. Called once per bucket, at capture."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def capture_cuda_graph_plan(self, variant: str, bs: int, out_cache_loc: torch.Tensor) -> object:
        """Makes bucket `bs`'s fixed-address state for `variant` and plans it for a batch made
        only of padding, ready for the capture that follows. `out_cache_loc` is the graph's
        [bs] input buffer of KV slots, where `forward` must store the new K/V. Returns an opaque
        handle that the runner passes back to `replay_cuda_graph_plan`."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def choose_cuda_graph_variant(self, batch: ForwardBatch, bs: int) -> str:
        """Which of `cuda_graph_variants(bs)` replays this decode batch (padded to `bs`).
        Asked only for a bucket with more than one variant."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def replay_cuda_graph_plan(self, variant: str, handle: object, batch: ForwardBatch, bs: int,
                               out_cache_loc: torch.Tensor) -> None:
        """Plans the captured `variant` of bucket `bs` (its `handle`) for `batch`, on the host
        and into the graph's fixed buffers only; `out_cache_loc` is the same buffer as at
        capture, already holding the batch's slots and the padding slot."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")


def missing_cuda_graph_hooks(backend: AttentionBackend) -> list[str]:
    """The CUDA_GRAPH_HOOKS that `backend`'s class leaves to the base class (which only raise)."""
    cls = type(backend)
    return [name for name in CUDA_GRAPH_HOOKS if getattr(cls, name) is getattr(AttentionBackend, name)]
