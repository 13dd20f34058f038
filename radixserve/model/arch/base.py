"""What a model family is: the GGUF `general.architecture` names it reads, its hyperparameters
(with their checks), the tensors it loads and the layer stack it builds from model/layers.py's
pieces. A family module subclasses `Family` and overrides only what its architecture does
differently; the registry (model/arch/__init__.py) finds it by the `FAMILIES` list it exports.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import gguf
import numpy as np

from radixserve.memory.layout import FULL, RECURRENT, SLIDING, MemoryLayout
from radixserve.model.hparams import (
    HParams,
    MoeDims,
    UnsupportedModelError,
    YarnDims,
    field_value,
    int_or_none,
    pooling_name,
)
from radixserve.model.layers import FFN, Attention, Block, DenseFFN, Mixer
from radixserve.model.moe import ExpertMatrices, MoEFFN, Router, SharedExpert
from radixserve.model.tensors import TensorLoader

# llama_expert_gating_func_type's values this engine runs
GATING_FUNCS = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}

# reads `{arch}.key` (default when absent; absent and required: UnsupportedModelError naming it)
Get = Callable[..., Any]


def rope_scaling(get: Get) -> tuple[float, YarnDims | None]:
    """(the linear position scale, YaRN's dims or None) from `rope.scaling.*`, as llama.cpp
    resolves them: linear divides positions by the factor; YaRN's mscale is 1 + 0.1 ln(factor)
    times `rope.scaling.attn_factor` (llama_context replaces the file's yarn_attn_factor
    unless ext_factor is 0; it is 1 by default)."""
    kind = get("rope.scaling.type", "none", required=False)
    factor = float(get("rope.scaling.factor", 1.0, required=False) or 1.0)
    if kind in (None, "none"):
        return 1.0, None
    if kind == "linear":
        return factor, None
    if kind != "yarn":
        raise UnsupportedModelError(f"unsupported rope scaling type {kind!r}")
    if float(get("rope.scaling.yarn_log_multiplier", 0.0, required=False) or 0.0):
        raise UnsupportedModelError("YaRN with rope.scaling.yarn_log_multiplier (DeepSeek's "
                                    "mscale_all_dim) is not supported")
    ext = float(get("rope.scaling.yarn_ext_factor", -1.0, required=False))
    ext = 1.0 if ext < 0 else ext
    n_orig = int(get("rope.scaling.original_context_length", None, required=False)
                 or get("context_length", 2048, required=False))
    mscale = float(get("rope.scaling.attn_factor", 1.0, required=False) or 1.0)
    if ext == 0:
        mscale *= float(get("rope.scaling.yarn_attn_factor", 1.0, required=False))
    elif factor > 1:
        mscale *= 1.0 + 0.1 * math.log(factor)
    return 1.0, YarnDims(factor, n_orig,
                         float(get("rope.scaling.yarn_beta_fast", 32.0, required=False)),
                         float(get("rope.scaling.yarn_beta_slow", 1.0, required=False)),
                         ext, mscale)


def swa_pattern(get: Get, n_layer: int, default: int) -> tuple[bool, ...]:
    """Which layers slide, as llama.cpp's load_swa_pattern: per-layer flags where
    `attention.sliding_window_pattern` is an array (as newer converters write), else its
    number n (the family's `default` when absent): the last layer of every n is global."""
    pattern = get("attention.sliding_window_pattern", default, required=False)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != n_layer:
            raise UnsupportedModelError(f"sliding_window_pattern has {len(pattern)} entries "
                                        f"for {n_layer} layers")
        return tuple(bool(x) for x in pattern)
    n = int(pattern)
    return tuple(n == 0 or il % n < n - 1 for il in range(n_layer))


class Family:
    """The default decoder (llama's): pre-norm blocks of global attention and a SwiGLU FFN."""

    archs: tuple[str, ...] = ()
    # Q/K rows stored permuted for the interleaved rotation (llama.cpp's converter does this to
    # llama's only), un-permuted at load
    permuted_qk = False
    qk_norm = False  # per-head RMS norms of q and k before RoPE are required
    act = "silu"
    output_norm = "output_norm.weight"
    # the FFN's pre-norm (Qwen 3.5's and gpt-oss's is HF's post_attention_layernorm, which
    # gguf-py names post_attention_norm for them)
    ffn_norm = "ffn_norm.weight"
    # every layer's FFN is dense and `feed_forward_length` wide (False: the experts' keys
    # give every width, and a file may omit it, as Qwen3.5 MoE's converter does)
    dense_ffn = True

    # -- hyperparameters ------------------------------------------------------------------

    def hparams(self, reader: gguf.GGUFReader, arch: str) -> HParams:
        """The GGUF's hyperparameters: the keys every family shares, then `extra`'s."""

        def get(key: str, default: Any = None, required: bool = True) -> Any:
            v = field_value(reader, f"{arch}.{key}", default)
            if v is None and required:
                raise UnsupportedModelError(f"GGUF is missing metadata key {arch}.{key}")
            return v

        n_embd = int(get("embedding_length"))
        n_head = int(get("attention.head_count"))
        n_layer = self.n_layer(get)
        n_head_kv, extra = self.kv_heads(arch, get, n_layer, get("attention.head_count_kv",
                                                                  n_head))
        head_dim = int(get("attention.key_length", n_embd // n_head))
        tokens = field_value(reader, "tokenizer.ggml.tokens")
        n_vocab = int(get("vocab_size", len(tokens) if tokens is not None else None))
        scale, yarn = rope_scaling(get)
        extra.update(self.extra(get, n_layer, n_embd, n_head, head_dim))
        return HParams(
            arch=arch,
            n_layer=n_layer,
            n_embd=n_embd,
            n_ff=int(get("feed_forward_length", 0, required=self.dense_ffn)),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_vocab=n_vocab,
            n_ctx_train=int(get("context_length", 2048, required=False)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5, required=False)),
            rope_base=float(get("rope.freq_base", 10000.0, required=False)),
            rope_neox=True,
            rope_scale_linear=scale,
            yarn=yarn,
            name=str(field_value(reader, "general.name", arch)),
            file_type=int_or_none(field_value(reader, "general.file_type")),
            pooling=pooling_name(get("pooling_type", None, required=False)),
            act=self.act,
            **extra,
        )

    def n_layer(self, get: Get) -> int:
        """The layers the forward runs (a file's extra blocks, such as Qwen3.5's multi-token
        prediction, excluded by the family)."""
        return int(get("block_count"))

    def kv_heads(self, arch: str, get: Get, n_layer: int, raw: Any) -> tuple[int, dict[str, Any]]:
        """The KV head count from `attention.head_count_kv`, and any fields the family reads
        from it (LFM2's layer pattern). One count for every layer here."""
        if isinstance(raw, (list, tuple)):
            raise UnsupportedModelError(f"{arch}.attention.head_count_kv: a per-layer array "
                                        f"is not supported for {arch}")
        return int(raw), {}

    def extra(self, get: Get, n_layer: int, n_embd: int, n_head: int,
              head_dim: int) -> dict[str, Any]:
        """The family's own HParams fields (sliding windows, scales, state sizes)."""
        return {}

    # -- memory ---------------------------------------------------------------------------

    def memory_layout(self, hp: HParams) -> MemoryLayout:
        """What each layer keeps of a sequence (memory/layout.py's contract; the pool is built
        from it): attention's K/V rows, over every position or, for a sliding layer, the last
        n_swa; a recurrent layer (Gated DeltaNet, Mamba2) its state (its conv's last rows and a
        [dk, dv] matrix a head), kept whole a sequence."""
        kinds = tuple(RECURRENT if r else SLIDING if s else FULL
                      for r, s in zip(hp.rec_layers, hp.swa_layers))
        return MemoryLayout(hp.n_head_kv, hp.head_dim, kinds,
                            n_swa=hp.n_swa if SLIDING in kinds else 0,
                            state_width=hp.ssm.cell_width if hp.ssm is not None else 0)

    # -- tensors and layers ---------------------------------------------------------------

    def layers(self, ld: TensorLoader, hp: HParams) -> list[Block]:
        out = []
        for i in range(hp.n_layer):
            out.append(self.block(ld, hp, i))
            ld.release()  # a layer's pages of the file, once its weights are held
        return out

    def block(self, ld: TensorLoader, hp: HParams, i: int) -> Block:
        p = f"blk.{i}."
        mixer = self.mixer(ld, hp, i)  # first: its checks name a malformed file's tensor
        return Block(ld.norm(p + "attn_norm.weight"), mixer, ld.norm(p + self.ffn_norm),
                     self.ffn(ld, hp, p))

    def mixer(self, ld: TensorLoader, hp: HParams, i: int) -> Mixer:
        return self.attention(ld, hp, i)

    def attention(self, ld: TensorLoader, hp: HParams, i: int) -> Attention:
        """Layer i's attention: q/k/v fused (with their biases when the file has all three:
        qwen2's), the output projection (with its bias where the file has one), the q/k norms
        where the family has them."""
        p = f"blk.{i}."
        biases = [ld.array(p + f"attn_{n}.bias", required=False) for n in "qkv"]
        if any(b is not None for b in biases) and any(b is None for b in biases):
            raise UnsupportedModelError(f"layer {i}: only some of the q/k/v biases are present")
        perm_q, perm_k = (hp.n_head, hp.n_head_kv) if self.permuted_qk else (None, None)
        wqkv = ld.linear([p + f"attn_{n}.weight" for n in "qkv"], [perm_q, perm_k, None],
                         None if biases[0] is None else biases)
        # the q/k norms: required where the family has them, used wherever a file has them
        q_norm = ld.norm(p + "attn_q_norm.weight", required=self.qk_norm)
        k_norm = ld.norm(p + "attn_k_norm.weight", required=self.qk_norm)
        o_bias = ld.array(p + "attn_output.bias", required=False)  # gpt-oss's
        wo = ld.linear([p + "attn_output.weight"], [None], None if o_bias is None else [o_bias])
        return Attention(hp.layer_kind(i), wqkv, wo, q_norm, k_norm)

    def ffn(self, ld: TensorLoader, hp: HParams, p: str) -> FFN:
        return DenseFFN(ld.linear([p + "ffn_gate.weight", p + "ffn_up.weight"], [None, None]),
                        ld.linear([p + "ffn_down.weight"], [None]), self.act)

    # -- mixture of experts ---------------------------------------------------------------

    def moe_dims(self, get: Get, arch: str, gating: str | None = "softmax",
                 norm_w: bool = True, n_dense_lead: int = 0, width_required: bool = False,
                 shared: bool = False) -> MoeDims:
        """The experts' sizes from `{arch}.expert_*` (the expert width, unless
        `width_required`, defaults to feed_forward_length / expert_used_count, as llama.cpp's);
        `gating` and `norm_w` where the family fixes them in code, as llama.cpp does (gating
        None: the file's `expert_gating_func`, required); `shared`: a shared expert of
        `expert_shared_feed_forward_length` (default feed_forward_length). No weight scale:
        llama.cpp reads none for these families."""
        n_expert, n_used = int(get("expert_count")), int(get("expert_used_count"))
        n_ff = get("expert_feed_forward_length", None, required=width_required)
        if n_ff is None:
            n_ff = int(get("feed_forward_length")) // max(1, n_used)
        n_shared = 0
        if shared:
            n_shared = int(get("expert_shared_feed_forward_length", None, required=False)
                           or get("feed_forward_length"))
        scale = 0.0
        if gating is None:
            code = int(get("expert_gating_func"))
            if code not in GATING_FUNCS:
                raise UnsupportedModelError(f"{arch}.expert_gating_func {code} is not supported "
                                            f"(supported: {sorted(GATING_FUNCS)})")
            gating = GATING_FUNCS[code]
        return MoeDims(n_expert, n_used, int(n_ff), gating, norm_w, scale, n_dense_lead,
                       n_shared)

    def moe_ffn(self, ld: TensorLoader, hp: HParams, p: str, select_bias: bool = False,
                biases: bool = False, act: str = "silu") -> MoEFFN:
        """The router (ffn_gate_inp) and each expert's SwiGLU from ffn_{gate,up,down}_exps
        (gate and up fused an expert), shapes checked against the metadata; `select_bias`:
        the router's selection bias (exp_probs_b.bias), required; `biases`: the router's and
        every expert matrix's biases (gpt-oss's `.bias` of each), required; `act`: the
        experts' gate (MoEFFN's)."""
        m, e = hp.moe, hp.n_embd
        assert m is not None
        ld.expect(p + "ffn_gate_inp.weight", (m.n_expert, e))
        bias = None
        if select_bias:
            ld.expect(p + "exp_probs_b.bias", (m.n_expert,))
            bias = ld.torch(p + "exp_probs_b.bias", f32=True)

        def role(names: list[str], shape: tuple[int, int]) -> ExpertMatrices:
            b = None
            if biases:
                b = [p + n.removesuffix(".weight") + ".bias" for n in names]
                for n in b:
                    ld.expect(n, (m.n_expert, shape[0]))
            return ExpertMatrices(ld.experts([p + n for n in names], m.n_expert, shape, b))

        if ld.tensor(p + "ffn_gate_up_exps.weight", required=False) is not None:
            # fused by the converter (its --fuse-gate-up-exps, Granite's always): gate rows first
            gate_up = role(["ffn_gate_up_exps.weight"], (2 * m.n_ff, e))
        else:
            gate_up = role(["ffn_gate_exps.weight", "ffn_up_exps.weight"], (m.n_ff, e))
        down = role(["ffn_down_exps.weight"], (e, m.n_ff))
        router_bias = None
        if biases:
            ld.expect(p + "ffn_gate_inp.bias", (m.n_expert,))
            router_bias = ld.torch(p + "ffn_gate_inp.bias", f32=True)
        # the router's exact dots on the file's rows wherever our kernels run (dequant too)
        router = Router(ld.rows(p + "ffn_gate_inp.weight", blocks=True), router_bias)
        return MoEFFN(router, gate_up, down, m, bias, ld.kern, act,
                      self.shared_expert(ld, hp, p) if m.n_ff_shared else None)

    def shared_expert(self, ld: TensorLoader, hp: HParams, p: str) -> SharedExpert:
        """The shared expert's SwiGLU (ffn_{gate,up,down}_shexp) and its sigmoid gate's row
        (ffn_gate_inp_shexp: [n_embd], or [1, n_embd] as the converter writes HF's)."""
        m, e = hp.moe, hp.n_embd
        assert m is not None
        gate_name = p + "ffn_gate_inp_shexp.weight"
        t = ld.tensor(gate_name)
        assert t is not None
        if int(np.prod(t.shape)) != e:
            ld.expect(gate_name, (1, e))
        for n, shape in (("gate", (m.n_ff_shared, e)), ("up", (m.n_ff_shared, e)),
                         ("down", (e, m.n_ff_shared))):
            ld.expect(p + f"ffn_{n}_shexp.weight", shape)
        gate = ld.torch(gate_name, f32=True)
        assert gate is not None
        return SharedExpert(gate.reshape(1, e).contiguous(),
                            ld.linear([p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight"],
                                      [None, None]),
                            ld.linear([p + "ffn_down_shexp.weight"], [None]))
