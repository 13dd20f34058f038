"""Mixture-of-experts families, Qwen3 MoE (`qwen3moe`) and LFM2-MoE (`lfm2moe`): our forward
equals HF transformers' Qwen3MoeForCausalLM and Lfm2MoeForCausalLM on the same weights (f32
and Q8_0 experts; LFM2-MoE with its dense first layer, sigmoid gating and selection bias); the
routing (softmax, top-k, renormalized weights, ties) equals HF's router; only the chosen experts
run; a token's bits do not depend on chunking or on the tokens beside it, which route to
overlapping experts, on every kernel variant; expert tensors mapped from the file give the bits
of the same experts copied into tiles; a file whose metadata and tensors disagree is refused
naming the key or tensor.

The GGUFs are written from random HF models the way llama.cpp's converter writes them
(tests/moe_hf.py)."""

from __future__ import annotations

import mmap
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from radixserve.engine.batch import BatchSeq, forward
from radixserve.model.hparams import MoeDims, UnsupportedModelError
from radixserve.model.kernel_routes import FAST_GATHER
from radixserve.model.loader import Model, load_model
from radixserve.model import loader, moe
from radixserve.model.moe import MoEFFN, exact_sigmoid, route
from tests.conftest import model_pool
from tests.model.kernel_variants import VARIANTS, config_for
from tests.model.test_lfm2 import (TOKENS, check_against_hf,
                                   check_bits_do_not_depend_on_chunking_or_batch,
                                   check_refusals, rewrite)
from tests.model.test_lfm2 import logits_in_chunks as lfm2_chunks
from tests.moe_hf import (random_moe, tiny_gptoss_config, tiny_lfm2moe_config,
                          tiny_qwen3moe_config, write_gptoss_from_hf, write_lfm2moe_from_hf,
                          write_qwen3moe_from_hf)

N = len(TOKENS)
N_VOCAB = tiny_qwen3moe_config().vocab_size


def logits_in_chunks(m: Model, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Every position's logits, the prompt fed in `chunks` (sizes) through a fresh pool."""
    pool = model_pool(m, 256, 1, True, 64)
    out, pos = [], 0
    for c in chunks:
        part = ids[pos:pos + c]
        out.append(forward(m.transformer, pool, [BatchSeq(0, part, pos, len(part))]))
        pos += len(part)
    assert pos == len(ids)
    return torch.cat(out)


def random_lfm2moe(seed: int) -> transformers.PreTrainedModel:
    """random_moe's LFM2-MoE with an expert bias that matters (N(0, 0.1); HF's init is 0)."""
    hf = random_moe(tiny_lfm2moe_config(), seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return hf


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Qwen3 MoE with Q8_0 matrices (the experts on the 8-bit tiles)."""
    d = tmp_path_factory.mktemp("qwen3moe")
    return write_qwen3moe_from_hf(str(d / "q3moe.gguf"),
                                  random_moe(tiny_qwen3moe_config(), seed=11), "q8_0")


@pytest.fixture(scope="module")
def tiny_lfm2moe(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny LFM2-MoE with Q8_0 matrices."""
    d = tmp_path_factory.mktemp("lfm2moe")
    return write_lfm2moe_from_hf(str(d / "lfm2moe.gguf"), random_lfm2moe(12), "q8_0")


# f32 against HF's f32: measured max abs error over every position's logits (largest ~5) in
# one chunk / chunks of 1 / of 7: 2.7e-6 / 3.5e-6 / 3.5e-6 (f32 weights), 3.3e-6 / 3.3e-6 /
# 3.2e-6 (Q8_0); the bound is ~10x the largest: rounding noise, nothing more
HF_BOUND = 3e-5


@pytest.mark.family_reference("qwen3moe")
@pytest.mark.parametrize("wtype", ["f32", "q8_0"])
def test_tiny_qwen3moe_matches_hf(tmp_path: Path, wtype: str):
    """f32: every position's logits within HF_BOUND of HF's, in one chunk and in chunks of 1
    and 7; greedy continuation equal to HF's generate. 8 experts, 3 used a token."""
    hf = random_moe(tiny_qwen3moe_config(), seed=3)
    m = load_model(write_qwen3moe_from_hf(str(tmp_path / "m.gguf"), hf, wtype), "f32")
    assert m.hp.moe == MoeDims(8, 3, 32, "softmax", True, 0.0)
    check_against_hf(m, hf, HF_BOUND, logits_in_chunks)


# f32 against HF's f32: measured max abs error over every position's logits (largest ~22) in
# one chunk / chunks of 1 / of 7: 1.6e-5 / 2.7e-5 / 2.0e-5 (f32 weights), 1.7e-5 / 3.3e-5 /
# 2.1e-5 (Q8_0), as dense LFM2's; the bound is LFM2's (tests/model/test_lfm2.py)
LFM2_BOUND = 1e-4


@pytest.mark.family_reference("lfm2moe")
@pytest.mark.parametrize("wtype", ["f32", "q8_0"])
def test_tiny_lfm2moe_matches_hf(tmp_path: Path, wtype: str):
    """As the Qwen3 MoE test, on LFM2's conv and attention layers: a dense first FFN, then 8
    experts (3 a token) chosen by sigmoid scores plus the expert bias, weighted by the
    scores alone, renormalized."""
    hf = random_lfm2moe(3)
    m = load_model(write_lfm2moe_from_hf(str(tmp_path / "m.gguf"), hf, wtype), "f32")
    assert m.hp.moe == MoeDims(8, 3, 32, "sigmoid", True, 0.0, 1)
    assert not isinstance(m.transformer.w.layers[0].ffn, MoEFFN)
    assert all(isinstance(b.ffn, MoEFFN) and b.ffn.select_bias is not None
               for b in m.transformer.w.layers[1:])
    check_against_hf(m, hf, LFM2_BOUND, lfm2_chunks)


def test_routing_equals_hf_router_with_ties():
    """Our route() against HF's Qwen3MoeTopKRouter on logits with exact ties (equal
    probabilities): the same experts in the same order, the same renormalized weights; and
    without renormalization the weights are the softmax's own."""
    cfg = tiny_qwen3moe_config(num_experts=6, num_experts_per_tok=2)
    router = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(cfg)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(40, cfg.hidden_size, generator=g)
    with torch.no_grad():
        router.weight.copy_(torch.randn(6, cfg.hidden_size, generator=g))
        router.weight[3] = router.weight[1]  # experts 1 and 3 tie for every token
        logits, want_w, want_idx = router(h)
    idx, w = route(logits.float(), MoeDims(6, 2, 8))
    assert torch.equal(idx, want_idx) and torch.allclose(w, want_w, atol=1e-7, rtol=0)
    assert ((idx == 1).any(-1) != (idx == 3).any(-1)).any()  # a tie at the cut, decided
    idx2, w2 = route(logits.float(), MoeDims(6, 2, 8, norm_w=False))
    assert torch.equal(idx2, idx)
    assert torch.allclose(w2, torch.softmax(logits.float(), -1).gather(1, idx), atol=0, rtol=0)
    assert not torch.allclose(w2, w)


def test_gatings_and_the_selection_bias():
    """sigmoid (each expert alone, then renormalized), softmax over the chosen logits only,
    a selection bias that changes the choice but not the weights, and the weight scale."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    idx, w = route(logits, MoeDims(4, 2, 8, "sigmoid", norm_w=False))
    assert idx.tolist() == [[0, 1]] and torch.allclose(w, torch.sigmoid(logits[:, :2]))
    idx, w = route(logits, MoeDims(4, 2, 8, "softmax_weight", norm_w=False))
    assert torch.allclose(w, torch.softmax(logits[:, :2], -1))
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0])
    idx, w = route(logits, MoeDims(4, 2, 8, "sigmoid", norm_w=False), bias)
    assert idx.tolist() == [[2, 0]] and torch.allclose(w, torch.sigmoid(logits[:, [2, 0]]))
    _, w = route(logits, MoeDims(4, 2, 8, w_scale=2.5))
    assert torch.allclose(w.sum(), torch.tensor(2.5))


@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_a_rows_routing_bits_do_not_depend_on_the_rows_beside_it(gating: str):
    """route() on 132 rows of 8 experts and on each row alone: the same experts and the same
    weight bits. (torch's sigmoid gives 26 of these rows other bits in the batch: its
    vectorized and scalar paths differ by an ulp, exact_sigmoid's cannot.)"""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(132, 8, generator=g) * 3
    bias = 0.1 * torch.randn(8, generator=g) if gating == "sigmoid" else None
    dims = MoeDims(8, 3, 16, gating)
    idx, w = route(logits, dims, bias)
    for i in range(132):
        one_idx, one_w = route(logits[i:i + 1].clone(), dims, bias)
        assert torch.equal(one_idx, idx[i:i + 1]) and torch.equal(one_w, w[i:i + 1]), i


def test_exact_sigmoid_is_torchs_within_2_ulp():
    x = torch.cat([torch.randn(100_000) * 10, torch.tensor([-800.0, 800.0, 0.0])])
    a, b = exact_sigmoid(x), torch.sigmoid(x)
    assert (a.view(torch.int32) - b.view(torch.int32)).abs().max() <= 2
    assert exact_sigmoid(torch.tensor([float("inf"), -float("inf")])).tolist() == [1.0, 0.0]


def test_only_the_chosen_experts_run(tiny_bf16: str, monkeypatch: pytest.MonkeyPatch):
    """A decode step runs exactly the experts the router chose for its token, gate/up and
    down, each over one row: every other expert's matrices are never called."""
    m = load_model(tiny_bf16, "bf16", deterministic="on")
    ffns = [b.ffn for b in m.transformer.w.layers]
    assert all(isinstance(f, MoEFFN) for f in ffns)
    ran: list[tuple[int, int, int]] = []  # (layer, expert, rows) of gate/up, then of down
    chose: list[list[int]] = []

    def spy_route(*a, **kw):
        idx, w = route(*a, **kw)
        chose.append(idx[0].tolist())
        return idx, w
    monkeypatch.setattr(moe, "route", spy_route)

    class Spy:
        def __init__(self, li: int, e: int, lin) -> None:
            self.li, self.e, self.lin = li, e, lin

        def __call__(self, x: torch.Tensor, inv: bool = False) -> torch.Tensor:
            ran.append((self.li, self.e, x.shape[0]))
            return self.lin(x, inv)

    for li, f in enumerate(ffns):
        for mats in (f.gate_up, f.down):
            monkeypatch.setattr(mats, "parts",
                                [Spy(li, e, lin) for e, lin in enumerate(mats.parts)])
    pool = model_pool(m, 256, 1, True, 64)
    forward(m.transformer, pool, [BatchSeq(0, TOKENS[:20], 0, 1)])
    ran.clear()
    chose.clear()
    forward(m.transformer, pool, [BatchSeq(0, [TOKENS[20]], 20, 1)])
    per_layer = [sorted(e for li2, e, _ in ran if li2 == li) for li in range(len(ffns))]
    assert per_layer == [sorted(c + c) for c in chose], (per_layer, chose)
    assert all(rows == 1 for _, _, rows in ran) and len(chose) == len(ffns)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family", ["qwen3moe", "lfm2moe"])
def test_bits_do_not_depend_on_chunking_or_batch(tiny_bf16: str, tiny_lfm2moe: str,
                                                 variant: str, family: str):
    """bf16 on each kernel variant: chunks of 1, 7 and 60 give every position's logits bit
    for bit, and so does the prompt computed beside another sequence in the same steps (its
    tokens routed to the same experts as some of ours: 8 experts, 3 a token)."""
    path = tiny_bf16 if family == "qwen3moe" else tiny_lfm2moe
    chunks_of = logits_in_chunks if family == "qwen3moe" else lfm2_chunks
    m = load_model(path, "bf16", kernels=config_for(variant), deterministic="on")
    assert m.deterministic
    check_bits_do_not_depend_on_chunking_or_batch(m, chunks_of)


def _backing(a: object) -> object:
    """What an array's memory belongs to, past its views (a mapped file: an mmap)."""
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a


@pytest.fixture(scope="module")
def tiny_gptoss_mxfp4(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny gpt-oss with MXFP4 experts and biases."""
    d = tmp_path_factory.mktemp("gptoss_map")
    return write_gptoss_from_hf(str(d / "oss.gguf"), random_moe(tiny_gptoss_config(), seed=5),
                                "mxfp4")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family", ["qwen3moe", "gpt-oss"])
def test_mapped_experts_are_the_files_pages_with_the_tiles_bits(
        tiny_bf16: str, tiny_gptoss_mxfp4: str, variant: str, family: str):
    """--load-mode mmap: every expert matrix (Q8_0, MXFP4 with biases) is views of the mapped
    file, nothing copied, reported as the file-rows route with the file's bytes; a prompt's
    logits in chunks of 1, 7 and 70 equal bit for bit those of the same model with its experts
    copied into the tiles (--load-mode none) on every variant; auto maps them on the builds
    whose gather keeps up with their tiles (the AVX-512 and AVX-VNNI ones)."""
    path = tiny_bf16 if family == "qwen3moe" else tiny_gptoss_mxfp4
    models = {mode: load_model(path, "bf16", kernels=config_for(variant), deterministic="on",
                               load_mode=mode) for mode in ("mmap", "none", "auto")}
    ffns = [layer.ffn for layer in models["mmap"].transformer.w.layers]
    for ffn in ffns:
        assert isinstance(ffn, MoEFFN)
        for role in (ffn.gate_up, ffn.down):
            assert role.route == "file-rows"
            for e in range(len(role)):
                parts = role[e].mat.parts
                assert all(isinstance(_backing(p), mmap.mmap) for p in parts)
                assert role[e].nbytes == sum(p.nbytes for p in parts) + (
                    0 if role[e].bias is None else role[e].bias.nbytes)
    assert (ffns[0].gate_up[0].bias is not None) == (family == "gpt-oss")
    copied = models["none"].transformer.w.layers[0].ffn
    assert copied.gate_up.route == ("i8-tiles" if family == "qwen3moe" else "mxfp4-tiles")
    auto = models["auto"].transformer.w.layers[0].ffn.gate_up.route
    assert auto == ("file-rows" if variant in FAST_GATHER else copied.gate_up.route)
    want = logits_in_chunks(models["none"], TOKENS, [N])
    for chunks in ([1] * N, [7] * 10, [N]):
        got = logits_in_chunks(models["mmap"], TOKENS, chunks)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), chunks


def test_bf16_follows_f32(tiny_bf16: str):
    """The default dtype's path (bf16, the experts on our 8-bit tiles, the router's logits
    exact f32 dots) near the f32 path the HF test checks: a position's largest logit error
    measured 0.15 at the median and 1.15 at most (logits of ~5): where bf16 rounding moves a
    router logit past a near-tie another expert runs, which no rounding noise bound covers;
    the greedy token agrees at most positions."""
    want = logits_in_chunks(load_model(tiny_bf16, "f32"), TOKENS, [N])
    got = logits_in_chunks(load_model(tiny_bf16, "bf16", deterministic="on"), TOKENS, [N])
    err = (got - want).abs().max(-1).values
    assert err.median() < 0.25 and err.max() < 2.0
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_refusals_name_the_key_or_tensor(tmp_path: Path, tiny_bf16: str):
    """Copies without the tokenizer (rewrite's), the vocabulary's size given as a key: the
    unchanged copy gets past every check the bad ones fail, to the missing tokenizer."""
    ok = rewrite(tiny_bf16, tmp_path / "ok.gguf", arch="qwen3moe",
                 set_keys={"qwen3moe.vocab_size": N_VOCAB})
    with pytest.raises(ValueError, match="no tokenizer"):
        load_model(ok, "f32")
    cases = [
        (dict(drop_keys=("qwen3moe.expert_count",)), "qwen3moe.expert_count"),
        (dict(set_keys={"qwen3moe.expert_used_count": 9}), "expert_used_count 9"),
        (dict(tensors={"blk.1.ffn_gate_exps.weight": np.zeros((8, 16, 64), np.float32)}),
         "'blk.1.ffn_gate_exps.weight' has shape [8, 16, 64]"),
        (dict(tensors={"blk.2.ffn_gate_inp.weight": np.zeros((7, 64), np.float32)}),
         "'blk.2.ffn_gate_inp.weight' has shape [7, 64]"),
        (dict(tensors={"blk.0.ffn_down_exps.weight": np.zeros((8, 32, 64), np.float32)}),
         "'blk.0.ffn_down_exps.weight' has shape [8, 32, 64]"),
    ]
    check_refusals(tiny_bf16, tmp_path, "qwen3moe", N_VOCAB, cases)


def test_lfm2moe_refusals_name_the_key_or_tensor(tmp_path: Path, tiny_lfm2moe: str):
    """As the Qwen3 MoE refusals: a missing gating key, a gating llama.cpp has and this
    engine does not, more dense layers than layers, a missing or misshapen expert bias."""
    n_vocab = tiny_lfm2moe_config().vocab_size
    cases = [
        (dict(drop_keys=("lfm2moe.expert_gating_func",)), "lfm2moe.expert_gating_func"),
        (dict(set_keys={"lfm2moe.expert_gating_func": 4}), "expert_gating_func 4"),
        (dict(set_keys={"lfm2moe.leading_dense_block_count": 5}), "leading_dense_block_count 5"),
        (dict(tensors={"blk.2.exp_probs_b.bias": np.zeros(7, np.float32)}),
         "'blk.2.exp_probs_b.bias' has shape [7]"),
        (dict(set_keys={"lfm2moe.leading_dense_block_count": 0}), "'blk.0.ffn_gate_inp.weight'"),
    ]
    check_refusals(tiny_lfm2moe, tmp_path, "lfm2moe", n_vocab, cases)


@pytest.mark.parametrize("family", ["qwen3moe", "lfm2moe"])
def test_every_tensor_name_is_one_llama_cpp_knows_for_the_architecture(
        tiny_bf16: str, tiny_lfm2moe: str, family: str):
    """The test files' tensor names are gguf-py's for the architecture (MODEL_TENSORS): a name
    llama.cpp does not read (the expert bias is exp_probs_b, not ffn_exp_probs_b) would make
    a file only we load, and a loader that reads it would refuse the real ones."""
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == family)
    path = tiny_bf16 if family == "qwen3moe" else tiny_lfm2moe
    known = set()
    for t in gguf.MODEL_TENSORS[arch]:
        pattern = gguf.TENSOR_NAMES[t]
        known |= {pattern.format(bid=i) for i in range(8)} if "{bid}" in pattern else {pattern}
    names = {t.name.rsplit(".", 1)[0] for t in gguf.GGUFReader(path).tensors}
    assert names and names <= known, sorted(names - known)


def test_an_moe_model_off_the_cpu_is_refused_in_one_line(tiny_bf16: str,
                                                        monkeypatch: pytest.MonkeyPatch):
    """Before any weight is read (a device this machine lacks stands in as torch's meta
    device): the experts are this engine's packed matrices."""
    monkeypatch.setattr(loader, "resolve_device", lambda *a: torch.device("meta"))
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts models run on the CPU"):
        load_model(tiny_bf16, "f32", device="cuda")


def test_the_dequant_path_keeps_the_router_exact_and_deterministic(tiny_bf16: str):
    """--weights dequant: the router still runs our exact dots on the file's rows, so
    deterministic mode holds there too, with the same logits as the packed path's router."""
    m = load_model(tiny_bf16, "bf16", weights="dequant", deterministic="on")
    assert m.deterministic
    assert all(b.ffn.router.route == "qmm-f32" for b in m.transformer.w.layers)
