"""GGUF reader: metadata of every type, tensor layout, dequantization and corrupt files."""

import struct

import numpy as np
import pytest

from common.errors import CheckpointError
from hub.gguf import GGUFReader
from gguf_writer import (ARRAY, FLOAT64, INT8, INT16, INT64, UINT8, UINT16, UINT32, UINT64,
                         Typed, write_gguf)

RNG = np.random.default_rng(0)

METADATA = {
    "general.architecture": "llama",
    "u8": Typed(UINT8, 250), "i8": Typed(INT8, -5), "u16": Typed(UINT16, 65000),
    "i16": Typed(INT16, -300), "u32": Typed(UINT32, 4_000_000_000), "i32": -7,
    "u64": Typed(UINT64, 2**40), "i64": Typed(INT64, -(2**40)), "f32": 0.5,
    "f64": Typed(FLOAT64, 0.1), "flag": True, "text": "héllo <|im_end|> 世界",
    "strings": ["a", "Ġb", "", "<|im_start|>"], "ints": Typed(ARRAY, [1, -2, 3], INT16),
    "nested": Typed(ARRAY, [Typed(ARRAY, [1, 2], INT16), Typed(ARRAY, [3], INT16)], ARRAY),
}


@pytest.fixture
def gguf_file(tmp_path):
    tensors = {
        "f32": (RNG.standard_normal((3, 64)).astype(np.float32), "F32"),
        "f16": (RNG.standard_normal((2, 32)).astype(np.float32), "F16"),
        "bf16": (RNG.standard_normal((32,)).astype(np.float32), "BF16"),
        "q8": (RNG.standard_normal((4, 96)).astype(np.float32), "Q8_0"),
        "q4": (RNG.standard_normal((5, 64)).astype(np.float32) + 0.3, "Q4_1"),
        "k4": (np.zeros((1, 256), np.float32), "Q4_K"),
    }
    path = tmp_path / "tiny.gguf"
    exact = write_gguf(path, METADATA, tensors)
    return path, tensors, exact


def test_metadata_round_trips_every_value_type(gguf_file):
    r = GGUFReader(gguf_file[0])
    assert r.version == 3 and r.alignment == 32
    md = r.metadata
    for key in ("u8", "i8", "u16", "i16", "u32", "i32", "u64", "i64", "flag", "text", "strings"):
        value = METADATA[key].value if isinstance(METADATA[key], Typed) else METADATA[key]
        assert md[key] == value, key
    assert md["f32"] == 0.5 and md["f64"] == 0.1
    assert md["ints"] == [1, -2, 3] and md["nested"] == [[1, 2], [3]]


def test_tensor_infos_are_in_numpy_order(gguf_file):
    path, tensors, _ = gguf_file
    r = GGUFReader(path)
    assert list(r.tensors) == list(tensors)
    for name, (array, kind) in tensors.items():
        assert r.tensors[name].shape == array.shape and r.tensors[name].type_name == kind
        assert r.tensors[name].offset % 32 == 0


@pytest.mark.parametrize("name", ["f32", "f16", "bf16", "q8", "q4"])
def test_dequantize_gives_the_exact_quantized_values(gguf_file, name):
    path, tensors, exact = gguf_file
    out = GGUFReader(path).dequantize(name)
    assert out.dtype == np.float32 and out.shape == tensors[name][0].shape
    np.testing.assert_array_equal(out, exact[name])
    # And the quantization is a sane approximation of the original values.
    np.testing.assert_allclose(out, tensors[name][0], atol=0.3)


def test_q4_1_nibble_order_by_hand(tmp_path):
    # One block: d = 1, m = 0.5, byte j = j (low) | (15 - j) << 4 (high).
    # Element j (j < 16) is the low nibble of byte j; element 16 + j the high nibble.
    path = tmp_path / "hand.gguf"
    write_gguf(path, {}, {"t": (np.zeros((1, 32), np.float32), "Q4_1")})
    r = GGUFReader(path)
    block = struct.pack("<ee", 1.0, 0.5) + bytes(j | (15 - j) << 4 for j in range(16))
    raw = bytearray(path.read_bytes())
    raw[r.tensors["t"].offset:r.tensors["t"].offset + 20] = block
    path.write_bytes(bytes(raw))
    want = np.concatenate([np.arange(16), 15 - np.arange(16)]) + 0.5
    np.testing.assert_array_equal(GGUFReader(path).dequantize("t")[0], want)


def test_q8_0_by_hand(tmp_path):
    path = tmp_path / "hand.gguf"
    write_gguf(path, {}, {"t": (np.zeros((1, 32), np.float32), "Q8_0")})
    r = GGUFReader(path)
    block = struct.pack("<e", 0.25) + np.arange(-16, 16, dtype=np.int8).tobytes()
    raw = bytearray(path.read_bytes())
    raw[r.tensors["t"].offset:r.tensors["t"].offset + 34] = block
    path.write_bytes(bytes(raw))
    np.testing.assert_array_equal(GGUFReader(path).dequantize("t")[0], np.arange(-16, 16) * 0.25)


def test_custom_alignment(tmp_path):
    path = tmp_path / "a64.gguf"
    x = RNG.standard_normal((2, 32)).astype(np.float32)
    write_gguf(path, {"x": 1}, {"a": (x[:, :32], "F32"), "b": (x, "Q8_0")}, alignment=64)
    r = GGUFReader(path)
    assert r.alignment == 64 and all(t.offset % 64 == 0 for t in r.tensors.values())
    np.testing.assert_array_equal(r.dequantize("a"), x)


def test_unsupported_type_raises(gguf_file):
    r = GGUFReader(gguf_file[0])
    assert r.tensors["k4"].type_name == "Q4_K"
    with pytest.raises(CheckpointError, match="Q4_K"):
        r.dequantize("k4")
    with pytest.raises(CheckpointError, match="no tensor"):
        r.dequantize("missing")


def test_bad_magic_raises(tmp_path, gguf_file):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGML" + gguf_file[0].read_bytes()[4:])
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        GGUFReader(path)


def test_unsupported_version_raises(tmp_path):
    path = tmp_path / "v1.gguf"
    write_gguf(path, {}, {}, version=1)
    with pytest.raises(CheckpointError, match="version 1"):
        GGUFReader(path)


@pytest.mark.parametrize("keep", [0, 10, 100, 400, -1])
def test_truncated_file_raises(tmp_path, gguf_file, keep):
    data = gguf_file[0].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:keep])
    with pytest.raises(CheckpointError, match="truncated"):
        GGUFReader(path)


def test_missing_file_raises(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        GGUFReader(tmp_path / "nope.gguf")
