"""Suffix drafts for speculative decoding (after SuffixDecoding, NeurIPS 2025): the likeliest
continuation of the request's tail, matched against its own prompt and output and against the
recent finished outputs of every request in its radix namespace. Agents repeat themselves (the
same tool-call JSON, plans that quote earlier outputs), so what followed the same context
before is a good draft; counting what followed it across outputs says how good.

Matching runs on numpy arrays, not a pointer-based suffix tree: a namespace's outputs are one
int32 array with -1 between them, and the longest suffix of the request's tail (at most
`max_depth` tokens) that occurred before is found by filtering the positions that follow the
newest token, one earlier token at a time (or all remaining ones in one gather once few
candidates are left). Those positions are the suffix tree's node at the match; the draft walks
down from it, each step taking the most frequent next token (ties: the most recent) while the
product of the chosen tokens' frequencies stays at least `min_token_prob`, and for at most
`max_spec_factor` x the match length tokens: longer matches earn longer drafts. As in
SuffixDecoding, the request's own tokens and the stored outputs are two trees, each drafts,
and the draft with more expected accepted tokens (the sum of its prefixes' probabilities) wins:
merging them let a longer match on a shared template (another trip's tool call) outvote the
request's own text, which a copying reply follows (docs/speculative.md has the figures).

Memory: the store keeps at most `max_tokens` tokens over all namespaces (each output after the
last `max_depth` tokens of its prompt; 4 bytes a token, plus a separator per output); adding
an output evicts the oldest outputs, of any namespace, until it fits. A namespace's text is
never matched for another's request, so tenants with different cache salts (or LoRA adapters)
never draft each other's text. No torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence

import numpy as np

_SEP = -1  # between outputs: no match spans two, and an output's end counts as a continuation
_SEP_ARRAY = np.array([_SEP], dtype=np.int32)
# Occurrences of the match counted at most (the newest), so a draft costs the same however
# often a common context was stored.
MAX_CANDIDATES = 256
# Below this many candidate-tokens left to compare, the rest of the match is one gather.
_GATHER_ELEMENTS = 4096


def longest_match(buf: np.ndarray, stop: int, tail: np.ndarray, max_depth: int) -> tuple[np.ndarray, int]:
    """(positions, length): the positions p < stop of `buf` whose preceding `length` tokens are
    the last `length` tokens of `tail`, for the longest length <= max_depth that occurs at all;
    (empty, 0) when the newest token never occurred before `stop`."""
    depth_max = min(max_depth, tail.shape[0])
    pos = np.flatnonzero(buf[:stop - 1] == tail[-1]) + 1
    depth = 1
    while pos.size and depth < depth_max:
        if pos.size * (depth_max - depth) <= _GATHER_ELEMENTS:
            back = np.arange(depth, depth_max)
            idx = pos[:, None] - 1 - back  # buf[idx[i, k]] must equal tail[-1 - back[k]]
            same = (idx >= 0) & (buf[np.maximum(idx, 0)] == tail[-1 - back])
            lengths = depth + np.cumprod(same, axis=1).sum(axis=1)
            longest = int(lengths.max())
            return pos[lengths == longest], longest
        reach = pos[pos > depth]  # an occurrence cannot begin before the buffer does
        narrowed = reach[buf[reach - 1 - depth] == tail[-1 - depth]]
        if not narrowed.size:
            break
        pos, depth = narrowed, depth + 1
    return pos, depth if pos.size else 0


def walk(buf: np.ndarray, positions: np.ndarray, num_drafts: int, min_token_prob: float) -> tuple[list[int], float]:
    """(draft, score): the draft continuing `positions` of `buf`, the most frequent next token
    each step (ties: the newest occurrence), while the estimated probability of the whole draft
    stays >= min_token_prob; the score sums those probabilities, the draft's expected accepted
    length. An output's end (-1) counts against a token's frequency; the end of the request's
    own tokens does not (unknown)."""
    draft: list[int] = []
    prob, score = 1.0, 0.0
    while len(draft) < num_drafts:
        positions = positions[positions < buf.shape[0]]
        if not positions.size:  # every occurrence is at the end of the request's tokens
            break
        if positions.size == 1:  # one occurrence left: the rest is what followed it, up to its end
            rest = buf[positions[0]:positions[0] + num_drafts - len(draft)]
            ends = np.flatnonzero(rest == _SEP)
            rest = rest[:ends[0]] if ends.size else rest
            draft += rest.tolist()
            return draft, score + prob * rest.size
        following = buf[positions]
        if following[0] != _SEP and (following == following[0]).all():  # one continuation: probability kept
            token = int(following[0])
            score += prob
            draft.append(token)
            positions = positions + 1
            continue
        tokens = following[following != _SEP]
        if not tokens.size:
            break
        _, inverse, counts = np.unique(tokens, return_inverse=True, return_counts=True)
        best = counts.max()
        prob *= best / following.size
        if prob < min_token_prob:
            break
        score += prob
        token = int(tokens[np.flatnonzero(counts[inverse] == best)[-1]])
        draft.append(token)
        positions = positions[following == token] + 1
    return draft, score


class SuffixStore:
    """Recent finished outputs per namespace, and the drafts they suggest (module doc)."""

    def __init__(self, max_tokens: int, max_depth: int = 24, max_spec_factor: float = 8.0,
                 min_token_prob: float = 0.1):
        self.max_tokens = max_tokens
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.tokens = 0  # tokens kept, over all namespaces
        self._texts: dict[Hashable, np.ndarray] = {}  # -1, text, -1, text, ..., -1
        self._order: deque[tuple[Hashable, int]] = deque()  # (namespace, length), oldest first

    def add(self, namespace: Hashable, output: list[int], prompt: Sequence[int] = ()) -> None:
        """Keeps a finished request's output after the last `max_depth` tokens of its prompt (so
        that the first tokens of a request ending alike match, not only its later ones),
        evicting the oldest outputs to stay in bound (one longer than the bound is not kept)."""
        if not output:
            return
        text = list(prompt[-self.max_depth:]) + list(output)
        if len(text) > self.max_tokens:
            return
        while self.tokens + len(text) > self.max_tokens:
            oldest, length = self._order.popleft()
            self.tokens -= length
            rest = self._texts[oldest][length + 1:]
            if rest.shape[0] > 1:
                self._texts[oldest] = rest.copy()  # a view would keep the evicted tokens alive
            else:
                del self._texts[oldest]
        head = self._texts.get(namespace, _SEP_ARRAY)
        self._texts[namespace] = np.concatenate([head, np.array(text, dtype=np.int32), _SEP_ARRAY])
        self._order.append((namespace, len(text)))
        self.tokens += len(text)

    def clear(self) -> None:
        """Forgets every output (benchmarks start each run from an empty store)."""
        self.tokens = 0
        self._texts.clear()
        self._order.clear()

    def propose(self, namespace: Hashable, tokens: np.ndarray, num_drafts: int) -> list[int]:
        """Up to `num_drafts` tokens continuing `tokens` (the request's prompt and output): the
        longest suffix match over its own earlier tokens and the one over its namespace's
        outputs are each walked by frequency, and the draft with the higher score (expected
        accepted length) wins, the longer match on a tie. [] when nothing matches."""
        n = tokens.shape[0]
        if num_drafts <= 0 or n < 2:
            return []
        tail = tokens[max(0, n - self.max_depth):]
        sources = [(tokens, *longest_match(tokens, n, tail, self.max_depth))]
        text = self._texts.get(namespace)
        if text is not None:
            sources.append((text, *longest_match(text, text.shape[0], tail, self.max_depth)))
        best, best_key = [], (0.0, 0)
        for buf, pos, length in sources:
            if length:
                limit = min(num_drafts, int(self.max_spec_factor * length))
                draft, score = walk(buf, pos[-MAX_CANDIDATES:], limit, self.min_token_prob)
                if (score, length) > best_key:
                    best, best_key = draft, (score, length)
        return best
