"""The step layout: one host-to-device copy carries every array of a step, masks included."""

import numpy as np
import pytest
import torch

from kernels import REFERENCE
from runtime.step_layout import Readback, SeqChunk, Staging, layout_step


def test_one_upload_carries_the_whole_step():
    tree_mask = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
    chunks = [SeqChunk([5, 6, 7, 8], 0, [3], logits_rows=(3,)),  # a prefill chunk
              SeqChunk([9], 20, [0, 4], logits_rows=(0,)),  # a decode token
              SeqChunk([1, 2, 3], 17, [1, 2], logits_rows=(0, 1, 2), positions=[17, 18, 18],
                       custom_mask=tree_mask)]  # a tree: root and two children
    staging = Staging(torch.device("cpu"))
    lay = layout_step(chunks, 16, torch.device("cpu"), REFERENCE, staging)
    m = lay.meta
    assert lay.input_ids.tolist() == [5, 6, 7, 8, 9, 1, 2, 3]
    assert m.query_start_loc.tolist() == [0, 4, 5, 8] and m.seq_lens.tolist() == [4, 21, 20]
    assert m.positions.tolist() == [0, 1, 2, 3, 20, 17, 18, 18]
    assert m.slot_mapping.tolist() == [48, 49, 50, 51, 4 * 16 + 4, 2 * 16 + 1, 2 * 16 + 2, 2 * 16 + 3]
    assert m.block_tables.tolist() == [[3, 0], [0, 4], [1, 2]]
    assert lay.logits_rows.tolist() == [3, 4, 5, 6, 7]
    # plain chunks get their causal mask among the new tokens; the tree keeps its own
    want = np.zeros((8, 4), bool)
    want[:4, :4] = np.tril(np.ones((4, 4), bool))
    want[4, 0] = True
    want[5:, :3] = tree_mask
    assert m.custom_mask.dtype == torch.bool and np.array_equal(m.custom_mask.numpy(), want)
    assert m.mask_start.tolist() == [0, 20, 17]
    storages = {t.untyped_storage().data_ptr() for t in (lay.input_ids, m.query_start_loc, m.block_tables,
                                                         m.slot_mapping, m.custom_mask, m.mask_start, lay.logits_rows)}
    assert len(storages) == 1  # views of one copy


def test_staging_buffers_alternate_and_grow():
    staging = Staging(torch.device("cpu"))
    a = staging.upload([np.arange(5)])[0]
    b = staging.upload([np.arange(10_000)])[0]  # grows past the initial 4096 words
    assert a.tolist() == list(range(5)) and b.tolist() == list(range(10_000))


def test_a_graphs_static_layout_holds_what_layout_arrays_computes():
    """``StaticLayout.fill`` (a CUDA graph's inputs, here on the CPU) against ``layout_arrays``, for a
    decode step (its fast path), a step of trees and a prompt's tokens as decodes (one table for all),
    padding zeroed past the step's tokens."""
    from runtime.static_layout import Bucket, StaticLayout
    from runtime.step_layout import layout_arrays

    tree_mask = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
    decode = [SeqChunk([9 + i], 5 + 7 * i, [4, i + 1, 7][:1 + (5 + 7 * i) // 16]) for i in range(5)]
    trees = [SeqChunk([1, 2, 3], 17, [1, 2], positions=[17, 18, 18], custom_mask=tree_mask),
             SeqChunk([4, 5, 6], 3, [6], positions=[3, 4, 4], custom_mask=tree_mask)]
    from verify_service.model_runner import decode_tokens
    prompt = decode_tokens([SeqChunk([3, 4, 5, 6], 14, [2, 8], logits_rows=(3,))])  # one table, shared
    for chunks, bucket in ((decode, Bucket(8, 1, False)), (trees, Bucket(4, 3, True)), (prompt, Bucket(4, 1, False))):
        lay = StaticLayout(bucket, 3, 64, 16, torch.device("cpu"))
        lay.fill_placeholder()
        qsl = lay.fill(chunks)
        want = layout_arrays(chunks, 16, 3)
        T, n = int(want["qsl"][-1]), len(chunks)
        assert qsl.tolist() == want["qsl"].tolist() and lay.host["qsl"][n + 1:].tolist() == [T] * (bucket.seqs - n)
        assert np.array_equal(lay.host["seq_lens"][:n], want["seq_lens"]) and not lay.host["seq_lens"][n:].any()
        assert np.array_equal(lay.host["tables"][:n], want["tables"]) and not lay.host["tables"][n:].any()
        for name in ("slots", "positions", "token_seq", "q_idx"):
            assert np.array_equal(lay.host[name][:T], want[name]), name
        assert (lay.host["slots"][T:] == -1).all() and not lay.host["positions"][T:].any()
        assert lay.host["ids"][:T].tolist() == [t for c in chunks for t in c.token_ids] and not lay.host["ids"][T:].any()
        assert torch.equal(lay.device_buffer, lay.host_buffer)  # the one copy


def test_a_static_layout_refilled_step_after_step_holds_each_steps_tables():
    """Rows of the host block table are rewritten only where a table changed (consecutive decode
    steps mostly send the same ones): after any sequence of fills the table is what a fresh layout
    holds for the last step, whatever the earlier steps held (tables grown in place, shrunk, shared
    by a prompt's tokens, given as arrays, fewer sequences)."""
    from runtime.static_layout import Bucket, StaticLayout
    from runtime.step_layout import layout_arrays
    from verify_service.model_runner import decode_tokens

    rng = np.random.default_rng(3)
    tables = [[int(b) for b in rng.integers(1, 50, size=2)] for _ in range(6)]
    lay = StaticLayout(Bucket(8, 1, False), 4, 64, 16, torch.device("cpu"))
    for step in range(40):
        kind = rng.integers(0, 6)
        if kind == 0:  # a table grows in place (the block manager's own list)
            t = tables[rng.integers(0, 6)]
            if len(t) < 4:
                t.append(int(rng.integers(1, 50)))
        elif kind == 1:  # ... or is truncated and regrown to its length with other blocks
            t = tables[rng.integers(0, 6)]
            t[-1] = int(rng.integers(1, 50))
        n = int(rng.integers(1, 7))
        if kind == 2:
            chunks = decode_tokens([SeqChunk([3, 4, 5], 16 * (len(tables[0]) - 1), tables[0], logits_rows=(2,))])
        else:
            chunks = [SeqChunk([i], 16 * (len(tables[i]) - 1) + step % 16,
                               np.asarray(tables[i]) if kind == 3 and i == 0 else tables[i]) for i in range(n)]
        lay.fill(chunks)
        want = layout_arrays(chunks, 16, 4)
        n = len(chunks)
        assert np.array_equal(lay.host["tables"][:n], want["tables"]) and not lay.host["tables"][n:].any(), step
        assert np.array_equal(lay.host["slots"][:n], want["slots"]), step


def test_the_draft_extend_graphs_layout_equals_layout_arrays():
    """The extend graph lays its rows out on the device (``extend_layout``) from each sequence's first
    row, row count and table: ``layout_arrays``' values for the real rows, and rows past them that
    write nothing (slot -1) at position, sequence and index 0; padding sequences (count 0) empty."""
    from kernels.draft_rows import extend_layout_ref as extend_layout
    from runtime.step_layout import layout_arrays

    bs, Q, W = 4, 5, 6
    rng = np.random.default_rng(0)
    for counts in ([3], [5, 1, 2], [1, 4, 0, 0], [2, 3, 5, 1]):
        real = [c for c in counts if c]
        chunks = [SeqChunk(np.arange(n), int(rng.integers(0, 9)), list(rng.integers(1, 50, size=W)), logits_rows=(n - 1,))
                  for n in real]
        padded = chunks + [SeqChunk(np.zeros(0, dtype=np.int64), 0, [])] * (len(counts) - len(real))
        want = layout_arrays(padded, bs, W)
        tables = np.zeros((len(counts), W), dtype=np.int64)
        for i, c in enumerate(chunks):
            tables[i] = c.block_table
        starts = [c.kv_start for c in chunks] + [0] * (len(counts) - len(real))
        got = {k: v.numpy() for k, v in extend_layout(torch.tensor(starts), torch.tensor(counts), torch.from_numpy(tables),
                                                       bs, Q).items()}
        T = sum(counts)
        for name in ("qsl", "seq_lens"):
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        for name in ("slots", "positions", "token_seq", "q_idx"):
            np.testing.assert_array_equal(got[name][:T], want[name], err_msg=name)
        assert (got["slots"][T:] == -1).all() and not got["positions"][T:].any()
        assert not got["token_seq"][T:].any() and not got["q_idx"][T:].any()
        np.testing.assert_array_equal(got["rows"], np.maximum(want["qsl"][1:] - 1, 0))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_a_readback_gives_the_tensor_as_it_was_queued_and_refuses_a_stale_ticket(device):
    """``Readback``: the copy holds the tensor as of ``start`` (work queued later does not reach it),
    the host gets its own array (the buffer is reused), and a ticket read after the next copy
    started is refused."""
    rb = Readback(torch.device(device))
    t = torch.arange(12, device=device).view(3, 4)
    first = rb.start(t)
    t.add_(100)  # queued after the copy
    got = rb.wait(first)
    assert got.tolist() == np.arange(12).reshape(3, 4).tolist()
    got[:] = -1
    assert rb.wait(first).tolist() == np.arange(12).reshape(3, 4).tolist()
    second = rb.start(t[:1].float())  # another dtype and shape: the buffer follows
    with pytest.raises(AssertionError, match="after the next one started"):
        rb.wait(first)
    assert rb.wait(second).tolist() == [[100.0, 101.0, 102.0, 103.0]]
    with torch.inference_mode():  # the buffer grows in inference mode, then serves a copy outside it
        third = rb.start(torch.arange(5000.0, device=device))
    assert rb.wait(third)[-1] == 4999.0
    assert rb.wait(rb.start(t[0].float())).tolist() == [100.0, 101.0, 102.0, 103.0]


def test_trees_written_on_the_device_give_the_layout_the_host_builds():
    """``StaticLayout.write_trees`` after ``fill(mask_on_device=True)`` (each tree's root, every row at
    the root's position) gives the same inputs, byte for byte, as ``fill`` of the host-built tree
    chunks: the nodes' tokens, positions (root + depth) and packed ancestor masks."""
    from kernels.tree import packed_tree_mask_ref
    from runtime.static_layout import Bucket, StaticLayout
    from runtime.tree import ancestor_masks

    rng = np.random.default_rng(0)
    B, n, bs = 3, 37, 16  # more than 32 columns: two mask words a row
    parents = np.stack([[rng.integers(-1, i) for i in range(n)] for _ in range(B)])  # parents before children
    depths = np.zeros((B, n), dtype=np.int64)
    for b in range(B):
        for i in range(n):
            depths[b, i] = 1 if parents[b, i] < 0 else depths[b, parents[b, i]] + 1
    tokens = rng.integers(1, 1000, (B, n))
    roots, starts = rng.integers(1, 1000, B), np.array([5, 40, 17])
    tables = [list(range(b * 8, b * 8 + 7)) for b in range(B)]
    masks = ancestor_masks(parents, np.full(B, n))
    host = [SeqChunk(np.concatenate(([roots[b]], tokens[b])), starts[b], tables[b], logits_rows=np.arange(n + 1),
                     positions=starts[b] + np.concatenate(([0], depths[b])), custom_mask=masks[b]) for b in range(B)]
    roots_only = [SeqChunk(np.pad([roots[b]], (0, n)), starts[b], tables[b], logits_rows=np.arange(n + 1),
                           positions=np.full(n + 1, starts[b])) for b in range(B)]
    want, got, batched = (StaticLayout(Bucket(4, 64, True), 8, 256, bs, torch.device("cpu")) for _ in range(3))
    want.fill(host)
    got.fill(roots_only, mask_on_device=True)
    # The same roots laid out for the batch at once, without chunks (a chained step's), over a layout
    # whose rows held another step first (its stale rows must not survive).
    batched.fill(host + host[:1])
    qsl = batched.fill_roots(starts, roots, tables, n)
    assert qsl.tolist() == [b * (n + 1) for b in range(B + 1)]
    assert torch.equal(batched.device_buffer, got.device_buffer)
    t = torch.from_numpy
    got.write_trees(t(tokens), t(depths), packed_tree_mask_ref(t(parents), torch.full((B,), n)))
    assert torch.equal(got.device_buffer, want.device_buffer)


def test_chained_layouts_in_turn_give_what_a_fresh_layout_gives():
    """``fill_roots`` writes the rows that follow its shape only when the shape changes: steps of one
    shape, then another, then a host ``fill`` and ``fill_roots`` again, each give the inputs a layout
    that never held another step gives, byte for byte (host and device buffers); and writing the
    same trees twice (a graph's warm-up run, then its replay) gives the inputs written once."""
    from kernels.tree import packed_tree_mask_ref
    from runtime.static_layout import Bucket, StaticLayout

    rng = np.random.default_rng(3)
    bucket, width, bs = Bucket(4, 24, True), 24, 16

    def layout():
        return StaticLayout(bucket, width, 512, bs, torch.device("cpu"))

    def roots_step(B, n):
        starts = rng.integers(0, 300, B)
        tables = [rng.permutation(200)[:width].tolist() for _ in range(B)]
        return starts, rng.integers(1, 1000, B), tables, n

    reused = layout()
    chunks = [SeqChunk(rng.integers(1, 99, 5), 7, list(range(3)), logits_rows=(4,)) for _ in range(2)]
    for step in (roots_step(3, 7), roots_step(3, 7), roots_step(2, 23), ("fill", chunks), roots_step(2, 23),
                 roots_step(4, 5), roots_step(1, 23)):
        fresh = layout()
        if isinstance(step[0], str):
            assert reused.fill(step[1]).tolist() == fresh.fill(step[1]).tolist()
        else:
            assert reused.fill_roots(*step).tolist() == fresh.fill_roots(*step).tolist()
        assert torch.equal(reused.host_buffer, fresh.host_buffer) and torch.equal(reused.device_buffer,
                                                                                   fresh.device_buffer)
    B, n = 2, 9
    reused.fill_roots(*roots_step(B, n))
    parents = torch.tensor([[-1, 0, 0, 1, -1, 4, 5, 2, 7]] * B)
    depths = torch.tensor([[1, 2, 2, 3, 1, 2, 3, 3, 4]] * B)
    tokens = torch.from_numpy(rng.integers(1, 1000, (B, n)))
    mask = packed_tree_mask_ref(parents, torch.full((B,), n))
    reused.write_trees(tokens, depths, mask)
    once = reused.device_buffer.clone()
    reused.write_trees(tokens, depths, mask)
    assert torch.equal(reused.device_buffer, once)


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_the_tree_inputs_graph_writes_what_write_trees_writes(kernels):
    """``TreeInputsGraph`` (a chained step's trees written into the verification's inputs by one graph
    replay; on a CPU the same calls run eagerly), made after the step's ``fill_roots`` as a first use
    makes it (its capture writes placeholder trees), then written twice more with other trees, gives
    the inputs ``write_trees`` gives, byte for byte."""
    from kernels import REFERENCE
    from kernels.tree import packed_tree_mask_ref
    from runtime.static_layout import Bucket, StaticLayout
    from verify_service.accept_graph import TreeInputsGraph

    if kernels == "triton":
        pytest.importorskip("triton")
        from kernels.triton_set import TRITON as k
    else:
        k = REFERENCE
    rng = np.random.default_rng(5)
    B, n, dev = 3, 11, torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (on a GPU: a captured graph)
    want, got = (StaticLayout(Bucket(4, 16, True), 8, 256, 16, dev) for _ in range(2))
    graph = None
    for _ in range(3):
        parents = torch.tensor(np.stack([[rng.integers(-1, i) for i in range(n)] for _ in range(B)]))
        depths = torch.zeros(B, n, dtype=torch.int64)
        for b in range(B):
            for i in range(n):
                depths[b, i] = 1 if parents[b, i] < 0 else depths[b, parents[b, i]] + 1
        trees = torch.stack([torch.from_numpy(rng.integers(1, 1000, (B, n))), parents, depths,
                             torch.from_numpy(rng.integers(0, 99, (B, n)))]).to(dev)
        parents = parents.to(dev)
        step = (rng.integers(0, 100, B), rng.integers(1, 1000, B), [list(range(b, b + 8)) for b in range(B)], n)
        want.fill_roots(*step)
        want.write_trees(trees[0], trees[2], packed_tree_mask_ref(parents, torch.full((B,), n, device=dev)))
        got.fill_roots(*step)
        graph = graph or TreeInputsGraph(k, got, B, n)
        graph.write(trees)
        assert torch.equal(got.device_buffer, want.device_buffer)
