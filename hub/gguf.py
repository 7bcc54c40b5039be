"""A small, self-contained reader for GGUF files (llama.cpp's checkpoint format).

Layout of a GGUF v2/v3 file (all integers little-endian):

    +--------------------------------------------------------------+
    | "GGUF" | version u32 | n_tensors u64 | n_kv u64               |
    | n_kv x (key str, value type u32, value)                      |
    | n_tensors x (name str, n_dims u32, dims u64[n_dims],          |
    |              ggml type u32, offset u64)                       |
    | padding up to `general.alignment` (default 32)                |
    | tensor data; each tensor at data_start + offset               |
    +--------------------------------------------------------------+

    str = length u64 + UTF-8 bytes (no terminator)

Dims are listed innermost-first (dims[0] is the number of columns), so a tensor
with dims [ne0, ne1] is a numpy array of shape (ne1, ne0). Tensor data is
memory-mapped and only dequantized on request, one tensor at a time.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.errors import CheckpointError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Metadata value types: id -> struct format of one scalar (8 = string, 9 = array).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f",
                   7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# GGML tensor types: id -> (name, elements per block, bytes per block). Sizes are
# known for more types than we dequantize so that bounds checks cover every tensor.
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
    28: ("F64", 1, 8), 30: ("BF16", 1, 2),
}

# Block layouts of the quantized types we dequantize (packed, no padding).
Q8_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", (32,))])                 # 34 bytes
Q4_1_BLOCK = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))])   # 20 bytes


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in the file. ``shape`` is in numpy order (outermost first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int            # absolute byte offset in the file
    n_bytes: int | None    # None for types whose block size this reader does not know

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.ggml_type, (f"unknown({self.ggml_type})",))[0]

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class _Cursor:
    """Sequential little-endian decoding over a buffer; overruns raise CheckpointError."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise CheckpointError(f"{self.path}: truncated GGUF header "
                                  f"(needs byte {self.pos + n}, file has {len(self.buf)})")
        view = self.buf[self.pos:self.pos + n]
        self.pos += n
        return view

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.scalar("<Q"))
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{self.path}: invalid UTF-8 string at byte {self.pos}") from e

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        raise CheckpointError(f"{self.path}: unknown metadata value type {vtype}")

    def array(self) -> list:
        etype, count = self.scalar("<I"), self.scalar("<Q")
        if etype in _SCALAR_FORMATS:
            # Numeric arrays (e.g. 49k token types) are decoded in one numpy call.
            dtype = np.dtype(_SCALAR_FORMATS[etype])
            raw = self.take(count * dtype.itemsize)
            return np.frombuffer(raw, dtype=dtype).tolist()
        return [self.value(etype) for _ in range(count)]


class GGUFReader:
    """Parsed GGUF header plus lazy access to tensor data through a read-only mmap."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: GGUF file does not exist")
        with open(self.path, "rb") as f:
            if self.path.stat().st_size < 24:
                raise CheckpointError(f"{self.path}: truncated GGUF file "
                                      f"({self.path.stat().st_size} bytes)")
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        cur = _Cursor(memoryview(self._mm), self.path)
        self.version = self._read_preamble(cur)
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("<I"))
        self.alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise CheckpointError(f"{self.path}: alignment {self.alignment} is not a power of 2")
        raw_infos = [self._read_tensor_info(cur) for _ in range(n_tensors)]
        self.data_start = -(-cur.pos // self.alignment) * self.alignment  # round up
        self.tensors = {name: self._place(name, dims, t, off) for name, dims, t, off in raw_infos}

    def _read_preamble(self, cur: _Cursor) -> int:
        magic = bytes(cur.take(4))
        if magic != GGUF_MAGIC:
            raise CheckpointError(f"{self.path}: not a GGUF file (magic {magic!r}, "
                                  f"expected {GGUF_MAGIC!r})")
        version = cur.scalar("<I")
        if version not in SUPPORTED_VERSIONS:
            raise CheckpointError(f"{self.path}: GGUF version {version} is not supported "
                                  f"(supported: {SUPPORTED_VERSIONS})")
        return version

    @staticmethod
    def _read_tensor_info(cur: _Cursor) -> tuple[str, list[int], int, int]:
        name = cur.string()
        dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
        return name, dims, cur.scalar("<I"), cur.scalar("<Q")

    def _place(self, name: str, dims: list[int], ggml_type: int, rel: int) -> TensorInfo:
        shape = tuple(reversed(dims))  # GGUF dims are innermost-first
        n_bytes = None
        if ggml_type in GGML_TYPES:
            _, block, type_size = GGML_TYPES[ggml_type]
            n_elem = int(np.prod(shape, dtype=np.int64))
            if dims and dims[0] % block:
                raise CheckpointError(f"{self.path}: tensor {name} has {dims[0]} columns, "
                                      f"not a multiple of the block size {block}")
            n_bytes = n_elem // block * type_size
        info = TensorInfo(name, shape, ggml_type, self.data_start + rel, n_bytes)
        if n_bytes is not None and info.offset + n_bytes > len(self._mm):
            raise CheckpointError(f"{self.path}: truncated file: tensor {name} ends at byte "
                                  f"{info.offset + n_bytes}, file has {len(self._mm)}")
        return info

    def raw(self, name: str, dtype: np.dtype, count: int) -> np.ndarray:
        """Zero-copy view of a tensor's bytes as ``count`` items of ``dtype``."""
        return np.frombuffer(self._mm, dtype=dtype, count=count, offset=self.tensors[name].offset)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as a fresh float32 array in numpy order."""
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: no tensor named {name!r}")
        info = self.tensors[name]
        decode = _DEQUANTIZERS.get(info.ggml_type)
        if decode is None:
            raise CheckpointError(f"{self.path}: tensor {name} has GGML type {info.type_name}, "
                                  f"which this reader cannot dequantize "
                                  f"(supported: {', '.join(GGML_TYPES[t][0] for t in _DEQUANTIZERS)})")
        return decode(self, info).reshape(info.shape)


def _dequant_f32(r: GGUFReader, t: TensorInfo) -> np.ndarray:
    return r.raw(t.name, np.dtype("<f4"), t.n_elements).astype(np.float32)  # copy off the mmap


def _dequant_f16(r: GGUFReader, t: TensorInfo) -> np.ndarray:
    return r.raw(t.name, np.dtype("<f2"), t.n_elements).astype(np.float32)


def _dequant_bf16(r: GGUFReader, t: TensorInfo) -> np.ndarray:
    # bf16 is the top half of an f32: shift the 16 bits into place and reinterpret.
    bits = r.raw(t.name, np.dtype("<u2"), t.n_elements).astype(np.uint32) << 16
    return bits.view(np.float32)


def _dequant_q8_0(r: GGUFReader, t: TensorInfo) -> np.ndarray:
    # x = d * q, one fp16 scale d per 32 int8 q.
    blocks = r.raw(t.name, Q8_0_BLOCK, t.n_elements // 32)
    return blocks["d"].astype(np.float32)[:, None] * blocks["qs"].astype(np.float32)  # (nb, 32)


def _dequant_q4_1(r: GGUFReader, t: TensorInfo) -> np.ndarray:
    # x = d * q + m with 4-bit q; byte j holds element j (low nibble) and j + 16 (high nibble).
    blocks = r.raw(t.name, Q4_1_BLOCK, t.n_elements // 32)
    qs = blocks["qs"]                                                     # (nb, 16)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)   # (nb, 32)
    return blocks["d"].astype(np.float32)[:, None] * q + blocks["m"].astype(np.float32)[:, None]


_DEQUANTIZERS = {0: _dequant_f32, 1: _dequant_f16, 30: _dequant_bf16,
                 8: _dequant_q8_0, 3: _dequant_q4_1}
