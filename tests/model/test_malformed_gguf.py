"""Malformed GGUF files are refused at load with UnsupportedModelError naming what is wrong
(the tensor, where one is at fault): never a crash, never a silent read. Each file is a real
tiny model (tests/tiny_gguf.py) with one field of its header changed, byte for byte."""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from radixserve.model.gguf_check import check_gguf, read_gguf
from radixserve.model.hparams import UnsupportedModelError
from radixserve.model.loader import load_model

TARGET = "blk.0.attn_q.weight"  # a Q4_1 matrix of the tiny model


@pytest.fixture(scope="module")
def good(tiny_path: str) -> Path:
    """The session's tiny model (read only here: each test changes a copy)."""
    return Path(tiny_path)


@functools.cache
def info_at(path: Path, name: str) -> tuple[int, int]:
    """Where tensor `name`'s table entry keeps its dimension count, and that count."""
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
    raw = path.read_bytes()
    (nlen,) = struct.unpack_from("<Q", raw, t.field.offset)
    pos = t.field.offset + 8 + nlen
    return pos, struct.unpack_from("<I", raw, pos)[0]


def changed(good: Path, tmp_path: Path, edit: Callable[[bytearray, int, int], None]) -> str:
    b = bytearray(good.read_bytes())
    pos, nd = info_at(good, TARGET)
    edit(b, pos, nd)
    out = tmp_path / "bad.gguf"
    out.write_bytes(bytes(b))
    return str(out)


def refused(path: str, *words: str) -> str:
    with pytest.raises(UnsupportedModelError) as e:
        load_model(path, dtype="f32")
    msg = str(e.value)
    assert all(w in msg for w in words), msg
    return msg


def test_the_unchanged_file_passes_the_check(good: Path, tiny_tr) -> None:
    """The session's tiny model (loaded by tiny_tr) passes the check the loader runs."""
    check_gguf(str(good))
    assert tiny_tr.hp.n_layer == 2


def test_truncated_tensor_data(good: Path, tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(good.read_bytes()[:-1000])
    refused(str(path), "past the end of the file", "truncated")


def test_a_row_length_that_does_not_divide_into_blocks(good: Path, tmp_path: Path) -> None:
    # ne[0] 64 -> 48, and the row count doubled so the bytes still fit: only the blocks are off
    def edit(b: bytearray, pos: int, nd: int) -> None:
        ne0, ne1 = struct.unpack_from("<QQ", b, pos + 4)
        struct.pack_into("<QQ", b, pos + 4, ne0 - 16, ne1)
    refused(changed(good, tmp_path, edit), TARGET, "not a multiple of its 32-weight blocks")


def test_an_offset_past_the_end(good: Path, tmp_path: Path) -> None:
    def edit(b: bytearray, pos: int, nd: int) -> None:
        struct.pack_into("<Q", b, pos + 4 + 8 * nd + 4, 1 << 30)
    refused(changed(good, tmp_path, edit), TARGET, "past the end of the file")


def test_an_offset_onto_another_tensor(good: Path, tmp_path: Path) -> None:
    def edit(b: bytearray, pos: int, nd: int) -> None:
        struct.pack_into("<Q", b, pos + 4 + 8 * nd + 4, 0)
    refused(changed(good, tmp_path, edit), TARGET, "overlap")


@pytest.mark.parametrize("dim", [0, 2**40])
def test_absurd_dimensions(good: Path, tmp_path: Path, dim: int) -> None:
    def edit(b: bytearray, pos: int, nd: int) -> None:
        struct.pack_into("<Q", b, pos + 4 + 8, dim)
    refused(changed(good, tmp_path, edit), TARGET, "dimensions")


def test_too_many_dimensions(good: Path, tmp_path: Path) -> None:
    def edit(b: bytearray, pos: int, nd: int) -> None:
        struct.pack_into("<I", b, pos, 9)
    refused(changed(good, tmp_path, edit), TARGET, "9 dimensions")


def test_an_unknown_type_id(good: Path, tmp_path: Path) -> None:
    def edit(b: bytearray, pos: int, nd: int) -> None:
        struct.pack_into("<I", b, pos + 4 + 8 * nd, 99)
    refused(changed(good, tmp_path, edit), TARGET, "unknown type id 99")


def test_a_vocabulary_that_disagrees_with_the_embedding(good: Path, tmp_path: Path) -> None:
    """The token list one token short of the embedding's rows (written as such)."""
    src = gguf.GGUFReader(str(good))
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens" or key == "tokenizer.ggml.token_type":
            value = value[:-1]
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, value, vtype)
    for t in src.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    refused(str(tmp_path / "bad.gguf"), "token_embd.weight", "vocabulary")


def test_not_a_gguf_at_all(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    refused(str(path), "not a GGUF file")


def every_kind(path: Path) -> Path:
    """A file with a key of every GGUF value type (scalars, and arrays of each) and
    tensors of the element types gguf-py reads as numbers and of a block type."""
    w = gguf.GGUFWriter(str(path), "llama")
    V = gguf.GGUFValueType
    scalars = {V.UINT8: 200, V.INT8: -100, V.UINT16: 60000, V.INT16: -30000, V.UINT32: 4e9,
               V.INT32: -2e9, V.FLOAT32: 0.1, V.UINT64: 2**63, V.INT64: -(2**62),
               V.FLOAT64: 0.1, V.BOOL: True, V.STRING: "über ✓"}
    for vt, v in scalars.items():
        v = v if vt in (V.FLOAT32, V.FLOAT64, V.STRING, V.BOOL) else int(v)
        w.add_key_value(f"t.{vt.name.lower()}", v, vt)
        w.add_key_value(f"t.{vt.name.lower()}s", [v, v, v], V.ARRAY, sub_type=vt)
    w.add_key_value("t.dup1", 1, V.UINT32)
    w.add_key_value("t.dup2", 2, V.UINT32)
    rng = np.random.default_rng(3)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    w.add_tensor("i32", np.arange(12, dtype=np.int32).reshape(3, 4))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32),
                             gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("dupA", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("dupB", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("which", ["tiny", "default", "every-kind"])
def test_read_gguf_gives_what_gguf_py_reads(good: Path, tmp_path: Path, which: str) -> None:
    """The loader's reader (~30x faster on a big vocabulary) against gguf-py's GGUFReader:
    every key's contents, value types included, and every tensor's type, shape, sizes, offset,
    data view (dtype, shape, bytes)."""
    from radixserve.model.default_model import default_model_path

    path = (good if which == "tiny" else Path(default_model_path()) if which == "default"
            else every_kind(tmp_path / "k.gguf"))
    ours, ref = read_gguf(str(path)), gguf.GGUFReader(str(path))
    assert set(ours.fields) == {k for k in ref.fields if not k.startswith("GGUF.")}
    for key, field in ours.fields.items():
        got, want = field.contents(), ref.fields[key].contents()
        assert got == want and type(got) is type(want), key
        if isinstance(got, list):
            assert [type(x) for x in got] == [type(x) for x in want], key
            assert field.contents() is not field.contents()  # a caller's own list
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, a.shape.tolist(), a.n_elements, a.n_bytes, a.data_offset) == (
            b.tensor_type, b.shape.tolist(), b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name


@pytest.mark.parametrize("what", ["key", "tensor"])
def test_a_key_or_tensor_named_twice(tmp_path: Path, what: str) -> None:
    raw = every_kind(tmp_path / "k.gguf").read_bytes()
    raw = raw.replace(b"t.dup2", b"t.dup1") if what == "key" else raw.replace(b"dupB", b"dupA")
    (tmp_path / "bad.gguf").write_bytes(raw)
    with pytest.raises(UnsupportedModelError, match=f"the {what} '.*dup.*' appears twice"):
        check_gguf(str(tmp_path / "bad.gguf"))


def test_a_string_that_is_not_utf8(tmp_path: Path) -> None:
    """Read strictly, as gguf-py reads it: never a vocabulary with replaced characters."""
    raw = every_kind(tmp_path / "k.gguf").read_bytes()
    assert raw.count("über".encode()) == 4  # the string, then the array's three
    (tmp_path / "bad.gguf").write_bytes(raw.replace("über".encode(), b"\xff\xbcber", 1))
    with pytest.raises(UnsupportedModelError, match="is not UTF-8"):
        check_gguf(str(tmp_path / "bad.gguf"))


def test_arrays_nested_past_any_model(tmp_path: Path) -> None:
    """A forged header of arrays of arrays is refused, not recursed through."""
    head = struct.pack("<4sIQQ", b"GGUF", 3, 0, 1) + struct.pack("<Q", 1) + b"k"
    nested = struct.pack("<I", 9) + b"".join(struct.pack("<IQ", 9, 1) for _ in range(5000))
    (tmp_path / "deep.gguf").write_bytes(head + nested + bytes(64))
    with pytest.raises(UnsupportedModelError, match="nested over 8 deep"):
        check_gguf(str(tmp_path / "deep.gguf"))
