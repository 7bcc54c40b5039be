"""Incremental detokenization and stop-string detection for one sequence.

Text is emitted only once it is final: a token that ends inside a multi-byte UTF-8
character decodes to U+FFFD and is held back until the next token completes it, and a
text suffix that could still grow into a stop string is held back until it cannot.
"""

from __future__ import annotations

from hub.tokenizer import Tokenizer

# Tokens decoded before the first new one, so leading-space merges render as in full decoding.
_CONTEXT_TOKENS = 5


class StopStringDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: tuple[str, ...]):
        self._tok = tokenizer
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = stop
        self.text = ""  # all final text so far (truncated at a stop string)
        self._emitted = 0
        self.stopped = False

    def add_tokens(self, ids: list[int]) -> str:
        """Feed new token ids; returns the newly final text (possibly empty)."""
        for token in ids:
            if self.stopped:
                break
            self._ids.append(token)
            self._decode_step()
        return self._flush()

    def finish(self) -> str:
        """Release held-back text at the end of generation."""
        tail = self.text[self._emitted:]
        self._emitted = len(self.text)
        return tail

    def _decode_step(self) -> None:
        before = self._tok.decode(self._ids[self._prefix_offset:self._read_offset])
        after = self._tok.decode(self._ids[self._prefix_offset:])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return  # an incomplete UTF-8 character, or a token that renders as nothing yet
        search_from = max(0, len(self.text) - max((len(s) for s in self._stop), default=0))
        self.text += after[len(before):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._check_stop(search_from)

    def _check_stop(self, search_from: int) -> None:
        hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _flush(self) -> str:
        limit = len(self.text) if self.stopped else len(self.text) - self._held_back()
        out = self.text[self._emitted:limit] if limit > self._emitted else ""
        self._emitted = max(self._emitted, limit)
        return out

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest
