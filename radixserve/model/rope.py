"""Rotary position embedding, half-split (NeoX) convention for every architecture.

GGUF `llama` Q/K weights are un-permuted at load (model/weights.py), so one rotation serves
llama, qwen2 and qwen3. The same function re-rotates cached K when positions shift (seq_add):
rotations compose, so rotating by `delta` moves a key from position p to p + delta.

Gemma 3's sliding-window layers rotate with their own base (10000) and no position scaling,
its global layers with the file's base and linear scaling: one Rope each (`base`, `scale`).
YaRN (gpt-oss) mixes each pair's frequency between interpolated and original and scales the
tables by its mscale, as ggml's rope_yarn; a K-shift rotates without that scale (the stored
keys have it already).
"""

from __future__ import annotations

import math

import torch

from radixserve.model.hparams import HParams, YarnDims


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, base: float, beta_fast: float,
                   beta_slow: float) -> tuple[float, float]:
    """The pairs between which YaRN's ramp runs (ggml_rope_yarn_corr_dims: the dims whose
    wavelength makes beta_fast and beta_slow turns in n_ctx_orig positions, floored and
    ceiled, within [0, n_dims - 1])."""
    def dim(rot: float) -> float:
        return n_dims * math.log(n_ctx_orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    return max(0.0, math.floor(dim(beta_fast))), min(n_dims - 1.0, math.ceil(dim(beta_slow)))


def yarn_inv_freq(inv: torch.Tensor, y: YarnDims, n_dims: int, base: float) -> torch.Tensor:
    """inv (f64, a pair each) under YaRN: pair i's frequency is the interpolated inv / factor
    mixed with the original by ramp(i) * ext_factor, ramp 1 below the correction range and 0
    above it (ggml's rope_yarn_ramp)."""
    lo, hi = yarn_corr_dims(n_dims, y.n_ctx_orig, base, y.beta_fast, y.beta_slow)
    i = torch.arange(inv.shape[0], dtype=torch.float64)
    mix = (1 - ((i - lo) / max(0.001, hi - lo)).clamp(0, 1)) * y.ext_factor
    return inv / y.factor * (1 - mix) + inv * mix


def rotary_order(head_dim: int, n_rot: int) -> list[int]:
    """A head's dimensions reordered so partial rotary (the first n_rot dimensions turn, in
    half-split pairs (i, i + n_rot / 2)) becomes the full-width half-split rotation's pairs
    (i, i + head_dim / 2): [rot first half, pass first half, rot second half, pass second
    half]. Applied to q's and k's rows (and their norms) alike, q.k is unchanged."""
    r, p = n_rot // 2, (head_dim - n_rot) // 2
    if n_rot % 2 or (head_dim - n_rot) % 2 or n_rot <= 0:
        raise ValueError(f"rotary dims {n_rot} of a {head_dim}-wide head must be even")
    return (list(range(r)) + list(range(n_rot, n_rot + p)) + list(range(r, n_rot))
            + list(range(n_rot + p, head_dim)))


class Rope:
    def __init__(self, hp: HParams, freq_factors: torch.Tensor | None = None,
                 base: float | None = None, scale: float | None = None,
                 device: torch.device | None = None, yarn: bool = True) -> None:
        """`base` / `scale` default to the model's (global layers'): hp.rope_base and
        hp.rope_scale_linear; `yarn`: the model's YaRN applies (hp.yarn, where it has one);
        the tables are computed on `device` (the model's)."""
        half, rot = hp.head_dim // 2, hp.n_rot // 2
        base = hp.rope_base if base is None else base
        inv = 1.0 / (base ** (torch.arange(0, half, dtype=torch.float64) * 2 / hp.n_rot))
        # partial rotary (n_rot < head_dim): the family ordered each q/k head's dimensions so
        # the rotated pairs are (i, i + head_dim / 2) for i < n_rot / 2 (`rotary_order`); the
        # others turn by angle 0 (cos 1, sin 0: unchanged, exactly)
        inv[0 if hp.nope else rot:] = 0.0  # NoPE: every pair unchanged
        if freq_factors is not None:
            inv = inv / freq_factors.to("cpu", torch.float64)
        # YaRN's magnitude scale, on the rotated pairs only: a pair that does not turn (past
        # n_rot, or NoPE) passes through unscaled, as ggml copies it
        self.mscale: torch.Tensor | None = None
        if yarn and hp.yarn is not None:
            turns = inv != 0
            inv = yarn_inv_freq(inv, hp.yarn, hp.n_rot, base)
            if hp.yarn.mscale != 1.0:
                self.mscale = torch.where(turns, hp.yarn.mscale, 1.0).to(device or "cpu",
                                                                         torch.float32)
        self.inv_freq = inv.to(device or "cpu", torch.float32)
        self.scale = hp.rope_scale_linear if scale is None else scale
        self.half = half

    def cos_sin(self, positions: torch.Tensor, scaled: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables [n, 1, head_dim] for integer positions [n]: (cos, cos) and (-sin, sin), so a
        rotation is x * cos + swap_halves(x) * sin: four ops a call instead of ten. `scaled`:
        times YaRN's mscale (a pure rotation without)."""
        ang = positions.to(torch.float32)[:, None] / self.scale * self.inv_freq[None, :]
        c, s = ang.cos(), ang.sin()
        if scaled and self.mscale is not None:
            c, s = c * self.mscale, s * self.mscale
        return torch.cat((c, c), -1)[:, None], torch.cat((-s, s), -1)[:, None]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [n, heads, head_dim] with `cos_sin` tables; computed in f32, returned as x."""
        xf = x.float()
        swapped = torch.cat((xf[..., self.half :], xf[..., : self.half]), dim=-1)
        return torch.addcmul(xf * cos, swapped, sin).to(x.dtype)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos_sin(positions.to(self.inv_freq.device), scaled=False)
        return self.apply(x, cos, sin)
