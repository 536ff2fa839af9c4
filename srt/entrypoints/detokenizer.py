"""The detokenizer process: token-id deltas from the scheduler in, text deltas to the tokenizer
manager out (srt/detokenizer/manager.py). Sockets: PULL bound on recv_addr (the scheduler's
PUSH connects), PUSH connected to send_addr (the tokenizer manager's PULL is bound there)."""

from __future__ import annotations

import logging
import signal
import sys
from types import FrameType

import zmq

from .. import io_struct
from .child import ChildStart

logger = logging.getLogger(__name__)


def run_detokenizer_process(tokenizer_dir: str, recv_addr: str, send_addr: str, ready_addr: str) -> None:
    """Process entry point (spawned): loads the tokenizer, reports ready, then serves until
    SIGTERM (exit 0); exits 1 if its start fails, after reporting why."""
    start = ChildStart("detokenizer", ready_addr, watch_addr=recv_addr)

    def shutdown(signum: int, frame: FrameType | None) -> None:
        # Raise out of the blocking recv; the finally below closes the sockets.
        logger.info("detokenizer got signal %d, exiting", signum)
        sys.exit(0)

    signal.signal(signal.SIGTERM, shutdown)
    context = zmq.Context()
    sockets: list[zmq.Socket] = []

    def open_socket(kind: int) -> zmq.Socket:
        sock = context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sockets.append(sock)
        return sock

    try:
        try:
            from ..detokenizer.manager import DetokenizerManager
            from ..detokenizer.text_decoder import load_decoder

            manager = DetokenizerManager(load_decoder(tokenizer_dir))
            recv_sock = open_socket(zmq.PULL)
            recv_sock.bind(recv_addr)
            send_sock = open_socket(zmq.PUSH)
            send_sock.connect(send_addr)
        except Exception as exc:
            start.failed(exc)
        start.ready()
        logger.info("detokenizer ready: pull %s, push %s", recv_addr, send_addr)
        _serve(manager, recv_sock, send_sock)
    finally:
        for sock in sockets:
            sock.close()
        context.term()


def _serve(manager, recv_sock: zmq.Socket, send_sock: zmq.Socket) -> None:
    while True:
        payload = recv_sock.recv()
        try:
            reply = io_struct.encode(manager.handle(io_struct.decode(payload)))
        except Exception:
            logger.exception("skipping a bad message (%d bytes)", len(payload))
            continue
        send_sock.send(reply)
