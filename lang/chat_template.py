"""Role text (`system/user/assistant`) rendered from the model's own chat template.

The goal: at every `gen` inside an assistant turn, the program's text is exactly
`apply_chat_template(messages, add_generation_prompt=True)` for the messages so far — the
same text, hence the same tokens, that /v1/chat/completions renders — and each turn only
appends to the text, so the radix cache keeps every earlier turn.

Rather than hard-coding per-family strings, each role's text is cut out of renderings of the
real template (ChatML, Llama-3, Qwen, Mistral, ... all work the same way):
- a role's opening text is what a message with a sentinel content adds to the rendering of
  the messages before it, up to the sentinel (for `assistant`: the generation prompt);
- a role's closing text is what the full message's rendering adds after the content.
Templates that add default text (SmolLM2's default system message when the first message is
not a system one) are matched automatically. If a template rewrites a message's content
(e.g. trims it), the turn's text is replaced by the template's rendering when the turn ends.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

logger = logging.getLogger(__name__)

Render = Callable[[list[dict[str, Any]], bool], str]  # (messages, add_generation_prompt) -> text
_SENTINEL = "\u2063radixlm-role-content\u2063"  # invisible separator: never in real content


class ChatRenderer:
    """Cuts role text out of a chat template's renderings. Stateless; thread-safe."""

    def __init__(self, render: Render, name: str = "chat template"):
        self._render = render
        self.name = name

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        if not messages and not add_generation_prompt:
            return ""
        try:
            return self._render(messages, add_generation_prompt)
        except Exception as e:  # templates raise assorted types for role-order violations
            roles = [m["role"] for m in messages]
            raise ValueError(f"the {self.name} rejected the roles {roles}: {e}") from None

    def begin(self, messages: list[dict[str, Any]], role: str, fields: dict[str, Any] | None = None) -> str:
        """Text that opens a `role` turn after `messages` (complete turns); `fields`: the
        message's other keys (a tool result's tool_call_id)."""
        base = self.render(messages)
        if role == "assistant" and messages:
            with_prompt = self.render(messages, add_generation_prompt=True)
            if with_prompt.startswith(base):
                return with_prompt[len(base):]
        full = self.render([*messages, {"role": role, "content": _SENTINEL, **(fields or {})}])
        if not full.startswith(base) or _SENTINEL not in full[len(base):]:
            _warn_unstable(self.name, role)
            return full.split(_SENTINEL, 1)[0][len(_common_prefix(base, full)):]
        return full[len(base):].split(_SENTINEL, 1)[0]

    def end(self, messages: list[dict[str, Any]], message: dict[str, Any], turn_text: str) -> tuple[str, str]:
        """Closes a turn with `message`. `turn_text` is the text since the turn began (its
        opening text plus the content). Returns (text to keep in place of turn_text, text to
        append): normally (turn_text, closing text); when the template renders the turn
        differently (or the message is not the text, as a turn that called tools), the
        template's own rendering replaces it."""
        base = self.render(messages)
        full = self.render([*messages, message])
        if not full.startswith(base):
            _warn_unstable(self.name, message["role"])
            return turn_text, ""
        rendered = full[len(base):]
        if rendered.startswith(turn_text):
            return turn_text, rendered[len(turn_text):]
        return "", rendered


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


_warned: set[str] = set()


def _warn_unstable(name: str, role: str) -> None:
    if name not in _warned:
        _warned.add(name)
        logger.warning("the %s renders earlier turns differently once a %s message follows; the program's "
                       "text will not match /v1/chat/completions for later turns", name, role)
