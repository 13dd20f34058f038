"""One batched forward over several sequences (llama / qwen2 / qwen3 / gemma3 decoder).

All tokens of the batch go through the dense layers together as one [T, n_embd] matrix;
attention runs per sequence over that sequence's cells only. Prefill chunks and single decode
tokens mix freely, which is what continuous batching needs. Logits are computed only for the
rows the caller will sample (the output head is a third of a decode step on CPU).

bf16 steps with our kernels run each layer's glue in C: RoPE, the K/V store and attention in
one call a layer, the norms and gates in one call each (kernels.py's DecodeStep for llama's
layers, gemma_step.py's GemmaStep for q/k norms, sliding windows, post norms and GeGLU), when
every sequence's new tokens end its cells; the general path below does the same arithmetic
with torch's attention where they do not.

Gemma 3 adds sliding-window layers: a query at position p sees keys at p - n_swa < k <= p only
(llama.cpp's LLAMA_SWA_TYPE_STANDARD), rotated with their own RoPE base. Their K/V live either
in the same cache as the global layers' (`--swa-full`: every layer, every cell, the window
applied by the mask) or in a separate window-sized cache whose cells each step names in
`SeqStep.swa` (kv/swa.py), so a long context costs the sliding layers n_swa cells only.
"""

from __future__ import annotations

import bisect
import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.model.hparams import HParams
from radixserve.model import gemma_step
from radixserve.model.gemma_step import GemmaStep, LayerKind
from radixserve.model.kernels import DecodeStep, kernels
from radixserve.model.quant import Int4Linear
from radixserve.model.rope import Rope
from radixserve.model.weights import ModelWeights

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SwaStep:
    """A sequence's part of a forward in the sliding layers' own cache (the split layout): the
    same three things as SeqStep's, in that cache's cells. The cache keeps only the window, so
    kv_positions may start anywhere after 0."""

    cells: list[int]  # where the new tokens' sliding-layer K/V go, one per token
    kv_cells: slice | torch.Tensor  # every cell the sliding layers read, in position order
    kv_positions: list[int]  # their positions


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
    swa: SwaStep | None = None  # the sliding layers' cells when they have a cache of their own


@dataclass(slots=True)
class _Plan:
    """What one sequence's attention reads in one kind of layer (global or sliding)."""

    cells: slice | torch.Tensor  # in position order; a sliding plan drops keys out of every window
    pos0: int  # position of the first of `cells`
    window: int  # n_swa for sliding layers, 0 for causal-only
    mask: torch.Tensor | None  # [n_group * n, len(cells)] visible keys; None: all of them
    tail: bool = False  # contiguous positions ending with the step's new tokens (our kernel's)


@dataclass(slots=True)
class _Sliding:
    """What the sliding layers of one step share: RoPE tables with their base, the cells their
    new K/V go to, and each sequence's plan."""

    cos: torch.Tensor
    sin: torch.Tensor
    cells: list[int]
    plans: list[_Plan]


def resolve_deterministic(mode: str, dtype: torch.dtype, kernels_built: bool,
                          w: ModelWeights, torch_attention: bool = False) -> bool:
    """Whether a token's logits will depend only on its token sequence (docs/PERFORMANCE.md).

    Only the bf16 path with our kernels is batch-invariant: torch's f32 matmul and SDPA pick
    their kernels and blockings by shape, so a row's bits change with the rows beside it. `on`
    where that path cannot run is an error rather than a mode that silently is not one. `auto`
    is on wherever it costs nothing measurable; torch's int4 kernel (4-bit weights on CPUs
    without AVX512-BF16) would have to skip its dense GEMM on prefill chunks, ~2x slower
    there, so auto leaves the mode off for it. `torch_attention`: the model's attention runs
    torch's SDPA (a scale our kernel does not take: Gemma 3 27B), whose blocking, and so a
    token's bits, depends on how many tokens a call holds."""
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
    elif torch_attention:
        why = ("attention runs torch's SDPA (sliding-window layers), whose bits change with the "
               "chunking")
    if mode == "on" and why is not None:
        raise ValueError(f"--deterministic on needs bf16 compute with radixserve's kernels "
                         f"({why}); use --deterministic off or auto")
    if mode == "auto" and why is None and any(isinstance(m, Int4Linear) for m in linears):
        why = "torch's int4 kernel is slow on prefill chunks without its dense switch"
    if mode == "auto" and why is not None:
        log.info("deterministic mode off: %s", why)
    return why is None and mode != "off"


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm computed in f32 in HF's op order (the per-head q/k norms), returned as `dtype`
    (default x's)."""
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
        # our attention kernel scales by 1/sqrt(head_dim): a model with another scale (Gemma 3
        # 27B) attends with torch's SDPA (see _attend_plan)
        self.torch_attention = hp.attn_scale not in (0.0, hp.head_dim ** -0.5)
        # kernels.py's DecodeStep knows llama's layer only (SwiGLU, no q/k or output norms);
        # the others (qwen3, gemma3) take gemma_step.py's GemmaStep
        self.fused_layers = (hp.act == "silu" and hp.embd_scale == 1.0
                             and all(lw.q_norm is None and lw.post_attn_norm is None
                                     for lw in w.layers))
        self.deterministic = resolve_deterministic(deterministic, dtype, self.kern is not None,
                                                   w, self.torch_attention)
        self._warned = False
        self.rope = Rope(hp, w.rope_freqs)
        # sliding layers: their own base, never position scaling (llama.cpp's
        # rope_freq_scale_train_swa = 1); a pool re-rotates their cache with this one
        self.rope_swa = (Rope(hp, w.rope_freqs, base=hp.rope_base_swa, scale=1.0)
                         if hp.n_layer_swa else self.rope)
        self.attn_scale = hp.attn_scale or None  # None: SDPA's own 1/sqrt(head_dim)
        self.q_dim = hp.n_head * hp.head_dim
        self.kv_dim = hp.n_head_kv * hp.head_dim
        # GemmaStep's (kind, cache index) of each layer, with all layers in one cache (False)
        # or the sliding ones in their own (True)
        self._checked: dict[tuple[int, int], torch.Tensor] = {}  # its norm weights, checked
        kind = ["sliding" if s else "global" for s in hp.swa_layers]
        self._layer_kinds = {False: list(zip(kind, range(hp.n_layer))),
                             True: [(k, hp.cache_index(li)) for li, k in enumerate(kind)]}

    @property
    def own_attention(self) -> bool:
        """Attention runs our kernel (bf16 with the kernels built, the kernel's scale)."""
        return self.kern is not None and not self.torch_attention

    @torch.inference_mode()
    def hidden(self, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: list[SeqStep],
               k_swa: torch.Tensor | None = None,
               v_swa: torch.Tensor | None = None) -> torch.Tensor:
        """Run `batch`, storing its K/V into `cells` of the caches [n_layer, n_head_kv, n_cells,
        head_dim]; returns the output-normed f32 hidden states [sum n_logits, n_embd] of the
        rows to sample (the head turns them into logits).

        A model with sliding layers given `k_swa`/`v_swa` (the split layout): k_cache/v_cache
        hold the global layers only ([n_layer_full, ...], layer li at hp.cache_index(li)),
        k_swa/v_swa the sliding ones ([n_layer_swa, n_head_kv, n_swa_cells, head_dim]), and
        every step's `.swa` names their cells. Without them (--swa-full) the caches hold every
        layer and the sliding layers read the step's own cells through the window mask."""
        hp = self.hp
        split = k_swa is not None and hp.n_layer_swa > 0
        if split:
            assert k_swa is not None and v_swa is not None
            if k_cache.shape[0] != hp.n_layer_full or k_swa.shape[0] != hp.n_layer_swa:
                raise ValueError(f"split caches need {hp.n_layer_full} global and "
                                 f"{hp.n_layer_swa} sliding layers, got {k_cache.shape[0]} "
                                 f"and {k_swa.shape[0]}")
            if any(b.swa is None for b in batch):
                raise ValueError("a split sliding-window cache needs every step's .swa")
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
        tail = self.own_attention and all(_new_tokens_last(b) for b in batch)
        if self.deterministic and not tail and not self._warned:
            self._warned = True
            log.warning("deterministic mode: a step with tokens inside a sequence's cells "
                        "runs torch's attention; its bits may depend on the batch")
        plans = None if tail else [self._attn_plan(b, device) for b in batch]
        swa = self._sliding(batch, pos, split, device) if hp.n_layer_swa else None

        # the residual stream stays in f32: bf16 there flips near-tie greedy choices
        x = self.w.embed(tokens)
        if hp.embd_scale != 1.0:
            x.mul_(hp.embd_scale)
        # then RoPE, the K/V store and attention of the whole step are one kernel call a layer
        # (model/csrc/decode_attn.c): llama's layers in DecodeStep, those with q/k norms, sliding
        # windows, post norms or GeGLU (qwen3, gemma3) in GemmaStep, when every sliding plan
        # is one our kernel runs too
        step: DecodeStep | GemmaStep | None = None
        if tail and self.fused_layers:
            assert self.kern is not None
            step = self.kern.decode_step(k_cache, v_cache, hp.n_head,
                                         [b.kv_cells for b in batch], cells, cos, sin, x, eps,
                                         hp.n_ff, n_new=[len(b.tokens) for b in batch])
        elif tail and (swa is None or all(p.tail for p in swa.plans)):
            step = self._gemma_step(batch, cells, cos, sin, x, swa, split, k_cache, v_cache,
                                    k_swa, v_swa)
        cell_idx = swa_idx = None  # the general path's new cells, as index tensors
        if step is None:
            cell_idx = torch.tensor(cells, dtype=torch.long, device=device)
            if swa is not None:
                swa_idx = torch.tensor(swa.cells, dtype=torch.long, device=device)
        glue = step or self  # the norms and gates: the step's C calls, or the general ones
        act = glue.silu if hp.act == "silu" else glue.gelu
        inv = self.deterministic
        layers = self.w.layers
        h = glue.norm(x, None, layers[0].attn_norm)
        for li, lw in enumerate(layers):
            qkv = lw.wqkv(h, inv)
            if step is not None:
                attn = step.attend(li, qkv)
            else:
                assert cell_idx is not None
                ci = hp.cache_index(li) if split else li
                if swa is not None and hp.swa_layers[li]:
                    ks, vs = (k_swa, v_swa) if split else (k_cache, v_cache)
                    assert ks is not None and vs is not None
                    assert swa_idx is not None
                    outs = self._attention(ks[ci], vs[ci], li, batch, swa.plans, qkv, swa.cos,
                                           swa.sin, swa_idx, self.rope_swa)
                else:
                    outs = self._attention(k_cache[ci], v_cache[ci], li, batch, plans, qkv, cos,
                                           sin, cell_idx, self.rope)
                attn = outs[0] if len(outs) == 1 else torch.cat(outs)
            nxt = layers[li + 1].attn_norm if li + 1 < len(layers) else None
            if lw.post_attn_norm is None:  # llama / qwen: the residual add fused into the norm
                h = glue.norm(x, lw.wo(attn, inv), lw.ffn_norm)
                add = lw.w_down(act(lw.w_gate_up(h, inv)), inv)
                if nxt is not None:
                    h = glue.norm(x, add, nxt)
                else:
                    x.add_(add)
            else:  # gemma3: each output RMS-normed (in f32) before its residual add
                assert lw.post_ffn_norm is not None
                hn = glue.post_norm(x, lw.wo(attn, inv), lw.post_attn_norm, lw.ffn_norm)
                assert hn is not None
                down = lw.w_down(act(lw.w_gate_up(hn, inv)), inv)
                hn = glue.post_norm(x, down, lw.post_ffn_norm, nxt)
                if hn is not None:
                    h = hn

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

    def post_norm(self, x: torch.Tensor, y: torch.Tensor, wp: torch.Tensor,
                  wn: torch.Tensor | None) -> torch.Tensor | None:
        """Gemma's residual step: x += rms_norm(y) * wp (y's norm in f32), then the next
        norm of x in the compute dtype (None when wn is None: after the last layer)."""
        if self.kern is not None:
            return gemma_step.post_norm(self.kern, x, y, wp, wn, self.hp.rms_eps)
        x.add_(F.rms_norm(y.float(), (self.hp.n_embd,), wp, self.hp.rms_eps))
        return None if wn is None else self.norm(x, None, wn)

    def silu(self, gu: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the fused [gate | up] rows, in the compute dtype."""
        if self.kern is not None:
            return self.kern.silu_mul(gu)
        return F.silu(gu[:, : self.hp.n_ff]) * gu[:, self.hp.n_ff :]

    def gelu(self, gu: torch.Tensor) -> torch.Tensor:
        """Gemma's GeGLU: gelu(gate) * up with the tanh-approximated GELU (HF's
        gelu_pytorch_tanh, llama.cpp's ggml_gelu), in the compute dtype."""
        if self.kern is not None:
            return gemma_step.gelu_mul(self.kern, gu)
        return F.gelu(gu[:, : self.hp.n_ff], approximate="tanh") * gu[:, self.hp.n_ff :]

    def act_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of the fused [gate | up] rows with the model's activation: SwiGLU
        (silu) or GeGLU (gelu)."""
        return self.silu(gu) if self.hp.act == "silu" else self.gelu(gu)

    def _gemma_step(self, batch: list[SeqStep], cells: list[int], cos: torch.Tensor,
                    sin: torch.Tensor, x: torch.Tensor, swa: _Sliding | None, split: bool,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, k_swa: torch.Tensor | None,
                    v_swa: torch.Tensor | None) -> GemmaStep:
        """The step's glue in C for layers with q/k norms, windows, post norms or GeGLU: the
        global layers read each sequence's cells (positions from 0, as attend_causal), the
        sliding ones its sliding plan's (their own cache in the split layout)."""
        hp, kern = self.hp, self.kern
        assert kern is not None
        n_new = [len(b.tokens) for b in batch]
        kinds = {"global": LayerKind(k_cache, v_cache, [b.kv_cells for b in batch], None, 0, cells,
                                 n_new, cos, sin)}
        layer_kind = self._layer_kinds[split]
        if swa is not None:
            ks, vs = (k_swa, v_swa) if split else (k_cache, v_cache)
            assert ks is not None and vs is not None
            kinds["sliding"] = LayerKind(ks, vs, [p.cells for p in swa.plans],
                                     [p.pos0 for p in swa.plans], hp.n_swa,
                                     swa.cells, n_new, swa.cos, swa.sin)
        return GemmaStep(kern, hp.n_head, hp.n_head_kv, hp.head_dim, kinds, layer_kind,
                         [(lw.q_norm, lw.k_norm) for lw in self.w.layers], x, hp.rms_eps,
                         hp.n_ff, self._checked)

    def _sliding(self, batch: list[SeqStep], pos: torch.Tensor, split: bool,
                 device: torch.device) -> _Sliding:
        """The sliding layers' share of a step: RoPE tables with their base, where their new
        K/V go and what each sequence reads (its `.swa` cells in the split layout, else its
        own), through the window."""
        cos, sin = self.rope_swa.cos_sin(pos)
        n_swa = self.hp.n_swa
        if split:
            views = [b.swa for b in batch if b.swa is not None]  # hidden checked: all of them
            cells = [c for v in views for c in v.cells]
            plans = [self._plan(v.kv_cells, v.kv_positions, b.pos0, len(b.tokens), device, n_swa)
                     for b, v in zip(batch, views)]
        else:
            cells = [c for b in batch for c in b.cells]
            plans = [self._plan(b.kv_cells, b.kv_positions, b.pos0, len(b.tokens), device, n_swa)
                     for b in batch]
        return _Sliding(cos, sin, cells, plans)

    def _attention(self, kl: torch.Tensor, vl: torch.Tensor, li: int, batch: list[SeqStep],
                   plans: list[_Plan] | None, qkv: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, cell_idx: torch.Tensor,
                   rope: Rope | None = None) -> list[torch.Tensor]:
        """Rotate q/k (with `rope`, default the global one), store this layer's K/V at
        `cell_idx`, attend per sequence (the general path): with our causal kernel when `plans`
        is None, else torch's attention with each plan's cells and mask."""
        hp = self.hp
        qk = qkv[:, : self.q_dim + self.kv_dim].view(-1, hp.n_head + hp.n_head_kv, hp.head_dim)
        v = qkv[:, self.q_dim + self.kv_dim :].view(-1, hp.n_head_kv, hp.head_dim)
        lw = self.w.layers[li]
        if lw.q_norm is not None and lw.k_norm is not None:
            if self.kern is not None:  # GemmaStep's norms, bit for bit
                norm = functools.partial(gemma_step.head_norm, self.kern, eps=hp.rms_eps)
            else:
                norm = functools.partial(rms_norm, eps=hp.rms_eps)
            qk = torch.cat([norm(qk[:, : hp.n_head], w=lw.q_norm),
                            norm(qk[:, hp.n_head :], w=lw.k_norm)], dim=1)
        qk = (rope or self.rope).apply(qk, cos, sin)
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
        for b, plan in zip(batch, plans):
            n = len(b.tokens)
            outs.append(self._attend_plan(q[start : start + n], kl, vl, plan))
            start += n
        return outs

    def _attend_plan(self, q: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor,
                     plan: _Plan) -> torch.Tensor:
        """One sequence's attention in one layer, global or sliding: q [n, n_head, d], kl/vl the
        layer [n_head_kv, n_cells, d]. bf16 steps whose new tokens end the plan's contiguous
        cells run our kernel (fixed position-aligned blocks, the window applied by position:
        a token's bits do not depend on chunking, batching or how much of the window's past a
        cache still holds); the rest torch's SDPA over the plan's cells and mask."""
        if plan.tail and self.own_attention:
            assert self.kern is not None
            return self.kern.attend_causal(q.contiguous(), kl, vl, plan.cells,
                                           window=plan.window, pos0=plan.pos0)
        return self._attend(q, kl[:, plan.cells], vl[:, plan.cells], plan.mask)

    def _attn_plan(self, b: SeqStep, device: torch.device) -> _Plan:
        """Cells to read for this sequence in a global layer, and a causal mask unless every
        key is visible."""
        return self._plan(b.kv_cells, b.kv_positions, b.pos0, len(b.tokens), device)

    def _plan(self, cells: slice | torch.Tensor, positions: list[int], pos0: int, n: int,
              device: torch.device, window: int = 0) -> _Plan:
        """What queries at pos0 .. pos0 + n - 1 read of `cells` (at `positions`, ascending):
        keys at k <= p, and with a window only p - window < k (llama.cpp's
        LLAMA_SWA_TYPE_STANDARD). Keys before every query's window are left out of the cells
        rather than masked: --swa-full keeps them all, and a long context would otherwise cost
        the sliding layers as much as the global ones."""
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
            return _Plan(cells, positions[0], window, None, tail)
        if tail and self.own_attention:  # our kernel masks by position itself
            return _Plan(cells, positions[0], window, None, tail)
        kp = torch.tensor(positions, device=device)
        qp = torch.arange(pos0, pos0 + n, device=device)
        mask = kp[None, :] <= qp[:, None]
        if window:
            mask &= qp[:, None] - kp[None, :] < window
        return _Plan(cells, positions[0], window, mask.repeat(self.hp.n_group, 1), tail)

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
                                               k[None], v[None], attn_mask=mask,
                                               scale=self.attn_scale)
            return o.view(1, hp.n_head * hp.head_dim)
        qf = q.view(n, hp.n_head_kv, hp.n_group, hp.head_dim).permute(1, 2, 0, 3)
        qf = qf.reshape(hp.n_head_kv, hp.n_group * n, hp.head_dim)
        # a leading batch axis makes SDPA pick its fused CPU kernel (3x faster than 3-D input)
        o = F.scaled_dot_product_attention(qf[None], k[None], v[None], attn_mask=mask,
                                           scale=self.attn_scale)[0]
        o = o.view(hp.n_head_kv, hp.n_group, n, hp.head_dim).permute(2, 0, 1, 3)
        return o.reshape(n, hp.n_head * hp.head_dim)
