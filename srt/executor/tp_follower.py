"""A tensor-parallel rank other than 0: it loads its shard of the weights and runs every forward
rank 0 sends it (step_broadcast.py), until rank 0 says stop. It has no scheduler, tokenizer or
cache of its own: one policy, on rank 0, decides for all."""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from typing import Any

import numpy as np
import torch
import zmq

from .. import io_struct
from ..io_struct import ReadySignal
from ..process_utils import exit_when_parent_dies
from ..server_args import ServerArgs

logger = logging.getLogger(__name__)


def follower_name(rank: int) -> str:
    return f"tp-rank-{rank}"


def run_tp_follower_process(server_args: dict[str, Any], rank: int, local_rank: int, dist_addr: str,
                            ready_addr: str) -> None:
    """Process entry point (multiprocessing spawn)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher stops its children itself
    exit_when_parent_dies()
    ctx = zmq.Context()
    ready = ctx.socket(zmq.PUSH)
    ready.setsockopt(zmq.LINGER, 1000)
    ready.connect(ready_addr)
    try:
        runner, receiver = _start(ServerArgs(**server_args), rank, local_rank, dist_addr)
    except Exception as e:
        logger.error("rank %d failed to start:\n%s", rank, traceback.format_exc())
        ready.send(io_struct.encode(ReadySignal(follower_name(rank), False, error=f"{type(e).__name__}: {e}")))
        ready.close()
        sys.exit(1)
    # Nothing to save on the way out; SIGTERM may arrive while it already exits (rank 0 said stop).
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    ready.send(io_struct.encode(ReadySignal(follower_name(rank), True)))
    ready.close()
    ctx.term()
    try:
        follow(runner, receiver)
    except Exception:
        logger.error("rank %d stopped:\n%s", rank, traceback.format_exc())
        sys.exit(1)


def _start(args: ServerArgs, rank: int, local_rank: int, dist_addr: str):
    from ..scheduler.kv_memory import PageAllocator
    from . import parallel
    from .model_loader import load_model
    from .model_runner import ModelRunner, kv_slots_for
    from .step_broadcast import StepReceiver

    device = parallel.prepare_rank(args, local_rank)
    args = args.with_device_defaults()  # as rank 0's Scheduler does: the same table rows
    loaded = load_model(args.model_path, dtype=args.resolved_dtype(), load_format=args.load_format,
                        tokenizer_path=args.tokenizer_path, device=device, tensor_parallel=(rank, args.tp_size))
    tp = parallel.init_tensor_parallel(args, rank, local_rank, dist_addr)
    # The same table and pool sizes as rank 0's scheduler makes (scheduler.py).
    pages = PageAllocator(kv_slots_for(loaded.config, args), args.page_size).num_pages
    context_len = args.context_length or loaded.config.context_len
    table = np.zeros((args.max_running_requests, context_len + 1), dtype=np.int64)
    runner = ModelRunner(loaded, args, torch.from_numpy(table), pages * args.page_size)
    tp.barrier("ready")
    return runner, StepReceiver(tp, table, runner.device)


def follow(runner, receiver) -> None:
    from . import parallel
    from .step_broadcast import Kind

    while True:
        kind, batch = receiver.receive()
        if kind is Kind.STOP:
            logger.info("rank 0 stopped; exiting")
            parallel.shutdown()  # with rank 0, which tears its side down now
            return
        if kind is Kind.FORWARD:
            runner.forward(batch)
