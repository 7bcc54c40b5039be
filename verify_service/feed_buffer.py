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
        self._feeds: dict[int, DraftFeed] = {}
        self.rows = 0

    def add(self, feeds: list[DraftFeed]) -> list[DraftFeed]:
        """Buffer ``feeds``; returns what must be sent first, without them, when together they would
        exceed ``max_rows`` (one step's feeds alone never do)."""
        new = sum(len(f.next_tokens) for f in feeds)
        flush = self.take() if self._feeds and self.rows + new > self.max_rows else []
        for f in feeds:
            old = self._feeds.get(f.seq_id)
            self._feeds[f.seq_id] = f if old is None else _merge(old, f)
        self.rows += new
        return flush

    def take(self) -> list[DraftFeed]:
        """Everything buffered, emptied."""
        feeds, self._feeds, self.rows = list(self._feeds.values()), {}, 0
        return feeds

    def drop(self, seq_id: int) -> None:
        """A finished or cancelled sequence: its rows are never sent."""
        f = self._feeds.pop(seq_id, None)
        if f is not None:
            self.rows -= len(f.next_tokens)


def _merge(a: DraftFeed, b: DraftFeed) -> DraftFeed:
    """Rows of ``a`` then ``b``, which starts where ``a`` ends."""
    assert b.start == a.start + len(a.next_tokens), f"sequence {a.seq_id}: rows must arrive in order"
    return DraftFeed(a.seq_id, a.start, torch.cat([a.features, b.features]),
                     np.concatenate([a.next_tokens, b.next_tokens]))
