"""Incremental detokenization with stop-string detection."""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing token list into text without re-decoding everything each step.

    Byte-level BPE tokens can end mid-character, so text is only committed once the decoded tail
    no longer ends in a replacement character; a small window of tokens is re-decoded each step.
    """

    def __init__(self, tokenizer: Decoder, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # ids[:prefix_offset] are fully reflected in text
        self._read_offset = 0
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that cut the text (the last to cut it)

    def append(self, token_id: int, stop: list[str]) -> bool:
        """Add a token; True if a stop string now appears (``text`` is cut before it)."""
        if self.stopped:
            return True
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self._prefix_offset:self._read_offset])
        full = self.tokenizer.decode(self.ids[self._prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return False  # incomplete UTF-8 sequence, or a token that adds no visible text yet
        new_text = full[len(prefix):]
        search_from = max(0, len(self.text) - max((len(s) for s in stop), default=0))
        self.text += new_text
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        for s in stop:
            idx = self.text.find(s, search_from)
            if idx != -1:
                self.text = self.text[:idx]
                self.stopped = True
                self.stop_string = s
        return self.stopped

    def flush(self) -> None:
        """At the end, keep text still held back (an incomplete UTF-8 tail), unless a stop string cut it."""
        if self.stopped:
            return
        prefix = self.tokenizer.decode(self.ids[self._prefix_offset:self._read_offset])
        full = self.tokenizer.decode(self.ids[self._prefix_offset:])
        if len(full) > len(prefix):
            self.text += full[len(prefix):]
            self._prefix_offset = self._read_offset = len(self.ids)
