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
