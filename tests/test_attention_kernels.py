"""Triton paged attention and KV write against their pure-torch references.

Ragged batches mix decode tokens, prefill chunks over a cached prefix, target tree steps and
draft-style tree levels (mask_start before the new tokens); every cache slot no sequence owns
holds NaN, so a kernel that reads outside its sequence fails loudly. On a CPU the kernels run
through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); on a GPU, natively.
"""

import dataclasses

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from kernels import REFERENCE, select_kernels  # noqa: E402
from kernels.attention import paged_attention_ref, unpack_mask, write_kv_ref  # noqa: E402
from kernels.attention_triton import pack_mask, paged_attention_triton, write_kv_triton  # noqa: E402
from kernels.tree import tree_mask_ref  # noqa: E402
from runtime.step_layout import SeqChunk, layout_step  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 16
TRITON_SET = select_kernels(DEVICE, "triton")


def tree_mask(parents: list[int]) -> np.ndarray:
    n = len(parents)
    return tree_mask_ref(torch.tensor([parents]), torch.tensor([n]))[0].numpy()


def build(cases, kvh, d, dtype, seed):
    """Caches with every sequence's KV in shuffled blocks (NaN elsewhere) and one step's chunks.

    ``cases``: (cached, new_tokens, mask, mask_start) per sequence; mask None = causal.
    """
    gen = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n, _, _ in cases]
    need = [-(-n // BLOCK) for n in lens]
    order = torch.randperm(sum(need) + 3, generator=gen).tolist()
    k_cache = torch.full((sum(need) + 3, BLOCK, kvh, d), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    chunks, at = [], 0
    for (cached, new, mask, mask_start), n, blocks in zip(cases, lens, need):
        table = order[at:at + blocks]
        at += blocks
        slots = torch.tensor([table[i // BLOCK] * BLOCK + i % BLOCK for i in range(n)])
        k_cache.view(-1, kvh, d)[slots] = torch.randn(n, kvh, d, generator=gen).to(dtype)
        v_cache.view(-1, kvh, d)[slots] = torch.randn(n, kvh, d, generator=gen).to(dtype)
        chunks.append(SeqChunk(list(range(new)), cached, table, custom_mask=mask, mask_start=mask_start))
    return k_cache.to(DEVICE), v_cache.to(DEVICE), chunks


TREE = [-1, -1, 0, 0, 1, 4, 2]  # 7 nodes below the root
# 69 nodes below the root, each under an earlier one: the masked keys span several 32-key tiles
# and each row's mask three int32 words
WIDE_TREE = [-1] + [int(p) for p in torch.randint(0, 1 << 20, (68,), generator=torch.Generator().manual_seed(5)) % torch.arange(1, 69)]


@pytest.mark.parametrize("kvh, g, d, dtype", [(2, 2, 16, torch.float32), (1, 3, 32, torch.float32),
                                              (2, 4, 64, torch.bfloat16), (3, 1, 16, torch.float16),
                                              (2, 2, 48, torch.float32)])  # 48: head_dim short of its tile
@pytest.mark.parametrize("batch", ["decode", "mixed", "tree", "draft_levels", "long_decode"])
def test_paged_attention_matches_reference(kvh, g, d, dtype, batch):
    cases = {
        "decode": [(5, 1, None, None), (16, 1, None, None), (33, 1, None, None)],
        "mixed": [(0, 19, None, None), (5, 1, None, None), (21, 7, None, None)],
        # target tree step: root + 7 nodes at the end of a 20-token prefix, beside a decode token
        "tree": [(20, 8, tree_mask(TREE), 20), (9, 1, None, None)],
        # draft level 2: 3 new nodes after 3 level-1 nodes, each seeing one level-1 ancestor and itself
        "draft_levels": [(12 + 3, 3, np.array([[1, 0, 0, 1, 0, 0], [0, 1, 0, 0, 1, 0], [0, 0, 1, 0, 0, 1]], bool), 12),
                         (40, 4, np.tril(np.ones((4, 4), bool)), 40)],
        "long_decode": [(700, 1, None, None), (64, 1, None, None)],  # splits over the KV length
    }[batch]
    k_cache, v_cache, chunks = build(cases, kvh, d, dtype, seed=kvh * 100 + d)
    q = torch.randn(sum(len(c.token_ids) for c in chunks), kvh * g, d, generator=torch.Generator().manual_seed(1))
    q = q.to(dtype).to(DEVICE)
    scale = d ** -0.5
    ref_meta = layout_step(chunks, BLOCK, torch.device(DEVICE), REFERENCE).meta
    tri_meta = layout_step(chunks, BLOCK, torch.device(DEVICE), TRITON_SET).meta
    # The reference gathers whole blocks, so it gets the caches with the poison zeroed.
    want = paged_attention_ref(q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), ref_meta, scale)
    got = paged_attention_triton(q, k_cache, v_cache, tri_meta, scale)
    assert got.shape == want.shape and torch.isfinite(got).all()
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("kvh, g, d, dtype", [(2, 2, 16, torch.float32), (1, 3, 32, torch.float32),
                                              (2, 4, 64, torch.bfloat16)])
def test_a_ragged_graphed_step_matches_reference(kvh, g, d, dtype):
    """A graphed prompt step's layout (``meta.ragged``: each program finds its chunk and tile from
    query_start_loc, the grid fixed by the layout's capacity of tokens), with padding sequences and
    rows past the step's: every real row equals the reference on the eager layout. The padding
    rows' queries are NaN: a program that took one for a real row fails the comparison. The
    reference runs the same static layout too (the CPU's stand-in for the graph)."""
    from kernels.attention import prepare_attention_ref
    from runtime.static_layout import Bucket, StaticLayout
    cases = [(0, 19, None, None), (5, 1, None, None), (21, 40, None, None), (0, 3, None, None), (70, 2, None, None)]
    k_cache, v_cache, chunks = build(cases, kvh, d, dtype, seed=11)
    T, capacity = sum(len(c.token_ids) for c in chunks), 96
    lay = StaticLayout(Bucket(8, capacity, False, ragged=True), 8, 128, BLOCK, torch.device(DEVICE))
    lay.fill(chunks)
    q = torch.randn(capacity, kvh * g, d, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    scale = d ** -0.5
    clean_k, clean_v = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    want = paged_attention_ref(q[:T], clean_k, clean_v, layout_step(chunks, BLOCK, torch.device(DEVICE), REFERENCE).meta,
                               scale)
    on_static = paged_attention_ref(q, clean_k, clean_v, prepare_attention_ref(lay.meta), scale)[:T]
    q[T:] = float("nan")
    got = paged_attention_triton(q, k_cache, v_cache, lay.meta, scale)[:T]
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(on_static.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("block_m, block_n", [(16, 32), (64, 64), (128, 32), (128, 64), (128, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_tile_config_matches_reference(block_m, block_n, dtype):
    """Prefill, tree and long decode rows under each tile shape: the split of the keys into an
    open prefix and a masked tail, and the row tiling, never change the result."""
    from kernels.attention_triton import AttentionConfig
    kvh, g, d = 2, 4, 64
    cases = [(0, 40, None, None), (90, 9, None, None), (20, 8, tree_mask(TREE), 20), (700, 1, None, None),
             (45, 70, tree_mask(WIDE_TREE), 45)]  # (the tree after an unaligned prefix of 45 keys)
    k_cache, v_cache, chunks = build(cases, kvh, d, dtype, seed=7)
    q = torch.randn(sum(len(c.token_ids) for c in chunks), kvh * g, d, generator=torch.Generator().manual_seed(2))
    q = q.to(dtype).to(DEVICE)
    want = paged_attention_ref(q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0),
                               layout_step(chunks, BLOCK, torch.device(DEVICE), REFERENCE).meta, d ** -0.5)
    got = paged_attention_triton(q, k_cache, v_cache, layout_step(chunks, BLOCK, torch.device(DEVICE), TRITON_SET).meta,
                                 d ** -0.5, AttentionConfig(block_m, block_n))
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_long_decode_uses_several_splits():
    """The flash-decoding path (partials + combine) is what the long case above exercised."""
    from kernels.attention_triton import _CPU_SLOTS, _num_splits
    k_cache, v_cache, chunks = build([(700, 1, None, None)], 2, 16, torch.float32, seed=0)
    meta = layout_step(chunks, BLOCK, torch.device(DEVICE), TRITON_SET).meta
    assert _num_splits(meta.num_seqs * 2, meta.max_seq_len, 64, _CPU_SLOTS) > 1


@pytest.mark.parametrize("n_regs, shared, warps, want", [
    (255, 229376, 8, 1),  # 128 x 128 tiles, 2 stages (an H200's compiled variant): one program an SM
    (255, 98816, 4, 2),  # 64 x 64, 3 stages: two, by registers and by shared memory alike
    (145, 39424, 4, 3),  # the decode tile, 16 x 64: three, by registers (152 rounded up: 4864 a warp)
    (32, 0, 4, 16),  # small: threads (2048 an SM) limit it
])
def test_programs_per_sm_from_a_compiled_variants_resources(n_regs, shared, warps, want):
    from types import SimpleNamespace
    from kernels.attention_triton import _programs_per_sm
    h200 = SimpleNamespace(regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=233472,
                           max_threads_per_multi_processor=2048)
    assert _programs_per_sm(n_regs, shared, warps, h200) == want


@pytest.mark.parametrize("programs, max_seq_len, block_n, slots, want", [
    (16, 32768, 128, 132, 8),  # a 64-token tree at 32K keys on an H200: one full wave (17 splits: 2.06 waves)
    (32, 4096, 64, 264, 8),  # the same tree at 4K keys, two programs an SM
    (8, 4096, 64, 396, 16),  # one-token decode at 4K: as many splits as 4 key tiles each allow
    (512, 4096, 64, 396, 1),  # batch-64 decode fills the GPU: no split
    (100, 4096, 64, 132, 1),  # 2 splits of 100 programs would take 2 waves
    (8, 32768, 64, 396, 49),
    (3, 100, 64, 132, 1),  # too short to split
])
def test_splits_fill_whole_waves(programs, max_seq_len, block_n, slots, want):
    from kernels.attention_triton import _num_splits
    assert _num_splits(programs, max_seq_len, block_n, slots) == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(6, BLOCK, 2, 8, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(6, BLOCK, 2, 8, generator=gen).to(dtype).to(DEVICE)
    k, v = (torch.randn(9, 2, 8, generator=gen).to(dtype).to(DEVICE) for _ in range(2))  # the model's dtype
    slots = torch.randperm(6 * BLOCK, generator=gen)[:9]
    slots[[2, 7]] = -1  # padding tokens of a graphed step: not written
    slots = slots.to(DEVICE)
    before = k_cache.clone()
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv_ref(ref_k, ref_v, k, v, slots)
    write_kv_triton(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    changed = (k_cache != before).flatten(2).any(-1).flatten().nonzero().flatten().cpu()
    assert set(changed.tolist()) <= set(slots[slots >= 0].cpu().tolist()) and len(changed) > 0


def test_pack_mask_bits():
    gen = torch.Generator().manual_seed(4)
    mask = torch.rand(5, 70, generator=gen) > 0.5
    packed = pack_mask(mask)
    assert packed.shape == (5, 3) and packed.dtype == torch.int32
    bits = (packed[:, :, None].long() >> torch.arange(32)) & 1  # (5, 3, 32)
    assert torch.equal(bits.view(5, 96)[:, :70].bool(), mask) and not bits.view(5, 96)[:, 70:].any()



@pytest.mark.parametrize("kind", ["reference", "triton", "exact"])
def test_every_prepare_attention_takes_a_packed_mask(kind):
    """A custom mask that comes packed into int32 words, with a spare zero word past its columns (as the
    draft's device proposal builds it), gives the bool mask's attention, bit for bit."""
    kernels = select_kernels(DEVICE, "reference" if kind == "reference" else "triton", exact=kind == "exact")
    level = np.array([[1, 0, 0, 1, 0, 0], [0, 1, 0, 0, 1, 0], [0, 0, 1, 0, 0, 1]], bool)
    k_cache, v_cache, chunks = build([(20, 8, tree_mask(TREE), 20), (12 + 3, 3, level, 12)], 2, 16, torch.float32, 3)
    if kind == "reference":  # the reference gathers whole blocks: no poison
        k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    meta = dataclasses.replace(layout_step(chunks, BLOCK, torch.device(DEVICE), REFERENCE).meta, dense_mask=None)
    words = torch.nn.functional.pad(pack_mask(meta.custom_mask), (0, 1))
    assert torch.equal(unpack_mask(words)[:, :meta.custom_mask.shape[1]], meta.custom_mask)
    q = torch.randn(meta.num_tokens, 4, 16, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    want, got = (kernels.paged_attention(q, k_cache, v_cache, kernels.prepare_attention(m), 0.25)
                 for m in (meta, dataclasses.replace(meta, custom_mask=words)))
    assert torch.equal(got, want)


def test_select_kernels():
    assert select_kernels("cpu") is REFERENCE and select_kernels("cuda", "reference") is REFERENCE
    assert select_kernels("cpu", "auto") is REFERENCE  # never the interpreter unless asked for
    assert select_kernels("cpu", "triton").name == "triton"
    with pytest.raises(ValueError, match="kernels must be one of"):
        select_kernels("cpu", "fast")


@pytest.mark.parametrize("splits", [1, 5, 16, 17, 40, 64])
def test_combine_merges_any_number_of_splits(splits):
    """The combine kernel reads a launch's splits in one block (``combine_block``): every count up to
    MAX_SPLITS merges to the softmax-weighted mean of the partials (splits that saw no key, lse -inf,
    weigh nothing), each token's first ``used`` of them."""
    from kernels.attention_triton import COMBINE_NARROW, MAX_SPLITS, _combine_kernel, combine_block
    assert splits <= MAX_SPLITS
    assert combine_block(splits) == (COMBINE_NARROW if splits <= COMBINE_NARROW else MAX_SPLITS)
    gen = torch.Generator().manual_seed(splits)
    T, H, D = 4, 2, 32
    part = torch.randn(splits, T, H, D, generator=gen)
    lse = torch.randn(splits, T, H, generator=gen) * 3
    if splits > 1:
        lse[splits // 2] = float("-inf")
    out = torch.empty(T, H, D)
    # Each token's splits holding keys; the last token's count is garbage (padding no program wrote):
    # clamped to the launch's splits.
    used = torch.tensor([splits, max(1, splits - 3), 1, 1 << 30], dtype=torch.int32)
    part[:, 1, :, :][max(1, splits - 3):] = float("nan")  # partials past a token's count: never read
    part[1:, 2] = float("nan")
    part, lse, used, out = part.to(DEVICE), lse.to(DEVICE), used.to(DEVICE), out.to(DEVICE)
    _combine_kernel[(T, H)](part, lse, used, out, splits, part.stride(0), part.stride(1), part.stride(2),
                            lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), D,
                            BLOCK_S=combine_block(splits), BLOCK_D=D, USE_GDC=False)
    for t, n in enumerate(used.clamp(max=splits).tolist()):
        w = torch.softmax(lse[:n, t] * np.log(2), dim=0)  # lse is in base 2
        want = (w[..., None] * part[:n, t]).sum(0)
        torch.testing.assert_close(out[t], want, atol=1e-5, rtol=1e-5)


def test_the_combines_blocks_compile_at_start_up():
    """``warm_combine`` launches the combine once for each of its two blocks (the narrow one, and
    ``MAX_SPLITS``), shaped as the attention launches it, so no launch compiles one while serving."""
    from kernels import attention_triton
    assert attention_triton.combine_block(2) == attention_triton.COMBINE_NARROW < attention_triton.MAX_SPLITS
    assert attention_triton.combine_block(attention_triton.COMBINE_NARROW + 1) == attention_triton.MAX_SPLITS
    blocks = []
    real = attention_triton.combine_block
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention_triton, "combine_block", lambda s: blocks.append(real(s)) or blocks[-1])
        attention_triton.warm_combine(torch.device(DEVICE), torch.float32, 4, 32)
    assert sorted(blocks) == [attention_triton.COMBINE_NARROW, attention_triton.MAX_SPLITS]


@pytest.mark.parametrize("splits", [3, 40])
def test_short_sequences_in_a_launch_of_many_splits(splits):
    """A graphed step's split count comes from its capacity: sequences far shorter than it use their
    first few splits only, and the rest of the launch reads nothing, yet every token's attention is
    the reference's. Decode, tree and prefill rows side by side with one long sequence."""
    from kernels.attention_triton import AttentionConfig
    kvh, g, d = 2, 2, 32
    cases = [(5, 1, None, None), (130, 1, None, None), (20, 8, tree_mask(TREE), 20), (0, 12, None, None),
             (700, 1, None, None)]
    k_cache, v_cache, chunks = build(cases, kvh, d, torch.float32, seed=11)
    q = torch.randn(sum(len(c.token_ids) for c in chunks), kvh * g, d, generator=torch.Generator().manual_seed(3))
    q = q.to(DEVICE)
    want = paged_attention_ref(q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0),
                               layout_step(chunks, BLOCK, torch.device(DEVICE), REFERENCE).meta, d ** -0.5)
    cfg = AttentionConfig(16, 16, splits=splits)
    assert 5 <= cfg.block_n and 700 > splits * cfg.block_n  # the shortest one split, the long one every split
    got = paged_attention_triton(q, k_cache, v_cache, layout_step(chunks, BLOCK, torch.device(DEVICE), TRITON_SET).meta,
                                 d ** -0.5, cfg)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("programs, want", [(8 * 17, 2), (3 * 2, 2), (8 * 33, 2), (8 * 49, 0), (64 * 8, 0)])
def test_only_launches_of_at_most_two_programs_an_sm_prefetch(programs, want):
    """On a 132-SM H200: the 8B decode at 4K (8 KV heads x 17 splits) and SmolLM2's (3 x 2) prefetch;
    the 8B at 32K (8 x 49) and batch 64 (512 programs), which lost by it, do not."""
    from kernels.attention_triton import prefetch_tiles
    assert prefetch_tiles(programs, 132, tiles=2) == want
    assert prefetch_tiles(programs, 132, tiles=0) == 0  # EAGLE3_ATTN_PREFETCH=0
