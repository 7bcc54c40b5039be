"""The Triton greedy argmax (kernels/argmax_triton.py) against ``argmax_ref`` (``torch.argmax``).

On a CPU it runs through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); on a
GPU, natively. Outputs and partials start as garbage (poisoned ``torch.empty``), rows are strided
views of a wider buffer, vocabularies are not multiples of the chunk size, and the values that
decide an argmax's ties and order (equal maxima in other chunks, NaN, -inf, -0.0) are planted.
"""

import pytest
import torch

triton = pytest.importorskip("triton")

from kernels import REFERENCE, select_kernels  # noqa: E402
from kernels.argmax_triton import CHUNK, argmax_triton  # noqa: E402
from kernels.sampling import argmax_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCABS = [1, 97, CHUNK, CHUNK + 1, 3 * CHUNK + 5] + ([49152, 128256] if DEVICE == "cuda" else [])

pytestmark = pytest.mark.usefixtures("poisoned_empty")  # tests/conftest.py


def strided(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random logits [rows, vocab] as columns 3 .. 3 + vocab of a wider buffer (strided rows)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab + 7, generator=gen) * 4).to(dtype)[:, 3:3 + vocab]


def check(x: torch.Tensor) -> None:
    got = argmax_triton(x.to(DEVICE))
    assert got.dtype == torch.int64 and got.shape == (x.shape[0],)
    assert torch.equal(got.cpu(), argmax_ref(x)), (got.cpu(), argmax_ref(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("rows", [1, 5])
def test_random_logits_give_torch_argmax(dtype, vocab, rows):
    check(strided(rows, vocab, dtype, seed=vocab + rows))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [CHUNK + 1, 3 * CHUNK + 5])
def test_ties_order_and_special_values_follow_torch(dtype, vocab):
    """Row by row: the maximum repeated in later chunks and in the same chunk (the first wins); a NaN
    (it wins, the first of two); every value -inf (index 0); -0.0 before +0.0 as the only maxima (equal:
    the first); +inf beside a NaN; the maximum in the very last column."""
    x = strided(8, vocab, dtype, seed=vocab).float().clamp(-50, 50)
    x[0, [vocab - 1, 7, CHUNK, 9]] = 100.0  # equal maxima across chunks: index 7
    x[1, [vocab - 1, CHUNK - 2]] = float("nan")  # NaN above everything: the first one
    x[1, 5] = float("inf")
    x[2] = float("-inf")  # nothing better than -inf: index 0
    x[3] = -1.0
    x[3, [CHUNK, 4]] = torch.tensor([-0.0, 0.0])  # -0.0 == +0.0: the first of them (index 4)
    x[4] = -1.0
    x[4, 11] = -0.0  # the only maximum is -0.0
    x[4, CHUNK] = 0.0  # equal to it, later
    x[5, vocab - 1] = 1e4  # the last column
    x[6, 0] = float("inf")
    x[6, vocab - 1] = float("inf")  # two +inf: the first
    x[7] = 0.5  # all equal: index 0
    check(x.to(dtype))


def test_empty_batch_and_kernel_sets():
    assert argmax_triton(torch.zeros(0, 50, device=DEVICE)).shape == (0,)
    assert REFERENCE.argmax is argmax_ref
    assert select_kernels(DEVICE, "triton").argmax is argmax_triton
