"""A GGUF file's structure checked, and its metadata and tensor table read, in one pass.

Why our own reader: gguf-py's builds two numpy views for every element of an array (9 s for
Gemma 3's 262k-token vocabulary, 2.2 s for SmolLM2's 49k: most of a load), where this reads
each array at once (`read_gguf` gives what the loader used of `gguf.GGUFReader`: `fields`
whose `contents()` are gguf-py's values, and gguf-py's own `ReaderTensor`s, views of the file
shaped as gguf-py shapes them; tests/model/test_malformed_gguf.py holds the two equal). And
gguf-py's reader maps each tensor over the file and fails on a malformed one
with numpy's message ("cannot reshape array of size 7942 into shape (64,128)"), naming no
tensor, or, for a row length that does not divide into its type's blocks, reads on; and the
kernels trust every size they are given. This pass reads the header and the tensor table (not
the data) and refuses, naming the tensor, what would be read wrong: an unknown type, dimensions
that are absurd or do not divide into the type's blocks, data that lies past the end of the
file or overlaps another tensor's, and a vocabulary whose size is not the embedding's rows.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import gguf
import numpy as np
from gguf.quants import quant_shape_to_byte_shape

from radixserve.model.hparams import UnsupportedModelError

MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_DIM = 2**31 - 1  # one dimension: llama.cpp's own limit (int32 row counts)
MAX_NESTING = 8  # arrays of arrays (gguf-py reads none; a deeper file is forged)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}  # GGUF value type -> struct code (8 string, 9 array)


# element types gguf-py reads tensor data as (every other type: its bytes, in block rows)
_ITEM_TYPES = {gguf.GGMLQuantizationType.F16: np.float16, gguf.GGMLQuantizationType.F32: np.float32,
               gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
               gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
               gguf.GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True, slots=True)
class Field:
    """A metadata value, read as gguf-py's `ReaderField.contents()` gives it (an array: a new
    list each call, as there)."""

    name: str
    value: object

    def contents(self) -> object:
        return list(self.value) if isinstance(self.value, list) else self.value


@dataclass(frozen=True, slots=True)
class GGUFFile:
    path: str
    fields: dict[str, Field]
    tensors: list[gguf.ReaderTensor]
    mapping: mmap.mmap | None = None  # the file's pages the tensors are views of

    def release(self) -> None:
        """Drop the pages of the file read so far from this process's memory: the loader has
        copied what it keeps (packed, decoded or as the file's blocks), and a page read again
        comes back from the file. So loading never holds a model twice (its file's pages
        and its packed weights), which a model near the machine's memory would not survive."""
        if self.mapping is not None and len(self.mapping):
            self.mapping.madvise(mmap.MADV_DONTNEED)


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> int | float | bool:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise UnsupportedModelError(f"{self.path}: the GGUF header ends early (truncated file)")
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self) -> str:
        n = int(self.take("Q"))
        if self.pos + n > len(self.buf):
            raise UnsupportedModelError(f"{self.path}: the GGUF header ends early (truncated file)")
        try:  # strictly, as gguf-py: a vocabulary is never read with replaced characters
            s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise UnsupportedModelError(f"{self.path}: the string at byte {self.pos} of the "
                                        f"header is not UTF-8 ({e.reason})") from None
        self.pos += n
        return s

    def value(self, vtype: int, depth: int = 0) -> object:
        """A value of the given type (an array: a list, each scalar array read at once)."""
        if vtype == 8:
            return self.string()
        if vtype == 9:
            itype, count = int(self.take("I")), int(self.take("Q"))
            if depth >= MAX_NESTING:
                raise UnsupportedModelError(f"{self.path}: arrays nested over {MAX_NESTING} deep")
            if itype in (8, 9) and self.pos + 8 * count > len(self.buf):  # >= 8 bytes each
                raise UnsupportedModelError(f"{self.path}: the GGUF header ends early")
            if itype in _SCALAR:
                dt = np.dtype("<" + _SCALAR[itype])
                if self.pos + dt.itemsize * count > len(self.buf):
                    raise UnsupportedModelError(f"{self.path}: the GGUF header ends early")
                out = np.frombuffer(self.buf, dt, count, self.pos).tolist() if count else []
                self.pos += dt.itemsize * count
                return out
            if itype == 8:
                return [self.string() for _ in range(count)]
            return [self.value(itype, depth + 1) for _ in range(count)]
        if vtype not in _SCALAR:
            raise UnsupportedModelError(f"{self.path}: unknown GGUF value type {vtype}")
        return self.take(_SCALAR[vtype])


def check_gguf(path: str) -> None:
    """Raise UnsupportedModelError naming what is wrong with the file's structure, if anything
    (a file that is not GGUF at all included)."""
    _header(path)


def read_gguf(path: str) -> GGUFFile:
    """The file's metadata and tensors, once its structure passed the checks. Each tensor is
    gguf-py's `ReaderTensor` but for `field`, a stand-in (its offset the data's): nothing here
    reads a tensor's table entry back."""
    kv, table = _header(path)
    data = np.memmap(path, mode="r")
    tensors = []
    for name, dims, qtype, n, n_bytes, start in table:
        item = _ITEM_TYPES.get(qtype, np.uint8)
        shape = tuple(reversed(dims))
        if item is np.uint8:
            shape = quant_shape_to_byte_shape(shape, qtype)
        view = data[start:start + n_bytes].view(item).reshape(shape)
        tensors.append(gguf.ReaderTensor(name, qtype, np.array(dims, dtype=np.uint64), n,
                                         n_bytes, start, view, gguf.ReaderField(start, name)))
    return GGUFFile(path, {k: Field(k, v) for k, v in kv.items()}, tensors,
                    getattr(data, "_mmap", None))


# a tensor's table entry, checked: name, dims, type, elements, bytes, where its data starts
_Entry = tuple[str, list[int], gguf.GGMLQuantizationType, int, int, int]


def _header(path: str) -> tuple[dict[str, object], list[_Entry]]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size < 24 or f.read(4) != b"GGUF":
            raise UnsupportedModelError(f"{path}: not a GGUF file (no GGUF magic)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _check(_Cursor(buf, path), size)


def _check(c: _Cursor, file_size: int) -> tuple[dict[str, object], list[_Entry]]:
    path = c.path
    c.pos = 4
    version = c.take("I")
    if version not in (2, 3):
        raise UnsupportedModelError(f"{path}: GGUF version {version} (2 and 3 are read)")
    n_tensors, n_kv = int(c.take("Q")), int(c.take("Q"))
    if n_tensors > 1 << 20 or n_kv > 1 << 20:
        raise UnsupportedModelError(f"{path}: {n_tensors} tensors, {n_kv} keys: not a model")
    kv: dict[str, object] = {}
    for _ in range(n_kv):
        key = c.string()
        if key in kv:
            raise UnsupportedModelError(f"{path}: the key {key!r} appears twice")
        kv[key] = c.value(int(c.take("I")))
    align = kv.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise UnsupportedModelError(f"{path}: general.alignment {align} is not a power of two")
    infos: list[tuple[str, list[int], int, int]] = []
    seen: set[str] = set()
    for _ in range(n_tensors):
        name = c.string()
        n_dims = int(c.take("I"))
        if not 1 <= n_dims <= MAX_DIMS:
            raise UnsupportedModelError(f"{path}: tensor {name!r} has {n_dims} dimensions "
                                        f"(1 to {MAX_DIMS})")
        dims = [int(c.take("Q")) for _ in range(n_dims)]
        raw_type, offset = int(c.take("I")), int(c.take("Q"))
        if name in seen:
            raise UnsupportedModelError(f"{path}: the tensor {name!r} appears twice")
        seen.add(name)
        infos.append((name, dims, raw_type, offset))
    data_start = -(-c.pos // align) * align
    spans, table = [], []
    for name, dims, raw_type, offset in infos:
        try:
            qtype = gguf.GGMLQuantizationType(raw_type)
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise UnsupportedModelError(f"{path}: tensor {name!r} has unknown type id "
                                        f"{raw_type}") from None
        if any(not 1 <= d <= MAX_DIM for d in dims):
            raise UnsupportedModelError(f"{path}: tensor {name!r} has dimensions {dims} "
                                        f"(each 1 to {MAX_DIM})")
        if dims[0] % block:
            raise UnsupportedModelError(
                f"{path}: tensor {name!r} ({qtype.name}) has rows of {dims[0]} weights, not a "
                f"multiple of its {block}-weight blocks")
        n = 1
        for d in dims:
            n *= d
        nbytes = n // block * block_bytes
        start = data_start + offset
        if offset % align or start + nbytes > file_size:
            raise UnsupportedModelError(
                f"{path}: tensor {name!r} ({nbytes} bytes at offset {offset}) lies past the "
                f"end of the file ({file_size} bytes: truncated?)" if start + nbytes > file_size
                else f"{path}: tensor {name!r}'s offset {offset} is not aligned to {align}")
        spans.append((start, start + nbytes, name))
        table.append((name, dims, qtype, n, nbytes, start))
    spans.sort()
    for (s0, e0, n0), (s1, _, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise UnsupportedModelError(f"{path}: tensors {n0!r} and {n1!r} overlap")
    tokens = kv.get("tokenizer.ggml.tokens")
    embd = next((dims for name, dims, _, _ in infos if name == "token_embd.weight"), None)
    n_tokens = len(tokens) if isinstance(tokens, list) else None
    if n_tokens is not None and embd is not None and len(embd) == 2 and embd[1] != n_tokens:
        raise UnsupportedModelError(
            f"{path}: tensor 'token_embd.weight' has {embd[1]} rows but the vocabulary "
            f"(tokenizer.ggml.tokens) has {n_tokens} tokens")
    return kv, table
