"""Our C step kernels (model/csrc/) against torch's own ops on the same inputs, in every
variant (avx512bf16, avx512, avxvnni, avx2, generic: the same sources built with other flags),
their input checks (they take raw pointers), their build cache and the choice of variant
(RADIXSERVE_KERNELS). The tiles' products (csrc/i8act.c) are checked bit for bit on every
variant by tests/model/test_i8act.py; here their input checks and Q4Linear's rows."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from radixserve.model import kernel_build as B
from radixserve.model import kernels as K
from radixserve.model.kernel_config import KernelConfig
from radixserve.model.hparams import HParams
from radixserve.model.rope import Rope
from radixserve.model.step import plain_step
from tests.model.kernel_variants import (  # noqa: F401 (fixtures)
    HAS,
    VARIANTS,
    act8_tolerance,
    kern,
    permuted_lanes,
    threads,
    variant_kernels,
)

BF = torch.bfloat16


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reference decode attention: q [1, H, d], k/v [n_kv, L, d] -> [1, H * d]."""
    n_kv, _, d = k.shape
    g = q.shape[1] // n_kv
    o = F.scaled_dot_product_attention(q.view(1, n_kv, g, d).to(dtype), k[None].to(dtype),
                                       v[None].to(dtype))
    return o.reshape(1, -1).float()


# (n_kv, group, head_dim): the default model's shape (AVX-512 path), others (generic path)
SHAPES = [(3, 3, 64), (2, 4, 64), (8, 1, 64), (4, 2, 128), (1, 1, 32)]
LENGTHS = [1, 2, 3, 15, 16, 17, 33, 257, 299]


@pytest.mark.parametrize("n_kv,g,d", SHAPES)
def test_attend_as_accurate_as_torch_bf16(kern, threads, n_kv, g, d):
    """Against f32 SDPA, the kernel's error is within twice bf16 SDPA's (plus a rounding step),
    for runs of cells and gathered cells, odd and even lengths, 1 and 2 threads."""
    gen = torch.Generator().manual_seed(n_kv * 100 + d)
    n_cells = 300
    pk = (torch.randn(n_kv, n_cells, d, generator=gen) * 2).to(BF)
    pv = torch.randn(n_kv, n_cells, d, generator=gen).to(BF)
    for n in LENGTHS:
        q = (torch.randn(1, n_kv * g, d, generator=gen) * 2).to(BF)
        perm = torch.randperm(n_cells, generator=gen)[:n]
        for cells in (slice(1, 1 + n), perm):
            k, v = pk[:, cells], pv[:, cells]
            ref = sdpa(q, k, v, torch.float32)
            err_torch = (sdpa(q, k, v, BF) - ref).abs().max().item()
            err = (kern.attend(q, pk, pv, cells).float() - ref).abs().max().item()
            assert err <= 2 * err_torch + 2**-8 * ref.abs().max().item(), (n, cells)


def test_attend_passes_a_nan_through(kern):
    """A NaN in a query reaches that query head's output (corrupt inputs show, as in torch's
    SDPA), and only that head's; the other heads' outputs stay finite."""
    gen = torch.Generator().manual_seed(5)
    for n_kv, g, d in [(3, 3, 64), (1, 4, 256), (2, 2, 32)]:
        pk = torch.randn(n_kv, 40, d, generator=gen).to(BF)
        pv = torch.randn(n_kv, 40, d, generator=gen).to(BF)
        q = torch.randn(1, n_kv * g, d, generator=gen).to(BF)
        q[0, 1, 3] = float("nan")
        out = kern.attend(q, pk, pv, slice(0, 33)).float().view(n_kv * g, d)
        assert out[1].isnan().all(), (n_kv, g, d)
        assert torch.isfinite(out[torch.arange(n_kv * g) != 1]).all(), (n_kv, g, d)


def test_decode_step_equals_torch_path(kern, threads):
    """One call a layer: RoPE, the K/V store and attention for three sequences (a run of cells,
    gathered cells, a one-token sequence) equal Rope.apply + index_copy + SDPA."""
    hp = HParams(arch="llama", n_layer=2, n_embd=576, n_ff=64, n_head=9, n_head_kv=3,
                 head_dim=64, n_vocab=100, n_ctx_train=4096, rms_eps=1e-5, rope_base=10000.0,
                 rope_neox=True, rope_scale_linear=1.0, name="t")
    rope = Rope(hp)
    gen = torch.Generator().manual_seed(7)
    shape = (hp.n_layer, hp.n_head_kv, 64, hp.head_dim)
    pk, pv = torch.randn(shape, generator=gen).to(BF), torch.randn(shape, generator=gen).to(BF)
    pk2, pv2 = pk.clone(), pv.clone()
    # a new cell belongs to its sequence alone (shared prefix cells are only read)
    scattered = torch.tensor([12, 13, 35, 8, 50, 52])  # shares cells 12, 13 with the first
    cells = [slice(10, 30), scattered, slice(60, 61)]
    dst = [29, 52, 60]  # each sequence's new cell, last in its cells
    pos = torch.tensor([19, 5, 0])
    cos, sin = rope.cos_sin(pos)
    row = (hp.n_head + 2 * hp.n_head_kv) * hp.head_dim
    x = torch.randn(3, hp.n_embd, generator=gen)
    w = torch.rand(hp.n_embd, generator=gen) + 0.5
    step = plain_step(kern, pk, pv, hp.n_head, cells, dst, cos, sin, x, 1e-5, 64)
    # the step's add + norm and gate equal the general kernels (and write reused buffers)
    x2, y = x.clone(), torch.randn(3, hp.n_embd, generator=gen).to(BF)
    got = step.norm(x, y, w)
    assert got is step.h and torch.equal(got, kern.add_rms_norm(x2, y, w, 1e-5))
    assert torch.equal(x, x2)
    gu = torch.randn(3, 128, generator=gen).to(BF)
    assert step.silu(gu) is step.act and torch.equal(step.act, kern.silu_mul(gu))
    for layer in range(hp.n_layer):
        qkv = torch.randn(3, row, generator=gen).to(BF)
        out = step.attend(layer, qkv).float()
        # the torch path
        nq, nk = hp.n_head * 64, hp.n_head_kv * 64
        qk = rope.apply(qkv[:, : nq + nk].view(3, -1, 64), cos, sin)
        q, k = qk[:, : hp.n_head], qk[:, hp.n_head :]
        v = qkv[:, nq + nk :].view(3, hp.n_head_kv, 64)
        pk2[layer].index_copy_(1, torch.tensor(dst), k.transpose(0, 1))
        pv2[layer].index_copy_(1, torch.tensor(dst), v.transpose(0, 1))
        # K: the same f32 rotation with Rope.apply's roundings (its addcmul is one FMA)
        assert torch.equal(pv[layer], pv2[layer]) and torch.equal(pk[layer], pk2[layer])
        for i, c in enumerate(cells):
            ref = sdpa(q[i : i + 1], pk2[layer][:, c].float(), pv2[layer][:, c].float(),
                       torch.float32)
            assert (out[i : i + 1] - ref).abs().max() < 2**-6 * ref.abs().max() + 1e-3


def causal_f64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: q [n, H, d] the last n of the keys k/v [n_kv, L, d]; query i sees the first
    L - n + i + 1 -> [n, H * d] in float64; q.k scaled by `scale` (None: 1 / sqrt(d));
    `sinks` [H]: a logit a head in the softmax, its share dropped (HF's gpt-oss)."""
    n, heads, d = q.shape
    n_kv, length, _ = k.shape
    kk, vv = k.double().repeat_interleave(heads // n_kv, 0), v.double()
    vv = vv.repeat_interleave(heads // n_kv, 0)
    s = torch.einsum("nhd,hld->hnl", q.double(), kk) * (d**-0.5 if scale is None else scale)
    seen = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
    s = s.masked_fill(~seen, -torch.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None, None].expand(heads, n, 1)], -1)
    p = torch.softmax(s, -1)[..., :length]
    return torch.einsum("hnl,hld->nhd", p, vv).reshape(n, -1)


@pytest.mark.parametrize("n_kv,g,d", [(3, 3, 64), (2, 4, 32), (2, 2, 128)])
def test_attend_causal_matches_float64(kern, threads, n_kv, g, d):
    """Chunks of queries over contexts that cross several 256-key blocks, through the AVX-512
    path (d 64) and the generic one, are within two bf16 steps of the largest output."""
    gen = torch.Generator().manual_seed(d + n_kv)
    n_cells = 900
    pk = (torch.randn(n_kv, n_cells, d, generator=gen) * 2).to(BF)
    pv = torch.randn(n_kv, n_cells, d, generator=gen).to(BF)
    for length, n in ((1, 1), (700, 1), (700, 300), (513, 513), (260, 7)):
        q = (torch.randn(n, n_kv * g, d, generator=gen) * 2).to(BF)
        perm = torch.randperm(n_cells, generator=gen)[:length]
        for cells in (slice(100, 100 + length), perm):
            ref = causal_f64(q, pk[:, cells], pv[:, cells])
            err = (kern.attend_causal(q, pk, pv, cells).double() - ref).abs().max().item()
            assert err <= 2**-7 * ref.abs().max().item(), (length, n, err)


@pytest.mark.parametrize("d", [64, 32])
def test_attend_causal_takes_the_models_scale(kern, d):
    """A scale other than 1/sqrt(d) (Granite's attention multiplier, Gemma 3 27B's) is the
    kernel's softmax scale, in the AVX-512 path (d 64) and the generic one."""
    gen = torch.Generator().manual_seed(d)
    pk = (torch.randn(2, 300, d, generator=gen) * 2).to(BF)
    pv = torch.randn(2, 300, d, generator=gen).to(BF)
    q = (torch.randn(5, 4, d, generator=gen) * 2).to(BF)
    cells = slice(0, 280)
    for scale in (0.0078125, 0.3):
        ref = causal_f64(q, pk[:, cells], pv[:, cells], scale)
        err = (kern.attend_causal(q, pk, pv, cells, scale=scale).double() - ref).abs().max()
        assert err <= 2**-7 * ref.abs().max(), (scale, err)
        default = causal_f64(q, pk[:, cells], pv[:, cells])
        assert (default - ref).abs().max() > 10 * err  # the scale changes the answer


@pytest.mark.parametrize("d", [64, 32])
def test_attend_causal_takes_attention_sinks(kern, threads, d):
    """gpt-oss's sinks (a logit a query head that joins its softmax, with no value) within
    two bf16 steps of float64, whether a sink dominates the head's keys or not, in the
    AVX-512 path (d 64) and the generic one; the sinks change the answer, and a chunk's query
    equals itself alone over its prefix, bit for bit."""
    gen = torch.Generator().manual_seed(d + 7)
    pk = (torch.randn(2, 600, d, generator=gen) * 2).to(BF)
    pv = torch.randn(2, 600, d, generator=gen).to(BF)
    q = (torch.randn(40, 6, d, generator=gen) * 2).to(BF)
    cells = torch.randperm(600, generator=gen)[:530]
    sinks = torch.tensor([-30.0, 0.0, 2.5, 8.0, 40.0, -1.0])
    ref = causal_f64(q, pk[:, cells], pv[:, cells], sinks=sinks)
    got = kern.attend_causal(q, pk, pv, cells, sinks=sinks)
    err = (got.double() - ref).abs().max()
    assert err <= 2**-7 * ref.abs().max(), err
    assert (causal_f64(q, pk[:, cells], pv[:, cells]) - ref).abs().max() > 10 * err
    alone = torch.cat([kern.attend_causal(q[i : i + 1], pk, pv, cells[: 530 - 40 + i + 1],
                                          sinks=sinks) for i in range(40)])
    assert torch.equal(got, alone)
    with pytest.raises(ValueError, match="sinks"):
        kern.attend_causal(q, pk, pv, cells, sinks=sinks[:4])


@pytest.mark.parametrize("d", [32, 128])
def test_attend_causal_generic_path_is_bitwise_invariant(kern, threads, d):
    """The generic path (head_dim not 64) keeps the same blocks: each query of a chunk equals
    itself alone over its prefix, computed with the other thread count."""
    gen = torch.Generator().manual_seed(d)
    n_kv, g, n_cells, length, n = 2, 3, 800, 700, 300
    pk = torch.randn(n_kv, n_cells, d, generator=gen).to(BF)
    pv = torch.randn(n_kv, n_cells, d, generator=gen).to(BF)
    q = (torch.randn(n, n_kv * g, d, generator=gen) * 2).to(BF)
    cells = torch.randperm(n_cells, generator=gen)[:length]
    chunk = kern.attend_causal(q, pk, pv, cells)
    torch.set_num_threads(3 - threads)
    try:
        alone = torch.cat([kern.attend_causal(q[i : i + 1], pk, pv, cells[: length - n + i + 1])
                           for i in range(n)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(chunk, alone)


def windowed_f32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos0: int,
                 window: int) -> torch.Tensor:
    """Reference: f32 math on the bf16 inputs; keys k/v [n_kv, L, d] at positions pos0 ..
    pos0 + L - 1, queries q [n, H, d] the last n of them; a query at p sees keys at k <= p, and
    with window > 0 only those with p - window < k (llama.cpp's SWA mask) -> [n, H * d]."""
    n, heads, d = q.shape
    n_kv, length, _ = k.shape
    kk = k.float().repeat_interleave(heads // n_kv, 0)
    vv = v.float().repeat_interleave(heads // n_kv, 0)
    s = torch.einsum("nhd,hld->hnl", q.float(), kk) * d**-0.5
    kpos = pos0 + torch.arange(length)[None, :]
    qpos = pos0 + torch.arange(length - n, length)[:, None]
    seen = kpos <= qpos
    if window > 0:
        seen &= kpos > qpos - window
    p = torch.softmax(s.masked_fill(~seen, -torch.inf), -1)
    return torch.einsum("hnl,hld->nhd", p, vv).reshape(n, -1)


# (n_kv, group, head_dim): Gemma 3's (1, 4, 256) and others, the AVX-512 path (d 64) and the
# generic one (d 256)
WINDOW_SHAPES = [(1, 4, 256), (2, 3, 256), (1, 4, 64), (2, 3, 64)]


@pytest.mark.parametrize("n_kv,g,d", WINDOW_SHAPES)
def test_windowed_attend_causal_matches_torch(kern, n_kv, g, d):
    """Sliding windows (and window 0) over lists that start at position 0 or elsewhere and
    cross 256-position blocks are within two bf16 steps of the largest output of f32 math;
    window 1 gives each query its own value row exactly."""
    gen = torch.Generator().manual_seed(10 * d + g)
    n_cells = 1100
    pk = (torch.randn(n_kv, n_cells, d, generator=gen) * 2).to(BF)
    pv = torch.randn(n_kv, n_cells, d, generator=gen).to(BF)
    # (list length, queries, pos0)
    for length, n, pos0 in ((1, 1, 0), (257, 257, 0), (700, 300, 37), (513, 64, 256),
                            (600, 5, 700), (255, 20, 1)):
        q = (torch.randn(n, n_kv * g, d, generator=gen) * 2).to(BF)
        perm = torch.randperm(n_cells, generator=gen)[:length]
        for cells in (slice(100, 100 + length), perm):
            k, v = pk[:, cells], pv[:, cells]
            for window in (0, 1, 7, 256, 300, 512):
                ref = windowed_f32(q, k, v, pos0, window)
                got = kern.attend_causal(q, pk, pv, cells, window=window, pos0=pos0).float()
                err = (got - ref).abs().max().item()
                assert err <= 2**-7 * ref.abs().max().item(), (length, n, pos0, window, err)
                if window == 1:
                    own = v[:, length - n :].repeat_interleave(g, 0).transpose(0, 1)
                    assert torch.equal(got, own.reshape(n, -1).float())


@pytest.mark.parametrize("d,g", [(64, 4), (256, 4), (256, 3)])
@pytest.mark.parametrize("window", [7, 300, 512])
def test_windowed_attend_causal_is_bitwise_invariant(kern, threads, d, g, window):
    """With a window a query's bits depend on its window alone: the same with older entries
    dropped from the list (pos0 moved on), in chunks of 1, 7 or 64 queries (blocks spread
    over the threads, or queries) or all at once, with the other thread count; and a window
    that reaches past the list's start gives window 0's bits."""
    gen = torch.Generator().manual_seed(d + g + window)
    n_kv, n_cells, length, n, pos0 = 1, 1300, 1200, 200, 37
    pk = torch.randn(n_kv, n_cells, d, generator=gen).to(BF)
    pv = torch.randn(n_kv, n_cells, d, generator=gen).to(BF)
    q = (torch.randn(n, n_kv * g, d, generator=gen) * 2).to(BF)
    cells = torch.randperm(n_cells, generator=gen)[:length]
    full = kern.attend_causal(q, pk, pv, cells, window=window, pos0=pos0)
    torch.set_num_threads(3 - threads)
    try:
        # older entries dropped: every query's window still inside the list
        for keep in (window + n - 1, window + n + 4, window + n + 300):
            got = kern.attend_causal(q, pk, pv, cells[length - keep :], window=window,
                                     pos0=pos0 + length - keep)
            assert torch.equal(got, full), keep
        # the last 6 queries over only the last window + 5 entries
        got = kern.attend_causal(q[n - 6 :].contiguous(), pk, pv, cells[-window - 5 :],
                                 window=window, pos0=pos0 + length - window - 5)
        assert torch.equal(got, full[n - 6 :])
        # chunks, each over its own list: from the sequence's start, or from its first window
        for chunk in (1, 7, 64):
            parts = []
            for lo in range(0, n, chunk):
                hi = min(n, lo + chunk)
                end = length - n + hi  # the list ends with this chunk's last query
                start = 0 if lo % 2 else max(0, end - (hi - lo) - window + 1)
                parts.append(kern.attend_causal(q[lo:hi].contiguous(), pk, pv,
                                                cells[start:end], window=window,
                                                pos0=pos0 + start))
            assert torch.equal(torch.cat(parts), full), chunk
    finally:
        torch.set_num_threads(threads)
    # a window wider than the list is plain causal attention, bit for bit
    wide = kern.attend_causal(q, pk, pv, cells[:300], window=10**6)
    assert torch.equal(wide, kern.attend_causal(q, pk, pv, cells[:300]))
    assert torch.equal(wide, kern.attend_causal(q, pk, pv, cells[:300], window=0, pos0=0))


def test_windowed_attend_causal_refuses_negative_window_or_position(kern):
    pk = torch.zeros(1, 32, 64, dtype=BF)
    q = torch.zeros(1, 4, 64, dtype=BF)
    with pytest.raises(ValueError):
        kern.attend_causal(q, pk, pk, slice(0, 4), window=-1)
    with pytest.raises(ValueError):
        kern.attend_causal(q, pk, pk, slice(0, 4), pos0=-3)


HP = HParams(arch="llama", n_layer=2, n_embd=64, n_ff=64, n_head=9, n_head_kv=3, head_dim=64,
             n_vocab=100, n_ctx_train=4096, rms_eps=1e-5, rope_base=10000.0, rope_neox=True,
             rope_scale_linear=1.0, name="t")


class Stream:
    """A sequence fed to steps: its fused qkv rows, one per position, and its cells (a run or
    an index) in a pool; `done` tokens already stored."""

    def __init__(self, qkv: torch.Tensor, cells: slice | torch.Tensor) -> None:
        self.qkv, self.cells, self.done = qkv, cells, 0
        self.out = torch.zeros(qkv.shape[0], HP.n_head * HP.head_dim, dtype=BF)

    def cell_list(self, upto: int) -> slice | torch.Tensor:
        if isinstance(self.cells, slice):
            return slice(self.cells.start, self.cells.start + upto)
        return self.cells[:upto]

    def cell_ids(self, lo: int, hi: int) -> list[int]:
        if isinstance(self.cells, slice):
            return list(range(self.cells.start + lo, self.cells.start + hi))
        return self.cells[lo:hi].tolist()


def run_step(kern: K.Kernels, pk: torch.Tensor, pv: torch.Tensor, layer: int,
             parts: list[tuple[Stream, int]]) -> None:
    """One fused step: each stream in `parts` advances by its count of new tokens."""
    rope = Rope(HP)
    cells, dst, pos, rows, n_new = [], [], [], [], []
    for s, n in parts:
        cells.append(s.cell_list(s.done + n))
        dst += s.cell_ids(s.done, s.done + n)
        pos += range(s.done, s.done + n)
        rows.append(s.qkv[s.done : s.done + n])
        n_new.append(n)
    cos, sin = rope.cos_sin(torch.tensor(pos))
    x = torch.zeros(len(dst), HP.n_embd)
    step = plain_step(kern, pk, pv, HP.n_head, cells, dst, cos, sin, x, 1e-5, HP.n_ff, n_new)
    out = step.attend(layer, torch.cat(rows))
    at = 0
    for s, n in parts:
        s.out[s.done : s.done + n] = out[at : at + n]
        s.done, at = s.done + n, at + n


def pool(n_cells: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (HP.n_layer, HP.n_head_kv, n_cells, HP.head_dim)
    return torch.zeros(shape, dtype=BF), torch.zeros(shape, dtype=BF)


def one_at_a_time(kern: K.Kernels, qkv: torch.Tensor, cells: slice | torch.Tensor,
                  n_cells: int, layer: int) -> tuple[Stream, torch.Tensor, torch.Tensor]:
    """The reference: every token a decode step of its own (n_new = 1) over its prefix."""
    pk, pv = pool(n_cells)
    s = Stream(qkv, cells)
    while s.done < qkv.shape[0]:
        run_step(kern, pk, pv, layer, [(s, 1)])
    return s, pk, pv


def qkv_rows(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    row = (HP.n_head + 2 * HP.n_head_kv) * HP.head_dim
    return (torch.randn(n, row, generator=gen) * 2).to(BF)


@pytest.mark.parametrize("chunk", [1, 2, 7, 64, 300])
def test_step_chunks_equal_single_tokens_bitwise(kern, threads, chunk):
    """Deterministic mode's core: a token's attention output, and the K/V the step stores for
    it, are the same bits whether it came in a prefill chunk of any size or as a decode step
    of its own, with the other thread count, and with its cells a run instead of an index."""
    n_cells, length = 1024, 700  # 700 keys: blocks of 256 end inside the chunks
    qkv = qkv_rows(length, 11)
    cells = torch.randperm(n_cells, generator=torch.Generator().manual_seed(5))[:length]
    torch.set_num_threads(3 - threads)
    try:
        ref, rk, rv = one_at_a_time(kern, qkv, cells, n_cells, 1)
    finally:
        torch.set_num_threads(threads)
    for as_run in (False, True):
        pk, pv = pool(n_cells)
        s = Stream(qkv, slice(200, 200 + length) if as_run else cells)
        while s.done < length:
            run_step(kern, pk, pv, 1, [(s, min(chunk, length - s.done))])
        assert torch.equal(s.out, ref.out), (chunk, as_run)
        mine = s.cell_list(length)
        assert torch.equal(pk[:, :, mine], rk[:, :, cells]) and torch.equal(pv[:, :, mine],
                                                                            rv[:, :, cells])
        assert not pk[0].any()  # layer 0 untouched


def test_mixed_steps_are_batch_invariant(kern, threads):
    """Decode tokens and prefill chunks of several sequences in one step, in varying order and
    company (and sharing a prefix), give each token the bits it gets alone."""
    n_cells = 2048
    lens = (600, 330, 40)
    qkv = [qkv_rows(n, 20 + i) for i, n in enumerate(lens)]
    perm = torch.randperm(1000, generator=torch.Generator().manual_seed(9))  # cells < 1000
    cells: list[slice | torch.Tensor] = [perm[:600].clone(), slice(1000, 1330), perm[600:640]]
    refs = [one_at_a_time(kern, q, c, n_cells, 0)[0].out for q, c in zip(qkv, cells)]
    pk, pv = pool(n_cells)
    a, b, c = (Stream(q, cl) for q, cl in zip(qkv, cells))
    schedule = [[(a, 300), (b, 1), (c, 7)], [(c, 1), (b, 300), (a, 1)], [(a, 1)],
                [(b, 1), (a, 257), (c, 30)], [(c, 1), (a, 1), (b, 28)],
                [(a, 40), (c, 1)]]
    for parts in schedule:
        run_step(kern, pk, pv, 0, parts)
    for s, ref in zip((a, b, c), refs):
        assert s.done == s.qkv.shape[0] and torch.equal(s.out, ref)
    # attend_causal (the q/k-norm path) over the stored K/V agrees with the fused step
    rope = Rope(HP)
    q = qkv[0][:, : HP.n_head * HP.head_dim].view(-1, HP.n_head, HP.head_dim)
    q = rope.apply(q, *rope.cos_sin(torch.arange(600))).contiguous()
    for lo, hi in ((0, 600), (599, 600), (100, 357)):
        got = kern.attend_causal(q[lo:hi].contiguous(), pk[0], pv[0], cells[0][:hi])
        assert torch.equal(got, refs[0][lo:hi]), (lo, hi)
    assert torch.equal(kern.attend(q[599:].contiguous(), pk[0], pv[0], cells[0]), refs[0][599:])


def test_add_rms_norm_and_silu_match_torch(kern, threads):
    gen = torch.Generator().manual_seed(3)
    for rows in (1, 5, 40):  # 40: rows split over the threads
        x = torch.randn(rows, 576, generator=gen) * 3
        y = torch.randn(rows, 576, generator=gen).to(BF)
        w = torch.rand(576, generator=gen) + 0.5
        x2 = x.clone()
        got = kern.add_rms_norm(x, y, w, 1e-5)
        x2.add_(y)
        assert torch.equal(x, x2)  # the residual add is torch's, bit for bit
        ref = F.rms_norm(x2, (576,), w, 1e-5)
        assert ((got.float() - ref).abs() <= 2**-8 * ref.abs() + 1e-6).all()
        got0 = kern.add_rms_norm(x, None, w, 1e-5)
        assert torch.equal(x, x2) and torch.equal(got0, got)
        gu = (torch.randn(rows, 2 * 1536, generator=gen) * 4).to(BF)
        ref = (F.silu(gu[:, :1536]) * gu[:, 1536:]).float()
        diff = (kern.silu_mul(gu).float() - ref).abs()
        assert (diff <= 2**-7 * ref.abs() + 1e-30).all()  # at most the last bit of bf16


def test_clamped_swiglu_matches_the_torch_path(kern, threads):
    """gpt-oss's clamped SwiGLU in C within the last bit of bf16 of moe.py's f32 swiglu_oai
    (gates and ups beyond the clamp of 7 included), a NaN kept, and each row's bits the same
    computed alone."""
    from radixserve.model.moe import swiglu_oai

    gen = torch.Generator().manual_seed(4)
    gu = (torch.randn(40, 2 * 2880, generator=gen) * 6).to(BF)
    gu[3, 7] = float("nan")
    got = kern.swiglu_oai(gu)
    ref = swiglu_oai(gu)
    ok = ((got.float() - ref).abs() <= 2**-7 * ref.abs() + 1e-30) | (got.isnan() & ref.isnan())
    assert ok.all() and got[3, 7].isnan() and (gu[:, :2880].float() > 7).any()
    alone = torch.cat([kern.swiglu_oai(gu[i:i + 1]) for i in range(40)])
    assert torch.equal(alone.view(torch.int16), got.view(torch.int16))  # bits, the NaN's too


def test_kernels_refuse_what_they_cannot_read(kern):
    """They take raw pointers, so a wrong dtype, layout, shape or cell is an error, not a read."""
    pk = torch.zeros(3, 32, 64, dtype=BF)
    q = torch.zeros(1, 9, 64, dtype=BF)
    with pytest.raises(ValueError):
        kern.attend(q.float(), pk, pk, slice(0, 4))
    with pytest.raises(ValueError):
        kern.attend(q, pk.float(), pk.float(), slice(0, 4))
    with pytest.raises(ValueError):
        kern.attend(q, pk[:, ::2], pk[:, ::2], slice(0, 4))  # not the pool's layout
    with pytest.raises(IndexError):
        kern.attend(q, pk, pk, slice(30, 40))
    with pytest.raises(ValueError):
        kern.attend(q, pk, pk, torch.tensor([1, 2], dtype=torch.int32))
    pool = torch.zeros(2, 3, 32, 64, dtype=BF)
    cos = sin = torch.zeros(1, 1, 64)
    x, w = torch.zeros(1, 576), torch.ones(576)
    with pytest.raises(ValueError):  # cell outside
        plain_step(kern, pool, pool, 9, [slice(0, 4)], [32], cos, sin, x, 1e-5, 64)
    with pytest.raises(ValueError):  # residual rows not f32
        plain_step(kern, pool, pool, 9, [slice(0, 4)], [3], cos, sin, x.to(BF), 1e-5, 64)
    with pytest.raises(ValueError):  # new-token counts that do not add up to the rows
        plain_step(kern, pool, pool, 9, [slice(0, 4)], [3], cos, sin, x, 1e-5, 64, [2])
    with pytest.raises(ValueError):  # more new tokens than cells
        plain_step(kern, pool, pool, 9, [slice(0, 1)], [0, 1], cos.repeat(2, 1, 1),
                         sin.repeat(2, 1, 1), x.repeat(2, 1), 1e-5, 64, [2])
    with pytest.raises(ValueError):
        kern.attend_causal(torch.zeros(5, 9, 64, dtype=BF), pk, pk, slice(0, 4))
    with pytest.raises(ValueError):  # head_dim not the pool's
        kern.attend_causal(torch.zeros(1, 9, 32, dtype=BF), pk, pk, slice(0, 4))
    step = plain_step(kern, pool, pool, 9, [slice(0, 4)], [3], cos, sin, x, 1e-5, 64)
    with pytest.raises(ValueError):
        step.attend(2, torch.zeros(1, 15 * 64, dtype=BF))  # no layer 2
    with pytest.raises(ValueError):
        step.attend(0, torch.zeros(1, 14 * 64, dtype=BF))
    with pytest.raises(ValueError):  # a norm weight that is not f32 and n_embd long
        step.norm(x, None, torch.ones(576, dtype=BF))
    with pytest.raises(ValueError):
        step.norm(x, None, torch.ones(575))
    with pytest.raises(ValueError):  # another residual stream
        step.norm(x.clone(), None, w)
    with pytest.raises(ValueError):
        step.norm(x, torch.zeros(1, 575, dtype=BF), w)
    with pytest.raises(ValueError):
        step.silu(torch.zeros(1, 127, dtype=BF))
    with pytest.raises(ValueError):
        kern.add_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8, dtype=BF), torch.ones(8), 1e-5)
    with pytest.raises(ValueError):
        kern.silu_mul(torch.zeros(2, 7, dtype=BF))
    if not HAS[kern.variant][0]:  # no AVX512-BF16 in this build: no bf16 panels
        with pytest.raises(ValueError, match="bf16 kernel needs"):
            kern.bf16(torch.zeros(1, 16, 32, 2, dtype=BF), 32, 32)
    # the tiles (csrc/i8act.c) are in every build
    tiles = torch.zeros(2, 3, 320, dtype=torch.uint8)  # a 32 x 96 matrix of 4-bit tiles
    mat = kern.tiles(tiles, 0, 32, 96)
    # the matrix multiplies good rows: what is refused below is refused for what it is
    assert mat.matmul(torch.ones(2, 96, dtype=BF)).shape == (2, 32)
    with pytest.raises(ValueError, match="tile matmul needs"):
        mat.matmul(torch.zeros(1, 96))  # f32 rows
    with pytest.raises(ValueError, match="tile matmul needs"):
        mat.matmul(torch.zeros(1, 64, dtype=BF))  # k does not match the tiles
    with pytest.raises(ValueError, match="tile matmul needs"):
        mat.matmul(torch.zeros(4, 192, dtype=BF)[:, ::2])  # not contiguous
    with pytest.raises(ValueError, match="tile matmul needs"):
        mat.matmul(torch.zeros(96, dtype=BF))  # not rows
    assert K.TILE_BLOCK_BYTES == {0: 320, 1: 576, 2: 640, 3: 640, 4: 320}  # i8act.c's BLOCK(f)
    for fmt, size in K.TILE_BLOCK_BYTES.items():  # each format's block size is taken
        assert kern.tiles(torch.zeros(2, 3, size, dtype=torch.uint8), fmt, 32, 96).fmt == fmt
    refused = [
        (tiles[:, :2], 0, 32, 96),  # tiles not of that shape
        (tiles.to(torch.int16), 0, 32, 96),  # not bytes
        (torch.zeros(2, 3, 640, dtype=torch.uint8)[..., :320], 0, 32, 96),  # not contiguous
        (tiles, 1, 32, 96),  # the 4-bit block size given as an 8-bit format's (576)
        (torch.zeros(2, 3, 576, dtype=torch.uint8), 2, 32, 96),  # 576 given as 640
        (torch.zeros(2, 3, 640, dtype=torch.uint8), 1, 32, 96),  # 640 given as 576
        (tiles, 5, 32, 96),  # no such format
        (tiles, -1, 32, 96),
        (tiles[:1].contiguous(), 0, 24, 96),  # rows not a multiple of 16
        (torch.zeros(2, 3, 320, dtype=torch.uint8), 0, 32, 80),  # k not a multiple of 32
    ]
    for args in refused:
        with pytest.raises(ValueError, match="tile kernels need"):
            kern.tiles(*args)


def test_q4_linear_rows_are_independent_of_the_batch(kern, threads):
    """Through Q4Linear (quant.py's packing of 4-bit codes, f16 scales and offsets): each row's
    product is the same bits alone or among others (1..9 rows: with and without the few-row
    prefetch), on 1 and 2 threads, and within 8-bit activations' error of an f64 product with
    the layer's own weights (csrc/i8act.c's arithmetic itself: tests/model/test_i8act.py)."""
    from radixserve.model.quant import Codes, Q4Linear

    g = torch.Generator().manual_seed(0)
    n, k = 48, 160
    codes = Codes(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8).numpy(),
                  (torch.rand(n, k // 32, generator=g) * 0.01).half().float().numpy(),
                  (torch.randn(n, k // 32, generator=g) * 0.05).half().float().numpy())
    lin = Q4Linear(codes, None, kern)
    assert lin.route == "q4-tiles" and lin.dense_from is None and lin.row_invariant
    w = torch.from_numpy(codes.dequantize()).double()  # exact: the scales are f16 already
    x = torch.randn(9, k, generator=g).to(BF)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(9)])
    for rows in range(1, 10):
        y = lin(x[:rows])
        assert torch.equal(y.view(torch.int16), alone[:rows].view(torch.int16)), rows
    ref, tol = act8_tolerance(x, w)
    assert ((alone.double() - ref).abs() <= tol).all()
    wrong, _ = act8_tolerance(x, permuted_lanes(w))  # the tolerance tells a lane slip apart
    assert ((alone.double() - wrong).abs() > tol).any()


def settled(**env: str) -> KernelConfig:
    """The configuration a start-up settles from this process's environment with `env` set."""
    return KernelConfig.from_env({**os.environ, **env})


def build_as(cfg: KernelConfig) -> Path | None:
    """The best variant's build with the compiler and cache directory `cfg` settled."""
    return B.build(None, cfg.cc, cfg.cache_dir)


def test_build_is_cached_and_degrades_without_a_compiler(tmp_path):
    """XDG_CACHE_HOME and CC, as settled at start-up, name the cache and the compiler."""
    cfg = settled(XDG_CACHE_HOME=str(tmp_path))
    first = build_as(cfg)
    assert first is not None and first.parent == tmp_path / "radixserve" / "kernels"
    stamp = first.stat().st_mtime_ns
    assert build_as(cfg) == first and first.stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporaries left
    other = str(tmp_path / "other")
    assert build_as(settled(XDG_CACHE_HOME=other, CC=str(tmp_path / "no-such-compiler"))) is None
    fake = tmp_path / "fake-cc"  # answers --version, then writes half an output and fails
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && echo fake 1.0 && exit 0\n'
                    'while [ "$1" != -o ]; do shift; done; echo partial > "$2"; exit 1\n')
    fake.chmod(0o755)
    assert build_as(settled(XDG_CACHE_HOME=other, CC=str(fake))) is None
    out = tmp_path / "other" / "radixserve" / "kernels"
    assert not out.exists() or not list(out.iterdir())


def test_kernels_can_be_switched_off_or_forced(monkeypatch):
    """RADIXSERVE_KERNELS, settled at start-up: 0 is off; unset, auto and 1 the best this CPU
    runs (every variant here, so avx512bf16); a variant's name gives that variant's kernels
    (forced: a failed build is an error), the very object load_kernels caches."""
    off = settled(RADIXSERVE_KERNELS="0")
    assert off.load() is None and K.variant_name(off.load()) == "none"
    for value in ("auto", "1", " AUTO ", ""):
        cfg = settled(RADIXSERVE_KERNELS=value)
        assert cfg.load() is K.load_kernels("avx512bf16", cfg.cc, cfg.cache_dir, cfg.checks), value
        assert not cfg.forced and cfg.load() is variant_kernels("avx512bf16"), value
    for variant in VARIANTS:
        cfg = settled(RADIXSERVE_KERNELS=variant)
        assert cfg.load() is variant_kernels(variant) and cfg.forced
        assert K.variant_name(cfg.load()) == variant
    monkeypatch.delenv("RADIXSERVE_KERNELS", raising=False)
    kern = KernelConfig.from_env().load()  # this process's environment, the variable unset
    assert kern is not None and kern.variant == "avx512bf16"
    assert os.environ.get("RADIXSERVE_KERNELS") is None
    assert isinstance(kern.lib, ctypes.CDLL)  # for callers binding entry points of their own


# /proc/cpuinfo of a CPU with AVX-512 (F, BW, DQ, VL, CD) and VNNI but no BF16 (Ice Lake), two
# cores listing the same flags; and the flags of a Haswell (AVX2, no AVX-512)
HASWELL = ("fpu sse sse2 pni ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt xsave avx f16c lahf_lm "
           "abm bmi1 avx2 bmi2")
ICELAKE = HASWELL + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512vbmi"
ICELAKE_INFO = "".join(f"processor\t: {i}\nmodel name\t: Xeon\nflags\t\t: {ICELAKE}\n\n"
                       for i in range(2))


def test_auto_takes_the_best_variant_the_cpu_runs():
    assert B.supported_variants() == VARIANTS  # this machine runs them all
    assert B.select_variant("auto") == B.select_variant("1") == "avx512bf16"
    assert B.select_variant("0") is None
    for variant in VARIANTS:
        assert B.select_variant(variant) == variant
    flags = ICELAKE_INFO
    assert B.cpu_flags(flags) >= {"avx512f", "avx512_vnni"} and "avx512_bf16" not in \
        B.cpu_flags(flags)
    assert B.select_variant("auto", flags, "x86_64") == "avx512"
    assert B.select_variant("auto", f"flags : {HASWELL}", "x86_64") == "avx2"
    # AVX-VNNI without AVX-512 (Alder Lake on)
    assert B.select_variant("auto", f"flags : {HASWELL} avx_vnni", "x86_64") == "avxvnni"
    # LZCNT listed under its own name rather than "abm"
    assert B.select_variant("auto", f"flags : {HASWELL.replace('abm', 'lzcnt')}",
                            "x86_64") == "avx2"
    assert B.select_variant("auto", f"flags : {HASWELL.replace('bmi2', '')}",
                            "x86_64") == "generic"
    assert B.select_variant("auto", "", "x86_64") == "generic"
    # a core that lacks a flag the others list: the CPU lacks it
    mixed = ICELAKE_INFO + f"processor\t: 2\nflags\t\t: {HASWELL}\n"
    assert B.select_variant("auto", mixed, "x86_64") == "avx2"
    # aarch64: neon where the CPU has the dot-product instructions, else generic (no -march)
    assert B.select_variant("auto", "Features : fp asimd", "aarch64") == "generic"
    assert B.supported_variants("Features : fp asimd", "aarch64") == ["generic"]
    assert B.supported_variants("Features : fp asimd asimddp", "arm64") == ["neon", "generic"]
    # other machines: the generic build, with no -march
    assert B.supported_variants("", "riscv64") == ["generic"]
    assert not any(f.startswith("-m") for f in B.compile_flags("rowwise.c", "generic",
                                                               "aarch64"))


def test_a_variant_the_cpu_cannot_run_or_an_unknown_value_is_an_error(monkeypatch):
    with pytest.raises(B.KernelsError) as e:
        B.select_variant("avx512bf16", ICELAKE_INFO, "x86_64")
    msg = str(e.value)
    assert "RADIXSERVE_KERNELS=avx512bf16" in msg and "lacks avx512_bf16" in msg
    assert "avx512_vnni" not in msg.split("lacks")[1].split(";")[0]  # only what is missing
    assert "auto, avx512bf16, avx512, avxvnni, avx2, generic, 0" in msg
    with pytest.raises(B.KernelsError, match=r"lacks avx512f avx512bw avx512dq avx512vl "
                                             r"avx512cd avx512_vnni;.* runs avx2, generic"):
        B.select_variant("avx512", f"flags : {HASWELL}", "x86_64")
    with pytest.raises(B.KernelsError, match="lacks .*avx2"):
        B.select_variant("avx2", "flags : fpu sse sse2", "x86_64")
    with pytest.raises(B.KernelsError, match="x86-64 build and this machine is aarch64.*"
                                             "allowed values: auto, neon, generic, 0"):
        B.select_variant("avx2", "Features : fp asimd", "aarch64")
    assert B.select_variant("generic", "Features : fp asimd", "aarch64") == "generic"
    for bogus in ("bogus", "avx512-bf16", "2", "native"):
        with pytest.raises(B.KernelsError, match=f"RADIXSERVE_KERNELS='{bogus}' is not a "
                                                 r"kernel variant; allowed values: auto, "):
            B.select_variant(bogus)
    # from the environment, as a start-up settles it: the error, never a silent fallback
    with pytest.raises(B.KernelsError, match="bogus"):
        settled(RADIXSERVE_KERNELS="bogus")
    # a CPU without a flag the forced variant needs (its /proc/cpuinfo faked)
    real = B.cpu_flags
    monkeypatch.setattr(B, "cpu_flags", lambda text=None: real(text or ICELAKE_INFO))
    with pytest.raises(B.KernelsError, match="lacks avx512_bf16"):
        settled(RADIXSERVE_KERNELS="avx512bf16")
    cfg = settled(RADIXSERVE_KERNELS="auto")
    with pytest.raises(B.KernelsError, match="lacks avx512_bf16"):
        K.load_kernels.__wrapped__("avx512bf16", cfg.cc, cfg.cache_dir)
    assert cfg.load() is K.load_kernels("avx512", cfg.cc, cfg.cache_dir, cfg.checks)


def test_each_variant_builds_with_its_own_flags_into_its_own_file(tmp_path, monkeypatch):
    """Sources of our own in place of csrc/: each variant's objects get its -march (and only
    its), cached in a file of its own named by the variant; a source in _STRICT_FP is compiled
    without reassociation (its sums as written), the others with it; and the sources are
    linked into one shared object."""
    src = tmp_path / "csrc"
    src.mkdir()
    probe = """#include "common.h"
        int {name}_assoc(void) {{
        #ifdef __ASSOCIATIVE_MATH__
            return 1;
        #else
            return 0;
        #endif
        }}
        int {name}_avx2(void) {{
        #ifdef __AVX2__
            return 1;
        #else
            return 0;
        #endif
        }}
        int {name}_bf16(void) {{
        #ifdef __AVX512BF16__
            return 1;
        #else
            return 0;
        #endif
        }}
        float {name}_sum(float a, float b) {{ return (a + b) - b; }}
        """
    (src / "common.h").write_text("#include <stdint.h>\n")
    for name in ("loose", "strict"):
        (src / f"{name}.c").write_text(probe.format(name=name))
    monkeypatch.setattr(B, "_CSRC", src)
    monkeypatch.setattr(B, "_STRICT_FP", frozenset({"strict.c"}))
    cfg = settled(XDG_CACHE_HOME=str(tmp_path / "cache"))
    paths = {}
    for variant, avx2, bf16 in (("avx512bf16", 1, 1), ("avx2", 1, 0), ("generic", 0, 0)):
        path = B.build(variant, cfg.cc, cfg.cache_dir)
        assert path is not None and path.name.startswith(f"radixserve-kernels-{variant}-")
        lib = ctypes.CDLL(str(path))
        lib.strict_sum.restype = lib.loose_sum.restype = ctypes.c_float
        lib.strict_sum.argtypes = lib.loose_sum.argtypes = [ctypes.c_float, ctypes.c_float]
        assert (lib.loose_assoc(), lib.strict_assoc()) == (1, 0), variant
        assert lib.strict_sum(1.0, 1e20) == 0.0  # (1 + 1e20) - 1e20, rounded as written
        assert lib.loose_sum(1.0, 1e20) == 1.0  # reassociated: a + (b - b)
        for name in ("loose", "strict"):
            assert getattr(lib, f"{name}_avx2")() == avx2 and getattr(lib, f"{name}_bf16")() \
                == bf16, (variant, name)
        paths[variant] = path
    assert len(set(paths.values())) == 3
    assert sorted(p.name for p in paths["generic"].parent.iterdir()) == sorted(
        p.name for p in paths.values())  # no objects or temporaries left
    stamp = paths["avx2"].stat().st_mtime_ns
    assert B.build("avx2", cfg.cc, cfg.cache_dir) == paths["avx2"]
    assert paths["avx2"].stat().st_mtime_ns == stamp
    # a source that does not compile: no build, nothing left behind
    (src / "broken.c").write_text("int broken(void) { return }\n")
    cfg = settled(XDG_CACHE_HOME=str(tmp_path / "cache2"))
    assert B.build("generic", cfg.cc, cfg.cache_dir) is None
    assert not list((tmp_path / "cache2" / "radixserve" / "kernels").iterdir())


def test_strict_sources_drop_only_the_reassociation_flags():
    """csrc/qmm.c (when present) sums exactly as written: its flags are the others' without
    -fassociative-math, -fno-signed-zeros and -fno-trapping-math, the same -O3, OpenMP, PIC
    and -march. rowwise.c alone adds -fno-tree-pre (its gates' division, kernel_build.py says
    why)."""
    assert "qmm.c" in B._STRICT_FP
    loose = ("-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")
    for variant in VARIANTS:
        common = B.compile_flags("decode_attn.c", variant, "x86_64")
        rowwise = B.compile_flags("rowwise.c", variant, "x86_64")
        assert [f for f in rowwise if f != "-fno-tree-pre"] == common != rowwise
        strict = B.compile_flags("qmm.c", variant, "x86_64")
        assert all(f in common for f in loose) and not any(f in strict for f in loose)
        assert strict == [f for f in common if f not in loose]
        assert {"-O3", "-fopenmp", "-fPIC"} <= set(strict) and "-march=native" not in common
        assert [f for f in common if f.startswith("-m")] == list(B.VARIANTS[variant].flags("x86_64"))


def test_int8_head_equals_its_integer_dots_or_is_refused(kern):
    """The head's VNNI pass (avx512bf16 and avx512 builds): each logit the int32 dot products of
    the int8 rows and the hidden state's two int8 parts, scaled in f32; other builds refuse it
    (head.py then keeps torch's int8 kernel)."""
    from radixserve.model.head import split_int8

    g = torch.Generator().manual_seed(4)
    v, d, n = 300, 128, 3
    q8 = torch.randint(-128, 128, (v, d), generator=g, dtype=torch.int8)
    rowsum = q8.sum(1, dtype=torch.int32)
    scale = torch.rand(v, generator=g) * 0.01
    a, s, _, _ = split_int8(torch.randn(n, d, generator=g))
    if not kern.has_int8_head:
        with pytest.raises(ValueError):
            kern.int8_head(q8, rowsum, scale, a, s)
        return
    y = kern.int8_head(q8, rowsum, scale, a, s)
    dots = (a.long() - 128) @ q8.long().T  # exact, [2n, v]
    parts = dots.double() * s.double()[:, None]
    ref = (parts[0::2] + parts[1::2]) * scale.double()
    mag = (parts[0::2].abs() + parts[1::2].abs()) * scale.double()
    assert y.shape == (n, v) and ((y.double() - ref).abs() <= mag * 2.0**-22 + 1e-30).all()


def test_head_dots_are_exact_dots_and_refuse_ids_outside_the_head(kern):
    g = torch.Generator().manual_seed(3)
    w, h = torch.randn(300, 64, generator=g), torch.randn(3, 64, generator=g)
    full = kern.head_dots(w, h)
    assert torch.allclose(full, (h.double() @ w.double().T).float(), rtol=1e-5, atol=1e-5)
    ids = torch.tensor([299, 0, 17])
    assert torch.equal(kern.head_dots(w, h, ids), full[:, ids])
    for bad in ([300], [-1], [5, 1000]):
        with pytest.raises(IndexError):
            kern.head_dots(w, h, torch.tensor(bad))
    with pytest.raises(ValueError):
        kern.head_dots(w, h.double())


def test_check_mode_refuses_a_cell_index_outside_the_pool(kern, monkeypatch):
    """decode_attn.c reads K/V at kh + cells[j] d unchecked; in check mode (the suite's) an
    index outside the pool is an IndexError before the call, and without it the call is made
    (so the check, not something else, is what refuses)."""
    from radixserve.model.kernel_config import CHECKS_ENV

    assert os.environ[CHECKS_ENV] == "1" and kern.checks  # the suite's, settled as a start-up
    q = torch.randn(1, 4, 64).to(torch.bfloat16)
    pk = torch.randn(2, 16, 64).to(torch.bfloat16)
    good = torch.tensor([0, 5, 15])
    kern.attend_causal(q, pk, pk, good)
    for bad in ([0, 5, 16], [-1, 3]):
        with pytest.raises(IndexError, match="outside a pool of 16"):
            kern.attend_causal(q, pk, pk, torch.tensor(bad))
    monkeypatch.setattr(kern, "checks", False)  # as RADIXSERVE_KERNEL_CHECKS=0 settles it
    calls = []
    monkeypatch.setattr(kern, "_attn", lambda *a: calls.append(a) or 0)
    kern.attend_causal(q, pk, pk, torch.tensor([0, 5, 16]))
    assert len(calls) == 1
