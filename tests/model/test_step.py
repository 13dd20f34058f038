"""KernelStep (model/step.py): the C glue of every architecture, here the layers with q/k norms, sliding windows, post
norms and GeGLU, in every kernel variant. Its attention call equals the general path's pieces
(head norms, Rope.apply, the K/V store, windowed attention) bit for bit; its norms and gate
follow torch's within a bf16 rounding; and through a whole model (a tiny gemma3, both cache
layouts) the step and the general path give the same K/V and logits, chunked or not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import radixserve.model.forward as fw
from radixserve.engine.batch import BatchSeq, hidden
from radixserve.memory.pool.swa import SWAPool
from radixserve.memory.pool import kv_types
from radixserve.model import step as G
from radixserve.model import kernels as K
from radixserve.model.forward import rms_norm
from radixserve.model.hparams import HParams
from radixserve.model.loader import load_model
from radixserve.model.rope import Rope
from tests.model.kernel_variants import config_for, kern, threads, variant  # noqa: F401
from tests.tiny_gguf import write_tiny_gguf
from tests.conftest import model_pool

BF = torch.bfloat16


HP = HParams(arch="gemma3", n_layer=2, n_embd=128, n_ff=64, n_head=4, n_head_kv=1,
             head_dim=256, n_vocab=100, n_ctx_train=4096, rms_eps=1e-6, rope_base=1e6,
             rope_neox=True, rope_scale_linear=1.0, name="t", n_swa=40,
             swa_layers=(True, False), rope_base_swa=1e4)


@pytest.mark.parametrize("window, scale", [(0, None), (40, None), (0, 0.3)])
@pytest.mark.parametrize("base", [0, 220], ids=["block-0", "across-256"])
def test_step_attention_equals_norms_rope_store_and_attend(kern, threads, window, base, scale):
    """One call a layer: q/k norms, RoPE, the K/V store and (windowed) attention for three
    sequences (a run of cells, gathered cells starting at a later position, a one-token
    sequence) equal head_norm + Rope.apply + index_copy + attend_causal, bit for bit, with the
    model's q.k scale (None: 1/sqrt(head_dim)); and head_norm is forward.py's rms_norm within a
    bf16 rounding."""
    d, nh, nkv = HP.head_dim, HP.n_head, HP.n_head_kv
    rope = Rope(HP, base=HP.rope_base_swa, scale=1.0)
    gen = torch.Generator().manual_seed(window + 1)
    shape = (2, nkv, 160, d)
    pk, pv = torch.randn(shape, generator=gen).to(BF), torch.randn(shape, generator=gen).to(BF)
    pk2, pv2 = pk.clone(), pv.clone()
    scattered = torch.tensor([12, 13, 35, 8, 50, 52, 51])
    cells = [slice(10, 70), scattered, slice(100, 101)]
    # the gathered list holds positions 30 .. 36 (across-256: 250 .. 256, the window's keys in
    # two of the kernel's 256-position blocks)
    pos0 = [0, 30 + base, 0]
    n_new = [3, 2, 1]
    dst = [67, 68, 69, 52, 51, 100]  # each sequence's new tokens end its cells
    pos = torch.tensor([57, 58, 59, 35 + base, 36 + base, 0])
    cos, sin = rope.cos_sin(pos)
    qn, kn = torch.rand(d, generator=gen) + 0.5, torch.rand(d, generator=gen) + 0.5
    x = torch.zeros(6, HP.n_embd)
    kind = G.LayerKind(pk, pv, cells, pos0, window, dst, n_new, cos, sin)
    step = G.KernelStep(kern, nh, nkv, d, {"k": kind}, [("k", 0), ("k", 1)],
                       [(qn, kn), (None, None)], x, HP.rms_eps, HP.n_ff, scale)
    for layer, norms in ((0, True), (1, False)):
        qkv = (torch.randn(6, (nh + 2 * nkv) * d, generator=gen) * 3).to(BF)
        got = step.attend(layer, qkv).clone()
        qk = qkv[:, : (nh + nkv) * d].view(6, nh + nkv, d)
        if norms:
            parts = [(qk[:, :nh], qn), (qk[:, nh:], kn)]
            normed = [G.head_norm(kern, t, w, HP.rms_eps) for t, w in parts]
            for a, (t, w) in zip(normed, parts):
                ref = rms_norm(t, w, HP.rms_eps).float()
                assert ((a.float() - ref).abs() <= 2**-7 * ref.abs()).all()
            qk = torch.cat(normed, 1)
        qk = rope.apply(qk, cos, sin)
        v = qkv[:, (nh + nkv) * d :].view(6, nkv, d)
        pk2[layer].index_copy_(1, torch.tensor(dst), qk[:, nh:].transpose(0, 1))
        pv2[layer].index_copy_(1, torch.tensor(dst), v.transpose(0, 1))
        assert torch.equal(pk[layer], pk2[layer]) and torch.equal(pv[layer], pv2[layer])
        q, at = qk[:, :nh], 0
        for c, p0, n in zip(cells, pos0, n_new):
            want = kern.attend_causal(q[at : at + n].contiguous(), pk2[layer], pv2[layer], c,
                                      window=window, pos0=p0, scale=scale)
            assert torch.equal(got[at : at + n], want), (layer, at)
            at += n


def test_post_norm_and_gelu_follow_torch(kern, threads):
    gen = torch.Generator().manual_seed(3)
    d, ff = 640, 512
    for rows in (1, 5, 40):  # 40: rows split over the threads
        x = torch.randn(rows, d, generator=gen) * 3
        y = (torch.randn(rows, d, generator=gen) * 50).to(BF)
        wp, wn = torch.rand(d, generator=gen) + 0.5, torch.rand(d, generator=gen) + 0.5
        x2 = x.clone()
        got = G.post_norm(kern, x, y, wp, wn, 1e-6)
        x2.add_(F.rms_norm(y.float(), (d,), wp, 1e-6))
        assert (x - x2).abs().max() <= 1e-5 * x2.abs().max()
        ref = F.rms_norm(x, (d,), wn, 1e-6)
        assert got is not None and ((got.float() - ref).abs() <= 2**-8 * ref.abs() + 1e-6).all()
        x3 = x.clone()
        assert G.post_norm(kern, x3, y, wp, None, 1e-6) is None  # the last layer: add only
        step = F.rms_norm(y.float(), (d,), wp, 1e-6)
        assert ((x3 - x) - step).abs().max() <= 1e-5 * x.abs().max()
        gu = (torch.randn(rows, 2 * ff, generator=gen) * 4).to(BF)
        gu[0, :8] = torch.tensor([0.0, -0.0, 1e-3, -30.0, 30.0, -5.0, 100.0, -100.0])
        ref = (F.gelu(gu[:, :ff], approximate="tanh") * gu[:, ff:]).float()
        diff = (G.gelu_mul(kern, gu).float() - ref).abs()
        # at most the last bit of bf16, or torch's own cancellation in 1 + tanh(u) for very
        # negative gates (f32 steps of 2^-24 there; ours is the logistic, without it)
        slack = 2**-23 * (gu[:, :ff].float() * gu[:, ff:].float()).abs()
        assert (diff <= 2**-7 * ref.abs() + slack + 1e-30).all()


def test_step_refuses_what_it_cannot_read(kern):
    d = HP.head_dim
    pk = torch.zeros(1, 1, 32, d, dtype=BF)
    cos = torch.zeros(1, 1, d)
    x = torch.zeros(1, HP.n_embd)
    with pytest.raises(ValueError):  # a new cell outside the cache
        G.LayerKind(pk, pk, [slice(0, 4)], None, 0, [32], [1], cos, cos)
    with pytest.raises(ValueError):  # more new tokens than cells
        G.LayerKind(pk, pk, [slice(0, 1)], None, 0, [0, 1], [2], cos, cos)
    kind = G.LayerKind(pk, pk, [slice(0, 4)], None, 0, [3], [1], cos, cos)
    with pytest.raises(ValueError):  # a layer outside the cache
        G.KernelStep(kern, 4, 1, d, {"k": kind}, [("k", 1)], [(None, None)], x, 1e-6, 64)
    with pytest.raises(ValueError):  # a bf16 norm weight
        G.KernelStep(kern, 4, 1, d, {"k": kind}, [("k", 0)], [(torch.ones(d, dtype=BF), None)],
                    x, 1e-6, 64)
    step = G.KernelStep(kern, 4, 1, d, {"k": kind}, [("k", 0)], [(None, None)], x, 1e-6, 64)
    with pytest.raises(ValueError):
        step.attend(0, torch.zeros(1, 6 * d))  # f32 rows
    with pytest.raises(ValueError):
        step.norm(x.clone(), None, torch.ones(HP.n_embd))  # not the step's residual
    with pytest.raises(ValueError):
        step.gelu(torch.zeros(1, 64, dtype=BF))  # not [gate | up] of n_ff


# -- through the model ------------------------------------------------------------------------

def _run(m, split: bool, ids: list[int], chunk: int, general: bool,
         monkeypatch: pytest.MonkeyPatch,
         types: str | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Logits of every position of `ids` fed in `chunk`-token steps, the global layers' K/V
    (as stored: `types` names K's and V's cache type, None the compute dtype), and how many
    steps took KernelStep."""
    tr = m.transformer
    pool = model_pool(m, 256, 1, True, 128, swa_full=not split,
                      types=None if types is None else kv_types.resolve(types, types, m.dtype))
    assert isinstance(pool, SWAPool) == split
    used = []
    real = fw.Transformer._kernel_step

    def spy(self, *a):
        if general:
            return None
        step = real(self, *a)
        used.append(step is not None)
        return step
    outs = []
    with monkeypatch.context() as mp:
        mp.setattr(fw.Transformer, "_kernel_step", spy)
        for s in range(0, len(ids), chunk):
            part = ids[s : s + chunk]
            outs.append(tr.w.head.full(hidden(tr, pool, [BatchSeq(0, part, s, len(part))])))
    return torch.cat(outs), pool.k[:, :, pool.view(0).cells].clone(), sum(used)


def test_tiny_gemma3_step_equals_general_path(tiny_swa_path: str, monkeypatch):
    """bf16 with the kernels: KernelStep runs every step (prefill chunks of 70 and 7, decode
    tokens; --swa-full and the split cache, the window of 16 crossed many times) and gives
    the general path's logits and K/V bit for bit, whatever the chunking."""
    m = load_model(tiny_swa_path, "bf16")
    assert m.transformer.own_attention and m.deterministic
    ids = [(i * 7919) % 250 + 3 for i in range(70)]
    for split in (False, True):
        ref, ref_k, used = _run(m, split, ids, 70, True, monkeypatch)
        assert used == 0
        for chunk in (70, 7, 1):
            got, k, used = _run(m, split, ids, chunk, False, monkeypatch)
            assert used == -(-70 // chunk), (split, chunk)
            assert torch.equal(got, ref) and torch.equal(k, ref_k), (split, chunk)


def test_tiny_gemma3_bf16_step_close_to_f32(tiny_swa_path: str):
    """The step's arithmetic (bf16 activations, our kernels) stays close to the f32 reference
    path (torch ops throughout) on the tiny gemma3."""
    ids = [(i * 7919) % 250 + 3 for i in range(50)]
    outs = []
    for dtype in ("bf16", "f32"):
        m = load_model(tiny_swa_path, dtype)
        pool = model_pool(m, 256, 1, True, 128)
        outs.append(torch.cat([m.transformer.w.head.full(hidden(
            m.transformer, pool, [BatchSeq(0, ids[s : s + 10], s, 10)]))
            for s in range(0, 50, 10)]))
    err = (outs[0] - outs[1]).abs().max().item()
    assert err < 0.05 * outs[1].abs().max().item(), err


def test_every_variant_runs_the_step(variant, tiny_swa_path: str, monkeypatch):  # noqa: F811
    """Each kernel variant's build runs KernelStep on the tiny gemma3 with the general path's
    bits (in the same chunks: without AVX512-BF16 the layer matrices run torch's GEMM, whose
    rows change with the row count)."""
    m = load_model(tiny_swa_path, "bf16", kernels=config_for(variant))
    assert K.variant_name(m.transformer.kern) == variant
    ids = [(i * 31) % 250 + 3 for i in range(40)]
    ref = _run(m, True, ids, 8, True, monkeypatch)
    got = _run(m, True, ids, 8, False, monkeypatch)
    assert got[2] == 5 and torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_qwen3_takes_the_step_too(tiny_paths: dict[str, str], monkeypatch):
    """q/k norms without windows or post norms (qwen3): the step, with the general path's
    bits."""
    m = load_model(tiny_paths["qwen3"], "bf16")
    tr = m.transformer
    assert tr.w.layers[0].mixer.q_norm is not None
    ids = [(i * 31) % 250 + 3 for i in range(40)]
    ref = _run(m, False, ids, 40, True, monkeypatch)
    got = _run(m, False, ids, 8, False, monkeypatch)
    assert got[2] == 5 and torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])



@pytest.mark.parametrize("types", ["q8_0", "q4_0", "f16"])
def test_quantized_kv_step_equals_general_path(tmp_path, types: str, monkeypatch):
    """With K/V stored in a cache type (a tiny gemma3 with 32-dim heads, both cache layouts):
    the C step's store (csrc/kv_rows.c) and its attention over the stored blocks give the
    general path's bytes and logits (kv_types.py's quantizer, the kernel reading in place),
    whatever the chunking; and the type is really used (its rows are stored in the type)."""
    path = write_tiny_gguf(str(tmp_path / "g32.gguf"), arch="gemma3", n_layer=6, n_embd=128,
                           n_head=4, n_head_kv=1, seed=3, sliding_window=16)
    m = load_model(path, "bf16")
    assert m.hp.head_dim == 32 and m.transformer.own_attention
    ids = [(i * 7919) % 250 + 3 for i in range(60)]
    for split in (False, True):
        ref, ref_k, used = _run(m, split, ids, 60, True, monkeypatch, types)
        assert used == 0
        for chunk in (60, 7, 1):
            got, k, used = _run(m, split, ids, chunk, False, monkeypatch, types)
            assert used == -(-60 // chunk), (split, chunk)
            assert torch.equal(got, ref) and torch.equal(k, ref_k), (split, chunk)
        bf, bf_k, _ = _run(m, split, ids, 60, False, monkeypatch)
        t = kv_types.TYPES[types]
        assert k.dtype == t.storage and k.shape[-1] == t.width(32)
        # (f16 holds these bf16 values exactly: its rows read back as bf16's)
        assert torch.equal(t.dequantize(k, BF), bf_k) != t.quantized
        # the types' logits stay close to bf16 KV's
        assert (got - bf).abs().max() < 0.25 * bf.abs().max()
