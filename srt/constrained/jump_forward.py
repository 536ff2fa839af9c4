"""Jump-forward decoding: where the grammar admits exactly one continuation (a JSON key, a
separator, a fixed literal), append its tokens at once instead of one decode step each.

Token boundaries need care. The forced text may merge with the token just sampled (`{"` then
`name` may tokenize as `{"name`), so that token, which has no KV yet, is taken back, its text
joined with the forced text, and the whole retokenized the way the model's tokenizer would.
And the forced text's last token may be the start of a longer one (`": ` then the model's
` 42`): forcing it would push the model off its own tokenization, so it is left to the model.
The matcher checks every new token before any is kept.
"""

from __future__ import annotations

from typing import Any

from .backend import GrammarMatcher


class JumpForward:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        # Token strings that are a strict prefix of another token.
        prefixes = {tok[:i] for tok in vocab for i in range(1, len(tok))}
        self._extendable = {tid for tok, tid in vocab.items() if tok in prefixes}

    def __call__(self, output_ids: list[int], matcher: GrammarMatcher, room: int) -> list[int] | None:
        """The tokens that replace `output_ids[-1]` (already accepted by `matcher`) so as to
        include the grammar's forced continuation, accepted by the matcher; None, with the
        matcher unchanged, when there is nothing to jump or it does not fit `room` more tokens."""
        forced = matcher.jump_forward_string()
        if not forced:
            return None
        last_text = self.tokenizer.decode(output_ids[-1:], skip_special_tokens=False)
        if "\ufffd" in last_text:  # a token holding part of a UTF-8 character: leave it alone
            return None
        new_ids = self.tokenizer.encode(last_text + forced, add_special_tokens=False)
        if self.tokenizer.decode(new_ids, skip_special_tokens=False) != last_text + forced:
            return None
        if len(new_ids) > 1 and new_ids[-1] in self._extendable:
            new_ids = new_ids[:-1]
        new_ids = new_ids[:room + 1]
        if len(new_ids) <= 1:
            return None
        matcher.rollback(1)
        for accepted, token in enumerate(new_ids):
            if not matcher.accept_token(token):
                # The grammar does not admit this split token by token: restore, decode normally.
                matcher.rollback(accepted)
                matcher.accept_token(output_ids[-1])
                return None
        return new_ids
