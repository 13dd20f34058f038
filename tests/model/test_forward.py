"""Batched forward: equal to HF transformers on the same GGUF, and invariant to how a sequence
is chunked or batched with others."""

from __future__ import annotations

import os

import pytest
import torch

from radixserve.engine.batch import BatchSeq, forward, hidden
from radixserve.model.forward import Transformer
from radixserve.model.head import RowNeed
from radixserve.model.loader import load_model
from radixserve.model.quant import Int4Linear, Q4Linear
from tests.conftest import make_pool
from tests.model.kernel_variants import NO_KERNELS

PROMPTS = [
    [1, 19556, 905, 28, 957, 314, 260, 1345, 282, 4649, 47, 216],
    [1, 504, 3458, 282, 4649, 314, 3575, 30, 378, 1076, 282, 260, 6037, 314, 2369, 30, 216],
    list(range(200, 300)) + [30, 198, 198],
]


def hf_model(path: str):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()


def load_native(path: str, kernels: bool) -> Transformer:
    """The default model on packed weights in bf16, with our kernels (Q4 matmuls, step glue)
    or with none of them (torch's int4 kernel and ops), as RADIXSERVE_KERNELS=0 runs it."""
    model = load_model(path, "bf16", weights="native", kernels=None if kernels else NO_KERNELS)
    tr = model.transformer
    assert model.weights == "native" and tr.w.packed
    if kernels:
        assert tr.kern is not None, "the kernels did not build (is a C compiler there?)"
        assert isinstance(tr.w.layers[0].mixer.wqkv, Q4Linear), "no AVX512-BF16 here?"
    else:
        assert tr.kern is None and isinstance(tr.w.layers[0].mixer.wqkv, Int4Linear)
    return tr


def our_logits(tr: Transformer, ids: list[int]) -> torch.Tensor:
    pool = make_pool(tr, n_cells=512, n_seq=1)
    return forward(tr, pool, [BatchSeq(0, ids, 0, n_logits=len(ids))])


def greedy(tr: Transformer, ids: list[int], n: int) -> list[int]:
    """Greedy tokens through the head as the server samples them (a certified shortlist on
    the native path, the full f32 head on the dequant path)."""
    pool = make_pool(tr, n_cells=512, n_seq=1)
    h = hidden(tr, pool, [BatchSeq(0, ids, 0)])
    out: list[int] = []
    for _ in range(n):
        out.append(int(tr.w.head.logits(h, [RowNeed(1)])[0].argmax()))
        h = hidden(tr, pool, [BatchSeq(0, [out[-1]], len(ids) + len(out) - 1)])
    return out


@pytest.fixture(scope="module")
def hf_reference(default_path: str) -> list[tuple[torch.Tensor, list[int]]]:
    """HF transformers in f32 on the same GGUF: prompt logits and 32 greedy tokens per prompt."""
    ref = hf_model(default_path)
    out = []
    with torch.no_grad():
        for ids in PROMPTS:
            logits = ref(torch.tensor([ids])).logits[0]
            gen = ref.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32
            )[0, len(ids) :].tolist()
            out.append((logits, gen))
    return out


@pytest.mark.model
def test_default_model_matches_hf_logits_and_greedy(default_tr: Transformer, hf_reference):
    """f32 against HF's f32, every position's logits: measured max abs error 4.0e-5, 3.7e-5 and
    6.6e-5 on the three prompts (largest logits ~30-32); the bound, 2.5e-4, is ~4x the largest
    (it was 1e-3, 15x)."""
    for ids, (expect, gen) in zip(PROMPTS, hf_reference):
        got = our_logits(default_tr, ids)
        assert got.shape == expect.shape
        assert (got - expect).abs().max().item() < 2.5e-4
        assert greedy(default_tr, ids, 32) == gen


NEAR_TIE = 0.05  # reference logits this close are a coin flip for bf16 activations


def f32_step_logits(ref: Transformer, seq: list[int]) -> torch.Tensor:
    return forward(ref, make_pool(ref, n_cells=512, n_seq=1), [BatchSeq(0, seq, 0)])[0]


@pytest.mark.model
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch-ops"])
def test_native_bf16_greedy_matches_hf(default_path: str, default_tr: Transformer,
                                       hf_reference, kernels: bool):
    """Packed Q4_1 weights, bf16 activations, shortlist head, with our kernels (model/csrc/:
    tiles with 8-bit activations, step glue, head) or with torch's int4 kernel and ops (bf16
    activations): the same 32 greedy tokens as the f32 reference, up to a measured near-tie.
    Every prompt must agree until a step where the f32 reference itself has our token within
    NEAR_TIE of its choice, and from then on nothing is compared (the continuations differ).
    Measured: both paths match prompts 1 and 2 in full and split prompt 3 at step 5, where the
    reference's top three are 31.294, 31.284 and 31.267 (a gap of 0.011)."""
    tr = load_native(default_path, kernels)
    full = 0
    for ids, (expect, gen) in zip(PROMPTS, hf_reference):
        # close, not equal. Measured max 0.77 / 0.77 / 1.77 with the tiles' 8-bit activations
        # (mean 0.10-0.17; the KL divergence from f32 below llama-server's: docs/PERFORMANCE.md),
        # 0.75 / 0.37 / 0.73 with torch's bf16 ones; the same bits whether the prompt runs as one
        # chunk or token by token as decode steps
        got = our_logits(tr, ids)
        assert (got - expect).abs().max().item() < 2.25
        ours = greedy(tr, ids, 32)
        split = next((i for i, (a, b) in enumerate(zip(ours, gen)) if a != b), None)
        if split is None:
            full += 1
            continue
        ref = f32_step_logits(default_tr, ids + gen[:split])
        gap = (ref[gen[split]] - ref[ours[split]]).item()
        assert 0 <= gap < NEAR_TIE, f"split at step {split} by {gap:.3f}: not a near-tie"
    assert full >= 2  # a split is the exception, not the rule
    assert tr.w.head.stats.rows_short >= 3 * 32 and tr.w.head.stats.rows_full == 0


@pytest.mark.model
def test_kernel_path_as_close_to_reference_as_torch_ops(default_path: str,
                                                         default_tr: Transformer):
    """Decode steps through our kernels (fused RoPE + K/V store + attention, add + norm, SiLU
    gate) stay as close to the f32 reference as torch's own bf16 ops do, on forced tokens."""
    model = load_model(default_path, "bf16", weights="native")
    tr = model.transformer
    kern = tr.kern
    assert kern is not None

    def logits(t: Transformer, seq: list[int], n0: int) -> torch.Tensor:
        pool = make_pool(t, n_cells=512, n_seq=1)
        rows = [forward(t, pool, [BatchSeq(0, seq[:n0], 0)])[0]]
        rows += [forward(t, pool, [BatchSeq(0, [seq[i]], i)])[0] for i in range(n0, len(seq))]
        return torch.stack(rows)

    for ids in PROMPTS:
        seq = ids + list(range(1000, 1024))
        ref = logits(default_tr, seq, len(ids))
        tr.kern = kern
        err_k = (logits(tr, seq, len(ids)) - ref).abs()
        tr.kern = None
        err_t = (logits(tr, seq, len(ids)) - ref).abs()
        # measured: kernels max 0.27-0.49 / mean 0.046-0.074, torch ops 0.37-0.54 / 0.056-0.072
        assert err_k.max() < 1.0 and err_k.mean() < 1.5 * err_t.mean()


# f32 against HF's f32 on random weights: measured max abs error 9.5e-6 (llama), 1.1e-5 (qwen2),
# 2.5e-5 (qwen3: n_embd 256, so longer sums); each bound ~4x its own (all were 1e-4)
TINY_HF_BOUND = {"llama": 4e-5, "qwen2": 4e-5, "qwen3": 1e-4}


@pytest.mark.family_reference("llama", "qwen2", "qwen3")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_architectures_match_hf(tiny_paths: dict[str, str], arch: str):
    """Each architecture's RoPE convention, biases and norms agree with HF on random weights,
    within TINY_HF_BOUND."""
    from tests.conftest import make_transformer

    path = tiny_paths[arch]
    ref = hf_model(path)
    ids = PROMPTS[1]
    with torch.no_grad():
        expect = ref(torch.tensor([ids])).logits[0]
    got = our_logits(make_transformer(path), ids)
    assert (got - expect).abs().max().item() < TINY_HF_BOUND[arch]


def run_chunked(tr: Transformer, ids: list[int], chunk: int) -> torch.Tensor:
    pool = make_pool(tr, n_cells=256, n_seq=1)
    rows = []
    for s in range(0, len(ids), chunk):
        part = ids[s : s + chunk]
        rows.append(forward(tr, pool, [BatchSeq(0, part, s, n_logits=len(part))]))
    pool.check()
    return torch.cat(rows)


def test_chunked_prefill_equals_one_go(tiny_tr: Transformer):
    ids = list(range(1000, 1150))
    whole = our_logits(tiny_tr, ids)
    for chunk in (1, 7, 64):
        # f32; different matmul shapes may round differently in the last bits
        assert (run_chunked(tiny_tr, ids, chunk) - whole).abs().max().item() < 1e-4


def test_several_sequences_in_one_batch(tiny_tr: Transformer):
    seqs = [list(range(500, 540)), list(range(900, 905)), list(range(3000, 3077)), [42]]
    alone = [our_logits(tiny_tr, ids) for ids in seqs]
    for unified in (True, False):
        pool = make_pool(tiny_tr, n_cells=512, n_seq=4, unified=unified)
        # first half of each as a prefill batch, then the rest mixed with single-token steps
        half = [len(s) // 2 for s in seqs]
        batch = [BatchSeq(i, s[: h], 0, n_logits=h) for i, (s, h) in enumerate(zip(seqs, half)) if h]
        first = forward(tiny_tr, pool, batch)
        batch = [BatchSeq(i, s[h:], h, n_logits=len(s) - h) for i, (s, h) in enumerate(zip(seqs, half))]
        second = forward(tiny_tr, pool, batch)
        pool.check()
        rows_a = torch.split(first, [h for h in half if h])
        rows_b = torch.split(second, [len(s) - h for s, h in zip(seqs, half)])
        ia = iter(rows_a)
        for i, s in enumerate(seqs):
            got = torch.cat([next(ia), rows_b[i]]) if half[i] else rows_b[i]
            assert (got - alone[i]).abs().max().item() < 1e-4, (unified, i)


def test_bf16_close_to_f32(tiny_path: str):
    from tests.conftest import make_transformer

    ids = PROMPTS[1]
    f32 = our_logits(make_transformer(tiny_path, torch.float32), ids)
    bf16 = our_logits(make_transformer(tiny_path, torch.bfloat16), ids)
    # bf16 keeps ~3 significant digits: errors stay a small fraction of the logits' spread
    assert ((f32 - bf16).abs().max() / f32.std()).item() < 0.1


def test_bf16_kernels_follow_torch_ops_through_sharing_and_mixed_batches(tiny_path: str):
    """The bf16 step kernels, driven like the server drives them: prefill, a sequence that
    takes another's prefix cells (seq_cp: gathered cells in unified mode, a copy in partitions),
    fused decode steps of several sequences, and a decode token batched with a prefill chunk
    (the general path). Logits stay within bf16 noise of the same run on torch's ops."""
    from tests.conftest import make_transformer

    tr = make_transformer(tiny_path, torch.bfloat16)
    assert tr.kern is not None

    def drive(use_kernels: bool, unified: bool) -> torch.Tensor:
        kern = tr.kern
        tr.kern = kern if use_kernels else None
        try:
            pool = make_pool(tr, n_cells=256, n_seq=4, unified=unified)
            a, b = list(range(300, 340)), list(range(700, 713))
            out = [forward(tr, pool, [BatchSeq(0, a, 0), BatchSeq(1, b, 0)])]
            pool.seq_cp(0, 2, 0, 30)  # sequence 2 starts from a's first 30 tokens
            out.append(forward(tr, pool, [BatchSeq(2, list(range(900, 905)), 30)]))
            for i in range(6):  # decode steps of three sequences at once
                out.append(forward(tr, pool, [BatchSeq(0, [5 + i], 40 + i), BatchSeq(1, [9], 13 + i),
                                             BatchSeq(2, [11 + i], 35 + i)]))
            # a decode token next to a prefill chunk: the general path
            out.append(forward(tr, pool, [BatchSeq(0, [77], 46), BatchSeq(3, list(range(50, 90)), 0)]))
            pool.check()
            return torch.cat(out)
        finally:
            tr.kern = kern

    for unified in (True, False):
        got, ref = drive(True, unified), drive(False, unified)
        assert got.shape == ref.shape
        assert ((got - ref).abs().max() / ref.std()).item() < 0.05, unified
