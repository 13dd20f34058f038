"""Qwen 3.5 (dense) GGUF files as llama.cpp's converter writes them, and the HF reference built
from one (tests/qwen35_hf.py):

- the tiny random files (tests/tiny_gguf.py) in each layout a converted file can have (as many
  value heads as key heads or more, the layer pattern as an array or by the interval only, with
  an MTP block or without) load every parameter of transformers' Qwen3_5ForCausalLM and run;
- a random transformers model written through the converter's transforms (write_qwen35_from_hf)
  and read back gives its logits: the reader undoes exactly what the converter does. (That
  writer's keys, tensor names, shapes, types and bytes were compared by hand with those of
  llama.cpp's convert_hf_to_gguf.py on the same model: equal.)
- the random writers (tiny_gguf's, bench/synth_model.py's) lay a file out as that writer does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from radixserve.bench.synth_model import SHAPES, write
from radixserve.model.gguf_check import read_gguf
from tests.qwen35_hf import (hf_qwen35_from_gguf, qwen35_config_from_gguf, random_qwen35,
                             random_qwen35_mtp, untile_v_heads)
from tests.tiny_gguf import (qwen35_sections, tile_v_heads, write_qwen35_from_hf,
                             write_tiny_gguf)

IDS = [(37 * i * i + 11 * i + 300) % 40000 + 200 for i in range(40)]
LIN, FULL = "linear_attention", "full_attention"
N_VOCAB = 49152  # the default model's, whose tokenizer the files carry


def fields(path: str) -> dict:
    # the project's reader: gguf-py's values (tests/model/test_malformed_gguf.py holds them
    # equal), without its seconds for the 49k-token vocabulary
    return {k: v.contents() for k, v in read_gguf(path).fields.items()}


def tensors(path: str) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in read_gguf(path).tensors}


def logits(model: transformers.Qwen3_5ForCausalLM, ids: list[int] = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


# write_tiny_gguf's qwen35 options -> (the trunk's layer types, MTP blocks)
LAYOUTS = {
    "nk<nv-array": ({}, [LIN, LIN, LIN, FULL], 0),
    "nk=nv-interval": ({"ssm_heads": (2, 2), "recurrent_key": False}, [LIN, LIN, LIN, FULL], 0),
    "mtp-pattern": ({"mtp": True, "recurrent": (True, False, True, False)},
                    [LIN, FULL, LIN, FULL], 1),
    "interval2-mtp-no-array": ({"mtp": True, "full_attention_interval": 2,
                                "recurrent_key": False}, [LIN, FULL, LIN, FULL], 1),
    "f32-untied-wide-heads": ({"quantize": False, "tied": False, "head_dim": 32, "n_rot": 16,
                               "ssm_heads": (3, 6), "n_layer": 5},
                              [LIN, LIN, LIN, FULL, LIN], 0),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_tiny_file_loads_every_hf_parameter_and_runs(tmp_path: Path, name: str):
    kw, types, n_mtp = LAYOUTS[name]
    path = write_tiny_gguf(str(tmp_path / "q.gguf"), arch="qwen35", seed=3, **kw)
    f, t = fields(path), tensors(path)
    n_layer = len(types)
    assert f["general.architecture"] == "qwen35"
    assert f["qwen35.block_count"] == n_layer + n_mtp
    assert f.get("qwen35.nextn_predict_layers") == (n_mtp or None)
    flags = f.get("qwen35.attention.recurrent_layers")
    if kw.get("recurrent_key", True):
        assert flags == [x == LIN for x in types] + [False] * n_mtp
    else:
        assert flags is None
    nk, nv = kw.get("ssm_heads", (2, 4))
    hd, n_rot = kw.get("head_dim", 16), kw.get("n_rot", 8)
    assert (f["qwen35.ssm.group_count"], f["qwen35.ssm.time_step_rank"]) == (nk, nv)
    assert f["qwen35.ssm.inner_size"] == nv * 16 and f["qwen35.ssm.state_size"] == 16
    assert f["qwen35.attention.key_length"] == f["qwen35.attention.value_length"] == hd
    assert f["qwen35.rope.dimension_count"] == n_rot
    assert f["qwen35.rope.dimension_sections"] == list(qwen35_sections(n_rot))
    assert sum(f["qwen35.rope.dimension_sections"]) * 2 == n_rot
    assert ("output.weight" in t) == (kw.get("tied", True) is False)
    for i, kind in enumerate(types):
        assert (f"blk.{i}.attn_qkv.weight" in t) == (kind == LIN)
        assert (f"blk.{i}.attn_q.weight" in t) == (kind == FULL)
        assert f"blk.{i}.post_attention_norm.weight" in t and f"blk.{i}.ffn_norm.weight" not in t
    full = types.index(FULL)
    assert list(t[f"blk.{full}.attn_q.weight"].shape) == [64, 2 * 4 * hd]  # query + gate rows
    assert list(t["blk.0.ssm_conv1d.weight"].shape) == [4, 2 * nk * 16 + nv * 16]
    assert t["blk.0.ssm_conv1d.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert (np.asarray(t["blk.0.ssm_a"].data) < 0).all()
    mtp = [n for n in t if n.startswith(f"blk.{n_layer}.")]
    if n_mtp:  # a full-attention block and the MTP head's own, which the reference skips
        assert {f"blk.{n_layer}.nextn.{x}.weight" for x in
                ("eh_proj", "enorm", "hnorm", "shared_head_norm")} <= set(mtp)
        assert f"blk.{n_layer}.attn_q.weight" in mtp
        assert list(t[f"blk.{n_layer}.nextn.eh_proj.weight"].shape) == [128, 64]
    else:
        assert mtp == []

    model = hf_qwen35_from_gguf(path)  # raises if a parameter were not in the file
    c = model.config
    assert c.layer_types == types and c.num_hidden_layers == n_layer
    assert (c.linear_num_key_heads, c.linear_num_value_heads) == (nk, nv)
    assert c.head_dim == hd and c.rope_parameters["partial_rotary_factor"] == n_rot / hd
    assert c.tie_word_embeddings == kw.get("tied", True)
    out = logits(model)
    assert out.shape == (len(IDS), N_VOCAB)
    assert torch.isfinite(out).all() and out.std() > 0.1


@pytest.mark.parametrize("drop, hf", [("blk.1.ssm_a", "layers.1.linear_attn.A_log"),
                                      ("blk.3.attn_k_norm.weight", "layers.3.self_attn.k_norm"),
                                      ("blk.4.nextn.enorm.weight", None)])
def test_the_reference_refuses_a_file_short_of_a_parameter(tmp_path: Path, drop: str, hf,
                                                           monkeypatch: pytest.MonkeyPatch):
    """Every HF parameter must come from the file; the MTP block's tensors are not HF's."""
    add = gguf.GGUFWriter.add_tensor

    def add_but_one(self: gguf.GGUFWriter, name: str, *args, **kw) -> None:
        if name != drop:
            add(self, name, *args, **kw)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_but_one)
    short = write_tiny_gguf(str(tmp_path / "q.gguf"), arch="qwen35", mtp=True)
    assert drop not in tensors(short)
    if hf is None:
        hf_qwen35_from_gguf(short)
        return
    with pytest.raises(ValueError, match=f"parameters not in the file .*{hf}"):
        hf_qwen35_from_gguf(short)


def test_v_heads_are_tiled_as_the_converter_tiles_them():
    """_reorder_v_heads's order: 2 key heads of 2 value heads each, grouped [k0v0, k0v1, k1v0,
    k1v1] -> tiled [k0v0, k1v0, k0v1, k1v1] (each head `size` rows); and back."""
    a = np.arange(8 * 3).reshape(8, 3)
    tiled = tile_v_heads(a, 0, nk=2, per_k=2, size=2)
    assert tiled[:, 0].tolist() == [0, 3, 12, 15, 6, 9, 18, 21]
    assert np.array_equal(untile_v_heads(tiled, 0, nk=2, per_k=2, size=2), a)
    cols = tile_v_heads(a.T, 1, nk=2, per_k=2, size=2)
    assert np.array_equal(cols, tiled.T)
    b = np.arange(12)  # 3 key heads of 4 value heads each, one value a head
    assert np.array_equal(untile_v_heads(tile_v_heads(b, 0, 3, 4, 1), 0, 3, 4, 1), b)
    assert tile_v_heads(b, 0, 3, 4, 1).tolist() == [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]


def tiny_config(nk: int, nv: int, tied: bool = True, **kw) -> transformers.Qwen3_5TextConfig:
    """A small Qwen 3.5 whose attention head (32) is not n_embd / n_head (16)."""
    args = dict(vocab_size=N_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                linear_num_key_heads=nk, linear_num_value_heads=nv, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                                 "mrope_interleaved": True},
                tie_word_embeddings=tied)
    return transformers.Qwen3_5TextConfig(**(args | kw))


# f32 written, f32 read: the one rounding is A_log's, through -exp and log (and norm weights'
# +1 / -1); measured max |difference| over the logits (largest ~20): 4e-5
ROUND_TRIP_BOUND = 2e-4


@pytest.mark.parametrize("nk, nv, tied, mtp, types", [
    (2, 2, True, False, None),
    (2, 4, True, True, None),
    (2, 4, False, False, [LIN, FULL, LIN, FULL]),
    (2, 6, True, True, [FULL, LIN, LIN, LIN]),
])
def test_the_reference_undoes_the_converters_transforms(tmp_path: Path, nk, nv, tied, mtp,
                                                        types):
    """A random transformers Qwen 3.5 written as the converter writes it (norms +1, A_log ->
    -exp, value heads tiled, conv kernels squeezed, an MTP head), read back by the reference:
    the same logits, every parameter equal up to A_log's rounding."""
    cfg = tiny_config(nk, nv, tied, **({"layer_types": types} if types else {}))
    model = random_qwen35(cfg, seed=nk * 10 + nv)
    path = write_qwen35_from_hf(str(tmp_path / "q.gguf"), model,
                                random_qwen35_mtp(cfg, 9) if mtp else None)
    f, t = fields(path), tensors(path)
    assert f["qwen35.block_count"] == 4 + mtp
    assert f["qwen35.rope.dimension_count"] == 8 and f["qwen35.rope.dimension_sections"] == [
        2, 1, 1, 0]
    assert f["qwen35.attention.recurrent_layers"] == [x == LIN for x in cfg.layer_types] + (
        [False] if mtp else [])
    assert all(x.tensor_type == gguf.GGMLQuantizationType.F32 for x in t.values())
    lin = cfg.layer_types.index(LIN)
    a_log = model.model.layers[lin].linear_attn.A_log.detach().numpy()
    stored = np.asarray(t[f"blk.{lin}.ssm_a"].data)
    assert np.allclose(stored, tile_v_heads(-np.exp(a_log), 0, nk, nv // nk, 1), rtol=1e-6)
    if nk != nv:  # the stored order is not HF's: the reader must put it back
        assert not np.allclose(stored, -np.exp(a_log))

    back = hf_qwen35_from_gguf(path)
    assert back.config.layer_types == cfg.layer_types
    want = dict(model.named_parameters())
    for name, p in back.named_parameters():
        assert torch.allclose(p, want[name], rtol=1e-5, atol=1e-6), name
    err = (logits(back) - logits(model)).abs().max().item()
    assert err < ROUND_TRIP_BOUND, err


def layout(path: str) -> tuple[dict, dict]:
    """The file's qwen35.* keys, and each tensor's (shape, type)."""
    f = {k: v for k, v in fields(path).items() if k.startswith("qwen35.")}
    return f, {n: (x.shape.tolist(), x.tensor_type) for n, x in tensors(path).items()}


def test_the_tiny_writer_lays_a_file_out_as_the_converter(tmp_path: Path):
    """write_tiny_gguf's defaults with an MTP block: the keys and the tensors' names and shapes
    of the converter's writer for the config the file describes (types aside: the tiny file
    mixes Q8_0 and Q4_1)."""
    path = write_tiny_gguf(str(tmp_path / "tiny.gguf"), arch="qwen35", mtp=True)
    cfg, _ = qwen35_config_from_gguf(path)
    cfg.max_position_embeddings = 2048
    ref = write_qwen35_from_hf(str(tmp_path / "ref.gguf"), random_qwen35(cfg),
                               random_qwen35_mtp(cfg), wtype="f16")
    (fa, ta), (fb, tb) = layout(path), layout(ref)
    assert fa == fb
    assert {n: s for n, (s, _) in ta.items()} == {n: s for n, (s, _) in tb.items()}


def test_the_bench_shapes_are_qwen35s_and_write_as_the_converter(tmp_path: Path):
    """SHAPES' qwen35 entries hold Qwen3.5-0.8B's and -4B's config.json values, and the tiny
    one writes, at f16 and q8_0, the keys, tensors, shapes and types the converter's writer
    gives its config; HF runs it."""
    want = {"qwen35-0.8b": (24, 1024, 3584, 8, 2, 256, 64, 16, 16, 128),
            "qwen35-4b": (32, 2560, 9216, 16, 4, 256, 64, 16, 32, 128)}
    for name, dims in want.items():
        s = SHAPES[name]
        assert (s.n_layer, s.n_embd, s.n_ff, s.n_head, s.n_head_kv, s.hd, s.n_rot,
                s.ssm_k_heads, s.ssm_v_heads, s.ssm_head_dim) == dims
        assert (s.arch, s.attn_interval, s.ssm_conv, s.rope_sections, s.rope_base,
                s.rms_eps, s.n_ctx_train, s.nextn) == (
            "qwen35", 4, 4, (11, 11, 10, 0), 1e7, 1e-6, 262144, 0)
    shape = SHAPES["qwen35-tiny"]
    assert shape.ssm_v_heads > shape.ssm_k_heads and shape.hd != shape.n_embd // shape.n_head
    for wtype, nextn in (("f16", 0), ("q8_0", 1)):
        sh = dataclasses.replace(shape, nextn=nextn)
        path = write(str(tmp_path / f"{wtype}.gguf"), sh, wtype)
        cfg, _ = qwen35_config_from_gguf(path)
        ref = write_qwen35_from_hf(str(tmp_path / f"ref-{wtype}.gguf"), random_qwen35(cfg),
                                   random_qwen35_mtp(cfg) if nextn else None, wtype=wtype)
        assert layout(path) == layout(ref)
    out = logits(hf_qwen35_from_gguf(path))
    assert torch.isfinite(out).all() and out.std() > 0
