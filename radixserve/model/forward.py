"""One batched forward over several sequences (llama / qwen2 / qwen3 decoder).

All tokens of the batch go through the dense layers together as one [T, n_embd] matrix;
attention runs per sequence over that sequence's cells only. Prefill chunks and single decode
tokens mix freely, which is what continuous batching needs. Logits are computed only for the
rows the caller will sample (the output head is a third of a decode step on CPU).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.model.hparams import HParams
from radixserve.model.kernels import kernels
from radixserve.model.quant import Int4Linear
from radixserve.model.rope import Rope
from radixserve.model.weights import ModelWeights

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SeqStep:
    """One sequence's part of a forward, with its cells already reserved by the caller.

    The model knows cells only as row indices of the K/V tensors it is given: which cells a
    sequence owns, and whether there are any left, is the pool's business (kv/), decided
    before the forward runs, so a forward never runs out of cells half-way.
    """

    tokens: list[int]  # new tokens, at consecutive positions from pos0
    pos0: int
    cells: list[int]  # where the new tokens' K/V go, one per token
    kv_cells: slice | torch.Tensor  # every cell attention reads, in position order (new ones too)
    kv_positions: list[int]  # their positions
    n_logits: int = 1  # logits for the last n_logits tokens (0: none)


def resolve_deterministic(mode: str, dtype: torch.dtype, kernels_built: bool,
                          w: ModelWeights) -> bool:
    """Whether a token's logits will depend only on its token sequence (docs/PERFORMANCE.md).

    Only the bf16 path with our kernels is batch-invariant: torch's f32 matmul and SDPA pick
    their kernels and blockings by shape, so a row's bits change with the rows beside it. `on`
    where that path cannot run is an error rather than a mode that silently is not one. `auto`
    is on wherever it costs nothing measurable; torch's int4 kernel (4-bit weights on CPUs
    without AVX512-BF16) would have to skip its dense GEMM on prefill chunks, ~2x slower
    there, so auto leaves the mode off for it."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"--deterministic must be auto, on or off, got {mode!r}")
    linears = [m for lw in w.layers for m in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)]
    why = None
    if dtype != torch.bfloat16:
        why = f"--dtype is {str(dtype).removeprefix('torch.')}"
    elif not kernels_built:
        why = "the kernels did not build"
    elif not all(m.row_invariant for m in linears):
        why = "some layer matrices run torch's bf16 GEMM, whose rows change with the row count"
    if mode == "on" and why is not None:
        raise ValueError(f"--deterministic on needs bf16 compute with radixserve's kernels "
                         f"({why}); use --deterministic off or auto")
    if mode == "auto" and why is None and any(isinstance(m, Int4Linear) for m in linears):
        why = "torch's int4 kernel is slow on prefill chunks without its dense switch"
    if mode == "auto" and why is not None:
        log.info("deterministic mode off: %s", why)
    return why is None and mode != "off"


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * w).to(dtype or x.dtype)


def _new_tokens_last(b: SeqStep) -> bool:
    """The step's tokens are the last cells of the sequence, after every other position."""
    n, kp = len(b.tokens), b.kv_positions
    return (len(kp) >= n and kp[-n] == b.pos0 and kp[-1] == b.pos0 + n - 1
            and (len(kp) == n or kp[-n - 1] < b.pos0))


class Transformer:
    def __init__(self, hp: HParams, w: ModelWeights, dtype: torch.dtype,
                 use_kernels: bool = True, deterministic: str = "auto") -> None:
        self.hp, self.w, self.dtype = hp, w, dtype
        # bf16 steps run their glue and decode attention in our kernels (model/csrc/) when they
        # build; f32 (the reference path) stays on torch ops
        self.kern = kernels() if use_kernels and dtype == torch.bfloat16 else None
        self.deterministic = resolve_deterministic(deterministic, dtype, self.kern is not None,
                                                   w)
        self._warned = False
        self.rope = Rope(hp, w.rope_freqs)
        self.q_dim = hp.n_head * hp.head_dim
        self.kv_dim = hp.n_head_kv * hp.head_dim

    @torch.inference_mode()
    def hidden(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
               batch: list[SeqStep]) -> torch.Tensor:
        """Run `batch`, storing its K/V into `cells` of the caches [n_layer, n_head_kv, n_cells,
        head_dim]; returns the output-normed f32 hidden states [sum n_logits, n_embd] of the
        rows to sample (the head turns them into logits)."""
        hp = self.hp
        cells = [c for b in batch for c in b.cells]
        device = k_cache.device
        tokens = torch.tensor([t for b in batch for t in b.tokens], dtype=torch.long, device=device)
        pos = torch.tensor(
            [p for b in batch for p in range(b.pos0, b.pos0 + len(b.tokens))], device=device
        )
        cos, sin = self.rope.cos_sin(pos)
        d, eps = hp.n_embd, hp.rms_eps
        # our attention kernel takes each sequence's new tokens as the last of its cells (all
        # but --cache-reuse's holes); it is the same arithmetic for a decode token and a prefill
        # chunk, so only it keeps a token's bits independent of chunking (and it is faster)
        tail = self.kern is not None and all(_new_tokens_last(b) for b in batch)
        if self.deterministic and not tail and not self._warned:
            self._warned = True
            log.warning("deterministic mode: a step with tokens inside a sequence's cells "
                        "runs torch's attention; its bits may depend on the batch")
        plans = None if tail else [self._attn_plan(b, device) for b in batch]

        # the residual stream stays in f32: bf16 there flips near-tie greedy choices
        x = F.embedding(tokens, self.w.tok_embd).float()
        # then RoPE, the K/V store and attention of the whole step are one kernel call a layer
        # (model/csrc/decode_attn.c); q/k norms (qwen3) keep the torch path up to attention
        step = None
        if tail and self.w.layers[0].q_norm is None:
            assert self.kern is not None
            step = self.kern.decode_step(k_cache, v_cache, hp.n_head,
                                         [b.kv_cells for b in batch], cells, cos, sin, x, eps,
                                         hp.n_ff, n_new=[len(b.tokens) for b in batch])
            cell_idx = None
        else:
            cell_idx = torch.tensor(cells, dtype=torch.long, device=device)
        glue = step or self  # norm and silu: the step's C calls, or the general ones
        inv = self.deterministic
        layers = self.w.layers
        h = glue.norm(x, None, layers[0].attn_norm)
        for li, lw in enumerate(layers):
            qkv = lw.wqkv(h, inv)
            if step is not None:
                attn = step.attend(li, qkv)
            else:
                assert cell_idx is not None
                outs = self._attention(k_cache[li], v_cache[li], li, batch, plans, qkv, cos, sin,
                                       cell_idx)
                attn = outs[0] if len(outs) == 1 else torch.cat(outs)
            h = glue.norm(x, lw.wo(attn, inv), lw.ffn_norm)
            down = lw.w_down(glue.silu(lw.w_gate_up(h, inv)), inv)
            if li + 1 < len(layers):
                h = glue.norm(x, down, layers[li + 1].attn_norm)
            else:
                x.add_(down)

        rows: list[int] = []
        start = 0
        for b in batch:
            n = len(b.tokens)
            rows.extend(range(start + n - min(b.n_logits, n), start + n))
            start += n
        if not rows:
            return torch.empty(0, hp.n_embd)
        xr = x[torch.tensor(rows, device=device)] if len(rows) < len(x) else x
        return F.rms_norm(xr, (d,), self.w.output_norm, eps)

    def norm(self, x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor) -> torch.Tensor:
        """x += y (the f32 residual stream; f32 += bf16 needs no conversion op), then its
        RMSNorm in the compute dtype."""
        if self.kern is not None:
            return self.kern.add_rms_norm(x, y, w, self.hp.rms_eps)
        if y is not None:
            x.add_(y)
        return F.rms_norm(x, (self.hp.n_embd,), w, self.hp.rms_eps).to(self.dtype)

    def silu(self, gu: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the fused [gate | up] rows, in the compute dtype."""
        if self.kern is not None:
            return self.kern.silu_mul(gu)
        return F.silu(gu[:, : self.hp.n_ff]) * gu[:, self.hp.n_ff :]

    def _attention(self, kl: torch.Tensor, vl: torch.Tensor, li: int, batch: list[SeqStep],
                   plans: list[tuple[slice | torch.Tensor, torch.Tensor | None]] | None,
                   qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cell_idx: torch.Tensor) -> list[torch.Tensor]:
        """Rotate q/k, store this layer's K/V, attend per sequence (the general path): with our
        causal kernel when `plans` is None, else torch's attention with each plan's mask."""
        hp = self.hp
        qk = qkv[:, : self.q_dim + self.kv_dim].view(-1, hp.n_head + hp.n_head_kv, hp.head_dim)
        v = qkv[:, self.q_dim + self.kv_dim :].view(-1, hp.n_head_kv, hp.head_dim)
        lw = self.w.layers[li]
        if lw.q_norm is not None and lw.k_norm is not None:
            qk = torch.cat([rms_norm(qk[:, : hp.n_head], lw.q_norm, hp.rms_eps),
                            rms_norm(qk[:, hp.n_head :], lw.k_norm, hp.rms_eps)], dim=1)
        qk = self.rope.apply(qk, cos, sin)
        q, k = qk[:, : hp.n_head], qk[:, hp.n_head :]
        kl.index_copy_(1, cell_idx, k.transpose(0, 1).to(kl.dtype))
        vl.index_copy_(1, cell_idx, v.transpose(0, 1).to(vl.dtype))
        outs = []
        start = 0
        if plans is None:
            assert self.kern is not None
            q = q.contiguous()
            for b in batch:
                n = len(b.tokens)
                outs.append(self.kern.attend_causal(q[start : start + n], kl, vl, b.kv_cells))
                start += n
            return outs
        for b, (sel, mask) in zip(batch, plans):
            n = len(b.tokens)
            outs.append(self._attend(q[start : start + n], kl[:, sel], vl[:, sel], mask))
            start += n
        return outs

    def _attn_plan(
        self, b: SeqStep, device: torch.device
    ) -> tuple[slice | torch.Tensor, torch.Tensor | None]:
        """Cells to read for this sequence, and a causal mask unless every key is visible."""
        n = len(b.tokens)
        if n == 1 and b.kv_positions[-1] == b.pos0:
            return b.kv_cells, None
        kp = torch.tensor(b.kv_positions, device=device)
        qp = torch.arange(b.pos0, b.pos0 + n, device=device)
        mask = kp[None, :] <= qp[:, None]
        return b.kv_cells, mask.repeat(self.hp.n_group, 1)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """GQA attention with the query group folded into the length axis (no K/V copies).

        q [n, n_head, d]; k, v [n_head_kv, L, d] -> [n, n_head * d].
        """
        hp = self.hp
        n = q.shape[0]
        if n == 1:  # decode: [1, n_head, d] is already [n_head_kv, group, d]; fewer ops a layer
            o = F.scaled_dot_product_attention(q.view(1, hp.n_head_kv, hp.n_group, hp.head_dim),
                                               k[None], v[None], attn_mask=mask)
            return o.view(1, hp.n_head * hp.head_dim)
        qf = q.view(n, hp.n_head_kv, hp.n_group, hp.head_dim).permute(1, 2, 0, 3)
        qf = qf.reshape(hp.n_head_kv, hp.n_group * n, hp.head_dim)
        # a leading batch axis makes SDPA pick its fused CPU kernel (3x faster than 3-D input)
        o = F.scaled_dot_product_attention(qf[None], k[None], v[None], attn_mask=mask)[0]
        o = o.view(hp.n_head_kv, hp.n_group, n, hp.head_dim).permute(2, 0, 1, 3)
        return o.reshape(n, hp.n_head * hp.head_dim)
