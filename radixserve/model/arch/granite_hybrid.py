"""Granite 4.0-H (dense), as llama.cpp reads `granitehybrid`: a hybrid of Mamba2 layers
(model/mamba2.py) and attention layers, pre-norm blocks with a SwiGLU FFN, and Granite's
multipliers.

- The layer pattern: `attention.head_count_kv` lists every layer, 0 for a Mamba2 layer.
- Attention: llama's (Q/K rows permuted by the converter, un-permuted here), without RoPE when
  `rope.scaling.finetuned` is false (Granite 4.0-H's NoPE; llama.cpp's switch, default on),
  q.k scaled by `attention.scale` (HF's attention_multiplier).
- Multipliers: embeddings times `embedding_scale`, each sublayer's output times
  `residual_scale` before its residual add, logits divided by `logit_scale`.
- Mamba2: `ssm.time_step_rank` heads of `ssm.inner_size / heads`, `ssm.group_count` B/C groups
  of `ssm.state_size`, a conv of `ssm.conv_kernel` with its optional bias; ssm_a is stored as
  -exp(A_log), ssm_norm [groups, inner / groups].
- Mixture-of-experts Granite 4.0-H files (`expert_count` > 0) are refused until expert layers
  land.
"""

from __future__ import annotations

from typing import Any

from radixserve.model.arch.base import Family, Get
from radixserve.model.hparams import HParams, SsmDims, UnsupportedModelError
from radixserve.model.layers import Block, DenseFFN, Mamba2Mixer, Mixer, ScaledBlock
from radixserve.model.tensors import TensorLoader


class GraniteHybrid(Family):
    archs = ("granitehybrid",)
    permuted_qk = True

    def kv_heads(self, arch: str, get: Get, n_layer: int, raw: Any) -> tuple[int, dict[str, Any]]:
        if not isinstance(raw, (list, tuple)) or len(raw) != n_layer:
            raise UnsupportedModelError(f"granitehybrid.attention.head_count_kv must list "
                                        f"{n_layer} layers (0 for a Mamba2 layer), got {raw!r}")
        kv = {int(x) for x in raw if int(x) > 0}
        if len(kv) != 1:
            raise UnsupportedModelError("granitehybrid.attention.head_count_kv: the attention "
                                        "layers must share one KV head count, got "
                                        f"{sorted(kv) or 'no attention layer'}")
        n_expert = int(get("expert_count", 0, required=False) or 0)
        if n_expert > 0:
            raise UnsupportedModelError(f"granitehybrid with {n_expert} experts (Granite 4.0-H "
                                        "mixture-of-experts) needs expert layers, not supported "
                                        "yet")
        rec = tuple(int(x) == 0 for x in raw)
        return kv.pop(), dict(rec_layers=rec)

    def extra(self, get: Get, n_layer: int, n_embd: int, n_head: int,
              head_dim: int) -> dict[str, Any]:
        ssm = SsmDims.from_keys(get, "granitehybrid", "Mamba2")
        nope = not bool(get("rope.scaling.finetuned", True, required=False))
        n_rot = int(get("rope.dimension_count", head_dim, required=False))
        if not nope and n_rot != head_dim:
            raise UnsupportedModelError(f"granitehybrid.rope.dimension_count {n_rot}: RoPE on "
                                        f"part of a {head_dim}-wide head is not supported")

        def scale(key: str, default: float) -> float:
            v = float(get(key, default, required=False) or default)
            if not v > 0:
                raise UnsupportedModelError(f"granitehybrid.{key} must be positive, got {v}")
            return v

        return dict(ssm=ssm,
                    nope=nope,
                    embd_scale=scale("embedding_scale", 1.0),
                    residual_scale=scale("residual_scale", 1.0),
                    attn_scale=scale("attention.scale", head_dim ** -0.5),
                    logit_scale=scale("logit_scale", 1.0))

    def block(self, ld: TensorLoader, hp: HParams, i: int) -> Block:
        p = f"blk.{i}."
        mixer = self.mixer(ld, hp, i)
        for name in ("attn_output.bias", "ffn_gate.bias", "ffn_up.bias", "ffn_down.bias",
                     "ssm_in.bias", "ssm_out.bias"):
            if ld.tensor(p + name, required=False) is not None:
                raise UnsupportedModelError(f"granitehybrid: {p + name} is not supported")
        return ScaledBlock(ld.norm(p + "attn_norm.weight"), mixer, ld.norm(p + "ffn_norm.weight"),
                           self.ffn(ld, hp, p), hp.residual_scale)

    def mixer(self, ld: TensorLoader, hp: HParams, i: int) -> Mixer:
        return self.mamba2(ld, hp, i) if hp.rec_layers[i] else self.attention(ld, hp, i)

    def mamba2(self, ld: TensorLoader, hp: HParams, i: int) -> Mamba2Mixer:
        p, e, s = f"blk.{i}.", hp.n_embd, hp.ssm
        assert s is not None
        vd = s.nv * s.dv
        for name, shape in (("ssm_in.weight", (2 * vd + 2 * s.nk * s.dk + s.nv, e)),
                            ("ssm_conv1d.weight", (s.channels, s.conv)),
                            ("ssm_dt.bias", (s.nv,)), ("ssm_a", (s.nv, 1)), ("ssm_d", (s.nv, 1)),
                            ("ssm_norm.weight", (s.nk, vd // s.nk)), ("ssm_out.weight", (e, vd))):
            ld.expect(p + name, shape)
        if ld.tensor(p + "ssm_conv1d.bias", required=False) is not None:
            ld.expect(p + "ssm_conv1d.bias", (s.channels,))
        f32 = {n: ld.torch(p + n, required=False, f32=True)
               for n in ("ssm_conv1d.weight", "ssm_conv1d.bias", "ssm_a", "ssm_dt.bias",
                         "ssm_d", "ssm_norm.weight")}
        flat = {n: None if t is None else t.reshape(-1).contiguous() for n, t in f32.items()}
        conv = f32["ssm_conv1d.weight"]
        assert conv is not None
        return Mamba2Mixer(ld.linear([p + "ssm_in.weight"], [None]), conv.contiguous(),
                           flat["ssm_conv1d.bias"], flat["ssm_a"], flat["ssm_dt.bias"],
                           flat["ssm_d"], flat["ssm_norm.weight"],
                           ld.linear([p + "ssm_out.weight"], [None]))

    def ffn(self, ld: TensorLoader, hp: HParams, p: str) -> DenseFFN:
        if ld.tensor(p + "ffn_gate_inp.weight", required=False) is not None:
            raise UnsupportedModelError(f"granitehybrid: {p}ffn_gate_inp.weight (an expert "
                                        "router) without expert_count")
        return super().ffn(ld, hp, p)


FAMILIES = [GraniteHybrid()]
