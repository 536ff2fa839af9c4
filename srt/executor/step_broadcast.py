"""Rank 0 tells the other tensor-parallel ranks what to compute, one message per forward.

Only rank 0 runs the scheduling policy; the others are followers that run the same forward on
their shard of the weights. Before each forward rank 0 broadcasts the batch (token ids,
positions, KV slots, rows, lengths, logit rows) and the entries of the request-to-token table
its rows read that the followers' copies lack: the policy's table marks, per row, the first
position written since the row was last sent (kv_memory.py), so a follower's rows are exactly
rank 0's for every forward whatever the policy did in between (radix-cache hits, retractions,
speculation's truncations), at the cost of the new entries only. Attention
plans and CUDA-graph choices are computed from the batch and the table, so every rank makes
the same ones.

The message travels on the host (the gloo group): a follower reads it while its GPU still
runs the previous step, plans the attention and launches the forward, as rank 0 does; over the
device group it would wait behind that step. Only the token ids go over the device group
(NCCL on GPUs), enqueued before the forward: under overlap scheduling they may not have
reached rank 0's host yet. While idle, rank 0 sends a heartbeat, so a follower waits at most
`dist_timeout` for a rank 0 that died: a thread sends one whenever no message went out for a
second (a server waiting for requests, or an Engine between calls).
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ...radix.tiered import KVMove
from .forward_batch import ForwardBatch, ForwardMode
from .parallel import TensorParallel

_HEADER = 7  # kind, mode, tokens, requests, logit rows, table entries, LoRA section length
HEARTBEAT_S = 1.0


class Kind(enum.IntEnum):
    FORWARD = 0
    HEARTBEAT = 1
    STOP = 2
    MOVES = 3  # the hierarchical cache's copies, run by each rank on its own shard (host_kv.py)


MOVE_KINDS = ("d2h", "h2d")


class StepSender:
    """Rank 0's side: `with sender.sending(batch): <run the forward>`."""

    def __init__(self, tp: TensorParallel, table: np.ndarray, device: torch.device):
        self.tp = tp
        self.table = table
        self.dirty_from: np.ndarray | None = None  # ReqToTokenTable.dirty_from, given to start()
        self.device = device
        # One message at a time on the group, whichever thread sends it.
        self._lock = threading.Lock()
        self._last_sent = time.monotonic()
        self._stopped = False

    def start(self, dirty_from: np.ndarray) -> None:
        """Starts sending. `dirty_from`: the policy's per-row marks of written table entries.
        From now on the group carries only this sender's messages (call it after the last
        start-up collective: a heartbeat amid a barrier on the same group would deadlock)."""
        self.dirty_from = dirty_from
        threading.Thread(target=self._heartbeats, name="tp-heartbeat", daemon=True).start()

    @contextlib.contextmanager
    def sending(self, batch: ForwardBatch):
        """Sends `batch`, then holds the group while the caller launches the forward: its
        collectives must not interleave with a heartbeat from the other thread."""
        with self._lock:
            if self._stopped:
                raise RuntimeError("tensor parallel: the other ranks were told to stop")
            self._send_locked(self._message(batch))
            dist.broadcast(batch.input_ids, src=0, group=self.tp.group)
            yield

    def _message(self, batch: ForwardBatch) -> np.ndarray:
        deltas = self._table_deltas(batch.req_pool_indices_cpu, batch.seq_lens_cpu)
        mode = 0 if batch.mode is ForwardMode.EXTEND else 1
        positions, out_cache_loc, logit_rows = (np.asarray(list(c), np.int64) for c in batch.host_columns)
        lora = encode_adapters(batch)
        return np.concatenate([
            np.array([Kind.FORWARD, mode, len(positions), batch.batch_size, len(logit_rows), deltas.shape[0] // 3,
                      len(lora)], dtype=np.int64),
            positions, out_cache_loc, np.asarray(batch.req_pool_indices_cpu, np.int64),
            np.asarray(batch.seq_lens_cpu, np.int64), np.asarray(batch.prefix_lens_cpu, np.int64),
            np.asarray(batch.extend_lens_cpu, np.int64), logit_rows, deltas, lora])

    def send_moves(self, moves: list[KVMove]) -> None:
        """Sends the host tier's copies before rank 0 runs them: every rank moves its own shard
        of the same slots, in the same place among the forwards."""
        with self._lock:
            if self._stopped:
                raise RuntimeError("tensor parallel: the other ranks were told to stop")
            total = sum(len(m.device_slots) for m in moves)
            self._send_locked(np.concatenate([
                np.array([Kind.MOVES, len(moves), total, 0, 0, 0, 0], dtype=np.int64),
                np.array([MOVE_KINDS.index(m.kind) for m in moves], dtype=np.int64),
                np.array([len(m.device_slots) for m in moves], dtype=np.int64),
                np.asarray([s for m in moves for s in m.device_slots], dtype=np.int64),
                np.asarray([s for m in moves for s in m.host_slots], dtype=np.int64)]))

    def stop(self) -> None:
        """Tells the followers to exit (once)."""
        with self._lock:
            if not self._stopped:
                self._send_locked(self._signal(Kind.STOP))
                self._stopped = True

    def _heartbeats(self) -> None:
        while not self._stopped:
            time.sleep(HEARTBEAT_S / 4)
            if time.monotonic() - self._last_sent < HEARTBEAT_S:
                continue
            with self._lock:
                if not self._stopped and time.monotonic() - self._last_sent >= HEARTBEAT_S:
                    self._send_locked(self._signal(Kind.HEARTBEAT))

    @staticmethod
    def _signal(kind: Kind) -> np.ndarray:
        return np.array([kind, 0, 0, 0, 0, 0, 0], dtype=np.int64)

    def _send_locked(self, message: np.ndarray) -> None:
        dist.broadcast(torch.tensor([message.shape[0]], dtype=torch.int64), src=0, group=self.tp.cpu_group)
        dist.broadcast(torch.from_numpy(message), src=0, group=self.tp.cpu_group)
        self._last_sent = time.monotonic()

    def _table_deltas(self, rows: list[int], seq_lens: list[int]) -> np.ndarray:
        """(row, position, slot) triples, flat: each row's entries from its first written
        position up to its length. Afterwards the rows count as sent up to their lengths (what
        lies beyond may have been written and is sent when a batch reads it)."""
        if not rows:
            return np.zeros(0, np.int64)
        idx, ends = np.asarray(rows, np.int64), np.asarray(seq_lens, np.int64)
        starts = np.minimum(self.dirty_from[idx], ends)
        self.dirty_from[idx] = ends
        counts = ends - starts
        total = int(counts.sum())
        if total == 0:
            return np.zeros(0, np.int64)
        which = np.repeat(idx, counts)
        pos = np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(total)
        return np.stack([which, pos, self.table[which, pos]], axis=1).ravel()


def encode_adapters(batch: ForwardBatch) -> np.ndarray:
    """A batch's LoRA columns as int64s: [number of token slots, slots..., loads, (slot, handle,
    path length, path bytes...) per load, drops, handles...]; empty without LoRA."""
    if batch.adapter_slots is None and not batch.adapter_loads and not batch.adapter_drops:
        return np.zeros(0, np.int64)
    slots = batch.adapter_slots or []
    parts = [[len(slots)], slots, [len(batch.adapter_loads)]]
    for slot, handle, path in batch.adapter_loads:
        raw = list(path.encode())
        parts += [[slot, handle, len(raw)], raw]
    parts += [[len(batch.adapter_drops)], list(batch.adapter_drops)]
    return np.asarray([v for part in parts for v in part], np.int64)


def decode_adapters(section: np.ndarray, batch: ForwardBatch) -> None:
    """Sets the batch's LoRA columns from encode_adapters' section."""
    if not len(section):
        return
    values = section.tolist()
    count = values[0]
    batch.adapter_slots = values[1:1 + count] if count else None
    at = 1 + count
    loads = []
    for _ in range(values[at]):
        slot, handle, length = values[at + 1:at + 4]
        loads.append((slot, handle, bytes(values[at + 4:at + 4 + length]).decode()))
        at += 3 + length
    batch.adapter_loads = tuple(loads)
    batch.adapter_drops = tuple(values[at + 1:at + 1 + values[at]])


class StepReceiver:
    """A follower's side: `receive()` blocks until rank 0's next message."""

    def __init__(self, tp: TensorParallel, table: np.ndarray, device: torch.device):
        self.tp = tp
        self.table = table
        self.device = device

    def receive(self) -> tuple[Kind, ForwardBatch | list[KVMove] | None]:
        length = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(length, src=0, group=self.tp.cpu_group)
        host = torch.empty(int(length.item()), dtype=torch.int64)
        dist.broadcast(host, src=0, group=self.tp.cpu_group)
        host = host.numpy()
        kind = Kind(int(host[0]))
        if kind is Kind.MOVES:
            return kind, self._moves(host)
        if kind is not Kind.FORWARD:
            return kind, None
        mode, tokens, reqs, logits, entries, lora = (int(v) for v in host[1:_HEADER])
        sizes = [tokens, tokens, reqs, reqs, reqs, reqs, logits, 3 * entries, lora]
        cols = np.split(host[_HEADER:_HEADER + sum(sizes)], np.cumsum(sizes)[:-1])
        positions, out_loc, rows, seq_lens, prefix_lens, extend_lens, logit_rows, deltas, lora_section = cols
        if entries:
            triples = deltas.reshape(-1, 3)
            self.table[triples[:, 0], triples[:, 1]] = triples[:, 2]
        input_ids = torch.empty(tokens, dtype=torch.int64, device=self.device)
        dist.broadcast(input_ids, src=0, group=self.tp.group)
        on_device = torch.from_numpy(np.concatenate([positions, out_loc, rows, seq_lens, logit_rows])).to(
            self.device, non_blocking=True).split([tokens, tokens, reqs, reqs, logits])
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND if mode == 0 else ForwardMode.DECODE, input_ids=input_ids,
            positions=on_device[0], out_cache_loc=on_device[1], req_pool_indices=on_device[2],
            req_pool_indices_cpu=rows.tolist(), seq_lens=on_device[3], seq_lens_cpu=seq_lens.tolist(),
            prefix_lens_cpu=prefix_lens.tolist(), extend_lens_cpu=extend_lens.tolist(), logit_rows=on_device[4])
        decode_adapters(lora_section, batch)
        return kind, batch

    @staticmethod
    def _moves(host: np.ndarray) -> list[KVMove]:
        count, total = int(host[1]), int(host[2])
        kinds, lens = host[_HEADER:_HEADER + count], host[_HEADER + count:_HEADER + 2 * count]
        device = host[_HEADER + 2 * count:_HEADER + 2 * count + total].tolist()
        host_slots = host[_HEADER + 2 * count + total:].tolist()
        moves, start = [], 0
        for k, n in zip(kinds.tolist(), lens.tolist()):
            moves.append(KVMove(MOVE_KINDS[k], device[start:start + n], host_slots[start:start + n]))
            start += n
        return moves


class Follower:
    """A follower rank's whole job: every forward rank 0 sends, on this rank's shard, until
    rank 0 says stop (then it leaves the process group with rank 0)."""

    def __init__(self, runner: Any, receiver: StepReceiver, host_kv: Any = None):
        """host_kv: this rank's host tier (host_kv.HostKVPool), with the hierarchical cache."""
        self.runner = runner
        self.receiver = receiver
        self.host_kv = host_kv

    def follow(self) -> None:
        from . import parallel

        while True:
            kind, message = self.receiver.receive()
            if kind is Kind.STOP:
                if self.host_kv is not None:
                    self.host_kv.close()
                parallel.shutdown()  # with rank 0, which tears its side down now
                return
            if kind is Kind.MOVES:
                self.host_kv.run(message)
            elif kind is Kind.FORWARD:
                loads = self.host_kv.take_loads() if self.host_kv is not None else None
                self.runner.forward(message, loads)
