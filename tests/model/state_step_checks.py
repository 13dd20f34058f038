"""The bit-exact invariances every recurrent step kernel keeps (csrc/delta_net.c's gdn_step,
csrc/mamba2.c's mamba2_step), checked the same way for each: a kernel test module hands in its
`make_layer(d, n_cells, seed)` (a layer whose `run(kern, proj, n_new, read, write)` calls its
kernel on its state stores `k`, `v`) and `make_proj(d, T, seed)`, and `d` its sizes (nv, ha,
dk, dv, w as a state cell holds them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.model.kernel_variants import VARIANTS, variant_kernels

MakeLayer = Callable[[Any, int, int], Any]
MakeProj = Callable[[Any, int, int], torch.Tensor]
# (the output before its bf16 rounding, the conv state after, the matrices after) of one
# sequence's step from a layer's cell `read`
Reference = Callable[[Any, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
BF = torch.bfloat16

# a call of three sequences: (tokens, read cell, write cell)
SEQS = [(5, 2, 0), (1, -1, 1), (3, 4, 5)]
# and one whose sequences span several of the conv's chunks of 16 tokens
LONG = [(40, 2, 0), (17, -1, 1), (3, 2, 5)]


def matrices(d: Any, k: torch.Tensor, v: torch.Tensor, cell: int) -> torch.Tensor:
    """A cell's [nv, dk, dv] matrices (heads 0..ha-1 in k's row, the rest in v's)."""
    hd = d.dk * d.dv
    first = k[cell, (d.K - 1) * d.cc:].view(d.ha, d.dk, d.dv)
    rest = v[cell, :(d.nv - d.ha) * hd].view(d.nv - d.ha, d.dk, d.dv)
    return torch.cat([first, rest])


def conv_state(d: Any, k: torch.Tensor, cell: int) -> torch.Tensor:
    """A cell's conv rows [K-1, Cc], oldest first."""
    return k[cell, :(d.K - 1) * d.cc].view(d.K - 1, d.cc)


def check_against_reference(kern: Any, make_layer: MakeLayer, make_proj: MakeProj,
                            reference: Reference, d: Any, seqs: list[tuple[int, int, int]],
                            seed: int) -> None:
    """`seqs` in one call: each output within bf16's rounding of the reference, each write
    cell's state within f32 roundings of it (its conv rows exactly the inputs), and nothing else
    in the stores changed: not the read cells, other cells, or v's padding."""
    lay = make_layer(d, 7, seed)
    T = sum(n for n, _, _ in seqs)
    proj = make_proj(d, T, 3)
    before = lay.clone()
    out = lay.run(kern, proj, *map(list, zip(*seqs, strict=True)))
    assert out.dtype == BF and out.shape == (T, d.nv * d.dv)
    t0 = 0
    for n, rd, wr in seqs:
        y, new_conv, S = reference(before, proj[t0:t0 + n], rd)
        torch.testing.assert_close(out[t0:t0 + n].float(), y.to(BF).float(), atol=2e-2,
                                   rtol=1e-2)
        assert torch.equal(conv_state(d, lay.k, wr), new_conv)
        torch.testing.assert_close(matrices(d, lay.k, lay.v, wr), S, atol=1e-6, rtol=1e-6)
        t0 += n
    written = [wr for _, _, wr in seqs]
    kept = [c for c in range(7) if c not in written]
    assert torch.equal(lay.k[kept], before.k[kept]) and torch.equal(lay.v[kept], before.v[kept])
    pad = (d.nv - d.ha) * d.dk * d.dv
    assert torch.equal(lay.v[written, pad:], before.v[written, pad:])


def chained(kern: Any, lay: Any, proj: torch.Tensor, parts: list[int], read: int,
            cells: list[int]) -> torch.Tensor:
    """One sequence's tokens in calls of `parts` tokens, each call's write cell the next one's
    read cell (cells: the write cells in turn); the outputs concatenated."""
    outs, t0 = [], 0
    for n, wr in zip(parts, cells, strict=True):
        outs.append(lay.run(kern, proj[t0:t0 + n], [n], [read], [wr]))
        read, t0 = wr, t0 + n
    return torch.cat(outs)


def check_chunks_equal_one_call(kern: Any, make_layer: MakeLayer, make_proj: MakeProj, d: Any,
                                splits: tuple[list[int], ...]) -> None:
    """A sequence's tokens in each split of `splits` (one call, one a token, ...): the same
    output bits and final state bits, from a read state and from read == -1."""
    proj = make_proj(d, sum(splits[0]), 11)
    n_cells = max(len(p) for p in splits) + 1
    for read in (n_cells - 1, -1):
        runs = []
        for parts in splits:
            lay = make_layer(d, n_cells, 5)
            out = chained(kern, lay, proj, parts, read, list(range(len(parts))))
            last = len(parts) - 1
            runs.append((out, lay.k[last], lay.v[last, :(d.nv - d.ha) * d.dk * d.dv]))
        for other in runs[1:]:
            for a, b in zip(runs[0], other, strict=True):
                assert torch.equal(a, b), read


def check_beside_others(kern: Any, make_layer: MakeLayer, make_proj: MakeProj, d: Any,
                        n_before: int) -> None:
    """A sequence's outputs and state alone, after another sequence (of `n_before` tokens),
    before two others, on 1 and on 2 threads: the same bits."""
    before = torch.get_num_threads()
    a = make_proj(d, 4, 21)
    others = make_proj(d, 9, 22)
    results = []
    try:
        for nthreads in (1, 2):
            torch.set_num_threads(nthreads)
            for layout in ("alone", "after", "before"):
                lay = make_layer(d, 8, 6)
                if layout == "alone":
                    out = lay.run(kern, a, [4], [3], [0])[:4]
                elif layout == "after":
                    out = lay.run(kern, torch.cat([others[:n_before], a]), [n_before, 4],
                                  [-1, 3], [1, 0])[n_before:]
                else:
                    out = lay.run(kern, torch.cat([a, others]), [4, 6, 3], [3, 3, 7],
                                  [0, 2, 4])[:4]
                results.append((out, lay.k[0].clone(), lay.v[0].clone()))
    finally:
        torch.set_num_threads(before)
    for r in results[1:]:
        for x, y in zip(results[0], r, strict=True):
            assert torch.equal(x, y)


def check_read_cell_untouched(kern: Any, make_layer: MakeLayer, make_proj: MakeProj, d: Any,
                              token_counts: tuple[int, ...]) -> None:
    """The read cell keeps its bits (both stores, the whole row); read == -1 gives the bits a
    read of an all-zero cell gives, for each count of new tokens."""
    proj = make_proj(d, 5, 31)
    lay = make_layer(d, 4, 7)
    k2, v2 = lay.k[2].clone(), lay.v[2].clone()
    lay.run(kern, proj, [5], [2], [1])
    assert torch.equal(lay.k[2], k2) and torch.equal(lay.v[2], v2)

    fresh, zeroed = make_layer(d, 4, 7), make_layer(d, 4, 7)
    zeroed.k[3] = 0
    zeroed.v[3] = 0
    for n in token_counts:
        out_fresh = fresh.run(kern, proj[:n], [n], [-1], [0])
        out_zero = zeroed.run(kern, proj[:n], [n], [3], [0])
        assert torch.equal(out_fresh, out_zero)
        assert torch.equal(fresh.k[0], zeroed.k[0]) and torch.equal(fresh.v[0], zeroed.v[0])
    assert torch.equal(zeroed.k[3], torch.zeros(d.w))  # the zero cell read, not written


def check_every_variant(make_layer: MakeLayer, make_proj: MakeProj, dims: list[Any]) -> None:
    """Every x86 variant computes the same output and state bits (three sequences, one from
    the zero state)."""
    for d in dims:
        proj = make_proj(d, 9, 41)
        ref = None
        for name in VARIANTS:
            lay = make_layer(d, 7, 8)
            out = lay.run(variant_kernels(name), proj, [5, 1, 3], [2, -1, 4], [0, 1, 5])
            got = (out, lay.k, lay.v)
            if ref is None:
                ref = got
            for x, y in zip(ref, got, strict=True):
                assert torch.equal(x, y), (d, name)


def check_plan_refusals(call: Callable[..., Any]) -> None:
    """`call(**kw)` (the kernel on a 3-token step of one sequence, read cell 1, write cell 2, in
    a 4-cell store, with `kw` replacing arguments) refuses a bad plan before C sees it: token
    counts that do not add up or are not int64, read / write lists of another length, a write
    cell shared or read, and cells outside the store."""
    bad = [
        dict(n_new=torch.tensor([2])),
        dict(n_new=torch.tensor([3, 0]), read=torch.tensor([1, 0]), write=torch.tensor([2, 3])),
        dict(n_new=torch.tensor([3], dtype=torch.int32)), dict(read=torch.tensor([2])),
        dict(write=torch.tensor([1, 2])),
        dict(n_new=torch.tensor([1, 2]), read=torch.tensor([0, 1]), write=torch.tensor([2, 2])),
        dict(n_new=torch.tensor([1, 2]), read=torch.tensor([0, 2]), write=torch.tensor([2, 3])),
    ]
    for kw in bad:
        with pytest.raises(ValueError):
            call(**kw)
    for cells in (dict(read=torch.tensor([4])), dict(read=torch.tensor([-2])),
                  dict(write=torch.tensor([4])), dict(write=torch.tensor([-1]))):
        with pytest.raises(IndexError):
            call(**cells)
