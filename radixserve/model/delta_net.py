"""Qwen3.5's Gated DeltaNet layer over the pool's state cells (memory/pool/recurrent.py).

The layer (HF's Qwen3_5GatedDeltaNet, llama.cpp's qwen35 build_layer_attn_linear): the fused
in-projection gives each token [q | k | v] (the conv's channels), z (the output norm's gate),
beta and alpha; a causal depthwise conv of length K over q/k/v with SiLU; q and k L2-normed
per head (q also scaled by 1/sqrt(dk)); then for each value head h, with S its [dk, dv] state
and q/k head h % nk (llama.cpp's converter stores value heads tiled):

    S *= exp(ssm_a[h] * softplus(alpha + dt_bias[h]));  d = (v - k^T S) * sigmoid(beta)
    S += k d^T;  o = q^T S

and o is RMS-normed per head, scaled by the norm weight and gated by silu(z).

Why one token at a time: a chunked-parallel form (the FLA kernels, transformers' chunked
path) reorders the sums within each chunk, so a token's state bits would depend on where the
chunks fall; the recurrence in token order does the same arithmetic for a token whatever the
step holds (prefill chunk, decode, beside other sequences): cached == uncached, bit for bit.
Its cost is two passes over S a token and head, a few percent of the layer's matmuls.

A step reads each sequence's state from the cell before its first token (zeros at position 0)
and writes the state after its last token into a new cell; the cell read is never written.
With the kernels built and bf16 rows one C call a layer runs it (csrc/delta_net.c), else the
torch ops below (the f32 reference path and tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixserve.model.hparams import HParams, SsmDims
from radixserve.model.kernels import Kernels

if TYPE_CHECKING:
    from radixserve.model.forward import SeqStep
    from radixserve.model.layers import DeltaNetMixer


class DeltaPlan:
    """One step's plan, shared by every recurrent layer (Gated DeltaNet, and Mamba2 in
    mamba2.py): each sequence's token count, the state cell it reads (-1: none, a sequence
    starting at position 0) and the one it writes."""

    def __init__(self, ssm: SsmDims, eps: float, k: torch.Tensor, v: torch.Tensor,
                 n_new: list[int], read: list[int], write: list[int],
                 kern: Kernels | None) -> None:
        self.ssm, self.eps = ssm, eps
        self.k, self.v = k, v  # [n_layer_rec, 1, n_cells, cell_width] f32
        self.n_new, self.read, self.write = n_new, read, write
        self.kern = kern
        dev = k.device
        self.args = tuple(torch.tensor(x, dtype=torch.long, device=dev)
                          for x in (n_new, read, write))

    @classmethod
    def plan(cls, hp: HParams, batch: list[SeqStep], k: torch.Tensor | None,
             v: torch.Tensor | None, kern: Kernels | None = None) -> DeltaPlan:
        """From every step's `.swa` (the state cell it writes, the cells held and their
        positions): the cell at the position before the step's first is the state read."""
        if k is None or v is None or any(b.swa is None for b in batch):
            raise ValueError("a model with recurrent layers needs the pool's state cells and "
                             "every step's .swa")
        assert hp.ssm is not None
        read: list[int] = []
        write: list[int] = []
        for b in batch:
            w = b.swa
            assert w is not None
            if len(w.cells) != 1:
                raise ValueError("a recurrent step writes one state cell a sequence")
            write.append(w.cells[0])
            if b.pos0 == 0:
                read.append(-1)
                continue
            cells = (list(range(w.kv_cells.start or 0, w.kv_cells.stop))
                     if isinstance(w.kv_cells, slice) else w.kv_cells.tolist())
            at = dict(zip(w.kv_positions, cells))
            if b.pos0 - 1 not in at:
                raise ValueError(f"no recurrent state at position {b.pos0 - 1} for a step "
                                 f"from {b.pos0}")
            read.append(at[b.pos0 - 1])
        if max(read + write) >= k.shape[2]:  # the C step trusts every cell
            raise ValueError("a recurrent step names a cell outside the state part")
        return cls(hp.ssm, hp.rms_eps, k, v, [len(b.tokens) for b in batch], read, write,
                   kern)

    def run(self, ci: int, m: DeltaNetMixer, proj: torch.Tensor) -> torch.Tensor:
        """Layer `ci` (its row in the state part) on the in-projection's rows proj [T,
        channels + nv * dv + 2 nv]; returns the gated-normed output [T, nv * dv] in proj's
        dtype."""
        s = self.ssm
        if (self.kern is not None and hasattr(self.kern, "gdn_step")
                and proj.dtype == torch.bfloat16):
            return self.kern.gdn_step(proj.contiguous(), self.k[ci, 0], self.v[ci, 0],
                                      *self.args, m.conv, m.ssm_a, m.dt_bias, m.norm,
                                      s.nk, s.nv, s.dk, s.dv, self.eps)
        out, t0 = [], 0
        for n, r, w in zip(self.n_new, self.read, self.write):
            out.append(self._sequence(ci, m, proj[t0:t0 + n].float(), r, w))
            t0 += n
        return torch.cat(out).to(proj.dtype)

    # -- the torch path: the same arithmetic, token by token (mamba2.py's too) --------------
    def _parts(self, ci: int, cell: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A cell's conv rows, its K half's matrices and its V half's, as flat views."""
        s = self.ssm
        kc, vc = self.k[ci, 0, cell], self.v[ci, 0, cell]
        cs, in_k = (s.conv - 1) * s.channels, s.heads_in_k * s.dk * s.dv
        return kc[:cs], kc[cs:cs + in_k], vc[:(s.nv - s.heads_in_k) * s.dk * s.dv]

    def cell(self, ci: int, cell: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A cell's conv rows [K-1, C] and head matrices [nv, dk, dv] (copies: the matrices
        lie in two halves)."""
        s = self.ssm
        conv, mk, mv = self._parts(ci, cell)
        return conv.view(s.conv - 1, s.channels).clone(), torch.cat([mk, mv]).view(
            s.nv, s.dk, s.dv)

    def store(self, ci: int, cell: int, conv: torch.Tensor, mats: torch.Tensor) -> None:
        dst_conv, mk, mv = self._parts(ci, cell)
        flat = mats.reshape(-1)
        dst_conv.copy_(conv.reshape(-1))
        mk.copy_(flat[:mk.numel()])
        mv.copy_(flat[mk.numel():])

    def _sequence(self, ci: int, m: DeltaNetMixer, x: torch.Tensor, read: int,
                  write: int) -> torch.Tensor:
        s, eps, T = self.ssm, self.eps, x.shape[0]
        C, K, kd = s.channels, s.conv, s.nk * s.dk
        if read >= 0:
            conv, S = self.cell(ci, read)
        else:
            conv = x.new_zeros(K - 1, C)
            S = x.new_zeros(s.nv, s.dk, s.dv)
        xs = torch.cat([conv, x[:, :C]])
        acc = xs[0:T] * m.conv[:, 0]
        for j in range(1, K):
            acc = acc + xs[j:j + T] * m.conv[:, j]
        mixed = F.silu(acc)
        q = mixed[:, :kd].view(T, s.nk, s.dk)
        k = mixed[:, kd:2 * kd].view(T, s.nk, s.dk)
        v = mixed[:, 2 * kd:].view(T, s.nv, s.dv)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps) * (s.dk ** -0.5)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps)
        tiled = torch.arange(s.nv, device=x.device) % s.nk  # value head h reads q/k head h % nk
        q, k = q[:, tiled], k[:, tiled]
        vd = s.nv * s.dv
        z = x[:, C:C + vd].view(T, s.nv, s.dv)
        beta = torch.sigmoid(x[:, C + vd:C + vd + s.nv])
        decay = torch.exp(m.ssm_a * F.softplus(x[:, C + vd + s.nv:] + m.dt_bias))
        o = torch.empty(T, s.nv, s.dv, device=x.device)
        for t in range(T):
            S = S * decay[t][:, None, None]
            kv_mem = (S * k[t][:, :, None]).sum(1)
            delta = (v[t] - kv_mem) * beta[t][:, None]
            S = S + k[t][:, :, None] * delta[:, None, :]
            o[t] = (S * q[t][:, :, None]).sum(1)
        self.store(ci, write, xs[T:], S)
        o = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + eps) * m.norm * F.silu(z)
        return o.reshape(T, vd)
