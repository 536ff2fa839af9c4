"""RuntimeEndpoint: the backend for a radixlm (or SGLang) server's native API.

Everything comes from the server over HTTP: token ids from /tokenize, the chat template and
special tokens from /get_model_info. The client needs no model files and no runtime code.

`select` scores every choice in one batched /generate call with `max_new_tokens: 0` and
prompt logprobs, after a prefill-only call has put the prompt in the radix cache, so every
choice shares the prompt's KV and only its own tokens are computed.

The boundary between prompt and choice: a choice's tokens are those of `tokenize(prompt +
choice)` after its longest common token prefix with `tokenize(prompt)` (a token that merges
the prompt's last characters with the choice's first ones is scored as part of the choice).
The ids come from the server's /tokenize (or a local tokenizer the caller names with
`tokenizer_path`) and are sent as `input_ids`, so the boundary is exact. A server without
/tokenize gets text, and the client compares the token ids the server reports for the last
`_BOUNDARY_WINDOW` prompt tokens with those of each prompt+choice — the same rule, exact unless
a choice changes the tokenization of the prompt further back than that window (BPE
pre-tokenization keeps such changes to the last word).
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any, AsyncIterator, Iterator

from .backend import Backend, BackendError, Generation, Prompt
from .chat_template import ChatRenderer
from .choices import ChoiceDecision, ChoicesMethod, TokenLogprobs
from .http_client import DEFAULT_TIMEOUT_S, AsyncHttpClient, HttpClient, HttpStatusError
from .sampling import SglSamplingParams
from .tokenizer import ClientTokenizer, load_client_tokenizer, render_chat_template

logger = logging.getLogger(__name__)

_BOUNDARY_WINDOW = 16
_PREFILL_ONLY = {"max_new_tokens": 0}


class RuntimeEndpoint(Backend):
    """A running server at `base_url` (checked now through /get_model_info).

    tokenizer_path: a tokenizer on this machine to tokenize with and take the chat template
    from, instead of asking the server.
    sessions: whether each running program keeps its prefix protected on the server between
    its calls (docs/sessions.md); None: when the server offers program sessions."""

    def __init__(self, base_url: str, api_key: str | None = None, *, tokenizer_path: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, sessions: bool | None = None):
        self.base_url = base_url.rstrip("/")
        self._http = HttpClient(self.base_url, api_key, timeout)
        self._ahttp = AsyncHttpClient(self.base_url, api_key, timeout)
        self.model_info: dict[str, Any] = self._http.get("/get_model_info")
        offered = bool(self.model_info.get("program_sessions"))
        if sessions and not offered:
            raise BackendError(f"sessions=True: the server at {self.base_url} offers no program sessions")
        self.sessions = offered if sessions is None else sessions
        self._tokenizer_path = tokenizer_path
        self._local_tokenizer: ClientTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._server_tokenizes = True  # until a server answers /tokenize with 404 (older servers)

    # ---- information and cache -------------------------------------------------------------

    def get_model_info(self) -> dict[str, Any]:
        return dict(self.model_info)

    def get_server_info(self) -> dict[str, Any]:
        return self._http.get("/get_server_info")

    def flush_cache(self) -> bool:
        self._http.post_text("/flush_cache")
        return True

    def cache_prefix(self, text: str, images: tuple[str, ...] = ()) -> None:
        if text:
            self._http.post("/generate", {"text": text, "sampling_params": _PREFILL_ONLY, **_images(images)})

    async def acache_prefix(self, text: str, images: tuple[str, ...] = ()) -> None:
        if text:
            await self._ahttp.post("/generate", {"text": text, "sampling_params": _PREFILL_ONLY, **_images(images)})

    def image_token(self) -> str:
        token = self.model_info.get("image_token")
        if not token:
            raise BackendError(f"image: the model at {self.base_url} ({self.model_info.get('model_path')}) "
                               "takes no images")
        return token

    # ---- program sessions --------------------------------------------------------------------

    def session_id(self) -> str | None:
        return f"prog-{uuid.uuid4().hex}" if self.sessions else None

    def end_session(self, session_id: str) -> None:
        self._http.post("/end_session", {"session_id": session_id})

    async def aend_session(self, session_id: str) -> None:
        await self._ahttp.post("/end_session", {"session_id": session_id})

    # ---- token ids and chat template ------------------------------------------------------

    def tokenize(self, texts: list[str]) -> list[list[int]] | None:
        """Each text's token ids as the server's /generate sees them (no special tokens added);
        None when the server has no /tokenize and no local tokenizer was named."""
        tok = self._tokenizer()
        if tok is not None:
            return [tok.encode(t) for t in texts]
        if not self._server_tokenizes:
            return None
        try:
            reply = self._http.post("/tokenize", {"prompt": list(texts), "add_special_tokens": False})
        except HttpStatusError as e:
            if e.status != 404:
                raise
            logger.info("%s has no /tokenize; select compares the ids the server reports", self.base_url)
            self._server_tokenizes = False
            return None
        return reply["tokens"]

    def _tokenizer(self) -> ClientTokenizer | None:
        """The local tokenizer named by `tokenizer_path` (loaded on first use), else None."""
        if self._tokenizer_path is None:
            return None
        with self._tokenizer_lock:
            if self._local_tokenizer is None:
                self._local_tokenizer = load_client_tokenizer(self._tokenizer_path)
            return self._local_tokenizer

    def get_chat_template(self) -> ChatRenderer:
        name = f"chat template of {self.model_info.get('model_path')}"
        tok = self._tokenizer()
        if tok is not None:
            if not tok.has_chat_template:
                raise BackendError(f"roles need a chat template, and the tokenizer at {self._tokenizer_path} has none")
            return ChatRenderer(tok.apply_chat_template, name=name)
        template = self.model_info.get("chat_template")
        if not template:
            raise BackendError("roles need the model's chat template, but the server reports none")
        special = dict(self.model_info.get("special_tokens") or {})
        return ChatRenderer(lambda messages, add_generation_prompt: render_chat_template(
            template, special, messages, add_generation_prompt), name=name)

    # ---- generation ------------------------------------------------------------------------

    def generate(self, prompt: Prompt, params: SglSamplingParams) -> Generation:
        out = self._http.post("/generate", self._body(prompt, params))
        results = out if isinstance(out, list) else [out]
        return Generation([r["text"] for r in results], [r["meta_info"] for r in results])

    def generate_stream(self, prompt: Prompt, params: SglSamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        sent = 0
        for event in self._http.post_sse("/generate", {**self._body(prompt, params), "stream": True}):
            text = event.get("text", "")
            yield text[sent:], event.get("meta_info", {})
            sent = len(text)

    async def agenerate(self, prompt: Prompt, params: SglSamplingParams) -> Generation:
        out = await self._ahttp.post("/generate", self._body(prompt, params))
        results = out if isinstance(out, list) else [out]
        return Generation([r["text"] for r in results], [r["meta_info"] for r in results])

    async def agenerate_stream(self, prompt: Prompt,
                               params: SglSamplingParams) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        sent = 0
        async for event in self._ahttp.post_sse("/generate", {**self._body(prompt, params), "stream": True}):
            text = event.get("text", "")
            yield text[sent:], event.get("meta_info", {})
            sent = len(text)

    async def aclose(self) -> None:
        """Closes this event loop's connection pool now (it closes with its loop otherwise)."""
        await self._ahttp.aclose()

    async def aget_chat_template(self) -> ChatRenderer:
        return self.get_chat_template()  # model_info is already here; a local tokenizer loads once

    @staticmethod
    def _body(prompt: Prompt, params: SglSamplingParams) -> dict[str, Any]:
        return {"text": prompt.text, "sampling_params": params.wire_sampling(), **params.wire_logprob(),
                **_adapter(prompt), **_session(prompt), **_images(prompt.images)}

    # ---- select ----------------------------------------------------------------------------

    def select(self, prompt: Prompt, choices: list[str], temperature: float, method: ChoicesMethod) -> ChoiceDecision:
        if not prompt.text:
            raise ValueError("select: needs some text before it to score the choices after")
        # Token ids cannot carry images (the server expands each image's token): then text.
        ids = None if prompt.images else self.tokenize([prompt.text] + [prompt.text + c for c in choices])
        adapter = _adapter(prompt)  # every scoring call runs on the prompt's adapter
        if ids is not None:
            logprobs, choice_ids = self._score_with_ids(ids[0], ids[1:], adapter, _session(prompt))
        else:
            logprobs, choice_ids = self._score_with_text(prompt.text, choices, adapter, _session(prompt),
                                                         prompt.images)
        unconditional = self._unconditional(choice_ids, adapter) if method.requires_unconditional_logprobs else None
        return method(choices, logprobs, unconditional, temperature)

    def _score_with_ids(self, prompt_ids: list[int], seqs: list[list[int]], adapter: dict[str, str],
                        session: dict[str, str]) -> tuple[list[TokenLogprobs], list[list[int]]]:
        """prompt_ids: the prompt's ids; seqs: those of prompt + each choice. The prompt's
        prefill carries the program's session (the choices branch off it)."""
        # Position 0 has no logprob, and every choice keeps at least one token.
        starts = [max(1, min(_common_prefix_len(prompt_ids, s), len(s) - 1)) for s in seqs]
        self._http.post("/generate", {"input_ids": prompt_ids, "sampling_params": _PREFILL_ONLY, **adapter,
                                      **session})
        first = min(starts)
        results = self._prefill_batch({"input_ids": seqs, **_per_prompt(adapter, len(seqs))}, first)
        logprobs = []
        for seq, start, result in zip(seqs, starts, results):
            entries = result["meta_info"]["input_token_logprobs"]
            if len(entries) != len(seq) - first:
                raise BackendError(f"select: the server returned {len(entries)} prompt logprobs, "
                                   f"expected {len(seq) - first}")
            logprobs.append([(lp, tid) for lp, tid, *_ in entries[start - first:]])
        return logprobs, [seq[start:] for seq, start in zip(seqs, starts)]

    def _score_with_text(self, text: str, choices: list[str], adapter: dict[str, str], session: dict[str, str],
                         images: tuple[str, ...] = ()) -> tuple[list[TokenLogprobs], list[list[int]]]:
        warm = self._http.post("/generate", {"text": text, "sampling_params": _PREFILL_ONLY, **adapter, **session,
                                             **_images(images)})
        first = max(1, warm["meta_info"]["prompt_tokens"] - _BOUNDARY_WINDOW)
        per_prompt = {"image_data": [list(images)] * (len(choices) + 1)} if images else {}
        results = self._prefill_batch({"text": [text] + [text + c for c in choices],
                                       **_per_prompt(adapter, len(choices) + 1), **per_prompt}, first)
        window = [tid for _, tid, *_ in results[0]["meta_info"]["input_token_logprobs"]]
        logprobs, choice_ids = [], []
        for result in results[1:]:
            entries = result["meta_info"]["input_token_logprobs"]
            ids = [tid for _, tid, *_ in entries]
            k = min(_common_prefix_len(window, ids), len(ids) - 1)
            logprobs.append([(lp, tid) for lp, tid, *_ in entries[k:]])
            choice_ids.append(ids[k:])
        return logprobs, choice_ids

    def _unconditional(self, choice_ids: list[list[int]], adapter: dict[str, str]) -> list[TokenLogprobs]:
        """Each choice's tokens scored alone; the first has no context, so it counts 0."""
        results = self._prefill_batch({"input_ids": choice_ids, **_per_prompt(adapter, len(choice_ids))}, 0)
        out = []
        for result in results:
            entries = result["meta_info"]["input_token_logprobs"]
            out.append([(0.0 if lp is None else lp, tid) for lp, tid, *_ in entries])
        return out

    def _prefill_batch(self, prompts: dict[str, Any], logprob_start_len: int) -> list[dict[str, Any]]:
        count = len(next(iter(prompts.values())))
        out = self._http.post("/generate", {**prompts, "sampling_params": _PREFILL_ONLY, "return_logprob": True,
                                            "logprob_start_len": logprob_start_len})
        results = out if isinstance(out, list) else [out]
        if len(results) != count:
            raise BackendError(f"select: the server answered {len(results)} results for {count} prompts")
        return results


def _adapter(prompt: Prompt) -> dict[str, str]:
    """The body field naming the prompt's LoRA adapter, if it has one."""
    return {"lora_path": prompt.lora_path} if prompt.lora_path is not None else {}


def _session(prompt: Prompt) -> dict[str, str]:
    """The body field naming the running program's session, if it keeps one."""
    return {"session_id": prompt.session_id} if prompt.session_id is not None else {}


def _images(images: tuple[str, ...]) -> dict[str, list[str]]:
    """The body field carrying the prompt's images, in the order of their tokens in the text."""
    return {"image_data": list(images)} if images else {}


def _per_prompt(adapter: dict[str, str], count: int) -> dict[str, list[str]]:
    return {"lora_path": [adapter["lora_path"]] * count} if adapter else {}


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n
