"""infer's GGUF header reader (``loader.gguf.GGUFFile``) against gguf-py's ``GGUFReader``, the format
authority: every metadata value and every tensor entry equal, on a file written here with every
value type (arrays of strings and of each number type included) and on the real SmolLM2 file; and
bad files give a ``CheckpointError`` naming the file and the problem."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from test_gguf import REAL_GGUF, needs_real

from infer.loader import CheckpointError
from infer.loader.gguf import GGUFFile

gguf = pytest.importorskip("gguf", reason="the gguf package reads GGUF files: pip install gguf")
T = gguf.GGUFValueType


def assert_same_as_gguf_py(path: Path) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        value, expected = ours.get(key), field.contents()
        assert value == expected, key
        assert type(value) is type(expected), key
        if isinstance(expected, list):
            assert [type(v) for v in value] == [type(v) for v in expected], key
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for reference in theirs.tensors:
        tensor = ours.tensors[reference.name]
        assert tensor.tensor_type == reference.tensor_type
        assert tensor.shape == tuple(int(d) for d in reference.shape)
        assert (tensor.n_elements, tensor.n_bytes, tensor.data_offset) == (
            reference.n_elements, reference.n_bytes, reference.data_offset)
        assert tensor.data.dtype == reference.data.dtype and tensor.data.shape == reference.data.shape
        np.testing.assert_array_equal(tensor.data, reference.data)
    return ours


EVERY_VALUE = {
    "test.u8": (200, T.UINT8), "test.i8": (-100, T.INT8), "test.u16": (60000, T.UINT16),
    "test.i16": (-30000, T.INT16), "test.u32": (4_000_000_000, T.UINT32), "test.i32": (-2_000_000_000, T.INT32),
    "test.f32": (0.1, T.FLOAT32), "test.bool_true": (True, T.BOOL), "test.bool_false": (False, T.BOOL),
    "test.u64": (2**63 + 5, T.UINT64), "test.i64": (-(2**62), T.INT64), "test.f64": (0.1, T.FLOAT64),
    "test.string": ("naïve café 日本語 🤖", T.STRING), "test.empty_string": ("", T.STRING),
}
EVERY_ARRAY = {
    "test.strings": (["", "a", "Ġhello", "<|im_end|>", "日本語", "🤖 x", "\n\n"], T.STRING),
    "test.u8s": ([0, 1, 255], T.UINT8), "test.i8s": ([-128, 0, 127], T.INT8),
    "test.u16s": ([0, 65535], T.UINT16), "test.i16s": ([-32768, 32767], T.INT16),
    "test.u32s": ([0, 2**32 - 1], T.UINT32), "test.i32s": ([-(2**31), 2**31 - 1, 3], T.INT32),
    "test.f32s": ([0.1, -2.5, 1e30], T.FLOAT32), "test.bools": ([True, False, True], T.BOOL),
    "test.u64s": ([0, 2**64 - 1], T.UINT64), "test.i64s": ([-(2**63), 2**63 - 1], T.INT64),
    "test.f64s": ([0.1, -1e300], T.FLOAT64), "test.nested": ([[1, 2], [3]], T.ARRAY),
}


def write_every_type(path: Path) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    for key, (value, kind) in EVERY_VALUE.items():
        writer.add_key_value(key, value, kind)
    for key, (values, kind) in EVERY_ARRAY.items():
        writer.add_key_value(key, values, T.ARRAY, kind)
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 4, 8)).astype(np.float16))
    writer.add_tensor("i32", np.arange(7, dtype=np.int32))
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.BF16):
        rows = rng.standard_normal((4, 256)).astype(np.float32)
        writer.add_tensor(qtype.name.lower(), gguf.quants.quantize(rows, qtype).view(np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_every_value_type_reads_as_gguf_py_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "every.gguf"
    write_every_type(path)
    f = assert_same_as_gguf_py(path)
    assert f.get("test.strings") == EVERY_ARRAY["test.strings"][0]  # and both read what was written
    assert f.get("test.u64s") == [0, 2**64 - 1] and f.get("test.f32") == pytest.approx(0.1)
    assert f.get("test.missing", "default") == "default"
    assert f.tensors["q8_0"].data.shape == (4, 272)  # blocks as bytes, as gguf-py shapes them


@needs_real
def test_real_file_reads_as_gguf_py_reads_it() -> None:
    path = REAL_GGUF
    assert path is not None
    f = assert_same_as_gguf_py(path)
    assert len(f.get("tokenizer.ggml.tokens")) == 49152 and len(f.get("tokenizer.ggml.merges")) > 48000


def test_truncated_files_are_named(tmp_path: Path) -> None:
    full = tmp_path / "every.gguf"
    write_every_type(full)
    data = full.read_bytes()
    header_end = GGUFFile(full).tensors["f32"].data_offset
    # cuts inside the counts, a key, a string array, the tensor infos, and the tensor data
    for cut in (12, 30, header_end // 3, header_end - 20, len(data) - 100):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated") as err:
            GGUFFile(path)
        assert str(path) in str(err.value)


@pytest.mark.parametrize(("change", "named"), [
    (lambda b: b"GGUX" + b[4:], "magic"),
    (lambda b: b[:4] + struct.pack("<I", 99) + b[8:], "version 99"),
    (lambda b: b[:4] + struct.pack(">I", 3) + b[8:], "big-endian"),
    (lambda b: b"", "not a readable GGUF file"),
])
def test_bad_headers_are_named(tmp_path: Path, change: object, named: str) -> None:
    full = tmp_path / "every.gguf"
    write_every_type(full)
    path = tmp_path / "bad.gguf"
    path.write_bytes(change(full.read_bytes()))  # type: ignore[operator]
    with pytest.raises(CheckpointError, match=named) as err:
        GGUFFile(path)
    assert str(path) in str(err.value)


def test_unknown_value_type_is_named(tmp_path: Path) -> None:
    path = tmp_path / "odd.gguf"
    key = b"general.architecture"
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 77)
    path.write_bytes(header + b"\x00" * 16)
    with pytest.raises(CheckpointError, match="77") as err:
        GGUFFile(path)
    assert str(path) in str(err.value)
