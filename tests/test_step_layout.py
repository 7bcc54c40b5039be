"""The step layout: one host-to-device copy carries every array of a step, masks included."""

import numpy as np
import torch

from kernels import REFERENCE
from runtime.step_layout import SeqChunk, Staging, layout_step


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
