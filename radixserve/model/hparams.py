"""Model hyper-parameters read from GGUF metadata (`{arch}.*` keys).

Gemma 3 interleaves sliding-window layers (local attention over the last `n_swa` positions,
their own RoPE base) with global ones; the per-layer pattern and the constants llama.cpp fixes
in code rather than metadata (local base 10000, pattern 6, the 27B attention scale) are
resolved here once, so the forward and the KV pools only read fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import gguf

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "lfm2")

# llama.cpp hard-codes these for gemma3 (llama-model.cpp, LLM_ARCH_GEMMA3)
GEMMA3_SWA_PATTERN = 6  # every 6th layer is global
GEMMA3_ROPE_BASE_SWA = 10000.0


class UnsupportedModelError(ValueError):
    """The GGUF describes a model this engine cannot run (architecture, tensor, rope type)."""


def field_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


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

    def __post_init__(self) -> None:
        """Fill the defaults that depend on other fields, so hand-built HParams (tests) of
        full-attention models need not spell them out."""
        if not self.swa_layers:
            object.__setattr__(self, "swa_layers", (False,) * self.n_layer)
        if not any(self.conv_layers):  # also after dataclasses.replace changed n_layer
            object.__setattr__(self, "conv_layers", (False,) * self.n_layer)
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
        if self.act not in ("silu", "gelu_tanh"):
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
        return self.n_layer - self.n_layer_swa - self.n_layer_conv

    @property
    def n_layer_conv(self) -> int:
        """Short-convolution layers (a recurrent state a sequence instead of K/V rows)."""
        return sum(self.conv_layers)

    @property
    def recurrent(self) -> bool:
        """Some layers keep a recurrent state: a sequence's memory exists only at positions
        it was computed at (no context shift, no --cache-reuse chunk shifting)."""
        return self.n_layer_conv > 0

    def layer_kind(self, li: int) -> str:
        """"global", "sliding" or "conv"."""
        return "conv" if self.conv_layers[li] else "sliding" if self.swa_layers[li] else "global"

    def cache_index(self, li: int, split: bool = True) -> int:
        """Layer `li`'s row in its cache: among the layers of its kind when the sliding layers
        have a cache of their own (`split`), else among the attention layers (the conv layers'
        rows are always apart)."""
        kind = self.layer_kind(li)
        if split or kind == "conv":
            return sum(1 for j in range(li) if self.layer_kind(j) == kind)
        return sum(1 for j in range(li) if self.layer_kind(j) != "conv")

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> HParams:
        arch = field_value(reader, "general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(
                f"unsupported model architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})"
            )

        def get(key: str, default: Any = None, required: bool = True) -> Any:
            v = field_value(reader, f"{arch}.{key}", default)
            if v is None and required:
                raise UnsupportedModelError(f"GGUF is missing metadata key {arch}.{key}")
            return v

        n_embd = int(get("embedding_length"))
        n_head = int(get("attention.head_count"))
        n_layer = int(get("block_count"))
        extra: dict[str, Any] = {}
        n_head_kv_raw = get("attention.head_count_kv", n_head)
        if arch == "lfm2":
            extra = _lfm2(get, n_layer, n_head_kv_raw)
            n_head_kv = extra.pop("n_head_kv")
        elif isinstance(n_head_kv_raw, (list, tuple)):
            raise UnsupportedModelError(f"{arch}.attention.head_count_kv: a per-layer array "
                                        f"is not supported for {arch}")
        else:
            n_head_kv = int(n_head_kv_raw)
        head_dim = int(get("attention.key_length", n_embd // n_head))
        tokens = field_value(reader, "tokenizer.ggml.tokens")
        n_vocab = int(get("vocab_size", len(tokens) if tokens is not None else None))
        scaling_type = get("rope.scaling.type", "none", required=False)
        factor = float(get("rope.scaling.factor", 1.0, required=False) or 1.0)
        if scaling_type in (None, "none"):
            scale = 1.0
        elif scaling_type == "linear":
            scale = factor
        else:
            raise UnsupportedModelError(f"unsupported rope scaling type {scaling_type!r}")
        if arch == "gemma3":
            extra = _gemma3(get, n_layer, n_embd, n_head, head_dim)
        return cls(
            arch=arch,
            n_layer=n_layer,
            n_embd=n_embd,
            n_ff=int(get("feed_forward_length")),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_vocab=n_vocab,
            n_ctx_train=int(get("context_length", 2048, required=False)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5, required=False)),
            rope_base=float(get("rope.freq_base", 10000.0, required=False)),
            rope_neox=True,
            rope_scale_linear=scale,
            name=str(field_value(reader, "general.name", arch)),
            file_type=_int_or_none(field_value(reader, "general.file_type")),
            pooling=_pooling(get("pooling_type", None, required=False)),
            **extra,
        )


# llama_pooling_type's values (llama.h), -1 being "unspecified"
POOLING_TYPES = {-1: "", 0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


def _pooling(v: Any) -> str:
    """The pooling's name; a value llama.cpp does not know is kept as such (it matters only to
    a server started with --embeddings, which refuses it)."""
    if v is None:
        return ""
    return POOLING_TYPES.get(_int_or_none(v), f"pooling_type {v!r}")


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _lfm2(get: Callable[..., Any], n_layer: int, head_count_kv: Any) -> dict[str, Any]:
    """LFM2's layer pattern as llama.cpp reads it (LLM_ARCH_LFM2): a per-layer head_count_kv
    array whose 0 entries are the short-convolution layers; the kernel length from
    `shortconv.l_cache`. Sliding-window attention layers (later LFM2 variants) are refused."""
    if not isinstance(head_count_kv, (list, tuple)) or len(head_count_kv) != n_layer:
        raise UnsupportedModelError(f"lfm2.attention.head_count_kv must list {n_layer} layers "
                                    f"(0 for a short-convolution layer), got {head_count_kv!r}")
    kv = {int(x) for x in head_count_kv if int(x) > 0}
    if len(kv) != 1:
        raise UnsupportedModelError("lfm2.attention.head_count_kv: the attention layers must "
                                    f"share one KV head count, got {sorted(kv) or 'none'}")
    if int(get("attention.sliding_window", 0, required=False) or 0) > 0:
        raise UnsupportedModelError("lfm2 with sliding-window attention layers is not supported")
    l_cache = int(get("shortconv.l_cache"))
    if l_cache < 2:
        raise UnsupportedModelError(f"lfm2.shortconv.l_cache must be >= 2, got {l_cache}")
    return dict(n_head_kv=kv.pop(), conv_layers=tuple(int(x) == 0 for x in head_count_kv),
                l_cache=l_cache)


def _gemma3(get: Callable[..., Any], n_layer: int, n_embd: int, n_head: int,
            head_dim: int) -> dict[str, Any]:
    """Gemma 3's fields beyond llama's, as llama.cpp resolves them (LLM_ARCH_GEMMA3 in
    llama-model.cpp; HF's Gemma3TextConfig agrees for the sizes it can load from a GGUF)."""
    cap = float(get("final_logit_softcapping", 0.0, required=False) or 0.0)
    if cap:  # Gemma 3 has none (Gemma 2 had); the output head does not implement it
        raise UnsupportedModelError(f"final logit softcapping ({cap}) is not supported")
    n_swa = int(get("attention.sliding_window", 0, required=False) or 0)
    pattern = get("attention.sliding_window_pattern", GEMMA3_SWA_PATTERN, required=False)
    if n_swa <= 0:
        swa: tuple[bool, ...] = (False,) * n_layer
    elif isinstance(pattern, (list, tuple)):  # per-layer flags, as newer converters write
        if len(pattern) != n_layer:
            raise UnsupportedModelError(f"sliding_window_pattern has {len(pattern)} entries "
                                        f"for {n_layer} layers")
        swa = tuple(bool(x) for x in pattern)
    else:  # llama.cpp's set_swa_pattern(n): the last layer of every n is global
        n = int(pattern)
        swa = tuple(n == 0 or il % n < n - 1 for il in range(n_layer))
    # gemma_pytorch's query_pre_attn_scalar: n_embd / n_head for the 27B (62 layers), else
    # head_dim (llama.cpp keys the rule on the layer count too)
    scale = (n_embd // n_head) ** -0.5 if n_layer == 62 else head_dim ** -0.5
    return dict(
        n_swa=n_swa if any(swa) else 0,
        swa_layers=swa,
        rope_base_swa=float(get("rope.freq_base_swa", GEMMA3_ROPE_BASE_SWA, required=False)),
        embd_scale=float(n_embd) ** 0.5,
        act="gelu_tanh",
        attn_scale=scale,
    )
