"""GGUF tensors -> dense PyTorch weights in the compute dtype.

Every quant type is dequantized once at load with `gguf.quants` (the engine runs dense
matmuls). Q/K/V and gate/up are fused into one [out, in] matrix each, because on CPU one larger
`F.linear` beats several small ones (shared/reference/cpu-perf-notes.md). GGUF `llama` Q/K rows
are stored permuted for the interleaved rotation; we undo the permutation so every architecture
uses the half-split (NeoX) rotation, exactly as HF transformers does when it loads a GGUF.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from radixserve.model.hparams import HParams, UnsupportedModelError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor
    wqkv: torch.Tensor  # [(n_head + 2 n_head_kv) * head_dim, n_embd]
    bqkv: torch.Tensor | None  # qwen2 biases
    q_norm: torch.Tensor | None  # qwen3 per-head RMS norm
    k_norm: torch.Tensor | None
    wo: torch.Tensor
    ffn_norm: torch.Tensor
    w_gate_up: torch.Tensor  # [2 * n_ff, n_embd]
    w_down: torch.Tensor


@dataclass(slots=True)
class ModelWeights:
    tok_embd: torch.Tensor  # [n_vocab, n_embd]
    output_norm: torch.Tensor
    output: torch.Tensor  # [n_vocab, n_embd], f32: bf16 logits are too coarse for near ties
    layers: list[LayerWeights]
    rope_freqs: torch.Tensor | None  # llama3-style per-frequency divisors


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's llama Q/K permutation (interleaved -> half-split)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dense(t: gguf.ReaderTensor) -> np.ndarray:
    arr = gguf.quants.dequantize(t.data, t.tensor_type)
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))
    return np.array(arr.reshape(shape), dtype=np.float32)  # a writable copy, not the mmap


def load_weights(reader: gguf.GGUFReader, hp: HParams, dtype: torch.dtype) -> ModelWeights:
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str, required: bool = True) -> np.ndarray | None:
        t = tensors.get(name)
        if t is None:
            if required:
                raise UnsupportedModelError(f"GGUF is missing tensor {name!r}")
            return None
        return _dense(t)

    def tt(a: np.ndarray | None, keep_f32: bool = False) -> torch.Tensor | None:
        if a is None:
            return None
        return torch.from_numpy(a).to(torch.float32 if keep_f32 else dtype).contiguous()

    unpermute = hp.arch == "llama"
    layers = []
    for i in range(hp.n_layer):
        p = f"blk.{i}."
        q, k, v = get(p + "attn_q.weight"), get(p + "attn_k.weight"), get(p + "attn_v.weight")
        if unpermute:
            q, k = _unpermute(q, hp.n_head), _unpermute(k, hp.n_head_kv)
        biases = [get(p + f"attn_{n}.bias", required=False) for n in "qkv"]
        if any(b is not None for b in biases):
            if any(b is None for b in biases):
                raise UnsupportedModelError(f"layer {i}: only some of the q/k/v biases are present")
            bqkv = tt(np.concatenate(biases))
        else:
            bqkv = None
        gate, up = get(p + "ffn_gate.weight"), get(p + "ffn_up.weight")
        layers.append(
            LayerWeights(
                attn_norm=tt(get(p + "attn_norm.weight"), keep_f32=True),
                wqkv=tt(np.concatenate([q, k, v])),
                bqkv=bqkv,
                q_norm=tt(get(p + "attn_q_norm.weight", required=hp.arch == "qwen3"), True),
                k_norm=tt(get(p + "attn_k_norm.weight", required=hp.arch == "qwen3"), True),
                wo=tt(get(p + "attn_output.weight")),
                ffn_norm=tt(get(p + "ffn_norm.weight"), keep_f32=True),
                w_gate_up=tt(np.concatenate([gate, up])),
                w_down=tt(get(p + "ffn_down.weight")),
            )
        )
    tok_embd = tt(get("token_embd.weight"))
    out = get("output.weight", required=False)
    if out is None:
        log.info("output.weight absent: using tied token embeddings as the output head")
    return ModelWeights(
        tok_embd=tok_embd,
        output_norm=tt(get("output_norm.weight"), keep_f32=True),
        output=tt(get("token_embd.weight") if out is None else out, keep_f32=True),
        layers=layers,
        rope_freqs=tt(get("rope_freqs.weight", required=False), keep_f32=True),
    )
