"""The Triton projection matmul against F.linear: ragged row counts, odd shapes, every tile config.

On a CPU the kernel runs through Triton's interpreter (float32 dots); natively on a GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.linear_triton import LinearConfig, linear_config, linear_ref, linear_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64, 130])
@pytest.mark.parametrize("n, k", [(96, 64), (80, 200)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_reference(rows, n, k, dtype):
    g = torch.Generator().manual_seed(rows * 7 + n)
    x = torch.randn(rows, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype).to(DEVICE)
    got = linear_triton(x, w)
    want = linear_ref(x.float(), w.float())
    assert got.shape == (rows, n) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("cfg", [LinearConfig(16, 16, 32), LinearConfig(16, 32, 256), LinearConfig(64, 64, 64),
                                 LinearConfig(128, 128, 64)])
def test_every_config_matches_reference(cfg):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 72, generator=g).to(DEVICE)  # leading dims fold into rows
    w = torch.randn(40, 72, generator=g).to(DEVICE)
    torch.testing.assert_close(linear_triton(x, w, cfg), linear_ref(x, w), atol=1e-4, rtol=1e-4)


def test_config_by_rows():
    assert linear_config(1).block_m == 16 and linear_config(64).block_m == 64 and linear_config(65).block_m == 128


def test_no_rows():
    w = torch.randn(8, 16, device=DEVICE)
    assert linear_triton(torch.empty(0, 16, device=DEVICE), w).shape == (0, 8)
