"""The main process's side of the runtime: sends requests that its `intake` validated and
tokenized to the scheduler, and hands the detokenizer's text back to the HTTP handlers as
chunks of what is new, per request."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from .. import io_struct
from ..intake import Intake
from ..io_struct import (AbortReq, BatchTextOut, ControlReply, ControlReq, ReqTextOutput,
                         TokenizedGenerateReq)
from ..results import LogprobRecord, Progress, ResultBuilder, TokenTexts, result
from ..sampling_params import SamplingParams
from .errors import Overloaded, ServerUnavailable
from .metrics import Metrics

logger = logging.getLogger(__name__)


@dataclass
class _ReqState:
    msg: TokenizedGenerateReq
    text_in_logprobs: bool
    created: float
    sent: bool = False  # sent to the scheduler
    ended: bool = False  # finished, failed or closed: no longer in the manager
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tiers: list[int] | None = None
    finish_reason: dict[str, Any] | None = None
    spec_verify_ct: int = 0
    spec_accepted: int = 0
    # What arrived since the last chunk handed out.
    texts: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: LogprobRecord = field(default_factory=LogprobRecord)
    first_token_time: float | None = None
    last_token_time: float | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)
    error: str | None = None  # set when the server can no longer finish it (a child died, shutdown)

    @property
    def rid(self) -> str:
        return self.msg.rid

    @property
    def prompt_tokens(self) -> int:  # read by Metrics
        return len(self.msg.input_ids)


class RequestStream:
    """One request's results as they arrive: an async iterator of SGLang-shaped chunks, each
    holding the text, ids and logprob entries new since the previous one, with the request's
    running counters (results.py). A request not streamed yields one chunk, when it finishes.

    The request is sent to the scheduler on the first iteration. `aclose()` ends it early and
    aborts it in the scheduler; whoever iterates must call it (or read to the end).
    """

    def __init__(self, tm: TokenizerManager, state: _ReqState, payload: bytes):
        self._tm = tm
        self._state = state
        self._payload = payload

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        state = self._state
        if state.ended:
            raise StopAsyncIteration
        if not state.sent:
            state.sent, state.created = True, time.perf_counter()  # latencies count from here
            await self._tm._send.send(self._payload)
        while True:
            await state.event.wait()
            state.event.clear()
            if state.error is not None:
                self._tm._end(state)
                raise ServerUnavailable(state.error)
            if state.finish_reason is not None or state.msg.stream:
                chunk = self._tm._chunk(state)
                if state.finish_reason is not None:
                    self._tm._end(state)
                return chunk

    async def aclose(self) -> None:
        state = self._state
        if state.ended:
            return
        self._tm._end(state)
        if state.sent and state.finish_reason is None and self._tm.unavailable is None:
            await self._tm.abort(state.rid)


class TokenizerManager:
    def __init__(self, tokenizer: Any, model_config: Any, context_len: int, scheduler_addr: str,
                 recv_addr: str, metrics: Metrics | None = None, max_in_flight: int | None = None,
                 default_seed: int | None = None, adapters: Any = None, sessions: Any = None, images: Any = None):
        """adapters: the LoRA adapters requests may name (lora_routes.AdapterNames, with
        --enable-lora), else None. sessions: the owners of session ids
        (session_routes.SessionOwners), else None (not checked). images: a vision-language
        model's image intake (multimodal/inputs.py's ImageInputs), else None. The intake, images
        included, runs in worker threads (the routes' asyncio.to_thread), never on the loop."""
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.context_len = context_len
        self.adapters = adapters
        self.sessions = sessions
        self.intake = Intake(tokenizer, model_config.vocab_size, context_len, default_seed,
                             adapters.usable if adapters is not None else None, sessions, images)
        self.metrics = metrics or Metrics()
        # Running plus waiting requests the server holds at most; beyond it requests get 429.
        self.max_in_flight = max_in_flight
        self.unavailable: str | None = None  # why no request can be served any more
        self._ctx = zmq.asyncio.Context()
        self._send = self._ctx.socket(zmq.PUSH)
        self._send.setsockopt(zmq.LINGER, 0)
        self._send.connect(scheduler_addr)
        self._recv = self._ctx.socket(zmq.PULL)
        self._recv.setsockopt(zmq.LINGER, 0)
        self._recv.bind(recv_addr)
        self._states: dict[str, _ReqState] = {}
        self._token_texts = TokenTexts(tokenizer)
        self._control_waiters: dict[str, asyncio.Future] = {}
        self._recv_task: asyncio.Task | None = None
        # Constraint specs are checked here with xgrammar's parsers; importing it takes seconds,
        # which would otherwise stall the event loop on the first constrained request.
        threading.Thread(target=importlib.import_module, args=("xgrammar",), daemon=True).start()

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the receive loop on the running event loop."""
        if self._recv_task is None:
            self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())

    def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
        self._send.close()
        self._recv.close()
        self._ctx.term()

    @property
    def num_active(self) -> int:
        return len(self._states)

    def is_full(self, adding: int = 1) -> bool:
        return self.max_in_flight is not None and len(self._states) + adding > self.max_in_flight

    def fail_all(self, reason: str) -> None:
        """Ends every request in flight at once with `reason` (their streams raise
        ServerUnavailable) and refuses new ones: used when a child died or on shutdown."""
        self.unavailable = reason
        for state in self._states.values():
            state.error = reason
            state.event.set()

    # ---- generation ----------------------------------------------------------------------------

    def generate(self, msg: TokenizedGenerateReq, text_in_logprobs: bool = False,
                 admitted: bool = False) -> RequestStream:
        """Registers `msg` (from `self.intake`, which validated it) and returns its stream of
        chunks; it is sent to the scheduler when the stream is first read. `text_in_logprobs`:
        each logprob triple holds its token's text. `admitted`: the request's place was taken
        already (a later phase of an admitted request), so it is not refused for a full server.

        Raises at once, leaving nothing registered: ValueError when the rid is already running
        or the message cannot be packed, Overloaded when the server is full, ServerUnavailable
        when it can serve no more. Reading the stream raises ServerUnavailable when a child dies.
        """
        if self.unavailable is not None:
            raise ServerUnavailable(self.unavailable)
        if msg.rid in self._states:
            raise ValueError(f"rid: {msg.rid!r} is already running")
        if not admitted and self.is_full():
            self.metrics.on_rejected("queue_full")
            raise Overloaded(f"the server holds {len(self._states)} requests, its limit; retry later")
        try:  # packed before it is registered: a failure leaves no rid behind
            payload = io_struct.encode(msg)
        except (OverflowError, TypeError, ValueError) as e:
            raise ValueError(f"body: cannot be sent to the scheduler ({e})") from None
        state = _ReqState(msg=msg, text_in_logprobs=text_in_logprobs, created=time.perf_counter())
        self._states[msg.rid] = state
        return RequestStream(self, state, payload)

    async def generate_once(self, msg: TokenizedGenerateReq, admitted: bool = False) -> dict[str, Any]:
        """The whole result of `msg`, run without streaming."""
        whole = ResultBuilder()
        stream = self.generate(dataclasses.replace(msg, stream=False), admitted=admitted)
        try:
            async for chunk in stream:
                whole.add(chunk)
        finally:
            await stream.aclose()
        return whole.result()

    async def cache_prompt(self, msg: TokenizedGenerateReq) -> None:
        """Prefills a prompt without generating, so n samples after it share its KV (under the
        same cache salt: a salted prompt is cached for that salt only). It takes no place of its
        own: the samples it runs for were admitted and wait for it."""
        warm = TokenizedGenerateReq(rid=uuid.uuid4().hex, input_ids=msg.input_ids,
                                    sampling_params=SamplingParams(max_new_tokens=0), cache_salt=msg.cache_salt,
                                    lora_path=msg.lora_path, images=msg.images)
        await self.generate_once(warm, admitted=True)

    async def abort(self, rid: str, abort_all: bool = False) -> None:
        await self._send.send(io_struct.encode(AbortReq(rid=rid, abort_all=abort_all)))

    def running_on_adapter(self, name: str) -> bool:
        return any(state.msg.lora_path == name for state in self._states.values())

    async def control(self, kind: str, timeout: float = 30.0, args: dict[str, Any] | None = None) -> ControlReply:
        request_id = uuid.uuid4().hex
        future = asyncio.get_running_loop().create_future()
        self._control_waiters[request_id] = future
        try:
            await self._send.send(io_struct.encode(ControlReq(kind=kind, request_id=request_id, args=args or {})))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._control_waiters.pop(request_id, None)

    # ---- results -------------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        while True:
            try:
                msg = io_struct.decode(await self._recv.recv())
            except asyncio.CancelledError:
                raise
            except Exception:  # a malformed message must not stop result delivery
                logger.exception("bad message from the detokenizer")
                continue
            if isinstance(msg, BatchTextOut):
                for out in msg.outputs:
                    self._apply(out)
            elif isinstance(msg, ControlReply):
                future = self._control_waiters.get(msg.request_id)
                if future is not None and not future.done():
                    future.set_result(msg)

    def _apply(self, out: ReqTextOutput) -> None:
        state = self._states.get(out.rid)
        if state is None:
            return  # the client already left
        o = out.output
        now = time.perf_counter()
        if o.new_token_ids:
            if state.first_token_time is None:
                state.first_token_time = now
                self.metrics.observe_ttft(now - state.created)
            elif state.last_token_time is not None:
                self.metrics.observe_itl((now - state.last_token_time) / len(o.new_token_ids))
            state.last_token_time = now
        state.texts.append(out.text_delta)
        state.ids.extend(o.new_token_ids)
        state.completion_tokens += len(o.new_token_ids)
        state.cached_tokens = o.cached_tokens
        state.cached_tiers = o.cached_tiers
        state.spec_verify_ct, state.spec_accepted = o.spec_verify_ct, o.spec_accepted
        record = state.logprobs
        record.input_token.extend(o.input_token_logprobs or [])
        record.input_top.extend(o.input_top_logprobs or [])
        record.output_token.extend(o.output_token_logprobs or [])
        record.output_top.extend(o.output_top_logprobs or [])
        if o.finish_reason is not None:
            state.finish_reason = o.finish_reason
        state.event.set()

    def _chunk(self, state: _ReqState) -> dict[str, Any]:
        """What arrived since the last chunk, as a result; the state starts collecting anew."""
        # The detokenizer trimmed stop strings and stop regex matches, streamed or not.
        progress = Progress(prompt_tokens=state.prompt_tokens, completion_tokens=state.completion_tokens,
                            cached_tokens=state.cached_tokens, cached_tiers=state.cached_tiers,
                            finish_reason=state.finish_reason,
                            e2e_latency=time.perf_counter() - state.created, spec_verify_ct=state.spec_verify_ct)
        text = state.texts[0] if len(state.texts) == 1 else "".join(state.texts)
        chunk = result(state.msg, text, state.ids, progress, state.logprobs,
                       self._token_texts if state.text_in_logprobs else None)
        state.texts, state.ids, state.logprobs = [], [], LogprobRecord()
        return chunk

    def _end(self, state: _ReqState) -> None:
        if not state.ended:
            state.ended = True
            self._states.pop(state.rid, None)
            self.metrics.on_request_end(state)
            if self.sessions is not None and state.msg.session_id is not None:
                self.sessions.touch(state.msg.session_id)
