"""LFM2 (short convolutions + attention): our forward equals HF transformers' Lfm2ForCausalLM
on the same GGUF, a token's bits do not depend on chunking in the default dtype, and a GGUF
whose LFM2 metadata and tensors disagree is refused naming the key or tensor.

The tiny models are random-weight GGUFs written the way llama.cpp's converter writes LFM2
(tests/tiny_gguf.py); the HF reference is built from the same file (tests/lfm2_hf.py)."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from radixserve.engine.batch import BatchSeq, forward
from radixserve.memory.pool.conv import ShiftRefused
from radixserve.model.hparams import UnsupportedModelError
from radixserve.model.loader import Model, load_model
from radixserve.model.short_conv import ShortConv
from tests.model.kernel_variants import kern, threads  # noqa: F401 (fixtures)
from tests.lfm2_hf import hf_lfm2_from_gguf
from tests.tiny_gguf import write_tiny_gguf
from tests.conftest import model_pool

TOKENS = [(37 * i * i + 11 * i + 300) % 40000 + 200 for i in range(70)]


def logits_in_chunks(m: Model, ids: list[int], chunks: list[int],
                     check: Callable[[Any, int], None] | None = None) -> torch.Tensor:
    """Every position's logits, the prompt fed in `chunks` (sizes) through a fresh pool of the
    model's windowed layout; `check(pool, n)` after each chunk (n tokens held)."""
    pool = model_pool(m, 256, 1, True, 64)
    assert pool.windowed is not None
    out, pos = [], 0
    for c in chunks:
        part = ids[pos:pos + c]
        out.append(forward(m.transformer, pool, [BatchSeq(0, part, pos, len(part))]))
        pos += len(part)
        pool.check()
        if check is not None:
            check(pool, pos)
    assert pos == len(ids)
    return torch.cat(out)


def chunked(n: int, size: int) -> list[int]:
    return [size] * (n // size) + ([n % size] if n % size else [])


def check_bits_do_not_depend_on_chunking_or_batch(
        m: Model, chunks_of: Callable[[Model, list[int], list[int]], torch.Tensor]) -> None:
    """TOKENS' logits (fed by `chunks_of`) bit for bit in one chunk, in chunks of 60, 7 and
    1, and beside another sequence's decode tokens."""
    n = len(TOKENS)
    one = chunks_of(m, TOKENS, [n])
    for size in (60, 7, 1):
        assert torch.equal(chunks_of(m, TOKENS, chunked(n, size)), one), size
    assert torch.equal(beside_another(m, TOKENS), one)


def beside_another(m: Model, ids: list[int]) -> torch.Tensor:
    """Every position's logits of `ids` fed in chunks of 9, each step beside a decode token of
    another sequence (its tokens `ids` shifted by one) in a fresh two-sequence pool."""
    pool = model_pool(m, 256, 2, True, 64)
    other = [t + 1 for t in ids]
    got, pos = [], 0
    for c in chunked(len(ids), 9):
        out = forward(m.transformer, pool, [BatchSeq(1, other[pos:pos + c], pos, 1),
                                            BatchSeq(0, ids[pos:pos + c], pos, c)])
        got.append(out[1:])
        pos += c
    return torch.cat(got)


@pytest.fixture(scope="module", params=[False, True], ids=["f32-weights", "quantized"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("lfm2")
    return write_tiny_gguf(str(d / "tiny-lfm2.gguf"), arch="lfm2", n_layer=6, n_head=4,
                           n_head_kv=2, seed=5, attn_layers=(2, 5), quantize=request.param)


# f32 against HF's f32: measured max abs error over every position's logits (largest logit
# ~21-22) 1.5e-5 / 2.8e-5 / 1.9e-5 (one chunk, chunks of 1, of 7) with f32 weights, 1.9e-5 /
# 3.1e-5 / 2.0e-5 quantized; the bound is ~3x the largest, rounding noise and nothing more
# (the bound it replaced, 2e-3 of the largest logit, was ~0.044: 1,400x that)
HF_BOUND = 1e-4


@pytest.mark.family_reference("lfm2")
def test_tiny_lfm2_matches_hf(tiny: str):
    """f32: every position's logits within HF_BOUND of HF's, in one chunk and in chunks of 1
    and 7 (the conv layers reading their earlier input rows from the pool's window part);
    greedy continuation equal."""
    check_against_hf(load_model(tiny, "f32"), hf_lfm2_from_gguf(tiny), HF_BOUND,
                     logits_in_chunks)


def check_against_hf(m: Model, ref: Any, bound: float,
                     chunks_of: Callable[[Model, list[int], list[int]], torch.Tensor]) -> None:
    """`m`'s f32 logits of TOKENS (fed by `chunks_of` in one chunk, chunks of 1 and of 7)
    within `bound` of the HF model `ref`'s, the same argmax; then 12 greedy decode steps
    equal to HF's generate."""
    with torch.no_grad():
        want = ref(torch.tensor([TOKENS])).logits[0].float()
    n = len(TOKENS)
    for chunks in ([n], chunked(n, 1), chunked(n, 7)):
        got = chunks_of(m, TOKENS, chunks)
        err = (got - want).abs().max().item()
        assert err < bound, (chunks[:2], err)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    # decode: the greedy tokens after the prompt, one step at a time against HF's generate
    pool = model_pool(m, 256, 1, True, 64)
    last = forward(m.transformer, pool, [BatchSeq(0, TOKENS, 0, 1)])[0]
    ours = []
    for i in range(12):
        ours.append(int(last.argmax()))
        last = forward(m.transformer, pool, [BatchSeq(0, [ours[-1]], n + i, 1)])[0]
    with torch.no_grad():
        hf = ref.generate(torch.tensor([TOKENS]), max_new_tokens=12, min_new_tokens=12,
                          do_sample=False)[0, n:].tolist()
    assert ours == hf


def test_tiny_lfm2_bits_do_not_depend_on_chunking(tiny_lfm2_path: str):
    """bf16 with our kernels (the default, deterministic): chunks of 60, 7 and 1 (decode
    steps) give every position's logits bit for bit."""
    m = load_model(tiny_lfm2_path, "bf16", deterministic="on")
    assert m.deterministic
    one = logits_in_chunks(m, TOKENS, [70])
    for size in (60, 7, 1):
        assert torch.equal(logits_in_chunks(m, TOKENS, chunked(70, size)), one), size


def test_the_conv_state_is_never_shifted(tiny_lfm2_path: str):
    m = load_model(tiny_lfm2_path, "bf16")
    pool = model_pool(m, 256, 1, True, 64)
    forward(m.transformer, pool, [BatchSeq(0, TOKENS[:10], 0, 1)])
    with pytest.raises(ShiftRefused):
        pool.seq_add(0, 5, -1, -2)
    pool.check()
    assert pool.seq_positions(0) == list(range(10))


# -- refusals: the metadata and the tensors must agree ---------------------------------------

_read = functools.cache(gguf.GGUFReader)  # gguf-py parses a 49k-token vocabulary in seconds


def check_refusals(src: str, tmp_path: Path, arch: str, n_vocab: int,
                   cases: list[tuple[dict[str, Any], str]]) -> None:
    """Each case's copy of `src` (rewrite's keyword arguments, with the vocabulary's size set
    as a key: rewrite drops the tokenizer) refused at load with an UnsupportedModelError whose
    message contains the case's text."""
    for i, (kw, msg) in enumerate(cases):
        kw = dict(kw)
        keys = {f"{arch}.vocab_size": n_vocab, **kw.pop("set_keys", {})}
        bad = rewrite(src, tmp_path / f"bad{i}.gguf", arch=arch, set_keys=keys, **kw)
        with pytest.raises(UnsupportedModelError, match=re.escape(msg)):
            load_model(bad, "f32")


def rewrite(src: str, dst: Path, drop_keys: tuple[str, ...] = (),
            set_keys: dict[str, object] | None = None,
            tensors: dict[str, np.ndarray] | None = None, arch: str = "lfm2") -> str:
    """A copy of GGUF `src` with keys dropped or set, tensors replaced or added (f32), and the
    architecture renamed to `arch` (its keys with it). Without its tokenizer: the refusals
    come before the tokenizer is read, and copying a 49k-token vocabulary costs seconds."""
    r = _read(src)
    w = gguf.GGUFWriter(str(dst), arch)
    set_keys = set_keys or {}
    for f in r.fields.values():
        if (f.name.startswith(("GGUF.", "tokenizer.")) or f.name == "general.architecture"
                or f.name in drop_keys or f.name in set_keys):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name.replace("lfm2.", f"{arch}.", 1), f.contents(), vtype,
                        sub_type=sub)
    for k, v in set_keys.items():
        if isinstance(v, list):
            w.add_array(k, v)
        else:
            w.add_uint32(k, int(v))
    for t in r.tensors:
        if tensors and t.name in tensors:
            w.add_tensor(t.name, tensors[t.name])
        else:
            w.add_tensor(t.name, np.array(t.data), raw_shape=np.array(t.data).shape,
                         raw_dtype=t.tensor_type)
    for name, a in (tensors or {}).items():
        if name not in {t.name for t in r.tensors}:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(dst)


def test_refusals_name_the_key_or_tensor(tmp_path: Path):
    src = write_tiny_gguf(str(tmp_path / "ok.gguf"), arch="lfm2", n_layer=3, n_head=4,
                          n_head_kv=2, attn_layers=(1,), quantize=False)
    load_model(src, "f32")  # the file itself loads
    cases = [
        (dict(drop_keys=("lfm2.shortconv.l_cache",)), "lfm2.shortconv.l_cache"),
        (dict(set_keys={"lfm2.attention.head_count_kv": 2}), "head_count_kv"),
        (dict(set_keys={"lfm2.attention.head_count_kv": [2, 0]}), "must list 3 layers"),
        (dict(set_keys={"lfm2.attention.head_count_kv": [0, 0, 0]}), "share one KV head"),
        (dict(tensors={"blk.0.shortconv.conv.weight": np.zeros((64, 4), np.float32)}),
         "'blk.0.shortconv.conv.weight' has shape [64, 4]"),
        (dict(tensors={"blk.2.shortconv.in_proj.weight": np.zeros((128, 64), np.float32)}),
         "'blk.2.shortconv.in_proj.weight'"),
    ]
    for i, (kw, words) in enumerate(cases):
        bad = rewrite(src, tmp_path / f"bad{i}.gguf", **kw)
        with pytest.raises(UnsupportedModelError, match=words.replace("[", r"\[")):
            load_model(bad, "f32")


def test_an_lfm2_file_named_lfm2moe_is_refused_naming_the_expert_key(tmp_path: Path):
    """LFM2-MoE is served (tests/model/test_moe.py); a dense file under its name lacks the
    experts, and the refusal names the first key missing."""
    src = write_tiny_gguf(str(tmp_path / "ok.gguf"), arch="lfm2", n_layer=2, quantize=False)
    moe = rewrite(src, tmp_path / "moe.gguf", arch="lfm2moe")
    with pytest.raises(UnsupportedModelError, match="lfm2moe.expert_count"):
        load_model(moe, "f32")


@pytest.mark.parametrize("n_tok", [1, 20])
def test_the_c_conv_step_gives_the_torch_paths_bits(kern, threads, n_tok: int) -> None:
    """csrc/short_conv.c against model/short_conv.py's torch ops on the same plan, every x86
    variant, 1 and 2 threads, one token (decode) and 20 (the threaded path): the stored input
    rows and the output bit for bit. Reads name earlier cells, the step's own new cells and
    positions before 0 (-1)."""
    g = torch.Generator().manual_seed(n_tok)
    e, L, n_cells, n_conv = 96, 3, 48, 2
    hp = type("HP", (), {"n_embd": e, "l_cache": L})()
    k0 = torch.randn(n_conv, 1, n_cells, e // 2, generator=g).bfloat16()
    v0 = torch.randn(n_conv, 1, n_cells, e // 2, generator=g).bfloat16()
    new = torch.arange(n_cells - n_tok, n_cells)
    reads = torch.randint(-1, n_cells, (n_tok * L,), generator=g)
    reads[-1] = new[-1]  # the last output reads its own row
    w = torch.randn(e, L, generator=g)
    bcx = (torch.randn(n_tok, 3 * e, generator=g) * 3).bfloat16()
    got = []
    for kernels in (None, kern):
        k, v = k0.clone(), v0.clone()
        step = ShortConv(hp, k, v, new, reads, kernels)
        assert (step.kern is None) == (kernels is None)
        got.append((step.run(1, w, bcx), k, v))
    (a, ka, va), (b, kb, vb) = got
    assert torch.equal(ka, kb) and torch.equal(va, vb) and not torch.equal(ka, k0)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="short_conv kernel"):
        kern.short_conv(bcx.float(), k0[1, 0], v0[1, 0], new, reads, w)
    with pytest.raises(ValueError, match="short_conv kernel"):
        kern.short_conv(bcx, k0[1, 0], v0[1, 0], new.int(), reads, w)


def test_a_plan_reads_the_cells_of_the_positions_before_each_token() -> None:
    """ShortConv.plan looks for a step's rows among the view's last positions first (a window,
    or a draft's view of the whole sequence) and in the whole view when they are not there
    (cells held past the new tokens): either way each output reads the cells of positions
    p - L + 1 .. p, -1 before position 0; a position the view lacks is an error."""
    from types import SimpleNamespace as NS

    hp = NS(n_embd=8, l_cache=3)
    k = v = torch.zeros(1, 1, 32, 4, dtype=torch.bfloat16)
    cells = torch.tensor([20 + p for p in range(10)])  # positions 0..9 at cells 20..29

    def step(pos0: int, n: int, view: slice | torch.Tensor, positions: list[int]) -> NS:
        return NS(pos0=pos0, tokens=[0] * n, swa=NS(cells=[20 + pos0 + i for i in range(n)],
                                                      kv_cells=view, kv_positions=positions))

    at_end = ShortConv.plan(hp, [step(8, 2, cells, list(range(10)))], k, v)
    assert at_end.reads.tolist() == [26, 27, 28, 27, 28, 29] and at_end.new.tolist() == [28, 29]
    inside = ShortConv.plan(hp, [step(1, 2, slice(20, 30), list(range(10)))], k, v)
    assert inside.reads.tolist() == [-1, 20, 21, 20, 21, 22]
    with pytest.raises(ValueError, match="holds no input row at position 3"):
        ShortConv.plan(hp, [step(5, 1, cells[5:], list(range(5, 10)))], k, v)
