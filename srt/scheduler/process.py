"""The scheduler process: receives requests over ZeroMQ, runs scheduler steps, and pushes each
request's new tokens to the detokenizer (every step when streaming, else once at the end)."""

from __future__ import annotations

import logging
import signal
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import zmq

from .. import io_struct
from ..io_struct import (AbortReq, BatchTokenOut, ControlReply, ControlReq, ReadySignal, ReqOutput,
                         TokenizedGenerateReq)
from ..process_utils import exit_when_parent_dies
from ..sampling_params import SamplingParams
from ..server_args import DEVICE_DEPENDENT_FIELDS, ServerArgs
from .request import FinishReason, Req
from .scheduler import Scheduler

logger = logging.getLogger(__name__)

# How long an idle scheduler blocks waiting for a request before looping (ms).
_IDLE_POLL_MS = 1000


@dataclass
class _Sent:
    """How much of a request's output has been sent already."""

    ids: int = 0
    output_logprobs: int = 0
    input_logprobs: int = 0


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler, recv: zmq.Socket, send: zmq.Socket, fatal_step_errors: bool = False):
        """fatal_step_errors: a failed step ends the process after failing its requests (tensor
        parallelism: the ranks may no longer agree on where they are; the server then exits
        non-zero instead of hanging in the next collective)."""
        self.scheduler = scheduler
        self.recv = recv
        self.send = send
        self.fatal_step_errors = fatal_step_errors
        self.sent: dict[str, _Sent] = {}
        self.reqs: dict[str, Req] = {}

    def run_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.recv, zmq.POLLIN)
        while True:
            timeout = 0 if self.scheduler.has_work else _IDLE_POLL_MS
            if poller.poll(timeout):
                self._drain_requests()
            if self.scheduler.has_work:
                self.run_step()

    def run_step(self) -> None:
        try:
            stepped = self.scheduler.step()
        except Exception as e:  # keep serving: fail what was in flight, not the process
            logger.error("scheduler step failed:\n%s", traceback.format_exc())
            if self.fatal_step_errors:
                self._send_outputs(self.scheduler.abort_all(
                    f"internal error: tensor-parallel step failed (a rank died or stopped answering): {e}"))
                raise SystemExit(1) from None
            stepped = self.scheduler.abort_all(f"internal error: {e}")
        self._send_outputs(stepped)

    # ---- incoming ------------------------------------------------------------------------------

    def _drain_requests(self) -> None:
        while True:
            try:
                payload = self.recv.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle(io_struct.decode(payload))
            except Exception:
                logger.exception("dropped a bad message")

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, TokenizedGenerateReq):
            self._add(msg)
        elif isinstance(msg, AbortReq):
            rids = list(self.reqs) if msg.abort_all else [msg.rid]
            aborted = [r for r in (self.scheduler.abort(rid) for rid in rids) if r is not None]
            self._send_outputs(aborted)
        elif isinstance(msg, ControlReq):
            self._send(self._control(msg))
        else:
            logger.warning("unexpected message %s", type(msg).__name__)

    def _add(self, msg: TokenizedGenerateReq) -> None:
        try:
            req = Req.from_tokenized(msg, self.scheduler.config.vocab_size)
        except ValueError as e:  # the main process validates; this guards a bad peer
            req = Req(rid=msg.rid, origin_input_ids=msg.input_ids, sampling_params=SamplingParams())
            req.finish_reason = FinishReason("abort", message=str(e))
            self._send_outputs([req])
            return
        self.reqs[req.rid] = req
        self.sent[req.rid] = _Sent()
        self.scheduler.add_request(req)

    def _control(self, msg: ControlReq) -> ControlReply:
        if msg.kind == "flush_cache":
            ok = self.scheduler.flush_cache()
            return ControlReply(msg.request_id, ok, {} if ok else {"message": "requests are running"})
        if msg.kind == "server_info":
            return ControlReply(msg.request_id, True, self.scheduler.server_info())
        return ControlReply(msg.request_id, False, {"message": f"unknown control kind {msg.kind!r}"})

    # ---- outgoing ------------------------------------------------------------------------------

    def _send_outputs(self, reqs: list[Req]) -> None:
        outputs = [out for out in (self._output(r) for r in reqs) if out is not None]
        if outputs:
            self._send(BatchTokenOut(outputs))

    def _output(self, req: Req) -> ReqOutput | None:
        if not (req.stream or req.finished):
            return None
        sent = self.sent.get(req.rid, _Sent())
        new_ids = req.output_ids[sent.ids:]
        if not new_ids and not req.finished and len(req.input_token_logprobs) == sent.input_logprobs:
            return None
        sp = req.sampling_params
        want_lp = req.logprob.return_logprob
        out = ReqOutput(
            rid=req.rid, new_token_ids=new_ids,
            finish_reason=req.finish_reason.to_dict() if req.finish_reason else None,
            prompt_tokens=len(req.origin_input_ids), completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens, spec_verify_ct=req.spec_verify_ct, spec_accepted=req.spec_accepted,
            skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens, stop=list(sp.stop),
            stop_regex=list(sp.stop_regex), no_stop_trim=sp.no_stop_trim,
            input_token_logprobs=_pairs(req.input_token_logprobs[sent.input_logprobs:]) if want_lp else None,
            input_top_logprobs=_tops(req.input_top_logprobs[sent.input_logprobs:]) if want_lp else None,
            output_token_logprobs=_pairs(req.output_token_logprobs[sent.output_logprobs:]) if want_lp else None,
            output_top_logprobs=_tops(req.output_top_logprobs[sent.output_logprobs:]) if want_lp else None,
        )
        if req.finished:
            self.sent.pop(req.rid, None)
            self.reqs.pop(req.rid, None)
        else:
            sent.ids = len(req.output_ids)
            sent.output_logprobs = len(req.output_token_logprobs)
            sent.input_logprobs = len(req.input_token_logprobs)
        return out

    def _send(self, msg: Any) -> None:
        self.send.send(io_struct.encode(msg))


def _pairs(items: list[tuple[Any, int]]) -> list[list[Any]]:
    return [[lp, tok] for lp, tok in items]


def _tops(items: list[Any]) -> list[Any]:
    return [None if top is None else _pairs(top) for top in items]


def run_scheduler_process(server_args: dict[str, Any], recv_addr: str, send_addr: str, ready_addr: str,
                          dist_addr: str | None = None) -> None:
    """Process entry point (started with multiprocessing's spawn). With tp_size > 1 it is
    tensor-parallel rank 0, meeting the other ranks at `dist_addr` (host:port)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s")
    # Ctrl-C in a terminal reaches the whole process group; the server stops its children itself
    # (SIGTERM) once it has failed what was in flight, so a child ignores SIGINT rather than dying
    # mid-step with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_when_parent_dies(ipc_addr=recv_addr)
    ctx = zmq.Context()
    ready = ctx.socket(zmq.PUSH)
    ready.setsockopt(zmq.LINGER, 1000)
    ready.connect(ready_addr)
    try:
        from ..executor.model_loader import load_model

        from ..executor import parallel

        args = ServerArgs(**server_args)
        device = parallel.prepare_rank(args, 0)
        loaded = load_model(args.model_path, dtype=args.resolved_dtype(), load_format=args.load_format,
                            tokenizer_path=args.tokenizer_path, device=device, tensor_parallel=(0, args.tp_size))
        tp = parallel.init_tensor_parallel(args, 0, 0, dist_addr) if args.tp_size > 1 else parallel.current()
        scheduler = Scheduler(loaded, args)
        tp.barrier("ready")  # every rank has its shard and KV pool
        sender = scheduler.engine.runner.step_sender if tp.enabled else None
        if sender is not None:
            sender.start(scheduler.req_table.dirty_from)
        recv = ctx.socket(zmq.PULL)
        recv.setsockopt(zmq.LINGER, 0)
        recv.bind(recv_addr)
        send = ctx.socket(zmq.PUSH)
        send.setsockopt(zmq.LINGER, 0)
        send.connect(send_addr)
    except Exception as e:
        logger.error("scheduler failed to start:\n%s", traceback.format_exc())
        ready.send(io_struct.encode(ReadySignal("scheduler", False, error=f"{type(e).__name__}: {e}")))
        ready.close()
        sys.exit(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ready.send(io_struct.encode(ReadySignal("scheduler", True, info={
        "max_total_tokens": scheduler.allocator.capacity, "context_len": scheduler.context_len,
        # the settings the scheduler filled in for its device, for the HTTP side's admission and reports
        "device_defaults": {name: getattr(scheduler.args, name) for name in DEVICE_DEPENDENT_FIELDS}})))
    ready.close()
    try:
        SchedulerLoop(scheduler, recv, send, fatal_step_errors=sender is not None).run_forever()
    finally:
        if sender is not None:
            try:
                sender.stop()
            except Exception:  # the other ranks may be gone (why we are stopping)
                pass
        recv.close()
        send.close()
        ctx.term()
