"""Reasoning output (`--reasoning-parser qwen3|deepseek-r1`): the `<think>` section of a
model's answer comes back as `reasoning_content`, the rest as `content`.

Where the prompt already opened the think block (DeepSeek-R1's template always does; Qwen3's
does when asked), the output starts inside it and carries only the closing tag. DeepSeek-R1
reasons first by design, so an output that never closes the block is all reasoning; for Qwen3
an output without a think block is all content.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek-r1")


@dataclass(frozen=True)
class Split:
    reasoning: str | None
    content: str | None


def check_parser(name: str) -> str:
    if name not in PARSERS:
        raise ValueError(f"reasoning_parser: unknown parser {name!r} (one of {', '.join(PARSERS)})")
    return name


def prompt_opens_think(prompt: str) -> bool:
    """Whether the rendered prompt ends inside an open think block."""
    tail = prompt.rstrip()
    return tail.endswith(OPEN)


def split_reasoning(parser: str, text: str, opened: bool) -> Split:
    """Splits a complete output. `opened`: the prompt ended inside a think block."""
    body = text
    inside = opened or parser == "deepseek-r1"
    stripped = body.lstrip()
    if stripped.startswith(OPEN):
        body, inside = stripped[len(OPEN):], True
    if not inside:
        return Split(None, text or None)
    reasoning, _, content = body.partition(CLOSE)
    return Split(reasoning.strip() or None, content.lstrip() or None)


class StreamingReasoning:
    """Splits streamed text: reasoning deltas until the think block closes, then content."""

    def __init__(self, parser: str, opened: bool):
        self.parser = parser
        self.state = "undecided" if not (opened or parser == "deepseek-r1") else "reasoning"
        self.buffer = ""  # held text that may be the start of a tag

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta)."""
        self.buffer += delta
        reasoning = content = ""
        if self.state == "undecided":
            stripped = self.buffer.lstrip()
            if stripped.startswith(OPEN):
                self.state, self.buffer = "reasoning", stripped[len(OPEN):]
            elif OPEN.startswith(stripped):
                return "", ""  # may still become <think>
            else:
                self.state = "content"
        if self.state == "reasoning":
            before, closed, after = self.buffer.partition(CLOSE)
            if closed:
                reasoning, self.state, self.buffer = before, "content", after.lstrip()
            else:
                keep = _partial_suffix(self.buffer, CLOSE)
                reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return reasoning, ""
        if self.state == "content":
            content, self.buffer = self.buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Whatever was held back at the end."""
        rest, self.buffer = self.buffer, ""
        if self.state == "reasoning":
            return rest, ""
        return "", rest


def _partial_suffix(text: str, tag: str) -> int:
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
