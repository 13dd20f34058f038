"""The samplers of llama.cpp's chain, one function each, as src/llama-sampler.cpp computes
them on its candidate array (`Candidates`: ids, logits, probs, a `sorted` flag, in its order),
in float32 like the C code; and std::mt19937 with libstdc++'s distributions (`MT19937`), so a
seeded draw equals llama.cpp's. chain.py strings them into the chain."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

_F32 = np.float32
_NEG_INF = _F32(-np.inf)


# ---------------------------------------------------------------- std::mt19937


class MT19937:
    """std::mt19937 with libstdc++'s uniform_real_distribution<double|float>(0, 1) and
    discrete_distribution, so seeded draws equal llama.cpp's."""

    __slots__ = ("mt", "i")

    def __init__(self, seed: int) -> None:
        mt = [0] * 624
        mt[0] = seed & 0xFFFFFFFF
        for i in range(1, 624):
            mt[i] = (1812433253 * (mt[i - 1] ^ (mt[i - 1] >> 30)) + i) & 0xFFFFFFFF
        self.mt, self.i = mt, 624

    def copy(self) -> MT19937:
        c = MT19937.__new__(MT19937)
        c.mt, c.i = list(self.mt), self.i
        return c

    def _twist(self) -> None:
        mt = self.mt
        for k in range(624):
            y = (mt[k] & 0x80000000) | (mt[(k + 1) % 624] & 0x7FFFFFFF)
            mt[k] = mt[(k + 397) % 624] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
        self.i = 0

    def u32(self) -> int:
        if self.i >= 624:
            self._twist()
        y = self.mt[self.i]
        self.i += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        return y ^ (y >> 18)

    def uniform(self) -> float:
        """uniform_real_distribution<double>(0, 1): generate_canonical<double, 53>."""
        lo = self.u32()
        r = (lo + self.u32() * 4294967296.0) / 18446744073709551616.0
        return r if r < 1.0 else math.nextafter(1.0, 0.0)

    def uniform_f32(self) -> float:
        """uniform_real_distribution<float>(0, 1): one draw, rounded to float."""
        r = float(_F32(self.u32()) / _F32(4294967296.0))
        return r if r < 1.0 else float(np.nextafter(_F32(1.0), _F32(0.0)))

    def discrete(self, p: np.ndarray) -> int:
        """std::discrete_distribution<int>(p)(rng)."""
        if p.size < 2:
            return 0
        w = p.astype(np.float64)
        cp = np.cumsum(w / w.sum())
        u = self.uniform()
        return int(np.searchsorted(cp[:-1], u, side="left"))


# ---------------------------------------------------------------- candidates and samplers

_ARANGE: dict[int, np.ndarray] = {}


class Candidates:
    """llama_token_data_array: candidates in order, their logits and probs, `sorted` flag."""

    __slots__ = ("ids", "logit", "p", "sorted", "selected", "identity")

    def __init__(self, logits: np.ndarray) -> None:
        n = logits.size
        ids = _ARANGE.get(n)
        if ids is None:
            ids = _ARANGE[n] = np.arange(n, dtype=np.int64)
        self.ids, self.logit = ids, logits
        self.p = np.zeros(n, dtype=_F32)
        self.sorted, self.selected, self.identity = False, -1, True

    @classmethod
    def of(cls, ids: np.ndarray, logits: np.ndarray) -> Candidates:
        """Only the candidates `ids` (token-wise steps need no more than the tokens they
        touch: the fast paths run bias/penalties/DRY on those instead of the whole row)."""
        cur = cls.__new__(cls)
        cur.ids, cur.logit, cur.p = ids, logits, np.zeros(ids.size, dtype=_F32)
        cur.sorted, cur.selected, cur.identity = False, -1, False
        return cur

    @property
    def size(self) -> int:
        return int(self.ids.size)

    def take(self, idx: np.ndarray | slice) -> None:
        self.ids, self.logit, self.p = self.ids[idx], self.logit[idx], self.p[idx]
        self.identity = False

    def positions(self, toks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions in the array, index into toks) of the tokens of `toks` present."""
        if self.identity:
            ok = np.nonzero((toks >= 0) & (toks < self.ids.size))[0]
            return toks[ok], ok
        order = np.argsort(self.ids, kind="stable")
        srt = self.ids[order]
        at = np.searchsorted(srt, toks).clip(max=max(srt.size - 1, 0))
        ok = np.nonzero(srt[at] == toks)[0] if srt.size else np.zeros(0, dtype=np.int64)
        return order[at[ok]], ok


def seq_sum(x: np.ndarray) -> Any:
    """Left-to-right float32 sum, as the C loops accumulate."""
    return np.cumsum(x, dtype=x.dtype)[-1] if x.size else x.dtype.type(0)


def sort(cur: Candidates, k: int | None = None) -> None:
    """partial_sort_inplace: the best k (all) by logit, descending; sorted."""
    n = cur.size
    k = n if k is None else min(k, n)
    idx: np.ndarray
    if n > 1024 and k < n // 4:
        idx = torch.topk(torch.from_numpy(cur.logit), k).indices.numpy()
    elif n > 1024:
        idx = torch.sort(torch.from_numpy(cur.logit), descending=True).indices.numpy()[:k]
    else:
        idx = np.argsort(-cur.logit, kind="stable")[:k]
    cur.take(idx)
    cur.sorted = True


def softmax(cur: Candidates, do_sort: bool) -> None:
    if do_sort and not cur.sorted:
        sort(cur)
    max_l = cur.logit[0] if cur.sorted else cur.logit.max()
    e = np.exp(cur.logit - max_l)
    cur.p = e / seq_sum(e)


def temp_impl(cur: Candidates, temp: float) -> None:
    if cur.size == 0:
        return
    if temp <= 0.0:
        keep = int(np.argmax(cur.logit))  # the first maximum, as the C loop keeps it
        v = cur.logit[keep]
        cur.logit = np.full(cur.size, _NEG_INF, dtype=_F32)
        cur.logit[keep] = v
        return
    cur.logit = cur.logit / _F32(temp)


def top_k(cur: Candidates, k: int) -> None:
    if k <= 0:
        return
    k = min(k, cur.size)
    if not cur.sorted:
        sort(cur, k)
    else:
        cur.take(slice(0, k))


def top_p(cur: Candidates, p: float, min_keep: int) -> None:
    if p >= 1.0:
        return
    softmax(cur, False)
    k = 256
    while not cur.sorted and cur.size > 4 * k:  # as llama.cpp: the best 256 first, then more
        idx = torch.topk(torch.from_numpy(cur.logit), k).indices.numpy()
        cum = np.cumsum(cur.p[idx], dtype=_F32)
        hit = np.nonzero((cum >= _F32(p)) & (np.arange(1, k + 1) >= min_keep))[0]
        if hit.size:  # the same prefix a full sort gives
            cur.take(idx[: int(hit[0]) + 1])
            cur.sorted = True
            return
        k *= 8
    if not cur.sorted:
        sort(cur)
    cum = np.cumsum(cur.p, dtype=_F32)
    hit = np.nonzero((cum >= _F32(p)) & (np.arange(1, cur.size + 1) >= min_keep))[0]
    if hit.size:
        cur.take(slice(0, int(hit[0]) + 1))


def min_p(cur: Candidates, p: float, min_keep: int) -> None:
    if p <= 0.0 or cur.size == 0:
        return
    with np.errstate(divide="ignore"):
        lp = np.log(_F32(p))
    if not cur.sorted:
        keep = np.nonzero(cur.logit >= cur.logit.max() + lp)[0]
        if keep.size and keep.size >= min_keep:
            if keep.size < cur.size:
                cur.take(keep)
            return
        sort(cur)
    cut = (cur.logit < cur.logit[0] + lp) & (np.arange(cur.size) >= min_keep)
    cut[0] = False
    hit = np.nonzero(cut)[0]
    if hit.size:
        cur.take(slice(0, int(hit[0])))


def top_p_then_min_p(cur: Candidates, top_p: float, min_p: float) -> None:
    """top_p then min_p (min_keep 0) on an unsorted array: both keep a prefix of the sorted
    order, so only min_p's survivors need sorting; top_p's running sum over them is the
    same float32 sum as over the full sorted order."""
    softmax(cur, False)
    with np.errstate(divide="ignore"):
        lp = np.log(_F32(min_p))
    keep = np.nonzero(cur.logit >= cur.logit.max() + lp)[0]
    keep = keep[np.argsort(-cur.logit[keep], kind="stable")]
    cum = np.cumsum(cur.p[keep], dtype=_F32)
    hit = np.nonzero(cum >= _F32(top_p))[0]
    if hit.size:
        keep = keep[: int(hit[0]) + 1]
    cur.take(keep)
    cur.sorted = True


def typical(cur: Candidates, p: float, min_keep: int) -> None:
    if p >= 1.0:
        return
    softmax(cur, True)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = seq_sum(-cur.p * np.log(cur.p))
        shifted = np.abs(-np.log(cur.p) - ent)
    order = np.argsort(shifted, kind="stable")
    cum = np.cumsum(cur.p[order], dtype=_F32)
    i = np.arange(cur.size)
    hit = np.nonzero((cum > _F32(p)) & ((min_keep == 0) | (i >= min_keep - 1)))[0]
    last = int(hit[0]) + 1 if hit.size else cur.size
    cur.take(order[:last])
    cur.sorted = False


def temp_ext(cur: Candidates, temp: float, delta: float, exponent: float) -> None:
    if delta <= 0:
        temp_impl(cur, temp)
        return
    t, d = _F32(temp), _F32(delta)
    min_temp, max_temp = max(_F32(0.0), t - d), t + d
    if cur.size <= 1:
        return
    max_entropy = -np.log(_F32(1.0) / _F32(cur.size))
    softmax(cur, True)
    pos = cur.p[cur.p > 0]
    ent = -seq_sum(pos * np.log(pos))
    dyn = min_temp + (max_temp - min_temp) * np.power(ent / max_entropy, _F32(exponent))
    temp_impl(cur, float(dyn))
    with np.errstate(invalid="ignore"):
        e = np.exp(cur.logit.astype(np.float64) - float(cur.logit[0]))
    cur.p = (e / np.cumsum(e)[-1]).astype(_F32)


def xtc(cur: Candidates, prob: float, threshold: float, min_keep: int, rng: MT19937) -> None:
    if prob <= 0.0 or threshold > 0.5 or cur.size < 2:
        return
    if rng.uniform_f32() > float(_F32(prob)):
        return
    softmax(cur, True)
    below = np.nonzero(cur.p < _F32(threshold))[0]
    run = int(below[0]) if below.size else cur.size  # leading tokens with p >= threshold
    pos_last = max(run - 1, 0)
    if cur.size - pos_last >= min_keep and pos_last > 0:
        cur.take(slice(pos_last, None))
        cur.sorted = True


def top_n_sigma(cur: Candidates, n: float) -> None:
    if n <= 0.0 or cur.size <= 1:
        return
    x = cur.logit
    valid = x[x != _NEG_INF]
    mx = max(x[0], valid.max()) if valid.size else x[0]
    mean = seq_sum(valid) / _F32(valid.size) if valid.size else _F32(0)
    std = np.sqrt(seq_sum(np.square(valid - mean)) / _F32(valid.size)) if valid.size else 0
    cur.logit = np.where(x < mx - _F32(n) * _F32(std), _NEG_INF, x).astype(_F32)


def dist(cur: Candidates, rng: MT19937) -> None:
    if cur.size == 0:
        cur.selected = -1
        return
    cur.selected = 0
    if cur.size == 1:
        rng.uniform()
        cur.p = np.ones(1, dtype=_F32)
        return
    max_l = cur.logit[0] if cur.sorted else cur.logit.max()
    e = np.exp(cur.logit - max_l)
    cums = np.cumsum(e, dtype=np.float64)
    total = cums[-1]
    rnd = rng.uniform()
    i = int(np.searchsorted(cums, total * rnd, side="left"))
    cur.selected = min(i, cur.size - 1)
    cur.p = (e / total).astype(_F32)
