"""Incremental detokenization: text deltas that never split a UTF-8 character.

Byte-level BPE tokens can end inside a multi-byte character; decoding such a prefix yields
U+FFFD. As vLLM does, keep a short window (prefix_offset..read_offset) of already-emitted tokens
for context, decode window + new tokens, and emit only the new suffix once it does not end in
U+FFFD. Cost per token is O(window), not O(text).
"""

from __future__ import annotations

from collections.abc import Callable


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str], context_tokens: int = 6):
        self._decode = decode  # ids -> text, special tokens kept, no clean-up of spaces
        self.context_tokens = context_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the context window
        self.read_offset = 0  # tokens before this are emitted

    def add(self, token_id: int, last: bool = False) -> str:
        """Append one token; return the text that is now final ('' while a character is split)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") and not last:
            return ""
        delta = full[len(prefix):]
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - self.context_tokens, 0)
        return delta
