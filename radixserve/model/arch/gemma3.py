"""Gemma 3: sliding-window attention layers interleaved with global ones, per-head q/k norms,
each sublayer's output normed before its residual add (post norms), a GeGLU FFN, embeddings
scaled by sqrt(n_embd).

The sliding layers attend over the last `n_swa` positions with their own RoPE base; the
per-layer pattern and the constants llama.cpp fixes in code rather than metadata (local base
10000, pattern 6, the 27B attention scale) are resolved here once (LLM_ARCH_GEMMA3 in
llama-model.cpp; HF's Gemma3TextConfig agrees for the sizes it can load from a GGUF).
"""

from __future__ import annotations

from typing import Any

from radixserve.model.arch.base import Family, Get, swa_pattern
from radixserve.model.hparams import HParams, UnsupportedModelError
from radixserve.model.layers import Block, PostNormBlock
from radixserve.model.tensors import TensorLoader

SWA_PATTERN = 6  # every 6th layer is global
ROPE_BASE_SWA = 10000.0


class Gemma3(Family):
    archs = ("gemma3",)
    qk_norm = True
    act = "gelu_tanh"

    def extra(self, get: Get, n_layer: int, n_embd: int, n_head: int,
              head_dim: int) -> dict[str, Any]:
        cap = float(get("final_logit_softcapping", 0.0, required=False) or 0.0)
        if cap:  # Gemma 3 has none (Gemma 2 had); the output head does not implement it
            raise UnsupportedModelError(f"final logit softcapping ({cap}) is not supported")
        n_swa = int(get("attention.sliding_window", 0, required=False) or 0)
        swa = swa_pattern(get, n_layer, SWA_PATTERN) if n_swa > 0 else (False,) * n_layer
        # gemma_pytorch's query_pre_attn_scalar: n_embd / n_head for the 27B (62 layers), else
        # head_dim (llama.cpp keys the rule on the layer count too)
        scale = (n_embd // n_head) ** -0.5 if n_layer == 62 else head_dim ** -0.5
        return dict(
            n_swa=n_swa if any(swa) else 0,
            swa_layers=swa,
            rope_base_swa=float(get("rope.freq_base_swa", ROPE_BASE_SWA, required=False)),
            embd_scale=float(n_embd) ** 0.5,
            attn_scale=scale,
        )

    def block(self, ld: TensorLoader, hp: HParams, i: int) -> Block:
        # llama.cpp's converter already adds gemma's +1 to its norm weights: plain RMSNorms
        p = f"blk.{i}."
        mixer = self.mixer(ld, hp, i)
        return PostNormBlock(ld.norm(p + "attn_norm.weight"), mixer,
                             ld.norm(p + "ffn_norm.weight"), self.ffn(ld, hp, p),
                             ld.norm(p + "post_attention_norm.weight"),
                             ld.norm(p + "post_ffw_norm.weight"))


FAMILIES = [Gemma3()]
