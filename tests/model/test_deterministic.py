"""Deterministic mode on the default model in bf16: a token's K/V and logits are bitwise the same
however its sequence was chunked, whatever shares its batch, on 1 or 2 threads, with each variant
of our kernels (avx512bf16, avx512, avx2, generic: RADIXSERVE_KERNELS); and on torch's own ops
they are not (the checks below can fail)."""

from __future__ import annotations

import pytest
import torch

from radixserve.engine.batch import BatchSeq, hidden
from radixserve.memory.pool.pool import KVPool
from radixserve.model.forward import Transformer
from radixserve.model.head import RowNeed
from radixserve.model.loader import Model, load_model
from tests.model.kernel_variants import NO_KERNELS, VARIANTS, config_for, variant_kernels
from tests.conftest import model_pool

ENGLISH = ("The river rose through the night, and by morning the old bridge at the edge of "
           "town was under water. People gathered on the hill to watch, some with coffee, some "
           "with cameras, and the mayor spoke about the plan to rebuild. ")
CHINESE = ("服务端按最长公共前缀选择槽位,把提示词缓存在内存里;当槽位被占用时,旧的状态先写入"
           "缓存,再按先进先出的顺序淘汰。检查点记录序列的状态,恢复时从最近的检查点重新计算。")


def load_with(variant: str, path: str = "default", deterministic: str = "on") -> Model:
    """The model in bf16 on `variant`'s kernels (as RADIXSERVE_KERNELS=<variant> runs it)."""
    variant_kernels(variant)  # runs here and builds, or the test fails saying why
    m = load_model(path, "bf16", deterministic=deterministic, kernels=config_for(variant))
    kern = m.transformer.kern
    assert kern is not None and kern.variant == variant
    return m


@pytest.fixture(scope="module", params=VARIANTS)
def model(request: pytest.FixtureRequest) -> Model:
    m = load_with(request.param)
    assert m.deterministic
    return m


def text_tokens(model: Model, n: int, skip: int = 0) -> list[int]:
    """`n` tokens of real text, English then Chinese (as the seeds are), so the prompt is
    neither synthetic ids nor one script."""
    ids = model.tokenizer.encode((ENGLISH + CHINESE) * 8, add_special=False)
    assert len(ids) >= skip + n
    return ids[skip : skip + n]


def new_pool(tr: Transformer, n_cells: int = 1024, n_seq: int = 4) -> KVPool:
    hp = tr.hp
    return KVPool(hp.n_layer, hp.n_head_kv, hp.head_dim, n_cells, n_seq, True, tr.dtype,
                  tr.rope.rotate)


def prefill(tr: Transformer, pool: KVPool, seq: int, ids: list[int], chunk: int,
            pos0: int = 0) -> torch.Tensor:
    """Compute `ids` of sequence `seq` in chunks of `chunk` tokens; the last chunk's hidden
    state of its last token."""
    h = None
    for s in range(0, len(ids), chunk):
        h = hidden(tr, pool, [BatchSeq(seq, ids[s : s + chunk], pos0 + s)])
    assert h is not None
    return h


def kv_bytes(pool: KVPool, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    cells = pool.view(seq).cells
    return pool.k[:, :, cells].clone(), pool.v[:, :, cells].clone()


def test_prefix_kv_and_logits_equal_bitwise_in_one_chunk_or_many(model):
    tr = model.transformer
    ids = text_tokens(model, 300)
    ref_pool = new_pool(tr)
    ref_h = prefill(tr, ref_pool, 0, ids, 512)
    ref_kv = kv_bytes(ref_pool, 0)
    for chunk in (1, 7, 64, 100):
        pool = new_pool(tr)
        h = prefill(tr, pool, 0, ids, chunk)
        k, v = kv_bytes(pool, 0)
        assert torch.equal(k.view(torch.int16), ref_kv[0].view(torch.int16)), chunk
        assert torch.equal(v.view(torch.int16), ref_kv[1].view(torch.int16)), chunk
        assert torch.equal(h, ref_h), chunk
        assert torch.equal(tr.w.head.full(h), tr.w.head.full(ref_h)), chunk


def test_torch_ops_alone_are_not_chunk_invariant():
    """The check above has teeth: the same model on torch's ops (no kernels of ours: torch's
    int4 kernel switching to a dense GEMM on big chunks, SDPA, torch's f32 head) gives a
    prefix other K/V bits in one chunk than token by token, so the mode is off there."""
    torch_ops = load_model("default", "bf16", kernels=NO_KERNELS)
    tr = torch_ops.transformer
    assert tr.kern is None and not tr.deterministic
    ids = text_tokens(torch_ops, 300)
    pools = [new_pool(tr), new_pool(tr)]
    prefill(tr, pools[0], 0, ids, 512)
    prefill(tr, pools[1], 0, ids, 1)
    assert not torch.equal(kv_bytes(pools[0], 0)[0], kv_bytes(pools[1], 0)[0])
    with pytest.raises(ValueError, match="kernels did not build"):
        Transformer(tr.hp, tr.w, tr.dtype, kern=None, deterministic="on")


def step_logits(tr: Transformer, pool: KVPool, batch: list[BatchSeq]) -> torch.Tensor:
    """Full-head logits of every row the batch samples."""
    return tr.w.head.full(hidden(tr, pool, batch))


def test_logits_alone_equal_logits_in_a_batch(model):
    """Sequence 0's next token computed alone, then beside a prefill chunk and two decode
    tokens of other sequences (other lengths), then as the last token of its own prefill
    chunk: the same logits bit for bit, from the full head and from the shortlist."""
    tr = model.transformer
    ids = text_tokens(model, 260)
    others = [text_tokens(model, 90, skip=300), text_tokens(model, 40, skip=400),
              text_tokens(model, 170, skip=500)]
    prefix, nxt = ids[:-1], ids[-1]

    pool = new_pool(tr)
    prefill(tr, pool, 0, prefix, 512)
    alone = step_logits(tr, pool, [BatchSeq(0, [nxt], len(prefix))])

    pool = new_pool(tr)
    prefill(tr, pool, 0, prefix, 64)
    prefill(tr, pool, 2, others[1][:-1], 512)
    prefill(tr, pool, 3, others[2][:-1], 512)
    batch = [BatchSeq(1, others[0], 0), BatchSeq(2, others[1][-1:], len(others[1]) - 1),
             BatchSeq(0, [nxt], len(prefix)), BatchSeq(3, others[2][-1:], len(others[2]) - 1)]
    h = hidden(tr, pool, batch)
    in_batch = tr.w.head.full(h)
    assert torch.equal(in_batch[2], alone[0])
    # the shortlist head: the same exact logits wherever it looks
    for need in (RowNeed(1), RowNeed(40)):
        got = tr.w.head.logits(h, [need] * 4)[2]
        ref = tr.w.head.logits(hidden(tr, new_pool_with(tr, prefix), [
            BatchSeq(0, [nxt], len(prefix))]), [need])[0]
        assert torch.equal(got, ref)

    pool = new_pool(tr)
    prefill(tr, pool, 0, prefix[:-9], 512)
    in_chunk = step_logits(tr, pool, [BatchSeq(0, prefix[-9:] + [nxt], len(prefix) - 9)])
    assert torch.equal(in_chunk[0], alone[0])


def new_pool_with(tr: Transformer, prefix: list[int]) -> KVPool:
    pool = new_pool(tr)
    prefill(tr, pool, 0, prefix, 512)
    return pool


def test_one_or_two_threads_give_the_same_bits(model):
    tr = model.transformer
    ids = text_tokens(model, 200)
    n = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            pool = new_pool(tr)
            h = prefill(tr, pool, 0, ids[:-1], 64)
            h2 = hidden(tr, pool, [BatchSeq(0, ids[-1:], len(ids) - 1)])
            outs.append((kv_bytes(pool, 0)[0], tr.w.head.full(torch.cat([h, h2]))))
    finally:
        torch.set_num_threads(n)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_every_architecture_and_weight_type_is_chunk_and_batch_invariant(tiny_paths, arch,
                                                                         variant):
    """The tiny models in bf16, on each variant of our kernels: Q8_0 and Q4_1 layer matrices
    (our bf16, 4-bit or block-format kernels), qwen2's q/k/v biases, qwen3's q/k norms (torch
    RoPE, then our causal attention): a prefix's K/V and its last logits are the same bits in
    one chunk, in 7-token chunks and token by token, and the mode is on by default there."""
    m = load_with(variant, tiny_paths[arch], "auto")
    tr = m.transformer
    assert m.deterministic
    ids = [(i * 7919) % 250 + 3 for i in range(150)]
    ref_pool = new_pool(tr, n_cells=256)
    ref_h = prefill(tr, ref_pool, 0, ids, 512)
    for chunk in (7, 1):
        pool = new_pool(tr, n_cells=256)
        prefill(tr, pool, 1, ids[:40], 512)  # another sequence in the pool, and in the batch:
        h = hidden(tr, pool, [BatchSeq(0, ids[:chunk], 0), BatchSeq(1, ids[40:45], 40)])[:1]
        if len(ids) > chunk:
            h = prefill(tr, pool, 0, ids[chunk:], chunk, pos0=chunk)
        assert torch.equal(kv_bytes(pool, 0)[0], kv_bytes(ref_pool, 0)[0]), chunk
        assert torch.equal(kv_bytes(pool, 0)[1], kv_bytes(ref_pool, 0)[1]), chunk
        assert torch.equal(tr.w.head.full(h), tr.w.head.full(ref_h)), chunk


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("swa_full", [False, True], ids=["split-cache", "swa-full"])
def test_gemma3_is_chunk_and_batch_invariant(tiny_swa_path, swa_full, variant):
    """The tiny gemma3 in bf16 on each variant of our kernels (q/k norms, sliding windows of 16
    with their own RoPE base and, in the split layout, their own pruned cache; post norms,
    GeGLU: model/step.py's C glue and our windowed attention): a prefix's K/V in both
    kinds of layers and its last logits are the same bits in one chunk, in 7-token chunks and
    token by token, beside another sequence; and the mode is on by default there."""
    from radixserve.memory.pool.swa import SWAPool

    m = load_with(variant, tiny_swa_path, "auto")
    tr = m.transformer
    assert m.deterministic and tr.own_attention
    ids = [(i * 7919) % 250 + 3 for i in range(150)]

    def kv(pool) -> list[torch.Tensor]:
        parts = [pool, pool.swa] if isinstance(pool, SWAPool) else [pool]
        return [t[:, :, p.view(0).cells].clone() for p in parts for t in (p.k, p.v)]

    def new(n_seq: int = 2):
        pool = model_pool(m, 512, n_seq, True, 150, swa_full=swa_full)
        assert isinstance(pool, SWAPool) != swa_full
        return pool

    ref_pool = new()
    ref_h = prefill(tr, ref_pool, 0, ids, 512)
    ref_kv = kv(ref_pool)
    for chunk in (7, 1):
        pool = new()
        prefill(tr, pool, 1, ids[:40], 512)  # another sequence in the pool, and in the batch
        h = hidden(tr, pool, [BatchSeq(0, ids[:chunk], 0), BatchSeq(1, ids[40:45], 40)])[:1]
        h = prefill(tr, pool, 0, ids[chunk:], chunk, pos0=chunk)
        got = kv(pool)
        assert all(torch.equal(a, b) for a, b in zip(got, ref_kv)), chunk
        assert torch.equal(tr.w.head.full(h), tr.w.head.full(ref_h)), chunk
