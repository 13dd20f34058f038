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


def test_the_command_refuses_an_unknown_type(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "m.gguf"), "--type", "q4_k_m"])
    assert "invalid choice" in capsys.readouterr().err
    assert not (tmp_path / "m.gguf").exists()
