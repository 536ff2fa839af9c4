"""The scheduler process: tensor-parallel rank 0, with the scheduling policy and the device
engine, serving the tokenizer manager's requests until the server stops it."""

from __future__ import annotations

import signal
import sys
from typing import Any

import zmq

from ..process_utils import exit_now
from ..server_args import DEVICE_DEPENDENT_FIELDS, ServerArgs
from .child import ChildStart


def run_scheduler_process(server_args: dict[str, Any], recv_addr: str, send_addr: str, ready_addr: str,
                          dist_addr: str | None = None) -> None:
    """Process entry point (started with multiprocessing's spawn). With tp_size > 1 it is
    tensor-parallel rank 0, meeting the other ranks at `dist_addr` (host:port)."""
    start = ChildStart("scheduler", ready_addr, watch_addr=recv_addr)
    ctx = zmq.Context()
    try:
        from ..bootstrap import bootstrap_rank, build_scheduler, step_sender
        from ..scheduler.loop import SchedulerLoop

        args = ServerArgs(**server_args)
        scheduler = build_scheduler(bootstrap_rank(args, 0, 0, dist_addr), args)
        sender = step_sender(scheduler)
        if sender is not None:
            sender.start(scheduler.req_table.dirty_from)
        recv = ctx.socket(zmq.PULL)
        recv.setsockopt(zmq.LINGER, 0)
        recv.bind(recv_addr)
        send = ctx.socket(zmq.PUSH)
        send.setsockopt(zmq.LINGER, 0)
        send.connect(send_addr)
    except Exception as e:
        start.failed(e)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # The settings it filled in for its device, for the HTTP side's admission and reports.
    device_defaults = {name: getattr(scheduler.args.scheduler, name) for name in DEVICE_DEPENDENT_FIELDS}
    start.ready({"max_total_tokens": scheduler.allocator.capacity, "context_len": scheduler.context_len,
                 "device_defaults": device_defaults})
    stopped = 0
    try:
        SchedulerLoop(scheduler, recv, send, fatal_step_errors=sender is not None).run_forever()
    except SystemExit as stop:  # SIGTERM: the cleanup below, then out without the teardown
        stopped = stop.code or 0
    finally:
        scheduler.close()  # the disk tier's queued writes land
        if sender is not None:
            try:
                sender.stop()
            except Exception:  # the other ranks may be gone (why we are stopping)
                pass
        recv.close()
        send.close()
        ctx.term()
    exit_now(stopped)
