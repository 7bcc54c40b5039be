"""Committed rows the draft has not been sent yet.

With a fixed tree the draft is called every step and the buffer is emptied at once. When adaptive
speculation decodes plainly, asking the draft for nothing, its rows wait here, merged per sequence,
and go with the next request for trees (or when the buffer fills): a plain step then costs no draft
round trip, and the draft still receives every committed row, in order, before proposing.
"""

from __future__ import annotations

import numpy as np
import torch

from link.protocol import DraftFeed


class FeedBuffer:
    def __init__(self, max_rows: int):
        """``max_rows``: the most rows one draft call may carry (the link's features buffer)."""
        self.max_rows = max_rows
        self._feeds: dict[int, list[DraftFeed]] = {}  # per sequence, in row order: merged when taken
        self.rows = 0

    def add(self, feeds: list[DraftFeed]) -> list[DraftFeed]:
        """Buffer ``feeds``; returns what must be sent first, without them, when together they would
        exceed ``max_rows`` (one step's feeds alone never do)."""
        new = sum(len(f.next_tokens) for f in feeds)
        flush = self.take() if self._feeds and self.rows + new > self.max_rows else []
        for f in feeds:
            parts = self._feeds.setdefault(f.seq_id, [])
            if parts:
                last = parts[-1]
                assert f.start == last.start + len(last.next_tokens), f"sequence {f.seq_id}: rows must arrive in order"
            parts.append(f)
        self.rows += new
        return flush

    def take(self) -> list[DraftFeed]:
        """Everything buffered, one feed per sequence, emptied."""
        feeds = [_merge(parts) for parts in self._feeds.values()]
        self._feeds, self.rows = {}, 0
        return feeds

    def drop(self, seq_id: int) -> None:
        """A finished or cancelled sequence: its rows are never sent."""
        for f in self._feeds.pop(seq_id, ()):
            self.rows -= len(f.next_tokens)


def _merge(parts: list[DraftFeed]) -> DraftFeed:
    """One sequence's buffered feeds as one (consecutive rows): one copy, however many steps waited."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    return DraftFeed(first.seq_id, first.start, torch.cat([f.features for f in parts]),
                     np.concatenate([f.next_tokens for f in parts]))
