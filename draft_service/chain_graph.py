"""A chained step's draft work as ONE CUDA graph: the extend of the rows acceptance chose, still on the
device, then the whole proposal grown from it.

A chained step (``EagleDrafter.step_on_device``: the draft fed straight from the target's acceptance,
in this process or in the draft service) was two graphs and a dozen launches between them from
Python: the fed counts and tokens clamped, copied into the extend graph, its outputs cloned, copied
into the proposal's root buffers, the fed rows added to the committed ones. Here it is one replay::

    host:    rows [B] (each sequence's first fed row), live [B] (its most rows), tables [B, W]
                 -> one copy (the proposal's pinned buffers, ``DeviceProposal.send``)
    device:  counts [B] | tokens [B, D] | features [B, D, width] -> this graph's buffers (three copies)
    graph:   counts clamped into [1, most] (padding sequences: 0), tokens into the vocabulary
             the rows packed (``kernels.pack_rows``), the draft extend (``extend_forward``)
                 -> each sequence's last row: its output and log-probs = the proposal's roots
             rows += counts: the committed rows the proposal's levels sit past
             the proposal's levels and trees (``DeviceProposal.grow``) -> packed [4, B, nodes]

The counts and tokens may come from another process (the draft link): clamped on the device, a wrong
value spoils proposals, never the draft's memory. ``last`` and ``logp``, the roots, are the graph's
buffers, rewritten by its next replay: the drafter holds the batch's rows there and copies out
the rows a replay would overwrite (``draft_service/roots.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from draft_service.draft_graphs import extend_forward
from draft_service.proposal_graph import DeviceProposal
from runtime.graphs import capture_graph


class ChainedProposal:
    """The extend of up to ``rows_per_seq`` rows a sequence, then ``proposal``'s trees (an eager
    ``DeviceProposal``, whose buffers and ``grow`` this graph captures), for up to its batch of
    sequences fed target features ``feature_width`` wide."""

    def __init__(self, proposal: DeviceProposal, rows_per_seq: int, feature_width: int, graph: bool = True,
                 pool=None):
        """``graph`` off (a CPU): the same computation runs eagerly, launch by launch."""
        assert proposal.graph is None, "the chained graph captures the proposal's work itself"
        self.proposal = p = proposal
        B, D, dev = p.batch, rows_per_seq, p.device
        self.counts = torch.zeros(B, dtype=torch.int64, device=dev)
        self.tokens = torch.zeros(B, D, dtype=torch.int64, device=dev)
        self.features = torch.zeros(B, D, feature_width, dtype=p.root_out.dtype, device=dev)
        self.vocab = p.net.embed_weight.shape[0]
        self.seq_ids: list[int] = []  # the sequences whose roots ``last`` and ``logp`` hold, in order
        self.replays = 0
        self.graph = self.last = self.logp = None  # eagerly: fresh roots each launch
        if graph:  # placeholder inputs: no sequence live, nothing written to the cache
            self.graph, (self.last, self.logp, self._packed) = capture_graph(self._forward, dev, pool)

    @property
    def batch(self) -> int:
        return self.proposal.batch

    @property
    def rows_per_seq(self) -> int:
        return self.tokens.shape[1]

    def launch(self, seq_ids: list[int], starts: np.ndarray, most: np.ndarray, tables: list[list[int]],
               counts: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Queue the step of ``len(seq_ids)`` sequences: sequence i's rows ``starts[i] ..`` are the first
        ``counts[i]`` (at most ``most[i]``) of ``features[i]`` [W, width] paired with ``tokens[i]`` [W]
        (W <= ``rows_per_seq``), written through ``tables[i]`` (covering them and the trees' rows past
        them). Returns the trees, int64 [4, n, nodes] on the device (tokens | parents | depths | score
        bits), valid until the next replay; nothing waits."""
        n, W = tokens.shape
        assert W <= self.rows_per_seq and n == len(seq_ids), (tokens.shape, self.rows_per_seq, len(seq_ids))
        self.proposal.send(starts, tables, live=np.clip(most, 1, W))
        self.counts[:n].copy_(counts)
        self.tokens[:n, :W].copy_(tokens)
        self.features[:n, :W].copy_(features)
        if self.graph is not None:
            self.graph.replay()
            self.replays += 1
        else:
            self.last, self.logp, self._packed = self._forward()
        self.seq_ids = list(seq_ids)
        return self._packed[:, :n]

    def _forward(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p, D = self.proposal, self.rows_per_seq
        counts = torch.minimum(self.counts.clamp(min=1), p.live)  # padding sequences (live 0) bring no rows
        ids, hidden = p.kernels.pack_rows(counts, self.tokens, self.features, p.batch * D, self.vocab)
        last, logp = extend_forward(p.net, p.kv, p.kernels, ids, hidden, p.rows, counts, p.tables, D, p.max_seq_len)
        # A padding sequence's "last row" attended to no key (NaN): its roots are zeros, so its tree,
        # which no one reads, is grown from finite scores like any other (NaN would rank out of range).
        live = (p.live > 0)[:, None]
        last, logp = torch.where(live, last, 0), torch.where(live, logp, 0)
        p.rows.add_(counts)  # (the extend's layout was computed from the rows before: graph order)
        return last, logp, p.grow(logp, last)
