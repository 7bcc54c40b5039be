"""The whole proposal computed on the device (draft_service/proposal_graph.py) against the
level-by-level drafter it replaces at full depth: the same trees for dynamic, static and chain
shapes, in padded batches, over several proposals of a sequence (the speculative draft rows are
dropped and rewritten), and the KV rows of committed tokens untouched.

On a CPU the device proposal runs eagerly (the same ops the CUDA graph captures); on CUDA the
graphed replay is checked by tests/test_draft_graphs.py.
"""

import json

import numpy as np
import pytest
import torch

from draft_service.drafter import EagleDrafter
from draft_service.proposal_graph import padded_batch
from draft_service.spec_config import SpecConfig
from link.protocol import DraftFeed, ProposeRequest
from tiny_eagle import make_eagle_dir
from tiny_models import TRITON_DEVICE, make_model_dir, target_for, tiny_config


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("device_proposal")
    static = root / "tree.json"
    static.write_text(json.dumps({"paths": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]}))
    return (make_model_dir(root / "target", "llama3", seed=5, std=0.3),
            make_eagle_dir(root / "draft", tiny_config("llama3"), draft_vocab=64, seed=1), static)


def drafter_for(dirs, tree: str, kernels: str = "reference") -> tuple[EagleDrafter, int, int]:
    """The drafter, the width of the features it is fed and the target's vocabulary."""
    spec = SpecConfig(str(dirs[1]), tree=tree, depth=4, top_k=3, max_nodes=10,
                      static_tree_file=str(dirs[2]) if tree == "static" else None)
    target = target_for(dirs[0], kernels=kernels, device=TRITON_DEVICE if kernels == "triton" else "cpu")
    drafter = EagleDrafter.from_checkpoint(spec, target.model_config, target.model.model.embed_tokens.weight,
                                           8, target.max_model_len, kernels)
    return drafter, target.model_config.hidden_size * len(drafter.capture_layers), target.model_config.vocab_size


def committed_kv(drafter: EagleDrafter, seq: int) -> torch.Tensor:
    """The draft KV (every layer, K and V) of a sequence's committed rows."""
    bs, table = drafter.kv.block_size, drafter.blocks.block_table(seq)
    slots = [table[r // bs] * bs + r % bs for r in range(drafter.rows[seq])]
    data = drafter.kv.data
    return data.view(*data.shape[:2], -1, *data.shape[-2:])[:, :, slots].clone()


def same_trees(a, b):
    assert a.keys() == b.keys()
    for i in a:
        np.testing.assert_array_equal(a[i].tokens, b[i].tokens)
        np.testing.assert_array_equal(a[i].parents, b[i].parents)
        np.testing.assert_array_equal(a[i].depths, b[i].depths)
        np.testing.assert_allclose(a[i].log_probs, b[i].log_probs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tree, kernels, seqs", [("dynamic", "reference", 3), ("static", "reference", 3),
                                                 ("chain", "reference", 3), ("dynamic", "triton", 1),
                                                 ("dynamic", "triton", 3)])
def test_device_proposal_gives_the_level_by_level_trees(dirs, tree, kernels, seqs):
    """Also on the Triton kernels (the interpreter on a CPU), one sequence alone included: a batch
    of one is where expanded metadata views flatten to stride 0."""
    if kernels == "triton":
        pytest.importorskip("triton")
    drafter, width, vocab = drafter_for(dirs, tree, kernels)
    dev = drafter.device
    gen = torch.Generator().manual_seed(0)
    starts = {s: 0 for s in range(1, seqs + 1)}
    for rows in ([9, 4, 13], [2, 3, 1], [5, 1, 4]):  # three proposals: prompts, then accepted tokens
        feeds = []
        for (seq, start), n in zip(starts.items(), rows):
            feeds.append(DraftFeed(seq, start, torch.randn(n, width, generator=gen).to(dev),
                                   torch.randint(0, vocab, (n,), generator=gen).numpy()))
            starts[seq] = start + n
        drafter.step(feeds, [])
        requests = [ProposeRequest(s, drafter.spec.settings.depth) for s in starts]
        by_levels = drafter._propose_by_levels(requests, drafter.spec.settings)
        before = {s: committed_kv(drafter, s) for s in starts}
        on_device = drafter._propose_on_device(requests, drafter.spec.settings)
        same_trees(by_levels, on_device)
        assert all(t.num_nodes > 1 for t in on_device.values())
        assert all(torch.equal(committed_kv(drafter, s), kv) for s, kv in before.items())  # only draft rows written
        bs = drafter.kv.block_size  # the levels' extra blocks are given back
        assert all(len(drafter.blocks.block_table(s)) == -(-drafter.rows[s] // bs) for s in starts)
    proposal = drafter._proposals[(drafter.spec.settings, padded_batch(seqs))]
    assert proposal.batch == padded_batch(seqs)  # a padded batch (of 4 for 3)
    assert (proposal.graph is not None) == (dev.type == "cuda")  # captured on CUDA, eager elsewhere


def test_padded_batch():
    assert [padded_batch(n) for n in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 128]


def test_a_proposal_graph_that_does_not_fit_runs_eagerly(dirs, monkeypatch):
    """Out of GPU memory at capture: the proposal runs the same computation eagerly (a warning), and
    the trees are the reference's."""
    from types import SimpleNamespace

    from draft_service import proposal_graph

    def no_memory(self, pool):
        raise torch.OutOfMemoryError("no room for the graph")

    monkeypatch.setattr(proposal_graph.DeviceProposal, "_capture", no_memory)
    drafter, width, vocab = drafter_for(dirs, "dynamic")
    drafter.graphs = SimpleNamespace(pool=None, run_extend=lambda chunks, hidden: None,  # as on CUDA: graphs first
                                     backlog_rows=lambda batch: 128)
    gen = torch.Generator().manual_seed(1)
    drafter.step([DraftFeed(1, 0, torch.randn(6, width, generator=gen),
                            torch.randint(0, vocab, (6,), generator=gen).numpy())], [])
    requests = [ProposeRequest(1, drafter.spec.settings.depth)]
    want = drafter._propose_by_levels(requests, drafter.spec.settings)
    same_trees(want, drafter._propose_on_device(requests, drafter.spec.settings))
    assert drafter._proposals[(drafter.spec.settings, 1)].graph is None


def test_compiling_the_eager_extends_leaves_no_trace(dirs):
    """The warm-up's eager extends of prompt-sized pieces (``_compile_extends``) write only a
    placeholder sequence's rows and give its blocks back; a real sequence's draft is untouched."""
    drafter, width, vocab = drafter_for(dirs, "chain")
    gen = torch.Generator().manual_seed(3)
    drafter.step([DraftFeed(1, 0, torch.randn(6, width, generator=gen),
                            torch.randint(0, vocab, (6,), generator=gen).numpy())], [])
    before, used = committed_kv(drafter, 1), drafter.blocks.num_used_blocks
    drafter._compile_extends(40)
    assert drafter.blocks.num_used_blocks == used and torch.equal(committed_kv(drafter, 1), before)
    assert set(drafter.rows) == {1}


def test_a_backlog_beyond_the_graphs_rows_goes_in_rounds_with_the_same_result(dirs):
    """With graphs, a sequence bringing more rows than the backlog graph holds is extended in
    consecutive rounds (here 4 rows a round, run eagerly): the same KV, last rows and trees as one
    eager extend of everything."""
    from types import SimpleNamespace

    whole, width, vocab = drafter_for(dirs, "dynamic")
    rounds, _, _ = drafter_for(dirs, "dynamic")
    rounds.graphs = SimpleNamespace(pool=None, run_extend=lambda chunks, hidden: None, backlog_rows=lambda batch: 4)
    gen = torch.Generator().manual_seed(5)
    feeds = [DraftFeed(s, 0, torch.randn(n, width, generator=gen), torch.randint(0, vocab, (n,), generator=gen).numpy())
             for s, n in ((1, 13), (2, 3), (3, 9))]
    calls = []
    run = rounds._run
    rounds._run = lambda chunks, hidden, *a: calls.append([len(c.token_ids) for c in chunks]) or run(chunks, hidden, *a)
    whole.step(feeds, [])
    rounds.step(feeds, [])
    assert calls == [[4, 3, 4], [4, 4], [4, 1], [1]]
    rounds.graphs = None  # proposals eagerly (no CUDA here)
    requests = [ProposeRequest(s, whole.spec.settings.depth) for s in (1, 2, 3)]
    for s in (1, 2, 3):
        assert rounds.rows[s] == whole.rows[s]
        torch.testing.assert_close(committed_kv(rounds, s), committed_kv(whole, s))
    same_trees(whole._propose_on_device(requests, whole.spec.settings),
               rounds._propose_on_device(requests, rounds.spec.settings))


@pytest.mark.parametrize("kernels, seqs", [("reference", 3), ("triton", 1), ("triton", 3)])
def test_the_chained_step_gives_the_extend_then_the_proposal(dirs, kernels, seqs):
    """A chained step as one computation (``ChainedProposal``: its CUDA graph on a GPU, elsewhere the
    ops it captures, eagerly) gives the trees, roots and committed KV of the eager extend then
    proposal, over three steps in a padded batch; a count past a sequence's most rows and tokens
    outside the vocabulary (the draft link's rows are untrusted) are clamped the same way on both paths."""
    from draft_service.chain_graph import ChainedProposal

    if kernels == "triton":
        pytest.importorskip("triton")
    fused, width, vocab = drafter_for(dirs, "dynamic", kernels)
    eager, _, _ = drafter_for(dirs, "dynamic", kernels)
    eager.graphs = None  # the extend, then the proposal, launch by launch
    settings, dev = fused.spec.settings, fused.device
    if dev.type != "cuda":
        fused._chained = lambda s, n: fused._chains.setdefault((s, fused._padded(n)), ChainedProposal(
            fused._new_proposal(s, fused._padded(n), graph=False), fused._extend_tokens, fused._feature_width,
            graph=False))
    gen = torch.Generator().manual_seed(4)
    seq_ids = list(range(1, seqs + 1))
    prompts = [DraftFeed(s, 0, torch.randn(5 + s, width, generator=gen).to(dev),
                         torch.randint(0, vocab, (5 + s,), generator=gen).numpy()) for s in seq_ids]
    for d in (fused, eager):
        d.step(prompts, [])
    D = fused._extend_tokens
    for step in range(3):
        starts = [fused.rows[s] for s in seq_ids]
        most = [D, 2, D][:seqs] if step == 1 else [D] * seqs
        counts = torch.randint(1, D + 1, (seqs,), generator=gen)
        if step == 1 and seqs > 1:
            counts[1] = D  # past its most (2)
        tokens = torch.randint(0, vocab, (seqs, D), generator=gen)
        tokens[0, 0] = vocab + 7 if step == 2 else tokens[0, 0]
        features = torch.randn(seqs, D, width, generator=gen)
        got = [d.step_on_device(seq_ids, starts, most, counts.to(dev), tokens.to(dev), features.to(dev),
                                settings).collect() for d in (fused, eager)]
        same_trees(*got)
        for s, a, b, m in zip(seq_ids, starts, counts.tolist(), most):
            fused.settle({s: a + min(b, m)})
            assert eager.rows[s] == fused.rows[s]
            torch.testing.assert_close(fused.last_out[s], eager.last_out[s], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(fused.last_logp[s], eager.last_logp[s], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(committed_kv(fused, s), committed_kv(eager, s), rtol=1e-5, atol=1e-5)
    chain = fused._chains[(settings, padded_batch(seqs))]
    assert len(fused._chains) == 1 and (chain.graph is not None) == (dev.type == "cuda")
    assert chain.replays == (3 if dev.type == "cuda" else 0)
    if seqs < 3:
        return
    # The same graph for another batch of as many: the roots of the sequence it leaves out (3), which
    # the replay overwrites in the graph's buffers, are kept; its next proposal is the eager drafter's.
    prompt = DraftFeed(4, 0, torch.randn(4, width, generator=gen).to(dev), np.arange(4) + 1)
    for d in (fused, eager):
        d.step([prompt], [])
    fed = [1, 2, 4]
    starts, counts = [fused.rows[s] for s in fed], torch.full((3,), 2)
    args = (counts.to(dev), torch.ones(3, D, dtype=torch.long, device=dev), torch.randn(3, D, width, generator=gen).to(dev))
    for d in (fused, eager):
        d.step_on_device(fed, starts, [D] * 3, *args, settings).collect()
    fused.settle({s: a + 2 for s, a in zip(fed, starts)})
    request = [ProposeRequest(3, settings.depth)]
    same_trees(fused._propose_on_device(request, settings), eager._propose_on_device(request, settings))
    assert chain.replays == (4 if dev.type == "cuda" else 0)
