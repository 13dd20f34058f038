"""One sequence's KV as bytes, and back (llama.cpp's llama_state_seq_get/set_data).

Layout (little-endian): magic "RXKV", u32 version, fingerprint (u16-length-prefixed arch
string, u32 n_layer, u32 n_head_kv, u32 head_dim, u16-length-prefixed dtype name), u32 n_tokens,
i32 positions[n_tokens], then for each layer the K rows [n_head_kv, n_tokens, head_dim] and the
V rows, in the pool's dtype. A sliding-window pool (swa.py) appends a second such block for its
sliding layers (arch suffixed ":swa", the window's positions only), as llama.cpp's iSWA state
writes the base cache then the SWA cache; a context checkpoint is that second block alone.
`set_state` validates everything (sizes, fingerprint, positions, free cells) before it touches
the pool, so a bad or foreign state leaves the pool exactly as it was. The engine restores a
host-cache entry the same way in two steps: the cache parses and checks (`parse_pool_state`,
`check_room`, `parse_draft_rows`: nothing written), the slot's KV owner writes the rows.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.memory.pool.pool import KVPool, KVTypes, OutOfCells, Windowed
from radixserve.memory.pool.kv_types import types_name

MAGIC = b"RXKV"
VERSION = 1


class StateError(ValueError):
    """A state that cannot be loaded here: corrupt, truncated, or from another model/dtype."""


@dataclass(slots=True, frozen=True)
class Fingerprint:
    arch: str
    n_layer: int
    n_head_kv: int
    head_dim: int
    dtype: str

    def pack(self) -> bytes:
        a, d = self.arch.encode(), self.dtype.encode()
        return (struct.pack("<H", len(a)) + a
                + struct.pack("<III", self.n_layer, self.n_head_kv, self.head_dim)
                + struct.pack("<H", len(d)) + d)


class _Reader:
    def __init__(self, data: bytes | memoryview) -> None:
        self.data, self.off = memoryview(data), 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.off + n > len(self.data):
            raise StateError(f"state truncated: need {n} bytes at offset {self.off}, "
                             f"{len(self.data) - self.off} left")
        out = self.data[self.off : self.off + n]
        self.off += n
        return out

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def string(self) -> str:
        (n,) = self.unpack("<H")
        return bytes(self.take(n)).decode("utf-8", "replace")


def fingerprint_of(pool: KVPool, arch: str) -> Fingerprint:
    """The pool's fingerprint; its dtype field names the cache types (`bf16`, `q8_0`,
    `q8_0/f16` for K and V apart): a state of one type never loads into a pool of another."""
    return Fingerprint(arch, pool.n_layer, pool.n_head_kv, pool.head_dim,
                       types_name(*pool.types))


def swa_fingerprint(pool: Windowed, fp: Fingerprint) -> Fingerprint:
    """The window part's fingerprint (its own rows and types: a short convolution's differ
    from the attention layers'): a state or checkpoint of another layout never loads."""
    w = pool.swa
    return Fingerprint(f"{fp.arch}:{pool.window_tag}", w.n_layer, w.n_head_kv, w.head_dim,
                       types_name(*w.types))


def _block_size(pool: KVPool, seq: int, fp: Fingerprint) -> int:
    n = pool.seq_len(seq)
    return 4 + 4 + len(fp.pack()) + 4 + 4 * n + n * pool.bytes_per_cell


def state_size(pool: KVPool, seq: int, fp: Fingerprint) -> int:
    n = _block_size(pool, seq, fp)
    if (w := pool.windowed) is not None:
        n += _block_size(w.swa, seq, swa_fingerprint(w, fp))
    return n


def draft_state_size(pool: KVPool, seq: int) -> int:
    """Bytes of `get_draft_state` (0 without a draft model)."""
    if pool.draft is None:
        return 0
    n = pool.seq_len(seq)
    return sum(4 + 4 + len(d.fp.pack()) + 4 + 4 * n for d in pool.draft.parts()) \
        + n * pool.draft.bytes_per_cell


def _rows_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def get_state(pool: KVPool, seq: int, fp: Fingerprint) -> bytes:
    """`seq`'s whole state: every layer (a sliding-window pool's two parts)."""
    data = _get_block(pool, seq, fp)
    if (w := pool.windowed) is not None:
        data += _get_block(w.swa, seq, swa_fingerprint(w, fp))
    return data


def get_swa_state(pool: Windowed, seq: int, fp: Fingerprint) -> bytes:
    """The window part only, its positions from `snapshot_from` (what a context checkpoint
    holds)."""
    return _get_block(pool.swa, seq, swa_fingerprint(pool, fp), p_min=pool.snapshot_from(seq))


def get_draft_state(pool: KVPool, seq: int) -> bytes:
    """The draft model's rows of `seq`'s cells (memory/pool/draft.py), as a state of its own:
    a block a group of rows (a recurrent draft's conv rows second)."""
    assert pool.draft is not None
    return b"".join(_get_block(pool, seq, d.fp, d) for d in pool.draft.parts())


def _get_block(pool: KVPool, seq: int, fp: Fingerprint, rows: Any = None,
               p_min: int = 0) -> bytes:
    """`rows`: whose K/V to read for the cells (default the pool's own; a DraftRows);
    `p_min`: the positions before it are left out."""
    rows = pool if rows is None else rows
    held = [(p, c) for p, c in zip(pool.seq_positions(seq), pool.seq_cells(seq)) if p >= p_min]
    positions = [p for p, _ in held]
    cells = torch.tensor([c for _, c in held], dtype=torch.long, device=pool.device)
    parts = [MAGIC, struct.pack("<I", VERSION), fp.pack(), struct.pack("<I", len(positions)),
             struct.pack(f"<{len(positions)}i", *positions)]
    if positions:
        k = rows.k[:, :, cells].cpu()  # [n_layer, n_head_kv, n, head_dim]
        v = rows.v[:, :, cells].cpu()
        for layer in range(rows.n_layer):
            parts.append(_rows_bytes(k[layer]))
            parts.append(_rows_bytes(v[layer]))
    return b"".join(parts)


@dataclass(slots=True)
class ParsedState:
    positions: list[int]
    k: torch.Tensor  # [n_layer, n_head_kv, n, head_dim]
    v: torch.Tensor
    swa: ParsedState | None = None  # a sliding-window pool's sliding part


def parse_state(data: bytes | memoryview, fp: Fingerprint, types: KVTypes,
                swa: tuple[Fingerprint, KVTypes] | None = None) -> ParsedState:
    """Decode and check a state without touching any pool (`types`: the pool's K and V cache
    types, which `fp` names); `swa`: a window part follows, of this fingerprint and types."""
    r = _Reader(data)
    st = _parse_block(r, fp, types)
    if swa is not None:
        st.swa = _parse_block(r, *swa)
        if st.swa.positions and (not st.positions or max(st.swa.positions) > max(st.positions)):
            raise StateError("sequence state's sliding part is past its global part")
    if r.off != len(r.data):
        raise StateError(f"sequence state has {len(r.data) - r.off} trailing bytes")
    return st


def _parse_block(r: _Reader, fp: Fingerprint, types: KVTypes) -> ParsedState:
    if bytes(r.take(4)) != MAGIC:
        raise StateError("not a radixserve sequence state (bad magic)")
    (version,) = r.unpack("<I")
    if version != VERSION:
        raise StateError(f"unsupported sequence state version {version} (expected {VERSION})")
    arch = r.string()
    n_layer, n_head_kv, head_dim = r.unpack("<III")
    dt = r.string()
    got = Fingerprint(arch, n_layer, n_head_kv, head_dim, dt)
    if got != fp:
        diffs = [f"{f}: file {getattr(got, f)!r} != model {getattr(fp, f)!r}"
                 for f in ("arch", "n_layer", "n_head_kv", "head_dim", "dtype")
                 if getattr(got, f) != getattr(fp, f)]
        raise StateError("sequence state is from another model, dtype or cache type ("
                         + "; ".join(diffs) + ")")
    (n,) = r.unpack("<I")
    positions = list(r.unpack(f"<{n}i")) if n else []
    if any(p < 0 for p in positions) or len(set(positions)) != n:
        raise StateError("sequence state has negative or duplicate positions")
    kt, vt = types
    rows = [n_head_kv * n * t.row_bytes(head_dim) for t in types]
    if len(r.data) - r.off < n_layer * sum(rows):
        raise StateError(f"sequence state size mismatch: {len(r.data) - r.off} bytes of K/V, "
                         f"expected {n_layer * sum(rows)}")
    kv: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for _ in range(n_layer):
        for t, size, out in zip(types, rows, kv):
            shape = (n_head_kv, n, t.width(head_dim))
            out.append(torch.frombuffer(bytearray(r.take(size)), dtype=t.storage).view(shape)
                       if n else torch.empty(shape, dtype=t.storage, device="cpu"))
    return ParsedState(positions, torch.stack(kv[0]), torch.stack(kv[1]))


def _check_room(pool: KVPool, seq: int, n: int) -> None:
    """Room for n rows in `pool`'s own part (a sliding-window pool's global part)."""
    if n > pool.seq_capacity(seq):
        raise OutOfCells(f"state of {n} tokens exceeds the sequence's capacity "
                         f"{pool.seq_capacity(seq)}")
    if n > KVPool.n_reclaimable(pool, seq):
        raise OutOfCells(f"state of {n} tokens needs more free cells than available")


def parse_pool_state(pool: KVPool, data: bytes | memoryview, fp: Fingerprint) -> ParsedState:
    """Decode and check a state of `pool`'s layout (a sliding-window pool's: both parts);
    touches nothing."""
    swa = pool.windowed
    return parse_state(data, fp, pool.types,
                       None if swa is None else (swa_fingerprint(swa, fp), swa.swa.types))


def check_room(pool: KVPool, seq: int, st: ParsedState) -> None:
    """OutOfCells unless `seq` could hold the state once its own cells go (reads only)."""
    _check_room(pool, seq, len(st.positions))
    if (w := pool.windowed) is not None:
        assert st.swa is not None
        _check_room(w.swa, seq, len(st.swa.positions))


def set_state(pool: KVPool, seq: int, data: bytes | memoryview, fp: Fingerprint) -> int:
    """Replace `seq`'s KV with the state; returns its token count. All checks come first."""
    swa = pool.windowed
    st = parse_pool_state(pool, data, fp)
    n = len(st.positions)
    check_room(pool, seq, st)
    pool.seq_rm(seq)
    pool.write_rows(seq, st.positions, st.k, st.v)
    if swa is not None and st.swa is not None:
        swa.swa.write_rows(seq, st.swa.positions, st.swa.k, st.swa.v)
    return n


def parse_swa_state(pool: Windowed, data: bytes | memoryview, fp: Fingerprint) -> ParsedState:
    """A checkpoint's sliding part, checked (StateError) without touching the pool."""
    r = _Reader(data)
    st = _parse_block(r, swa_fingerprint(pool, fp), pool.swa.types)
    if r.off != len(r.data):
        raise StateError(f"checkpoint state has {len(r.data) - r.off} trailing bytes")
    return st


def set_swa_state(pool: Windowed, seq: int, data: bytes | memoryview, fp: Fingerprint) -> None:
    """Replace only the sliding layers' KV of `seq` with a checkpoint's (checks first)."""
    st = parse_swa_state(pool, data, fp)
    _check_room(pool.swa, seq, len(st.positions))
    pool.swa.seq_rm(seq)
    pool.swa.write_rows(seq, st.positions, st.k, st.v)


def parse_draft_rows(pool: KVPool, data: bytes | memoryview,
                     positions: list[int]) -> tuple[torch.Tensor, ...]:
    """A draft state's rows (K and V of each of the draft's groups), checked against the
    draft rows' shapes and against the (ascending) `positions` each group must have rows for
    exactly (StateError); touches nothing."""
    assert pool.draft is not None
    r = _Reader(data)
    rows: list[torch.Tensor] = []
    for d in pool.draft.parts():
        st = _parse_block(r, d.fp, d.types)
        if st.positions != positions:
            raise StateError(f"draft state of {len(st.positions)} positions does not fit the "
                             f"sequence's {len(positions)}")
        rows += [st.k, st.v]
    if r.off != len(r.data):
        raise StateError(f"draft state has {len(r.data) - r.off} trailing bytes")
    return tuple(rows)


def parse_draft_state(pool: KVPool, seq: int,
                      data: bytes | memoryview) -> tuple[torch.Tensor, ...]:
    """A draft state's rows, checked as `parse_draft_rows` against the cells `seq` holds now
    (StateError unless it has rows for exactly their positions); touches nothing."""
    return parse_draft_rows(pool, data, pool.seq_positions(seq))


def set_draft_state(pool: KVPool, seq: int, data: bytes | memoryview) -> None:
    """Write a draft state into the draft rows of `seq`'s cells (all checks first)."""
    positions = pool.seq_positions(seq)
    rows = parse_draft_rows(pool, data, positions)
    if positions:
        assert pool.draft is not None
        idx = torch.tensor(pool.cells_at(seq, positions), dtype=torch.long, device=pool.device)
        pool.draft.write(idx, *rows)
