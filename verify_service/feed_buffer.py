"""Committed rows the draft has not been sent yet.

With a fixed tree the draft is called every step and the buffer is emptied at once. When adaptive
speculation decodes plainly, asking the draft for nothing, its rows wait here and go with the next
request for trees (or when the buffer fills): a plain step then costs no draft round trip, the rows
of a sequence that finishes before its next tree are never sent at all, and the draft still
receives every committed row, in order, before proposing. The buffer holds up to ``capacity`` rows
(a GPU memory bound, many steps' worth); ``split`` cuts what it releases into draft calls of at most
``max_rows`` (what one call, or the services' shared features buffer, carries).

Rows arrive a step at a time as ``FeedRows`` (a step's plain decodes: one record for the whole
batch, no per-sequence work) or as one sequence's ``DraftFeed`` (prefill chunks); they are merged
per sequence only when taken.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from link.protocol import DraftFeed
from kernels.host_copy import take_rows, to_device


@dataclass(frozen=True, slots=True)
class FeedRows:
    """Committed rows of any sequences: row j is position ``starts[j]`` of sequence ``seq_ids[j]``,
    its captured features and the token after it. The ids, positions and tokens are int64 arrays or
    lists of ints (a step's plain decodes: the lists the engine's commit loop filled, converted only
    when the rows are taken)."""

    seq_ids: np.ndarray | list[int]  # [n]
    starts: np.ndarray | list[int]  # [n]
    features: torch.Tensor  # [n, k * target_hidden]
    next_tokens: np.ndarray | list[int]  # [n]

    @staticmethod
    def of(feed: DraftFeed) -> FeedRows:
        n = len(feed.next_tokens)
        return FeedRows(np.full(n, feed.seq_id, dtype=np.int64), np.arange(feed.start, feed.start + n),
                        feed.features, np.asarray(feed.next_tokens, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.seq_ids)


class StepRows:
    """A step's plain rows for the draft, gathered while the engine advances and commits its sequences:
    prefill chunks (``add``: a chunk's positions and the tokens after them) and one-token decodes
    (``add_one``), one ``FeedRows`` for all (``build``). A step of decodes alone keeps the lists as
    the commit loop fills them (no per-row work beyond an append); a step with prompt chunks builds
    arrays once (a record per chunk cost a prefill step at batch 64 ~1 ms of host time)."""

    __slots__ = ("ones", "chunked")

    def __init__(self):
        # (chunk, seq_id, start, token after it) of each one-token decode: the commit loop appends to
        # ``ones`` itself (a tuple a row, the whole per-row cost at batch 128)
        self.ones: list[tuple[int, int, int, int]] = []
        self.chunked: list[tuple[int, int, int, list[int]]] = []  # (chunk, seq_id, start, tokens after each row)

    def add_one(self, chunk: int, seq_id: int, start: int, token: int) -> None:
        self.ones.append((chunk, seq_id, start, token))

    def add(self, chunk: int, seq_id: int, start: int, next_tokens: list[int]) -> None:
        """Positions start .. start + len(next_tokens) - 1 of chunk ``chunk``."""
        self.chunked.append((chunk, seq_id, start, next_tokens))

    def __len__(self) -> int:
        return len(self.ones) + sum(len(t) for *_, t in self.chunked)

    def build(self, captured: torch.Tensor, query_start_loc: list[int]) -> FeedRows | None:
        """The rows with their features, taken from the step's ``captured`` [T, k * hidden]."""
        qsl = query_start_loc
        if not self.chunked:
            if not self.ones:
                return None
            chunks, seq_ids, starts, tokens = map(list, zip(*self.ones))
            rows = chunks if qsl[-1] == len(qsl) - 1 else [qsl[i] for i in chunks]  # (a decode step: row i is chunk i)
            # (rows skip a sequence this step finished: a gather, its index never a pageable copy, which
            # would wait for the step launched ahead)
            return FeedRows(seq_ids, starts, take_rows(captured, rows, increasing=True), tokens)
        entries = sorted(self.chunked + [(c, s, p, [t]) for c, s, p, t in self.ones])  # by chunk
        counts = np.fromiter((len(t) for *_, t in entries), dtype=np.int64, count=len(entries))
        firsts = np.fromiter((qsl[c] for c, *_ in entries), dtype=np.int64, count=len(entries))
        starts = np.fromiter((p for _, _, p, _ in entries), dtype=np.int64, count=len(entries))
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        rows = np.repeat(firsts, counts) + within  # increasing: the chunks' rows follow each other
        seq_ids = np.repeat(np.fromiter((s for _, s, _, _ in entries), dtype=np.int64, count=len(entries)), counts)
        tokens = np.fromiter(chain.from_iterable([ts for *_, ts in entries]), dtype=np.int64, count=len(rows))
        return FeedRows(seq_ids, np.repeat(starts, counts) + within, take_rows(captured, rows, increasing=True), tokens)


FEED_BUFFER_BYTES = 256 << 20  # features waiting for the draft, at most (GPU memory)


class FeedBuffer:
    def __init__(self, max_rows: int, capacity: int | None = None):
        """``max_rows``: the most rows one draft call may carry (the link's features buffer);
        ``capacity``: the most rows waiting (default ``max_rows``)."""
        self.max_rows = max_rows
        self.capacity = max(capacity or max_rows, max_rows)
        self._parts: list[FeedRows] = []  # in arrival order
        self._per_seq: Counter[int] = Counter()  # rows waiting per sequence, of the parts counted ...
        # ... and the sequence ids of the parts not counted yet, as [ids, parts]: consecutive steps of
        # plain decodes with the same sequences are one entry (a run of them, counted at once)
        self._uncounted: list[list] = []
        # sequences whose waiting rows are never sent -> the parts then waiting (their rows in those
        # are dropped; a request that left the draft and takes it up again adds rows in later parts)
        self._dropped: dict[int, int] = {}
        self.rows = 0

    def add(self, feeds: list[DraftFeed | FeedRows]) -> list[DraftFeed]:
        """Buffer ``feeds``; returns what must be sent first, without them, when together they would
        exceed ``capacity`` (one step's feeds alone never exceed ``max_rows``)."""
        parts = [f if isinstance(f, FeedRows) else FeedRows.of(f) for f in feeds]
        new = sum(len(p) for p in parts)
        flush = self.take() if self._parts and self.rows + new > self.capacity else []
        for p in parts:
            if len(p):
                self._parts.append(p)
                self._uncount(p.seq_ids)
        self.rows += new
        return flush

    def take(self) -> list[DraftFeed]:
        """Everything buffered, one feed per sequence (by sequence id, rows in order), emptied."""
        parts, dropped = self._parts, self._dropped
        self._parts, self._per_seq, self._uncounted, self._dropped, self.rows = [], Counter(), [], {}, 0
        if not parts:
            return []
        ids, starts, tokens = (np.concatenate([getattr(p, name) for p in parts]).astype(np.int64, copy=False)
                               for name in ("seq_ids", "starts", "next_tokens"))
        order = np.lexsort((starts, ids))  # by sequence, then position
        if dropped:  # rows of a dropped sequence in the parts that waited when it was dropped
            gone_ids = np.fromiter(dropped, np.int64, len(dropped))
            before = np.fromiter(dropped.values(), np.int64, len(dropped))
            sorter = np.argsort(gone_ids)
            gone_ids, before = gone_ids[sorter], before[sorter]
            at = np.minimum(np.searchsorted(gone_ids, ids), len(gone_ids) - 1)
            part_of = np.repeat(np.arange(len(parts)), [len(p) for p in parts])
            gone = (gone_ids[at] == ids) & (part_of < before[at])
            order = order[~gone[order]]
        ids, starts, tokens = ids[order], starts[order], tokens[order]
        same = ids[1:] == ids[:-1]
        bad = np.flatnonzero(same & (starts[1:] != starts[:-1] + 1))
        assert not len(bad), f"sequence {ids[bad[0]]}: rows must arrive in order, without gaps or repeats"
        features = torch.cat([p.features for p in parts]) if len(parts) > 1 else parts[0].features
        if len(order) != len(features) or np.any(order != np.arange(len(order))):
            features = features.index_select(0, to_device(order, torch.int64, features.device))
        bounds = [0, *(np.flatnonzero(~same) + 1).tolist(), len(ids)]
        return [DraftFeed(int(ids[a]), int(starts[a]), features[a:b], tokens[a:b]) for a, b in zip(bounds, bounds[1:])]

    def split(self, feeds: list[DraftFeed]) -> list[list[DraftFeed]]:
        """``feeds`` cut into draft calls of at most ``max_rows`` rows, in order: a sequence's rows
        that do not fit one call go in consecutive pieces, each call after the one before it."""
        calls, call, room = [], [], self.max_rows
        for f in feeds:
            at, n = 0, len(f.next_tokens)
            while at < n:
                if room == 0:
                    calls.append(call)
                    call, room = [], self.max_rows
                take = min(room, n - at)
                call.append(f if take == n else DraftFeed(f.seq_id, f.start + at, f.features[at:at + take],
                                                          f.next_tokens[at:at + take]))
                at, room = at + take, room - take
        return calls + [call] if call else calls

    def drop(self, seq_id: int) -> None:
        """A finished or cancelled sequence: its rows are never sent."""
        self._count()
        waiting = self._per_seq.pop(seq_id, 0)
        if waiting:
            self.rows -= waiting
            self._dropped[seq_id] = len(self._parts)
        if not self.rows:  # every waiting row was dropped: nothing to hold on to
            self._parts, self._per_seq, self._uncounted, self._dropped = [], Counter(), [], {}

    def waiting(self, seq_id: int) -> int:
        """Rows of ``seq_id`` waiting (dropped ones excluded)."""
        self._count()
        return self._per_seq.get(seq_id, 0)

    def _uncount(self, seq_ids) -> None:
        """A part's sequence ids, to count when a sequence is dropped (``_count``). A plain decode step's
        ids (a list, as the engine's commit loop fills it) equal to the last part's join its run: a
        stretch of plain decoding is counted as one step times its length (counted part by part, the
        first finish after 112 steps at batch 128 took 1.6 ms, the host's time for a whole step)."""
        last = self._uncounted[-1] if self._uncounted else None
        if last is not None and type(seq_ids) is list and type(last[0]) is list and last[0] == seq_ids:
            last[1] += 1
        else:
            self._uncounted.append([seq_ids, 1])

    def _count(self) -> None:
        """Fold the parts added since the last count into the rows per sequence, at once (a step's
        record counted as it arrives cost a pass over its sequences every step; drops come a few at a
        time). A dropped sequence's rows are counted before it is dropped; rows it adds later, after
        leaving the draft and taking it up again, are counted afresh."""
        if self._uncounted:
            per_seq = self._per_seq
            for ids, times in self._uncounted:
                ids, counts = np.unique(np.asarray(ids, dtype=np.int64), return_counts=True)
                per_seq.update(dict(zip(ids.tolist(), (counts * times).tolist())))
            self._uncounted = []
