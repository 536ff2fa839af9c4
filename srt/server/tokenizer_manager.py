"""The main process's side of the runtime: tokenizes, sends requests to the scheduler and
gathers the detokenizer's text back into per-request results for the HTTP handlers."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import zmq
import zmq.asyncio

from radixlm.srt import io_struct
from radixlm.srt.server.input_validation import prompt_token_ids
from radixlm.srt.io_struct import (AbortReq, BatchTextOut, ControlReply, ControlReq, ReqTextOutput,
                                   TokenizedGenerateReq)
from radixlm.srt.executor.logprobs import logprob_meta
from radixlm.srt.server.metrics import Metrics
from radixlm.srt.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class GenerateRequest:
    """One prompt and one sample (callers expand batches and n > 1 with `expand_n`)."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = field(default_factory=dict)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | None = None


@dataclass
class _ReqState:
    rid: str
    input_ids: list[int]
    request: GenerateRequest
    created: float
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    input_token_logprobs: list[list[Any]] = field(default_factory=list)
    input_top_logprobs: list[Any] = field(default_factory=list)
    output_token_logprobs: list[list[Any]] = field(default_factory=list)
    output_top_logprobs: list[Any] = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)


class TokenizerManager:
    def __init__(self, tokenizer: Any, model_config: Any, context_len: int, model_path: str,
                 scheduler_addr: str, recv_addr: str, metrics: Metrics | None = None):
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.context_len = context_len
        self.model_path = model_path
        self.metrics = metrics or Metrics()
        self._ctx = zmq.asyncio.Context()
        self._send = self._ctx.socket(zmq.PUSH)
        self._send.setsockopt(zmq.LINGER, 0)
        self._send.connect(scheduler_addr)
        self._recv = self._ctx.socket(zmq.PULL)
        self._recv.setsockopt(zmq.LINGER, 0)
        self._recv.bind(recv_addr)
        self._states: dict[str, _ReqState] = {}
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

    # ---- generation ----------------------------------------------------------------------------

    def tokenize(self, req: GenerateRequest) -> list[int]:
        """Validates and tokenizes; raises ValueError naming the field."""
        return prompt_token_ids(self.tokenizer, req.text, req.input_ids, self.model_config.vocab_size,
                                self.context_len)

    def validate(self, req: GenerateRequest) -> tuple[list[int], SamplingParams]:
        ids = self.tokenize(req)
        sp = SamplingParams.from_dict(req.sampling_params, vocab_size=self.model_config.vocab_size)
        if not isinstance(req.return_logprob, bool):
            raise ValueError("return_logprob: must be a boolean")
        if not isinstance(req.logprob_start_len, int) or req.logprob_start_len < -1:
            raise ValueError("logprob_start_len: must be an integer >= -1")
        if not isinstance(req.top_logprobs_num, int) or not 0 <= req.top_logprobs_num <= 64:
            raise ValueError("top_logprobs_num: must be an integer in [0, 64]")
        if sp.n != 1:
            raise ValueError("sampling_params.n: expand n > 1 before calling generate")
        return ids, sp

    async def generate(self, req: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        """Yields SGLang-shaped results `{"text", "output_ids", "meta_info"}` with the text and
        ids so far: one final result, or with `stream` one per chunk (the last is finished).

        Raises ValueError before anything is sent when the input is bad. If the consumer stops
        iterating before the end (a client went away), the request is aborted in the scheduler.
        """
        ids, sp = self.validate(req)
        rid = req.rid or uuid.uuid4().hex
        if rid in self._states:
            raise ValueError(f"rid: {rid!r} is already running")
        state = _ReqState(rid=rid, input_ids=ids, request=req, created=time.perf_counter(), prompt_tokens=len(ids))
        self._states[rid] = state
        await self._send.send(io_struct.encode(TokenizedGenerateReq(
            rid=rid, input_ids=ids, sampling_params=sp.to_dict(), return_logprob=req.return_logprob, logprob_start_len=req.logprob_start_len,
            top_logprobs_num=req.top_logprobs_num, stream=req.stream)))
        try:
            while True:
                await state.event.wait()
                state.event.clear()
                if state.finish_reason is not None or req.stream:
                    yield self._result(state)
                if state.finish_reason is not None:
                    return
        finally:
            self._states.pop(rid, None)
            if state.finish_reason is None:
                await self.abort(rid)
            self.metrics.on_request_end(state)

    async def generate_once(self, req: GenerateRequest) -> dict[str, Any]:
        result = None
        async for result in self.generate(dataclasses.replace(req, stream=False)):
            pass
        return result

    async def cache_prompt(self, req: GenerateRequest) -> None:
        """Prefills a prompt without generating, so n samples after it share its KV."""
        warm = dataclasses.replace(req, sampling_params={"max_new_tokens": 0}, return_logprob=False,
                                   stream=False, rid=None)
        await self.generate_once(warm)

    async def abort(self, rid: str) -> None:
        await self._send.send(io_struct.encode(AbortReq(rid=rid)))

    async def control(self, kind: str, timeout: float = 30.0) -> ControlReply:
        request_id = uuid.uuid4().hex
        future = asyncio.get_running_loop().create_future()
        self._control_waiters[request_id] = future
        try:
            await self._send.send(io_struct.encode(ControlReq(kind=kind, request_id=request_id)))
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
        state.text += out.text_delta
        state.output_ids.extend(o.new_token_ids)
        state.cached_tokens = o.cached_tokens
        state.input_token_logprobs.extend(o.input_token_logprobs or [])
        state.input_top_logprobs.extend(o.input_top_logprobs or [])
        state.output_token_logprobs.extend(o.output_token_logprobs or [])
        state.output_top_logprobs.extend(o.output_top_logprobs or [])
        if o.finish_reason is not None:
            state.finish_reason = o.finish_reason
        state.event.set()

    def _result(self, state: _ReqState) -> dict[str, Any]:
        req = state.request
        meta: dict[str, Any] = {
            "id": state.rid,
            "prompt_tokens": state.prompt_tokens,
            "completion_tokens": len(state.output_ids),
            "cached_tokens": state.cached_tokens,
            "finish_reason": state.finish_reason,
            "e2e_latency": time.perf_counter() - state.created,
        }
        if req.return_logprob:
            meta.update(logprob_meta(self.tokenizer, req.return_text_in_logprobs, req.top_logprobs_num,
                                     state.input_token_logprobs, state.input_top_logprobs,
                                     state.output_token_logprobs, state.output_top_logprobs))
        return {"text": state.text, "output_ids": list(state.output_ids), "meta_info": meta}


def expand_n(req: GenerateRequest) -> list[GenerateRequest]:
    """n > 1 as n single-sample requests; with a seed, sample i gets seed + i (else all equal)."""
    params = dict(req.sampling_params or {})
    n = params.pop("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 64:
        raise ValueError("sampling_params.n: must be an integer in [1, 64]")
    out = []
    for i in range(n):
        p = dict(params)
        if n > 1 and p.get("seed") is not None:
            p["seed"] = p["seed"] + i
        rid = None if req.rid is None else (req.rid if n == 1 else f"{req.rid}-{i}")
        out.append(dataclasses.replace(req, sampling_params=p, rid=rid))
    return out
