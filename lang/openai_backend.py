"""OpenAI: the backend for any OpenAI-compatible server (ours at /v1 included).

- gen: a gen at the start of an assistant turn goes through /chat/completions with the turns
  so far (chat models); any other gen goes through /completions with the program's text.
- select: /completions with each `prompt + choice`, `echo`, `logprobs` and `max_tokens: 0`;
  a choice's tokens are those ending after the prompt's last character (text offsets). A
  server without completion logprobs (chat-only models) gets a clear error.
- roles: with `tokenizer_path` the model's own chat template renders them (then completions
  see exactly what chat would); otherwise ChatML stands in, which only chat-mode gens ignore.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

from .backend import Backend, BackendError, Generation, Prompt
from .chat_template import ChatRenderer
from .choices import ChoiceDecision, ChoicesMethod, TokenLogprobs
from .http_client import DEFAULT_TIMEOUT_S, HttpClient
from .sampling import SglSamplingParams
from .tokenizer import load_client_tokenizer

_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
# Sampling fields OpenAI-compatible servers take under the same name (SGLang's extras too).
_PASSED = ("n", "stop", "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
           "repetition_penalty", "seed", "ignore_eos", "stop_token_ids", "skip_special_tokens", "no_stop_trim",
           "regex", "json_schema")


class OpenAI(Backend):
    def __init__(self, model: str, base_url: str | None = None, api_key: str | None = None, *,
                 is_chat_model: bool = True, tokenizer_path: str | None = None, timeout: float = DEFAULT_TIMEOUT_S):
        self.model = model
        self.base_url = (base_url or os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1").rstrip("/")
        self.is_chat_model = is_chat_model
        self._http = HttpClient(self.base_url, api_key or os.environ.get("OPENAI_API_KEY"), timeout)
        self._tokenizer_path = tokenizer_path

    def get_chat_template(self) -> ChatRenderer:
        if self._tokenizer_path is not None:
            tok = load_client_tokenizer(self._tokenizer_path)
            if not tok.has_chat_template:
                raise BackendError(f"the tokenizer at {self._tokenizer_path} has no chat template")
            return ChatRenderer(tok.apply_chat_template, name=f"chat template of {self._tokenizer_path}")
        return ChatRenderer(_chatml, name="ChatML stand-in template")

    # ---- gen ---------------------------------------------------------------------------------

    def _chat_mode(self, prompt: Prompt) -> bool:
        return self.is_chat_model and prompt.role == "assistant" and not prompt.role_content and bool(prompt.messages)

    def _request(self, prompt: Prompt, params: SglSamplingParams, stream: bool) -> tuple[str, dict[str, Any]]:
        # A LoRA adapter is a model of its own on an OpenAI-style server (vLLM's and ours).
        body: dict[str, Any] = {"model": prompt.lora_path or self.model, **_openai_params(params)}
        if stream:
            body["stream"] = True
        if self._chat_mode(prompt):
            if "json_schema" in body:  # OpenAI's own spelling of a schema constraint
                schema = json.loads(body.pop("json_schema"))
                body["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": "output", "schema": schema, "strict": True}}
            if params.return_logprob:
                body["logprobs"] = True
                if params.top_logprobs_num:
                    body["top_logprobs"] = params.top_logprobs_num
            return "/chat/completions", {**body, "messages": list(prompt.messages)}
        if params.return_logprob:
            body["logprobs"] = params.top_logprobs_num or 0
        return "/completions", {**body, "prompt": prompt.text}

    def generate(self, prompt: Prompt, params: SglSamplingParams) -> Generation:
        path, body = self._request(prompt, params, stream=False)
        out = self._http.post(path, body)
        choices = sorted(out.get("choices", []), key=lambda c: c.get("index", 0))
        if not choices:
            raise BackendError(f"{path}: the server returned no choices")
        texts = [_choice_text(c) for c in choices]
        usage = out.get("usage") or {}
        metas = [_meta(out, c, usage) for c in choices]
        return Generation(texts, metas)

    def generate_stream(self, prompt: Prompt, params: SglSamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        path, body = self._request(prompt, params, stream=True)
        meta: dict[str, Any] = {}
        for event in self._http.post_sse(path, body):
            for choice in event.get("choices", []):
                delta = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                meta = _meta(event, choice, event.get("usage") or {})
                if delta:
                    yield delta, meta
        yield "", meta

    # ---- select ------------------------------------------------------------------------------

    def select(self, prompt: Prompt, choices: list[str], temperature: float, method: ChoicesMethod) -> ChoiceDecision:
        if not prompt.text:
            raise ValueError("select: needs some text before it to score the choices after")
        scored = self._echo_logprobs([prompt.text + c for c in choices], prompt.lora_path)
        logprobs = [_after(tokens, offsets, lps, len(prompt.text)) for tokens, offsets, lps in scored]
        unconditional = None
        if method.requires_unconditional_logprobs:
            alone = self._echo_logprobs(choices, prompt.lora_path)
            unconditional = [_aligned([0.0 if lp is None else lp for lp in lps], len(cond))
                             for (_, _, lps), cond in zip(alone, logprobs)]
        return method(choices, logprobs, unconditional, temperature)

    def _echo_logprobs(self, prompts: list[str],
                       lora_path: str | None = None) -> list[tuple[list[str], list[int], list[float | None]]]:
        body = {"model": lora_path or self.model, "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 0,
                "temperature": 0.0}
        try:
            out = self._http.post("/completions", body)
        except BackendError as e:
            raise BackendError(f"select with the OpenAI backend needs /completions with echo and logprobs; "
                               f"this server refused: {e}") from e
        results = sorted(out.get("choices", []), key=lambda c: c.get("index", 0))
        if len(results) != len(prompts) or any(not (c.get("logprobs") or {}).get("tokens") for c in results):
            raise BackendError("select with the OpenAI backend needs prompt logprobs (echo) from /completions, "
                               "which this server did not return")
        return [(c["logprobs"]["tokens"], c["logprobs"]["text_offset"], c["logprobs"]["token_logprobs"])
                for c in results]


def _after(tokens: list[str], offsets: list[int], logprobs: list[float | None], boundary: int) -> TokenLogprobs:
    """The (logprob, 0) of every token that ends after `boundary` characters (ids are unknown)."""
    out = [(lp, 0) for tok, off, lp in zip(tokens, offsets, logprobs) if off + len(tok) > boundary and lp is not None]
    if not out:
        raise BackendError("select: the server's logprobs cover no token of the choice")
    return out


def _aligned(logprobs: list[float], count: int) -> TokenLogprobs:
    """A choice scored alone, cut or padded (with 0) at the front to its token count after the
    prompt: the two tokenizations can differ at the prompt boundary, never at the end."""
    values = logprobs[-count:] if len(logprobs) >= count else [0.0] * (count - len(logprobs)) + logprobs
    return [(lp, 0) for lp in values]


def _choice_text(choice: dict[str, Any]) -> str:
    if "message" in choice:
        return (choice.get("message") or {}).get("content") or ""
    return choice.get("text") or ""


def _openai_params(params: SglSamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in params.wire_sampling().items():
        if name in _OPENAI_NAMES:
            out[_OPENAI_NAMES[name]] = value
        elif name in _PASSED:
            out[name] = value
        else:
            raise BackendError(f"the OpenAI backend cannot pass sampling parameter {name!r}")
    return out


def _meta(envelope: dict[str, Any], choice: dict[str, Any], usage: dict[str, Any]) -> dict[str, Any]:
    details = usage.get("prompt_tokens_details") or {}
    return {"id": envelope.get("id"), "finish_reason": choice.get("finish_reason"),
            "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": details.get("cached_tokens"), "logprobs": choice.get("logprobs")}


def _chatml(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")
