"""The decode step's glue in C, one skeleton for every architecture the kernels run: a layer is
four C calls besides its matmuls. What differs between architectures is data plugged in, not
code: per-head q/k RMS norms (qwen3, Gemma 3; none for llama), a layer's kind (global, or
sliding with its window, RoPE base and K/V cache of its own: Gemma 3), the residual block
(plain, or Gemma's post-attention / post-FFN norms) and the gate (SwiGLU or GeGLU).

Why: forward.py's general path spends ~25 torch ops a layer on this glue (q/k norms, RoPE,
index_copy into the cache, the post norms, GeGLU): at Gemma 3 270M's size that is as long as the
layer's matmuls. Here a layer is: the q/k norms, RoPE, the K/V store and windowed attention of
every sequence in one (decode_attn.c's attn_step_win_bf16; no norms, no window and positions
from 0 for llama's layers), the add + norm (rowwise.c's add_rms_norm_bf16, or
post_norm_add_bf16 for Gemma's post norms), the gate (silu_mul_bf16 or gelu_mul_bf16).

Every computation is per row (token) and per (query, KV head) in fixed, position-aligned
blocks, so a token's K/V and output do not depend on the chunking or the batch: the same
arithmetic as forward.py's general path with the kernels (its q/k norms are
attn_head_norm_bf16, its RoPE is Rope.apply's roundings, its post norms and gates these very
functions), so a step that has to take that path (tokens inside a sequence's cells) gives the
same K/V.

What a step needs (checked by Transformer.hidden before it builds one): the kernels, our
attention's scale, and every sequence's new tokens at the end of its cells in both kinds of
layers, a sliding plan's positions contiguous.
"""

from __future__ import annotations

import ctypes

import torch

from radixserve.model.cabi import bind, buf
from radixserve.model.hparams import STATE_KINDS
from radixserve.model.kernels import (
    ATTN_BLOCK,
    Kernels,
    KVTypes,
    _cells_arg,
    check_cells,
    pool_args,
)

def _f32_vec(w: torch.Tensor | None, d: int) -> int | None:
    """A norm weight's pointer (None for none), checked: contiguous f32 [d]."""
    if w is None:
        return None
    if not (w.dtype == torch.float32 and w.is_contiguous() and w.numel() == d):
        raise ValueError(f"norm weights must be contiguous f32 [{d}]")
    return w.data_ptr()


def head_norm(kern: Kernels, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """bf16 RMSNorm of each head of x [T, heads, d] (any row stride, heads contiguous) with the
    f32 weight w [d] -> [T, heads, d]: forward.py's rms_norm of the q/k heads, with the step's
    bits."""
    rows, nh, d = x.shape
    if not (x.dtype == torch.bfloat16 and x.stride(2) == 1 and x.stride(1) == d):
        raise ValueError("head_norm needs bf16 rows of contiguous heads")
    wp = _f32_vec(w, d)
    y = torch.empty(rows, nh, d, dtype=torch.bfloat16)
    if rows and bind(kern.lib).attn_head_norm_bf16(x.data_ptr(), x.stride(0), rows, nh, d, wp, eps,
                                   y.data_ptr()) != 0:
        raise ValueError(f"head_norm refused head_dim {d}")
    return y


def post_norm(kern: Kernels, x: torch.Tensor, y: torch.Tensor, wp: torch.Tensor,
              wn: torch.Tensor | None, eps: float,
              out: torch.Tensor | None = None) -> torch.Tensor | None:
    """x += rms_norm(y) * wp (f32 residual rows x [T, d], bf16 y), then bf16(rms_norm(x) * wn)
    (None when wn is None: the last layer)."""
    rows, d = x.shape
    if not (x.dtype == torch.float32 and x.stride(1) == 1 and y.dtype == torch.bfloat16
            and y.is_contiguous() and y.shape == x.shape):
        raise ValueError("post_norm needs f32 residual rows and bf16 addends of their shape")
    pp, pn = _f32_vec(wp, d), _f32_vec(wn, d)
    if wn is not None and out is None:
        out = torch.empty(rows, d, dtype=torch.bfloat16)
    po = None if wn is None else buf(out, torch.bfloat16, rows * d, "post_norm's rows")
    bind(kern.lib).post_norm_add_bf16(x.data_ptr(), x.stride(0), y.data_ptr(), pp, pn, rows, d,
                                      eps, po)
    return out if wn is not None else None


def gelu_mul(kern: Kernels, gu: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gelu_tanh(gate) * up for bf16 rows gu [T, 2 ff] = [gate | up] -> [T, ff]."""
    rows, ff2 = gu.shape
    if not (gu.dtype == torch.bfloat16 and gu.is_contiguous() and ff2 % 2 == 0):
        raise ValueError("gelu_mul needs contiguous bf16 [gate | up] rows")
    if out is None:
        out = torch.empty(rows, ff2 // 2, dtype=torch.bfloat16)
    bind(kern.lib).gelu_mul_bf16(gu.data_ptr(), rows, ff2 // 2,
                                 buf(out, torch.bfloat16, rows * (ff2 // 2), "gelu_mul's rows"))
    return out


class LayerKind:
    """One kind of layer's share of a step (global or sliding): its cache, the cells each
    sequence reads (with their first position and the window) and where its new K/V go, its
    RoPE rows; marshalled once for every layer of the kind."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, cells: list[slice | torch.Tensor],
                 pos0: list[int] | None, window: int, dst: list[int], n_new: list[int],
                 cos: torch.Tensor, sin: torch.Tensor, types: KVTypes | None = None) -> None:
        """`types`: the cache's K and V types (None: bf16); k, v [layers, n_kv, cells, width]."""
        # the C call writes K/V at k + layer + head * head stride + cell * row bytes
        if k.dim() != 4 or v.dim() != 4:
            raise ValueError("step: K/V must be [layers, n_kv, cells, width]")
        d = cos.shape[-1]  # the head size: RoPE rows are [tokens, (1,) d]
        n_kv, n_cells, _, kt, vt, k_hs, v_hs = pool_args(k, v, k.shape[1], d, types)
        if not (cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous()
                and sin.is_contiguous() and cos.shape == sin.shape
                and cos.numel() == len(dst) * d):
            raise ValueError("step: RoPE rows must be contiguous f32 [tokens, d]")
        # the indices' range is checked by KernelStep in the kernels' check mode (it holds the
        # kernels and their setting; a kind is marshalled before the step that reads it)
        args = [_cells_arg(c, n_cells, False) for c in cells]
        self.n_cells = n_cells
        n_seq, n_tok = len(args), len(dst)
        if not (len(n_new) == n_seq and sum(n_new) == n_tok
                and all(1 <= m <= a[2] for m, a in zip(n_new, args))
                and all(0 <= c < n_cells for c in dst) and window >= 0
                and (pos0 is None or (len(pos0) == n_seq and all(p >= 0 for p in pos0)))):
            raise ValueError("step: bad cells, new-token counts or positions")
        arr = ctypes.c_int64 * n_seq
        self.k0, self.v0 = k.data_ptr(), v.data_ptr()
        self.k_layer, self.v_layer = k.stride(0) * k.element_size(), v.stride(0) * v.element_size()
        self.n_layer, self.n_kv, self.d, self.n_tok = k.shape[0], n_kv, d, n_tok
        # the scratch holds the blocks a list spans, counted from its first block's start
        self.longest = max(n_cells, *(a[2] + (p % ATTN_BLOCK if pos0 else 0)
                                      for a, p in zip(args, pos0 or [0] * n_seq)))
        self.rope = (cos.data_ptr(), sin.data_ptr())
        # attn_step_win_bf16's arguments from the cache types to window
        self.seqs = (kt, vt, k_hs, v_hs, (ctypes.c_int64 * n_tok)(*dst), n_seq,
                     (ctypes.c_void_p * n_seq)(*(a[0] for a in args)),
                     arr(*(a[1] for a in args)), arr(*(a[2] for a in args)), arr(*n_new),
                     None if pos0 is None else arr(*pos0), window)
        self._keep = (k, v, cos, sin, cells)

    def check_cells(self) -> None:
        """IndexError unless every index of the kind's cell lists lies in its cache."""
        for c in self._keep[4]:
            check_cells(c, self.n_cells)


class KernelStep:
    """One step's glue, layer by layer (Transformer.hidden's layer loop calls attend, norm,
    post_norm and silu/gelu): every layer's kind, cache index and q/k norms are checked and
    marshalled once a step. The norm, gate and attention outputs are buffers reused by every
    layer: each is consumed by the next matmul before it is rewritten."""

    def __init__(self, kern: Kernels, n_head: int, n_kv: int, head_dim: int,
                 kinds: dict[str, LayerKind], layer_kind: list[tuple[str, int]],
                 norms: list[tuple[torch.Tensor | None, torch.Tensor | None]],
                 x: torch.Tensor, eps: float, n_ff: int, scale: float | None = None,
                 checked: dict[tuple[int, int], torch.Tensor] | None = None) -> None:
        """`scale`: q.k's softmax scale (None: 1 / sqrt(head_dim)). `checked`: norm weights
        already checked (by id and length), shared by the steps of one model so that its
        weights are checked once, not every step."""
        c = bind(kern.lib)
        self._step, self._post = c.attn_step_win_bf16, c.post_norm_add_bf16
        self._gelu = c.gelu_mul_bf16
        self._checked = {} if checked is None else checked
        if kern.checks:  # the check mode: every index the step reads through, before any call
            for kind in kinds.values():
                kind.check_cells()
        self._silu, self._norm = kern._silu, kern._norm
        d = head_dim
        if not (n_head % n_kv == 0 and x.dtype == torch.float32 and x.is_contiguous()):
            raise ValueError("step: bad heads or residual rows")
        self.n_tok, self.n_embd, self.n_ff, self.eps = x.shape[0], x.shape[1], n_ff, eps
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.g, self.d, self.n_kv = n_head // n_kv, d, n_kv
        self.width, self.row = n_head * d, (n_head + 2 * n_kv) * d
        self.kinds, self.x = kinds, x
        for name, ci in layer_kind:
            if name not in STATE_KINDS and not 0 <= ci < kinds[name].n_layer:
                raise ValueError(f"step: layer {ci} outside the {name} cache")
        for kd in kinds.values():
            if (kd.n_kv, kd.d, kd.n_tok) != (n_kv, d, x.shape[0]):
                raise ValueError("step: a cache's heads or a kind's tokens do not match")
        # a short-convolution or DeltaNet layer (short_conv.py, delta_net.py) attends nothing
        self.layers = [None if name in STATE_KINDS else
                       (kinds[name], ci, self._weight(qn, d), self._weight(kn, d))
                       for (name, ci), (qn, kn) in zip(layer_kind, norms)]
        longest = max(kd.longest for kd in kinds.values())
        self.work = kern._scratch(longest, self.n_tok, n_kv, self.g, d)
        self.h = torch.empty(self.n_tok, self.n_embd, dtype=torch.bfloat16)
        self.act = torch.empty(self.n_tok, n_ff, dtype=torch.bfloat16)
        self.out = torch.empty(self.n_tok, self.width, dtype=torch.bfloat16)

    def attend(self, layer: int, qkv: torch.Tensor, sinks: torch.Tensor | None = None
               ) -> torch.Tensor:
        """qkv [T, (n_head + 2 n_head_kv) d] bf16, layer `layer`'s fused projections -> its
        attention outputs [T, n_head d]; q/k normed, rotated, K/V stored on the way. `sinks`:
        the layer's f32 [n_head] attention sinks (None: none)."""
        if not (qkv.dtype == torch.bfloat16 and qkv.is_contiguous()
                and qkv.shape == (self.n_tok, self.row)):
            raise ValueError("step: bad qkv rows")
        if not 0 <= layer < len(self.layers):
            raise ValueError(f"step: no layer {layer}")
        entry = self.layers[layer]
        if entry is None:
            raise ValueError(f"step: layer {layer} is a short convolution")
        kd, ci, qn, kn = entry
        rc = self._step(qkv.data_ptr(), *kd.rope, kd.k0 + ci * kd.k_layer,
                        kd.v0 + ci * kd.v_layer, *kd.seqs, qn, kn,
                        self.eps, self.n_kv, self.g, self.d, self.scale,
                        self._weight(sinks, self.g * self.n_kv), self.out.data_ptr(),
                        self.work.data_ptr(), self.work.numel())
        if rc != 0:
            raise ValueError(f"step attention kernel refused the shape (rc {rc})")
        return self.out

    def _weight(self, w: torch.Tensor | None, n: int) -> int | None:
        """A norm weight's pointer (None for none): contiguous f32 [n], checked once."""
        if w is None:
            return None
        if self._checked.get((id(w), n)) is not w:
            _f32_vec(w, n)
            self._checked[(id(w), n)] = w  # kept: its id cannot be reused while it is here
        return w.data_ptr()

    def _rows(self, x: torch.Tensor, y: torch.Tensor | None) -> int | None:
        """y's pointer (None for none), checked: bf16 rows of the residual's shape."""
        if x is not self.x:
            raise ValueError("step: not this step's residual")
        if y is None:
            return None
        if not (y.dtype == torch.bfloat16 and y.is_contiguous() and y.shape == self.x.shape):
            raise ValueError("step: not bf16 rows of the residual's shape")
        return y.data_ptr()

    def norm(self, x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor) -> torch.Tensor:
        """Transformer.norm for this step's residual rows, into the step's reused buffer."""
        self._norm(x.data_ptr(), self.n_embd, self._rows(x, y), self._weight(w, self.n_embd),
                   self.n_tok, self.n_embd, self.eps, self.h.data_ptr())
        return self.h

    def post_norm(self, x: torch.Tensor, y: torch.Tensor, wp: torch.Tensor,
                  wn: torch.Tensor | None) -> torch.Tensor | None:
        """Transformer.post_norm for this step's residual rows, into the reused buffer."""
        if y is None:
            raise ValueError("step: post_norm needs the rows to add")
        self._post(x.data_ptr(), self.n_embd, self._rows(x, y), self._weight(wp, self.n_embd),
                   self._weight(wn, self.n_embd), self.n_tok, self.n_embd, self.eps,
                   self.h.data_ptr())
        return None if wn is None else self.h

    def _gate(self, gu: torch.Tensor) -> None:
        if not (gu.dtype == torch.bfloat16 and gu.is_contiguous()
                and gu.shape == (self.n_tok, 2 * self.n_ff)):
            raise ValueError("step: bad [gate | up] rows")

    def silu(self, gu: torch.Tensor) -> torch.Tensor:
        self._gate(gu)
        self._silu(gu.data_ptr(), self.n_tok, self.n_ff, self.act.data_ptr())
        return self.act

    def gelu(self, gu: torch.Tensor) -> torch.Tensor:
        self._gate(gu)
        self._gelu(gu.data_ptr(), self.n_tok, self.n_ff, self.act.data_ptr())
        return self.act


def plain_step(kern: Kernels, k: torch.Tensor, v: torch.Tensor, n_head: int,
               cells: list[slice | torch.Tensor], dst: list[int], cos: torch.Tensor,
               sin: torch.Tensor, x: torch.Tensor, eps: float, n_ff: int,
               n_new: list[int] | None = None, types: KVTypes | None = None) -> KernelStep:
    """A step of llama's layers (every layer global, no q/k norms) over the pool k, v [n_layer,
    n_head_kv, n_cells, width] of cache types `types` (None: bf16): T new tokens, n_new[i] >= 1
    of them (default 1) for sequence i, its new tokens' cells the last n_new[i] of its cells;
    dst the T new cells, sequence by sequence; cos/sin the tokens' Rope.cos_sin rows; x the f32
    residual rows [T, n_embd]."""
    n_new = [1] * len(cells) if n_new is None else list(n_new)
    kind = LayerKind(k, v, cells, None, 0, dst, n_new, cos.reshape(len(dst), -1),
                     sin.reshape(len(dst), -1), types)
    n_layer = k.shape[0]
    return KernelStep(kern, n_head, k.shape[1], kind.d, {"global": kind},
                      [("global", i) for i in range(n_layer)], [(None, None)] * n_layer, x, eps,
                      n_ff)
