"""The general path of a forward step: attention in torch's ops (and our single-sequence
attention kernel where it runs), for the steps the C steps do not take.

Why a step object: Transformer.hidden's layer loop calls one interface, `attend(layer, qkv)`
plus the glue (`norm`, `post_norm`, `silu`, `gelu`), whichever way a step runs: step.py's
KernelStep (every architecture's glue in C) or this one. This one runs when that cannot: f32 or
no kernels, new tokens inside a sequence's cells (--cache-reuse's holes), or a sliding plan our
kernel does not read. Everything a step shares across layers (plans, masks, the new
cells as index tensors, each kind of layer's cache and RoPE tables) is built once here; each
layer only picks its kind's (chosen at load: Transformer.layer_kinds).

Its arithmetic is the one the C steps reproduce bit for bit (their tests compare against it):
q/k norms as step.head_norm with the kernels, rms_norm in f32 without; RoPE as
Rope.apply; K/V stored in the cache dtype before attention reads them.

Plans (what a sequence's queries read in one kind of layer) live here too: the KernelStep
builder needs the sliding ones to know whether our kernel can run them.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixserve.model import step as kstep

if TYPE_CHECKING:
    from radixserve.model.forward import SeqStep, Transformer
    from radixserve.model.kernels import KVTypes
    from radixserve.model.rope import Rope


@dataclass(slots=True)
class Plan:
    """What one sequence's attention reads in one kind of layer (global or sliding)."""

    cells: slice | torch.Tensor  # in position order; a sliding plan drops keys out of every window
    pos0: int  # position of the first of `cells`
    window: int  # n_swa for sliding layers, 0 for causal-only
    mask: torch.Tensor | None  # [n_group * n, len(cells)] visible keys; None: all of them
    tail: bool = False  # contiguous positions ending with the step's new tokens (our kernel's)


@dataclass(slots=True)
class Sliding:
    """What the sliding layers of one step share: RoPE tables with their base, the cells their
    new K/V go to, and each sequence's plan."""

    cos: torch.Tensor
    sin: torch.Tensor
    cells: list[int]
    plans: list[Plan]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm computed in f32 in HF's op order (the per-head q/k norms), returned as `dtype`
    (default x's)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * w).to(dtype or x.dtype)


def make_plan(cells: slice | torch.Tensor, positions: list[int], pos0: int, n: int,
              device: torch.device, window: int, own_attention: bool, n_group: int) -> Plan:
    """What queries at pos0 .. pos0 + n - 1 read of `cells` (at `positions`, ascending):
    keys at k <= p, and with a window only p - window < k (llama.cpp's
    LLAMA_SWA_TYPE_STANDARD). Keys before every query's window are left out of the cells
    rather than masked: --swa-full keeps them all, and a long context would otherwise cost
    the sliding layers as much as the global ones. `own_attention`: our kernel runs the tail
    plans and masks by position itself (no mask built)."""
    if window:
        first = bisect.bisect_right(positions, pos0 - window)
        if first:
            if isinstance(cells, slice):
                cells = slice((cells.start or 0) + first, cells.stop)
            else:
                cells = cells[first:]
            positions = positions[first:]
    tail = (positions[-1] == pos0 + n - 1 and len(positions) >= n and positions[-n] == pos0
            and positions[-1] - positions[0] == len(positions) - 1)
    if n == 1 and positions[-1] == pos0:
        return Plan(cells, positions[0], window, None, tail)
    if tail and own_attention:  # our kernel masks by position itself
        return Plan(cells, positions[0], window, None, tail)
    kp = torch.tensor(positions, device=device)
    qp = torch.arange(pos0, pos0 + n, device=device)
    mask = kp[None, :] <= qp[:, None]
    if window:
        mask &= qp[:, None] - kp[None, :] < window
    return Plan(cells, positions[0], window, mask.repeat(n_group, 1), tail)


def sliding(tr: Transformer, batch: list[SeqStep], pos: torch.Tensor, split: bool,
            device: torch.device) -> Sliding:
    """The sliding layers' share of a step: RoPE tables with their base, where their new
    K/V go and what each sequence reads (its `.swa` cells in the split layout, else its
    own), through the window."""
    cos, sin = tr.rope_swa.cos_sin(pos)
    n_swa, own, g = tr.hp.n_swa, tr.own_attention, tr.hp.n_group
    if split:
        views = [b.swa for b in batch if b.swa is not None]  # hidden checked: all of them
        cells = [c for v in views for c in v.cells]
        plans = [make_plan(v.kv_cells, v.kv_positions, b.pos0, len(b.tokens), device, n_swa,
                           own, g) for b, v in zip(batch, views)]
    else:
        cells = [c for b in batch for c in b.cells]
        plans = [make_plan(b.kv_cells, b.kv_positions, b.pos0, len(b.tokens), device, n_swa,
                           own, g) for b in batch]
    return Sliding(cos, sin, cells, plans)


class TorchStep:
    """One step through the general path, layer by layer (Transformer.hidden's loop calls
    attend and the glue as it calls KernelStep's). The glue is the
    Transformer's own: our kernels call by call when they are built, torch's ops otherwise."""

    def __init__(self, tr: Transformer, batch: list[SeqStep], cells: list[int], tail: bool,
                 cos: torch.Tensor, sin: torch.Tensor, swa: Sliding | None, split: bool,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, k_swa: torch.Tensor | None,
                 v_swa: torch.Tensor | None, types: KVTypes) -> None:
        """`tail`: every sequence's new tokens end its cells and our kernel runs, so the global
        layers attend with attend_causal and need no plans. `types`: the caches' K and V types
        (stored through their quantize, read by our kernel in place or dequantized for SDPA)."""
        hp, device = tr.hp, k_cache.device
        self.tr, self.batch, self.kern, self.types = tr, batch, tr.kern, types
        self.norm, self.post_norm, self.silu, self.gelu = tr.norm, tr.post_norm, tr.silu, tr.gelu
        plans = None if tail else [
            make_plan(b.kv_cells, b.kv_positions, b.pos0, len(b.tokens), device, 0,
                      tr.own_attention, hp.n_group) for b in batch]
        # per kind of layer: its cache, plans (None: attend_causal), RoPE rows, new cells, Rope
        cell_idx = torch.tensor(cells, dtype=torch.long, device=device)
        self.kinds = {"global": (k_cache, v_cache, plans, cos, sin, cell_idx, tr.rope)}
        if swa is not None:
            ks, vs = (k_swa, v_swa) if split else (k_cache, v_cache)
            assert ks is not None and vs is not None
            swa_idx = torch.tensor(swa.cells, dtype=torch.long, device=device)
            self.kinds["sliding"] = (ks, vs, swa.plans, swa.cos, swa.sin, swa_idx, tr.rope_swa)
        self.layer_kind = tr.layer_kinds[split]

    def attend(self, li: int, qkv: torch.Tensor, sinks: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Layer li's fused projections [T, (n_head + 2 n_head_kv) d] -> its attention outputs
        [T, n_head d], in its kind's cache (row ci of it); `sinks` its f32 [n_head] attention
        sinks (None: none)."""
        name, ci = self.layer_kind[li]
        kc, vc, plans, cos, sin, idx, rope = self.kinds[name]
        outs = self._attention(kc[ci], vc[ci], li, plans, qkv, cos, sin, idx, rope, sinks)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _attention(self, kl: torch.Tensor, vl: torch.Tensor, li: int, plans: list[Plan] | None,
                   qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cell_idx: torch.Tensor, rope: Rope,
                   sinks: torch.Tensor | None) -> list[torch.Tensor]:
        """Rotate q/k with `rope`, store this layer's K/V at `cell_idx`, attend per sequence:
        with our causal kernel when `plans` is None, else each plan's (attend_plan)."""
        tr = self.tr
        hp = tr.hp
        qk = qkv[:, : tr.q_dim + tr.kv_dim].view(-1, hp.n_head + hp.n_head_kv, hp.head_dim)
        v = qkv[:, tr.q_dim + tr.kv_dim :].view(-1, hp.n_head_kv, hp.head_dim)
        qk_norms = tr._qk_norms[li]
        if qk_norms is not None:
            if self.kern is not None:  # KernelStep's norms, bit for bit
                norm = functools.partial(kstep.head_norm, self.kern, eps=hp.rms_eps)
            else:
                norm = functools.partial(rms_norm, eps=hp.rms_eps)
            qk = torch.cat([norm(qk[:, : hp.n_head], w=qk_norms[0]),
                            norm(qk[:, hp.n_head :], w=qk_norms[1])], dim=1)
        qk = rope.apply(qk, cos, sin)
        q, k = qk[:, : hp.n_head], qk[:, hp.n_head :]
        kt, vt = self.types
        kl.index_copy_(1, cell_idx, kt.quantize(k.transpose(0, 1)))
        vl.index_copy_(1, cell_idx, vt.quantize(v.transpose(0, 1)))
        outs = []
        start = 0
        if plans is None:
            assert self.kern is not None
            q = q.contiguous()
            for b in self.batch:
                n = len(b.tokens)
                outs.append(self.kern.attend_causal(q[start : start + n], kl, vl, b.kv_cells,
                                                    types=self.types, scale=self.tr.attn_scale,
                                                    sinks=sinks))
                start += n
            return outs
        for b, plan in zip(self.batch, plans):
            n = len(b.tokens)
            outs.append(self._attend_plan(q[start : start + n], kl, vl, plan, sinks))
            start += n
        return outs

    def _attend_plan(self, q: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor,
                     plan: Plan, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """One sequence's attention in one layer, global or sliding: q [n, n_head, d], kl/vl the
        layer [n_head_kv, n_cells, d]. bf16 steps whose new tokens end the plan's contiguous
        cells run our kernel (fixed position-aligned blocks, the window applied by position:
        a token's bits do not depend on chunking, batching or how much of the window's past a
        cache still holds); the rest torch's SDPA over the plan's cells and mask."""
        if plan.tail and self.tr.own_attention:
            assert self.kern is not None
            return self.kern.attend_causal(q.contiguous(), kl, vl, plan.cells,
                                           window=plan.window, pos0=plan.pos0, types=self.types,
                                           scale=self.tr.attn_scale, sinks=sinks)
        kt, vt = self.types
        k, v = kt.dequantize(kl[:, plan.cells], q.dtype), vt.dequantize(vl[:, plan.cells], q.dtype)
        if sinks is not None:
            return self._with_sinks(q, k, v, plan.mask, sinks)
        return self._sdpa(q, k, v, plan.mask)

    def _with_sinks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None, sinks: torch.Tensor) -> torch.Tensor:
        """_sdpa's attention with a sink logit a head in each softmax (SDPA takes none), in
        f32 as HF's eager gpt-oss attention: [scores | sink], softmax, the sink's share
        dropped."""
        hp, scale = self.tr.hp, self.tr.attn_scale
        n, hk, g, d = q.shape[0], hp.n_head_kv, hp.n_group, hp.head_dim
        qf = q.float().view(n, hk, g, d).permute(1, 2, 0, 3).reshape(hk, g * n, d)
        s = torch.matmul(qf, k.float().transpose(1, 2)) * scale  # [hk, g n, L]
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        sk = sinks.float().view(hk, g, 1, 1).expand(hk, g, n, 1).reshape(hk, g * n, 1)
        p = torch.softmax(torch.cat([s, sk], dim=-1), dim=-1)[..., :-1]
        o = torch.matmul(p, v.float()).view(hk, g, n, d).permute(2, 0, 1, 3)
        return o.reshape(n, hp.n_head * d).to(q.dtype)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
        """GQA attention with the query group folded into the length axis (no K/V copies).

        q [n, n_head, d]; k, v [n_head_kv, L, d] -> [n, n_head * d].
        """
        hp, scale = self.tr.hp, self.tr.attn_scale
        n = q.shape[0]
        if n == 1:  # decode: [1, n_head, d] is already [n_head_kv, group, d]; fewer ops a layer
            o = F.scaled_dot_product_attention(q.view(1, hp.n_head_kv, hp.n_group, hp.head_dim),
                                               k[None], v[None], attn_mask=mask, scale=scale)
            return o.view(1, hp.n_head * hp.head_dim)
        qf = q.view(n, hp.n_head_kv, hp.n_group, hp.head_dim).permute(1, 2, 0, 3)
        qf = qf.reshape(hp.n_head_kv, hp.n_group * n, hp.head_dim)
        # a leading batch axis makes SDPA pick its fused CPU kernel (3x faster than 3-D input)
        o = F.scaled_dot_product_attention(qf[None], k[None], v[None], attn_mask=mask,
                                           scale=scale)[0]
        o = o.view(hp.n_head_kv, hp.n_group, n, hp.head_dim).permute(2, 0, 1, 3)
        return o.reshape(n, hp.n_head * hp.head_dim)
