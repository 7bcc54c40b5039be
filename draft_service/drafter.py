"""The EAGLE-3 drafter: keeps the draft head's KV cache in step with committed tokens and
grows candidate trees level by level.

Draft cache of one sequence (row i pairs target feature f_i with token x_{i+1})::

    KV index   0 ... m-1           | m ...  m+F1-1 | m+F1 ...        (m = committed rows)
    content    committed rows      | level-1 nodes | level-2 nodes   (speculative, dropped
    position   0 ... m-1           | m             | m+1               after every proposal)

The newest committed row m-1 predicts the root's children. A node at depth d is fed at
position m + d - 1 with its parent's draft output as hidden input, and attends to the
committed rows plus its ancestors among the fed nodes (``mask_start`` = m). After the tree
is built the speculative rows are released; the next ``DraftFeed`` overwrites them with the
target's own features of what was accepted ("draft extend"), so no rejected node survives.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from common.config import ModelConfig
from common.tree_settings import TreeSettings
from draft_service.chain_graph import ChainedProposal
from draft_service.draft_graphs import DraftGraphs
from draft_service.eagle_config import DraftConfig
from draft_service.eagle_loader import load_eagle
from draft_service.eagle_net import EagleNet
from draft_service.proposal_graph import DeviceProposal, padded_batch
from draft_service.roots import Roots
from draft_service.spec_config import SpecConfig
from draft_service.static_tree import StaticTreeSpec
from draft_service.tree_builders import DynamicTreeBuilder, Frontier, StaticTreeBuilder
from kernels import KernelSet, select_kernels
from link.protocol import DraftFeed, ProposeRequest
from runtime.block_manager import BlockManager, blocks_for
from runtime.kv_cache import PagedKVCache
from runtime.memory import check_fits, rope_table_bytes
from runtime.step_layout import SeqChunk, Staging, layout_step
from runtime.tree import CandidateTree

log = logging.getLogger(__name__)


@dataclass(eq=False)
class PendingTrees:
    """The trees of ``EagleDrafter.step_on_device``, on their way to the host: ``collect`` waits for
    their copy (only what is left of it) and returns them by sequence. Collect before the drafter's
    next proposal of the same shape starts: it reuses the copy's buffer. ``on_device``: the same
    trees where the proposal left them on the device (a graph's outputs: read them before its next
    replay), which the next verification may lay out from without waiting for the copy."""

    seq_ids: list[int] = field(default_factory=list)
    proposal: DeviceProposal | None = None
    ticket: int = 0
    on_device: torch.Tensor | None = None  # int64 [4, n, nodes]: tokens | parents | depths | score bits
    trees: dict[int, CandidateTree] | None = None  # once collected (or made eagerly)
    outlives_next_draft = False  # the next proposal of the shape reuses the copy's buffer: collect first

    @property
    def nodes_hint(self) -> int | None:
        """How many nodes each tree holds (known at once in this process)."""
        return None if self.on_device is None else self.on_device.shape[2]

    def collect(self) -> dict[int, CandidateTree]:
        if self.trees is None:
            assert self.proposal is not None, "trees grown for the device only (to_host off)"
            tokens, parents, depths, scores = self.proposal.collect(self.ticket)
            deepest = depths.max(axis=1).tolist() if depths.shape[1] else [0] * len(self.seq_ids)  # one pass
            self.trees = {i: CandidateTree(tokens[j], parents[j], depths[j], scores[j], deepest[j])
                          for j, i in enumerate(self.seq_ids)}
        return self.trees


class EagleDrafter:
    # Its trees are grown here, in this process, by the builders: parents before children, depths from
    # the levels, distinct siblings (top-k of distinct draft ids through a d2t map checked injective and
    # inside the vocabulary when the checkpoint loaded), at most the asked nodes and depth. The verify
    # side skips its structural checks for them (``DraftCoordinator.draft``); trees from another
    # process (the draft link) are always checked.
    trusted_trees = True

    def __init__(self, net: EagleNet, spec: SpecConfig, capture_layers: tuple[int, ...], kernels: KernelSet,
                 max_num_seqs: int, max_model_len: int, block_size: int = 16, cuda_graphs: bool = False):
        """``cuda_graphs``: replay the whole proposal (``proposal_graph.py``) and the draft extend
        (``draft_graphs.py``) as CUDA graphs (CUDA with the Triton kernels only, else ignored)."""
        self.net, self.spec, self.kernels = net, spec, kernels
        self.capture_layers = capture_layers
        cfg = net.config
        weight = net.norm.weight
        self.device, self.dtype = weight.device, weight.dtype
        num_blocks = max_num_seqs * blocks_for(max_model_len + spec.settings.draft_tree_rows, block_size)
        kv_bytes = num_blocks * block_size * 2 * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize
        check_fits(f"draft KV cache for {max_num_seqs} sequences of {max_model_len} tokens", kv_bytes, self.device)
        self.kv = PagedKVCache(1, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
        self.blocks = BlockManager(num_blocks, block_size)
        self.staging = Staging(self.device)
        self.static = StaticTreeSpec.from_file(spec.static_tree_file) if spec.tree == "static" else None
        self.rows: dict[int, int] = {}  # committed rows per sequence
        self.roots = Roots()  # per sequence: the draft output [H] of its newest committed row, its log-probs [Vd]
        rows = spec.settings.draft_tree_rows
        self._table_width, self._capacity = blocks_for(max_model_len + rows, block_size), max_model_len + rows
        self._extend_tokens = spec.settings.depth + 1  # a step's rows a sequence: its accepted tokens at most
        self.graphs = DraftGraphs(net, self.kv, kernels, self._table_width, self._capacity, self._extend_tokens) \
            if cuda_graphs and self.device.type == "cuda" and kernels.name == "triton" else None
        self.max_num_seqs = max_num_seqs
        self._proposals: dict[tuple[TreeSettings, int], DeviceProposal] = {}  # (shape, padded batch)
        self._chains: dict[tuple[TreeSettings, int], ChainedProposal | None] = {}  # the same, chained steps
        self._feature_width = len(capture_layers) * cfg.target_hidden_size

    @classmethod
    def from_checkpoint(cls, spec: SpecConfig, target: ModelConfig, target_embedding: torch.Tensor,
                        max_num_seqs: int, max_model_len: int, kernels: str = "auto",
                        cuda_graphs: bool = True) -> "EagleDrafter":
        """Load ``spec.draft_path`` against the target; runs on the embedding's device and dtype with
        ``kernels`` (``select_kernels``' choice), proposals and extends as CUDA graphs where they can be."""
        positions = max_model_len + spec.settings.draft_positions
        check_fits(f"draft RoPE tables for {positions} positions",
                   rope_table_bytes(DraftConfig.from_dir(spec.draft_path).head_dim, positions), target_embedding.device)
        net = load_eagle(spec.draft_path, target, target_embedding, target_embedding.dtype,
                         target_embedding.device, max_model_len + spec.settings.draft_positions)
        net.fuse_projections()
        return cls(net, spec, net.config.capture_layers(target), select_kernels(target_embedding.device, kernels),
                   max_num_seqs, max_model_len, cuda_graphs=cuda_graphs)

    @torch.inference_mode()
    def warm_up(self, shapes: list[TreeSettings] | None = None, prompt_rows: int = 2048,
                chained: bool = False) -> float:
        """Capture the CUDA graphs of the tree ``shapes`` (default: the default tree) before the first
        proposal: the whole proposal and the draft extend, for every padded batch up to
        ``max_num_seqs`` (a capture in the middle of serving stalls its step by tens of
        milliseconds, and batches change as sequences finish); and compile the eager extend of
        prompt pieces up to ``prompt_rows`` rows (a kernel compilation stalls its step as long).
        ``chained``: also the chained steps' graphs, extend and proposal in one (``step_on_device``:
        an engine in this process without a policy, a draft service's session that takes them).
        Returns the seconds it took (0 without graphs)."""
        if self.graphs is None:
            return 0.0
        t0 = time.perf_counter()
        self._compile_extends(prompt_rows)
        batch = 1
        while True:
            b = min(batch, self.max_num_seqs)
            for settings in shapes or [self.spec.settings]:
                self._proposal(settings, b)
                if chained:
                    self._chained(settings, b)
            self.graphs.capture_extend(b, self._feature_width)
            if b >= self.max_num_seqs:
                break
            batch *= 2
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        log.info("draft graphs for %d tree shapes captured in %.1f s", len(shapes or [0]), seconds)
        return seconds

    def _compile_extends(self, max_rows: int) -> None:
        """Run the eager extend (more rows a sequence than an extend graph holds: prompts, rows that
        waited out plain steps) at the shapes the target's warm-up runs: pieces on both sides of a
        multiple of 16 and short ones, at a short and a long context (Triton specialises integer
        arguments on divisibility by 16). A placeholder sequence's KV
        rows are written and given back."""
        seq, width = -1, len(self.capture_layers) * self.net.config.target_hidden_size
        longest = self._capacity - self.spec.settings.draft_tree_rows  # committed rows: the context at most
        n = max(3, min(max_rows, longest - 1))
        for seq_len in sorted({min(longest, length) for length in (n, 8192 + n, longest)}):
            for tokens in sorted({n - 1, n, *(t for t in (48, 12, 2) if t < n - 1)}):  # T % 16 == 0 and not
                start = max(0, seq_len - tokens)
                table = self.blocks.ensure_capacity(seq, start + tokens)
                chunk = SeqChunk(np.zeros(tokens, np.int64), start, table, logits_rows=(tokens - 1,))
                self._run([chunk], torch.zeros(tokens, width, dtype=self.dtype, device=self.device))
        self.blocks.free(seq)

    # --- DraftProvider -------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, feeds: list[DraftFeed], proposals: list[ProposeRequest]) -> dict[int, CandidateTree]:
        if feeds:
            self._extend(feeds)
        return self._propose(proposals) if proposals else {}

    @torch.inference_mode()
    def step_on_device(self, seq_ids: list[int], starts: list[int], most: list[int], counts: torch.Tensor,
                       tokens: torch.Tensor, features: torch.Tensor, settings: TreeSettings,
                       to_host: bool = True) -> PendingTrees:
        """``step`` for feeds whose rows are still on the device (in this process: right after the
        target's acceptance, before the verify step waits for it): sequence i's rows
        ``starts[i] ..`` are ``counts[i]`` (at most ``most[i]``) target features ``features[i]`` [D,
        width] paired with the tokens ``tokens[i]`` [D] that follow them (columns past the count:
        padding). Then a tree of ``settings``, full depth, for each. With graphs nothing here waits
        for the device: the trees come to the host while the caller commits (``PendingTrees.collect``
        waits for them); ``settle`` must follow once the counts are known on the host. ``to_host``
        off: the trees are read on the device only (``on_device``; no copy, nothing to collect)."""
        D, rows = tokens.shape[1], self.rows
        assert [rows.get(i, 0) for i in seq_ids] == list(starts), "sequences fed from other than their newest rows"
        # Each sequence's own most rows, not the batch's widest, and never past the context: a sequence at
        # its end brings fewer rows than the others (its tree was cut), and its table must fit the graphs'.
        ensure, extra, cap = self.blocks.ensure_capacity, settings.draft_tree_rows, self._capacity
        tables = [ensure(i, min(start + min(D, m) + extra, cap)) for i, start, m in zip(seq_ids, starts, most)]
        chain = self._chained(settings, len(seq_ids)) if D <= self._extend_tokens else None
        if chain is None:  # eagerly (a CPU, no graph for the shape): the host needs the counts
            # Clamped as the graph clamps them: they may come from another process (the draft link).
            n = [min(c, m) for c, m in zip(counts.clamp(1, D).tolist(), most)]
            tokens = tokens.clamp(0, self.net.embed_weight.shape[0] - 1)
            self._extend([DraftFeed(i, start, features[j, :n[j]], tokens[j, :n[j]].cpu().numpy())
                          for j, (i, start) in enumerate(zip(seq_ids, starts))])
            trees, on_device = self._propose_on_device([ProposeRequest(i, settings.depth, settings)
                                                        for i in seq_ids], settings, keep_on_device=True)
            return PendingTrees(seq_ids, trees=trees, on_device=on_device)
        self.roots.release_rows(seq_ids)  # (the roots of others that the replay would overwrite: copied out)
        on_device = chain.launch(seq_ids, np.asarray(starts, dtype=np.int64), np.asarray(most, dtype=np.int64),
                                 tables, counts, tokens, features)
        self.roots.hold(chain.last, chain.logp, seq_ids)
        proposal = chain.proposal
        return PendingTrees(seq_ids, proposal if to_host else None, proposal.copy_out(on_device) if to_host else 0,
                            on_device)

    @property
    def last_out(self) -> dict[int, torch.Tensor]:
        """Every sequence's root output [H] (a snapshot, for tests and checks)."""
        return {i: self.roots.get(i)[0] for i in self.roots.ids()}

    @property
    def last_logp(self) -> dict[int, torch.Tensor]:
        """Every sequence's root log-probs [Vd] (a snapshot, for tests and checks)."""
        return {i: self.roots.get(i)[1] for i in self.roots.ids()}

    def settle(self, rows: dict[int, int]) -> None:
        """The committed rows of the sequences ``step_on_device`` fed, now known on the host: the
        proposal's speculative rows past them are dropped (a sequence this drafter does not hold: none).
        Their blocks stay the sequence's (the cache holds every sequence's longest table): the next
        chained step writes its tree rows there again, and its block tables stay as they were."""
        held = self.rows
        for seq_id, n in rows.items():
            if seq_id in held:
                held[seq_id] = n

    def tree_rejected(self, seq_id: int, reason: str) -> None:
        log.error("sequence %d: the verify side refused a tree: %s", seq_id, reason)

    def release(self, seq_id: int) -> None:
        self.blocks.free(seq_id)
        self.rows.pop(seq_id, None)
        self.roots.drop(seq_id)

    # --- draft extend over committed rows --------------------------------------------------

    def _extend(self, feeds: list[DraftFeed]) -> None:
        """Extend the draft's cache with ``feeds``; with graphs, rows beyond what the backlog graph holds
        a sequence go in consecutive rounds (each sequence's rows in order)."""
        if self.graphs is not None:
            cap = self.graphs.backlog_rows(len(feeds))
            if max(len(f.next_tokens) for f in feeds) > cap:
                self._extend([DraftFeed(f.seq_id, f.start, f.features[:cap], f.next_tokens[:cap]) for f in feeds])
                rest = [DraftFeed(f.seq_id, f.start + cap, f.features[cap:], f.next_tokens[cap:])
                        for f in feeds if len(f.next_tokens) > cap]
                return self._extend(rest)
        chunks = []
        for f in feeds:
            have = self.rows.get(f.seq_id, 0)
            assert f.start <= have, f"sequence {f.seq_id}: rows {have}..{f.start} were never fed"
            n = len(f.next_tokens)
            self.blocks.ensure_capacity(f.seq_id, f.start + n)
            chunks.append(SeqChunk(f.next_tokens, f.start, self.blocks.block_table(f.seq_id), logits_rows=(n - 1,)))
            self.rows[f.seq_id] = f.start + n
        hidden = torch.cat([f.features for f in feeds]) if len(feeds) > 1 else feeds[0].features
        hidden = hidden.to(self.dtype)
        graphed = self.graphs.run_extend(chunks, hidden) if self.graphs is not None else None
        if graphed is not None:
            # Copies, not views: a graph's outputs are overwritten by its next replay, and a sequence's
            # newest row must last until its next proposal, whichever steps come between.
            last, logp = graphed[0].clone(), graphed[1].clone()
        else:
            out, logp = self._run(chunks, hidden)
            last = out[np.cumsum([len(f.next_tokens) for f in feeds]) - 1]
        for j, f in enumerate(feeds):
            self.roots.set(f.seq_id, last[j], logp[j])

    def _run(self, chunks: list[SeqChunk], hidden: torch.Tensor, input_ids: torch.Tensor | None = None,
             custom_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft forward, eager; returns every row's output [T, H] and log-probs at the logits rows.
        ``input_ids``/``custom_mask``: already on the device (see ``layout_step``): a tree level."""
        lay = layout_step(chunks, self.kv.block_size, self.device, self.kernels, self.staging, input_ids, custom_mask)
        out, logits = self.net.extend(lay.input_ids, hidden, lay.meta, self.kv, self.kernels, lay.logits_rows)
        return out, torch.log_softmax(logits, dim=-1, dtype=torch.float32)

    # --- tree growth -------------------------------------------------------------------------

    def _builder(self, settings: TreeSettings):
        d2t, kernels = self.net.d2t, self.kernels
        if settings.tree == "static":
            return StaticTreeBuilder(self.static, d2t, kernels)
        if settings.tree == "chain":
            return StaticTreeBuilder(StaticTreeSpec.chain(settings.depth), d2t, kernels)
        return DynamicTreeBuilder(settings.top_k, settings.depth, settings.max_nodes, d2t, kernels)

    def _propose(self, requests: list[ProposeRequest]) -> dict[int, CandidateTree]:
        """One batched tree build per distinct tree shape among the requests."""
        groups: dict[TreeSettings, list[ProposeRequest]] = {}
        for r in requests:
            groups.setdefault(r.settings or self.spec.settings, []).append(r)
        trees = {}
        for settings, group in groups.items():
            trees.update(self._propose_group(group, settings))
        return trees

    def _propose_group(self, requests: list[ProposeRequest], settings: TreeSettings) -> dict[int, CandidateTree]:
        return self._propose_on_device(requests, settings)

    def _propose_by_levels(self, requests: list[ProposeRequest], settings: TreeSettings) -> dict[int, CandidateTree]:
        """The reference the device proposal is tested against (tests/test_device_proposal.py): level
        by level, laid out on the host, stopping at the deepest level asked for."""
        ids = [r.seq_id for r in requests]
        builder = self._builder(settings)
        root_out, root_logp = self.roots.stack(ids)
        frontier = builder.start(root_logp)
        parent_out = root_out[:, None]  # (B, 1, H): the root's output
        deepest = max(r.max_depth for r in requests)
        fed = 0
        while frontier is not None and frontier.depth < deepest:
            out, logp = self._feed_level(ids, builder, frontier, parent_out, fed)
            fed += frontier.tokens.shape[1]
            parent_out = out
            frontier = builder.expand(logp)
        for i in ids:  # drop the speculative rows; the next feed overwrites them
            self.blocks.truncate(i, self.rows[i])
        return {r.seq_id: t.prune_depth(r.max_depth) for r, t in zip(requests, builder.finish())}

    def _propose_on_device(self, requests: list[ProposeRequest], settings: TreeSettings, keep_on_device: bool = False):
        """Every level at once (``proposal_graph.py``): one CUDA graph where the drafter has them. Trees
        grow to the shape's full depth, and a request near its end (``max_depth`` below it) gets its
        tree cut there: one graph per shape, none captured in the middle of serving. Returns the trees
        by sequence; ``keep_on_device``: and the trees on the device too, int64 [4, n, nodes] (as a
        chained step's graph leaves them; valid until the shape's next proposal)."""
        ids = [r.seq_id for r in requests]
        rows = np.array([self.rows[i] for i in ids], dtype=np.int64)
        for i, m in zip(ids, rows):
            self.blocks.ensure_capacity(i, int(m) + settings.draft_tree_rows)
        root_out, root_logp = self.roots.stack(ids)
        proposal = self._proposal(settings, len(ids))
        ticket, on_device = proposal.launch(root_logp, root_out, rows, [self.blocks.block_table(i) for i in ids])
        tokens, parents, depths, scores = proposal.collect(ticket)
        for i in ids:  # drop the speculative rows; the next feed overwrites them
            self.blocks.truncate(i, self.rows[i])
        deepest = depths.max(axis=1).tolist() if depths.shape[1] else [0] * len(requests)  # one pass for all
        trees = {}
        for j, r in enumerate(requests):
            tree = CandidateTree(tokens[j], parents[j], depths[j], scores[j], deepest[j])
            trees[r.seq_id] = tree if deepest[j] <= r.max_depth else tree.prune_depth(r.max_depth)
        return (trees, on_device) if keep_on_device else trees

    def _proposal(self, settings: TreeSettings, n: int) -> DeviceProposal:
        """The device proposal of ``settings`` for ``n`` sequences (a padded batch), made on first use."""
        key = (settings, self._padded(n))
        if key not in self._proposals:
            try:
                self._proposals[key] = self._new_proposal(*key, graph=self.graphs is not None)
            except torch.OutOfMemoryError:  # the same trees, eagerly
                log.warning("no GPU memory to capture the proposal graph of %s for %d sequences: it runs eagerly",
                            settings.describe(), key[1])
                torch.cuda.empty_cache()
                self._proposals[key] = self._new_proposal(*key, graph=False)
        return self._proposals[key]

    def _chained(self, settings: TreeSettings, n: int) -> ChainedProposal | None:
        """The chained step's graph (``chain_graph.py``) of ``settings`` for ``n`` sequences (a padded
        batch), captured on first use; None without graphs, or without the GPU memory to capture it
        (then the step runs eagerly: the same trees)."""
        if self.graphs is None:
            return None
        key = (settings, self._padded(n))
        if key not in self._chains:
            try:
                self._chains[key] = ChainedProposal(self._new_proposal(*key, graph=False), self._extend_tokens,
                                                    self._feature_width, pool=self.graphs.pool)
            except torch.OutOfMemoryError:
                log.warning("no GPU memory to capture the chained step's graph of %s for %d sequences: "
                            "it runs eagerly", settings.describe(), key[1])
                torch.cuda.empty_cache()
                self._chains[key] = None
        return self._chains[key]

    def _padded(self, n: int) -> int:
        """The batch a proposal's graph for ``n`` sequences is captured for."""
        return min(padded_batch(n), max(self.max_num_seqs, n))

    def _new_proposal(self, settings: TreeSettings, batch: int, graph: bool) -> DeviceProposal:
        return DeviceProposal(self.net, self.kv, self.kernels, lambda: self._builder(settings), settings.depth,
                              settings.draft_tree_rows, batch, self._table_width, self._capacity, graph=graph,
                              pool=self.graphs.pool if graph else None)

    def _feed_level(self, ids, builder, frontier: Frontier, parent_out, fed):
        """Run the draft on one frontier level; returns outputs [B, F, H], log-probs [B, F, Vd].

        The frontier's tokens and ancestor masks stay on the device: the host lays out only what it
        knows without looking (KV slots, positions, lengths), so levels follow each other with no
        device-to-host copy; the proposal's one copy is the finished trees."""
        B, F = frontier.tokens.shape
        masks = builder.feed_mask(frontier)  # (B, F, fed + F): ancestors and self
        slot = frontier.parent_slot.clamp(min=0)  # depth 1: every node's parent is the root (slot 0)
        hidden = torch.gather(parent_out, 1, slot.to(parent_out.device)[..., None].expand(-1, -1, parent_out.shape[2]))
        counts = np.zeros(F, dtype=np.int64)  # the chunks only count the level's tokens (ids: on the device)
        rows, position = np.arange(F), frontier.depth - 1
        chunks = []
        for i in ids:
            m = self.rows[i]
            self.blocks.ensure_capacity(i, m + fed + F)
            chunks.append(SeqChunk(counts, m + fed, self.blocks.block_table(i), logits_rows=rows,
                                   positions=np.full(F, m + position), mask_start=m))
        out, logp = self._run(chunks, hidden.reshape(B * F, -1), frontier.tokens.reshape(-1).to(self.device),
                              masks.reshape(B * F, -1).to(self.device))
        return out.view(B, F, -1), logp.view(B, F, -1)
