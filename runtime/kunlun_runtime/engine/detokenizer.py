"""Incremental detokenization that never emits half a UTF-8 character.

Byte-level BPE tokens can split one multi-byte character across tokens; decoding a lone piece
yields U+FFFD. Text is released only once the decoded window no longer ends in U+FFFD, and each
step decodes a short window (a few tokens of context) rather than the whole output again.
"""

from __future__ import annotations

from kunlun_runtime.models.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        self._ids.append(token_id)
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = self._tokenizer.decode(self._ids[self._prefix_offset :], self._skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end, release whatever is held back (even an incomplete character)."""
        full = self._tokenizer.decode(self._ids[self._prefix_offset :], self._skip)
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta
