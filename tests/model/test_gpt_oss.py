"""gpt-oss (`gpt-oss`): our forward equals HF transformers' GptOssForCausalLM on the same
weights (f32, and MXFP4 experts beside Q8_0 matrices as the released files hold them): attention
sinks, sliding and full layers alternating, biases on the attention, the router and every
expert, the softmax over the chosen experts' logits, the clamped SwiGLU and YaRN; each of those
is needed to match; a token's bits do not depend on chunking or on the tokens beside it on
every kernel variant; a file whose metadata and tensors disagree is refused naming the key or
tensor.

The GGUFs are written from random HF models the way llama.cpp's converter writes them
(tests/moe_hf.py's write_gptoss_from_hf)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from radixserve.model.hparams import MoeDims, YarnDims
from radixserve.model.kernel_routes import FAST_GATHER
from radixserve.model.loader import Model, load_model
from radixserve.model.moe import MoEFFN
from radixserve.model.rope import Rope
from tests.model.kernel_variants import VARIANTS, config_for
from tests.model.test_lfm2 import (TOKENS, check_against_hf,
                                   check_bits_do_not_depend_on_chunking_or_batch,
                                   check_refusals, rewrite)
from tests.model.test_moe import logits_in_chunks
from tests.moe_hf import random_moe, tiny_gptoss_config, write_gptoss_from_hf

N = len(TOKENS)  # 70 tokens: the sliding layers' window of 8 slides far


@pytest.fixture(scope="module")
def hf_and_file(tmp_path_factory: pytest.TempPathFactory):
    """The tiny random gpt-oss and its GGUF with MXFP4 experts (the HF model's weights the
    dequantized ones)."""
    hf = random_moe(tiny_gptoss_config(), seed=21)
    d = tmp_path_factory.mktemp("gptoss")
    return hf, write_gptoss_from_hf(str(d / "oss.gguf"), hf, "mxfp4")


# f32 against HF's f32 (eager attention with sinks): measured max abs error over every
# position's logits (largest ~5) in one chunk / chunks of 1 / of 7: 3.6e-6 / 4.5e-6 / 4.8e-6
# (f32 weights), 4.4e-6 / 6.1e-6 / 4.4e-6 (MXFP4 experts); the bound is ~5x the largest
HF_BOUND = 3e-5


@pytest.mark.family_reference("gpt-oss")
@pytest.mark.parametrize("wtype", ["f32", "mxfp4"])
def test_tiny_gpt_oss_matches_hf(tmp_path: Path, wtype: str):
    """f32: every position's logits within HF_BOUND of HF's, in one chunk and in chunks of 1
    and 7; greedy continuation equal to HF's generate. Layers 0 and 2 slide (window 8)."""
    hf = random_moe(tiny_gptoss_config(), seed=3)
    m = load_model(write_gptoss_from_hf(str(tmp_path / "m.gguf"), hf, wtype), "f32")
    hp = m.hp
    assert hp.moe == MoeDims(8, 3, 32, "softmax_weight", False, 0.0)
    assert hp.swa_layers == (True, False, True, False) and hp.n_swa == 8
    assert hp.yarn == YarnDims(32.0, 4096, 32.0, 1.0, 1.0, 1 + 0.1 * math.log(32))
    check_against_hf(m, hf, HF_BOUND, logits_in_chunks)


def test_each_part_of_the_layer_is_needed(hf_and_file):
    """Dropping any one of the sinks, YaRN (scale and frequencies), the router's bias or
    the SwiGLU's clamp moves some logit by more than 1e-2 from HF's: the HF test could not
    pass without each."""
    hf, path = hf_and_file
    with torch.no_grad():
        want = hf(torch.tensor([TOKENS])).logits[0].float()

    def err(m: Model) -> float:
        return (logits_in_chunks(m, TOKENS, [N]) - want).abs().max().item()

    m = load_model(path, "f32")
    assert err(m) < 1e-4
    for layer in m.transformer.w.layers:
        layer.mixer.sinks = None
    assert err(m) > 1e-2
    m = load_model(path, "f32")
    tr = m.transformer
    tr.rope = tr.rope_swa = Rope(dataclasses.replace(m.hp, yarn=None))
    assert err(m) > 1e-2
    for change in ("router_bias", "act"):
        m = load_model(path, "f32")
        for layer in m.transformer.w.layers:
            ffn = layer.ffn
            assert isinstance(ffn, MoEFFN)
            if change == "router_bias":
                ffn.router.bias = None
            else:
                ffn.act = "silu"
        assert err(m) > 1e-2, change


def test_yarn_frequencies_equal_hfs():
    """Rope's YaRN inverse frequencies and scale against transformers' own computation for
    the same parameters (the correction range truncated, as llama.cpp has it)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = tiny_gptoss_config(head_dim=64, num_attention_heads=4, hidden_size=256)
    inv, scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    hp = dataclasses.replace(
        load_hparams_like(cfg), head_dim=64, n_rot=64,
        yarn=YarnDims(32.0, 4096, 32.0, 1.0, 1.0, 1 + 0.1 * math.log(32)))
    rope = Rope(hp)
    assert torch.allclose(rope.inv_freq, inv.float(), rtol=1e-6, atol=0)
    assert rope.mscale is not None and torch.allclose(rope.mscale, torch.tensor(scale))
    # partial rotary: the pairs that do not turn pass through unscaled, as ggml's copy
    part = Rope(dataclasses.replace(hp, n_rot=32))
    cos, sin = part.cos_sin(torch.tensor([0, 9]))
    assert torch.allclose(cos[0, 0, :16], torch.tensor(scale)) and (cos[:, 0, 16:32] == 1).all()
    assert (sin[:, 0, 16:32] == 0).all()
    # a K-shift is a pure rotation: the stored keys carry the scale already
    x = torch.randn(3, 2, 64)
    rotated = rope.rotate(x, torch.tensor([5, 6, 7]))
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)


def load_hparams_like(cfg) -> object:
    """HParams for a Rope of `cfg`'s base (the fields a Rope reads)."""
    from radixserve.model.hparams import HParams

    return HParams(arch="gpt-oss", n_layer=1, n_embd=cfg.hidden_size, n_ff=1,
                   n_head=cfg.num_attention_heads, n_head_kv=cfg.num_key_value_heads,
                   head_dim=cfg.head_dim, n_vocab=1, n_ctx_train=cfg.max_position_embeddings,
                   rms_eps=1e-5, rope_base=cfg.rope_parameters["rope_theta"], rope_neox=True,
                   rope_scale_linear=1.0, name="x")


@pytest.mark.parametrize("variant", VARIANTS)
def test_bits_do_not_depend_on_chunking_or_batch(hf_and_file, variant: str):
    """bf16 on each kernel variant (the MXFP4 experts read from the mapped file's rows, on
    the AVX2 and generic builds from their 4-bit tiles; the sinks in the C attention): chunks
    of 1, 7 and 60 give every position's logits bit for bit, and so does the prompt beside
    another sequence in the same steps (routed to overlapping experts)."""
    m = load_model(hf_and_file[1], "bf16", kernels=config_for(variant), deterministic="on")
    assert m.deterministic
    ffn = m.transformer.w.layers[0].ffn
    assert isinstance(ffn, MoEFFN)
    assert ffn.gate_up.route == ("file-rows" if variant in FAST_GATHER else "mxfp4-tiles")
    check_bits_do_not_depend_on_chunking_or_batch(m, logits_in_chunks)


def test_bf16_follows_f32(hf_and_file):
    """The default dtype's path near the f32 one HF's test checks: a position's largest logit
    error measured 0.19 at the median and 1.5 at most (logits of ~5), the greedy token the
    same at 96% of positions: as the Qwen3 MoE's (tests/model/test_moe.py), a near-tie in a
    router sends a token to another expert, so the bound is not rounding noise alone."""
    path = hf_and_file[1]
    want = logits_in_chunks(load_model(path, "f32"), TOKENS, [N])
    got = logits_in_chunks(load_model(path, "bf16", deterministic="on"), TOKENS, [N])
    err = (got - want).abs().max(-1).values
    assert err.median() < 0.25 and err.max() < 2.0
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_refusals_name_the_key_or_tensor(tmp_path: Path, hf_and_file):
    """Copies without the tokenizer: the unchanged copy gets past every check the bad ones
    fail, to the missing tokenizer."""
    path = hf_and_file[1]
    n_vocab = tiny_gptoss_config().vocab_size
    ok = rewrite(path, tmp_path / "ok.gguf", arch="gpt-oss",
                 set_keys={"gpt-oss.vocab_size": n_vocab})
    with pytest.raises(ValueError, match="no tokenizer"):
        load_model(ok, "f32")
    cases = [
        (dict(drop_keys=("gpt-oss.attention.sliding_window",)),
         "gpt-oss.attention.sliding_window"),
        (dict(drop_keys=("gpt-oss.expert_feed_forward_length",)),
         "gpt-oss.expert_feed_forward_length"),
        (dict(tensors={"blk.1.attn_sinks.weight": np.zeros(3, np.float32)}),
         "'blk.1.attn_sinks.weight' has shape [3]"),
        (dict(tensors={"blk.2.ffn_up_exps.bias": np.zeros((8, 31), np.float32)}),
         "'blk.2.ffn_up_exps.bias' has shape [8, 31]"),
        (dict(tensors={"blk.0.ffn_gate_inp.bias": np.zeros(7, np.float32)}),
         "'blk.0.ffn_gate_inp.bias' has shape [7]"),
        (dict(tensors={"blk.3.attn_output.bias": np.zeros(63, np.float32)}),
         "'blk.3.attn_output.bias' has shape [63]"),
        (dict(set_keys={"gpt-oss.rope.scaling.yarn_log_multiplier": 1}),
         "yarn_log_multiplier"),
    ]
    check_refusals(path, tmp_path, "gpt-oss", n_vocab, cases)


def test_every_tensor_name_is_one_llama_cpp_knows(hf_and_file):
    """The test file's tensor names are gguf-py's for gpt-oss (MODEL_TENSORS), the experts
    MXFP4 as the released files'."""
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == "gpt-oss")
    known = set()
    for t in gguf.MODEL_TENSORS[arch]:
        pattern = gguf.TENSOR_NAMES[t]
        known |= {pattern.format(bid=i) for i in range(8)} if "{bid}" in pattern else {pattern}
    tensors = gguf.GGUFReader(hf_and_file[1]).tensors
    names = {t.name.rsplit(".", 1)[0] for t in tensors}
    assert names and names <= known, sorted(names - known)
    assert {t.tensor_type for t in tensors if "_exps.weight" in t.name} == {
        gguf.GGMLQuantizationType.MXFP4}
