"""Qwen3.5 MoE (`qwen35moe`): Qwen3.5's Gated DeltaNet and gated attention layers, each with a
mixture of experts beside a shared expert gated by a sigmoid. Our forward equals HF
transformers' Qwen3_5MoeForCausalLM on the same weights; a token's bits do not depend on
chunking or on the tokens beside it (routed to overlapping experts) on every kernel variant;
the shared expert's gate is needed to match; a file whose metadata and tensors disagree is
refused naming the key or tensor.

The GGUFs are written from random HF models the way llama.cpp's converter (Qwen3_5MoeTextModel)
writes them (tests/tiny_gguf.py's write_qwen35_from_hf)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from radixserve.model.hparams import MoeDims
from radixserve.model.loader import Model, load_model
from radixserve.model.moe import MoEFFN
from tests.model.kernel_variants import VARIANTS, config_for
from tests.model.test_lfm2 import (TOKENS, check_against_hf,
                                   check_bits_do_not_depend_on_chunking_or_batch,
                                   check_refusals, rewrite)
from tests.model.test_qwen35 import logits_in_chunks
from radixserve.bench.synth_model import default_tokenizer_fields
from tests.hf_random import randomize
from tests.tiny_gguf import write_qwen35_from_hf

N = len(TOKENS)
N_VOCAB_DEFAULT = len(default_tokenizer_fields()["tokenizer.ggml.tokens"])


def tiny_config(**kw: object) -> transformers.Qwen3_5MoeTextConfig:
    """4 layers (three Gated DeltaNet, then full attention), 8 experts of 32, 3 a token, a
    shared expert of 64; 2 key heads on 4 value heads."""
    args: dict[str, object] = dict(
        vocab_size=N_VOCAB_DEFAULT, hidden_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=2048,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        # 4 rotary dims (a quarter of 16): 2 pairs, in sections llama.cpp accepts
        rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                         "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                         "mrope_interleaved": True})
    args.update(kw)
    return transformers.Qwen3_5MoeTextConfig(**args)


def random_qwen35moe(seed: int) -> transformers.PreTrainedModel:
    """Qwen3_5MoeForCausalLM of tiny_config, every parameter random (hf_random's), the
    DeltaNet's decays and norms in their ranges (A_log, dt_bias)."""
    torch.manual_seed(seed)
    m = transformers.Qwen3_5MoeForCausalLM(tiny_config()).to(torch.float32)
    m = randomize(m, seed, 0.5)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.2, 2.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight") and "linear_attn" not in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))  # stored + 1 in the file
    return m.eval()


@pytest.fixture(scope="module")
def hf_and_file(tmp_path_factory: pytest.TempPathFactory):
    hf = random_qwen35moe(31)
    d = tmp_path_factory.mktemp("qwen35moe")
    return hf, write_qwen35_from_hf(str(d / "q35moe.gguf"), hf, wtype="f32")


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("qwen35moe-q8")
    return write_qwen35_from_hf(str(d / "q35moe.gguf"), random_qwen35moe(32), wtype="q8_0")


# f32 against HF's f32: the dense Qwen3.5's bound (tests/model/test_qwen35.py: HF's chunked
# delta rule sums in another order than the token-by-token recurrence here)
HF_BOUND = 1e-3


@pytest.mark.family_reference("qwen35moe")
def test_tiny_qwen35moe_matches_hf(hf_and_file):
    """f32: every position's logits within HF_BOUND of HF's, in one chunk and in chunks of 1
    and 7; greedy continuation equal to HF's generate."""
    hf, path = hf_and_file
    m = load_model(path, "f32")
    assert m.hp.moe == MoeDims(8, 3, 32, "softmax", True, 0.0, 0, 64)
    assert m.hp.n_layer_rec == 3 and m.hp.n_ff == 0
    assert all(isinstance(b.ffn, MoEFFN) and b.ffn.shared is not None
               for b in m.transformer.w.layers)
    check_against_hf(m, hf, HF_BOUND, logits_in_chunks)


def test_the_shared_experts_gate_is_needed(hf_and_file):
    """With each layer's gate row zeroed (every token's shared expert weighted 1/2 instead of
    by its own sigmoid) the logits move by more than 1e-2 from HF's; with the shared expert
    dropped, too."""
    hf, path = hf_and_file
    with torch.no_grad():
        want = hf(torch.tensor([TOKENS])).logits[0].float()
    for change in ("zero gate", "no shared expert"):
        m = load_model(path, "f32")
        for b in m.transformer.w.layers:
            if change == "zero gate":
                b.ffn.shared.gate = torch.zeros_like(b.ffn.shared.gate)
            else:
                b.ffn.shared = None
        assert (logits_in_chunks(m, TOKENS, [N]) - want).abs().max() > 1e-2, change


@pytest.mark.parametrize("variant", VARIANTS)
def test_bits_do_not_depend_on_chunking_or_batch(tiny_q8: str, variant: str):
    """bf16 on each kernel variant (Q8_0 experts on the 8-bit tiles, the shared expert's gate
    an exact dot): chunks of 1, 7 and 60 give every position's logits bit for bit, and so does
    the prompt beside another sequence in the same steps."""
    m = load_model(tiny_q8, "bf16", kernels=config_for(variant), deterministic="on")
    assert m.deterministic
    check_bits_do_not_depend_on_chunking_or_batch(m, logits_in_chunks)


def test_refusals_name_the_key_or_tensor(tmp_path: Path, tiny_q8: str):
    ok = rewrite(tiny_q8, tmp_path / "ok.gguf", arch="qwen35moe",
                 set_keys={"qwen35moe.vocab_size": N_VOCAB_DEFAULT})
    with pytest.raises(ValueError, match="no tokenizer"):
        load_model(ok, "f32")
    cases = [
        (dict(drop_keys=("qwen35moe.expert_feed_forward_length",)),
         "qwen35moe.expert_feed_forward_length"),
        (dict(drop_keys=("qwen35moe.expert_shared_feed_forward_length",)),
         "qwen35moe.feed_forward_length"),
        (dict(tensors={"blk.1.ffn_gate_inp_shexp.weight": np.zeros((2, 64), np.float32)}),
         "'blk.1.ffn_gate_inp_shexp.weight' has shape [2, 64]"),
        (dict(tensors={"blk.2.ffn_down_shexp.weight": np.zeros((64, 40), np.float32)}),
         "'blk.2.ffn_down_shexp.weight' has shape [64, 40]"),
        (dict(drop_keys=("qwen35moe.ssm.conv_kernel",)), "qwen35moe.ssm.conv_kernel"),
    ]
    check_refusals(tiny_q8, tmp_path, "qwen35moe", N_VOCAB_DEFAULT, cases)


def test_a_shared_gate_of_one_dimension_is_the_same_row(tmp_path: Path, tiny_q8: str):
    """ffn_gate_inp_shexp as [n_embd] (llama.cpp reads either: a file that squeezed HF's
    [1, n_embd]) loads as the same row as the converter's [1, n_embd]."""
    import gguf

    from radixserve.model.arch import family_of
    from radixserve.model.gguf_check import read_gguf
    from radixserve.model.tensors import TensorLoader

    r = gguf.GGUFReader(tiny_q8)
    flat = {t.name: np.array(t.data).reshape(-1) for t in r.tensors
            if t.name.endswith("ffn_gate_inp_shexp.weight")}
    keys = {"qwen35moe.vocab_size": N_VOCAB_DEFAULT}
    gates = []
    for name, tensors in (("a", None), ("b", flat)):
        f = read_gguf(rewrite(tiny_q8, tmp_path / f"{name}.gguf", arch="qwen35moe",
                              set_keys=keys, tensors=tensors))
        fam = family_of("qwen35moe")
        ld = TensorLoader(f, torch.float32, packed=False)
        gates.append(fam.shared_expert(ld, fam.hparams(f, "qwen35moe"), "blk.0.").gate)
    assert gates[0].shape == (1, 64) and torch.equal(gates[0], gates[1])
