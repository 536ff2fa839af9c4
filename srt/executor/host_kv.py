"""The host tier's copies between host memory and the device KV pool.

The host pool is layer-major within each segment (host_segments.py): segment rows are token
slots, and layer l of a run of consecutive host slots is one contiguous block
([layers, slots, 2, heads, head_dim] in the pool's dtype; FP8 as bytes, which CPU kernels can
index), so each layer of a run is one large copy.

Device-to-host copies (demotions) run on the current stream, in the order the tree queued
them, before the next forward: they read slots before a later step overwrites them. On CUDA,
host-to-device copies (load-backs) run layer by layer beside the next forward (host_loads.py),
which scatters each layer into the pool just before that layer's attention. On CPU the same
copies run in place.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ...radix.tiered import KVMove
from .host_loads import LayerLoads
from .host_segments import HostSegments, PinningGate
from .mem_pool import KVPool

SEGMENT_BYTES = 1 << 30  # host memory is allocated (and pinned) a segment at a time
CHUNK_BYTES = 256 << 20  # device staging per copy round and layer
STAGING_BYTES = 256 << 20  # host staging for disk blocks on their way to the device


class HostKVPool:
    def __init__(self, pool: KVPool, num_slots: int, device: torch.device):
        self.pool = pool
        self.device = device
        self.cuda = device.type == "cuda"
        k0 = pool.k_buffers[0]
        self.dtype = torch.uint8 if pool.is_fp8 else k0.dtype
        self.num_layers = len(pool.k_buffers)
        self.layer_shape = (2, k0.shape[0], self._view(k0).shape[2])  # one token's K and V of a layer
        self.bytes_per_token = self.token_bytes(pool)
        self.num_slots = num_slots
        self.segment_tokens = max(1, SEGMENT_BYTES // self.bytes_per_token)
        self.chunk_tokens = max(1, CHUNK_BYTES * self.num_layers // self.bytes_per_token)
        num_segments = -(-num_slots // self.segment_tokens)

        def shape(index: int) -> tuple[int, ...]:
            rows = min(self.segment_tokens, num_slots - index * self.segment_tokens)
            return (self.num_layers, rows, *self.layer_shape)

        self.pinning_gate = PinningGate()  # loads defer the tier's background pinning (host_segments.py)
        self.segments = HostSegments(num_segments, shape, self.dtype, pinned=self.cuda, gate=self.pinning_gate)
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self._loads: LayerLoads | None = None  # load-backs the next forward scatters
        self._timed_loads: list[LayerLoads] = []  # done, their copy time not read yet
        self._staging: torch.Tensor | None = None  # disk blocks on their way (staging())
        self._staging_segments: HostSegments | None = None
        self._prefetch_segments: HostSegments | None = None  # prefetch_buffer()'s memory
        self._uploads_done: torch.cuda.Event | None = None  # after the last upload_tokens
        self.stats = {"d2h_tokens": 0, "h2d_tokens": 0, "d2h_seconds": 0.0, "h2d_seconds": 0.0}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # CUDA: timed when read

    def close(self) -> None:
        self.segments.close()
        for segments in (self._staging_segments, self._prefetch_segments):
            if segments is not None:
                segments.close()

    def _view(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(torch.uint8) if self.pool.is_fp8 else buf

    @staticmethod
    def token_bytes(pool: KVPool) -> int:
        k0 = pool.k_buffers[0]
        return 2 * len(pool.k_buffers) * k0.shape[0] * k0.shape[2] * k0.element_size()

    def timings(self) -> dict[str, float]:
        """Tokens copied and seconds spent each way (on CUDA from events, so reading them
        waits for nothing but the copies already done)."""
        self._collect_timings()
        return {**self.stats, "pin_wait_seconds": self.segments.wait_seconds}

    def _collect_timings(self) -> None:
        pending = []
        for kind, start, end in self._events:
            if end.query():
                self.stats[f"{kind}_seconds"] += start.elapsed_time(end) / 1000
            else:
                pending.append((kind, start, end))
        self._events = pending
        waiting = []
        for loads in self._timed_loads:
            seconds = loads.copy_seconds()
            if seconds is None:
                waiting.append(loads)
            else:
                self.stats["h2d_seconds"] += seconds
        self._timed_loads = waiting

    @property
    def allocated_bytes(self) -> int:
        return self.segments.allocated_bytes

    def take_loads(self) -> LayerLoads | None:
        """The load-backs queued since the last forward, for the next forward to scatter layer
        by layer (model_runner.LayerGate); handed out once."""
        loads, self._loads = self._loads, None
        return loads

    def _after_loads(self) -> None:
        """Scatters the load-backs no forward has taken yet, now, on the current stream: work
        about to touch slots or host rows must come after them (a request aborted before its
        prefill frees slots a load-back targets). On CPU there are none: loads run in place."""
        if self._loads is not None:
            self._loads.finish()
            self._loads = None

    def runs(self, host_slots):
        """(start in the move, segment, row, length) per run of consecutive host slots that
        stays inside one segment."""
        host_slots = np.asarray(host_slots, dtype=np.int64)
        breaks = np.flatnonzero((np.diff(host_slots) != 1)
                                | (host_slots[1:] % self.segment_tokens == 0)) + 1
        starts = np.concatenate(([0], breaks))
        ends = np.concatenate((breaks, [len(host_slots)]))
        for a, b in zip(starts.tolist(), ends.tolist()):
            seg, row = divmod(int(host_slots[a]), self.segment_tokens)
            yield a, seg, row, b - a

    def run(self, moves: list[KVMove]) -> None:
        """Runs the moves in order (consecutive moves of one kind as one batch)."""
        self._collect_timings()  # the events of copies done are let go as they come
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
            if kind == "d2h":
                self._timed(kind, len(dev), lambda: self._to_host(dev, host))
            elif self.cuda:
                self._after_loads()  # in order: a slot loaded twice gets the later copy
                self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # demotions' host rows
                self._loads = LayerLoads(self, dev, host, self.copy_stream)
                self._timed_loads.append(self._loads)
                self.stats["h2d_tokens"] += len(dev)
            else:
                self._timed(kind, len(dev), lambda: self._to_device(dev, host))
            i = j

    def _timed(self, kind: str, tokens: int, copy) -> None:
        if not self.cuda:
            start = time.perf_counter()
            copy()
            self.stats[f"{kind}_seconds"] += time.perf_counter() - start
        else:
            start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_event.record()
            copy()
            end_event.record()  # no synchronize: the copies overlap the step in flight
            self._events.append((kind, start_event, end_event))
        self.stats[f"{kind}_tokens"] += tokens

    def index(self, slots: list[int]) -> torch.Tensor:
        """Slot indices on the device. Through pinned memory: a copy from pageable memory
        waits for the whole stream, which would stall the step in flight."""
        idx = torch.tensor(slots, dtype=torch.int64)
        if not self.cuda:
            return idx
        return idx.pin_memory().to(self.device, non_blocking=True)

    def layer_buffers(self, layer: int):
        return self._view(self.pool.k_buffers[layer]), self._view(self.pool.v_buffers[layer])

    def gather_layer(self, layer: int, idx: torch.Tensor, out: torch.Tensor) -> None:
        """`out[i]` ([2, heads, dim]) = layer `layer`'s K and V of slot `idx[i]`."""
        for kv, buf in enumerate(self.layer_buffers(layer)):  # buf: [heads, slots, dim]
            out[:, kv].copy_(buf.index_select(1, idx).transpose(0, 1))

    def scatter_layer(self, layer: int, idx: torch.Tensor, rows: torch.Tensor) -> None:
        """Layer `layer`'s K and V of slot `idx[i]` = `rows[i]` ([2, heads, dim])."""
        for kv, buf in enumerate(self.layer_buffers(layer)):
            buf.index_copy_(1, idx, rows[:, kv].transpose(0, 1))

    def _chunks(self, device_slots: list[int], host_slots: list[int]):
        for c in range(0, len(device_slots), self.chunk_tokens):
            yield (self.index(device_slots[c:c + self.chunk_tokens]),
                   list(self.runs(host_slots[c:c + self.chunk_tokens])))

    def _to_host(self, device_slots: list[int], host_slots: list[int]) -> None:
        self._after_loads()
        for idx, runs in self._chunks(device_slots, host_slots):
            staged = torch.empty((len(idx), *self.layer_shape), dtype=self.dtype, device=self.device)
            for layer in range(self.num_layers):
                self.gather_layer(layer, idx, staged)
                for a, seg, row, n in runs:
                    self.segments.get(seg)[layer, row:row + n].copy_(staged[a:a + n], non_blocking=True)

    def _to_device(self, device_slots: list[int], host_slots: list[int]) -> None:
        """The CPU load-back: each chunk's rows staged, then scattered, layer by layer."""
        for idx, runs in self._chunks(device_slots, host_slots):
            staged = torch.empty((len(idx), *self.layer_shape), dtype=self.dtype)
            for layer in range(self.num_layers):
                for a, seg, row, n in runs:
                    staged[a:a + n].copy_(self.segments.get(seg)[layer, row:row + n])
                self.scatter_layer(layer, idx, staged)

    # ---- the disk tier: its blocks are token-major, [n, layers, 2, heads, dim] per token ---------

    def _gather(self, device_slots: list[int]) -> torch.Tensor:
        """The KV of `device_slots` on the device, token-major."""
        self._after_loads()
        idx = self.index(device_slots)
        out = torch.empty((len(device_slots), self.num_layers, *self.layer_shape), dtype=self.dtype,
                          device=self.device)
        for layer in range(self.num_layers):
            self.gather_layer(layer, idx, out[:, layer])
        return out

    def read_tokens(self, device_slots: list[int]) -> memoryview:
        """The KV of `device_slots` (token-major) in a fresh host buffer, waiting for the device."""
        return memoryview(self._gather(device_slots).cpu().view(torch.uint8).numpy().reshape(-1))

    def staging(self, nbytes: int) -> memoryview:
        """A host buffer (pinned on CUDA) for disk blocks on their way to the device, at least
        `nbytes` long; made on first use, and handed out again once its last upload is done."""
        self.wait_uploads()
        if self._staging is None or self._staging.numel() < nbytes:
            if self._staging_segments is not None:
                self._staging_segments.close()
            self._staging_segments = HostSegments(1, lambda _: (max(nbytes, STAGING_BYTES),), torch.uint8,
                                                  pinned=self.cuda)
            self._staging = self._staging_segments.get(0)
        return memoryview(self._staging.numpy())[:nbytes]

    def reserve_prefetch(self, nbytes: int) -> None:
        """Reserves the host memory that disk blocks are read into while their request waits
        (storage_prefetch.py): pinned on CUDA, from now on, in the background. One buffer,
        reused, because reading a block into fresh memory faults its pages in one by one, 30x
        slower than a read into touched memory (docs/hicache.md)."""
        self._prefetch_segments = HostSegments(1, lambda _: (nbytes,), torch.uint8, pinned=self.cuda)

    def prefetch_buffer(self) -> memoryview:
        """reserve_prefetch's memory (waits for its pinning on first use)."""
        return memoryview(self._prefetch_segments.get(0).numpy())

    def wait_uploads(self) -> None:
        """Returns once the host memory of every upload_tokens so far may be written again."""
        if self._uploads_done is not None:
            self._uploads_done.synchronize()
            self._uploads_done = None

    def upload_tokens(self, device_slots: list[int], offset: int, source: memoryview | None = None) -> None:
        """Writes token-major KV, from byte `offset` on, into `device_slots`: from the staging
        buffer, or from `source` (in the prefetch buffer). On CUDA the copy is asynchronous:
        wait_uploads() before that memory is written again."""
        n = len(device_slots)
        end = offset + n * self.bytes_per_token
        if source is None:
            data = self._staging[offset:end].to(self.device, non_blocking=True)
        else:
            data = self._upload_prefetched(torch.frombuffer(source[offset:end], dtype=torch.uint8))
        data = data.view(self.dtype).view(n, self.num_layers, *self.layer_shape)
        if self.cuda:
            self._uploads_done = torch.cuda.Event()
            self._uploads_done.record()
        self._after_loads()
        idx = self.index(device_slots)
        for layer in range(self.num_layers):
            self.scatter_layer(layer, idx, data[:, layer])


    def _upload_prefetched(self, host: torch.Tensor) -> torch.Tensor:
        """Bytes of the prefetch buffer on the device, copied in pieces that each stay inside
        one of the buffer's registrations with the driver (HostSegments.piece_bytes)."""
        if not self.cuda:
            return host  # scattered into the pool at once, on this thread
        segments = self._prefetch_segments
        piece = segments.piece_bytes(0)
        out = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
        start = host.data_ptr() - segments.get(0).data_ptr()
        done = 0
        while done < host.numel():
            size = min(host.numel() - done, piece - (start + done) % piece)
            out[done:done + size].copy_(host[done:done + size], non_blocking=True)
            done += size
        return out


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


def agree_on_host_tokens(tokens: int, tp) -> int:
    """Under tensor parallelism, the smallest of the ranks' host tiers, in tokens: rank 0's
    tree hands out host slots that every rank must have (a rank's bytes per token depend on
    its share of the KV heads). Every rank calls it once at start-up, after its runner."""
    if not tp.enabled:
        return tokens
    import torch.distributed as dist

    agreed = torch.tensor([tokens], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    return int(agreed.item())


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
