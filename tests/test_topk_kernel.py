"""The Triton draft top-k (kernels/topk_triton.py) against ``draft_topk_ref``.

On a CPU it runs through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); on a
GPU, natively. Outputs start as NaN / garbage (poisoned ``torch.empty``), rows are strided views
of a wider buffer, vocabularies are not multiples of the chunk size.
"""

import pytest
import torch

triton = pytest.importorskip("triton")

from kernels import select_kernels  # noqa: E402
from kernels.topk_triton import BLOCK, draft_topk_triton  # noqa: E402
from kernels.tree import draft_topk_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


pytestmark = pytest.mark.usefixtures("poisoned_empty")  # tests/conftest.py


@pytest.mark.parametrize("vocab", [16, 1000, BLOCK + 1, 32000, 49152])
@pytest.mark.parametrize("k", [1, 10])
def test_equals_the_reference(vocab, k):
    """Distinct random logits (no ties): the reference's ids and log-probs, from logits and from
    log-probs, rows strided inside a wider buffer."""
    gen = torch.Generator().manual_seed(vocab * 10 + k)
    rows = 7 if vocab <= 4096 else 2  # (the interpreter runs a program per row and chunk: real vocabularies, fewer rows)
    wide = torch.randn(rows, vocab + 5, generator=gen) * 4
    logits = wide[:, 3:3 + vocab]  # strided rows
    d2t = torch.randint(0, 50, (vocab,), generator=gen)
    for x in (logits, torch.log_softmax(logits, dim=-1)):
        want_ids, want_lp = draft_topk_ref(x, k, d2t)
        got_ids, got_lp = draft_topk_triton(x.to(DEVICE), k, d2t.to(DEVICE))
        assert got_ids.dtype == torch.int64 and got_lp.dtype == torch.float32
        assert torch.equal(got_ids.cpu(), want_ids)
        torch.testing.assert_close(got_lp.cpu(), want_lp, rtol=1e-5, atol=1e-5)


def test_bfloat16_logits_with_ties():
    """bfloat16 logits repeat values: the same log-probs as the reference, each id's own logit, and
    equal values in ascending draft id."""
    gen = torch.Generator().manual_seed(3)
    vocab, k = 32000, 10
    logits = (torch.randn(5, vocab, generator=gen) * 2).to(torch.bfloat16)
    d2t = torch.zeros(vocab, dtype=torch.int64)
    want_ids, want_lp = draft_topk_ref(logits, k, d2t)
    got_ids, got_lp = (t.cpu() for t in draft_topk_triton(logits.to(DEVICE), k, d2t.to(DEVICE)))
    torch.testing.assert_close(got_lp, want_lp, rtol=1e-5, atol=1e-5)
    lsm = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(lsm.gather(1, got_ids), got_lp, rtol=1e-5, atol=1e-5)
    for r in range(5):
        assert len(set(got_ids[r].tolist())) == k
        for i in range(k - 1):
            if got_lp[r, i] == got_lp[r, i + 1]:
                assert got_ids[r, i] < got_ids[r, i + 1]


def test_ties_go_to_the_lower_id_across_chunks():
    vocab = 3 * BLOCK
    x = torch.full((1, vocab), -5.0)
    x[0, [2 * BLOCK + 7, 7, BLOCK + 7]] = 1.0  # one in each chunk, the same value
    ids, lp = draft_topk_triton(x.to(DEVICE), 3, torch.zeros(vocab, dtype=torch.int64, device=DEVICE))
    assert ids.cpu().tolist() == [[7, BLOCK + 7, 2 * BLOCK + 7]]


def test_rows_with_fewer_finite_entries_than_k():
    """-inf logits (a masked vocabulary): the finite entries first, then distinct ids at -inf."""
    vocab, k = 40, 10
    x = torch.full((2, vocab), float("-inf"))
    x[0, [3, 17, 30]] = torch.tensor([0.5, 2.0, 1.0])
    x[1] = torch.arange(vocab, dtype=torch.float32)
    ids, lp = (t.cpu() for t in draft_topk_triton(x.to(DEVICE), k, torch.zeros(vocab, dtype=torch.int64,
                                                                                 device=DEVICE)))
    assert ids[0, :3].tolist() == [17, 30, 3]
    assert torch.isinf(lp[0, 3:]).all() and len(set(ids[0].tolist())) == k
    assert all(0 <= i < vocab for i in ids[0].tolist())
    assert ids[1].tolist() == list(range(vocab - 1, vocab - 1 - k, -1))


def test_no_rows_and_bad_k():
    empty_ids, empty_lp = draft_topk_triton(torch.zeros(0, 100, device=DEVICE), 4,
                                            torch.zeros(100, dtype=torch.int64, device=DEVICE))
    assert empty_ids.shape == (0, 4) and empty_lp.shape == (0, 4)
    with pytest.raises(AssertionError):
        draft_topk_triton(torch.zeros(2, 5, device=DEVICE), 6, torch.zeros(5, dtype=torch.int64, device=DEVICE))


def test_the_triton_set_uses_it():
    assert select_kernels("cuda", "triton").draft_topk is draft_topk_triton
