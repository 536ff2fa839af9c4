"""N-gram drafts for speculative decoding (prompt lookup): the tokens that followed the latest
earlier occurrence of the sequence's own tail. No model: strong wherever the output repeats
its input (extraction, quoting summaries, code edits, rephrasing), free where it does not.
"""

from __future__ import annotations


def propose_ngram(tokens: list[int], num_drafts: int, max_match: int = 4, min_match: int = 1,
                  window: int = 4096) -> list[int]:
    """Up to `num_drafts` tokens continuing `tokens`: the longest suffix of length
    max_match..min_match that occurred before (within the last `window` tokens) is matched at its
    latest earlier occurrence, and what followed it is the draft. [] when nothing matches."""
    if num_drafts <= 0 or len(tokens) < min_match + 1:
        return []
    start = max(0, len(tokens) - window)
    for size in range(min(max_match, len(tokens) - 1), min_match - 1, -1):
        suffix = tokens[-size:]
        first = suffix[0]
        # Scan backwards for the latest earlier occurrence that has a token after it.
        pos = len(tokens) - size - 1
        while pos >= start:
            if tokens[pos] == first and tokens[pos:pos + size] == suffix:
                follow = tokens[pos + size:pos + size + num_drafts]
                if follow:
                    return follow
            pos -= 1
    return []
