"""Model hyper-parameters read from GGUF metadata (`{arch}.*` keys)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gguf

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")


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
    rope_scale_linear: float  # positions are divided by this (1.0 = no scaling)
    name: str

    @property
    def n_group(self) -> int:
        return self.n_head // self.n_head_kv

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
        n_head_kv = int(get("attention.head_count_kv", n_head))
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
        return cls(
            arch=arch,
            n_layer=int(get("block_count")),
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
        )
