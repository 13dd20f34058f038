"""LFM2 (short convolutions + attention, its conv state a window of input rows in the pool's
window part: memory/pool/conv.py) through the real scheduler on the paths test_swa.py does not
run: n-gram speculative decoding with rejected drafts, a draft model (draft-simple: the LFM2
drafting for itself, a recurrent LFM2 draft whose conv rows live beside the target's in the
same cells, memory/pool/draft.py, and an attention-only llama draft; the reverse pairing, a
recurrent draft for an attention target, is refused), n_cmpl children,
the disk tier across a restart (and a damaged block), agent sessions outnumbering the slots
(the exact prompt tokens computed, per host backend), and quantized KV.

Every answer is compared, token for token, with the same prompt computed alone with no cache
of any kind (deterministic bf16: cached == uncached to the bit), and every test asserts that
the path under test really served (plans' sources, reused counts, draft counters), so a run
that silently recomputed everything cannot pass.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

import radixserve.memory.prefix_plan as prefix_plan
from radixserve.bench.stats import unshared_minimum
from radixserve.config import ServerConfig, SpecConfig
from radixserve.engine.build import build_scheduler
from radixserve.engine.counters import ServerMetrics
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.speculative import load_draft
from radixserve.engine.task import CompletionTask, FinalResult
from radixserve.memory.pool.conv import ConvPool
from radixserve.memory.prefix_plan import Source
from radixserve.memory.tiers.disk_block import MAGIC, SUFFIX
from radixserve.model.loader import Model, load_model
from radixserve.sampling.chain import SamplingParams
from tests.engine.test_deterministic import N_PREDICT, Recorder, drive, greedy, run_to_end
from tests.engine.test_speculative import (TIERS, check_draft_kv, draft_rows,
                                           slot_file_round_trip, spec_sched)
from tests.engine.test_swa import DOCS, QS, P, Ref, edit, kv_rows, sched
from tests.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def model(tiny_lfm2_path: str) -> Model:
    """The tiny LFM2 of tests/conftest.py: 6 layers, attention at 2 and 5, the others short
    convolutions of kernel length 3 (their state: the last 2 input rows)."""
    m = load_model(tiny_lfm2_path, "bf16", deterministic="on")
    assert m.deterministic and m.hp.recurrent
    assert (m.hp.arch, m.hp.n_swa, m.hp.l_cache) == ("lfm2", 0, 3)
    return m


@pytest.fixture(scope="module")
def ref(model: Model) -> Ref:
    return Ref(model)


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200, 40000) for _ in range(n)]


def holder(s: Scheduler, prompt: list[int]) -> int:
    """The slot whose KV starts with `prompt` (the one that just answered it)."""
    (slot,) = [sl for sl in s.slots if list(sl.kv.tokens[: len(prompt)]) == prompt]
    return slot.id


def same_kv(s: Scheduler, ref: Ref, prompt: list[int], fresh: bool = True) -> None:
    """The KV the slot holding `prompt` keeps equals a fresh computation's, bit for bit: the
    attention rows of every position, and the conv input rows of every position both hold -
    which must include the window (the last n_swa positions: the conv state). How many older
    rows a window keeps until its next prune depends on the slot's history, so only the rows
    both hold are compared. `fresh` False: the reference's slot holds `prompt` already."""
    if fresh:
        ref.run(prompt)
    (gp, gk, gv, gwk, gwv), (wp, wk, wv, wwk, wwv) = (kv_rows(s, holder(s, prompt)),
                                                      kv_rows(ref.sched, 0))
    assert torch.equal(gk, wk) and torch.equal(gv, wv), "attention rows differ from a fresh run"
    got, want = gp.tolist(), wp.tolist()
    common = sorted(set(got) & set(want))
    n = gk.shape[2]  # positions held
    assert set(range(n - s.pool.n_swa, n)) <= set(common), (got[-4:], want[-4:])
    gi, wi = [got.index(p) for p in common], [want.index(p) for p in common]
    assert torch.equal(gwk[:, :, gi], wwk[:, :, wi]), "conv input rows differ"
    assert torch.equal(gwv[:, :, gi], wwv[:, :, wi]), "conv input rows differ"


def check_run(s: Scheduler, ref: Ref, prompts: list[list[int]]) -> None:
    """test_swa.py's check_run with `same_kv`: each prompt's tokens, then its slot's KV, equal
    a fresh computation's (the reference runs first: the plans recorded last are then the
    scheduler's under test)."""
    for p in prompts:
        want = ref.run(p)
        assert drive(s, [greedy(p)])[0] == want
        same_kv(s, ref, p, fresh=False)


# -- 1. n-gram speculative decoding -----------------------------------------------------------

ECHO_SEEDS, ECHO_TAILS, ECHO_ANSWER = range(4), (8, 16), 40


@pytest.fixture(scope="module")
def echo_prompts(ref: Ref) -> list[list[list[int]]]:
    """echo[seed][i]: a random prompt X, the first 40 tokens of X's own greedy answer A, then
    X's last 8 (i = 0) or 16 (i = 1) tokens again. The model then partly retraces A (LFM2's
    conv layers see only the last 3 positions, its 2 attention layers everything), so the
    n-gram drafter, finding X's tail followed by A in the context, proposes A's tokens: some
    are the target's and are accepted, the rest rejected where the answer leaves A. Both
    prompts of a seed share the prefix X + A (90 tokens), so the second reuses it."""
    out = []
    for seed in ECHO_SEEDS:
        x = rand_tokens(random.Random(seed), 50)
        a = ref(x)[:ECHO_ANSWER]
        out.append([x + a + x[-n:] for n in ECHO_TAILS])
    return out


NGRAM = SpecConfig(types=["ngram-simple"], ngram_simple_size_n=2, ngram_simple_size_m=8)
SPEC_TIERS = {  # settings, the sources that must serve, tokens the second prompt reuses
    # the slot's own KV: a context checkpoint (ubatch 8 puts one at 98 - 12 = 86, in X + A)
    "in-slot": (dict(cache_ram_mib=0, n_parallel=2), {Source.OWN}, 86),
    # llama.cpp's whole-prompt cache (entries carry the same checkpoints), one slot
    "legacy": (dict(cache_ram_mib=64, cache_radix_prompt=False, n_parallel=1),
               {Source.HOST}, 86),
    # the radix tree (every token's conv rows: all of X + A) and other slots' cells
    "radix-unified": (dict(n_parallel=2, kv_unified=True), {Source.HOST}, 90),
}


@pytest.mark.parametrize("tier", list(SPEC_TIERS))
def test_ngram_speculation_with_rejections_equals_no_speculation(
        model: Model, ref: Ref, echo_prompts: list[list[list[int]]], monkeypatch, tier: str
) -> None:
    """Drafts accepted and drafts rejected (a rejection removes the drafted positions' rows,
    the conv window keeping the rows before them): the greedy tokens are those without
    speculation and without any cache, and so is the KV each slot then holds, bit for bit
    (every attention row, the conv window's input rows and their positions)."""
    kw, sources, n_reused = SPEC_TIERS[tier]
    rec = Recorder(monkeypatch)
    s = sched(model, spec=NGRAM, **kw)
    assert isinstance(s.pool, ConvPool) and s.spec is not None
    for pair in ((0, 1), (2, 3)):  # two seeds side by side: their 8-token tails, then 16
        for i in range(len(ECHO_TAILS)):
            prompts = [echo_prompts[seed][i] for seed in pair]
            want = [ref(p) for p in prompts]
            finals = run_to_end(s, [greedy(p) for p in prompts])
            assert [f.tokens for f in finals] == want and not any(f.truncated for f in finals)
            s.check()
            for p in prompts[-len(s.slots):]:  # the prompts the slots still hold
                same_kv(s, ref, p)
            if i == 1:  # the second prompt of each seed reused its first one's prefix
                assert [f.timings.cache_n for f in finals] == [n_reused] * 2
    used = {sp.source for pl in rec.plans for sp in pl.spans if sp.source is not Source.COMPUTE}
    assert sources <= used, f"{tier}: prefixes came from {used}"
    m = s.metrics
    assert m.n_drafts_total > 0, "nothing was drafted"
    assert 0 < m.n_draft_accepted_total, "no draft token was accepted"
    assert m.n_draft_accepted_total < m.n_draft_tokens_total, "no draft token was rejected"


# -- 2. a draft model ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain(tiny_path: str) -> Model:
    """A tiny llama with the same (default) vocabulary: an attention-only draft."""
    return load_model(tiny_path, "bf16", deterministic="on")


@pytest.fixture(scope="module")
def lfm2_draft(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """Another tiny LFM2 (4 layers, attention at 1, other weights): a poor recurrent draft."""
    path = write_tiny_gguf(str(tmp_path_factory.mktemp("lfm2-draft") / "draft.gguf"),
                           arch="lfm2", n_layer=4, n_head=4, n_head_kv=2, seed=12,
                           attn_layers=(1,), l_cache=3)
    return load_model(path, "bf16", deterministic="on")


@pytest.mark.parametrize("via", ["load_draft", "settings", "handed"])
def test_a_recurrent_draft_for_an_attention_target_is_refused(model: Model, plain: Model,
                                                              via: str) -> None:
    """A recurrent draft's conv rows are never rotated, so its target must refuse context
    shifts as a recurrent one does: an LFM2 drafting for a llama is refused when the server is
    built, naming the recurrent layers, whether the draft is loaded from the settings or
    handed over."""
    cfg = ServerConfig(ctx_size=512, n_parallel=1, cache_ram_mib=0,
                       spec=SpecConfig(types=["draft-simple"], draft_model=model.path, n_max=3))
    with pytest.raises(ValueError, match=r"recurrent \(short-convolution\).*recurrent target"):
        if via == "load_draft":
            load_draft(cfg, plain)
        else:
            build_scheduler(plain, cfg, ServerMetrics(), draft=model if via == "handed" else None)


DRAFTS = {"self": dict(n_max=4), "lfm2": dict(n_max=3, n_min=2, p_min=0.5),
          "llama": dict(n_max=3)}
# as tests/engine/test_speculative.py's, but a finished slot's window has moved past the
# document's end, so the tree serves it where the attention model shares another slot's cells
DRAFT_TIERS = TIERS | {"radix-shared": (TIERS["radix-shared"][0], {Source.HOST})}

def spec_prompts() -> list[list[int]]:
    """Two documents, two requests each (the second reuses its document from some tier)."""
    rng = random.Random(44)
    out = []
    for _ in range(2):
        doc = rand_tokens(rng, 70)
        out += [doc + rand_tokens(rng, 6) for _ in range(2)]
    return out


def draft_task(p: list[int], **kw: Any) -> CompletionTask:
    """A chat-like request: a user message (so a checkpoint) starts after the document."""
    t = CompletionTask(list(p), SamplingParams(temperature=0), **({"n_predict": 24} | kw),
                       ignore_eos=True)
    t.user_starts = (0, 70)
    return t


def spec_engine(model: Model, draft: Model, name: str, **kw: Any) -> Scheduler:
    return spec_sched(model, draft, dict(types=["draft-simple"], draft_model=draft.path,
                                         **DRAFTS[name]), **kw)


@pytest.fixture(scope="module")
def spec_reference(ref: Ref) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): drive(ref.sched, [draft_task(p, cache_prompt=False)])[0]
            for p in spec_prompts()}


@pytest.mark.parametrize("tier", list(DRAFT_TIERS))
@pytest.mark.parametrize("name", list(DRAFTS))
def test_a_draft_model_gives_the_answers_without_speculation(
        model: Model, lfm2_draft: Model, plain: Model, spec_reference, monkeypatch,
        name: str, tier: str) -> None:
    """An LFM2 target with draft-simple: drafting for itself (every draft accepted: a draft
    row out of step with its token would be rejected), a random tiny LFM2 (a recurrent draft:
    its conv rows a cell beside the target's; mostly rejected) and an attention-only llama.
    On every tier the answers are the prompts' alone without speculation or cache, and the
    draft rows every slot holds (restored from a tier or computed, rolled back past rejected
    tokens) are the draft's own computation of its tokens, bit for bit."""
    draft = {"self": model, "lfm2": lfm2_draft, "llama": plain}[name]
    kw, sources = DRAFT_TIERS[tier]
    rec = Recorder(monkeypatch)
    s = spec_engine(model, draft, name, **kw)
    prompts = spec_prompts()
    outs = drive(s, [draft_task(prompts[i]) for i in (0, 2)])
    for i in (1, 3):  # each document again, its prefix from a tier: the rows checked at once
        s.check()
        outs += drive(s, [draft_task(prompts[i])])
        check_draft_kv(s, model, draft)
    assert len(s.pool.draft.parts()) == (2 if draft.hp.recurrent else 1)  # conv rows too
    assert outs == [spec_reference[tuple(prompts[i])] for i in (0, 2, 1, 3)]
    used = {p.source for p in rec.plans if p.n_prefix}
    assert sources <= used, f"{tier}: prefixes came from {used}"
    m = s.metrics
    assert m.n_drafts_total > 0 and m.n_draft_tokens_total > 0, "nothing was drafted"
    if name == "self":
        assert m.n_draft_accepted_total == m.n_draft_tokens_total
    else:
        assert m.n_draft_accepted_total < m.n_draft_tokens_total, "no draft token rejected"


def test_a_slot_file_carries_the_recurrent_drafts_rows(model: Model, lfm2_draft: Model,
                                                        spec_reference, tmp_path: Path) -> None:
    """The slot file's draft appendix (SDFT) holds both groups of a recurrent draft's rows; a
    restore brings them back bit for bit; a file whose draft part is cut short keeps the
    target's state and computes the draft rows again, and the answer stays right."""
    kw = dict(cache_ram_mib=0, n_parallel=1, slot_save_path=str(tmp_path))
    s = spec_engine(model, lfm2_draft, "lfm2", **kw)
    p = spec_prompts()[1]
    assert drive(s, [draft_task(p)])[0] == spec_reference[tuple(p)]
    n = slot_file_round_trip(s)
    assert len(draft_rows(s, 0, n)) == 4  # attention K/V, conv rows
    raw = (tmp_path / "a.bin").read_bytes()
    at = raw.rindex(b"SDFT")
    (tmp_path / "cut.bin").write_bytes(raw[: at + (len(raw) - at) * 3 // 4])
    assert s.mem.slot_action(0, "restore", "cut.bin")["n_restored"] == n
    assert s.slots[0].kv.n_draft == 0 and len(s.slots[0].kv) == n
    assert drive(s, [draft_task(p)])[0] == spec_reference[tuple(p)]
    assert s.slots[0].n_cached > 0
    check_draft_kv(s, model, lfm2_draft)


# -- 3. n_cmpl children ----------------------------------------------------------------------

def n_cmpl_tasks(prompt: list[int], seed: int) -> list[CompletionTask]:
    """A request with n_cmpl = 3 as http/parse.py builds it: the parent (greedy here) and two
    children (seeded samples: three different answers over one prompt's KV)."""
    params = [SamplingParams(temperature=0)] + [
        SamplingParams(temperature=0.9, top_k=40, seed=seed + j) for j in (1, 2)]
    first = CompletionTask(list(prompt), params[0], n_predict=32, ignore_eos=True, n_cmpl=3)
    return [first] + [dataclasses.replace(first, params=params[j], id_slot=-1, parent=first,
                                          index=j) for j in (1, 2)]


@pytest.mark.parametrize("host", ["none", "radix"])
@pytest.mark.parametrize("unified", [True, False])
def test_n_cmpl_children_take_the_parents_prompt(model: Model, ref: Ref, monkeypatch,
                                                 unified: bool, host: str) -> None:
    """n_cmpl = 3, sent twice (the same prompt, other seeds): the children wait for the
    parent's prompt, then take it (the conv window at the prompt's end included) and compute
    only its last token; each answer is the one its prompt and sampler give alone with no
    cache. The second time the parent finds its prompt held (its slot, or the radix tree).

    With unified KV the children take the parent's cells themselves (prefix_plan's `prefer`,
    scheduler.py: "n_cmpl > 1 children ... take its cells"), so the three slots hold one copy
    of the prompt's attention rows - also when the host tier holds the whole prompt too (the
    second request, or a window model's write-through) and could restore as many tokens: a
    copy from the host would hold three."""
    check_n_cmpl(model, ref, monkeypatch, unified, host)


def check_n_cmpl(model: Model, ref: Ref, monkeypatch: pytest.MonkeyPatch, unified: bool,
                 host: str) -> None:
    """test_n_cmpl_children_take_the_parents_prompt's run and checks, for `model`."""
    rec = Recorder(monkeypatch)
    s = sched(model, n_parallel=3, kv_unified=unified, ubatch_size=512,
              cache_ram_mib=0 if host == "none" else 256)
    prompt = rand_tokens(random.Random(23), 90)
    for rnd in range(2):
        tasks = n_cmpl_tasks(prompt, 1000 * (rnd + 1))
        rec.plans.clear()
        outs: list[list[Any]] = [[] for _ in tasks]
        for t, out in zip(tasks, outs):
            s.submit(t, out.append)
        cells: set[int] = set()
        while s.has_active() or s.deferred:  # run_to_end's loop, with a look at the cells
            s.step()
            s.check()
            if all(sl.is_processing and sl.generated for sl in s.slots) and not cells:
                # every completion decoding: the cells the three slots hold
                cells = {c for sl in s.slots for c in s.pool.seq_cells(sl.id)}
        assert cells, "the three completions never decoded side by side"
        plans = list(rec.plans)  # the scheduler's (before the reference runs below)
        finals = [o[-1] for o in outs]
        assert all(isinstance(f, FinalResult) for f in finals), finals
        want = [drive(ref.sched, [dataclasses.replace(t, parent=None, n_cmpl=1,
                                                      cache_prompt=False)])[0] for t in tasks]
        assert [f.tokens for f in finals] == want, rnd
        assert len({tuple(w) for w in want}) == 3
        n = len(prompt)
        assert [(f.timings.prompt_n, f.timings.cache_n) for f in finals] == (
            [(n, 0) if rnd == 0 else (1, n - 1)] + [(1, n - 1)] * 2), rnd
        assert all(pl.n_reused == n - 1 for pl in plans[1 - rnd:]), plans
        if unified:
            # the parent's cells (or the slot's own, which already share them), never a copy
            # from the host tier: one copy of the prompt's cells, each slot's tokens past it
            assert not [pl for pl in plans if pl.source is Source.HOST], (rnd, plans)
            assert len(cells) <= n + 3 * 4, (rnd, len(cells))
        else:  # partitioned: each slot its own copy, from the parent's cells or the tree
            assert len(cells) >= 3 * n, (rnd, len(cells))


# -- 4. the disk tier and a restart ----------------------------------------------------------

BLOCK = 16


def disk_engine(model: Model, directory: Path) -> Scheduler:
    cfg = ServerConfig(ctx_size=512, n_parallel=2, cache_disk=str(directory),
                       cache_disk_block=BLOCK)
    s = build_scheduler(model, cfg, ServerMetrics())
    assert isinstance(s.pool, ConvPool) and s.mem.cache.stats()["bytes"] == 0  # RAM: empty
    return s


def block_files(directory: Path) -> dict[int, Path]:
    """The block files under `directory`, by their first position (read from the header)."""
    out = {}
    for root, _, names in os.walk(directory):
        for name in names:
            if name.endswith(SUFFIX):
                data = (Path(root) / name).read_bytes()
                (n,) = struct.unpack_from("<I", data, len(MAGIC))
                header = json.loads(data[len(MAGIC) + 4: len(MAGIC) + 4 + n])
                out[header["pos0"]] = Path(root) / name
    return out


@pytest.fixture(scope="module")
def disk_prompts() -> tuple[list[int], list[int]]:
    """Two prompts sharing 80 tokens (5 whole blocks), diverging after them."""
    doc = rand_tokens(random.Random(31), 80)
    return doc + [5001, 5002, 5003], doc + [6001, 6002]


def write(model: Model, ref: Ref, first: list[int], directory: Path) -> None:
    """An engine answers `first`, writes its blocks through to `directory`, and closes."""
    s = disk_engine(model, directory)
    assert drive(s, [greedy(first)])[0] == ref(first)
    s.mem.disk.disk.drain()  # every write-through on disk
    s.mem.close()
    held = len(first) + N_PREDICT - 1  # the prompt and every answer token but the last
    assert sorted(block_files(directory)) == list(range(0, held // BLOCK * BLOCK, BLOCK))


def test_restart_restores_the_conv_rows_from_disk(model: Model, ref: Ref, disk_prompts,
                                                  tmp_path: Path) -> None:
    """Blocks hold every token's attention rows and conv input rows: a new engine on the same
    directory (nothing in RAM) serves the 80 shared tokens from disk, and answers as the
    prompt alone; the slot's KV (conv window included) is then a fresh run's, bit for bit."""
    first, second = disk_prompts
    write(model, ref, first, tmp_path)
    s = disk_engine(model, tmp_path)
    f = run_to_end(s, [greedy(second)])[0]
    assert f.tokens == ref(second)
    assert f.timings.cache_n == 80 and f.timings.reuse is not None
    assert f.timings.reuse.tier == "disk" and f.timings.reuse.n_tokens == 80
    fig = s.mem.tier_figures()["disk"]
    assert (fig["hits"], fig["hit_tokens"], fig["bad_files"]) == (1, 80, 0)
    same_kv(s, ref, second)
    s.check()
    s.mem.close()


def test_a_damaged_block_is_refused_and_recomputed(model: Model, ref: Ref, disk_prompts,
                                                   tmp_path: Path) -> None:
    """One flipped bit in the rows of the third block (positions 32..47): the restarted
    engine's read stops there, the two blocks before it serve 32 tokens, the rest is
    computed, and the answer is the prompt's alone. The write-through then puts the block
    back, byte for byte the file first written (deterministic rows)."""
    first, second = disk_prompts
    write(model, ref, first, tmp_path)
    bad = block_files(tmp_path)[2 * BLOCK]
    good = bad.read_bytes()
    data = bytearray(good)
    data[len(data) // 2] ^= 0x10  # inside the rows (the header is ~440 of ~12.7k bytes)
    bad.write_bytes(bytes(data))
    s = disk_engine(model, tmp_path)
    f = run_to_end(s, [greedy(second)])[0]
    assert f.tokens == ref(second)
    assert f.timings.cache_n == 2 * BLOCK and f.timings.prompt_n == len(second) - 2 * BLOCK
    assert f.timings.reuse is not None and f.timings.reuse.tier == "disk"
    fig = s.mem.tier_figures()["disk"]
    assert (fig["hits"], fig["hit_tokens"], fig["bad_files"]) == (1, 2 * BLOCK, 1)
    same_kv(s, ref, second)
    s.check()
    s.mem.disk.disk.drain()
    assert bad.read_bytes() == good
    s.mem.close()


# -- 5. agent sessions on fewer slots than sessions ------------------------------------------

N_SESSIONS, N_STEPS, N_TOOLS, N_AGENT_PREDICT = 5, 3, 60, 8


def agent_task(prompt: list[int], chat: bool, **kw: Any) -> CompletionTask:
    t = CompletionTask(list(prompt), SamplingParams(temperature=0), n_predict=N_AGENT_PREDICT,
                       ignore_eos=True, **kw)
    if chat:  # a chat prompt's user message starts after the tools (the system message)
        t.user_starts = (0, N_TOOLS)
    return t


def run_agents(model: Model, ref: Ref, radix: bool, chat: bool, cache: Any = None
               ) -> tuple[list[FinalResult], list[list[int]], int, Scheduler]:
    """As tests/engine/test_agent_sessions.py: N_SESSIONS sessions on 2 slots, each prompt the
    shared tools (60 tokens) then the session's history, which grows each step by the answer
    and a tool result; a round of steps at a time. Returns (finals, prompts, the unshared
    minimum, the scheduler); every answer is checked against its prompt's alone. `cache`: a
    host cache to use instead of the one the flags make."""
    rng = random.Random(36)
    tools = rand_tokens(rng, N_TOOLS)
    hist = [[3000 + 97 * i] + rand_tokens(rng, 7) for i in range(N_SESSIONS)]
    s = build_scheduler(model, ServerConfig(n_parallel=2, ctx_size=1024,
                                            cache_radix_prompt=radix), ServerMetrics(), cache)
    finals, sent = [], []
    for step in range(N_STEPS):
        prompts = [tools + h for h in hist]
        got = run_to_end(s, [agent_task(p, chat) for p in prompts], check_steps=True)
        for i, (p, f) in enumerate(zip(prompts, got)):
            want = drive(ref.sched, [agent_task(p, chat, cache_prompt=False)])[0]
            assert f.tokens == want, (step, i)
            assert f.timings.prompt_n + f.timings.cache_n == len(p)
            hist[i] = hist[i] + f.tokens + [4000 + 89 * i] + rand_tokens(rng, 5)
        finals += got
        sent += prompts
    minimum = unshared_minimum([(p, f.tokens) for p, f in zip(sent, finals)])
    return finals, sent, minimum, s


@pytest.mark.parametrize("chat", [False, True])
def test_agents_radix_computes_exactly_the_unshared_minimum(model: Model, ref: Ref,
                                                            chat: bool) -> None:
    """The radix tree keeps every token's conv input rows (written through before a window
    slides), so any prefix it holds is usable, not only at a checkpoint: the prompt tokens
    computed are exactly the unshared minimum, whether or not the prompts carry a checkpoint
    at the tools' end: 170 = the first prompt's 68, then 8 for each other first-round prompt
    (its session's task) and 7 for each later one (the answer's last token, never fed back,
    and the tool result's 6). LFM2's window rules add nothing."""
    finals, sent, minimum, s = run_agents(model, ref, radix=True, chat=chat)
    computed = sum(f.timings.prompt_n for f in finals)
    assert computed == minimum == 170, (computed, minimum)
    assert s.mem.cache.stats()["evictions"] == 0
    assert minimum < sum(map(len, sent)) // 5  # the workload does share most of it


def test_agents_legacy_computes_the_minimum_plus_the_lost_histories(
        model: Model, ref: Ref, plain: Model) -> None:
    """llama.cpp's whole-prompt cache (cache_radix_prompt=False), chat prompts (a user message,
    so a context checkpoint, at the tools' end). By llama.cpp's rule the host cache is
    consulted (the slot saved, a better entry loaded) only when the chosen slot keeps under
    half of its tokens; a request that takes a slot holding another session keeps the tools
    (60 of at most 90 tokens), so nothing is ever loaded from it (the idle-slot saves are
    never looked up): only the slots serve. Every request but the very first reuses the 60
    tools (its slot's checkpoint at 60, or, for the second session of the first round, the
    first's prefill) and computes the rest: the session's own history is lost each time. That
    is the unshared minimum plus the histories llama.cpp's rule drops, 390 = 170 + 220, and
    a plain llama computes exactly the same: LFM2's window rules add nothing here."""
    finals, sent, minimum, s = run_agents(model, ref, radix=False, chat=True)
    assert s.mem.cache.name == "legacy" and s.mem.cache.stats()["loads"] == 0
    computed = sum(f.timings.prompt_n for f in finals)
    assert [f.timings.cache_n for f in finals] == [0] + [N_TOOLS] * (len(sent) - 1)
    lost_history = len(sent[0]) + sum(len(p) - N_TOOLS for p in sent[1:]) - minimum
    assert (computed, minimum, lost_history) == (390, 170, 220)
    plain_finals, _, _, _ = run_agents(plain, Ref(plain), radix=False, chat=True)
    assert sum(f.timings.prompt_n for f in plain_finals) == computed


class ToolsState:
    """For every prompt the scheduler plans: whether the conv state at the tools' end (the
    input rows of positions N_TOOLS - 2 and N_TOOLS - 1, in a window) was held by the slot
    chosen for it or by another slot at that moment - read off the pool, not the planner."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.held: dict[tuple[int, ...], bool] = {}
        real = prefix_plan.plan_prefix
        need = {N_TOOLS - 2, N_TOOLS - 1}

        def plan(slot: Any, key: Any, donors: Any, host: Any, cache_prompt: bool,
                 *a: Any, **kw: Any) -> Any:
            if cache_prompt:
                self.held[tuple(key.tokens)] = any(
                    len(h.kv) >= N_TOOLS and need <= set(h.kv.pool.swa.seq_positions(h.kv.seq))
                    for h in [slot, *donors])
            return real(slot, key, donors, host, cache_prompt, *a, **kw)

        monkeypatch.setattr(prefix_plan, "plan_prefix", plan)


def test_agents_legacy_without_checkpoints_loses_the_tools_the_windows_dropped(
        model: Model, ref: Ref, monkeypatch) -> None:
    """The same sessions without user messages: no checkpoint at the tools' end (a prompt's
    checkpoint is at its n - 4 >= 64). LFM2's conv state exists only where it was computed,
    so a slot can give a new prompt the 60 shared tools only while its window (or another
    slot's) still holds the input rows of positions 58 and 59; a window drops older rows
    when it is pruned. So the figure is exactly the chat figure (390: the minimum and the
    lost histories) plus 60 for every request but the first whose slots no longer held
    those rows: the only excess LFM2's window rules add. Measured: 450 with windows pruned
    in runs of 64, 1 request losing the tools, pinned here; 1230 with windows pruned to their
    last 3 positions after every step, 14 requests: that regression must fail this test."""
    probe = ToolsState(monkeypatch)
    finals, sent, minimum, s = run_agents(model, ref, radix=False, chat=False)
    assert s.mem.cache.stats()["loads"] == 0 and minimum == 170
    held = [probe.held[tuple(p)] for p in sent]
    assert not held[0]
    assert [f.timings.cache_n for f in finals] == [N_TOOLS * h for h in held]
    lost_tools = held[1:].count(False)
    computed = sum(f.timings.prompt_n for f in finals)
    assert computed == 390 + N_TOOLS * lost_tools, (computed, lost_tools)
    assert (lost_tools, computed) == (1, 450)  # the pruning regression gives (14, 1230)


# -- 6. quantized KV ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model32(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """A tiny LFM2 whose attention heads are 32 wide (q8_0 blocks are 32 values: the
    conftest's model has 16-wide heads, which quantized KV refuses)."""
    path = write_tiny_gguf(str(tmp_path_factory.mktemp("lfm2-32") / "lfm2-32.gguf"),
                           arch="lfm2", n_layer=6, n_head=2, n_head_kv=1, seed=12,
                           attn_layers=(2, 5), l_cache=3)
    m = load_model(path, "bf16", deterministic="on")
    assert m.deterministic and m.hp.recurrent and m.hp.head_dim == 32
    return m


class TypedRef(Ref):
    """Each prompt alone, one slot, no cache, with the cache types under test."""

    def __init__(self, model: Model, kv: str) -> None:
        self.sched = build_scheduler(model, ServerConfig(
            ctx_size=512, n_parallel=1, cache_ram_mib=0, cache_type_k=kv, cache_type_v=kv),
            ServerMetrics())
        self.memo = {}


Q_TIERS = {  # settings, the source that serves, tokens reused by each of the last 3 prompts
    # the slot's own KV: checkpoints (ubatch 8: at n - 12 = 54 and n - 4 = 62)
    "in-slot": (dict(cache_ram_mib=0), Source.OWN, [62, 0, 0]),
    # whole-prompt entries and their checkpoints: doc 0's entry serves P(0, 1) from 54
    "legacy": (dict(cache_radix_prompt=False), Source.HOST, [62, 54, 0]),
    # the tree: any prefix (64 of the edit, doc 0's 60, doc 1's first 30)
    "radix": (dict(), Source.HOST, [64, 60, 30]),
}


@pytest.mark.parametrize("tier", list(Q_TIERS))
def test_q8_0_attention_rows_exact_conv_rows(model32: Model, monkeypatch, tier: str) -> None:
    """-ctk / -ctv q8_0: the attention layers' rows are q8_0 blocks, the conv layers' input
    rows stay in the compute dtype (the state stays exact); on every tier the answers and the
    slot's KV (q8_0 bytes and conv rows) equal a fresh computation's with the same types."""
    kv, (kw, source, n_reused) = "q8_0", Q_TIERS[tier]
    ref = TypedRef(model32, kv)
    rec = Recorder(monkeypatch)
    s = sched(model32, cache_type_k=kv, cache_type_v=kv, **kw)
    pool = s.pool
    assert isinstance(pool, ConvPool)
    assert [t.name for t in pool.types] == [kv, kv] and pool.k.dtype == torch.uint8
    assert pool.swa.k.dtype == pool.swa.v.dtype == torch.bfloat16
    assert [t.name for t in pool.swa.types] == ["bf16", "bf16"]
    assert [t.name for t in ref.sched.pool.types] == [kv, kv]
    check_run(s, ref, [P(0, 0), P(1, 0)])  # the second takes the slot: doc 0 -> host (legacy)
    rec.plans.clear()
    got = []
    for p in (edit(P(1, 0)), P(0, 1), DOCS[1][:30] + QS[2]):
        check_run(s, ref, [p])
        got.append(rec.plans[-1].n_reused)  # the scheduler's plan (the reference runs first)
    assert got == n_reused
    used = {sp.source for pl in rec.plans for sp in pl.spans if sp.source is not Source.COMPUTE}
    assert source in used, used
    s.check()


def test_context_shift_is_refused_for_the_conv_state(tiny_lfm2_path: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """--context-shift asked for: the slots are built without it (a full context stops the
    task, as llama-server stops it), with llama-server's warning in the log."""
    m = load_model(tiny_lfm2_path, "bf16")
    with caplog.at_level("WARNING"):
        s = build_scheduler(m, ServerConfig(ctx_size=512, n_parallel=2, context_shift=True),
                            ServerMetrics())
    assert not any(sl.context_shift for sl in s.slots)
    assert "context shift is not supported by this model" in caplog.text
