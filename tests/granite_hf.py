"""Granite 4.0-H (dense) both ways: a random transformers GraniteMoeHybridForCausalLM, and the
GGUF llama.cpp's convert_hf_to_gguf.py (GraniteHybridModel) writes from it, so our forward can
be checked against HF's on the same weights.

The converter's transforms, done here the same way:
- Mamba2 layers: A_log as ssm_a = -exp(A_log) [nh, 1], D as ssm_d [nh, 1], conv1d [C, 1, K]
  squeezed to [C, K], the gated norm's weight as [groups, inner / groups], dt_bias as
  ssm_dt.bias;
- attention layers: llama's Q/K row permutation (LlamaModel.permute), which llama.cpp's rope
  undoes (and a NoPE layer does not notice);
- the dense FFN (HF's shared_mlp: input_linear [gate | up], output_linear) as ffn_gate, ffn_up,
  ffn_down;
- keys: head_count_kv one entry a layer (0 for a Mamba2 layer), the multipliers as
  attention.scale / embedding_scale / residual_scale / logit_scale, rope.scaling.finetuned
  false for NoPE (then context_length 2^20), ssm.* sizes (time_step_rank is the head count).

Checked by hand: llama.cpp's convert_hf_to_gguf.py on the same model saved by transformers
writes the same keys and every tensor bit for bit (after renaming config.json's layer types to
Granite's own "mamba" / "attention": the converter does not read transformers' newer
"linear_attention" / "full_attention"), and llama-server's greedy tokens and top
log-probabilities on the f32 file equal ours (with and without RoPE).

With `wtype` q8_0 the matrices are Q8_0 and the HF model's weights are replaced by their
dequantized values, so both sides compute with the same weights."""

from __future__ import annotations


import gguf
import numpy as np
import torch
import transformers

from radixserve.bench.synth_model import add_default_tokenizer, default_tokenizer_fields
from tests.hf_random import layer_arrays, randomize
from tests.tiny_gguf import write_file

_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "shared_mlp.output_linear.weight": "ffn_down.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mamba.in_proj.weight": "ssm_in.weight",
    "mamba.conv1d.weight": "ssm_conv1d.weight",
    "mamba.conv1d.bias": "ssm_conv1d.bias",
    "mamba.dt_bias": "ssm_dt.bias",
    "mamba.A_log": "ssm_a",
    "mamba.D": "ssm_d",
    "mamba.norm.weight": "ssm_norm.weight",
    "mamba.out_proj.weight": "ssm_out.weight",
}


def tiny_config(nope: bool = True, n_groups: int = 2, **kw: object
                ) -> transformers.GraniteMoeHybridConfig:
    """A 4-layer dense Granite 4.0-H (Mamba2, attention, Mamba2, Mamba2) on the default
    model's vocabulary, with multipliers that are not 1 (and an attention multiplier that is
    not 1/sqrt(head_dim))."""
    args: dict[str, object] = dict(
        vocab_size=len(default_tokenizer_fields()["tokenizer.ggml.tokens"]),
        hidden_size=64, intermediate_size=128, shared_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
        embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.1,
        logits_scaling=2.0, num_local_experts=0, num_experts_per_tok=0,
        position_embedding_type=None if nope else "rope",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        layer_types=["linear_attention", "attention", "linear_attention", "linear_attention"],
        mamba_n_heads=8, mamba_n_groups=n_groups, mamba_d_state=16, mamba_d_head=16,
        mamba_d_conv=4, mamba_expand=2, mamba_conv_bias=True, mamba_proj_bias=False)
    args.update(kw)
    return transformers.GraniteMoeHybridConfig(**args)


def random_granite(config: transformers.GraniteMoeHybridConfig, seed: int = 0
                   ) -> transformers.GraniteMoeHybridForCausalLM:
    """The model of `config` in float32 eval mode, every parameter drawn at random away from
    its init's special values: matrices N(0, 1/sqrt(fan_in)), the embedding N(0, 0.5 /
    embedding_multiplier), norm weights 1 + N(0, 0.1), A_log = log U(0.2, 2), dt_bias
    1 + N(0, 0.3), D 1 + N(0, 0.3), conv kernels N(0, 0.3) and biases N(0, 0.1)."""
    torch.manual_seed(seed)

    def mamba(name: str, p: torch.Tensor, z: torch.Tensor,
              g: torch.Generator) -> torch.Tensor | None:
        if name.endswith("norm.weight"):
            return None
        if name.endswith("A_log"):
            return torch.empty(p.shape).uniform_(0.2, 2.0, generator=g).log()
        if name.endswith(("dt_bias", ".D")):
            return 1 + 0.3 * z
        if name.endswith("conv1d.weight"):
            return 0.3 * z
        return 0.1 * z if name.endswith("conv1d.bias") else None
    return randomize(transformers.GraniteMoeHybridForCausalLM(config), seed,
                     0.5 / config.embedding_multiplier, mamba)


def permute(a: np.ndarray, n_head: int) -> np.ndarray:
    """LlamaModel.permute: each head's rows from half-split pairs to interleaved ones."""
    return (a.reshape(n_head, 2, a.shape[0] // n_head // 2, *a.shape[1:])
            .swapaxes(1, 2).reshape(a.shape))


def _tensors(model: transformers.GraniteMoeHybridForCausalLM
             ) -> dict[str, tuple[str, np.ndarray]]:
    """{GGUF name: (HF name, the converted f32 array)}."""
    cfg = model.config
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, a, p, key in layer_arrays(model, _GLOBAL, out):
        if key == "shared_mlp.input_linear.weight":
            gate, up = np.split(a, 2)
            out[p + "ffn_gate.weight"] = (name + ":gate", gate)
            out[p + "ffn_up.weight"] = (name + ":up", up)
            continue
        base = _LAYER.get(key)
        if base is None:
            raise ValueError(f"{name!r} has no granitehybrid GGUF counterpart")
        if base == "ssm_a":
            a = -torch.exp(torch.from_numpy(a)).numpy()[:, None]  # torch's exp, the converter's
        elif base == "ssm_d":
            a = a[:, None]
        elif base == "ssm_conv1d.weight":
            a = a.squeeze(1)
        elif base == "ssm_norm.weight":
            a = a.reshape(cfg.mamba_n_groups, -1)
        elif base == "attn_q.weight":
            a = permute(a, cfg.num_attention_heads)
        elif base == "attn_k.weight":
            a = permute(a, cfg.num_key_value_heads)
        out[p + base] = (name, np.ascontiguousarray(a, dtype=np.float32))
    return out


def write_granite_from_hf(path: str, model: transformers.GraniteMoeHybridForCausalLM,
                          wtype: str = "f32") -> str:
    """`model` as the converter writes it (see the module's docstring), matrices in `wtype`
    (f32 or q8_0; vectors, norms and conv kernels F32 as the converter keeps them). With q8_0
    the model's own weights become the dequantized ones."""
    if wtype not in ("f32", "q8_0"):
        raise ValueError(f"wtype {wtype!r}: f32 or q8_0")
    cfg = model.config
    nope = cfg.position_embedding_type != "rope"
    attn = [t != "linear_attention" for t in cfg.layer_types]
    hd = cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(path, "granitehybrid")
    w.add_name("granite-hybrid-from-hf")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(2**20 if nope else cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.shared_intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([cfg.num_key_value_heads if a else 0 for a in attn])
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if wtype == "f32"
                    else gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_attention_scale(cfg.attention_multiplier)
    w.add_embedding_scale(cfg.embedding_multiplier)
    w.add_residual_scale(cfg.residual_multiplier)
    w.add_logit_scale(cfg.logits_scaling)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_feed_forward_length(cfg.shared_intermediate_size)
    w.add_ssm_conv_kernel(cfg.mamba_d_conv)
    w.add_ssm_state_size(cfg.mamba_d_state)
    w.add_ssm_group_count(cfg.mamba_n_groups)
    w.add_ssm_inner_size(cfg.mamba_expand * cfg.hidden_size)
    w.add_ssm_time_step_rank(cfg.mamba_n_heads)
    w.add_rope_scaling_finetuned(not nope)
    add_default_tokenizer(w)
    q8 = gguf.GGMLQuantizationType.Q8_0
    dequantized: dict[str, np.ndarray] = {}
    for out, (hf, a) in _tensors(model).items():
        if wtype == "q8_0" and a.ndim == 2 and a.shape[-1] % 32 == 0 and out.endswith(
                ".weight") and "_norm." not in out and ".ssm_conv1d." not in out:
            blocks = gguf.quants.quantize(a, q8)
            w.add_tensor(out, blocks, raw_dtype=q8)
            back = gguf.quants.dequantize(blocks, q8).reshape(a.shape)
            if "attn_q." in out or "attn_k." in out:
                n = cfg.num_attention_heads if "attn_q." in out else cfg.num_key_value_heads
                back = _unpermute(back, n)
            dequantized[hf] = back
        else:
            w.add_tensor(out, a)
    write_file(w)
    if dequantized:
        _load_dequantized(model, dequantized)
    return path


def _unpermute(a: np.ndarray, n_head: int) -> np.ndarray:
    return (a.reshape(n_head, a.shape[0] // n_head // 2, 2, *a.shape[1:])
            .swapaxes(1, 2).reshape(a.shape))


def _load_dequantized(model: transformers.GraniteMoeHybridForCausalLM,
                      arrays: dict[str, np.ndarray]) -> None:
    """Put the dequantized matrices back into the HF model (a split gate/up joined again)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, a in arrays.items():
            base, _, part = name.partition(":")
            t = torch.from_numpy(np.ascontiguousarray(a))
            if part:
                half = params[base].shape[0] // 2
                params[base][:half].copy_(t) if part == "gate" else params[base][half:].copy_(t)
            else:
                params[base].copy_(t)
