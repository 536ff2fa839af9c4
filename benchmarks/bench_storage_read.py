"""The disk tier's read path against plain file reads: what checking each block costs.

Writes --blocks block files of --block-mib MiB through KVStorage (an 8B model's 64-token block is
8 MiB; 256 of them are a 16k-token prefix), then reads them back from the page cache into one
host buffer (pinned when CUDA is there, as the engine's staging buffer is), best of --repeats:

- baseline: plain reads of the same files' payloads on the same number of threads, unchecked;
- the same reads, each block then checked with zlib's CRC-32 (what format 2 did);
- KVStorage.read_in_order: the tier's reads, each block's CRC-32C checked (block_file.py);
- the checksums alone on one core over the buffer: CRC-32C (crc32c) and zlib's CRC-32 (the
  checksum of format 2), for scale.

One JSON line: GB/s of each, read_in_order / plain reads (1.0: checking is free) and
read_in_order / zlib-checked reads. On CUDA also a pinned host-to-device copy of the buffer,
the next step's ceiling.

    python -m benchmarks.bench_storage_read --out benchmarks/results/cpu_storage_read.jsonl
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import crc32c
import torch

from radixlm.radix import storage
from radixlm.radix.block_file import HEADER

from .harness import Reporter, command_line, ratio, run_frame


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=128)
    parser.add_argument("--block-mib", type=int, default=8)
    parser.add_argument("--threads", type=int, default=storage.READ_THREADS, help="readers (KVStorage's default)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the block files go (default: a temporary directory)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else "cpu"
    report = Reporter(args.out, command_line())

    block = args.block_mib << 20
    total = args.blocks * block
    buffer = torch.empty(total, dtype=torch.uint8)
    if cuda:
        buffer = buffer.pin_memory()
    out = memoryview(buffer.numpy())
    keys = [f"{i:064x}" for i in range(args.blocks)]
    storage.READ_THREADS, storage.READ_AHEAD = args.threads, 2 * args.threads
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        store = storage.KVStorage(directory, "bench-storage-read", 64, block)
        payload = os.urandom(block)
        for i, key in enumerate(keys):
            store.put(key, payload, owned=True)
            if i % 8 == 7:  # the write queue holds bytes, not files: keep it short
                store.flush()
        store.flush()
        if store.stats["writes_dropped"]:
            raise SystemExit(f"{store.stats['writes_dropped']} block writes were dropped (disk full?)")
        paths = [store._path(key) for key in keys]

        def plain_reads(check: Callable[[memoryview], int] | None = None) -> None:
            def read(i: int) -> None:
                view = out[i * block:(i + 1) * block]
                with open(paths[i], "rb") as f:
                    f.seek(HEADER.size)
                    f.readinto(view)
                if check is not None:
                    check(view)

            with ThreadPoolExecutor(args.threads) as pool:
                list(pool.map(read, range(args.blocks)))

        def tier_reads() -> None:
            if not all(store.read_in_order(keys, out)):
                raise SystemExit("a block failed its check")

        plain_s = best_seconds(plain_reads, args.repeats)
        zlib_checked_s = best_seconds(lambda: plain_reads(zlib.crc32), args.repeats)
        tier_s = best_seconds(tier_reads, args.repeats)
        store.close()
    one_block = out[:block]
    crc32c_s = best_seconds(lambda: crc32c.crc32c(one_block), args.repeats * 4)
    zlib_s = best_seconds(lambda: zlib.crc32(one_block), args.repeats * 4)
    line = {"bench": "storage_read", "system": "KVStorage.read_in_order (CRC-32C checked)",
            "baseline": "plain reads of the same payloads on as many threads, unchecked, measured in this run",
            "blocks": args.blocks, "block_bytes": block, "threads": args.threads, "pinned": cuda,
            "plain_read_gbps": round(total / plain_s / 1e9, 2), "tier_read_gbps": round(total / tier_s / 1e9, 2),
            "tier_over_plain": ratio(plain_s, tier_s),
            "zlib_checked_read_gbps": round(total / zlib_checked_s / 1e9, 2),
            "tier_over_zlib_checked": ratio(zlib_checked_s, tier_s),
            "crc32c_one_core_gbps": round(block / crc32c_s / 1e9, 2),
            "zlib_crc32_one_core_gbps": round(block / zlib_s / 1e9, 2)}
    if cuda:
        target = torch.empty(total, dtype=torch.uint8, device="cuda")

        def upload() -> None:
            target.copy_(buffer, non_blocking=True)
            torch.cuda.synchronize()

        line["h2d_gbps"] = round(total / best_seconds(upload, args.repeats) / 1e9, 2)
    report.emit({**line, **run_frame(device)})


if __name__ == "__main__":
    main()
