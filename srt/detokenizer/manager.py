"""The detokenizer process's work: token-id deltas from the scheduler in, text deltas to the
tokenizer manager out. Other messages (control replies) pass through unchanged. One
`IncrementalDetokenizer` per running request, dropped when its finish arrives, so state never
outlives a request. The process itself is started by srt/entrypoints/detokenizer.py."""

from __future__ import annotations

import logging
from typing import Any

from ..io_struct import BatchTextOut, BatchTokenOut, ReqOutput, ReqTextOutput
from .incremental import IncrementalDetokenizer

logger = logging.getLogger(__name__)


class DetokenizerManager:
    """Turns scheduler messages into tokenizer-manager messages; holds per-request state."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, IncrementalDetokenizer] = {}

    def handle(self, msg: Any) -> Any:
        if not isinstance(msg, BatchTokenOut):
            return msg
        return BatchTextOut(outputs=[ReqTextOutput(out.rid, self._text_delta(out), out) for out in msg.outputs])

    def _text_delta(self, out: ReqOutput) -> str:
        try:
            state = self.states.get(out.rid)
            if state is None:
                state = IncrementalDetokenizer(
                    self.tokenizer,
                    skip_special_tokens=out.skip_special_tokens,
                    spaces_between_special_tokens=out.spaces_between_special_tokens,
                    stop=out.stop,
                    stop_regex=out.stop_regex,
                    no_stop_trim=out.no_stop_trim,
                )
                self.states[out.rid] = state
            text = state.feed(out.new_token_ids)
            if out.finish_reason is not None:
                del self.states[out.rid]
                text += state.finish(out.finish_reason)
            return text
        except Exception:
            # One bad request fails alone: its ids still reach the tokenizer manager, text lost.
            logger.exception("detokenizing request %s failed", out.rid)
            self.states.pop(out.rid, None)
            return ""
