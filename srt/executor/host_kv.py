"""The host tier's memory, and the copies between it and the device KV pool.

The host pool is token-major: row s holds token slot s's K and V of every layer
([layers, 2, heads, head_dim], in the pool's dtype; FP8 as bytes, which CPU kernels can index),
so a run of consecutive host slots is one contiguous block and each copy is one large
transfer. It is allocated in 1 GiB segments. On CUDA they are pinned by background threads
from start-up on (pinning runs at ~1.7 GB/s per thread on the H200's host: a 78 GB tier
allocated on demand stalled the first rounds for tens of seconds, and up front it would delay
the start by as long); a copy waits only for a segment not pinned yet. On CPU a segment is
allocated when first used.

Copies run on the current stream, in the order the tree queued them, before the next forward:
a device-to-host copy reads slots before a later prefill overwrites them, and a load-back
lands before the prefill that reads it. Each batch of moves goes through a device staging
buffer in chunks: per layer one gather or scatter kernel, per contiguous host run one copy.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from ...radix.tiered import KVMove
from .mem_pool import KVPool

SEGMENT_BYTES = 1 << 30  # host memory is allocated (and pinned) a segment at a time
CHUNK_BYTES = 512 << 20  # device staging per copy round
PIN_THREADS = 4


class HostKVPool:
    def __init__(self, pool: KVPool, num_slots: int, device: torch.device):
        self.pool = pool
        self.device = device
        k0 = pool.k_buffers[0]
        self.dtype = torch.uint8 if pool.is_fp8 else k0.dtype
        self.num_layers = len(pool.k_buffers)
        self.token_shape = (self.num_layers, 2, k0.shape[0], self._view(k0).shape[2])
        self.bytes_per_token = self.token_bytes(pool)
        self.num_slots = num_slots
        self.segment_tokens = max(1, SEGMENT_BYTES // self.bytes_per_token)
        self.chunk_tokens = max(1, CHUNK_BYTES // self.bytes_per_token)
        num_segments = -(-num_slots // self.segment_tokens)
        self._segments: list[torch.Tensor | Future | None] = [None] * num_segments
        self._pinning: ThreadPoolExecutor | None = None
        if device.type == "cuda":  # pinned in the background, in the order slots are handed out
            self._pinning = ThreadPoolExecutor(PIN_THREADS, thread_name_prefix="host-kv-pin")
            self._segments = [self._pinning.submit(self._allocate, i, True) for i in range(num_segments)]
        self.stats = {"d2h_tokens": 0, "h2d_tokens": 0, "d2h_seconds": 0.0, "h2d_seconds": 0.0,
                      "pin_wait_seconds": 0.0}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # CUDA: timed when read

    def close(self) -> None:
        """Stops pinning segments not begun (an exit need not wait for a whole tier)."""
        if self._pinning is not None:
            self._pinning.shutdown(wait=False, cancel_futures=True)

    def _view(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(torch.uint8) if self.pool.is_fp8 else buf

    def _allocate(self, index: int, pin: bool) -> torch.Tensor:
        rows = min(self.segment_tokens, self.num_slots - index * self.segment_tokens)
        return torch.empty((rows, *self.token_shape), dtype=self.dtype, pin_memory=pin)

    @staticmethod
    def token_bytes(pool: KVPool) -> int:
        k0 = pool.k_buffers[0]
        return 2 * len(pool.k_buffers) * k0.shape[0] * k0.shape[2] * k0.element_size()

    def timings(self) -> dict[str, float]:
        """Tokens copied and seconds spent each way (on CUDA from events, so reading them
        waits for nothing but the copies already done)."""
        pending = []
        for kind, start, end in self._events:
            if end.query():
                self.stats[f"{kind}_seconds"] += start.elapsed_time(end) / 1000
            else:
                pending.append((kind, start, end))
        self._events = pending
        return dict(self.stats)

    @property
    def allocated_bytes(self) -> int:
        done = [s.result() if isinstance(s, Future) and s.done() else s for s in self._segments]
        return sum(s.numel() * s.element_size() for s in done if isinstance(s, torch.Tensor))

    def _segment(self, index: int) -> torch.Tensor:
        seg = self._segments[index]
        if isinstance(seg, Future):
            start = time.perf_counter()
            seg = seg.result()  # raises what pinning raised
            self.stats["pin_wait_seconds"] += time.perf_counter() - start
            self._segments[index] = seg
        elif seg is None:
            seg = self._segments[index] = self._allocate(index, False)
        return seg

    def _runs(self, host_slots: np.ndarray):
        """(start in the move, segment, row, length) per run of consecutive host slots that
        stays inside one segment."""
        breaks = np.flatnonzero((np.diff(host_slots) != 1)
                                | (host_slots[1:] % self.segment_tokens == 0)) + 1
        starts = np.concatenate(([0], breaks))
        ends = np.concatenate((breaks, [len(host_slots)]))
        for a, b in zip(starts.tolist(), ends.tolist()):
            seg, row = divmod(int(host_slots[a]), self.segment_tokens)
            yield a, seg, row, b - a

    def run(self, moves: list[KVMove]) -> None:
        """Runs the moves in order (consecutive moves of one kind as one batch)."""
        i = 0
        while i < len(moves):
            kind = moves[i].kind
            j = i
            dev: list[int] = []
            host: list[int] = []
            while j < len(moves) and moves[j].kind == kind:
                dev.extend(moves[j].device_slots)
                host.extend(moves[j].host_slots)
                j += 1
            cuda = self.device.type == "cuda"
            if cuda:
                start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start_event.record()
            start = time.perf_counter()
            for c in range(0, len(dev), self.chunk_tokens):
                d = dev[c:c + self.chunk_tokens]
                h = np.asarray(host[c:c + self.chunk_tokens], dtype=np.int64)
                if kind == "d2h":
                    self._to_host(d, h)
                else:
                    self._to_device(d, h)
            if cuda:  # no synchronize: the copies overlap the step in flight
                end_event.record()
                self._events.append((kind, start_event, end_event))
            else:
                self.stats[f"{kind}_seconds"] += time.perf_counter() - start
            self.stats[f"{kind}_tokens"] += len(dev)
            i = j

    def _index(self, slots: list[int]) -> torch.Tensor:
        """Slot indices on the device. Through pinned memory: a copy from pageable memory
        waits for the whole stream, which would stall the step in flight."""
        idx = torch.tensor(slots, dtype=torch.int64)
        if self.device.type != "cuda":
            return idx
        return idx.pin_memory().to(self.device, non_blocking=True)

    def _gather(self, device_slots: list[int]) -> torch.Tensor:
        """The KV of `device_slots` on the device, token-major: [n, layers, 2, heads, dim]."""
        idx = self._index(device_slots)
        out = torch.empty((len(device_slots), *self.token_shape), dtype=self.dtype, device=self.device)
        for layer in range(self.num_layers):
            for kv, bufs in enumerate((self.pool.k_buffers, self.pool.v_buffers)):
                src = self._view(bufs[layer])  # [heads, slots, dim]
                out[:, layer, kv].copy_(src.index_select(1, idx).transpose(0, 1))
        return out

    def _scatter(self, device_slots: list[int], data: torch.Tensor) -> None:
        idx = self._index(device_slots)
        for layer in range(self.num_layers):
            for kv, bufs in enumerate((self.pool.k_buffers, self.pool.v_buffers)):
                self._view(bufs[layer]).index_copy_(1, idx, data[:, layer, kv].transpose(0, 1))

    def _to_host(self, device_slots: list[int], host_slots: np.ndarray) -> None:
        staged = self._gather(device_slots)
        for a, seg, row, n in self._runs(host_slots):
            self._segment(seg)[row:row + n].copy_(staged[a:a + n], non_blocking=True)

    def _to_device(self, device_slots: list[int], host_slots: np.ndarray) -> None:
        staged = torch.empty((len(device_slots), *self.token_shape), dtype=self.dtype, device=self.device)
        for a, seg, row, n in self._runs(host_slots):
            staged[a:a + n].copy_(self._segment(seg)[row:row + n], non_blocking=True)
        self._scatter(device_slots, staged)

    # ---- the disk tier's reads and writes go through the device directly --------------------

    def read_tokens(self, device_slots: list[int]) -> bytes:
        """The KV of `device_slots` as bytes (token-major), waiting for the device."""
        return self._gather(device_slots).cpu().view(torch.uint8).numpy().tobytes()

    def write_tokens(self, device_slots: list[int], payload: bytes | memoryview) -> None:
        data = torch.frombuffer(bytearray(payload), dtype=self.dtype).view(len(device_slots), *self.token_shape)
        self._scatter(device_slots, data.to(self.device, non_blocking=False))


def host_tier_tokens(bytes_per_token: int, tokens: int | None, size_bytes: int | None) -> int:
    """The host tier's size in tokens, refused (naming the setting and the sizes) when it does
    not fit in the host memory available now."""
    if tokens is None:
        tokens = int(size_bytes // bytes_per_token)
        name = "hicache_size"
    else:
        name = "hicache_ratio"
    need = tokens * bytes_per_token
    available = available_host_memory()
    if available is not None and need > available:
        raise ValueError(f"{name}: the host tier needs {need / 2**30:.1f} GiB ({tokens} tokens x "
                         f"{bytes_per_token} bytes) but only {available / 2**30:.1f} GiB of host memory is available")
    if tokens < 1:
        raise ValueError(f"{name}: the host tier would hold no token ({bytes_per_token} bytes each)")
    return tokens


def available_host_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def model_identity(loaded, args, tp_rank: int, kv_dtype: torch.dtype) -> str:
    """What KV on disk must have been computed with to be reused: the weights (each file's
    name, size and a hash of its first and last MiB), the config, dtypes, page size and rank."""
    import hashlib
    import json
    import os

    h = hashlib.sha256()
    if args.model.load_format == "dummy":
        h.update(f"dummy seed={args.model.random_seed}".encode())
    else:
        root = loaded.model_path if os.path.isfile(loaded.model_path) else loaded.local_dir
        files = [root] if os.path.isfile(root) else sorted(
            os.path.join(root, n) for n in os.listdir(root) if n.endswith((".safetensors", ".bin", ".gguf", ".pt")))
        for path in files:
            size = os.path.getsize(path)
            h.update(f"{os.path.basename(path)}:{size}".encode())
            with open(path, "rb") as f:
                h.update(f.read(1 << 20))
                f.seek(max(0, size - (1 << 20)))
                h.update(f.read(1 << 20))
    h.update(json.dumps(loaded.hf_config.to_dict(), sort_keys=True, default=str).encode())
    h.update(f"dtype={args.model.resolved_dtype()} kv={kv_dtype} page={args.cache.page_size} "
             f"rank={tp_rank}".encode())
    return h.hexdigest()
