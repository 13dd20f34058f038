"""Write small random-weight GGUF models for fast tests (real files, read by the real loader).

The tokenizer metadata is copied from the default model so tokenization and chat templates are
real; only the network is tiny. Some tensors are quantized (Q8_0, Q4_1) so dequantization is
exercised too.

Qwen 3.5 (`qwen35`) files come two ways: random (`write_tiny_gguf(arch="qwen35")`), and from
a transformers Qwen3_5ForCausalLM (`write_qwen35_from_hf`), through the transforms llama.cpp's
converter applies (Qwen3_5TextModel: norms +1, A_log -> -exp, the DeltaNet's value heads
reordered from grouped to tiled, conv kernels squeezed), so that tests/qwen35_hf.py, which
undoes them, can be checked to be their inverse.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np

from radixserve.bench.synth_model import (Shape, add_default_tokenizer, add_qwen35_keys,
                                          check_qwen35, default_tokenizer_fields)

if TYPE_CHECKING:
    import torch
    import transformers


def _random_tensors(w: gguf.GGUFWriter, rng: np.random.Generator, quantize: bool
                    ) -> tuple[Any, Any]:
    """(rand, put): random f32 arrays of a scale, and a writer of them (quantized to `qtype`
    when asked and the rows are whole blocks)."""

    def rand(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def put(name: str, a: np.ndarray, qtype: gguf.GGMLQuantizationType | None = None) -> None:
        if quantize and qtype is not None and a.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a.astype(np.float32))

    return rand, put


def write_tiny_gguf(
    path: str,
    arch: str = "llama",
    n_layer: int | None = None,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_ctx_train: int = 2048,
    seed: int = 0,
    quantize: bool = True,
    tied: bool = True,
    sliding_window: int = 16,
    rename_tokens: dict[int, str] | None = None,
    token_ids: dict[str, int] | None = None,
    add_bos: bool | None = None,
    pooling_type: int | None = None,
    attn_layers: tuple[int, ...] | None = None,
    l_cache: int = 3,
    head_dim: int | None = None,
    n_rot: int | None = None,
    ssm_heads: tuple[int, int] = (2, 4),
    ssm_head_dim: int = 16,
    ssm_conv: int = 4,
    full_attention_interval: int = 4,
    recurrent: tuple[bool, ...] | None = None,
    recurrent_key: bool = True,
    mtp: bool = False,
) -> str:
    """`arch` gemma3: Gemma 3's layer pattern (every 6th layer global, the others sliding over
    `sliding_window` positions), q/k norms and post-norms. `arch` lfm2: LiquidAI LFM2 as
    llama.cpp's converter writes it: `attn_layers` attend (q/k norms, Q/K not permuted), the
    others are short-convolution layers of kernel length `l_cache`; head_count_kv is a per-layer
    array (0: a conv layer) and the final norm is named token_embd_norm. `attn_layers` defaults
    to every third layer from layer 2, (2, 5) at 6 layers, as LFM2's first ones. The vocabulary
    is the default model's, its tokens `rename_tokens` (id -> text) renamed; `token_ids`: extra
    `tokenizer.ggml.*_token_id` keys (GGUF key -> id); `add_bos`: tokenizer.ggml.add_bos_token
    other than the default model's; `pooling_type`: `{arch}.pooling_type` (llama_pooling_type).
    `n_layer`: 2, or 4 for qwen35.

    `arch` qwen35 (Qwen 3.5 dense, as llama.cpp's converter writes it; see write_tiny_qwen35):
    `head_dim` (16) and `n_rot` (8) the attention's, `ssm_heads` the Gated DeltaNet's
    (key heads, value heads), `ssm_head_dim` their size, `ssm_conv` its kernel length; every
    `full_attention_interval`-th layer attends, or the layers whose `recurrent` flag is False;
    `recurrent_key`: the flags written as `qwen35.attention.recurrent_layers` (else only the
    interval says which attend, as in files converted before that key, and `recurrent` must
    agree with it); `mtp`: one MTP block after the trunk."""
    if arch == "qwen35":
        if attn_layers is not None or pooling_type is not None:
            raise ValueError("attn_layers / pooling_type are not qwen35's")
        return write_tiny_qwen35(
            path, n_layer=4 if n_layer is None else n_layer, n_embd=n_embd, n_head=n_head,
            n_head_kv=n_head_kv, n_ff=n_ff, n_ctx_train=n_ctx_train, seed=seed,
            quantize=quantize, tied=tied, rename_tokens=rename_tokens, token_ids=token_ids,
            add_bos=add_bos, head_dim=16 if head_dim is None else head_dim,
            n_rot=8 if n_rot is None else n_rot, ssm_heads=ssm_heads, ssm_head_dim=ssm_head_dim,
            ssm_conv=ssm_conv, full_attention_interval=full_attention_interval,
            recurrent=recurrent, recurrent_key=recurrent_key, mtp=mtp)
    if (head_dim, n_rot, recurrent, mtp) != (None, None, None, False):
        raise ValueError(f"head_dim / n_rot / recurrent / mtp are qwen35's, not {arch}'s")
    n_layer = 2 if n_layer is None else n_layer
    if attn_layers is not None and arch != "lfm2":
        raise ValueError(f"attn_layers is for lfm2, not {arch}")
    if arch == "lfm2" and attn_layers is None:
        attn_layers = tuple(range(2, n_layer, 3)) or (n_layer - 1,)
    attn = set(attn_layers or ())
    if not attn <= set(range(n_layer)):
        raise ValueError(f"attn_layers {attn_layers} outside {n_layer} layers")
    rng = np.random.default_rng(seed)
    n_vocab = len(default_tokenizer_fields()["tokenizer.ggml.tokens"])
    head_dim = n_embd // n_head
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(n_layer)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    if pooling_type is not None:
        w.add_uint32(f"{arch}.pooling_type", pooling_type)
    w.add_head_count(n_head)
    if arch == "lfm2":
        w.add_head_count_kv([n_head_kv if i in attn else 0 for i in range(n_layer)])
        w.add_shortconv_l_cache(l_cache)
    else:
        w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    if arch in ("qwen3", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "gemma3":
        w.add_sliding_window(sliding_window)
    _add_tokenizer(w, rename_tokens, token_ids, add_bos)

    rand, put = _random_tensors(w, rng, quantize)

    q8, q41 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1
    put("token_embd.weight", rand(n_vocab, n_embd, scale=0.5), q8)
    # LFM2's final norm (HF's model.embedding_norm, applied after the last layer) keeps the name
    # its HF name maps to, token_embd_norm
    final_norm = "token_embd_norm.weight" if arch == "lfm2" else "output_norm.weight"
    put(final_norm, 1.0 + rand(n_embd, scale=0.05))
    if not tied:
        put("output.weight", rand(n_vocab, n_embd), q8)
    for i in range(n_layer):
        p = f"blk.{i}."
        put(p + "attn_norm.weight", 1.0 + rand(n_embd, scale=0.05))
        put(p + "ffn_norm.weight", 1.0 + rand(n_embd, scale=0.05))
        if arch == "lfm2" and i not in attn:
            # B, C, x = in_proj(h); out_proj(C * conv(B * x)): a product of three projections,
            # scaled so it is about as large as the residual stream; the kernel stays f32 as
            # the converter keeps it, [n_embd, L] (HF's Conv1d [n_embd, 1, L] squeezed)
            put(p + "shortconv.conv.weight", rand(n_embd, l_cache, scale=0.3))
            put(p + "shortconv.in_proj.weight", rand(3 * n_embd, n_embd, scale=0.15), q41)
            put(p + "shortconv.out_proj.weight", rand(n_embd, n_embd, scale=0.12), q8)
        else:
            put(p + "attn_q.weight", rand(n_head * head_dim, n_embd, scale=0.25), q41)
            put(p + "attn_k.weight", rand(n_head_kv * head_dim, n_embd, scale=0.25), q41)
            put(p + "attn_v.weight", rand(n_head_kv * head_dim, n_embd), q8)
            put(p + "attn_output.weight", rand(n_embd, n_head * head_dim), q8)
        put(p + "ffn_gate.weight", rand(n_ff, n_embd), q41)
        put(p + "ffn_up.weight", rand(n_ff, n_embd), q8)
        put(p + "ffn_down.weight", rand(n_embd, n_ff))
        if arch == "qwen2":
            put(p + "attn_q.bias", rand(n_head * head_dim))
            put(p + "attn_k.bias", rand(n_head_kv * head_dim))
            put(p + "attn_v.bias", rand(n_head_kv * head_dim))
        if arch in ("qwen3", "gemma3") or (arch == "lfm2" and i in attn):
            put(p + "attn_q_norm.weight", 1.0 + rand(head_dim, scale=0.05))
            put(p + "attn_k_norm.weight", 1.0 + rand(head_dim, scale=0.05))
        if arch == "gemma3":
            put(p + "post_attention_norm.weight", 1.0 + rand(n_embd, scale=0.05))
            put(p + "post_ffw_norm.weight", 1.0 + rand(n_embd, scale=0.05))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_tokenizer(w: gguf.GGUFWriter, rename_tokens: dict[int, str] | None,
                   token_ids: dict[str, int] | None, add_bos: bool | None) -> None:
    add_default_tokenizer(w, rename_tokens)
    for key, tid in (token_ids or {}).items():
        w.add_uint32(key, tid)
    if add_bos is not None:
        w.kv_data[0].pop(gguf.Keys.Tokenizer.ADD_BOS, None)  # the default model's value
        w.add_add_bos_token(add_bos)


def write_file(w: gguf.GGUFWriter) -> None:
    """The writer's header, keys and tensors to its file, closed."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def qwen35_sections(n_rot: int) -> tuple[int, int, int, int]:
    """M-RoPE sections covering `n_rot` dims as Qwen 3.5's [11, 11, 10] cover its 64: n_rot / 2
    rotated pairs spread over time, height and width, the first ones one larger."""
    pairs = n_rot // 2
    t, h, w = (pairs // 3 + (i < pairs % 3) for i in range(3))
    return (t, h, w, 0)


def write_tiny_qwen35(
    path: str,
    n_layer: int = 4,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_ctx_train: int = 2048,
    seed: int = 0,
    quantize: bool = True,
    tied: bool = True,
    rename_tokens: dict[int, str] | None = None,
    token_ids: dict[str, int] | None = None,
    add_bos: bool | None = None,
    head_dim: int = 16,
    n_rot: int = 8,
    ssm_heads: tuple[int, int] = (2, 4),
    ssm_head_dim: int = 16,
    ssm_conv: int = 4,
    full_attention_interval: int = 4,
    recurrent: tuple[bool, ...] | None = None,
    recurrent_key: bool = True,
    mtp: bool = False,
    rope_base: float = 10000.0,
) -> str:
    """A random Qwen 3.5 (dense) GGUF at `path` with the keys, tensor names, shapes and types
    llama.cpp's converter gives one (see write_tiny_gguf for the parameters). The stored norms
    are 1 + N(0, 0.05) (the converter stores Qwen's 1 + weight), ssm_norm too (stored as is);
    ssm_a in [-2, -0.2] (-exp(A_log)); ssm_dt.bias 1 + N(0, 0.3). With `quantize`, some
    matrices are Q8_0 / Q4_1 (the rest, the conv kernels and every vector F32)."""
    nk, nv = ssm_heads
    shape = Shape(n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
                  rope_base=rope_base, n_ctx_train=n_ctx_train, arch="qwen35",
                  head_dim=head_dim, rms_eps=1e-6, attn_interval=full_attention_interval,
                  n_rot=n_rot, rope_sections=qwen35_sections(n_rot), ssm_k_heads=nk,
                  ssm_v_heads=nv, ssm_head_dim=ssm_head_dim, ssm_conv=ssm_conv, nextn=int(mtp))
    check_qwen35(shape)
    flags = list(shape.recurrent() if recurrent is None else recurrent)
    if len(flags) != n_layer:
        raise ValueError(f"{len(flags)} recurrent flags for {n_layer} layers")
    if not recurrent_key and flags != shape.recurrent():
        raise ValueError(f"recurrent {flags} without the array key: the interval "
                         f"{full_attention_interval} says {shape.recurrent()}")
    rng = np.random.default_rng(seed)
    n_vocab = len(default_tokenizer_fields()["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(path, "qwen35")
    w.add_name("tiny-qwen35")
    w.add_block_count(n_layer + shape.nextn)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    add_qwen35_keys(w, shape, flags if recurrent_key else None)
    _add_tokenizer(w, rename_tokens, token_ids, add_bos)

    rand, put = _random_tensors(w, rng, quantize)

    def norm(name: str, n: int = n_embd) -> None:
        put(name, 1.0 + rand(n, scale=0.05))

    q8, q41 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1
    d, hd, sd = n_embd, head_dim, ssm_head_dim
    put("token_embd.weight", rand(n_vocab, d, scale=0.5), q8)
    norm("output_norm.weight")
    if not tied:
        put("output.weight", rand(n_vocab, d), q8)
    for i in range(n_layer + shape.nextn):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        norm(p + "post_attention_norm.weight")  # the FFN's pre-norm (ATTN_POST_NORM)
        if i < n_layer and flags[i]:  # Gated DeltaNet
            conv_dim = 2 * nk * sd + nv * sd
            # q and k are L2-normalized per head after the conv; v and the gate z are not
            put(p + "attn_qkv.weight", rand(conv_dim, d, scale=0.15), q41)
            put(p + "attn_gate.weight", rand(nv * sd, d, scale=0.15), q8)
            put(p + "ssm_conv1d.weight", rand(conv_dim, ssm_conv, scale=0.3))
            put(p + "ssm_dt.bias", (1.0 + rand(nv, scale=0.3)))
            put(p + "ssm_a", -rng.uniform(0.2, 2.0, nv).astype(np.float32))
            put(p + "ssm_beta.weight", rand(nv, d, scale=0.15), q8)
            put(p + "ssm_alpha.weight", rand(nv, d, scale=0.15), q8)
            norm(p + "ssm_norm.weight", sd)
            put(p + "ssm_out.weight", rand(d, nv * sd, scale=0.08), q8)
        else:  # gated attention: per head, its hd query rows then its hd gate rows
            put(p + "attn_q.weight", rand(2 * n_head * hd, d, scale=0.25), q41)
            put(p + "attn_k.weight", rand(n_head_kv * hd, d, scale=0.25), q41)
            # v and the output larger than the other arches': sigmoid(gate) halves the heads
            put(p + "attn_v.weight", rand(n_head_kv * hd, d, scale=0.15), q8)
            put(p + "attn_output.weight", rand(d, n_head * hd, scale=0.12), q8)
            norm(p + "attn_q_norm.weight", hd)
            norm(p + "attn_k_norm.weight", hd)
        if i >= n_layer:  # the MTP block's own (a reader of the trunk skips the block)
            put(p + "nextn.eh_proj.weight", rand(d, 2 * d), q8)
            for n in ("enorm", "hnorm", "shared_head_norm"):
                norm(p + f"nextn.{n}.weight")
        put(p + "ffn_gate.weight", rand(n_ff, d), q41)
        put(p + "ffn_up.weight", rand(n_ff, d), q8)
        put(p + "ffn_down.weight", rand(d, n_ff))
    write_file(w)
    return path


# HF Qwen3_5ForCausalLM / MTP checkpoint name -> GGUF name, as gguf-py's tensor_mapping maps
# them for MODEL_ARCH.QWEN35 (post_attention_layernorm is ATTN_POST_NORM there: qwen35 has no
# FFN_NORM)
# qwen3's attention in HF's names -> gguf-py's (Qwen 3.5's full-attention layers, Qwen3 MoE)
HF_ATTENTION = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
QWEN35_HF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
              "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
QWEN35_HF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    **HF_ATTENTION,
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
}
# the MTP head's own tensors (checkpoint mtp.fc, mtp.pre_fc_norm_embedding, ...), renamed by the
# converter (_QwenMtpMixin) to the block after the trunk, then mapped by gguf-py
_HF_MTP = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
           "norm": "shared_head.norm"}
QWEN35_HF_LAYER.update({"eh_proj.weight": "nextn.eh_proj.weight", "enorm.weight": "nextn.enorm.weight",
                  "hnorm.weight": "nextn.hnorm.weight",
                  "shared_head.norm.weight": "nextn.shared_head_norm.weight"})
_HF_TYPES = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0}
_FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
               "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}


def tile_v_heads(a: np.ndarray, axis: int, nk: int, per_k: int, size: int) -> np.ndarray:
    """The converter's _reorder_v_heads: along `axis`, nk * per_k heads of `size` from grouped
    order (key head 0's value heads, then key head 1's, ...) to tiled (each key head's first
    value head, then each one's second, ...)."""
    shape = list(a.shape)
    a = a.reshape(shape[:axis] + [nk, per_k, size] + shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(a, axis, axis + 1)).reshape(shape)


def _converted(name: str, a: np.ndarray, cfg: "transformers.Qwen3_5TextConfig") -> np.ndarray:
    """HF tensor `name` (trunk or MTP layer, or global) as Qwen3_5TextModel.modify_tensors
    writes it."""
    import torch

    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if name.endswith(".A_log"):
        a = -torch.exp(torch.from_numpy(a)).numpy()  # torch's exp, as the converter's: to the bit
    elif ".conv1d." in name:
        a = a.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        a = a + 1  # Qwen 3.5's RMSNorm scales by 1 + weight; the gated norm by weight
    if nk == nv or "linear_attn." not in name:
        return a
    per_k = nv // nk
    if ".in_proj_qkv." in name or ".conv1d." in name:  # only the value rows / channels
        qk = 2 * nk * dk
        return np.concatenate([a[:qk], tile_v_heads(a[qk:], 0, nk, per_k, dv)])
    if ".in_proj_z." in name:
        return tile_v_heads(a, 0, nk, per_k, dv)
    if name.endswith((".in_proj_b.weight", ".in_proj_a.weight", ".A_log", ".dt_bias")):
        return tile_v_heads(a, 0, nk, per_k, 1)
    if ".out_proj." in name:
        return tile_v_heads(a, 1, nk, per_k, dv)
    return a


# Qwen3.5 MoE's mixture (Qwen2MoeModel's names): the router, the shared expert and its gate;
# the routed experts' fused gate_up_proj [E, 2 F, D] is split in halves, down_proj kept
QWEN35MOE_HF_LAYER = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


def _converter_type(gguf_name: str, a: np.ndarray, wtype: str) -> gguf.GGMLQuantizationType:
    """The type the converter stores a tensor in for output type `wtype`: F32 for vectors,
    norms, conv kernels, the routers' rows (ffn_gate_inp, ffn_gate_inp_shexp) and names not
    ending in .weight; else the output type (F16 where a row does not divide into Q8_0
    blocks)."""
    if (a.ndim <= 1 or gguf_name.endswith("_norm.weight") or ".ssm_conv1d." in gguf_name
            or ".ffn_gate_inp" in gguf_name or not gguf_name.endswith(".weight")):
        return gguf.GGMLQuantizationType.F32
    if wtype == "q8_0" and a.shape[-1] % 32:
        return gguf.GGMLQuantizationType.F16  # its QuantError fallback
    return _HF_TYPES[wtype]


def write_qwen35_from_hf(
    path: str,
    model: "transformers.Qwen3_5ForCausalLM",
    mtp: dict[str, "torch.Tensor"] | None = None,
    wtype: str = "f32",
    tokenizer: bool = True,
    full_attention_interval: int | None = None,
) -> str:
    """`model` (with `mtp`: a checkpoint's `mtp.*` tensors, under those names) as llama.cpp's
    convert_hf_to_gguf.py (Qwen3_5TextModel; Qwen3_5MoeTextModel for a Qwen3_5MoeForCausalLM,
    as `qwen35moe` with the expert keys and QWEN35MOE_HF_LAYER's tensors) writes it: its keys (from model.config; the
    `layer_types` always as the recurrent-layers array, `full_attention_interval` config.json's,
    4 when it has none, as a transformers-saved one), its tensor names, the norms +1 (not the
    DeltaNet's gated one), A_log as ssm_a = -exp(A_log), the value heads tiled when
    linear_num_value_heads > linear_num_key_heads, conv kernels [C, K], lm_head left out when
    tied; types as the converter's for output type `wtype` (f32, f16, q8_0). `tokenizer`: the
    default model's (its vocabulary must be model's)."""
    import torch

    cfg = model.config
    if cfg.linear_key_head_dim != cfg.linear_value_head_dim:
        raise ValueError("llama.cpp's qwen35 needs linear_key_head_dim == linear_value_head_dim")
    rope = cfg.rope_parameters
    sections = list(rope.get("mrope_section", [11, 11, 10]))[:4]
    sections += [0] * (4 - len(sections))
    mtp = dict(mtp or {})
    n_mtp = len({k.split(".")[2] for k in mtp if k.startswith("mtp.layers.")})
    interval = full_attention_interval or getattr(cfg, "full_attention_interval", 4)
    moe = hasattr(cfg, "num_experts")
    arch = "qwen35moe" if moe else "qwen35"
    shape = Shape(n_layer=cfg.num_hidden_layers, n_embd=cfg.hidden_size,
                  n_ff=0 if moe else cfg.intermediate_size, n_head=cfg.num_attention_heads,
                  n_head_kv=cfg.num_key_value_heads, rope_base=float(rope["rope_theta"]),
                  n_ctx_train=cfg.max_position_embeddings, arch="qwen35",
                  head_dim=cfg.head_dim, rms_eps=cfg.rms_norm_eps, attn_interval=interval,
                  n_rot=int(cfg.head_dim * rope.get("partial_rotary_factor", 0.25)),
                  rope_sections=tuple(sections),  # type: ignore[arg-type]
                  ssm_k_heads=cfg.linear_num_key_heads, ssm_v_heads=cfg.linear_num_value_heads,
                  ssm_head_dim=cfg.linear_key_head_dim, ssm_conv=cfg.linear_conv_kernel_dim,
                  nextn=n_mtp)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"{arch}-from-hf")
    w.add_block_count(shape.n_layer + n_mtp)
    w.add_context_length(shape.n_ctx_train)
    w.add_embedding_length(shape.n_embd)
    if moe:  # Qwen2MoeModel's keys (the config has no dense intermediate_size to write)
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    else:
        w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_freq_base(shape.rope_base)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_file_type(_FILE_TYPES[wtype])
    add_qwen35_keys(w, shape, [t == "linear_attention" for t in cfg.layer_types], interval)
    if tokenizer:
        add_default_tokenizer(w)
    state = {k: v for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and cfg.tie_word_embeddings)}
    for k, v in mtp.items():  # the converter's renaming (_QwenMtpMixin.filter_tensors)
        if m := re.fullmatch(r"mtp\.layers\.(\d+)\.(.+)", k):
            state[f"model.layers.{shape.n_layer + int(m[1])}.{m[2]}"] = v
        elif (m := re.fullmatch(r"mtp\.(\w+)\.weight", k)) and m[1] in _HF_MTP:
            state[f"model.layers.{shape.n_layer}.{_HF_MTP[m[1]]}.weight"] = v
        else:
            raise ValueError(f"{k!r}: not an MTP tensor of Qwen 3.5's")
    for name, t in state.items():
        a = t.detach().to(dtype=torch.float32).cpu().numpy()
        layer = {**QWEN35_HF_LAYER, **QWEN35MOE_HF_LAYER} if moe else QWEN35_HF_LAYER
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if moe and m and m[2] == "mlp.experts.gate_up_proj":
            for half, part in zip(np.split(a, 2, axis=1), ("gate", "up")):
                _add(w, f"blk.{m[1]}.ffn_{part}_exps.weight", np.ascontiguousarray(half), wtype)
            continue
        if name in QWEN35_HF_GLOBAL:
            out = QWEN35_HF_GLOBAL[name]
        elif m and m[2] in layer:
            out = f"blk.{m[1]}.{layer[m[2]]}"
        else:
            raise ValueError(f"{name!r} has no {arch} GGUF counterpart")
        _add(w, out, np.ascontiguousarray(_converted(name, a, cfg), dtype=np.float32), wtype)
    write_file(w)
    return path


def _add(w: gguf.GGUFWriter, out: str, a: np.ndarray, wtype: str) -> None:
    """Tensor `out` in the type the converter gives it (_converter_type)."""
    qtype = _converter_type(out, a, wtype)
    if qtype == gguf.GGMLQuantizationType.F32:
        w.add_tensor(out, a)
    elif qtype == gguf.GGMLQuantizationType.F16:
        w.add_tensor(out, a.astype(np.float16))
    else:
        w.add_tensor(out, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
