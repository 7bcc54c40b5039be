"""``kernels/host_copy.py``: small host arrays onto the device without waiting for the queued work."""

import time

import numpy as np
import pytest
import torch

from kernels.host_copy import take_rows, to_device


def test_values_and_dtypes():
    assert torch.equal(to_device([3, -1, 2**40], torch.int64, "cpu"), torch.tensor([3, -1, 2**40]))
    got = to_device(np.array([0.5, 2.0]), torch.float32, "cpu")
    assert got.dtype == torch.float32 and got.tolist() == [0.5, 2.0]


def test_take_rows_is_a_view_when_consecutive_else_a_gather():
    t = torch.arange(20).view(10, 2)
    view = take_rows(t, [2, 3, 4])
    assert view.data_ptr() == t[2].data_ptr() and torch.equal(view, t[2:5])
    assert torch.equal(take_rows(t, [1, 4, 9]), t[[1, 4, 9]])
    assert torch.equal(take_rows(t, [5, 2]), t[[5, 2]])  # (not increasing: gathered in that order)
    assert torch.equal(take_rows(t, [2, 4, 4]), t[[2, 4, 4]])  # the span of consecutive rows, not them
    assert take_rows(t, [2, 3, 4], increasing=True).data_ptr() == view.data_ptr()
    assert torch.equal(take_rows(t, [1, 4], increasing=True), t[[1, 4]])


def test_take_rows_takes_an_int64_array_as_a_list():
    t = torch.arange(20).view(10, 2)
    view = take_rows(t, np.arange(3, 7), increasing=True)
    assert view.data_ptr() == t[3].data_ptr() and torch.equal(view, t[3:7])
    assert torch.equal(take_rows(t, np.array([1, 4, 9]), increasing=True), t[[1, 4, 9]])
    assert torch.equal(take_rows(t, np.array([5, 2])), t[[5, 2]])
    assert take_rows(t, np.array([], dtype=np.int64)).shape == (0, 2)


@pytest.mark.gpu
def test_copies_queued_behind_device_work_land_intact():
    """Many copies in flight behind queued work, an array of 20,000 entries among them: each lands intact
    (a pinned block is reused only once its copy has run)."""
    torch.cuda._sleep(50_000_000)
    outs = [to_device(list(range(i, i + 100)), torch.int64, "cuda") for i in range(48)]
    big = to_device(np.arange(20_000), torch.int64, "cuda")
    torch.cuda.synchronize()
    assert all(o.tolist() == list(range(i, i + 100)) for i, o in enumerate(outs))
    assert torch.equal(big.cpu(), torch.arange(20_000))


@pytest.mark.gpu
def test_the_copy_does_not_wait_for_queued_work():
    """A pageable copy (``torch.tensor(..., device="cuda")``) returns only once the work queued before it
    has run; ``to_device`` and ``take_rows`` return at once, and their results follow that work."""
    t = torch.arange(64, device="cuda").view(32, 2)
    for _ in range(4):  # the caching host allocator's first blocks (allocating one waits for the device)
        take_rows(t, [0, 3, 9])
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of queued device work
    start = time.perf_counter()
    idx = to_device([1, 5, 7], torch.int64, "cuda")
    rows = take_rows(t, [0, 3, 9])
    queued = time.perf_counter() - start
    torch.cuda.synchronize()
    assert queued < 0.02, f"waited {queued:.3f} s for the queued work"
    assert idx.tolist() == [1, 5, 7] and rows[:, 0].tolist() == [0, 6, 18]
    torch.cuda._sleep(200_000_000)
    start = time.perf_counter()
    torch.tensor([1, 5, 7], device="cuda")
    assert time.perf_counter() - start > 0.02  # (the pageable copy this replaces does wait)
