"""The device KV pool: llama.cpp's cell/sequence memory model in PyTorch.

A cell holds one token's K and V (for every layer) at one position, for the *set* of
sequences that use it. `seq_cp` in unified mode shares cells instead of copying K/V, and a cell
returns to the free list only when its last sequence drops it: this is what later lets several
slots read one copy of a prefix. K is stored after RoPE, so `seq_add` re-rotates K by the shift.

Layouts: unified (`--kv-unified`) draws every sequence's cells from one free list; partitioned
gives sequence s the fixed range [s*n, (s+1)*n) and copies K/V when `seq_cp` crosses ranges.
Only the engine thread touches a pool; there are no locks.

Rows by layer group: a pool keeps, for each cell, the rows of one or more layer groups: its own
layers (`KVPool`), a sliding window's layers in a window-sized part of their own (`SWAPool`,
swa.py), a draft model's layers (`DraftRows`, draft.py, attached). Nothing outside pool/ reads
or writes those tensors: the tiers ask the pool for a sequence's rows (`rows_out`: every group's
rows of a run of positions, as fresh host tensors, described by `row_layout`), cut what they
stored back into the pool's layout (`segment`), and give them back (`write_segment`). A new
kind of sequence memory is a group of memory/layout.py's `MemoryLayout` (with the capabilities
its callers ask there) and a subclass that adds its group to these methods (`_gather` and
`_split` are where its rows leave and come back apart; and to the state bytes of state.py),
made from the layout by the one factory (factory.py's `build_pool`): the tiers, the planner
and the engine do not change. A pool with a window part (swa.py, conv.py) says so by
`windowed`, the operations the owner and the state bytes use of it (`Windowed`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from radixserve.memory.layout import FULL, MemoryLayout
from radixserve.memory.pool.kv_types import KVType, of_dtype
from radixserve.memory.pool.rows import RowSpec, Segment, stored

if TYPE_CHECKING:
    from radixserve.memory.pool.draft import DraftRows

KVTypes = tuple[KVType, KVType]

# rotate(k [n, n_head_kv, head_dim], delta_pos [n]) -> k rotated by delta_pos
Rotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class OutOfCells(RuntimeError):
    """No free cells for a sequence; the scheduler may free idle slots or shrink the batch."""


@dataclass(slots=True)
class _Seq:
    """One sequence's cells keyed by position, plus a position-ordered view kept incrementally."""

    by_pos: dict[int, int] = field(default_factory=dict)
    order_pos: list[int] = field(default_factory=list)
    order_cell: list[int] = field(default_factory=list)
    ordered: bool = True  # order_* are valid and sorted by position
    contiguous: bool = True  # order_cell is one ascending run of cells
    index: torch.Tensor | None = None  # cached tensor of order_cell


@dataclass(slots=True)
class SeqView:
    """What attention needs to read one sequence: its cells (slice or index) and positions."""

    cells: slice | torch.Tensor
    positions: list[int]


def typed_rows(n_layer: int, n_head_kv: int, head_dim: int, n_cells: int, dtype: torch.dtype,
               types: KVTypes | None,
               device: torch.device) -> tuple[KVTypes, torch.Tensor, torch.Tensor]:
    """K and V of n_cells cells [n_layer, n_head_kv, n_cells, width], zeroed, stored in `types`
    (None: as the compute dtype `dtype`), with the types resolved (the pool's and a draft's)."""
    types = types or (of_dtype(dtype), of_dtype(dtype))
    for t in types:
        t.check(head_dim)
    k, v = (torch.zeros((n_layer, n_head_kv, n_cells, t.width(head_dim)), dtype=t.storage,
                        device=device) for t in types)
    return types, k, v


def cell_bytes(n_layer: int, n_head_kv: int, head_dim: int, types: KVTypes) -> int:
    """Bytes of one cell's K and V rows in every layer, stored in `types`."""
    return n_layer * n_head_kv * sum(t.row_bytes(head_dim) for t in types)


def rotate_rows(k: torch.Tensor, kt: KVType, idx: torch.Tensor, delta: torch.Tensor,
                rotate: Rotate, dtype: torch.dtype) -> None:
    """Re-rotate K rows `idx` of every layer of k [n_layer, n_head_kv, n_cells, width] by
    `delta` positions: through `dtype` values and stored again in `kt` (a quantized K is
    requantized, as llama.cpp's K-shift does through f32)."""
    for layer in range(k.shape[0]):
        rows = kt.dequantize(k[layer, :, idx], dtype).transpose(0, 1)  # [n, n_head_kv, d]
        k[layer, :, idx] = kt.quantize(rotate(rows, delta).to(dtype).transpose(0, 1))


class Windowed(Protocol):
    """A pool with a window part (swa.py; conv.py's state rows; recurrent.py's one state cell
    a sequence): the operations the slot's KV owner and the state bytes use of it, where
    `layout.window` > 0."""

    swa: KVPool  # the window part: the windowed group's rows of a sequence's last positions
    window_tag: str  # names the window's part in state bytes (state.py's fingerprints)
    n_keep: int  # the most positions a sequence's window part holds between two prunes

    def swa_pos_min(self, seq: int) -> int: ...

    def window_start(self, seq: int) -> int: ...

    def snapshot_from(self, seq: int) -> int: ...

    def prune(self, seq: int) -> None: ...


class KVPool:
    def __init__(
        self,
        n_layer: int,
        n_head_kv: int,
        head_dim: int,
        n_cells: int,
        n_seq: int,
        unified: bool,
        dtype: torch.dtype,
        rotate: Rotate,
        device: str | torch.device = "cpu",
        types: KVTypes | None = None,
        layout: MemoryLayout | None = None,
    ) -> None:
        """`dtype`: the compute dtype; `types`: how K and V rows are stored (`-ctk` / `-ctv`,
        memory/pool/kv_types.py; None: as `dtype`), so k / v are [n_layer, n_head_kv, n_cells,
        width] of each type's storage (a quantized row: its blocks' bytes). `layout`: the
        layout held, as the factory passes it (None: `n_layer` full-attention layers)."""
        if not unified and n_cells % n_seq:
            n_cells -= n_cells % n_seq
        if n_cells < n_seq:
            raise ValueError(f"KV pool of {n_cells} cells cannot serve {n_seq} sequences")
        self.n_layer, self.n_head_kv, self.head_dim = n_layer, n_head_kv, head_dim
        self.n_cells, self.n_seq, self.unified = n_cells, n_seq, unified
        self.dtype, self.device, self.rotate = dtype, torch.device(device), rotate
        self.types, self.k, self.v = typed_rows(n_layer, n_head_kv, head_dim, n_cells, dtype,
                                                types, self.device)
        self.cell_pos = [-1] * n_cells
        self.cell_seqs: list[set[int]] = [set() for _ in range(n_cells)]
        self.seqs = [_Seq() for _ in range(n_seq)]
        n_part = 1 if unified else n_seq
        self.part_size = n_cells // n_part
        self._free: list[list[int]] = [
            list(range(p * self.part_size, (p + 1) * self.part_size)) for p in range(n_part)
        ]
        self._n_free = n_cells
        self.draft: DraftRows | None = None  # a draft model's rows of these cells (draft.py)
        self.layout = layout or MemoryLayout(n_head_kv, head_dim, (FULL,) * n_layer)

    @property
    def windowed(self) -> Windowed | None:
        """This pool's window operations (None: it keeps every position's rows)."""
        return None

    @property
    def window_cells(self) -> int:
        """Cells of the window part (0: none)."""
        return 0

    # -- rows by layer group (the contract in the module's docstring) ------------------------
    def _row_layers(self) -> int:
        """Layers of this pool's own rows in `rows_out` (a sliding window's appended)."""
        return self.n_layer

    def row_layout(self) -> list[RowSpec]:
        """The row tensors `rows_out` gives a token, in order: every layer's K and V, then a
        draft model's, each as its cache type stores it (a float type unnamed)."""
        parts = [(self._row_layers(), self.n_head_kv, self.head_dim, self.types)]
        if self.draft is not None:
            parts += [(d.n_layer, d.n_head_kv, d.head_dim, d.types) for d in self.draft.parts()]
        return [RowSpec(layers, heads, t.width(dim), t.storage, t.name if t.quantized else "")
                for layers, heads, dim, types in parts for t in types]

    @property
    def bytes_per_token(self) -> int:
        """Host bytes of one token's rows in every group (what a tier stores a token in)."""
        return self.bytes_per_cell + (self.draft.bytes_per_cell if self.draft is not None else 0)

    def caches(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                              torch.Tensor | None]:
        """The K and V tensors a forward reads and writes: this pool's layers, then a windowed
        group's (None: no window)."""
        return self.k, self.v, None, None

    def window_view(self, seq: int, positions: list[int]
                    ) -> tuple[list[int], slice | torch.Tensor, list[int]] | None:
        """A windowed group's view for new tokens of `seq` at `positions` (their cells, the
        cells the window reads and their positions); None without a window."""
        return None

    def prune(self, seq: int) -> None:
        """Drop rows no later token reads (a window's oldest; nothing for full attention)."""

    def rows_held_from(self, seq: int) -> int:
        """The first position from which every group still holds `seq`'s rows (-1: a group
        holds none), so `rows_out` can copy only from there on."""
        return 0

    def window_from(self, n: int) -> int:
        """Where a restore of n tokens must bring a windowed group's rows from (0: no window)."""
        return 0

    def can_hold(self, seq: int, n: int) -> bool:
        """Whether `seq` can hold a restore of n tokens once its current cells (those it alone
        holds) go, in every group."""
        return n <= self.n_reclaimable(seq)

    def _gather(self, seq: int, positions: list[int],
                idx: torch.Tensor) -> list[torch.Tensor]:
        """This pool's own groups' row tensors of `positions` (cells `idx`), as `row_layout`
        lists them before a draft model's."""
        return [self.k[:, :, idx], self.v[:, :, idx]]

    def _split(self, rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor,
                                                        torch.Tensor, torch.Tensor,
                                                        list[torch.Tensor]]:
        """`_gather`'s tensors (then a draft's) back as (K, V of this pool's own layers, K, V
        of a window's layers (empty here), the draft's)."""
        k, v, *draft = rows
        g = self.n_layer
        return k[:g], v[:g], k[g:], v[g:], draft

    def rows_out(self, seq: int, p0: int, p1: int) -> list[torch.Tensor]:
        """The rows of positions [p0, p1) of `seq` in every group (`row_layout`'s order), as new
        host tensors; the pool is only read."""
        positions = list(range(p0, p1))
        idx = torch.tensor(self.cells_at(seq, positions), dtype=torch.long, device=self.device)
        rows = [t.contiguous() for t in self._gather(seq, positions, idx)]
        if self.draft is not None:
            rows += self.draft.gather(idx)
        if self.device.type == "cpu":
            return rows  # advanced indexing already made fresh tensors
        # off a device pool the rows come to pageable host memory. Not pinned one allocation a
        # segment: torch's pinned allocator rounds each up to a power of two and keeps what is
        # freed, so the tier's page-locked memory could reach twice the tier's budget and never
        # shrink; pinning wants one arena of the tier's size, to measure on a GPU
        return [t.to("cpu") for t in rows]

    def segment(self, pos0: int, rows: list[torch.Tensor], n: int, window_from: int) -> Segment:
        """The first `n` of `rows` (as `rows_out` gave them, from position pos0) in this pool's
        layout for a restore whose window starts at `window_from` (a sliding group keeps only
        the window's positions). ValueError for rows of another layout."""
        want = tuple((r.n_layer, r.n_head_kv, r.width, r.dtype) for r in self.row_layout())
        got = tuple((t.shape[0], t.shape[1], t.shape[3], t.dtype) for t in rows)
        if got != want or len({t.shape[2] for t in rows}) != 1:
            raise ValueError(f"segment at position {pos0} has rows {got}; the pool wants {want}")
        k, v, wk, wv, draft = self._split(rows)
        return Segment(list(range(pos0, pos0 + n)), k[:, :, :n], v[:, :, :n],
                       self._window(pos0, wk, wv, n, window_from),
                       tuple(d[:, :, :n] for d in draft) if draft else None)

    def _window(self, pos0: int, k: torch.Tensor, v: torch.Tensor, n: int,
                window_from: int) -> tuple[list[int], torch.Tensor, torch.Tensor] | None:
        """A sliding group's part of a segment (none here)."""
        return None

    def write_segment(self, seq: int, seg: Segment) -> None:
        """Put a segment's rows into fresh cells of `seq` (ValueError for a group this pool
        lacks; OutOfCells when there is no room)."""
        if seg.swa is not None:
            raise ValueError("sliding-window rows for a pool without a sliding part")
        if seg.draft is not None and self.draft is None:
            raise ValueError("draft rows for a pool without a draft model")
        self.write_rows(seq, seg.positions, seg.k, seg.v)
        if seg.draft is not None and seg.positions:
            assert self.draft is not None
            idx = torch.tensor(self.cells_at(seq, seg.positions), dtype=torch.long,
                               device=self.device)
            self.draft.write(idx, *seg.draft)

    def write_rows(self, seq: int, positions: list[int], k: torch.Tensor,
                   v: torch.Tensor) -> None:
        """K/V rows [n_layer, n_head_kv, n, width] of this pool's own layers into fresh cells of
        `seq` at `positions`."""
        if not positions:
            return
        idx = torch.tensor(self.alloc(seq, positions), dtype=torch.long, device=self.device)
        self.k[:, :, idx] = stored(k, self.k, self.device)
        self.v[:, :, idx] = stored(v, self.v, self.device)

    # -- sizes ---------------------------------------------------------------------------
    @property
    def n_free(self) -> int:
        return self._n_free

    @property
    def bytes_per_cell(self) -> int:
        return cell_bytes(self.n_layer, self.n_head_kv, self.head_dim, self.types)

    def seq_capacity(self, seq: int) -> int:
        """Cells sequence `seq` could hold if it had every cell it may draw from."""
        return self.n_cells if self.unified else self.part_size

    def n_free_for(self, seq: int) -> int:
        return len(self._free[self._part(seq)])

    def n_reclaimable(self, seq: int) -> int:
        """Cells `seq` could hold after dropping its own: the free ones plus those no other
        sequence shares (what replacing its content with a restored state may use)."""
        own = sum(1 for c in self.seq_cells(seq) if len(self.cell_seqs[c]) == 1)
        return len(self._free[self._part(seq)]) + own

    def seq_len(self, seq: int) -> int:
        return len(self.seqs[seq].by_pos)

    def seq_pos_max(self, seq: int) -> int:
        """The last position of `seq` (-1: none); O(1) while it grows by appends (every step
        asks, through the sliding window's prune)."""
        pos = self._ordered(seq).order_pos
        return pos[-1] if pos else -1

    def seq_positions(self, seq: int) -> list[int]:
        return list(self._ordered(seq).order_pos)

    def seq_cells(self, seq: int) -> list[int]:
        return list(self._ordered(seq).order_cell)

    def cells_at(self, seq: int, positions: list[int]) -> list[int]:
        by_pos = self.seqs[seq].by_pos
        return [by_pos[p] for p in positions]

    # -- allocation ----------------------------------------------------------------------
    def _part(self, seq: int) -> int:
        self._check_seq(seq)
        return 0 if self.unified else seq

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq:
            raise IndexError(f"sequence {seq} out of range [0, {self.n_seq})")

    def _take(self, seq: int, n: int) -> list[int]:
        free = self._free[self._part(seq)]
        if len(free) < n:
            raise OutOfCells(f"sequence {seq} needs {n} cells, {len(free)} free")
        self._n_free -= n
        return [heapq.heappop(free) for _ in range(n)]

    def _release(self, cell: int) -> None:
        self.cell_pos[cell] = -1
        heapq.heappush(self._free[0 if self.unified else cell // self.part_size], cell)
        self._n_free += 1

    def alloc_step(self, seq: int, positions: list[int]) -> list[int]:
        """Cells for a forward's new tokens of `seq` in every part (all or nothing); returns
        this part's cells (`cells_at` finds a window part's)."""
        return self.alloc(seq, positions)

    def alloc(self, seq: int, positions: list[int]) -> list[int]:
        """Give `seq` fresh cells at `positions` (all or nothing); returns the cells."""
        s = self.seqs[seq]
        for p in positions:
            if p in s.by_pos:
                raise ValueError(f"sequence {seq} already has a cell at position {p}")
        cells = self._take(seq, len(positions))
        self._attach(seq, positions, cells)
        return cells

    def _attach(self, seq: int, positions: list[int], cells: list[int]) -> None:
        if not positions:
            return
        s = self.seqs[seq]
        for p, c in zip(positions, cells):
            self.cell_pos[c] = p
            self.cell_seqs[c].add(seq)
            s.by_pos[p] = c
        appendable = s.ordered and positions == sorted(positions)
        appendable = appendable and (not s.order_pos or positions[0] > s.order_pos[-1])
        if appendable:
            prev = s.order_cell[-1] if s.order_cell else cells[0] - 1
            run = all(b == a + 1 for a, b in zip([prev, *cells], cells))
            s.contiguous = s.contiguous and run
            s.order_pos.extend(positions)
            s.order_cell.extend(cells)
        else:
            s.ordered = False
        s.index = None

    def _detach(self, seq: int, positions: list[int]) -> None:
        s = self.seqs[seq]
        for p in positions:
            c = s.by_pos.pop(p)
            self.cell_seqs[c].discard(seq)
            if not self.cell_seqs[c]:
                self._release(c)
        if positions:
            s.ordered, s.index = False, None

    # -- llama.cpp's sequence operations --------------------------------------------------
    def seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> None:
        """Drop `seq`'s cells with position in [p0, p1) (p1 < 0: to the end)."""
        self._check_seq(seq)
        self._detach(seq, self._in_range(seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """Give `dst` the cells of `src` in [p0, p1): shared in unified mode, copied otherwise."""
        self._check_seq(dst)
        if src == dst:
            return
        positions = self._in_range(src, p0, p1)
        held = [p for p in positions if p in self.seqs[dst].by_pos]
        if not self.unified:  # all or nothing: check room before dst loses the cells it holds
            d = self.seqs[dst]
            freed = sum(1 for p in held if self.cell_seqs[d.by_pos[p]] == {dst})
            free = len(self._free[self._part(dst)])
            if free + freed < len(positions):
                raise OutOfCells(f"sequence {dst} needs {len(positions)} cells, "
                                 f"{free + freed} free")
        self._detach(dst, held)
        src_cells = [self.seqs[src].by_pos[p] for p in positions]
        if self.unified:
            self._attach(dst, positions, src_cells)
            return
        cells = self._take(dst, len(positions))
        self._copy_cells(src_cells, cells)
        self._attach(dst, positions, cells)

    def seq_keep(self, seq: int) -> None:
        """Keep only `seq`: every other sequence loses all its cells."""
        self._check_seq(seq)
        for other in range(self.n_seq):
            if other != seq:
                self.seq_rm(other)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        """Shift `seq`'s positions in [p0, p1) by `delta`, re-rotating K (llama.cpp's K-shift).

        A cell shared with another sequence is copied first (the other keeps its position).
        Cells whose position would become negative are dropped, as in llama.cpp.
        """
        self._check_seq(seq)
        if delta == 0:
            return
        s = self.seqs[seq]
        moved = self._in_range(seq, p0, p1)
        kept = [p for p in moved if p + delta >= 0]
        clash = {p + delta for p in kept}.intersection(set(s.by_pos) - set(moved))
        if clash:
            raise ValueError(f"seq_add would put two cells of sequence {seq} at position {min(clash)}")
        self._detach(seq, [p for p in moved if p + delta < 0])
        moved = kept
        if not moved:
            return
        shared = [p for p in moved if len(self.cell_seqs[s.by_pos[p]]) > 1]
        if shared:
            old = [s.by_pos[p] for p in shared]
            self._detach(seq, shared)
            new = self._take(seq, len(shared))
            self._copy_cells(old, new)
            self._attach(seq, shared, new)
        cells = [s.by_pos.pop(p) for p in moved]
        for p, c in zip(moved, cells):
            s.by_pos[p + delta] = c
            self.cell_pos[c] = p + delta
        s.ordered, s.index = False, None
        idx = torch.tensor(cells, dtype=torch.long, device=self.device)
        d = torch.full((len(cells),), delta, dtype=torch.long, device=self.device)
        rotate_rows(self.k, self.types[0], idx, d, self.rotate, self.dtype)
        if self.draft is not None:
            self.draft.rotate_cells(idx, d)

    def clear(self) -> None:
        for seq in range(self.n_seq):
            self.seq_rm(seq)

    # -- reading and writing K/V -----------------------------------------------------------
    def _in_range(self, seq: int, p0: int, p1: int) -> list[int]:
        hi = float("inf") if p1 < 0 else p1
        return [p for p in self.seqs[seq].by_pos if p0 <= p < hi]

    def _copy_cells(self, src: list[int], dst: list[int]) -> None:
        if not src:
            return
        si = torch.tensor(src, dtype=torch.long, device=self.device)
        di = torch.tensor(dst, dtype=torch.long, device=self.device)
        self.k[:, :, di] = self.k[:, :, si]
        self.v[:, :, di] = self.v[:, :, si]
        if self.draft is not None:
            self.draft.copy_cells(si, di)

    def _ordered(self, seq: int) -> _Seq:
        s = self.seqs[seq]
        if not s.ordered:
            items = sorted(s.by_pos.items())
            s.order_pos = [p for p, _ in items]
            s.order_cell = [c for _, c in items]
            s.contiguous = all(b == a + 1 for a, b in zip(s.order_cell, s.order_cell[1:]))
            s.ordered, s.index = True, None
        return s

    def view(self, seq: int) -> SeqView:
        """The sequence's cells in position order: a slice when they form one run (no gather)."""
        s = self._ordered(seq)
        if s.contiguous and s.order_cell:
            return SeqView(slice(s.order_cell[0], s.order_cell[-1] + 1), s.order_pos)
        if s.index is None:
            s.index = torch.tensor(s.order_cell, dtype=torch.long, device=self.device)
        return SeqView(s.index, s.order_pos)

    # -- invariants ------------------------------------------------------------------------
    def check(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests call this often)."""
        used = 0
        for c in range(self.n_cells):
            if self.cell_seqs[c]:
                used += 1
                assert self.cell_pos[c] >= 0, f"cell {c} used but has no position"
                for s in self.cell_seqs[c]:
                    assert self.seqs[s].by_pos.get(self.cell_pos[c]) == c, f"cell {c} / seq {s}"
            else:
                assert self.cell_pos[c] == -1, f"cell {c} unused but has position"
        free = sorted(c for part in self._free for c in part)
        assert len(free) == self._n_free == self.n_cells - used, "free count mismatch"
        assert len(set(free)) == len(free), "a cell is free twice"
        assert all(not self.cell_seqs[c] for c in free), "a used cell is on the free list"
        for i, sq in enumerate(self.seqs):
            for p, c in sq.by_pos.items():
                assert i in self.cell_seqs[c] and self.cell_pos[c] == p, f"seq {i} pos {p}"
                assert self.unified or c // self.part_size == i, f"seq {i} left its partition"
            if sq.ordered:
                assert sq.order_pos == sorted(sq.by_pos), f"seq {i} order view stale"
