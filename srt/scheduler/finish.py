"""When a request stops: EOS, stop tokens and strings, stop regexes, max_new_tokens, the context."""

from __future__ import annotations

from typing import Any, Sequence

import regex

from ..core.request import FinishReason, Req

# Extra tokens decoded beyond a stop string's length, so a string split across tokens is seen.
_STOP_WINDOW_SLACK = 4
# A stop regex is matched on the output's tail, within a time budget: a user's pattern can
# backtrack exponentially ("(a|aa)+b" on "aaaa..."), and the scheduler loop must not freeze on it.
STOP_REGEX_TAIL_TOKENS = 512
STOP_REGEX_TIMEOUT_S = 0.05


def check_finished(req: Req, eos_ids: Sequence[int], context_len: int, tokenizer: Any) -> FinishReason | None:
    """The reason `req` stops after its newest token, or None to go on."""
    sp = req.sampling_params
    last = req.output_ids[-1]
    num_out = len(req.output_ids)
    if num_out >= sp.min_new_tokens:
        if not sp.ignore_eos and last in eos_ids:
            return FinishReason("stop", matched=last)
        if last in sp.stop_token_ids:
            return FinishReason("stop", matched=last)
        if sp.stop:
            window = max(len(s) for s in sp.stop) + _STOP_WINDOW_SLACK
            tail = tokenizer.decode(req.output_ids[-window:], skip_special_tokens=sp.skip_special_tokens)
            for stop in sp.stop:
                if stop in tail:
                    return FinishReason("stop", matched=stop)
        if sp.stop_regex:
            text = tokenizer.decode(req.output_ids[-STOP_REGEX_TAIL_TOKENS:], skip_special_tokens=sp.skip_special_tokens)
            for pattern in sp.stop_regex:
                try:
                    found = regex.search(pattern, text, timeout=STOP_REGEX_TIMEOUT_S)
                except TimeoutError:
                    return FinishReason("abort", message=f"stop_regex: matching {pattern!r} took longer than "
                                                         f"{STOP_REGEX_TIMEOUT_S * 1000:.0f} ms; simplify the pattern")
                if found:
                    return FinishReason("stop", matched=found.group(0))
    if num_out >= sp.max_new_tokens:
        return FinishReason("length")
    if req.seq_len >= context_len:
        return FinishReason("length", message="reached the context length")
    return None
