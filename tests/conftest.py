import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Without a GPU, Triton kernels run on CPU tensors through Triton's interpreter. Triton reads
# the switch when a kernel is defined, so it is set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (``make test`` runs ``-n auto``) each worker takes its share of the cores for
# torch's own threads: two workers on two cores, each with two threads, would spin on each other.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


def _row_invariant_interpreter_dot() -> None:
    """Make the interpreter's ``tl.dot`` compute every output element the same way.

    The interpreter emulates ``tl.dot`` with ``np.matmul``, i.e. an OpenBLAS sgemm micro-kernel,
    and that kernel does not sum every output element in the same order. With numpy's bundled
    OpenBLAS 0.3.30 on an AVX-512 AMD EPYC (core ``Haswell``), a (64, K) @ (K, N) product gives,
    for the very same row of operands, a sequential FMA chain in rows 6..11 (mod 12), another
    order in rows 0..5 (mod 12) and two interleaved partial sums in the tail rows 60..63; operands,
    shapes, strides and threads play no part, only the row. So a query's float32 scores, and a
    token's ``linear_exact`` outputs, change in their last bit with the row they occupy in a tile
    (a decode step puts a token's rows at 0..3, a tree step at 4 * node), and the batch-invariance
    tests in test_exact_kernels.py fail on CPUs whose dispatched kernel does this and pass on
    others. It is no property of the kernels: on a GPU every element of a tile's dot is computed
    by the same instructions in the same order, so those tests stay strict there.

    The replacement sums the exact float64 products (products of float32, bf16 or fp16 values are
    exact in float64) over k in order, with elementwise ufuncs only (correctly rounded, no FMA
    contraction), and rounds once to the accumulator's dtype: the same bits for an element
    wherever it sits, whatever the CPU, its SIMD width or the operands' strides, and no less
    accurate than the float32 GEMM it replaces. Integer dots are exact in any order and keep
    Triton's implementation.
    """
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:  # no triton: the kernel tests skip themselves
        return
    blas_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not np.issubdtype(d.data.dtype, np.floating):
            return blas_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        a_data, b_data = a.data, b.data
        if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or \
           (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):  # as Triton's: fp8 operands via fp16
            a_data = interpreter._convert_float(a_data, a.dtype, interpreter.tl.float16, None).view(np.float16)
            b_data = interpreter._convert_float(b_data, b.dtype, interpreter.tl.float16, None).view(np.float16)
        a64, b64 = a_data.astype(np.float64), b_data.astype(np.float64)
        acc = a64[..., :, 0, None] * b64[..., None, 0, :]
        for k in range(1, a64.shape[-1]):
            acc += a64[..., :, k, None] * b64[..., None, k, :]
        return interpreter.TensorHandle(acc.astype(d.data.dtype) + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _row_invariant_interpreter_dot()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def test_device() -> str:
    """Device for engine tests: EAGLE3_TEST_DEVICE, else cpu."""
    return os.environ.get("EAGLE3_TEST_DEVICE", "cpu")


@pytest.fixture
def poisoned_empty(monkeypatch):
    """``torch.empty`` returns NaN-filled float tensors and -7-filled integer ones while a test runs:
    a kernel that leaves part of an output unwritten shows it."""
    empty = torch.empty

    def bad_empty(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out.fill_(-7)

    monkeypatch.setattr(torch, "empty", bad_empty)
