"""The detokenizer process: token-id deltas from the scheduler in, text deltas to the tokenizer
manager out. Other messages (control replies) pass through unchanged.

Sockets: PULL bound on recv_addr (the scheduler's PUSH connects), PUSH connected to send_addr
(the tokenizer manager's PULL is bound there). One `IncrementalDetokenizer` per running request,
dropped when its finish arrives, so state never outlives a request.
"""

from __future__ import annotations

import logging
import signal
import sys
from types import FrameType
from typing import Any

import zmq

from .. import io_struct
from ..io_struct import BatchTextOut, BatchTokenOut, ReadySignal, ReqOutput, ReqTextOutput
from ..process_utils import exit_when_parent_dies
from .incremental import IncrementalDetokenizer

logger = logging.getLogger(__name__)

# How long a failed start may wait to deliver its ReadySignal before the process exits (ms):
# with LINGER 0 the error report could be dropped and the parent would only see a timeout.
_READY_LINGER_MS = 2000


class DetokenizerManager:
    """Turns scheduler messages into tokenizer-manager messages; holds per-request state."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, IncrementalDetokenizer] = {}

    def handle(self, msg: Any) -> Any:
        if not isinstance(msg, BatchTokenOut):
            return msg
        return BatchTextOut(outputs=[ReqTextOutput(out.rid, self._text_delta(out), out) for out in msg.outputs])

    def _text_delta(self, out: ReqOutput) -> str:
        try:
            state = self.states.get(out.rid)
            if state is None:
                state = IncrementalDetokenizer(
                    self.tokenizer,
                    skip_special_tokens=out.skip_special_tokens,
                    spaces_between_special_tokens=out.spaces_between_special_tokens,
                    stop=out.stop,
                    stop_regex=out.stop_regex,
                    no_stop_trim=out.no_stop_trim,
                )
                self.states[out.rid] = state
            text = state.feed(out.new_token_ids)
            if out.finish_reason is not None:
                del self.states[out.rid]
                text += state.finish(out.finish_reason)
            return text
        except Exception:
            # One bad request fails alone: its ids still reach the tokenizer manager, text lost.
            logger.exception("detokenizing request %s failed", out.rid)
            self.states.pop(out.rid, None)
            return ""


def run_detokenizer_process(tokenizer_dir: str, recv_addr: str, send_addr: str, ready_addr: str) -> None:
    """Process entry point (spawned): loads the tokenizer, reports ready, then serves forever.

    Exits 0 on SIGTERM/SIGINT, 1 if startup fails (after sending ReadySignal(ok=False)).
    """
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s detokenizer %(levelname)s %(message)s")
    context = zmq.Context()
    sockets: list[zmq.Socket] = []
    exit_when_parent_dies(ipc_addr=recv_addr)

    def shutdown(signum: int, frame: FrameType | None) -> None:
        # Raise out of the blocking recv; the finally below closes the sockets.
        logger.info("detokenizer got signal %d, exiting", signum)
        sys.exit(0)

    signal.signal(signal.SIGTERM, shutdown)
    # Ctrl-C reaches the whole process group; the server stops us with SIGTERM when it is ready.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def open_socket(kind: int, linger_ms: int = 0) -> zmq.Socket:
        sock = context.socket(kind)
        sock.setsockopt(zmq.LINGER, linger_ms)
        sockets.append(sock)
        return sock

    try:
        ready = open_socket(zmq.PUSH, _READY_LINGER_MS)
        ready.connect(ready_addr)
        try:
            from .text_decoder import load_decoder

            manager = DetokenizerManager(load_decoder(tokenizer_dir))
            recv_sock = open_socket(zmq.PULL)
            recv_sock.bind(recv_addr)
            send_sock = open_socket(zmq.PUSH)
            send_sock.connect(send_addr)
        except Exception as exc:
            logger.exception("detokenizer failed to start")
            ready.send(io_struct.encode(ReadySignal(process="detokenizer", ok=False, error=repr(exc))))
            sys.exit(1)
        ready.send(io_struct.encode(ReadySignal(process="detokenizer", ok=True)))
        logger.info("detokenizer ready: pull %s, push %s", recv_addr, send_addr)
        _serve(manager, recv_sock, send_sock)
    finally:
        for sock in sockets:
            sock.close()
        context.term()


def _serve(manager: DetokenizerManager, recv_sock: zmq.Socket, send_sock: zmq.Socket) -> None:
    while True:
        payload = recv_sock.recv()
        try:
            reply = io_struct.encode(manager.handle(io_struct.decode(payload)))
        except Exception:
            logger.exception("skipping a bad message (%d bytes)", len(payload))
            continue
        send_sock.send(reply)
