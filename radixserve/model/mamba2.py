"""A Mamba2 layer (Granite 4.0-H's SSM layers) over the pool's state cells (memory/pool/
recurrent.py), on the same step plan as the Gated DeltaNet (delta_net.py's DeltaPlan).

The layer (HF's GraniteMoeHybridMambaLayer, llama.cpp's build_mamba2_layer): the in-projection
gives each token [z | x | B | C | dt] (x, B and C are the conv's channels: x nh heads of hd,
B and C ng groups of ds); a causal depthwise conv of length K over x/B/C plus its bias, with
SiLU; then for each head h, with S its [ds, hd] state and B/C group h // (nh / ng) (groups
are contiguous runs of heads, unlike the DeltaNet's tiled value heads):

    dt = softplus(dt + dt_bias[h]);  S = S exp(dt A[h]) + B (x dt)^T;  y = S^T C + D[h] x

then y times silu(z), RMS-normed over each group's nh / ng heads together (the norm's group is
wider than a head), scaled by the norm weight. In SsmDims' terms: nk = ng, dk = ds, nv = nh,
dv = hd, so the cell (the conv window and a [dk, dv] matrix a head) is the DeltaNet's.

Why one token at a time: as for the DeltaNet (delta_net.py), a chunked form (SSD's block
decomposition) would make a token's state bits depend on where the chunks fall; the recurrence
in token order gives the same bits whatever the step holds. It is one pass over S a token.
With the kernels built and bf16 rows one C call a layer runs it (csrc/mamba2.c), else the torch
ops below (the f32 reference path and tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from radixserve.model.delta_net import DeltaPlan
    from radixserve.model.layers import Mamba2Mixer


def run(plan: DeltaPlan, ci: int, m: Mamba2Mixer, proj: torch.Tensor) -> torch.Tensor:
    """Layer `ci` (its row in the state part) on the in-projection's rows proj [T, 2 nh hd +
    2 ng ds + nh]; returns the normed output [T, nh hd] in proj's dtype."""
    s = plan.ssm
    kern = plan.kern
    if kern is not None and hasattr(kern, "mamba2_step") and proj.dtype == torch.bfloat16:
        return kern.mamba2_step(proj.contiguous(), plan.k[ci, 0], plan.v[ci, 0], *plan.args,
                                m.conv, m.conv_bias, m.ssm_a, m.dt_bias, m.ssm_d, m.norm,
                                s.nk, s.nv, s.dk, s.dv, plan.eps)
    out, t0 = [], 0
    for n, r, w in zip(plan.n_new, plan.read, plan.write):
        out.append(_sequence(plan, ci, m, proj[t0:t0 + n].float(), r, w))
        t0 += n
    return torch.cat(out).to(proj.dtype)


def _sequence(plan: DeltaPlan, ci: int, m: Mamba2Mixer, x: torch.Tensor, read: int,
              write: int) -> torch.Tensor:
    """One sequence's tokens in f32, the state read from cell `read` (-1: zeros) and left in
    cell `write`."""
    s, T = plan.ssm, x.shape[0]
    ng, nh, ds, hd, K = s.nk, s.nv, s.dk, s.dv, s.conv
    vd, C = nh * hd, s.channels
    if read >= 0:
        conv, S = plan.cell(ci, read)
    else:
        conv = x.new_zeros(K - 1, C)
        S = x.new_zeros(nh, ds, hd)
    xs = torch.cat([conv, x[:, vd:vd + C]])
    acc = xs[0:T] * m.conv[:, 0]
    for j in range(1, K):
        acc = acc + xs[j:j + T] * m.conv[:, j]
    if m.conv_bias is not None:
        acc = acc + m.conv_bias
    mixed = F.silu(acc)
    xh = mixed[:, :vd].view(T, nh, hd)
    group = torch.arange(nh, device=x.device) // (nh // ng)  # head h reads group h // (nh/ng)
    B = mixed[:, vd:vd + ng * ds].view(T, ng, ds)[:, group]
    Cm = mixed[:, vd + ng * ds:].view(T, ng, ds)[:, group]
    dt = F.softplus(x[:, vd + C:] + m.dt_bias)  # [T, nh]
    decay = torch.exp(dt * m.ssm_a)
    y = torch.empty(T, nh, hd, device=x.device)
    for t in range(T):
        S = S * decay[t][:, None, None] + B[t][:, :, None] * (xh[t] * dt[t][:, None])[:, None, :]
        y[t] = (S * Cm[t][:, :, None]).sum(1)
    plan.store(ci, write, xs[T:], S)
    y = (y + m.ssm_d[:, None] * xh) * F.silu(x[:, :vd].view(T, nh, hd))
    g = y.reshape(T, ng, vd // ng)
    g = g * torch.rsqrt((g * g).mean(-1, keepdim=True) + plan.eps)
    return g.reshape(T, vd) * m.norm
