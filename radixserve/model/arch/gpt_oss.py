"""gpt-oss (`gpt-oss`: gpt-oss-20b, gpt-oss-120b), as llama.cpp's openai-moe reads it:
- attention with biases on q/k/v and the output, one sink logit a head (`attn_sinks`), sliding
  (window `attention.sliding_window`, 128) and full layers alternating, the sliding ones
  first (llama.cpp's swa pattern 2), YaRN rope scaling on both kinds;
- a mixture-of-experts FFN in every layer, normed by `post_attention_norm`: a router with a
  bias, the top `expert_used_count` logits softmaxed among themselves (no renormalization),
  experts with biases and the clamped SwiGLU (model/moe.py's swiglu_oai), MXFP4 weights in
  the released files (run on tiles of their own 4-bit codes: model/quant.py's MxLinear).
YaRN's correction range is truncated as llama.cpp truncates it (HF follows the released
config's `truncate: false`, which moves 9 of gpt-oss-20b's 32 rotary frequencies).
The harmony chat format its replies come in is text/chat_parse.py's.
"""

from __future__ import annotations

from typing import Any

from radixserve.model.arch.base import Family, Get, swa_pattern
from radixserve.model.hparams import HParams
from radixserve.model.layers import FFN, Attention
from radixserve.model.tensors import TensorLoader

SWA_PATTERN = 2


class GptOss(Family):
    archs = ("gpt-oss",)
    ffn_norm = "post_attention_norm.weight"

    def extra(self, get: Get, n_layer: int, n_embd: int, n_head: int,
              head_dim: int) -> dict[str, Any]:
        return dict(
            n_swa=int(get("attention.sliding_window")),
            swa_layers=swa_pattern(get, n_layer, SWA_PATTERN),
            rope_base_swa=float(get("rope.freq_base_swa", 0.0, required=False) or 0.0),
            rope_swa_scaled=True,
            moe=self.moe_dims(get, "gpt-oss", gating="softmax_weight", norm_w=False,
                              width_required=True),
        )

    def attention(self, ld: TensorLoader, hp: HParams, i: int) -> Attention:
        p = f"blk.{i}."
        ld.expect(p + "attn_sinks.weight", (hp.n_head,))
        ld.expect(p + "attn_output.bias", (hp.n_embd,))  # required here (the base reads it)
        a = super().attention(ld, hp, i)
        a.sinks = ld.torch(p + "attn_sinks.weight", f32=True)
        return a

    def ffn(self, ld: TensorLoader, hp: HParams, p: str) -> FFN:
        return self.moe_ffn(ld, hp, p, biases=True, act="swiglu_oai")


FAMILIES = [GptOss()]
