"""The scheduler process's loop: receives requests over ZeroMQ, runs scheduler steps, and pushes
each request's new tokens to the detokenizer (every step when streaming, else once at the end).
The process itself is started by srt/entrypoints/scheduler.py."""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass
from typing import Any

import zmq

from .. import io_struct
from ..core.request import FinishReason, Req
from ..io_struct import AbortReq, BatchTokenOut, ControlReply, ControlReq, ReqOutput, TokenizedGenerateReq
from ..sampling_params import SamplingParams
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
            else:  # steps expire sessions; so does an idle loop, once a poll
                self.scheduler.sessions.expire()

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
            self.scheduler.bind_adapter(req, msg.lora_path)
        except ValueError as e:  # the main process validates; this guards a bad peer
            req = Req(rid=msg.rid, origin_input_ids=msg.input_ids, sampling_params=SamplingParams())
            req.finish_reason = FinishReason("abort", message=str(e))
            self._send_outputs([req])
            return
        self.reqs[req.rid] = req
        self.sent[req.rid] = _Sent()
        self.scheduler.add_request(req)

    def _control(self, msg: ControlReq) -> ControlReply:
        if msg.kind in ("flush_cache", "flush_cache_storage"):
            ok = self.scheduler.flush_cache(include_storage=msg.kind == "flush_cache_storage")
            return ControlReply(msg.request_id, ok, {} if ok else {"message": "requests are running"})
        if msg.kind == "end_session":
            return ControlReply(msg.request_id, True, {"ended": self.scheduler.sessions.end(msg.args.get("session_id"))})
        if msg.kind == "server_info":
            return ControlReply(msg.request_id, True, self.scheduler.server_info())
        if msg.kind in ("load_lora_adapter", "unload_lora_adapter"):
            try:
                if msg.kind == "load_lora_adapter":
                    data = self.scheduler.load_adapter(msg.args.get("lora_name"), msg.args.get("lora_path"))
                else:
                    data = self.scheduler.unload_adapter(msg.args.get("lora_name"))
            except (ValueError, OSError) as e:
                return ControlReply(msg.request_id, False, {"message": str(e), **getattr(e, "reply", {})})
            return ControlReply(msg.request_id, True, data)
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
        lps = req.logprobs
        if not new_ids and not req.finished and len(lps.input_token) == sent.input_logprobs:
            return None
        sp = req.sampling_params
        want_lp = req.logprob.return_logprob
        out = ReqOutput(
            rid=req.rid, new_token_ids=new_ids,
            finish_reason=req.finish_reason.to_dict() if req.finish_reason else None,
            prompt_tokens=len(req.origin_input_ids), completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            cached_tiers=list(req.cached_tiers) if req.cached_tiers is not None else None, spec_verify_ct=req.spec_verify_ct, spec_accepted=req.spec_accepted,
            skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens, stop=list(sp.stop),
            stop_regex=list(sp.stop_regex), no_stop_trim=sp.no_stop_trim,
            input_token_logprobs=_pairs(lps.input_token[sent.input_logprobs:]) if want_lp else None,
            input_top_logprobs=_tops(lps.input_top[sent.input_logprobs:]) if want_lp else None,
            output_token_logprobs=_pairs(lps.output_token[sent.output_logprobs:]) if want_lp else None,
            output_top_logprobs=_tops(lps.output_top[sent.output_logprobs:]) if want_lp else None,
        )
        if req.finished:
            self.sent.pop(req.rid, None)
            self.reqs.pop(req.rid, None)
        else:
            sent.ids = len(req.output_ids)
            sent.output_logprobs = len(lps.output_token)
            sent.input_logprobs = len(lps.input_token)
        return out

    def _send(self, msg: Any) -> None:
        self.send.send(io_struct.encode(msg))


def _pairs(items: list[tuple[Any, int]]) -> list[list[Any]]:
    return [[lp, tok] for lp, tok in items]


def _tops(items: list[Any]) -> list[Any]:
    return [None if top is None else _pairs(top) for top in items]
