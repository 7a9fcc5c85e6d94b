"""Reply text from generated token ids, streamed piece by piece.

The transcript keeps exactly ``tokenizer.decode(tokens)`` of the generated
tokens, so that rendering it again gives back (as nearly as the tokenizer
allows) the tokens that are in the cache. mlx-lm's streaming detokenizers do
not promise that: the BPE and SPM ones drop the first token's leading space,
and ``last_segment`` hands out each piece only once. This decoder yields the
new text as it becomes stable and the pieces add up to the decoded reply.

It decodes a small window of recent tokens (vLLM's incremental
detokenization): the text of ``tokens[prefix:]`` minus the text of
``tokens[prefix:read]``. The window gives SentencePiece its context, so a
word's leading space is kept, and the work per token stays constant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

REPLACEMENT = "\ufffd"


class ReplyText:
    """Feed generated tokens with :meth:`add`; each call returns the newly stable text."""

    def __init__(self, tokenizer: TokenizerWrapper) -> None:
        self._tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""
        self._prefix = 0  # the window starts here
        self._read = 0  # tokens before this are in ``text``

    def _decode(self, tokens: list[int]) -> str:
        return self._tokenizer.decode(tokens) if tokens else ""

    def _pending(self) -> str:
        """Text of the tokens not yet in ``text`` (decoded in the window's context)."""
        window = self.tokens[self._prefix :]
        before = self._decode(self.tokens[self._prefix : self._read])
        return self._decode(window)[len(before) :]

    def add(self, token: int) -> str:
        """Add one token; return the text that is now complete ('' while a character
        is still missing bytes that a later token may bring)."""
        self.tokens.append(token)
        new = self._pending()
        if not new or new.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self.tokens)
        self.text += new
        return new

    def finish(self) -> str:
        """The reply is over: return what is left, without a trailing incomplete character."""
        new = self._pending().rstrip(REPLACEMENT)
        self._prefix = self._read = len(self.tokens)
        self.text += new
        return new
