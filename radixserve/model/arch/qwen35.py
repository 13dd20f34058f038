"""Qwen3.5: a hybrid of Gated DeltaNet layers (model/delta_net.py) and gated full-attention
layers, pre-norm blocks with a SwiGLU FFN, as llama.cpp reads `qwen35`; `qwen35moe`
(Qwen3.5-35B-A3B, -122B-A10B) has in every block a mixture of experts instead (model/moe.py:
a softmax router, the top `expert_used_count` renormalized, and a shared expert of
`expert_shared_feed_forward_length` gated by a sigmoid of its own row).

- The layer pattern: `attention.recurrent_layers` (a flag a block) where the file has it, else
  every `full_attention_interval`-th layer (default 4) attends.
- Attention: q/k RMS norms, partial rotary (`rope.dimension_count` of the head's dimensions),
  and an output gate: attn_q holds each head's q rows then its gate rows; the fused projection
  is loaded as [q | k | v | gate], q and k with their dimensions in `rotary_order`. For text
  every position section of Qwen's multimodal RoPE is the token's position, so it is the plain
  half-split rotation over those dimensions (`rope.dimension_sections` is checked, not used).
- Blocks past the trunk (`nextn_predict_layers`: the multi-token-prediction head real files
  carry) are not run and not loaded.
- Every norm weight is stored with Qwen3.5's +1 already added by the converter, except the
  DeltaNet's gated output norm (ssm_norm), so all are plain RMSNorm weights here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from radixserve.model.arch.base import Family, Get
from radixserve.model.hparams import HParams, SsmDims, UnsupportedModelError
from radixserve.model.layers import FFN, DeltaNetMixer, GatedAttention, Mixer
from radixserve.model.rope import rotary_order
from radixserve.model.tensors import TensorLoader


class Qwen35(Family):
    archs = ("qwen35",)
    qk_norm = True
    ffn_norm = "post_attention_norm.weight"

    def n_layer(self, get: Get) -> int:
        n_all = int(get("block_count"))
        n_mtp = int(get("nextn_predict_layers", 0, required=False) or 0)
        if not 0 <= n_mtp < n_all:
            raise UnsupportedModelError(f"{self.archs[0]}.nextn_predict_layers = {n_mtp} of "
                                        f"{n_all} blocks")
        return n_all - n_mtp

    def extra(self, get: Get, n_layer: int, n_embd: int, n_head: int,
              head_dim: int) -> dict[str, Any]:
        a = self.archs[0]
        if int(get("attention.value_length", head_dim, required=False)) != head_dim:
            raise UnsupportedModelError(f"{a}: attention.value_length must equal key_length")
        sections = get("rope.dimension_sections")
        if not isinstance(sections, (list, tuple)) or len(sections) > 4:
            raise UnsupportedModelError(f"{a}.rope.dimension_sections must list up to 4 "
                                        f"sections, got {sections!r}")
        n_rot = int(get("rope.dimension_count", head_dim, required=False))
        if not 0 < n_rot <= head_dim or n_rot % 2 or (head_dim - n_rot) % 2:
            raise UnsupportedModelError(f"{a}.rope.dimension_count {n_rot} does not fit a "
                                        f"{head_dim}-wide head")
        ssm = SsmDims.from_keys(get, a, "Gated DeltaNet")
        flags = get("attention.recurrent_layers", None, required=False)
        if flags is not None:
            if not isinstance(flags, (list, tuple)) or len(flags) < n_layer:
                raise UnsupportedModelError(f"{a}.attention.recurrent_layers must flag "
                                            f"{n_layer} layers, got {flags!r}")
            rec = tuple(bool(f) for f in flags[:n_layer])
        else:
            every = int(get("full_attention_interval", 4, required=False))
            if every < 1:
                raise UnsupportedModelError(f"{a}.full_attention_interval {every} < 1")
            rec = tuple((i + 1) % every != 0 for i in range(n_layer))
        return dict(rec_layers=rec, n_rot=n_rot,
                    ssm=ssm)

    def mixer(self, ld: TensorLoader, hp: HParams, i: int) -> Mixer:
        return self.delta_net(ld, hp, i) if hp.rec_layers[i] else self.gated_attention(ld, hp, i)

    def gated_attention(self, ld: TensorLoader, hp: HParams, i: int) -> GatedAttention:
        p, e, hd = f"blk.{i}.", hp.n_embd, hp.head_dim
        nh, nkv = hp.n_head, hp.n_head_kv
        ld.expect(p + "attn_q.weight", (2 * nh * hd, e))
        ld.expect(p + "attn_k.weight", (nkv * hd, e))
        ld.expect(p + "attn_v.weight", (nkv * hd, e))
        ld.expect(p + "attn_output.weight", (e, nh * hd))
        order = np.array(rotary_order(hd, hp.n_rot))
        q = np.concatenate([h * 2 * hd + order for h in range(nh)])
        gate = np.concatenate([h * 2 * hd + hd + np.arange(hd) for h in range(nh)])
        k = np.concatenate([h * hd + order for h in range(nkv)])
        wqkv = ld.linear([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight",
                          p + "attn_q.weight"], [q, k, None, gate])
        q_norm, k_norm = (ld.norm(p + f"attn_{n}_norm.weight") for n in "qk")
        assert q_norm is not None and k_norm is not None
        return GatedAttention("global", wqkv, ld.linear([p + "attn_output.weight"], [None]),
                              q_norm[order], k_norm[order], (nh + 2 * nkv) * hd)

    def delta_net(self, ld: TensorLoader, hp: HParams, i: int) -> DeltaNetMixer:
        p, e, s = f"blk.{i}.", hp.n_embd, hp.ssm
        assert s is not None
        vd = s.nv * s.dv
        for name, shape in (("attn_qkv.weight", (s.channels, e)), ("attn_gate.weight", (vd, e)),
                            ("ssm_beta.weight", (s.nv, e)), ("ssm_alpha.weight", (s.nv, e)),
                            ("ssm_conv1d.weight", (s.channels, s.conv)),
                            ("ssm_dt.bias", (s.nv,)), ("ssm_a", (s.nv,)),
                            ("ssm_norm.weight", (s.dv,)), ("ssm_out.weight", (e, vd))):
            ld.expect(p + name, shape)
        f32 = [ld.torch(p + n, f32=True) for n in ("ssm_conv1d.weight", "ssm_a", "ssm_dt.bias",
                                                    "ssm_norm.weight")]
        conv, ssm_a, dt_bias, norm = (t.contiguous() for t in f32 if t is not None)
        in_proj = ld.linear([p + n for n in ("attn_qkv.weight", "attn_gate.weight",
                                             "ssm_beta.weight", "ssm_alpha.weight")],
                            [None] * 4)
        return DeltaNetMixer(in_proj, conv, ssm_a, dt_bias, norm,
                             ld.linear([p + "ssm_out.weight"], [None]))


class Qwen35Moe(Qwen35):
    archs = ("qwen35moe",)
    dense_ffn = False

    def extra(self, get: Get, n_layer: int, n_embd: int, n_head: int,
              head_dim: int) -> dict[str, Any]:
        return {**super().extra(get, n_layer, n_embd, n_head, head_dim),
                "moe": self.moe_dims(get, "qwen35moe", width_required=True, shared=True)}

    def ffn(self, ld: TensorLoader, hp: HParams, p: str) -> FFN:
        return self.moe_ffn(ld, hp, p)


FAMILIES = [Qwen35(), Qwen35Moe()]
