"""Qwen3.5 (Gated DeltaNet + gated attention): our forward equals HF transformers'
Qwen3_5ForCausalLM on the same GGUF, a token's bits do not depend on chunking or on the
sequences beside it in the default dtype (the C delta-rule step and the torch one), the state
cells hold exactly the recomputed state, and a file whose metadata and tensors disagree is
refused naming the key or tensor.

The tiny models are random-weight GGUFs written the way llama.cpp's converter writes qwen35
(tests/tiny_gguf.py); the HF reference is built from the same file (tests/qwen35_hf.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from radixserve.engine.batch import BatchSeq, forward
from radixserve.memory.pool.conv import ShiftRefused
from radixserve.memory.pool.recurrent import RecurrentPool
from radixserve.memory.pool.state import fingerprint_of, get_state, get_swa_state, set_state, \
    set_swa_state
from radixserve.model.hparams import UnsupportedModelError
from radixserve.model.loader import Model, load_model
from tests.conftest import model_pool
from tests.model.kernel_variants import VARIANTS, config_for
from tests.model.test_lfm2 import (TOKENS, check_against_hf,
                                   check_bits_do_not_depend_on_chunking_or_batch,
                                   rewrite)
from tests.model.test_lfm2 import logits_in_chunks as lfm2_chunks
from tests.qwen35_hf import hf_qwen35_from_gguf
from tests.tiny_gguf import write_tiny_gguf

N = len(TOKENS)


def one_state_cell(pool: Any, n: int) -> None:
    """The pool holds a Qwen3.5 sequence's state in one cell, after its last token."""
    assert isinstance(pool, RecurrentPool) and pool.swa.seq_positions(0) == [n - 1]


def logits_in_chunks(m: Model, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """test_lfm2's, each chunk leaving one state cell."""
    return lfm2_chunks(m, ids, chunks, one_state_cell)


@pytest.fixture(scope="module", params=[(2, 2, False), (2, 4, False), (2, 4, True)],
                ids=["nk=nv", "nk<nv", "nk<nv-quantized"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    nk, nv, quantize = request.param
    d = tmp_path_factory.mktemp("qwen35")
    return write_tiny_gguf(str(d / "tiny-qwen35.gguf"), arch="qwen35", ssm_heads=(nk, nv),
                           seed=7 + nv, quantize=quantize)


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("qwen35b")
    return write_tiny_gguf(str(d / "tiny-qwen35.gguf"), arch="qwen35", ssm_heads=(2, 4), seed=3)


# f32 against HF's f32: measured max abs error over every position's logits (largest logit
# 23-29) in one chunk / chunks of 1 / of 7: 1.0e-4 / 1.1e-4 / 1.1e-4 (nk = nv), 1.3e-4 /
# 3.4e-4 / 2.9e-4 (nk < nv), 8.6e-5 / 6.6e-5 / 5.5e-5 (quantized); HF runs its chunked
# delta rule over the prompt, whose sums are in another order than the token-by-token
# recurrence here. The bound is ~3x the largest: rounding noise, nothing more
HF_BOUND = 1e-3


@pytest.mark.family_reference("qwen35")
def test_tiny_qwen35_matches_hf(tiny: str):
    """f32: every position's logits within HF_BOUND of HF's, in one chunk and in chunks of 1
    and 7 (the state carried in the pool's state cells between chunks); greedy continuation
    equal to HF's generate."""
    m = load_model(tiny, "f32")
    assert m.hp.n_layer_rec == 3 and m.hp.n_rot == 8 < m.hp.head_dim
    check_against_hf(m, hf_qwen35_from_gguf(tiny), HF_BOUND, logits_in_chunks)


def test_an_mtp_block_is_not_run(tmp_path: Path):
    """A file with a multi-token-prediction block after the trunk (block_count counts it,
    nextn_predict_layers says so) computes the trunk's logits: those of the same file
    without it."""
    kw = dict(arch="qwen35", ssm_heads=(2, 4), seed=11, quantize=False)
    plain = load_model(write_tiny_gguf(str(tmp_path / "a.gguf"), **kw), "f32")
    mtp = load_model(write_tiny_gguf(str(tmp_path / "b.gguf"), mtp=True, **kw), "f32")
    assert mtp.hp.n_layer == plain.hp.n_layer == 4
    assert torch.equal(logits_in_chunks(mtp, TOKENS[:20], [20]),
                       logits_in_chunks(plain, TOKENS[:20], [20]))


def test_the_layer_pattern_from_the_flags_or_the_interval(tmp_path: Path):
    a = load_model(write_tiny_gguf(str(tmp_path / "a.gguf"), arch="qwen35", n_layer=4,
                                   recurrent=(True, False, True, True)), "f32")
    assert a.hp.rec_layers == (True, False, True, True)
    b = load_model(write_tiny_gguf(str(tmp_path / "b.gguf"), arch="qwen35", n_layer=4,
                                   full_attention_interval=2, recurrent_key=False), "f32")
    assert b.hp.rec_layers == (True, False, True, False)


@pytest.mark.parametrize("variant", VARIANTS)
def test_bits_do_not_depend_on_chunking_or_batch(tiny_bf16: str, variant: str):
    """bf16 on each kernel variant (the C delta-rule step): chunks of 1, 7 and 60 give every position's logits bit for bit, and so does the prompt
    computed beside another sequence in the same steps."""
    m = load_model(tiny_bf16, "bf16", kernels=config_for(variant), deterministic="on")
    assert m.deterministic
    check_bits_do_not_depend_on_chunking_or_batch(m, logits_in_chunks)


def test_a_state_restored_resumes_exactly(tiny_bf16: str):
    """The state cell's bytes (a checkpoint: get_swa_state) and the whole sequence's (the
    whole-prompt cache: get_state) restored into a fresh sequence continue with the logits of
    the uncached computation, bit for bit; a sequence truncated inside its tokens holds no
    state (it was only kept after the last token); a shift is refused."""
    m = load_model(tiny_bf16, "bf16", deterministic="on")
    whole = logits_in_chunks(m, TOKENS, [N])
    pool = model_pool(m, 256, 2, True, 64)
    fp = fingerprint_of(pool, m.hp.arch)
    forward(m.transformer, pool, [BatchSeq(0, TOKENS[:40], 0, 1)])
    ck, state = get_swa_state(pool, 0, fp), get_state(pool, 0, fp)
    assert len(ck) >= m.layout.state_bytes
    # the checkpoint: the K/V rows are shared from seq 0, the state written
    pool.seq_cp(0, 1, 0, 40)
    pool.swa.seq_rm(1)
    set_swa_state(pool, 1, ck, fp)
    a = forward(m.transformer, pool, [BatchSeq(1, TOKENS[40:], 40, N - 40)])
    assert torch.equal(a, whole[40:])
    pool.seq_rm(1)
    assert set_state(pool, 1, state, fp) == 40
    b = forward(m.transformer, pool, [BatchSeq(1, TOKENS[40:], 40, N - 40)])
    assert torch.equal(b, whole[40:])
    pool.seq_rm(0, 30, -1)
    assert pool.seq_len(0) == 30 and pool.swa.seq_positions(0) == []
    with pytest.raises(ShiftRefused):
        pool.seq_add(1, 5, -1, -2)
    pool.check()


def test_refusals_name_the_key_or_tensor(tmp_path: Path):
    src = write_tiny_gguf(str(tmp_path / "ok.gguf"), arch="qwen35", quantize=False)
    load_model(src, "f32")
    bad_cases = [
        (dict(drop_keys=("qwen35.ssm.conv_kernel",)), "qwen35.ssm.conv_kernel"),
        (dict(drop_keys=("qwen35.rope.dimension_sections",)), "rope.dimension_sections"),
        (dict(set_keys={"qwen35.ssm.time_step_rank": 3}), "time_step_rank a multiple of group_count"),
        (dict(tensors={"blk.0.ssm_a": np.zeros(3, np.float32)}), "'blk.0.ssm_a' has shape [3]"),
        (dict(tensors={"blk.3.attn_q.weight": np.zeros((64, 64), np.float32)}),
         "'blk.3.attn_q.weight' has shape [64, 64]"),
        (dict(tensors={"blk.1.attn_qkv.weight": np.zeros((10, 64), np.float32)}),
         "'blk.1.attn_qkv.weight'"),
    ]
    vocab = {"qwen35.vocab_size": load_model(src, "f32").hp.n_vocab}  # rewrite drops tokens
    for i, (kw, words) in enumerate(bad_cases):
        kw = {**kw, "set_keys": {**vocab, **kw.get("set_keys", {})}}
        bad = rewrite(src, tmp_path / f"bad{i}.gguf", arch="qwen35", **kw)
        with pytest.raises(UnsupportedModelError, match=words.replace("[", r"\[")):
            load_model(bad, "f32")


def test_qwen3_next_is_refused_by_name(tmp_path: Path):
    src = write_tiny_gguf(str(tmp_path / "ok.gguf"), arch="qwen35", quantize=False)
    with pytest.raises(UnsupportedModelError, match="'qwen3next': .*not supported yet"):
        load_model(rewrite(src, tmp_path / "moe.gguf", arch="qwen3next"), "f32")
