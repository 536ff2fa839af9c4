"""A chat request run to its choices' answers, for /v1/chat/completions and /v1/responses.

`prepare_chat` renders a checked request's turn (chat.py) and its samples; `ChatChoices` runs
them. A choice answers in one phase, or in two when its answer is constrained (tool_choice
required or named, response_format) while the server parses reasoning: the reasoning, stopped
at its closing tag, then the constrained answer after it (its prompt extends the first, so it
hits the cache). ChatChoices holds that state for every choice, and for a stream each choice's
ChatStream, which reads the text as chat deltas (reasoning_content, content, tool_calls); the
routes only format what it hands out.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from ..io_struct import ImageInput, TokenizedGenerateReq
from ..results import ResultBuilder
from .chat import ChatOptions, ChatStream, ChatTurn, after_reasoning, prepare_turn
from .openai_common import adapter_of, check_fits, samples, tokenize
from .openai_protocol import ChatCompletionRequest, OpenAIError, samples_usage, usage
from .request_runner import RequestRunner
from .tokenizer_manager import TokenizerManager
from .tool_calls.reasoning import CLOSE

_RENAMES = {"min_new_tokens": "min_tokens", "text": "messages", "input_ids": "messages",
            "top_logprobs_num": "top_logprobs"}
REASONING, ANSWER = "reasoning", "answer"


@dataclass(frozen=True)
class ChatRun:
    """A prepared request: its turn, and one first-phase sample per choice."""

    body: ChatCompletionRequest
    turn: ChatTurn
    renames: dict[str, str]
    max_new: int
    msgs: list[TokenizedGenerateReq]
    images: list[Any] = field(default_factory=list)  # the prompt's prepared images (a second phase re-expands them)

    @property
    def two_phase(self) -> bool:
        return self.turn.constrain_after_reasoning


def prepare_chat(tm: TokenizerManager, body: ChatCompletionRequest, options: ChatOptions) -> ChatRun:
    """Raises OpenAIError naming the field (as this request names it)."""
    max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    renames = {**_RENAMES, "max_new_tokens": max_field}
    image_intake = tm.intake.images  # None: a text-only model, which refuses image parts
    messages = [m.as_dict(i, image_intake is not None) for i, m in enumerate(body.messages)]
    response_schema = body.schema_from_response_format()
    try:
        turn = prepare_turn(tm.tokenizer, messages, body.tools, body.tool_choice, body.parallel_tool_calls,
                            options, response_schema, image_intake.placeholder if image_intake else None)
        # Decoding the images takes time: this runs in a worker thread (the route's to_thread).
        images = tm.intake.load_images([u for i, m in enumerate(body.messages) for u in m.image_urls(i)], "messages")
    except ValueError as e:
        raise OpenAIError.from_value_error(e, renames) from None
    if turn.tools.constrained:
        renames["json_schema"] = "tools"
    elif response_schema is not None:
        json_object = body.response_format.type == "json_object"
        renames["json_schema"] = "response_format" if json_object else "response_format.json_schema.schema"
    ids, records = _with_images(tm, tokenize(tm, turn.prompt, renames), images, renames)
    max_new = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_new is None:
        max_new = tm.context_len - len(ids)
    check_fits(tm, len(ids), max_new, max_field)
    if turn.constrain_after_reasoning:
        msgs = _samples(tm, body, renames, ids, max_new, None, stop=[CLOSE], n=body.n, images=records)
    else:
        msgs = _samples(tm, body, renames, ids, max_new, turn.json_schema, n=body.n, images=records)
    return ChatRun(body, turn, renames, max_new, msgs, images)


def _with_images(tm: TokenizerManager, ids: list[int], images: list[Any],
                 renames: dict[str, str]) -> tuple[list[int], list[ImageInput]]:
    """The rendered prompt's image placeholders expanded (the template already holds BOS and
    special tokens)."""
    try:
        return tm.intake.expand_images(ids, images, "messages")
    except ValueError as e:
        raise OpenAIError.from_value_error(e, renames) from None


def _samples(tm: TokenizerManager, body: ChatCompletionRequest, renames: dict[str, str], ids: list[int],
             max_new: int, schema: str | None, stop: list[str] = (), n: int = 1,
             seed_offset: int = 0, images: list[ImageInput] = ()) -> list[TokenizedGenerateReq]:
    """n samples (sample i seeded seed + seed_offset + i, with a seed)."""
    params = body.sampling_params(max_new)
    params["n"] = n
    if schema is not None:
        params["json_schema"] = schema
    if stop:
        existing = params.get("stop") or []
        params["stop"] = ([existing] if isinstance(existing, str) else list(existing)) + list(stop)
    if seed_offset and params.get("seed") is None:
        params["seed"] = tm.intake.default_seed
    if seed_offset and params.get("seed") is not None:
        params["seed"] += seed_offset
    return samples(tm, ids, params, renames, return_logprob=body.logprobs, top_logprobs_num=body.top_logprobs or 0,
                   stream=body.stream, cache_salt=body.cache_salt, lora_path=adapter_of(tm, body.model),
                   session_id=body.session_id, images=images)


@dataclass(frozen=True)
class ChoiceEvent:
    """A chunk of one choice, as ChatChoices hands it out."""

    index: int
    phase: str  # REASONING (the first of two phases) or ANSWER
    chunk: dict[str, Any]  # the chunk (results.py), of this phase's request
    final: bool  # the choice ended with this chunk (its finish reason is the chunk's)
    deltas: list[dict[str, Any]] = field(default_factory=list)  # chat deltas of the chunk's text (streams)
    closing: list[dict[str, Any]] = field(default_factory=list)  # what the stream held back, at the end


@dataclass
class _Choice:
    phase: str
    stream: ChatStream | None  # None: not streamed
    metas: dict[str, dict[str, Any]] = field(default_factory=dict)  # per phase: its latest meta_info
    # Per phase, the whole result, where it is needed: a whole answer, or the reasoning that
    # the answer's prompt extends (a streamed answer keeps nothing).
    wholes: dict[str, ResultBuilder] = field(default_factory=dict)


class ChatChoices:
    """Every choice of one ChatRun as it runs (through `runner`, which admitted them)."""

    def __init__(self, tm: TokenizerManager, run: ChatRun, runner: RequestRunner):
        self._tm = tm
        self.run = run
        self.runner = runner
        first = REASONING if run.two_phase else ANSWER
        self._choices = [_Choice(first, run.turn.stream() if run.body.stream else None) for _ in run.msgs]

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Every choice's chunks, as they come, each phase after the other; raises as the
        runner's chunks() does."""
        async for index, chunk in self.runner.chunks():
            choice = self._choices[index]
            phase = choice.phase
            choice.metas[phase] = chunk["meta_info"]
            if choice.stream is None or phase == REASONING:
                choice.wholes.setdefault(phase, ResultBuilder()).add(chunk)
            final = chunk["meta_info"]["finish_reason"] is not None
            if final and phase == REASONING:
                final = not await self._answer_after_reasoning(index, choice)
            yield self._event(index, choice, phase, chunk, final)

    async def run_to_end(self) -> list[dict[str, Any]]:
        """Each choice's whole result, its text the reasoning and the answer of both phases."""
        async for _ in self.events():
            pass
        return [self.result(i) for i in range(len(self._choices))]

    def result(self, index: int) -> dict[str, Any]:
        """A choice not streamed, whole: the result of its last phase, with the whole text."""
        wholes = self._choices[index].wholes
        whole = wholes.get(ANSWER, wholes.get(REASONING)).result()
        if REASONING in wholes and ANSWER in wholes:
            whole["text"] = wholes[REASONING].text + CLOSE + whole["text"]
        return whole

    def called_tools(self, index: int) -> bool:
        stream = self._choices[index].stream
        return stream is not None and stream.called_tools

    def usage(self) -> dict[str, Any]:
        if not self.run.two_phase:
            metas = [c.metas[ANSWER] for c in self._choices]
            return samples_usage([len(self.run.msgs[0].input_ids)], [len(metas)], metas)
        # The prompt counts once; the answers' prompts extend it (and hit the cache).
        firsts = [c.metas[REASONING] for c in self._choices if REASONING in c.metas]
        answers = [c.metas[ANSWER] for c in self._choices if ANSWER in c.metas]
        completion = sum(m["completion_tokens"] for m in firsts + answers)
        return usage(firsts[0]["prompt_tokens"] if firsts else 0, completion,
                     min((m["cached_tokens"] for m in firsts), default=0))

    async def _answer_after_reasoning(self, index: int, choice: _Choice) -> bool:
        """Starts the answer phase of a choice whose reasoning closed with tokens left; False
        when the choice ended while reasoning (there is no answer to constrain)."""
        first = choice.wholes[REASONING]
        reason = first.meta["finish_reason"]
        left = self.run.max_new - first.meta["completion_tokens"]
        if reason.get("type") != "stop" or reason.get("matched") != CLOSE or left <= 0:
            return False
        # Tokenizing (and a VLM's image processing) runs off the event loop, as prepare_chat does.
        msg = await asyncio.to_thread(self._answer_request, index, first.text, left)
        self.runner.follow(index, msg)
        choice.phase = ANSWER
        return True

    def _answer_request(self, index: int, reasoning: str, left: int) -> TokenizedGenerateReq:
        """The answer phase's request: the prompt extended by the reasoning, constrained."""
        run = self.run
        ids = tokenize(self._tm, after_reasoning(run.turn, reasoning), run.renames)
        ids, records = _with_images(self._tm, ids, run.images, run.renames)
        [msg] = _samples(self._tm, run.body, run.renames, ids, left, run.turn.json_schema, seed_offset=index,
                         images=records)
        return msg

    def _event(self, index: int, choice: _Choice, phase: str, chunk: dict[str, Any], final: bool) -> ChoiceEvent:
        stream = choice.stream
        if stream is None:
            return ChoiceEvent(index, phase, chunk, final)
        text = chunk["text"]
        if phase == REASONING:
            return ChoiceEvent(index, phase, chunk, final, stream.feed_reasoning(text))
        if self.run.two_phase:
            deltas = stream.feed_answer(text)
        else:
            deltas = stream.feed(text) if text else []
        return ChoiceEvent(index, phase, chunk, final, deltas, stream.finish() if final else [])
