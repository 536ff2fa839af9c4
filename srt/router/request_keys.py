"""The routing key of a request: a string whose prefixes stand for the prompt prefixes a worker
caches. Text prompts are keyed by their text, token-id prompts by one character per id, chats
and Responses inputs by a canonical rendering of their messages in order (a shared system
prompt and earlier turns give a shared prefix). Each kind has its own namespace, and so does
each `cache_salt` and each LoRA adapter (native `lora_path`, or the OpenAI `model` naming one):
the workers never share prefixes across salts or adapters either. Only the first
MAX_KEY_CHARS characters count: enough to tell prompts apart, bounded work per request."""

from __future__ import annotations

import json
from typing import Any

MAX_KEY_CHARS = 100_000


def _namespace(kind: str, body: dict[str, Any]) -> str:
    salt, adapter = body.get("cache_salt"), _first(body.get("lora_path", body.get("model")))
    return f"{kind}{salt if isinstance(salt, str) else ''}\x00{adapter if isinstance(adapter, str) else ''}\x00"


def _ids_key(ids: Any) -> str | None:
    if isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        return "".join(chr(i % 0x110000) for i in ids[:MAX_KEY_CHARS])
    return None


def _first(value: Any) -> Any:
    """A batch is routed whole, by its first prompt."""
    return value[0] if isinstance(value, list) and value and isinstance(value[0], (str, list)) else value


def _bounded(kind: str, body: dict[str, Any], content: str | None) -> str | None:
    if not content:
        return None
    return (_namespace(kind, body) + content)[:MAX_KEY_CHARS]


def generate_key(body: Any) -> str | None:
    """Native /generate: `text` or `input_ids`, single or batched."""
    if not isinstance(body, dict):
        return None
    text = _first(body.get("text"))
    if isinstance(text, str):
        return _bounded("t", body, text)
    return _bounded("i", body, _ids_key(_first(body.get("input_ids"))))


def completion_key(body: Any) -> str | None:
    """/v1/completions: `prompt` as text or token ids (the same namespaces as /generate: the
    worker caches them alike)."""
    if not isinstance(body, dict):
        return None
    prompt = _first(body.get("prompt"))
    if isinstance(prompt, str):
        return _bounded("t", body, prompt)
    return _bounded("i", body, _ids_key(prompt))


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # parts: {"type": "text", "text": ...} and others
        return "".join(p.get("text", "") if isinstance(p, dict) and isinstance(p.get("text"), str)
                       else json.dumps(p, sort_keys=True) for p in content)
    return "" if content is None else json.dumps(content, sort_keys=True)


def _render_message(message: Any) -> str:
    if not isinstance(message, dict):
        return json.dumps(message, sort_keys=True)
    role = message.get("role", message.get("type", ""))
    extra = {k: v for k, v in message.items() if k not in ("role", "content")}
    text = f"<{role}>{_content_text(message.get('content'))}"
    return text + (json.dumps(extra, sort_keys=True) if extra else "") + "\n"


def _tools_header(body: dict[str, Any]) -> str:
    # The worker renders tools into the system message: they are part of the shared prefix.
    tools = body.get("tools")
    return f"<tools>{json.dumps(tools, sort_keys=True)}\n" if tools else ""


def chat_key(body: Any) -> str | None:
    """/v1/chat/completions: the messages rendered one after another."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return None
    return _bounded("c", body, _tools_header(body) + "".join(map(_render_message, body["messages"])))


def responses_key(body: Any) -> str | None:
    """/v1/responses: `instructions` as a system message, then the input (text or items)."""
    if not isinstance(body, dict):
        return None
    items = body.get("input")
    messages = [{"role": "user", "content": items}] if isinstance(items, str) else items
    if not isinstance(messages, list):
        return None
    if isinstance(body.get("instructions"), str):
        messages = [{"role": "system", "content": body["instructions"]}, *messages]
    return _bounded("c", body, _tools_header(body) + "".join(map(_render_message, messages)))
