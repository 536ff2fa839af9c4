"""Tensor-parallel ranks over torch.distributed: NCCL on GPUs, gloo on CPU.

Every rank of a model is one process (the scheduler process is rank 0). They meet at a
rendezvous (a TCPStore on node 0's `--dist-init-addr`), whose timeout names the ranks that
did not come; then they form the process group. Besides the device group (the model's
all-reduces and all-gathers) there is a gloo group on the host for barriers that name a
missing rank, and for agreeing on host-side values.

`init_tensor_parallel` returns the rank's `TensorParallel`, which the caller hands to the model
runner and the model; one rank of one (`TensorParallel()`) is the default everywhere.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..server_args import split_addr

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # the device group (None: the default group)
    cpu_group: Any = None  # gloo, on the host
    timeout_s: float = 120.0
    # --tp-all-reduce one_shot: small all-reduces through PyTorch's symmetric memory (each rank
    # reads the others' buffers over NVLink; no multicast), staged in this registered buffer.
    one_shot_buffer: Any = None

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks in place (row-parallel outputs). Capturable in CUDA graphs."""
        if self.size == 1:
            return x
        fast = self.one_shot_buffer
        if fast is not None and x.numel() <= fast.numel() and x.dtype == fast.dtype and x.is_contiguous():
            return fast_all_reduce(x, fast, self.group)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` side by side along the last dim (the vocabulary blocks of logits)."""
        if self.size == 1:
            return x
        out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
        if x.is_cuda:
            dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
        else:
            dist.all_gather(list(out.unbind(0)), x.contiguous(), group=self.group)
        return torch.cat(out.unbind(0), dim=-1)

    def min_on_host(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. the KV slots each rank's memory holds)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def barrier(self, what: str) -> None:
        """Waits for every rank; after the timeout, fails naming the ranks that did not come."""
        if self.size == 1:
            return
        try:
            dist.monitored_barrier(group=self.cpu_group, timeout=datetime.timedelta(seconds=self.timeout_s),
                                   wait_all_ranks=True)
        except RuntimeError as e:
            raise RuntimeError(f"tensor parallel: not every rank reached '{what}' within "
                               f"{self.timeout_s:.0f}s (dist_timeout): {e}") from None


ONE_SHOT_MAX_BYTES = 1 << 20


def one_shot_all_reduce_buffer(device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """A registered symmetric-memory buffer for small all-reduces; None where it cannot be used."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(ONE_SHOT_MAX_BYTES // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    except Exception as e:  # noqa: BLE001 - an optional fast path
        logger.warning("one-shot all-reduce unavailable (%s: %s); using NCCL", type(e).__name__, e)
        return None
    return buf


def fast_all_reduce(x: torch.Tensor, buf: torch.Tensor, group: Any) -> torch.Tensor:
    flat = x.view(-1)
    staged = buf[:flat.numel()]
    staged.copy_(flat)
    torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", group.group_name, flat)
    return x


_DESTROY_TIMEOUT_S = 10.0


def shutdown() -> None:
    """Leaves the process group; every rank calls it when rank 0 stops them (an Engine shutting
    down; a new one may form another group). NCCL's teardown can wait on a peer that is gone, so
    it gets a bounded wait in a thread, and a warning instead of a hang."""
    if dist.is_initialized():
        done = threading.Event()

        def destroy() -> None:
            dist.destroy_process_group()
            done.set()

        threading.Thread(target=destroy, name="tp-destroy", daemon=True).start()
        if not done.wait(_DESTROY_TIMEOUT_S):
            logger.warning("tensor parallel: the process group did not tear down within %.0fs; left as it is",
                           _DESTROY_TIMEOUT_S)


def rank_device(args: Any, local_rank: int) -> str:
    """The device a rank runs on: its GPU on the node (cuda:local_rank), or the CPU."""
    device = args.model.resolved_device()
    if device == "cuda" and args.parallel.tp_size > 1:
        return f"cuda:{local_rank}"
    return device


def check_devices(args: Any) -> None:
    """Refuses more ranks on this node than it has GPUs, before anything starts."""
    if args.model.resolved_device() != "cuda":
        return
    per_node = args.parallel.tp_size // args.parallel.nnodes
    found = torch.cuda.device_count()
    if per_node > found:
        raise ValueError(f"tp_size: {args.parallel.tp_size} ranks over {args.parallel.nnodes} node(s) need {per_node} "
                         f"GPUs on this node; {found} found")


def prepare_rank(args: Any, local_rank: int) -> str:
    """Before a rank loads its weights: its GPU becomes the current device, and on CPU the
    node's cores are divided among its ranks (each would otherwise spin on all of them)."""
    device = rank_device(args, local_rank)
    if args.parallel.tp_size == 1:
        return device
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (args.parallel.tp_size // args.parallel.nnodes)))
    return device


def init_tensor_parallel(args: Any, rank: int, local_rank: int, init_addr: str) -> TensorParallel:
    """Joins the rendezvous at `init_addr` (host:port) as `rank` of `args.parallel.tp_size` and sets up
    this process's groups (after `prepare_rank`). Raises, naming the ranks that did not join,
    after `dist_timeout`."""
    size, timeout = args.parallel.tp_size, float(args.parallel.dist_timeout)
    host, port = split_addr(init_addr)
    device = rank_device(args, local_rank)
    store = _rendezvous(host, port, rank, size, timeout)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    kwargs = {"device_id": torch.device(device)} if backend == "nccl" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout), **kwargs)
    cpu_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout)) \
        if backend == "nccl" else dist.group.WORLD
    one_shot = None
    if backend == "nccl" and args.parallel.tp_all_reduce == "one_shot":
        one_shot = one_shot_all_reduce_buffer(torch.device(device), args.model.resolved_dtype())
    logger.info("tensor parallel rank %d of %d on %s (%s)", rank, size, device, backend)
    return TensorParallel(rank, size, dist.group.WORLD, cpu_group, timeout, one_shot)


def _rendezvous(host: str, port: int, rank: int, size: int, timeout: float) -> dist.TCPStore:
    """Rank 0 hosts the store; every rank signs in; rank 0 waits for all and names the absent."""
    started = time.monotonic()
    try:
        store = dist.TCPStore(host, port, world_size=size, is_master=rank == 0, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout), use_libuv=True)
    except (RuntimeError, OSError) as e:
        where = "host the rendezvous at" if rank == 0 else "reach the rendezvous at"
        raise RuntimeError(f"tensor parallel rank {rank}: could not {where} dist_init_addr {host}:{port} "
                           f"within {timeout:.0f}s ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    store.set(f"radixlm/joined/{rank}", str(os.getpid()))
    if rank == 0:
        while True:
            absent = [r for r in range(1, size) if not store.check([f"radixlm/joined/{r}"])]
            if not absent:
                break
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"tensor parallel: rank(s) {absent} of {size} did not join the rendezvous at "
                                   f"{host}:{port} within {timeout:.0f}s (dist_timeout); start every node with "
                                   "the same --tp-size, --nnodes and --dist-init-addr")
            time.sleep(0.05)
    return store
