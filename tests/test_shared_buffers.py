"""Shared buffers between processes: POSIX shared memory on the CPU, CUDA IPC on the GPU.

Importers run in separate processes, as the draft service would: spawned children for the
round trips, and a fresh interpreter (with its own resource tracker) for the check that an
importer exiting leaves the exporter's segment alone.
"""

import importlib.util
import multiprocessing
import pickle
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from common.errors import SharedBufferError
from link.shared_buffers import CUDA_IPC, SHM, BufferExporter, BufferImporter, host_identity

ROOT = Path(__file__).resolve().parents[1]


def feature_values() -> torch.Tensor:
    return torch.arange(96, dtype=torch.float32).view(8, 12).to(torch.bfloat16)  # exact in bf16


def table_values() -> torch.Tensor:
    return torch.arange(10, dtype=torch.int64) * 1_000_000_007  # needs all 64 bits


def in_spawned_child(fn, *args):
    """Run fn(*args) in a fresh spawned process; its exceptions re-raise here."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def child_round_trip(descs, device: str) -> None:
    """Importer side: check the exporter's values, then write new ones through the same memory."""
    importer = BufferImporter(torch.device(device))
    features, table = (importer.open(desc) for desc in descs)
    assert features.device.type == table.device.type == torch.device(device).type
    assert torch.equal(features.cpu(), feature_values()) and torch.equal(table.cpu(), table_values())
    features.neg_()
    table.add_(1)
    if features.is_cuda:
        torch.cuda.synchronize()  # the parent reads through another context: finish the writes
    del features, table  # drop the tensors before close()
    importer.close()


def exported_pair(exporter: BufferExporter):
    features = exporter.allocate("features", (8, 12), torch.bfloat16)
    features.copy_(feature_values())
    table = exporter.share("table", table_values().to(exporter.device))
    return features, table


def check_round_trip(device: str) -> None:
    with BufferExporter(torch.device(device)) as exporter:
        features, table = exported_pair(exporter)
        in_spawned_child(child_round_trip, exporter.descriptors(), device)
        if features.is_cuda:
            torch.cuda.synchronize()
        assert torch.equal(features.cpu(), -feature_values())
        assert torch.equal(table.cpu(), table_values() + 1)


# --- CPU: POSIX shared memory ---------------------------------------------------------


def test_descriptors_describe_the_buffers():
    with BufferExporter(torch.device("cpu"), generation=42) as exporter:
        exported_pair(exporter)
        features, table = exporter.descriptors()
    assert (features.name, features.backend, features.shape, features.dtype) == ("features", SHM, (8, 12), "bfloat16")
    assert (table.shape, table.dtype, table.nbytes) == ((10,), "int64", 80)
    assert features.generation == table.generation == 42 and features.host_id == host_identity()
    assert features.offset_bytes == 0 and features.handle == b"" and features.shm_name
    assert BufferExporter(torch.device("cpu")).generation != BufferExporter(torch.device("cpu")).generation


def test_shm_round_trip_through_a_spawned_process():
    check_round_trip("cpu")


CHILD_THAT_EXITS_WITHOUT_CLOSE = """
import pickle, sys
import torch
from link.shared_buffers import BufferImporter
BufferImporter(torch.device("cpu")).open(pickle.load(sys.stdin.buffer)).fill_(7)
"""


def test_segment_survives_an_independent_importer_exiting():
    # A fresh interpreter has its own resource tracker, as the draft service does; had it
    # registered the segment, that tracker would unlink it (with a "leaked" warning) at exit.
    with BufferExporter(torch.device("cpu")) as exporter:
        table = exporter.share("table", table_values())
        (desc,) = exporter.descriptors()
        child = subprocess.run([sys.executable, "-c", CHILD_THAT_EXITS_WITHOUT_CLOSE], input=pickle.dumps(desc),
                               cwd=ROOT, capture_output=True, timeout=120)
        assert child.returncode == 0, child.stderr.decode()
        assert b"leaked" not in child.stderr
        assert torch.equal(table, torch.full((10,), 7))
        with BufferImporter(torch.device("cpu")) as importer:
            assert torch.equal(importer.open(desc), torch.full((10,), 7))  # the name still maps


def test_close_unlinks_the_segment_but_never_unmaps_under_a_live_tensor():
    exporter = BufferExporter(torch.device("cpu"))
    table = exporter.share("table", table_values())
    (desc,) = exporter.descriptors()
    exporter.close()
    assert torch.equal(table, table_values())  # still mapped while this tensor lives
    with pytest.raises(SharedBufferError, match="does not exist: its exporter has closed, exited or restarted"):
        BufferImporter(torch.device("cpu")).open(desc)


def test_a_descriptor_may_point_inside_a_segment():
    with BufferExporter(torch.device("cpu")) as exporter, BufferImporter(torch.device("cpu")) as importer:
        exporter.share("table", table_values())
        (desc,) = exporter.descriptors()
        tail = importer.open(replace(desc, name="tail", shape=(2, 2), offset_bytes=6 * 8))
        assert torch.equal(tail, table_values()[6:].view(2, 2))
        with pytest.raises(SharedBufferError, match="not aligned to int64"):
            importer.open(replace(desc, shape=(1,), offset_bytes=4))
        with pytest.raises(SharedBufferError, match="holds 80 bytes, the descriptor needs 88"):
            importer.open(replace(desc, shape=(11,)))


@pytest.mark.parametrize("change, message", [
    ({"host_id": "elsewhere/0"}, "exported on host 'elsewhere/0'.*only work between processes on one host"),
    ({"backend": CUDA_IPC, "handle": bytes(64)}, "is a cuda_ipc buffer but this importer on cpu uses shm"),
    ({"shm_name": "eagle3-0-0-gone"}, "segment 'eagle3-0-0-gone' does not exist"),
    ({"dtype": "complex_bfloat7"}, "unknown dtype 'complex_bfloat7'"),
])
def test_unusable_descriptors_are_refused(change, message):
    with BufferExporter(torch.device("cpu")) as exporter, BufferImporter(torch.device("cpu")) as importer:
        exporter.share("table", table_values())
        (desc,) = exporter.descriptors()
        with pytest.raises(SharedBufferError, match=message) as error:
            importer.open(replace(desc, **change))
    assert error.value.grpc_code == "FAILED_PRECONDITION"


def test_devices_without_a_backend_are_refused():
    with pytest.raises(SharedBufferError, match="no shared-buffer backend for device meta"):
        BufferExporter(torch.device("meta"))


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed")
def test_cuda_without_cupy_says_which_extra_to_install():
    with pytest.raises(SharedBufferError, match=r"need cupy.*\[cuda12\].*\[cuda13\]"):
        BufferExporter(torch.device("cuda"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_empty_buffers_can_be_shared(device):
    with BufferExporter(torch.device(device)) as exporter, BufferImporter(torch.device(device)) as importer:
        exporter.allocate("empty", (0, 4), torch.bfloat16)
        (desc,) = exporter.descriptors()
        assert desc.nbytes == 0 and importer.open(desc).shape == (0, 4)


# --- GPU: CUDA IPC -------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_ipc_round_trip_through_a_spawned_process():
    check_round_trip("cuda")


@pytest.mark.gpu
def test_cuda_ipc_refuses_another_gpu():
    with BufferExporter(torch.device("cuda")) as exporter, BufferImporter(torch.device("cuda")) as importer:
        exporter.share("table", table_values().cuda())
        (desc,) = exporter.descriptors()
        assert desc.backend == CUDA_IPC and len(desc.handle) == 64 and desc.device_uuid
        with pytest.raises(SharedBufferError, match="peers must share one GPU"):
            importer.open(replace(desc, device_uuid="GPU-00000000-0000-0000-0000-000000000000"))


@pytest.mark.gpu
def test_a_cuda_exporter_shares_host_buffers_as_shared_memory():
    """The tree buffers: host memory beside the CUDA IPC buffers, mapped by a CUDA importer too."""
    with BufferExporter(torch.device("cuda")) as exporter, BufferImporter(torch.device("cuda")) as importer:
        host = exporter.allocate("trees", (3, 4), torch.int64, host=True)
        exporter.share("table", table_values().cuda())
        trees, table = sorted(exporter.descriptors(), key=lambda d: d.name != "trees")
        assert (trees.backend, table.backend) == (SHM, CUDA_IPC) and trees.shm_name and not trees.device_uuid
        mapped = importer.open(trees)
        assert mapped.device.type == "cpu" and host.device.type == "cpu"
        mapped[1, 2] = 7
        assert host[1, 2] == 7  # one memory
        with pytest.raises(SharedBufferError, match="does not exist"):
            importer.open(replace(trees, shm_name="eagle3-0-0-gone"))


@pytest.mark.gpu
def test_cuda_ipc_importer_in_the_exporting_process_gets_the_same_memory():
    with BufferExporter(torch.device("cuda")) as exporter, BufferImporter(torch.device("cuda")) as importer:
        table = exporter.share("table", table_values().cuda())
        (desc,) = exporter.descriptors()
        imported = importer.open(desc)
        assert imported.data_ptr() == table.data_ptr()


def child_opens_sub_ranges(desc) -> None:
    """Open one allocation twice (whole, and a window at an offset): one IPC mapping serves both."""
    importer = BufferImporter(torch.device("cuda"))
    whole = importer.open(desc)
    window = importer.open(replace(desc, name="window", shape=(4,), offset_bytes=3 * 8))
    assert torch.equal(window.cpu(), table_values()[3:7])
    assert window.data_ptr() == whole.data_ptr() + 3 * 8
    window.fill_(-1)
    torch.cuda.synchronize()
    del whole, window
    importer.close()


@pytest.mark.gpu
def test_cuda_ipc_exports_allocation_bases_and_imports_offsets():
    with BufferExporter(torch.device("cuda")) as exporter:
        table = exporter.share("table", table_values().cuda())
        (desc,) = exporter.descriptors()
        assert desc.offset_bytes == 0  # every buffer is its own allocation
        in_spawned_child(child_opens_sub_ranges, desc)
        torch.cuda.synchronize()
        expected = table_values()
        expected[3:7] = -1
        assert torch.equal(table.cpu(), expected)
