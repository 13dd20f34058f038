"""Model hyper-parameters: what every family's GGUF metadata (`{arch}.*` keys) resolves to.

Each family module (model/arch/) reads its keys and fills these fields, the constants llama.cpp
fixes in code rather than metadata included (Gemma 3's local RoPE base and sliding pattern), so
the forward and the memory layout only read fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gguf

class UnsupportedModelError(ValueError):
    """The GGUF describes a model this engine cannot run (architecture, tensor, rope type)."""


# the gate activations of a dense FFN: SwiGLU's and GeGLU's (tanh-approximated GELU)
ACTIVATIONS = ("silu", "gelu_tanh")


def field_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


@dataclass(slots=True, frozen=True)
class SsmDims:
    """A recurrent layer's sizes (llama.cpp's ssm.* keys). Gated DeltaNet: `nk` q/k heads of
    `dk`, `nv` value heads of `dv` (v-heads stored tiled: head h reads q/k head h % nk), a
    causal conv of kernel length `conv` over the q/k/v channels. Mamba2: `nk` B/C groups of
    the state size `dk`, `nv` heads of `dv` (head h reads group h // (nv / nk)), the conv over
    x/B/C. Either keeps a [dk, dv] matrix a head."""

    nk: int
    nv: int
    dk: int
    dv: int
    conv: int

    @classmethod
    def from_keys(cls, get: Any, arch: str, layer: str) -> SsmDims:
        """From a file's `{arch}.ssm.*` keys (`get` reads one): group_count (nk),
        time_step_rank (nv), state_size (dk), inner_size (nv dv) and conv_kernel; refused,
        naming the keys and the `layer` kind, unless nv is a multiple of nk and inner_size of
        nv, with a kernel of at least 2."""
        nk, nv = int(get("ssm.group_count")), int(get("ssm.time_step_rank"))
        dk, inner, conv = (int(get("ssm.state_size")), int(get("ssm.inner_size")),
                           int(get("ssm.conv_kernel")))
        if nk <= 0 or nv <= 0 or nv % nk or inner % nv or dk <= 0 or conv < 2:
            raise UnsupportedModelError(
                f"{arch}: ssm.group_count {nk}, time_step_rank {nv}, inner_size {inner}, "
                f"state_size {dk}, conv_kernel {conv} do not describe {layer} heads "
                "(time_step_rank a multiple of group_count, inner_size a multiple of "
                "time_step_rank, a kernel of at least 2)")
        return cls(nk=nk, nv=nv, dk=dk, dv=inner // nv, conv=conv)

    @property
    def channels(self) -> int:
        """The conv's channels: q, k and v (Mamba2: B, C and x)."""
        return 2 * self.nk * self.dk + self.nv * self.dv

    @property
    def heads_in_k(self) -> int:
        """Value heads whose matrices a state cell keeps in its K half (the rest in V)."""
        return (self.nv + 1) // 2

    @property
    def cell_width(self) -> int:
        """f32 floats of each half of a state cell: the conv window ((conv - 1) rows of
        `channels`) and heads_in_k matrices in K; the other matrices in V (padded)."""
        return (self.conv - 1) * self.channels + self.heads_in_k * self.dk * self.dv


@dataclass(slots=True, frozen=True)
class YarnDims:
    """YaRN rope scaling (llama.cpp's rope.scaling.* keys, as llama_context resolves them):
    each rotary pair's frequency mixed between interpolated (divided by `factor`) and the
    original by a ramp over the pairs between the correction dims of `beta_fast` and
    `beta_slow` rotations in `n_ctx_orig` positions, times `ext_factor`; cos and sin scaled by
    `mscale`."""

    factor: float
    n_ctx_orig: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    ext_factor: float = 1.0
    mscale: float = 1.0


GATINGS = ("softmax", "sigmoid", "softmax_weight")


@dataclass(slots=True, frozen=True)
class MoeDims:
    """A mixture-of-experts FFN (llama.cpp's expert_* keys): `n_expert` FFNs of width `n_ff`
    a layer, `n_used` of them run a token. `gating`: how the router's logits become weights:
    "softmax" over every expert, "sigmoid" each alone, "softmax_weight" a softmax over the
    chosen experts' logits only; `norm_w`: the chosen weights renormalized to sum 1;
    `w_scale`: they are then scaled by it; the first `n_dense_lead` layers have a dense FFN
    instead; `n_ff_shared`: a shared expert every token runs, gated by a sigmoid (Qwen3.5's)."""

    n_expert: int
    n_used: int
    n_ff: int
    gating: str = "softmax"
    norm_w: bool = True
    w_scale: float = 1.0
    n_dense_lead: int = 0
    n_ff_shared: int = 0  # a shared expert's width, beside the routed ones (0: none)

    def __post_init__(self) -> None:
        if not 0 < self.n_used <= self.n_expert or self.n_ff <= 0 or self.n_ff_shared < 0:
            raise UnsupportedModelError(
                f"expert_count {self.n_expert}, expert_used_count {self.n_used}, "
                f"expert_feed_forward_length {self.n_ff} do not describe experts (1 <= used "
                "<= count, a width > 0)")
        if self.gating not in GATINGS:
            raise UnsupportedModelError(f"expert gating {self.gating!r} is not supported "
                                        f"(supported: {', '.join(GATINGS)})")


@dataclass(slots=True, frozen=True)
class HParams:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_neox: bool  # True: half-split rotation (after un-permuting llama Q/K at load)
    rope_scale_linear: float  # positions are divided by this (1.0 = no scaling; global layers)
    name: str
    n_swa: int = 0  # sliding window in positions (0: every layer attends to the whole context)
    swa_layers: tuple[bool, ...] = ()  # per layer, True = sliding; () = all False
    rope_base_swa: float = 0.0  # RoPE base of the sliding layers (0: rope_base)
    embd_scale: float = 1.0  # token embeddings are multiplied by this (gemma: sqrt(n_embd))
    act: str = "silu"  # gate activation of the FFN: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    attn_scale: float = 0.0  # softmax scale of q.k (0: 1/sqrt(head_dim), what SDPA defaults to)
    # general.file_type (llama_ftype), None when the GGUF does not say: read with the rest at
    # load, since parsing a GGUF again for /props costs seconds (Gemma 3's 262k-token vocabulary)
    file_type: int | None = None
    # `{arch}.pooling_type` (llama_pooling_type): the model's embedding pooling, "" when the
    # GGUF does not say (llama.cpp then pools nothing: per-token embeddings)
    pooling: str = ""
    # LFM2: per layer, True = a short-convolution layer (a recurrent state, no K/V); () = none
    conv_layers: tuple[bool, ...] = ()
    l_cache: int = 0  # the short convolution's kernel length (its state: l_cache - 1 rows)
    # rotary dimensions of a head (0: all of head_dim); fewer rotate the first n_rot only
    n_rot: int = 0
    # Gated DeltaNet (qwen35) or Mamba2 (granitehybrid): per layer, True = a recurrent layer (a
    # state of a conv window and one [dk, dv] matrix a head); () = none
    rec_layers: tuple[bool, ...] = ()
    ssm: SsmDims | None = None  # their dimensions
    nope: bool = False  # attention without positions (no RoPE): Granite 4.0-H's
    residual_scale: float = 1.0  # each sublayer's output times this before its residual add
    logit_scale: float = 1.0  # logits are divided by this (Granite's logits_scaling)
    moe: MoeDims | None = None  # mixture-of-experts FFNs (None: dense ones)
    yarn: YarnDims | None = None  # YaRN rope scaling (None: none, or linear by the field above)
    # the sliding layers' RoPE scaled as the global ones' (gpt-oss); else never (Gemma 3's)
    rope_swa_scaled: bool = False

    def __post_init__(self) -> None:
        """Fill the defaults that depend on other fields, so hand-built HParams (tests) of
        full-attention models need not spell them out."""
        if not self.swa_layers:
            object.__setattr__(self, "swa_layers", (False,) * self.n_layer)
        if not any(self.conv_layers):  # also after dataclasses.replace changed n_layer
            object.__setattr__(self, "conv_layers", (False,) * self.n_layer)
        if not any(self.rec_layers):
            object.__setattr__(self, "rec_layers", (False,) * self.n_layer)
        if len(self.rec_layers) != self.n_layer:
            raise ValueError(f"rec_layers has {len(self.rec_layers)} entries for "
                             f"{self.n_layer} layers")
        if any(self.rec_layers) and self.ssm is None:
            raise ValueError("recurrent layers need their dimensions (ssm)")
        if self.n_rot <= 0:
            object.__setattr__(self, "n_rot", self.head_dim)
        if len(self.conv_layers) != self.n_layer:
            raise ValueError(f"conv_layers has {len(self.conv_layers)} entries for "
                             f"{self.n_layer} layers")
        if any(self.conv_layers) and self.l_cache < 2:
            raise ValueError("short-convolution layers need a kernel length l_cache >= 2")
        if self.rope_base_swa <= 0:
            object.__setattr__(self, "rope_base_swa", self.rope_base)
        if len(self.swa_layers) != self.n_layer:
            raise ValueError(f"swa_layers has {len(self.swa_layers)} entries for "
                             f"{self.n_layer} layers")
        if any(self.swa_layers) and self.n_swa <= 0:
            raise ValueError("sliding layers need a window n_swa > 0")
        if self.act not in ACTIVATIONS:
            raise ValueError(f"unknown FFN activation {self.act!r}")

    @property
    def n_group(self) -> int:
        return self.n_head // self.n_head_kv

    @property
    def n_layer_swa(self) -> int:
        """Layers with sliding-window attention (their K/V may live in a window-sized cache)."""
        return sum(self.swa_layers)

    @property
    def n_layer_full(self) -> int:
        """Layers attending to the whole context."""
        return self.n_layer - self.n_layer_swa - self.n_layer_conv - self.n_layer_rec

    @property
    def n_layer_conv(self) -> int:
        """Short-convolution layers (a recurrent state a sequence instead of K/V rows)."""
        return sum(self.conv_layers)

    @property
    def n_layer_rec(self) -> int:
        """Gated DeltaNet or Mamba2 layers (a recurrent state a sequence, kept whole, no
        rows)."""
        return sum(self.rec_layers)

    @property
    def recurrent(self) -> bool:
        """Some layers keep a recurrent state: a sequence's memory exists only at positions
        it was computed at (no context shift, no --cache-reuse chunk shifting)."""
        return self.n_layer_conv > 0 or self.n_layer_rec > 0

    def layer_kind(self, li: int) -> str:
        """"global", "sliding", "conv" or "recurrent"."""
        if self.rec_layers[li]:
            return "recurrent"
        return "conv" if self.conv_layers[li] else "sliding" if self.swa_layers[li] else "global"

    def cache_index(self, li: int, split: bool = True) -> int:
        """Layer `li`'s row in its cache: among the layers of its kind when the sliding layers
        have a cache of their own (`split`), else among the attention layers (the conv layers'
        rows are always apart)."""
        kind = self.layer_kind(li)
        if split or kind in STATE_KINDS:
            return sum(1 for j in range(li) if self.layer_kind(j) == kind)
        return sum(1 for j in range(li) if self.layer_kind(j) not in STATE_KINDS)


STATE_KINDS = ("conv", "recurrent")  # layers whose memory is a state, apart from K/V rows

# llama_pooling_type's values (llama.h), -1 being "unspecified"
POOLING_TYPES = {-1: "", 0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


def pooling_name(v: Any) -> str:
    """The pooling's name; a value llama.cpp does not know is kept as such (it matters only to
    a server started with --embeddings, which refuses it)."""
    if v is None:
        return ""
    return POOLING_TYPES.get(int_or_none(v), f"pooling_type {v!r}")


def int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None
