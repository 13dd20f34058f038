"""Mixture-of-experts models both ways: a random transformers model (Qwen3MoeForCausalLM,
Lfm2MoeForCausalLM), and
the GGUF llama.cpp's convert_hf_to_gguf.py writes from it, so our forward can be checked
against HF's on the same weights.

The converter's transforms, done here the same way (Qwen2MoeModel.modify_tensors):
- the experts' fused gate_up_proj [E, 2 F, D] split into ffn_gate_exps and ffn_up_exps
  [E, F, D]; down_proj [E, D, F] as ffn_down_exps; the router (mlp.gate) as ffn_gate_inp,
  kept F32 whatever the type of the matrices (the converter keeps it so);
- Q/K rows as HF has them (qwen3's attention is not permuted), q/k norms as
  attn_q_norm / attn_k_norm;
- keys: expert_count, expert_used_count, expert_feed_forward_length, and the dense
  feed_forward_length (intermediate_size) beside them.

Checked by hand for both families: llama.cpp's converter on the same model saved by
transformers (LFM2-MoE's experts written per expert, w1/w3/w2, as the hub's checkpoints hold
them) writes the same keys and every tensor bit for bit, and llama-server's 24 greedy tokens
on the f32 files equal ours on three prompts (Qwen3 MoE: one prompt parts at a near-tie of
0.001 nats at step 13; top-3 log-probabilities within 0.0025, LFM2-MoE's within 0.0066, 1.5e-4
with llama-server's f32 KV cache and flash attention off).

With `wtype` q8_0 the matrices (experts included, an expert's rows Q8_0 blocks as any row's)
are Q8_0 and the HF model's weights are replaced by their dequantized values, so both sides
compute with the same weights."""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np
import torch
import transformers

from radixserve.bench.synth_model import add_default_tokenizer, default_tokenizer_fields
from tests.hf_random import layer_arrays, randomize
from tests.tiny_gguf import HF_ATTENTION, write_file

_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
           "model.embedding_norm.weight": "token_embd_norm.weight"}
_LFM2_LAYER = {
    "operator_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "conv.conv.weight": "shortconv.conv.weight",
    "conv.in_proj.weight": "shortconv.in_proj.weight",
    "conv.out_proj.weight": "shortconv.out_proj.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.out_proj.weight": "attn_output.weight",
    "self_attn.q_layernorm.weight": "attn_q_norm.weight",
    "self_attn.k_layernorm.weight": "attn_k_norm.weight",
    "feed_forward.w1.weight": "ffn_gate.weight",
    "feed_forward.w3.weight": "ffn_up.weight",
    "feed_forward.w2.weight": "ffn_down.weight",
    "feed_forward.gate.weight": "ffn_gate_inp.weight",
    "feed_forward.expert_bias": "exp_probs_b.bias",
    "feed_forward.experts.down_proj": "ffn_down_exps.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **HF_ATTENTION,
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}


def tiny_qwen3moe_config(**kw: object) -> transformers.Qwen3MoeConfig:
    """A 3-layer Qwen3 MoE on the default model's vocabulary: 8 experts of width 32, 3 used
    a token (so ties and renormalization matter), 4 heads of 16 on 2 KV heads."""
    args: dict[str, object] = dict(
        vocab_size=len(default_tokenizer_fields()["tokenizer.ggml.tokens"]),
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=True, max_position_embeddings=2048,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    args.update(kw)
    return transformers.Qwen3MoeConfig(**args)


def random_moe(config: transformers.PretrainedConfig, seed: int = 0) -> transformers.PreTrainedModel:
    """The causal LM of `config` in float32 eval mode, every parameter drawn at random:
    matrices N(0, 1/sqrt(fan_in)) (the router's too, so its choices are not near-ties),
    the embedding N(0, 0.5), norm weights 1 + N(0, 0.1)."""
    torch.manual_seed(seed)
    return randomize(transformers.AutoModelForCausalLM.from_config(config), seed, 0.5)


def tiny_lfm2moe_config(**kw: object) -> transformers.Lfm2MoeConfig:
    """A 4-layer LFM2-MoE on the default model's vocabulary: conv, attention, conv, conv, the
    first FFN dense, then 8 experts of width 32, 3 used a token, with an expert bias."""
    args: dict[str, object] = dict(
        vocab_size=len(default_tokenizer_fields()["tokenizer.ggml.tokens"]),
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=3,
        num_dense_layers=1, use_expert_bias=True, norm_topk_prob=True, conv_L_cache=3,
        layer_types=["conv", "full_attention", "conv", "conv"],
        max_position_embeddings=2048, norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    args.update(kw)
    return transformers.Lfm2MoeConfig(**args)


def _tensors(model: transformers.PreTrainedModel) -> dict[str, tuple[str, np.ndarray]]:
    """{GGUF name: (HF name, the converted f32 array)}."""
    layer_map = _LFM2_LAYER if model.config.model_type == "lfm2_moe" else _LAYER
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, a, p, key in layer_arrays(model, _GLOBAL, out):
        if key in ("mlp.experts.gate_up_proj", "feed_forward.experts.gate_up_proj"):
            gate, up = np.split(a, 2, axis=1)
            out[p + "ffn_gate_exps.weight"] = (name + ":gate", np.ascontiguousarray(gate))
            out[p + "ffn_up_exps.weight"] = (name + ":up", np.ascontiguousarray(up))
            continue
        base = layer_map.get(key)
        if base is None:
            raise ValueError(f"{name!r} has no GGUF counterpart")
        if base == "shortconv.conv.weight":
            a = np.ascontiguousarray(a.squeeze(1))  # the converter's: [D, 1, L] -> [D, L]
        out[p + base] = (name, a)
    return out


def _writer(path: str, arch: str, model: transformers.PreTrainedModel,
            wtype: str) -> gguf.GGUFWriter:
    """A writer of `arch` with the keys both families' converters write alike."""
    if wtype not in ("f32", "q8_0"):
        raise ValueError(f"wtype {wtype!r}: f32 or q8_0")
    cfg = model.config
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"{arch}-from-hf")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if wtype == "f32"
                    else gguf.LlamaFileType.MOSTLY_Q8_0)
    return w


def write_qwen3moe_from_hf(path: str, model: transformers.PreTrainedModel,
                           wtype: str = "f32") -> str:
    """`model` as the converter writes it (see the module's docstring), matrices in `wtype`
    (f32 or q8_0; norms and the router F32). With q8_0 the model's own weights become the
    dequantized ones."""
    cfg = model.config
    w = _writer(path, "qwen3moe", model, wtype)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    add_default_tokenizer(w)
    write_tensors(w, model, wtype)
    return path


def write_lfm2moe_from_hf(path: str, model: transformers.PreTrainedModel,
                          wtype: str = "f32") -> str:
    """`model` (Lfm2MoeForCausalLM) as LFM2MoeModel writes it: head_count_kv one entry a
    layer (0 for a conv layer), the expert keys, leading_dense_block_count,
    expert_gating_func sigmoid, shortconv.l_cache; the conv kernels squeezed to [D, L] and the
    expert bias as exp_probs_b.bias, both F32."""
    cfg = model.config
    w = _writer(path, "lfm2moe", model, wtype)
    w.add_head_count_kv([cfg.num_key_value_heads if t == "full_attention" else 0
                         for t in cfg.layer_types])
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_leading_dense_block_count(cfg.num_dense_layers)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_vocab_size(cfg.vocab_size)
    w.add_shortconv_l_cache(cfg.conv_L_cache)
    add_default_tokenizer(w)
    write_tensors(w, model, wtype)
    return path


def _restore_halves(params: dict[str, torch.nn.Parameter], base: str, part: str,
                    t: torch.Tensor) -> None:
    """A fused [E, 2 F, D] gate_up_proj's gate or up half set back (Qwen3 MoE, LFM2-MoE)."""
    half = params[base].shape[1] // 2
    (params[base][:, :half] if part == "gate" else params[base][:, half:]).copy_(t)


def write_tensors(w: gguf.GGUFWriter, model: transformers.PreTrainedModel, wtype: str,
                  tensors: dict[str, tuple[str, np.ndarray]] | None = None,
                  restore: Callable[..., None] = _restore_halves) -> None:
    """The tensors (`_tensors`'s unless given), then the file; q8_0: every matrix but the
    router's, mxfp4: those with the experts' in MXFP4, and the HF model's weights replaced by
    the dequantized ones (a part of an HF tensor, "name:part", by `restore`)."""
    dequantized: dict[str, np.ndarray] = {}
    for out, (hf, a) in (_tensors(model) if tensors is None else tensors).items():
        if (wtype in ("q8_0", "mxfp4") and a.ndim >= 2 and a.shape[-1] % 32 == 0
                and "ffn_gate_inp" not in out and "_norm." not in out
                and "shortconv.conv." not in out and not out.endswith(".bias")):
            q = gguf.GGMLQuantizationType.Q8_0
            if wtype == "mxfp4" and "_exps." in out:
                q = gguf.GGMLQuantizationType.MXFP4
            blocks = gguf.quants.quantize(a, q)
            w.add_tensor(out, blocks, raw_dtype=q)
            dequantized[hf] = gguf.quants.dequantize(blocks, q).reshape(a.shape)
        else:
            w.add_tensor(out, a)
    write_file(w)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, a in dequantized.items():
            base, _, part = name.partition(":")
            t = torch.from_numpy(np.ascontiguousarray(a))
            if part:
                restore(params, base, part, t)
            else:
                params[base].copy_(t)


# gpt-oss (GptOssForCausalLM) -> llama.cpp's GptOssModel names
_GPTOSS_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.sinks": "attn_sinks.weight",
    **{f"self_attn.{x}_proj.{kind}": f"attn_{x}.{kind}" for x in "qkv"
       for kind in ("weight", "bias")},
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
    "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
}


def tiny_gptoss_config(**kw: object) -> transformers.GptOssConfig:
    """A 4-layer gpt-oss on the default model's vocabulary: sliding (window 8) and full
    layers alternating, 8 experts of width 32, 3 used a token, 4 heads of 16 on 2 KV heads,
    YaRN x32 over 4096 positions with the correction range truncated, as llama.cpp always
    does. The released config says not to truncate, which HF follows: at gpt-oss-20b's sizes
    (64 rotary dims, base 150000) the ramp then runs over pairs 8.09..17.40 instead of 8..18,
    and 9 of the 32 frequencies differ, by up to 76% (pair 17): radixserve computes
    llama.cpp's rope, not HF's, for the released files."""
    args: dict[str, object] = dict(
        vocab_size=len(default_tokenizer_fields()["tokenizer.ggml.tokens"]),
        hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=3,
        sliding_window=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": True,
                         "original_max_position_embeddings": 4096, "rope_theta": 150000.0})
    args.update(kw)
    return transformers.GptOssConfig(**args)


def _gptoss_tensors(model: transformers.PreTrainedModel) -> dict[str, tuple[str, np.ndarray]]:
    """{GGUF name: (HF name[:part], the converted f32 array)}, as GptOssModel.modify_tensors
    converts unquantized experts: gate_up_proj [E, D, 2 F] transposed to [E, 2 F, D] and its
    interleaved rows split (gate the even, up the odd), its bias likewise; down_proj
    transposed to [E, D, F]."""
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, a, p, key in layer_arrays(model, _GLOBAL, out):
        if key == "mlp.experts.gate_up_proj":
            a = a.transpose(0, 2, 1)
            out[p + "ffn_gate_exps.weight"] = (name + ":gate", np.ascontiguousarray(a[:, ::2]))
            out[p + "ffn_up_exps.weight"] = (name + ":up", np.ascontiguousarray(a[:, 1::2]))
        elif key == "mlp.experts.gate_up_proj_bias":
            out[p + "ffn_gate_exps.bias"] = (name, np.ascontiguousarray(a[:, ::2]))
            out[p + "ffn_up_exps.bias"] = (name, np.ascontiguousarray(a[:, 1::2]))
        elif key == "mlp.experts.down_proj":
            out[p + "ffn_down_exps.weight"] = (name + ":down",
                                               np.ascontiguousarray(a.transpose(0, 2, 1)))
        elif key in _GPTOSS_LAYER:
            out[p + _GPTOSS_LAYER[key]] = (name, a)
        else:
            raise ValueError(f"{name!r} has no GGUF counterpart")
    return out


def _restore_gptoss(params: dict[str, torch.nn.Parameter], base: str, part: str,
                    t: torch.Tensor) -> None:
    """A dequantized expert matrix set back into GptOss's layout (_gptoss_tensors inverted)."""
    if part == "down":
        params[base].copy_(t.transpose(1, 2))
    else:
        first = 0 if part == "gate" else 1  # gate the even columns, up the odd
        params[base][:, :, first::2].copy_(t.transpose(1, 2))


def write_gptoss_from_hf(path: str, model: transformers.PreTrainedModel,
                         wtype: str = "f32") -> str:
    """`model` (GptOssForCausalLM) as GptOssModel writes it: the keys (sliding_window,
    expert_feed_forward_length, YaRN's), sinks, biases and the experts converted
    (_gptoss_tensors); `wtype` f32, q8_0, or mxfp4 (q8_0 with the experts in MXFP4, as the
    released files hold them)."""
    if wtype not in ("f32", "q8_0", "mxfp4"):
        raise ValueError(f"wtype {wtype!r}: f32, q8_0 or mxfp4")
    cfg = model.config
    rope = cfg.rope_parameters
    w = gguf.GGUFWriter(path, "gpt-oss")
    w.add_name("gpt-oss-from-hf")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_sliding_window(cfg.sliding_window)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if wtype == "f32"
                    else gguf.LlamaFileType.MOSTLY_Q8_0)
    add_default_tokenizer(w)
    write_tensors(w, model, wtype, _gptoss_tensors(model), _restore_gptoss)
    return path
