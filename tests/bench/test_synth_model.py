"""The synthetic-model writer (bench/synth_model.py): the files it writes load with the shape
asked for and run through the engine's every weight path alike."""

from __future__ import annotations

import dataclasses

import gguf
import pytest
import torch

from radixserve.bench.synth_model import SHAPES, main, write
from radixserve.engine.batch import BatchSeq, hidden
from radixserve.model.loader import load_model
from tests.conftest import model_pool

SHAPE = SHAPES["llama-tiny"]


def logits(m, ids: list[int]) -> torch.Tensor:
    pool = model_pool(m, 64, 1, True, len(ids))
    tr = m.transformer
    return tr.w.head.full(hidden(tr, pool, [BatchSeq(0, ids, 0)]))[-1].float()


@pytest.mark.parametrize("wtype, qtype", [("f16", gguf.GGMLQuantizationType.F16),
                                          ("q8_0", gguf.GGMLQuantizationType.Q8_0)])
def test_the_written_model_has_the_shape_and_runs_alike_on_every_path(tmp_path, wtype, qtype):
    path = write(str(tmp_path / "m.gguf"), SHAPE, wtype)
    r = gguf.GGUFReader(path)
    t = {x.name: x for x in r.tensors}
    assert len([n for n in t if n.endswith("ffn_down.weight")]) == SHAPE.n_layer
    hd = SHAPE.n_embd // SHAPE.n_head
    assert list(t["blk.0.attn_k.weight"].shape) == [SHAPE.n_embd, SHAPE.n_head_kv * hd]
    assert list(t["blk.1.ffn_gate.weight"].shape) == [SHAPE.n_embd, SHAPE.n_ff]
    assert t["blk.1.ffn_gate.weight"].tensor_type == qtype
    m = load_model(path, dtype="f32", weights="dequant")
    assert (m.hp.n_layer, m.hp.n_embd, m.hp.n_head, m.hp.n_head_kv) == (
        SHAPE.n_layer, SHAPE.n_embd, SHAPE.n_head, SHAPE.n_head_kv)
    ids = m.tokenizer.encode("The quick brown fox jumps over the lazy dog, twice over.")
    ref = logits(m, ids)
    got = logits(load_model(path, dtype="auto", weights="native"), ids)
    assert torch.isfinite(ref).all() and ref.std() > 0
    assert torch.nn.functional.cosine_similarity(ref, got, dim=0) > 0.99


def test_an_lfm2_shape_is_written_as_llama_cpp_converts_lfm2(tmp_path):
    """The LFM2 shapes' layout at a width a test can write: the per-layer KV-head array marks
    the conv layers (0), which carry the short-convolution tensors instead of attention, and
    HF transformers' LFM2 runs the file (its every parameter found there)."""
    from tests.lfm2_hf import hf_lfm2_from_gguf

    full = SHAPES["lfm2-350m"]
    assert (full.n_layer, full.n_embd, full.n_ff, full.attn_layers) == (
        16, 1024, 4608, (2, 5, 8, 10, 12, 14))
    shape = dataclasses.replace(full, n_layer=4, n_embd=128, n_ff=256, n_head=4, n_head_kv=2,
                                attn_layers=(2,))
    path = write(str(tmp_path / "m.gguf"), shape, "f16")
    r = gguf.GGUFReader(path)
    assert r.fields["general.architecture"].contents() == "lfm2"
    assert r.fields["lfm2.attention.head_count_kv"].contents() == [0, 0, 2, 0]
    assert r.fields["lfm2.shortconv.l_cache"].contents() == 3
    assert r.fields["lfm2.feed_forward_length"].contents() == 256
    t = {x.name: x for x in r.tensors}
    assert "token_embd_norm.weight" in t and "output_norm.weight" not in t
    assert "output.weight" not in t
    conv = t["blk.0.shortconv.conv.weight"]
    assert list(conv.shape) == [3, 128] and conv.tensor_type == gguf.GGMLQuantizationType.F32
    assert list(t["blk.3.shortconv.in_proj.weight"].shape) == [128, 3 * 128]
    assert list(t["blk.3.shortconv.out_proj.weight"].shape) == [128, 128]
    assert t["blk.3.shortconv.in_proj.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert list(t["blk.2.attn_k.weight"].shape) == [128, 2 * 32]
    assert list(t["blk.2.attn_q_norm.weight"].shape) == [32]
    assert not any(n.startswith("blk.2.shortconv") for n in t)
    assert not any(n.startswith(("blk.0.attn_q", "blk.1.attn_k")) for n in t)
    m = hf_lfm2_from_gguf(path)
    assert m.config.layer_types == ["conv", "conv", "full_attention", "conv"]
    with torch.no_grad():
        out = m(torch.arange(1, 17)[None]).logits
    assert torch.isfinite(out).all() and out.std() > 0


# the real shapes' config.json values: (layers, hidden, intermediate, heads, KV heads, head size,
# sliding window, rope base)
REAL = {
    "qwen2.5-0.5b": ("qwen2", (24, 896, 4864, 14, 2, 64, 0, 1e6)),
    "qwen3-0.6b": ("qwen3", (28, 1024, 3072, 16, 8, 128, 0, 1e6)),
    "gemma3-1b": ("gemma3", (26, 1152, 6912, 4, 1, 256, 512, 1e6)),
}


def greedy(m, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """`n` greedy tokens after `ids`, decoded one a step on the prompt's cache, and the last
    step's logits."""
    tr = m.transformer
    pool = model_pool(m, 64, 1, True, len(ids))
    out = tr.w.head.full(hidden(tr, pool, [BatchSeq(0, ids, 0)]))[-1].float()
    got: list[int] = []
    for _ in range(n):
        got.append(int(out.argmax()))
        step = [BatchSeq(0, [got[-1]], len(ids) + len(got) - 1)]
        out = tr.w.head.full(hidden(tr, pool, step))[-1].float()
    return got, out


@pytest.mark.parametrize("name", ["qwen2-tiny", "qwen3-tiny", "gemma3-tiny"])
def test_a_new_arch_is_written_as_llama_cpp_converts_it_and_generates(tmp_path, name):
    """Each tiny shape of qwen2, qwen3 and gemma3: llama.cpp's keys and tensors for the arch
    (qwen2's F32 q/k/v biases, qwen3's and gemma3's per-head q/k norms and key/value length,
    gemma3's post-norms and sliding window, tied embeddings), loaded with those hyperparameters,
    and a greedy generation on the cache equal to the forward of the whole text."""
    shape = SHAPES[name]
    arch = name.removesuffix("-tiny")
    assert shape.arch == arch
    real = next(n for n, (a, _) in REAL.items() if a == arch)
    big = SHAPES[real]
    assert big.arch == arch and (big.n_layer, big.n_embd, big.n_ff, big.n_head, big.n_head_kv,
                                 big.hd, big.sliding_window, big.rope_base) == REAL[real][1]
    assert shape.n_layer <= 6 and shape.n_embd <= 256
    hd = shape.hd
    path = write(str(tmp_path / "m.gguf"), shape, "f16")
    r = gguf.GGUFReader(path)
    f = {k: v.contents() for k, v in r.fields.items() if k.startswith(arch + ".")}
    assert r.fields["general.architecture"].contents() == arch
    assert f[f"{arch}.attention.head_count_kv"] == shape.n_head_kv
    assert f[f"{arch}.rope.freq_base"] == 1e6
    assert f"{arch}.rope.dimension_count" not in f  # llama's only
    if arch == "qwen2":  # Qwen2.5's config.json has no head_dim: the converter writes none
        assert f"{arch}.attention.key_length" not in f and hd == shape.n_embd // shape.n_head
    else:
        assert hd != shape.n_embd // shape.n_head  # as in the real models
        assert f[f"{arch}.attention.key_length"] == f[f"{arch}.attention.value_length"] == hd
    assert f.get(f"{arch}.attention.sliding_window") == (16 if arch == "gemma3" else None)
    t = {x.name: x for x in r.tensors}
    f16, f32 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32
    assert "output.weight" not in t and "output_norm.weight" in t  # tied
    assert list(t["blk.1.attn_q.weight"].shape) == [shape.n_embd, shape.n_head * hd]
    assert list(t["blk.1.attn_k.weight"].shape) == [shape.n_embd, shape.n_head_kv * hd]
    assert list(t["blk.1.attn_output.weight"].shape) == [shape.n_head * hd, shape.n_embd]
    assert t["blk.1.attn_q.weight"].tensor_type == f16
    for n, rows in (("q", shape.n_head * hd), ("k", shape.n_head_kv * hd),
                    ("v", shape.n_head_kv * hd)):
        b = t.get(f"blk.1.attn_{n}.bias")
        assert (b is not None) == (arch == "qwen2")
        assert b is None or (list(b.shape) == [rows] and b.tensor_type == f32)
    for n in ("attn_q_norm", "attn_k_norm"):
        assert (f"blk.1.{n}.weight" in t) == (arch != "qwen2")
        assert arch == "qwen2" or (list(t[f"blk.1.{n}.weight"].shape) == [hd]
                                   and t[f"blk.1.{n}.weight"].tensor_type == f32)
    for n in ("post_attention_norm", "post_ffw_norm"):
        assert (f"blk.1.{n}.weight" in t) == (arch == "gemma3")
    assert len([n for n in t if n.endswith("ffn_down.weight")]) == shape.n_layer

    m = load_model(path, "f32")
    hp = m.hp
    assert (hp.arch, hp.n_layer, hp.n_embd, hp.n_ff, hp.n_head, hp.n_head_kv, hp.head_dim) == (
        arch, shape.n_layer, shape.n_embd, shape.n_ff, shape.n_head, shape.n_head_kv, hd)
    assert hp.rope_base == 1e6 and abs(hp.rms_eps - 1e-6) < 1e-12
    layer = m.transformer.w.layers[1]
    att = layer.mixer
    assert (att.wqkv.bias is not None) == (arch == "qwen2")
    assert (att.q_norm is not None and att.k_norm is not None) == (arch != "qwen2")
    assert att.q_norm is None or list(att.q_norm.shape) == [hd]
    post = [getattr(layer, n, None) for n in ("post_attn_norm", "post_ffn_norm")]
    assert (post[0] is not None) == (post[1] is not None) == (arch == "gemma3")
    if arch == "gemma3":  # llama.cpp's pattern: every 6th layer global, the local base 10000
        assert hp.n_swa == 16 and hp.swa_layers == (True,) * 5 + (False,)
        assert hp.rope_base_swa == 10000.0 and hp.act == "gelu_tanh"
    else:
        assert hp.n_swa == 0 and not any(hp.swa_layers)
    # longer than gemma3-tiny's window, so its sliding layers drop positions
    ids = m.tokenizer.encode("The quick brown fox jumps over the lazy dog, twice over; "
                             "then it sleeps in the sun until the evening comes again.")
    assert len(ids) > 16
    got, last = greedy(m, ids, 4)
    assert torch.isfinite(last).all() and last.std() > 0
    ref = logits(m, ids + got)  # the whole text at once, on a fresh cache
    assert (ref - last).abs().max() < 1e-3 * ref.abs().max()


def test_the_writer_refuses_a_window_for_an_arch_without_one(tmp_path):
    with pytest.raises(ValueError, match="sliding_window"):
        write(str(tmp_path / "m.gguf"), dataclasses.replace(SHAPES["qwen3-tiny"],
                                                            sliding_window=16))
    with pytest.raises(ValueError, match="sliding_window"):
        write(str(tmp_path / "m.gguf"), dataclasses.replace(SHAPES["gemma3-tiny"],
                                                            sliding_window=0))
    with pytest.raises(ValueError, match="architecture"):
        write(str(tmp_path / "m.gguf"), dataclasses.replace(SHAPES["llama-tiny"], arch="phi3"))


def test_the_command_refuses_an_unknown_type(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "m.gguf"), "--type", "q4_k_m"])
    assert "invalid choice" in capsys.readouterr().err
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("name", ["qwen3moe-tiny", "lfm2moe-tiny", "gpt-oss-tiny",
                                  "qwen35moe-tiny"])
def test_the_moe_shapes_are_written_as_llama_cpp_names_them_and_load(tmp_path, name):
    """The mixture-of-experts shapes: every tensor name one gguf-py knows for the
    architecture, the expert keys (LFM2-MoE's dense leading layers, sigmoid gating and its
    selection bias; gpt-oss's window, YaRN, sinks and biases; Qwen3.5 MoE's shared expert),
    the experts stacked [experts,
    rows, cols] in the weight type (gpt-oss's MXFP4) beside an F32 router, loaded with those
    sizes; the real shapes keep the real models' layer."""
    shape = SHAPES[name]
    arch = shape.arch
    oss = arch == "gpt-oss"
    path = write(str(tmp_path / "m.gguf"), shape, "mxfp4" if oss else "q8_0")
    r = gguf.GGUFReader(path)
    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    known = set()
    for kind in gguf.MODEL_TENSORS[arch_id]:
        pattern = gguf.TENSOR_NAMES[kind]
        known |= {pattern.format(bid=i) for i in range(shape.n_layer)}
    t = {x.name: x for x in r.tensors}
    assert {n.removesuffix(".weight").removesuffix(".bias") for n in t} <= known
    f = {k: v.contents() for k, v in r.fields.items() if k.startswith(arch + ".")}
    assert (f[f"{arch}.expert_count"], f[f"{arch}.expert_used_count"],
            f[f"{arch}.expert_feed_forward_length"]) == (shape.n_expert, shape.n_expert_used,
                                                         shape.n_ff_exp)
    first = shape.n_dense_lead
    gate = t[f"blk.{first}.ffn_gate_exps.weight"]
    assert list(gate.shape) == [shape.n_embd, shape.n_ff_exp, shape.n_expert]
    assert gate.tensor_type == (gguf.GGMLQuantizationType.MXFP4 if oss else
                                gguf.GGMLQuantizationType.Q8_0)
    assert t[f"blk.{first}.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    if arch == "qwen35moe":
        assert f["qwen35moe.expert_shared_feed_forward_length"] == shape.n_ff_shexp
        assert "qwen35moe.feed_forward_length" not in f
        assert list(t["blk.0.ffn_gate_inp_shexp.weight"].shape) == [shape.n_embd, 1]
        assert "blk.0.ffn_down_shexp.weight" in t
    if oss:
        assert f["gpt-oss.attention.sliding_window"] == shape.sliding_window
        assert f["gpt-oss.rope.scaling.type"] == "yarn"
        assert {"blk.1.attn_sinks.weight", "blk.1.attn_output.bias", "blk.1.ffn_gate_inp.bias",
                "blk.1.ffn_down_exps.bias"} <= set(t)
    if arch == "lfm2moe":
        assert f["lfm2moe.leading_dense_block_count"] == 1
        assert f["lfm2moe.expert_gating_func"] == 2
        assert "blk.0.ffn_gate.weight" in t and "blk.0.ffn_gate_inp.weight" not in t
        assert f"blk.{first}.exp_probs_b.bias" in t
    m = load_model(path, "bf16")
    assert m.hp.moe is not None and (m.hp.moe.n_expert, m.hp.moe.n_used, m.hp.moe.n_ff,
                                     m.hp.moe.n_dense_lead) == (shape.n_expert,
                                                                shape.n_expert_used,
                                                                shape.n_ff_exp, first)
    real = SHAPES[{"qwen3moe": "qwen3moe-30b-a3b", "lfm2moe": "lfm2moe-8b-a1b",
                   "gpt-oss": "gpt-oss-20b", "qwen35moe": "qwen35moe-35b-a3b"}[arch]]
    assert (real.n_embd, real.n_expert, real.n_expert_used, real.n_ff_exp) == {
        "qwen3moe": (2048, 128, 8, 768), "lfm2moe": (2048, 32, 4, 1792),
        "gpt-oss": (2880, 32, 4, 2880), "qwen35moe": (2048, 256, 8, 512)}[arch]
