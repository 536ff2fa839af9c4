"""The host tier's memory, and the copies between it and the device KV pool.

The host pool is token-major: row s holds token slot s's K and V of every layer as bytes
([layers, 2, heads, head_dim * itemsize]), so a run of consecutive host slots is one
contiguous block and each copy is one large transfer. It is allocated in segments on first
use (pinned on CUDA): a 78 GB tier costs nothing at start-up, and only what the workload
fills is ever pinned.

Copies run on the current stream, in the order the tree queued them, before the next forward:
a device-to-host copy reads slots before a later prefill overwrites them, and a load-back
lands before the prefill that reads it. Each batch of moves goes through a device staging
buffer in chunks: per layer one gather or scatter kernel, per contiguous host run one copy.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ...radix.tiered import KVMove
from .mem_pool import KVPool

SEGMENT_BYTES = 1 << 30  # host memory is allocated (and pinned) a segment at a time
CHUNK_BYTES = 256 << 20  # device staging per copy round


class HostKVPool:
    def __init__(self, pool: KVPool, num_slots: int, device: torch.device):
        self.pool = pool
        self.device = device
        k0 = pool.k_buffers[0].view(torch.uint8)
        self.num_layers = len(pool.k_buffers)
        self.heads, self.row_bytes = k0.shape[0], k0.shape[2]
        self.token_shape = (self.num_layers, 2, self.heads, self.row_bytes)
        self.bytes_per_token = int(np.prod(self.token_shape))
        self.num_slots = num_slots
        self.segment_tokens = max(1, SEGMENT_BYTES // self.bytes_per_token)
        self.chunk_tokens = max(1, CHUNK_BYTES // self.bytes_per_token)
        self._segments: list[torch.Tensor | None] = [None] * -(-num_slots // self.segment_tokens)
        self._pin = device.type == "cuda"
        self.stats = {"d2h_tokens": 0, "h2d_tokens": 0, "d2h_seconds": 0.0, "h2d_seconds": 0.0}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # CUDA: timed when read

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
        return sum(s.numel() for s in self._segments if s is not None)

    def _segment(self, index: int) -> torch.Tensor:
        seg = self._segments[index]
        if seg is None:
            rows = min(self.segment_tokens, self.num_slots - index * self.segment_tokens)
            seg = torch.empty((rows, *self.token_shape), dtype=torch.uint8, pin_memory=self._pin)
            self._segments[index] = seg
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

    def _gather(self, device_slots: list[int]) -> torch.Tensor:
        """The KV of `device_slots` on the device, token-major: [n, layers, 2, heads, bytes]."""
        idx = torch.tensor(device_slots, dtype=torch.int64, device=self.device)
        out = torch.empty((len(device_slots), *self.token_shape), dtype=torch.uint8, device=self.device)
        for layer in range(self.num_layers):
            for kv, bufs in enumerate((self.pool.k_buffers, self.pool.v_buffers)):
                src = bufs[layer].view(torch.uint8)  # [heads, slots, bytes]
                out[:, layer, kv].copy_(src.index_select(1, idx).transpose(0, 1))
        return out

    def _scatter(self, device_slots: list[int], data: torch.Tensor) -> None:
        idx = torch.tensor(device_slots, dtype=torch.int64, device=self.device)
        for layer in range(self.num_layers):
            for kv, bufs in enumerate((self.pool.k_buffers, self.pool.v_buffers)):
                bufs[layer].view(torch.uint8).index_copy_(1, idx, data[:, layer, kv].transpose(0, 1))

    def _to_host(self, device_slots: list[int], host_slots: np.ndarray) -> None:
        staged = self._gather(device_slots)
        for a, seg, row, n in self._runs(host_slots):
            self._segment(seg)[row:row + n].copy_(staged[a:a + n], non_blocking=True)

    def _to_device(self, device_slots: list[int], host_slots: np.ndarray) -> None:
        staged = torch.empty((len(device_slots), *self.token_shape), dtype=torch.uint8, device=self.device)
        for a, seg, row, n in self._runs(host_slots):
            staged[a:a + n].copy_(self._segment(seg)[row:row + n], non_blocking=True)
        self._scatter(device_slots, staged)

    # ---- the disk tier's reads and writes go through the device directly --------------------

    def read_tokens(self, device_slots: list[int]) -> bytes:
        """The KV of `device_slots` as bytes (token-major), waiting for the device."""
        return self._gather(device_slots).cpu().numpy().tobytes()

    def write_tokens(self, device_slots: list[int], payload: bytes | memoryview) -> None:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(len(device_slots), *self.token_shape)
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
