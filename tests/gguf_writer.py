"""A tiny GGUF v3 writer, for tests only: F32, F16, BF16, Q8_0 and Q4_1 tensors plus metadata.

``write_gguf`` returns, for each tensor, the exact float32 values a correct reader must
produce after dequantization (the quantization's own reconstruction, computed in float32
the way the format defines it).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

# Metadata value type ids (GGUF spec).
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY = range(10)
UINT64, INT64, FLOAT64 = 10, 11, 12
_FORMATS = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i",
            FLOAT32: "<f", BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}

GGML_TYPE_IDS = {"F32": 0, "F16": 1, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "BF16": 30}


class Typed:
    """A metadata value with an explicit GGUF type (``Typed(UINT8, 7)``, ``Typed(ARRAY, [..], INT16)``)."""

    def __init__(self, vtype: int, value: Any, elem_type: int | None = None):
        self.vtype, self.value, self.elem_type = vtype, value, elem_type


def _infer(value: Any) -> Typed:
    if isinstance(value, Typed):
        return value
    if isinstance(value, bool):
        return Typed(BOOL, value)
    if isinstance(value, int):
        return Typed(INT32 if -2**31 <= value < 2**31 else INT64, value)
    if isinstance(value, float):
        return Typed(FLOAT32, value)
    if isinstance(value, str):
        return Typed(STRING, value)
    if isinstance(value, (list, tuple)):
        return Typed(ARRAY, list(value), _infer(value[0]).vtype if value else INT32)
    raise TypeError(f"cannot infer a GGUF type for {value!r}")


def _string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _value(vtype: int, value: Any, elem_type: int | None = None) -> bytes:
    if isinstance(value, Typed):  # e.g. the inner arrays of an array of arrays
        return _value(value.vtype, value.value, value.elem_type)
    if vtype == STRING:
        return _string(value)
    if vtype == ARRAY:
        body = b"".join(_value(elem_type, v) for v in value)
        return struct.pack("<IQ", elem_type, len(value)) + body
    return struct.pack(_FORMATS[vtype], value)


def quantize_q8_0(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Blocks of fp16 d + 32 int8 q with d = amax / 127; returns (bytes, d * q)."""
    blocks = x.astype(np.float32).reshape(-1, 32)
    d = (np.abs(blocks).max(axis=1) / 127).astype(np.float16)
    d32 = d.astype(np.float32)
    safe = np.where(d32 == 0, 1, d32)
    q = np.clip(np.round(blocks / safe[:, None]), -127, 127).astype(np.int8)
    raw = np.empty(len(blocks), dtype=[("d", "<f2"), ("qs", "i1", (32,))])
    raw["d"], raw["qs"] = d, q
    return raw.tobytes(), (d32[:, None] * q.astype(np.float32)).reshape(x.shape)


def quantize_q4_1(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Blocks of fp16 d, fp16 m and 16 bytes of nibbles (element j low, j + 16 high)."""
    blocks = x.astype(np.float32).reshape(-1, 32)
    m = blocks.min(axis=1).astype(np.float16)
    d = ((blocks.max(axis=1) - m.astype(np.float32)) / 15).astype(np.float16)
    d32, m32 = d.astype(np.float32), m.astype(np.float32)
    safe = np.where(d32 == 0, 1, d32)
    q = np.clip(np.round((blocks - m32[:, None]) / safe[:, None]), 0, 15).astype(np.uint8)
    raw = np.empty(len(blocks), dtype=[("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))])
    raw["d"], raw["m"], raw["qs"] = d, m, q[:, :16] | (q[:, 16:] << 4)
    exact = d32[:, None] * q.astype(np.float32) + m32[:, None]
    return raw.tobytes(), exact.reshape(x.shape)


def encode_tensor(x: np.ndarray, kind: str) -> tuple[bytes, np.ndarray | None]:
    """(raw bytes, exact dequantized float32 values) of ``x`` stored as ``kind``."""
    if kind == "F32":
        x32 = x.astype("<f4")
        return x32.tobytes(), x32.astype(np.float32)
    if kind == "F16":
        h = x.astype("<f2")
        return h.tobytes(), h.astype(np.float32)
    if kind == "BF16":
        bits = (x.astype(np.float32).view(np.uint32) >> 16).astype("<u2")  # truncate
        return bits.tobytes(), (bits.astype(np.uint32) << 16).view(np.float32)
    if kind == "Q8_0":
        return quantize_q8_0(x)
    if kind == "Q4_1":
        return quantize_q4_1(x)
    if kind == "Q4_K":  # unsupported by the reader: zero blocks of the right size
        return bytes(x.size // 256 * 144), None
    raise ValueError(kind)


def write_gguf(path: str | Path, metadata: dict[str, Any],
               tensors: dict[str, tuple[np.ndarray, str]], alignment: int = 32,
               version: int = 3) -> dict[str, np.ndarray | None]:
    """Write a GGUF file; ``tensors`` maps name -> (numpy array, GGML type name)."""
    if alignment != 32:
        metadata = {**metadata, "general.alignment": Typed(UINT32, alignment)}
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(metadata))
    for key, value in metadata.items():
        t = _infer(value)
        head += _string(key) + struct.pack("<I", t.vtype) + _value(t.vtype, t.value, t.elem_type)
    infos, data, exact = b"", b"", {}
    for name, (array, kind) in tensors.items():
        raw, exact[name] = encode_tensor(array, kind)
        data += bytes(-len(data) % alignment)
        dims = list(reversed(array.shape))  # GGUF lists dims innermost-first
        infos += _string(name) + struct.pack(f"<I{len(dims)}Q", len(dims), *dims)
        infos += struct.pack("<IQ", GGML_TYPE_IDS[kind], len(data))
        data += raw
    header = head + infos
    Path(path).write_bytes(header + bytes(-len(header) % alignment) + data)
    return exact
