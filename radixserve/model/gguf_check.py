"""A GGUF file's structure checked before anything reads its tensors.

Why our own pass: gguf-py's reader maps each tensor over the file and fails on a malformed one
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

import gguf

from radixserve.model.hparams import UnsupportedModelError

MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_DIM = 2**31 - 1  # one dimension: llama.cpp's own limit (int32 row counts)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}  # GGUF value type -> struct code (8 string, 9 array)


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
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> object:
        """A value of the given type; arrays are skipped and give their length."""
        if vtype == 8:
            return self.string()
        if vtype == 9:
            itype, count = int(self.take("I")), int(self.take("Q"))
            if itype in _SCALAR:
                size = struct.calcsize("<" + _SCALAR[itype]) * count
                if self.pos + size > len(self.buf):
                    raise UnsupportedModelError(f"{self.path}: the GGUF header ends early")
                self.pos += size
            else:
                for _ in range(count):
                    self.value(itype)
            return count
        if vtype not in _SCALAR:
            raise UnsupportedModelError(f"{self.path}: unknown GGUF value type {vtype}")
        return self.take(_SCALAR[vtype])


def check_gguf(path: str) -> None:
    """Raise UnsupportedModelError naming what is wrong with the file's structure, if anything
    (a file that is not GGUF at all included)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size < 24 or f.read(4) != b"GGUF":
            raise UnsupportedModelError(f"{path}: not a GGUF file (no GGUF magic)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            _check(_Cursor(buf, path), size)


def _check(c: _Cursor, file_size: int) -> None:
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
        kv[key] = c.value(int(c.take("I")))
    align = kv.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise UnsupportedModelError(f"{path}: general.alignment {align} is not a power of two")
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = int(c.take("I"))
        if not 1 <= n_dims <= MAX_DIMS:
            raise UnsupportedModelError(f"{path}: tensor {name!r} has {n_dims} dimensions "
                                        f"(1 to {MAX_DIMS})")
        dims = [int(c.take("Q")) for _ in range(n_dims)]
        raw_type, offset = int(c.take("I")), int(c.take("Q"))
        infos.append((name, dims, raw_type, offset))
    data_start = -(-c.pos // align) * align
    spans = []
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
    spans.sort()
    for (s0, e0, n0), (s1, _, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise UnsupportedModelError(f"{path}: tensors {n0!r} and {n1!r} overlap")
    tokens = kv.get("tokenizer.ggml.tokens")
    embd = next((dims for name, dims, _, _ in infos if name == "token_embd.weight"), None)
    if isinstance(tokens, int) and embd is not None and len(embd) == 2 and embd[1] != tokens:
        raise UnsupportedModelError(
            f"{path}: tensor 'token_embd.weight' has {embd[1]} rows but the vocabulary "
            f"(tokenizer.ggml.tokens) has {tokens} tokens")
