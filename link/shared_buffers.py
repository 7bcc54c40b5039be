"""Buffers that the verify and draft services map together, exchanged once at the handshake.

The verify service exports its big tensors (captured feature rows, the token-embedding
table, candidate-tree tensors); the draft service imports them. gRPC carries only the
small ``BufferDescriptor`` of each::

    exporter process                                   importer process
    BufferExporter.allocate("features") -> tensor      BufferImporter.open(desc) -> tensor
              |            descriptors() --- gRPC handshake ---> desc      |
              +--------------- the same physical memory -------------------+

Backends, chosen per buffer from the device, never a fallback from one to the other:
  cuda_ipc  CUDA device: one cudaMalloc per buffer, mapped by the peer through its IPC
            handle (the rules are in ``link.cuda_ipc``); both peers on one GPU.
  shm       CPU device, or a buffer both sides use on the host (``allocate(..., host=True)``:
            the candidate trees, which the verify side lays out on the host): one POSIX
            shared-memory segment per buffer, mapped by name.

Lifetime: the exporter keeps every buffer alive until ``close()``, which the owner calls
only after importers detached. Neither ``close()`` ever unmaps under a live tensor: memory
still viewed by tensors of this process is released when the last of them is dropped, so
callers should drop their tensors before (or soon after) closing.
"""

import _posixshmem  # shm_open/shm_unlink, what multiprocessing.shared_memory uses underneath
import logging
import math
import mmap
import os
import secrets
import socket
import warnings
from dataclasses import dataclass, replace
from multiprocessing import resource_tracker

import torch

from common.errors import SharedBufferError
from link import cuda_ipc

CUDA_IPC = "cuda_ipc"
SHM = "shm"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BufferDescriptor:
    """What the handshake carries for one buffer (plain fields; the gRPC layer converts it)."""

    name: str  # e.g. "features", "embedding", "tree_tokens"
    backend: str  # CUDA_IPC | SHM
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    generation: int  # the exporter's; a restarted exporter has a new one
    handle: bytes = b""  # cuda_ipc: cudaIpcMemHandle of the allocation base
    offset_bytes: int = 0  # from the allocation base (cuda_ipc) or segment start (shm)
    shm_name: str = ""  # shm: the segment name
    device_uuid: str = ""  # cuda_ipc: the exporter's GPU
    host_id: str = ""  # the exporter's host_identity()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_from_name(self.dtype).itemsize


def host_identity() -> str:
    """The kernel's boot id: equal for processes on one machine since its last boot.

    Containers on one host share the kernel, hence the boot id, while their hostnames
    differ; so the hostname is used only where no boot id exists (not Linux).
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def gpu_uuid(device: torch.device) -> str:
    """The physical GPU's UUID, the same in every process whatever CUDA_VISIBLE_DEVICES says."""
    return str(torch.cuda.get_device_properties(cuda_ipc.device_index(device)).uuid)


def backend_for(device: torch.device) -> str:
    if device.type == "cuda":
        return CUDA_IPC
    if device.type == "cpu":
        return SHM
    raise SharedBufferError(f"no shared-buffer backend for device {device}: use a CUDA device or the CPU")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise SharedBufferError(f"unknown dtype {name!r} in a buffer descriptor")
    return dtype


def _typed_view(data: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The uint8 ``data`` seen as a ``shape`` tensor of ``dtype`` (same memory)."""
    if data.numel() == 0:  # DLPack gives empty arrays stride 0, which view(dtype) rejects
        data = data.as_strided((0,), (1,))
    return data.view(dtype).view(shape)


class _ShmSegment:
    """One POSIX shared-memory segment mapped into this process.

    Built on shm_open + mmap rather than ``multiprocessing.shared_memory.SharedMemory``:
    - Before Python 3.13 SharedMemory registers even *attached* segments with the resource
      tracker, which unlinks them when the attaching process exits: the draft service
      exiting would delete the verify service's buffers. Here only the creator registers
      (so its segments are cleaned up if it dies without close()).
    - ``torch.frombuffer`` keeps a reference to the buffer object but no buffer export, so
      SharedMemory.close() unmaps under live tensors (a crash on the next read). Here each
      tensor holds a ``memoryview`` of the mmap, so mmap.close() refuses (BufferError) while
      a tensor is alive, and the mapping goes when the last such tensor does.
    """

    def __init__(self, name: str, mapping: mmap.mmap, creator: bool):
        self.name, self._mapping, self._creator = name, mapping, creator

    @classmethod
    def create(cls, name: str, nbytes: int) -> "_ShmSegment":
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))  # mmap cannot map 0 bytes
            mapping = mmap.mmap(fd, max(nbytes, 1))
        except OSError:
            _posixshmem.shm_unlink("/" + name)
            raise
        finally:
            os.close(fd)
        resource_tracker.register("/" + name, "shared_memory")
        return cls(name, mapping, creator=True)

    @classmethod
    def attach(cls, name: str, min_bytes: int, read_only: bool = False) -> "_ShmSegment":
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDONLY if read_only else os.O_RDWR, mode=0o600)
        except FileNotFoundError as error:
            raise SharedBufferError(
                f"shared-memory segment {name!r} does not exist: its exporter has closed, "
                "exited or restarted; redo the handshake to get fresh descriptors") from error
        try:
            size = os.fstat(fd).st_size
            if size < max(min_bytes, 1):
                raise SharedBufferError(
                    f"shared-memory segment {name!r} holds {size} bytes, the descriptor needs "
                    f"{min_bytes}: stale or mismatched descriptor")
            prot = mmap.PROT_READ if read_only else mmap.PROT_READ | mmap.PROT_WRITE
            return cls(name, mmap.mmap(fd, size, prot=prot), creator=False)
        finally:
            os.close(fd)

    def data(self, offset: int, nbytes: int) -> torch.Tensor:
        """uint8 tensor over [offset, offset + nbytes) of the segment. A read-only mapping gives a
        tensor that any write through faults (the process dies; the memory stays intact)."""
        # The memoryview is a buffer export the tensor keeps alive (see the class docstring).
        with warnings.catch_warnings():  # torch warns that a read-only buffer is not writable: intended
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(memoryview(self._mapping), dtype=torch.uint8)[offset:offset + nbytes]

    def close(self) -> None:
        """Unmap (deferred while tensors view the segment); the creator also unlinks the name."""
        if self._creator:
            self._creator = False
            resource_tracker.unregister("/" + self.name, "shared_memory")
            try:
                _posixshmem.shm_unlink("/" + self.name)
            except FileNotFoundError:  # someone else unlinked it; nothing left to clean
                log.warning("shared-memory segment %s vanished before close()", self.name)
        try:
            self._mapping.close()
        except BufferError:
            log.debug("segment %s still viewed by tensors; unmapped when they are dropped", self.name)
        self._mapping = None


class BufferExporter:
    """Owns shared buffers and keeps them alive until close() (after importers detached)."""

    def __init__(self, device: torch.device, generation: int | None = None):
        self.device = torch.device(device)
        self.backend = backend_for(self.device)
        self.generation = secrets.randbits(63) if generation is None else generation
        self._host_id = host_identity()
        self._device_uuid = ""
        if self.backend == CUDA_IPC:
            cuda_ipc.require_cupy()  # fail at construction, not at the first allocate
            self._device_uuid = gpu_uuid(self.device)
        self._descriptors: dict[str, BufferDescriptor] = {}
        self._owners: list = []  # _ShmSegment | cuda_ipc.ExportedAllocation

    def allocate(self, name: str, shape, dtype: torch.dtype, host: bool = False) -> torch.Tensor:
        """A zero-filled tensor in shareable memory, published under ``name``. ``host``: in shared
        host memory whatever the device (for data both sides read and write on the host)."""
        assert name not in self._descriptors, f"buffer {name!r} allocated twice"
        shape = tuple(int(s) for s in shape)
        backend = SHM if host else self.backend
        desc = BufferDescriptor(name=name, backend=backend, shape=shape,
                                dtype=str(dtype).removeprefix("torch."), generation=self.generation,
                                device_uuid="" if backend == SHM else self._device_uuid, host_id=self._host_id)
        if backend == SHM:
            owner = _ShmSegment.create(f"eagle3-{os.getpid()}-{self.generation:x}-{name}", desc.nbytes)
            data, desc = owner.data(0, desc.nbytes), replace(desc, shm_name=owner.name)
        else:
            owner = cuda_ipc.ExportedAllocation(self.device, desc.nbytes)
            data, desc = owner.data, replace(desc, handle=owner.handle)
        self._owners.append(owner)
        self._descriptors[name] = desc
        return _typed_view(data, dtype, shape).zero_()

    def share(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Copy ``tensor`` into shareable memory once; use the returned tensor from then on."""
        shared = self.allocate(name, tensor.shape, tensor.dtype)
        shared.copy_(tensor)
        return shared

    def descriptors(self) -> list[BufferDescriptor]:
        if self.backend == CUDA_IPC:
            # The peer reads through its own CUDA context, which is not ordered after this
            # process's streams: finish the zero-fills and copies before handing out handles.
            torch.cuda.synchronize(self.device)
        return list(self._descriptors.values())

    def close(self) -> None:
        """Unpublish everything (shm: unlink; cuda: free once this process's tensors are gone)."""
        for owner in self._owners:
            owner.close()
        self._owners.clear()
        self._descriptors.clear()

    def __enter__(self) -> "BufferExporter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class BufferImporter:
    """Maps buffers another process on this host exported; the tensors alias its memory."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.backend = backend_for(self.device)
        self._host_id = host_identity()
        self._device_uuid = ""
        if self.backend == CUDA_IPC:
            cuda_ipc.require_cupy()
            self._device_uuid = gpu_uuid(self.device)
        self._owners: list = []  # _ShmSegment | mapping keep-alives from cuda_ipc.open_handle

    def open(self, desc: BufferDescriptor, read_only: bool = False) -> torch.Tensor:
        """Map ``desc``. ``read_only``: host memory is mapped without write permission (CUDA IPC
        cannot map read-only: there the exporter must not depend on the buffer staying intact)."""
        self._check(desc)
        dtype = dtype_from_name(desc.dtype)
        if desc.backend == SHM:
            owner = _ShmSegment.attach(desc.shm_name, desc.offset_bytes + desc.nbytes, read_only)
            data = owner.data(desc.offset_bytes, desc.nbytes)
        else:
            data, owner = cuda_ipc.open_handle(desc.handle, self.device, desc.offset_bytes, desc.nbytes)
        self._owners.append(owner)
        return _typed_view(data, dtype, desc.shape)

    def close(self) -> None:
        """Detach everything (shm: unmap, never unlink; cuda: cudaIpcCloseMemHandle), each
        mapping as soon as no tensor of this process views it."""
        for owner in self._owners:
            if isinstance(owner, _ShmSegment):
                owner.close()
        self._owners.clear()  # drops the cuda mappings' last non-tensor references

    def __enter__(self) -> "BufferImporter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check(self, desc: BufferDescriptor) -> None:
        where = f"buffer {desc.name!r}"
        if desc.host_id != self._host_id:
            raise SharedBufferError(
                f"{where} was exported on host {desc.host_id!r}, this is {self._host_id!r}: "
                "shared buffers only work between processes on one host")
        if desc.backend not in (self.backend, SHM):  # host memory maps on any device
            raise SharedBufferError(
                f"{where} is a {desc.backend} buffer but this importer on {self.device} uses "
                f"{self.backend}: both services must run on the same device kind (one GPU, or the CPU)")
        if desc.backend == CUDA_IPC and desc.device_uuid != self._device_uuid:
            raise SharedBufferError(
                f"{where} lives on GPU {desc.device_uuid}, this importer's {self.device} is GPU "
                f"{self._device_uuid}: peers must share one GPU (check CUDA_VISIBLE_DEVICES and --device)")
        if desc.backend == CUDA_IPC and len(desc.handle) != cuda_ipc.HANDLE_BYTES:
            raise SharedBufferError(f"{where}: IPC handle has {len(desc.handle)} bytes, expected 64")
        if desc.offset_bytes % dtype_from_name(desc.dtype).itemsize:
            raise SharedBufferError(f"{where}: offset {desc.offset_bytes} is not aligned to {desc.dtype}")
