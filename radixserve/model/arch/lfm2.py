"""LiquidAI LFM2: a hybrid of gated short-convolution layers and attention layers (with per-head
q/k norms), SwiGLU FFNs everywhere, the final norm stored as `token_embd_norm`. LFM2-MoE
(`lfm2moe`: LFM2-8B-A1B, LFM2-24B-A2B) is the same hybrid with a mixture-of-experts FFN after
the first `leading_dense_block_count` layers (model/moe.py): sigmoid gating as the file's
`expert_gating_func` says, a per-expert bias (exp_probs_b) added for choosing only, the
chosen weights renormalized (llama.cpp always does for this family).

The layer pattern is read as llama.cpp reads it (LLM_ARCH_LFM2): a per-layer
`attention.head_count_kv` array whose 0 entries are the short-convolution layers; the kernel
length from `shortconv.l_cache`. A conv layer keeps a recurrent state (its last l_cache - 1
input rows) instead of K/V rows.
"""

from __future__ import annotations

from typing import Any

from radixserve.memory.layout import CONV, FULL, MemoryLayout
from radixserve.model.arch.base import Family, Get
from radixserve.model.hparams import HParams, UnsupportedModelError
from radixserve.model.layers import FFN, Mixer, ShortConvMixer
from radixserve.model.tensors import TensorLoader


class Lfm2(Family):
    archs = ("lfm2",)
    qk_norm = True
    output_norm = "token_embd_norm.weight"  # llama.cpp's LLM_TENSOR_OUTPUT_NORM_LFM2

    def kv_heads(self, arch: str, get: Get, n_layer: int, raw: Any) -> tuple[int, dict[str, Any]]:
        """Sliding-window attention layers (later LFM2 variants) are refused."""
        if not isinstance(raw, (list, tuple)) or len(raw) != n_layer:
            raise UnsupportedModelError(f"lfm2.attention.head_count_kv must list {n_layer} "
                                        f"layers (0 for a short-convolution layer), got {raw!r}")
        kv = {int(x) for x in raw if int(x) > 0}
        if len(kv) != 1:
            raise UnsupportedModelError("lfm2.attention.head_count_kv: the attention layers "
                                        f"must share one KV head count, got {sorted(kv) or 'none'}")
        if int(get("attention.sliding_window", 0, required=False) or 0) > 0:
            raise UnsupportedModelError("lfm2 with sliding-window attention layers is not "
                                        "supported")
        l_cache = int(get("shortconv.l_cache"))
        if l_cache < 2:
            raise UnsupportedModelError(f"lfm2.shortconv.l_cache must be >= 2, got {l_cache}")
        return kv.pop(), dict(conv_layers=tuple(int(x) == 0 for x in raw), l_cache=l_cache)

    def memory_layout(self, hp: HParams) -> MemoryLayout:
        """The attention layers' K/V rows, and each conv layer's state: its last l_cache - 1
        input rows (n_embd wide; llama.cpp's n_embd_r), kept at every position it was computed
        at so any held prefix resumes."""
        kinds = tuple(CONV if c else FULL for c in hp.conv_layers)
        return MemoryLayout(hp.n_head_kv, hp.head_dim, kinds, conv_rows=hp.l_cache - 1,
                            conv_width=hp.n_embd)

    def mixer(self, ld: TensorLoader, hp: HParams, i: int) -> Mixer:
        if not hp.conv_layers[i]:
            return self.attention(ld, hp, i)
        # the in-projection gives [B | C | x] (3 n_embd rows, in that order); shapes checked
        # against the metadata so a disagreeing file names the tensor
        p, e = f"blk.{i}.shortconv.", hp.n_embd
        ld.expect(p + "in_proj.weight", (3 * e, e))
        ld.expect(p + "conv.weight", (e, hp.l_cache))
        ld.expect(p + "out_proj.weight", (e, e))
        kernel = ld.torch(p + "conv.weight", f32=True)
        assert kernel is not None
        return ShortConvMixer(ld.linear([p + "in_proj.weight"], [None]), kernel,
                              ld.linear([p + "out_proj.weight"], [None]))


class Lfm2Moe(Lfm2):
    archs = ("lfm2moe",)

    def extra(self, get: Get, n_layer: int, n_embd: int, n_head: int,
              head_dim: int) -> dict[str, Any]:
        n_dense = int(get("leading_dense_block_count", 0, required=False) or 0)
        if not 0 <= n_dense <= n_layer:
            raise UnsupportedModelError(f"lfm2moe.leading_dense_block_count {n_dense} of "
                                        f"{n_layer} layers")
        return {"moe": self.moe_dims(get, "lfm2moe", gating=None, n_dense_lead=n_dense,
                                     width_required=True)}

    def ffn(self, ld: TensorLoader, hp: HParams, p: str) -> FFN:
        assert hp.moe is not None
        if int(p.split(".")[1]) < hp.moe.n_dense_lead:
            return super().ffn(ld, hp, p)
        return self.moe_ffn(ld, hp, p, select_bias=True)


FAMILIES = [Lfm2(), Lfm2Moe()]
