"""CUDA IPC through cupy: GPU memory that another process on the same GPU maps.

Used by ``link.shared_buffers`` for CUDA devices; cupy is imported only here, and only
when a CUDA buffer is made or opened, so CPU machines never need it.

The CUDA IPC rules this module is built around:

1. A ``cudaIpcMemHandle`` names a whole allocation by its base pointer (a handle taken
   for an interior pointer names the enclosing allocation). Descriptors therefore carry
   ``offset_bytes``, and every exported buffer is its own ``cudaMalloc``
   (``cupy.cuda.Memory``), never a block of cupy's or torch's caching pool, whose blocks
   are sub-ranges of larger allocations. Exported buffers thus have offset 0.
2. The exporter must keep the allocation alive until every importer has closed its
   mapping: an allocation freed early leaves the peer reading memory that may be reused.
   ``ExportedAllocation`` holds the memory until ``close()``; tensors handed out keep it
   alive after that, so this process never frees under its own tensors. Freeing under a
   peer is prevented only by the protocol: close the exporter after importers detached.
3. A process maps a given allocation at most once (older drivers refuse a second
   ``cudaIpcOpenMemHandle``, newer ones refcount it), so opened handles are cached per
   process and shared by every importer in it. A mapping is closed
   (``cudaIpcCloseMemHandle``) once no importer and no tensor uses it.
4. A process cannot open a handle it exported itself; an importer in the exporting
   process gets the exporter's own memory instead.
5. Memory is shared, streams are not: a writer must synchronize (or hand over an IPC
   event) before a reader in the other process reads.
"""

import threading
import weakref

import torch

from common.errors import SharedBufferError

HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)

_LOCK = threading.Lock()
_EXPORTED: "weakref.WeakValueDictionary[bytes, ExportedAllocation]" = weakref.WeakValueDictionary()
_OPENED: "weakref.WeakValueDictionary[bytes, _OpenedHandle]" = weakref.WeakValueDictionary()


def require_cupy():
    """The cupy module, or a SharedBufferError saying how to install it."""
    try:
        import cupy
    except ImportError as error:
        raise SharedBufferError(
            "CUDA shared buffers need cupy, which is not installed: install the project's "
            "extra for your CUDA version, `pip install -e '.[cuda12]'` or `pip install -e '.[cuda13]'`"
        ) from error
    return cupy


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _byte_tensor(cp, memory, offset: int, nbytes: int) -> torch.Tensor:
    """uint8 tensor over [offset, offset + nbytes) of a cupy memory object, keeping it alive.

    Bytes rather than the real dtype because cupy has no bfloat16; callers view the bytes.
    """
    array = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.memory.MemoryPointer(memory, offset))
    return torch.from_dlpack(array)


class ExportedAllocation:
    """One cudaMalloc that peers can map: ``handle`` goes in the descriptor, ``data`` is the
    zero-offset uint8 tensor over it."""

    def __init__(self, device: torch.device, nbytes: int):
        cp = require_cupy()
        with cp.cuda.Device(device_index(device)):
            # Its own allocation, so the pointer is the base the handle names (rule 1);
            # at least 1 byte because a 0-byte allocation is a null pointer with no handle.
            self._memory = cp.cuda.memory.Memory(max(nbytes, 1))
            self.handle = bytes(cp.cuda.runtime.ipcGetMemHandle(self._memory.ptr))
        self.data = _byte_tensor(cp, self._memory, 0, nbytes)
        with _LOCK:
            _EXPORTED[self.handle] = self

    def close(self) -> None:
        """Stop offering the memory; it is freed once this process's tensors over it are gone."""
        with _LOCK:
            _EXPORTED.pop(self.handle, None)
        self._memory = None


class _OpenedHandle:
    """One cudaIpcOpenMemHandle mapping, closed when the last reference to it goes."""

    def __init__(self, cp, handle: bytes, index: int):
        self._cp, self._index = cp, index
        with cp.cuda.Device(index):
            self.ptr = cp.cuda.runtime.ipcOpenMemHandle(handle)

    def __del__(self):
        try:
            with self._cp.cuda.Device(self._index):
                self._cp.cuda.runtime.ipcCloseMemHandle(self.ptr)
        except Exception:  # a finalizer must not raise; at interpreter exit CUDA may be gone
            pass


def open_handle(handle: bytes, device: torch.device, offset: int, nbytes: int) -> tuple[torch.Tensor, object]:
    """Map [offset, offset + nbytes) of the allocation ``handle`` names on ``device``.

    Returns the uint8 tensor and the object keeping the mapping open (the importer holds it
    until its close(); the tensor holds it as long as the tensor lives).
    """
    cp = require_cupy()
    index = device_index(device)
    with _LOCK:
        local = _EXPORTED.get(handle)
        if local is not None:  # exported by this very process (rule 4)
            return local.data[offset:offset + nbytes], local
        opened = _OPENED.get(handle)
        if opened is None:
            try:
                opened = _OpenedHandle(cp, handle, index)
            except cp.cuda.runtime.CUDARuntimeError as error:
                raise SharedBufferError(
                    f"cudaIpcOpenMemHandle failed ({error}): the exporting process has probably "
                    "exited or restarted; redo the handshake to get fresh descriptors") from error
            _OPENED[handle] = opened
    memory = cp.cuda.memory.UnownedMemory(opened.ptr, offset + nbytes, opened, index)
    return _byte_tensor(cp, memory, offset, nbytes), opened
