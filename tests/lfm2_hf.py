"""HF transformers' LFM2 built from an LFM2 GGUF, as the reference our forward is checked against.

Why not transformers' own GGUF loader: it maps the GGUF's `attention.layer_norm_rms_epsilon`
to `rms_norm_eps`, a name Lfm2Config does not read (its `norm_eps` keeps the default), and
it routes names through gguf-py's tables; here every GGUF key and tensor is mapped by hand,
as the inverse of llama.cpp's convert_hf_to_gguf.py (LFM2Model), and every parameter of the
HF model must be loaded from the file.
"""

from __future__ import annotations

import re
from typing import Any

import gguf
import numpy as np
import torch
import transformers

# GGUF tensor name (without .weight/.bias) -> HF name, as llama.cpp's tensor_mapping.py maps
# LFM2's HF names
_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "token_embd_norm": "model.embedding_norm",  # LFM2's final norm, after the last layer
    "output": "lm_head",
}
_LAYER = {
    "attn_norm": "operator_norm",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.out_proj",
    "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm",
    "shortconv.conv": "conv.conv",
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.out_proj": "conv.out_proj",
}
_BLK = re.compile(r"blk\.(\d+)\.(.+)\.(weight|bias)")


def _hf_name(name: str) -> str:
    if m := _BLK.fullmatch(name):
        bid, base, kind = m.groups()
        if base in _LAYER:
            return f"model.layers.{bid}.{_LAYER[base]}.{kind}"
    else:
        base, _, kind = name.rpartition(".")
        if base in _GLOBAL:
            return f"{_GLOBAL[base]}.{kind}"
    raise ValueError(f"GGUF tensor {name!r} has no LFM2 counterpart")


def _field(r: gguf.GGUFReader, key: str) -> Any:
    return r.fields[key].contents()


def hf_lfm2_from_gguf(path: str) -> transformers.Lfm2ForCausalLM:
    """The GGUF at `path` as transformers' Lfm2ForCausalLM in float32, eval mode: weights
    dequantized (gguf-py), the conv kernels unsqueezed back to Conv1d's [n_embd, 1, L]."""
    r = gguf.GGUFReader(path)
    arch = _field(r, "general.architecture")
    if arch != "lfm2":
        raise ValueError(f"{path}: architecture {arch!r}, not lfm2")
    n_layer = int(_field(r, "lfm2.block_count"))
    kv = _field(r, "lfm2.attention.head_count_kv")
    # the converter writes one entry a layer, 0 for a conv layer
    kv = [int(x) for x in kv] if isinstance(kv, list) else [int(kv)] * n_layer
    tensors = {t.name: t for t in r.tensors}
    config = transformers.Lfm2Config(
        vocab_size=int(_field(r, "lfm2.vocab_size")),
        hidden_size=int(_field(r, "lfm2.embedding_length")),
        # the GGUF holds the size after LFM2's auto-adjust; the tensors decide
        intermediate_size=int(tensors["blk.0.ffn_gate.weight"].shape[1]),
        block_auto_adjust_ff_dim=False,
        num_hidden_layers=n_layer,
        num_attention_heads=int(_field(r, "lfm2.attention.head_count")),
        num_key_value_heads=max(kv),
        layer_types=["full_attention" if k > 0 else "conv" for k in kv],
        conv_L_cache=int(_field(r, "lfm2.shortconv.l_cache")),
        conv_bias=any(n.startswith("blk.") and ".shortconv." in n and n.endswith(".bias")
                      for n in tensors),
        norm_eps=float(_field(r, "lfm2.attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_type": "default",
                         "rope_theta": float(_field(r, "lfm2.rope.freq_base"))},
        max_position_embeddings=int(_field(r, "lfm2.context_length")),
        tie_word_embeddings="output.weight" not in tensors,
    )
    model = transformers.Lfm2ForCausalLM(config).to(torch.float32)
    state: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        # a copy: torch wants a writable array, the reader's are read-only views of the file
        a = np.array(a, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist())))
        hf = _hf_name(name)
        if name.endswith("shortconv.conv.weight"):
            a = a[:, None, :]  # [n_embd, L] -> Conv1d's [n_embd, 1, L]
        state[hf] = torch.from_numpy(a)
    return load_every_parameter(model, state, config.tie_word_embeddings, path)


def load_every_parameter(model: Any, state: dict[str, torch.Tensor], tied: bool,
                         path: str) -> Any:
    """`state` into the HF `model`, every parameter from the file (a tied lm_head from the
    embeddings), else ValueError naming what is missing or left over; the model in eval
    mode."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    untied = {"lm_head.weight"} if tied else set()
    if unexpected or set(missing) - untied:
        raise ValueError(f"{path}: tensors not in the model {unexpected}, "
                         f"parameters not in the file {sorted(set(missing) - untied)}")
    if tied:
        model.tie_weights()
        if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
            raise ValueError("lm_head is not tied to the loaded embeddings")
    return model.eval()
