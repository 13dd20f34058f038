"""The output head and the token embedding held in the file's own blocks (head.py's OutputHead
over a qmm.QuantMatrix, tensors.py's TensorLoader.rows): the same logits, shortlists and embedding
rows as the f32 matrix they replace, bit for bit, on every kernel variant; the loaded models
hold their tied Q8_0 tables so (Gemma 3's: 178 MB where the f32 copy took 671 MB).

Blocks are made in the test (tests/model/test_qmm.py's random_blocks). The f32 reference is
gguf-py's dequantization itself, which qmm's decoded rows equal bit for bit (Q8_0, Q6_K, F16) or
within one f32 rounding (Q4_K's fused multiply-add: there the f32 head takes qmm's rows, which
is what "the same dots over the same rows" claims)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from radixserve.model import qmm
from radixserve.model.head import OutputHead, RowNeed
from tests.model.kernel_variants import default_kernels, variant, variant_kernels  # noqa: F401
from tests.model.test_qmm import random_blocks

Q = gguf.GGMLQuantizationType
V, D = 9000, 256  # more rows than one decoded chunk (head.py's _CHUNK), and a ragged last one


def _heads(t: Q, variant: str,
           seed: int = 0) -> tuple[OutputHead, OutputHead, torch.Tensor]:
    """The same table as blocks and as f32 rows (gguf-py's; qmm's for Q4_K), shortlists on,
    on `variant`'s kernels, and hidden states with an outlier dimension."""
    kern = variant_kernels(variant)
    assert kern is not None
    raw = random_blocks(t, V, D, seed)
    mat = qmm.QuantMatrix(kern.lib, int(t), torch.from_numpy(raw), D)
    w = torch.from_numpy(gguf.quants.dequantize(raw, t).reshape(V, D).astype(np.float32))
    if t == Q.Q4_K:
        # qmm decodes d sc q - dmin mn as one fused multiply-add where gguf-py rounds twice:
        # within one f32 rounding of gguf-py's rows, and the f32 head takes qmm's own rows so
        # "the same dots over the same rows" can be checked bit for bit
        got = mat.rows()
        assert ((got - w).abs() <= w.abs() * 2.0**-23 + 2.0**-126).all()
        w = got
    else:  # d q, d sc q and the halves' floats are exact or rounded as gguf-py rounds them
        assert torch.equal(w, mat.rows())
    h = torch.randn(12, D, generator=torch.Generator().manual_seed(seed + 1)) * 4
    h[:, 5] *= 10
    return OutputHead(mat, shortlist=True, kern=kern), OutputHead(w, shortlist=True, kern=kern), h


@pytest.mark.parametrize("t", [Q.Q8_0, Q.Q6_K, Q.Q4_K, Q.F16], ids=lambda t: t.name)
def test_blocks_give_the_f32_heads_logits(variant: str, t: Q) -> None:
    blocks, dense, h = _heads(t, variant)
    assert blocks.w is None and blocks.nbytes < dense.nbytes
    full = dense.full(h)
    assert torch.equal(blocks.full(h), full)
    # the int8 copy and its bound come from the same rows: the same shortlist pass
    assert torch.equal(blocks.q8, dense.q8) and torch.equal(blocks.err, dense.err)
    for top in (1, 40):
        got = blocks.logits(h, [RowNeed(top)] * len(h))
        assert torch.equal(got, dense.logits(h, [RowNeed(top)] * len(h))), top
        want = torch.topk(full, top, dim=1)
        have = torch.topk(got, top, dim=1)
        assert torch.equal(have.indices, want.indices) and torch.equal(have.values, want.values)
    # rows wanted beside the shortlist (a penalized history) are exact too
    extra = [3, 4000, V - 1]
    row = blocks.logits(h[:1], [RowNeed(1, extra=extra)])[0]
    assert torch.equal(row[extra], full[0, extra])
    tokens = torch.tensor([0, 17, V - 1, 17])
    assert torch.equal(blocks.embed(tokens), dense.embed(tokens))


def test_a_blocks_head_without_a_shortlist_is_the_full_head(variant: str) -> None:
    blocks, dense, h = _heads(Q.Q8_0, variant, 3)
    plain = OutputHead(blocks.blocks, shortlist=False, kern=blocks.dots)
    assert plain.q8 is None
    assert torch.equal(plain.logits(h, [RowNeed(1)] * len(h)), dense.full(h))


def test_loaded_models_hold_their_tied_tables_in_blocks(default_path: str) -> None:
    """The default model's tied Q8_0 table, loaded: held as the file's bytes (34 a 32
    weights), no f32 copy, the embedding rows gguf-py's dequantization; Gemma 3's tied table
    is read the same way (178 MB). The dequant path keeps its f32 matrix."""
    from radixserve.model.default_model import gemma3_model_path
    from radixserve.model.loader import load_model
    from radixserve.model.tensors import TensorLoader
    from tests.model.test_i8_tiles import _gemma_reader

    m = load_model(default_path, "bf16")
    w = m.transformer.w
    assert w.head.w is None and isinstance(w.head.blocks, qmm.QuantMatrix)
    assert w.tok_embd is None  # tied: the embedding is the head's rows
    n, d = w.head.shape
    assert w.head.blocks.raw.nbytes == n * d // 32 * 34
    reader = gguf.GGUFReader(default_path)
    t = next(x for x in reader.tensors if x.name == "token_embd.weight")
    assert t.tensor_type == Q.Q8_0
    ids = torch.tensor([0, 1, 100, n - 1])
    ref = gguf.quants.dequantize(np.asarray(t.data)[ids.numpy()], t.tensor_type)
    assert torch.equal(w.embed(ids), torch.from_numpy(ref))
    assert isinstance(TensorLoader(reader, torch.float32, packed=False).rows("token_embd.weight"),
                      torch.Tensor)

    g = TensorLoader(_gemma_reader(gemma3_model_path()), torch.bfloat16, packed=True,
                     kern=default_kernels())
    table = g.rows("token_embd.weight")
    assert isinstance(table, qmm.QuantMatrix) and table.qtype == int(Q.Q8_0)
    assert (table.n, table.k) == (262144, 640) and table.raw.nbytes == 262144 * 20 * 34
