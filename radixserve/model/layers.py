"""The layer pieces families compose: a decoder block is a norm, a mixer, a norm and an FFN with
their residual adds; the mixer is attention (global or sliding) or a short convolution, the FFN
a gated dense one. A family module (model/arch/) builds each layer from these at load, so the
forward's loop calls layer objects and never branches on the family.

Every piece runs through the step object it is handed (`Run.step`: step.py's KernelStep or
torch_step.py's TorchStep), which owns the step's norms, gates and attention: a piece decides
what runs in which order, the step how it runs, so a token's bits are the same whichever piece
composes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from radixserve.model import mamba2
from radixserve.model.hparams import ACTIVATIONS
from radixserve.model.quant import Linear

if TYPE_CHECKING:
    from radixserve.model.delta_net import DeltaPlan
    from radixserve.model.short_conv import ShortConv
    from radixserve.model.step import KernelStep
    from radixserve.model.torch_step import TorchStep



@dataclass(slots=True)
class Run:
    """What every layer of one forward step shares: the step object, the short-convolution
    plan (None without conv layers), each layer's row in its cache, whether matmuls must
    keep a row's bits independent of the batch (deterministic mode), and the recurrent layers'
    plan (None without such layers)."""

    step: KernelStep | TorchStep
    conv: ShortConv | None
    cache_index: list[int]
    inv: bool
    rec: DeltaPlan | None = None


class Mixer(Protocol):
    """The part of a layer that mixes positions. `kind` names the memory it keeps ("global" and
    "sliding" attention's K/V rows, "conv" a short convolution's input rows, "recurrent" a
    Gated DeltaNet's or Mamba2's state): the family's memory layout groups layers by it."""

    kind: str

    def __call__(self, run: Run, li: int, h: torch.Tensor) -> torch.Tensor: ...

    def matrices(self) -> dict[str, Linear]: ...


@dataclass(slots=True)
class Attention:
    """Self-attention: fused q/k/v projection (biases included where the file has them), the
    per-head q/k RMS norms where the family has them, RoPE, the K/V store and attention (the
    step's, with the layer's sinks where it has them), the output projection. `kind`: "global" or "sliding" (the step knows its window
    and RoPE base by the layer's kind)."""

    kind: str
    wqkv: Linear  # [(n_head + 2 n_head_kv) * head_dim, n_embd]
    wo: Linear
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # f32 [n_head]: a logit a head in its softmax (gpt-oss)

    def __call__(self, run: Run, li: int, h: torch.Tensor) -> torch.Tensor:
        return self.wo(run.step.attend(li, self.wqkv(h, run.inv), self.sinks), run.inv)

    def matrices(self) -> dict[str, Linear]:
        return {"wqkv": self.wqkv, "wo": self.wo}


@dataclass(slots=True)
class ShortConvMixer:
    """LFM2's short convolution (model/short_conv.py): the in-projection to [B | C | x], the
    depthwise causal convolution over the pool's input rows, the out-projection. Its matrices
    are reported in the attention's roles (the mixer's in- and out-projection)."""

    in_proj: Linear  # [3 n_embd, n_embd]
    kernel: torch.Tensor  # [n_embd, l_cache] f32
    out_proj: Linear
    kind: str = "conv"

    def __call__(self, run: Run, li: int, h: torch.Tensor) -> torch.Tensor:
        assert run.conv is not None
        mixed = run.conv.run(run.cache_index[li], self.kernel, self.in_proj(h, run.inv))
        return self.out_proj(mixed, run.inv)

    def matrices(self) -> dict[str, Linear]:
        return {"wqkv": self.in_proj, "wo": self.out_proj}


@dataclass(slots=True)
class GatedAttention:
    """Qwen3.5's full attention: Attention with a per-head output gate, out * sigmoid(gate)
    before the output projection. The gate's rows follow q/k/v in the fused projection
    (`qkv_rows` of them are attention's)."""

    kind: str
    wqkv: Linear  # [q | k | v | gate] rows
    wo: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv_rows: int

    def __call__(self, run: Run, li: int, h: torch.Tensor) -> torch.Tensor:
        y = self.wqkv(h, run.inv)
        a = run.step.attend(li, y[:, :self.qkv_rows].contiguous())
        gated = a.float() * torch.sigmoid(y[:, self.qkv_rows:].float())
        return self.wo(gated.to(a.dtype), run.inv)

    def matrices(self) -> dict[str, Linear]:
        return {"wqkv": self.wqkv, "wo": self.wo}


@dataclass(slots=True)
class DeltaNetMixer:
    """Qwen3.5's Gated DeltaNet (model/delta_net.py): the fused in-projection to [q k v | z |
    beta | alpha], the conv and the delta rule over the pool's state cells, the gated norm,
    the out-projection (reported in the attention's roles, as the short convolution's)."""

    in_proj: Linear
    conv: torch.Tensor  # [channels, K] f32
    ssm_a: torch.Tensor  # [nv] f32, -exp(A_log)
    dt_bias: torch.Tensor  # [nv] f32
    norm: torch.Tensor  # [dv] f32
    out_proj: Linear
    kind: str = "recurrent"

    def __call__(self, run: Run, li: int, h: torch.Tensor) -> torch.Tensor:
        assert run.rec is not None
        return self.out_proj(run.rec.run(run.cache_index[li], self, self.in_proj(h, run.inv)),
                             run.inv)

    def matrices(self) -> dict[str, Linear]:
        return {"wqkv": self.in_proj, "wo": self.out_proj}


@dataclass(slots=True)
class Mamba2Mixer:
    """Granite 4.0-H's Mamba2 layer (model/mamba2.py): the in-projection to [z | x B C | dt],
    the conv and the selective scan over the pool's state cells, the gated group norm, the
    out-projection (reported in the attention's roles, as the other recurrent mixers')."""

    in_proj: Linear
    conv: torch.Tensor  # [channels, K] f32
    conv_bias: torch.Tensor | None  # [channels] f32
    ssm_a: torch.Tensor  # [nh] f32, -exp(A_log)
    dt_bias: torch.Tensor  # [nh] f32
    ssm_d: torch.Tensor  # [nh] f32, the skip's weight
    norm: torch.Tensor  # [nh * hd] f32
    out_proj: Linear
    kind: str = "recurrent"

    def __call__(self, run: Run, li: int, h: torch.Tensor) -> torch.Tensor:
        assert run.rec is not None
        y = mamba2.run(run.rec, run.cache_index[li], self, self.in_proj(h, run.inv))
        return self.out_proj(y, run.inv)

    def matrices(self) -> dict[str, Linear]:
        return {"wqkv": self.in_proj, "wo": self.out_proj}


class FFN(Protocol):
    """A block's feed-forward part: a dense gated FFN, or a mixture of experts (moe.py)."""

    def __call__(self, run: Run, h: torch.Tensor) -> torch.Tensor: ...

    def matrices(self) -> dict[str, Linear]: ...


@dataclass(slots=True)
class DenseFFN:
    """act(gate) * up, then down: the fused [gate | up] matrix (one larger matmul beats two on
    CPU) and the step's gate (SwiGLU or GeGLU)."""

    w_gate_up: Linear  # [2 * n_ff, n_embd]
    w_down: Linear
    act: str = "silu"

    def __post_init__(self) -> None:
        if self.act not in ACTIVATIONS:
            raise ValueError(f"unknown FFN activation {self.act!r}")

    def __call__(self, run: Run, h: torch.Tensor) -> torch.Tensor:
        gu = self.w_gate_up(h, run.inv)
        gated = run.step.silu(gu) if self.act == "silu" else run.step.gelu(gu)
        return self.w_down(gated, run.inv)

    def matrices(self) -> dict[str, Linear]:
        return {"w_gate_up": self.w_gate_up, "w_down": self.w_down}


@dataclass(slots=True)
class Block:
    """A pre-norm decoder layer (llama, qwen, LFM2): x += mixer(norm(x)); x += ffn(norm(x)).
    Each residual add is fused into the next norm, the next layer's included: `__call__` takes
    this layer's normed input and returns the next layer's (None after the last layer)."""

    attn_norm: torch.Tensor
    mixer: Mixer
    ffn_norm: torch.Tensor
    ffn: FFN

    def __call__(self, run: Run, li: int, x: torch.Tensor, h: torch.Tensor,
                 nxt: torch.Tensor | None) -> torch.Tensor | None:
        h = run.step.norm(x, self.mixer(run, li, h), self.ffn_norm)
        add = self.ffn(run, h)
        if nxt is None:
            x.add_(add)
            return None
        return run.step.norm(x, add, nxt)

    def matrices(self) -> dict[str, Linear]:
        return {**self.mixer.matrices(), **self.ffn.matrices()}


@dataclass(slots=True)
class ScaledBlock(Block):
    """Granite's pre-norm block: each sublayer's output times `residual_scale` before its
    residual add (HF's residual_multiplier), both in f32 as HF's, so the add is not fused
    into the next norm (one more pass over the residual rows)."""

    residual_scale: float = 1.0

    def __call__(self, run: Run, li: int, x: torch.Tensor, h: torch.Tensor,
                 nxt: torch.Tensor | None) -> torch.Tensor | None:
        r = self.residual_scale
        x.add_(self.mixer(run, li, h).float().mul_(r))
        x.add_(self.ffn(run, run.step.norm(x, None, self.ffn_norm)).float().mul_(r))
        return None if nxt is None else run.step.norm(x, None, nxt)


@dataclass(slots=True)
class PostNormBlock(Block):
    """Gemma's sandwich: each sublayer's output RMS-normed (in f32) before its residual add."""

    post_attn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None

    def __call__(self, run: Run, li: int, x: torch.Tensor, h: torch.Tensor,
                 nxt: torch.Tensor | None) -> torch.Tensor | None:
        assert self.post_attn_norm is not None and self.post_ffn_norm is not None
        hn = run.step.post_norm(x, self.mixer(run, li, h), self.post_attn_norm, self.ffn_norm)
        assert hn is not None
        return run.step.post_norm(x, self.ffn(run, hn), self.post_ffn_norm, nxt)
