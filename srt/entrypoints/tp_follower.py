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

from ..server_args import ServerArgs
from .child import ChildStart

logger = logging.getLogger(__name__)


def follower_name(rank: int) -> str:
    return f"tp-rank-{rank}"


def run_tp_follower_process(server_args: dict[str, Any], rank: int, local_rank: int, dist_addr: str,
                            ready_addr: str) -> None:
    """Process entry point (multiprocessing spawn)."""
    start = ChildStart(follower_name(rank), ready_addr)
    try:
        from ..bootstrap import bootstrap_rank, build_follower

        args = ServerArgs(**server_args)
        follower = build_follower(bootstrap_rank(args, rank, local_rank, dist_addr), args)
    except Exception as e:
        start.failed(e)
    # Nothing to save on the way out; SIGTERM may arrive while it already exits (rank 0 said stop).
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    start.ready()
    try:
        follower.follow()
        logger.info("rank 0 stopped; exiting")
    except Exception:
        logger.error("rank %d stopped:\n%s", rank, traceback.format_exc())
        sys.exit(1)
