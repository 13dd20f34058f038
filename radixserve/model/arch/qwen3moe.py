"""Qwen3 MoE (`qwen3moe`: Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B): qwen3's
attention (q/k RMS norms, Q/K rows as HF has them) and a mixture-of-experts FFN in every
layer (model/moe.py): a softmax over all experts, the top `expert_used_count`, their weights
renormalized (llama.cpp always does for this family), SwiGLU experts of
`expert_feed_forward_length`.
"""

from __future__ import annotations

from typing import Any

from radixserve.model.arch.base import Family, Get
from radixserve.model.hparams import HParams
from radixserve.model.layers import FFN
from radixserve.model.tensors import TensorLoader


class Qwen3Moe(Family):
    archs = ("qwen3moe",)
    qk_norm = True

    def extra(self, get: Get, n_layer: int, n_embd: int, n_head: int,
              head_dim: int) -> dict[str, Any]:
        return {"moe": self.moe_dims(get, "qwen3moe")}

    def ffn(self, ld: TensorLoader, hp: HParams, p: str) -> FFN:
        return self.moe_ffn(ld, hp, p)


FAMILIES = [Qwen3Moe()]
