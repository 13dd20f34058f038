"""Write small random-weight GGUF models for fast tests (real files, read by the real loader).

The tokenizer metadata is copied from the default model so tokenization and chat templates are
real; only the network is tiny. Some tensors are quantized (Q8_0, Q4_1) so dequantization is
exercised too.
"""

from __future__ import annotations

import gguf
import numpy as np

from radixserve.bench.synth_model import add_default_tokenizer, default_tokenizer_fields


def write_tiny_gguf(
    path: str,
    arch: str = "llama",
    n_layer: int = 2,
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
) -> str:
    """`arch` gemma3: Gemma 3's layer pattern (every 6th layer global, the others sliding over
    `sliding_window` positions), q/k norms and post-norms. `arch` lfm2: LiquidAI LFM2 as
    llama.cpp's converter writes it: `attn_layers` attend (q/k norms, Q/K not permuted), the
    others are short-convolution layers of kernel length `l_cache`; head_count_kv is a per-layer
    array (0: a conv layer) and the final norm is named token_embd_norm. `attn_layers` defaults
    to every third layer from layer 2, (2, 5) at 6 layers, as LFM2's first ones. The vocabulary
    is the default model's, its tokens `rename_tokens` (id -> text) renamed; `token_ids`: extra
    `tokenizer.ggml.*_token_id` keys (GGUF key -> id); `add_bos`: tokenizer.ggml.add_bos_token
    other than the default model's; `pooling_type`: `{arch}.pooling_type` (llama_pooling_type)."""
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
    add_default_tokenizer(w, rename_tokens)
    for key, tid in (token_ids or {}).items():
        w.add_uint32(key, tid)
    if add_bos is not None:
        w.kv_data[0].pop(gguf.Keys.Tokenizer.ADD_BOS, None)  # the default model's value
        w.add_add_bos_token(add_bos)

    def rand(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def put(name: str, a: np.ndarray, qtype: gguf.GGMLQuantizationType | None = None) -> None:
        if quantize and qtype is not None and a.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)

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
