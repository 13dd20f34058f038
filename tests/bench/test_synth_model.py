"""The synthetic-model writer (bench/synth_model.py): the files it writes load with the shape
asked for and run through the engine's every weight path alike."""

from __future__ import annotations

import gguf
import pytest
import torch

from radixserve.bench.synth_model import SHAPES, main, write
from radixserve.engine.batch import BatchSeq, hidden, model_pool
from radixserve.model.loader import load_model

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


def test_the_command_refuses_an_unknown_type(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "m.gguf"), "--type", "q4_k_m"])
    assert "invalid choice" in capsys.readouterr().err
    assert not (tmp_path / "m.gguf").exists()
