"""HF transformers' Qwen 3.5 (dense) built from a qwen35 GGUF, as the reference our forward is
checked against.

Every GGUF key and tensor is mapped by hand, as the inverse of llama.cpp's convert_hf_to_gguf.py
(Qwen3_5TextModel, with its bases Qwen3NextModel and _LinearAttentionVReorderBase), and every
parameter of the HF model must be loaded from the file:

- norms stored +1 (Qwen 3.5's RMSNorm multiplies by 1 + weight) get it back off, all but the
  Gated DeltaNet's gated norm (ssm_norm, stored as is);
- ssm_a is -exp(A_log): A_log = log(-ssm_a); ssm_dt.bias is dt_bias;
- with more value heads than key heads, the converter reorders the value heads from grouped (by
  key head) to tiled in attn_qkv's value rows, attn_gate, ssm_beta, ssm_alpha, ssm_a,
  ssm_dt.bias, ssm_conv1d's value channels and ssm_out's columns: put back here;
- attn_q is HF's q_proj as is: both hold, per head, its query rows then its output gate's;
- ssm_conv1d [C, K] is Conv1d's [C, 1, K] squeezed;
- the layer pattern: `qwen35.attention.recurrent_layers` where the file has it, else every
  `full_attention_interval`-th layer (4 when absent) attends, as llama.cpp reads them;
- partial_rotary_factor = rope.dimension_count / head_dim, mrope_section the first three of
  rope.dimension_sections (for text every section gets the same position, so they do not
  change the logits);
- blocks past block_count - nextn_predict_layers (the MTP head) are not HF's model: skipped.
"""

from __future__ import annotations

import re
from typing import Any

import gguf
import numpy as np
import torch
import transformers

from radixserve.model.gguf_check import read_gguf
from tests.lfm2_hf import load_every_parameter
from tests.tiny_gguf import QWEN35_HF_GLOBAL, QWEN35_HF_LAYER

# GGUF name -> HF name: tiny_gguf's map (as gguf-py's tensor_mapping maps HF's names for
# MODEL_ARCH.QWEN35), inverted; the MTP block's names left out (its block is not loaded)
_GLOBAL = {g: h for h, g in QWEN35_HF_GLOBAL.items()}
_LAYER = {g: h for h, g in QWEN35_HF_LAYER.items() if not g.startswith("nextn.")}
# stored + 1 by the converter (its test: the HF name ends in norm.weight, but not the DeltaNet's)
_PLUS_ONE = {"output_norm.weight", "attn_norm.weight", "post_attention_norm.weight",
             "attn_q_norm.weight", "attn_k_norm.weight"}
_BLK = re.compile(r"blk\.(\d+)\.(.+)")


def _field(fields: dict[str, Any], key: str, default: Any = None) -> Any:
    if key in fields:
        return fields[key].contents()
    if default is None:
        raise ValueError(f"the file has no {key}")
    return default


def untile_v_heads(a: np.ndarray, axis: int, nk: int, per_k: int, size: int) -> np.ndarray:
    """The inverse of the converter's _reorder_v_heads: along `axis`, nk * per_k heads of `size`
    from tiled order (every key head's first value head, then every one's second, ...) back to
    grouped (key head 0's value heads, then key head 1's, ...)."""
    shape = list(a.shape)
    a = a.reshape(shape[:axis] + [per_k, nk, size] + shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(a, axis, axis + 1)).reshape(shape)


def qwen35_config_from_gguf(path: str) -> tuple[transformers.Qwen3_5TextConfig, dict[str, Any]]:
    """The Qwen3_5TextConfig a qwen35 GGUF describes, and the file's tensors (name -> gguf-py's
    ReaderTensor) of the trunk (the MTP blocks' left out)."""
    r = read_gguf(path)
    f = r.fields
    arch = _field(f, "general.architecture")
    if arch != "qwen35":
        raise ValueError(f"{path}: architecture {arch!r}, not qwen35")
    n_all = int(_field(f, "qwen35.block_count"))
    n_layer = n_all - int(_field(f, "qwen35.nextn_predict_layers", 0))
    if "qwen35.attention.recurrent_layers" in f:
        flags = [bool(x) for x in _field(f, "qwen35.attention.recurrent_layers")]
        if len(flags) != n_all:
            raise ValueError(f"{len(flags)} recurrent_layers flags for {n_all} blocks")
        flags = flags[:n_layer]
    else:
        every = int(_field(f, "qwen35.full_attention_interval", 4))
        flags = [(i + 1) % every != 0 for i in range(n_layer)]
    tensors = {}
    for t in r.tensors:
        m = _BLK.fullmatch(t.name)
        if m and int(m[1]) >= n_all:
            raise ValueError(f"{t.name}: past the file's {n_all} blocks")
        if not (m and int(m[1]) >= n_layer):
            tensors[t.name] = t
    head_dim = int(_field(f, "qwen35.attention.key_length"))
    if int(_field(f, "qwen35.attention.value_length", head_dim)) != head_dim:
        raise ValueError("key_length != value_length")
    n_rot = int(_field(f, "qwen35.rope.dimension_count"))
    sections = [int(x) for x in _field(f, "qwen35.rope.dimension_sections")]
    nk = int(_field(f, "qwen35.ssm.group_count"))
    nv = int(_field(f, "qwen35.ssm.time_step_rank"))
    emb = tensors["token_embd.weight"]
    config = transformers.Qwen3_5TextConfig(
        vocab_size=int(emb.shape[1]),  # gguf-py's shapes are ggml's: [n_embd, n_vocab]
        hidden_size=int(_field(f, "qwen35.embedding_length")),
        intermediate_size=int(_field(f, "qwen35.feed_forward_length")),
        num_hidden_layers=n_layer,
        num_attention_heads=int(_field(f, "qwen35.attention.head_count")),
        num_key_value_heads=int(_field(f, "qwen35.attention.head_count_kv")),
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=int(_field(f, "qwen35.context_length")),
        rms_norm_eps=float(_field(f, "qwen35.attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_type": "default",
                         "rope_theta": float(_field(f, "qwen35.rope.freq_base")),
                         "partial_rotary_factor": n_rot / head_dim,
                         "mrope_section": sections[:3], "mrope_interleaved": True},
        attention_bias=False,
        linear_conv_kernel_dim=int(_field(f, "qwen35.ssm.conv_kernel")),
        linear_key_head_dim=int(_field(f, "qwen35.ssm.state_size")),
        linear_value_head_dim=int(_field(f, "qwen35.ssm.inner_size")) // nv,
        linear_num_key_heads=nk,
        linear_num_value_heads=nv,
        layer_types=["linear_attention" if r else "full_attention" for r in flags],
        tie_word_embeddings="output.weight" not in tensors,
    )
    return config, tensors


def _unconverted(base: str, a: np.ndarray, cfg: transformers.Qwen3_5TextConfig) -> np.ndarray:
    """GGUF tensor `base` (its name without blk.N.) as HF holds it."""
    if base in _PLUS_ONE:
        a = a - 1
    elif base == "ssm_a":
        a = np.log(-a)
    elif base == "ssm_conv1d.weight":
        a = a[:, None, :]  # [C, K] -> Conv1d's [C, 1, K]
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if nk == nv or base not in ("attn_qkv.weight", "ssm_conv1d.weight", "attn_gate.weight",
                                "ssm_beta.weight", "ssm_alpha.weight", "ssm_a", "ssm_dt.bias",
                                "ssm_out.weight"):
        return a
    per_k, dv = nv // nk, cfg.linear_value_head_dim
    if base in ("attn_qkv.weight", "ssm_conv1d.weight"):  # the value rows / channels only
        qk = 2 * nk * cfg.linear_key_head_dim
        return np.concatenate([a[:qk], untile_v_heads(a[qk:], 0, nk, per_k, dv)])
    if base == "attn_gate.weight":
        return untile_v_heads(a, 0, nk, per_k, dv)
    if base == "ssm_out.weight":
        return untile_v_heads(a, 1, nk, per_k, dv)
    return untile_v_heads(a, 0, nk, per_k, 1)  # one value a head


def hf_qwen35_from_gguf(path: str) -> transformers.Qwen3_5ForCausalLM:
    """The GGUF at `path` as transformers' Qwen3_5ForCausalLM in float32, eval mode: weights
    dequantized (gguf-py), the converter's transforms undone (see the module's docstring); an
    error if a tensor of the trunk has no HF counterpart or an HF parameter is not in the file."""
    config, tensors = qwen35_config_from_gguf(path)
    model = transformers.Qwen3_5ForCausalLM(config).to(torch.float32)
    state: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        # a copy: torch wants a writable array, the reader's are read-only views of the file
        a = np.array(a, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist())))
        if name in _GLOBAL:
            base, hf = name, _GLOBAL[name]
        elif (m := _BLK.fullmatch(name)) and m[2] in _LAYER:
            base, hf = m[2], f"model.layers.{m[1]}.{_LAYER[m[2]]}"
        else:
            raise ValueError(f"{path}: GGUF tensor {name!r} has no Qwen 3.5 counterpart")
        state[hf] = torch.from_numpy(np.ascontiguousarray(_unconverted(base, a, config)))
    want = model.state_dict()
    bad = {k: (tuple(v.shape), tuple(want[k].shape)) for k, v in state.items()
           if k in want and v.shape != want[k].shape}
    if bad:
        raise ValueError(f"{path}: shapes (file, model) differ: {bad}")
    return load_every_parameter(model, state, config.tie_word_embeddings, path)


def random_qwen35(config: transformers.Qwen3_5TextConfig, seed: int = 0
                  ) -> transformers.Qwen3_5ForCausalLM:
    """A Qwen3_5ForCausalLM of `config` in float32 eval mode, every parameter drawn at random so
    that none is at its init's special value (norm weights 0 or 1, dt_bias 1): weights
    N(0, 1/sqrt(fan_in)) (the embeddings N(0, 0.5)), norm weights N(0, 0.1) (the DeltaNet's gated
    norm 1 + N(0, 0.1)), A_log = log U(0.2, 2), dt_bias 1 + N(0, 0.3), conv kernels N(0, 0.3)."""
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(config).to(torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=g)
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.1 * z)
            elif name.endswith("norm.weight"):
                p.copy_(0.1 * z)
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.2, 2.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(1 + 0.3 * z)
            elif name.endswith("conv1d.weight"):
                p.copy_(0.3 * z)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(0.5 * z)
            else:
                p.copy_(z / p.shape[-1] ** 0.5)
    return model.eval()


def random_qwen35_mtp(config: transformers.Qwen3_5TextConfig, seed: int = 0
                      ) -> dict[str, torch.Tensor]:
    """A checkpoint's MTP head for `config` (Qwen 3.5's `mtp.*` tensors: fc, the two pre-fc
    norms, the final norm, one full-attention decoder layer), random, float32."""
    g = torch.Generator().manual_seed(seed)
    c = config
    d, hd = c.hidden_size, c.head_dim
    shapes = {"fc.weight": (d, 2 * d), "pre_fc_norm_embedding.weight": (d,),
              "pre_fc_norm_hidden.weight": (d,), "norm.weight": (d,),
              "layers.0.input_layernorm.weight": (d,),
              "layers.0.post_attention_layernorm.weight": (d,),
              "layers.0.self_attn.q_proj.weight": (2 * c.num_attention_heads * hd, d),
              "layers.0.self_attn.k_proj.weight": (c.num_key_value_heads * hd, d),
              "layers.0.self_attn.v_proj.weight": (c.num_key_value_heads * hd, d),
              "layers.0.self_attn.o_proj.weight": (d, c.num_attention_heads * hd),
              "layers.0.self_attn.q_norm.weight": (hd,),
              "layers.0.self_attn.k_norm.weight": (hd,),
              "layers.0.mlp.gate_proj.weight": (c.intermediate_size, d),
              "layers.0.mlp.up_proj.weight": (c.intermediate_size, d),
              "layers.0.mlp.down_proj.weight": (d, c.intermediate_size)}
    return {f"mtp.{k}": torch.randn(s, generator=g) * (0.1 if len(s) == 1 else s[-1] ** -0.5)
            for k, s in shapes.items()}
