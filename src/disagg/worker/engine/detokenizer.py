"""Streaming detokenization: generated ids in, text deltas out.

Decoding token by token breaks characters that span tokens (a byte-level BPE splits an emoji
over several tokens) and loses leading spaces some tokenizers only render in context. So each
step decodes a short window of recent tokens twice, with and without the new ones, and emits
the difference, holding it back while it ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from disagg.worker.engine.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# How many prompt tokens give the first generated token its context.
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)
        self.num_prompt_ids = len(self.ids)
        # ids[prefix_offset:read_offset] is already emitted and only serves as context.
        self.prefix_offset = max(len(self.ids) - _PROMPT_CONTEXT, 0)
        self.read_offset = len(self.ids)
        self.text = ""  # everything emitted so far

    @property
    def generated_ids(self) -> list[int]:
        return self.ids[self.num_prompt_ids :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int] | int) -> str:
        """Append newly generated id(s); return the text they complete (possibly "")."""
        self.ids.extend([new_ids] if isinstance(new_ids, int) else new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation: whatever is held back (an incomplete character decodes
        to U+FFFD, as a full decode would show it)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        delta = full[len(prefix) :]
        self.text += delta
        return delta
