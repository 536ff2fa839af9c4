"""A tensor-parallel rank other than 0: it loads its shard of the weights and runs every forward
rank 0 sends it (executor/step_broadcast.py), until rank 0 says stop. It has no scheduler,
tokenizer or cache of its own: one policy, on rank 0, decides for all."""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from typing import Any

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
        from ..bootstrap import bootstrap_rank, build_follower

        args = ServerArgs(**server_args)
        follower = build_follower(bootstrap_rank(args, rank, local_rank, dist_addr), args)
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
        follower.follow()
        logger.info("rank 0 stopped; exiting")
    except Exception:
        logger.error("rank %d stopped:\n%s", rank, traceback.format_exc())
        sys.exit(1)
