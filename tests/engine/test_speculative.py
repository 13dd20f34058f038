"""Speculative decoding through the real scheduler, on the default model (deterministic bf16):
every spec type, on every cache tier, with slots running side by side, gives the tokens of the
same prompts computed alone without speculation and without any cache. The default model
drafting for itself must have every draft accepted (the mechanics exactly: a draft row out of
step with its token would be rejected); a tiny random draft model with the same vocabulary is
mostly rejected (the rejection paths). Where the draft KV came from a tier, it is compared
bit for bit with the draft's own computation of the same tokens.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from radixserve.config import ServerConfig, SpecConfig
from radixserve.engine.counters import ServerMetrics
from radixserve.memory.prefix_plan import Source
from radixserve.engine.build import build_scheduler
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.task import CompletionTask, FinalResult
from radixserve.model.loader import Model, load_model
from radixserve.sampling.chain import SamplingParams
from radixserve.bench.scenarios import make_text
from tests.engine.test_deterministic import Recorder, drive
from tests.tiny_gguf import write_tiny_gguf

N_PREDICT = 40


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """A random 2-layer llama with the default model's vocabulary: a poor draft."""
    path = write_tiny_gguf(str(tmp_path_factory.mktemp("draft") / "draft.gguf"), seed=3)
    m = load_model(path, "bf16", deterministic="on")
    assert m.deterministic
    return m


@pytest.fixture(scope="module")
def prompts(model: Model) -> list[list[int]]:
    """Two documents, two requests each: copy the document (n-grams find their drafts), or
    continue it; the second request of a document reuses its prefix from some tier."""
    rng = random.Random(17)
    out = []
    for _ in range(2):
        doc = make_text(rng, 60)
        for ask in ("Copy the text above exactly.", "Repeat the text above."):
            text = model.chat_template.render([
                {"role": "user", "content": f"{doc}\n\n{ask}"}])
            out.append(model.tokenizer.encode(text, add_special=True))
    return out


def task(p: list[int], **kw: Any) -> CompletionTask:
    params = kw.pop("params", SamplingParams(temperature=0))
    return CompletionTask(list(p), params, n_predict=N_PREDICT, ignore_eos=True, **kw)


def plain(model: Model, **kw: Any) -> Scheduler:
    cfg: dict[str, Any] = dict(ctx_size=1024, n_parallel=1, cache_ram_mib=0)
    return build_scheduler(model, ServerConfig(**(cfg | kw)), ServerMetrics())


@pytest.fixture(scope="module")
def reference(model: Model, prompts: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    """Each prompt alone: one slot, no cache, no speculation."""
    s = plain(model)
    return {tuple(p): drive(s, [task(p, cache_prompt=False)])[0] for p in prompts}


SPECS = {
    "ngram-simple": (dict(types=["ngram-simple"], ngram_simple_size_n=4,
                          ngram_simple_size_m=16), None),
    "ngram-mod": (dict(types=["ngram-mod"], ngram_mod_n_match=6, ngram_mod_n_min=2,
                       ngram_mod_n_max=16), None),
    "draft-self": (dict(types=["draft-simple"], draft_model="default", n_max=4), "self"),
    # n_min and p_min drop drafts (their drafted cells go again before the verification)
    "draft-tiny": (dict(types=["draft-simple"], draft_model="tiny", n_max=3, n_min=2,
                        p_min=0.5), "tiny"),
}
TIERS = {
    # the slot's own KV only, two slots running side by side
    "in-slot": (dict(cache_ram_mib=0, n_parallel=2), {Source.OWN}),
    # llama.cpp's legacy host cache (entries carry the draft state): one slot, so each
    # document's second request finds it in the host cache
    "legacy": (dict(cache_ram_mib=256, cache_radix_prompt=False, n_parallel=1), {Source.HOST}),
    # the radix tree (nodes carry draft rows) and device-tier sharing, unified KV, 4 slots
    "radix-shared": (dict(cache_ram_mib=256, n_parallel=4, kv_unified=True),
                     {Source.HOST, Source.SLOT}),
}


def spec_sched(model: Model, draft: Model | None, spec: dict[str, Any], **kw: Any
               ) -> Scheduler:
    cfg = ServerConfig(**(dict(ctx_size=2048) | kw), spec=SpecConfig(**spec))
    return build_scheduler(model, cfg, ServerMetrics(), draft=draft)


def draft_of(name: str | None, model: Model, tiny_draft: Model) -> Model | None:
    return {None: None, "self": model, "tiny": tiny_draft}[name]


def draft_rows(s: Scheduler, seq: int, n: int) -> list[torch.Tensor]:
    """Every group of the draft's rows of a sequence's first n positions (K and V; a
    recurrent draft's conv rows after them)."""
    assert s.pool.draft is not None
    return s.pool.draft.gather(torch.tensor(s.pool.cells_at(seq, list(range(n)))))


def slot_file_round_trip(s: Scheduler) -> int:
    """Slot 0 saved to a file (a.bin in the slot save path), erased and restored: its draft
    rows come back bit for bit, all of them marked computed. Returns the slot's length."""
    n = len(s.slots[0].kv)
    s.mem.slot_action(0, "save", "a.bin")
    want = draft_rows(s, 0, n)
    s.mem.slot_action(0, "erase", None)
    assert not any(len(slot.kv) for slot in s.slots)
    for d in s.pool.draft.parts():  # no row left over in the cells: all from the file
        d.k.zero_()
        d.v.zero_()
    assert s.mem.slot_action(0, "restore", "a.bin")["n_restored"] == n
    assert s.slots[0].kv.n_draft == n
    assert all(torch.equal(a, b) for a, b in zip(draft_rows(s, 0, n), want))
    return n


def fresh_draft_rows(model: Model, draft: Model, tokens: list[int]) -> list[torch.Tensor]:
    """The draft model's rows of `tokens` computed alone (a prompt, nothing generated)."""
    s = spec_sched(model, draft, SPECS["draft-self"][0], cache_ram_mib=0, n_parallel=1)
    drive(s, [CompletionTask(list(tokens), SamplingParams(temperature=0), n_predict=0,
                             cache_prompt=False)])
    assert s.slots[0].kv.n_draft == len(tokens)
    return draft_rows(s, 0, len(tokens))


def check_draft_kv(s: Scheduler, model: Model, draft: Model) -> None:
    """Every slot holding tokens has the draft rows of all of them, equal to the draft's own
    computation of those tokens, bit for bit."""
    for slot in s.slots:
        n = len(slot.kv)
        if not n:
            continue
        assert slot.kv.n_draft == n
        got = draft_rows(s, slot.id, n)
        want = fresh_draft_rows(model, draft, list(slot.kv.tokens))
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"slot {slot.id}"


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("kind", list(SPECS))
def test_greedy_equals_no_speculation_on_every_tier(model, tiny_draft, prompts, reference,
                                                    monkeypatch, kind, tier):
    spec, dname = SPECS[kind]
    kw, sources = TIERS[tier]
    draft = draft_of(dname, model, tiny_draft)
    rec = Recorder(monkeypatch)
    s = spec_sched(model, draft, spec, **kw)
    outs = []
    for pair in ((0, 2), (1, 3)):  # two documents side by side, then their second requests
        outs += drive(s, [task(prompts[i]) for i in pair])
        s.check()
    sent = [prompts[i] for i in (0, 2, 1, 3)]
    assert outs == [reference[tuple(p)] for p in sent]
    used = {p.source for p in rec.plans if p.n_prefix}
    assert sources <= used, f"{tier}: prefixes came from {used}"
    m = s.metrics
    assert m.n_drafts_total > 0 and m.n_draft_tokens_total > 0, "nothing was drafted"
    assert 0 < m.n_draft_accepted_total <= m.n_draft_tokens_total or kind == "draft-tiny"
    if kind == "draft-self":  # the model drafting for itself: every draft token is right
        assert m.n_draft_accepted_total == m.n_draft_tokens_total
    if kind == "draft-tiny":  # a random draft: the rejection path ran
        assert m.n_draft_accepted_total < m.n_draft_tokens_total
    if draft is not None:
        check_draft_kv(s, model, draft)


def test_seeded_sampling_equals_no_speculation(model, prompts):
    """llama.cpp's rule samples every row with the task's own chain and random draws, so a
    seeded sampled answer is the same token for token."""
    params = SamplingParams(temperature=0.9, top_k=40, seed=1234)
    p = prompts[0]
    want = drive(plain(model), [task(p, params=params)])[0]
    for kind in ("ngram-simple", "draft-self"):
        spec, dname = SPECS[kind]
        s = spec_sched(model, draft_of(dname, model, model), spec, cache_ram_mib=0,
                       n_parallel=1)
        assert drive(s, [task(p, params=params)])[0] == want, kind
        assert s.metrics.n_draft_tokens_total > 0


def test_context_shift_moves_the_draft_rows(model, prompts):
    """--context-shift with a draft model drafting for itself: the shifted draft rows are
    re-rotated with the target's, so every draft is still accepted, and the answer is the
    one without speculation."""
    p = prompts[0]
    kw = dict(ctx_size=len(p) + 24, n_parallel=1, cache_ram_mib=0, context_shift=True)
    long = dict(n_predict=64)
    def run(s: Scheduler) -> list[int]:
        out: list[Any] = []
        s.submit(CompletionTask(list(p), SamplingParams(temperature=0), ignore_eos=True,
                                **long), out.append)
        while s.has_active():
            s.step()
        s.check()
        assert isinstance(out[-1], FinalResult) and out[-1].truncated  # it did shift
        return out[-1].tokens

    want = run(plain(model, **kw))
    s = spec_sched(model, model, SPECS["draft-self"][0], **kw)
    assert run(s) == want and len(want) == 64
    m = s.metrics
    assert m.n_draft_tokens_total > 0 and m.n_draft_accepted_total == m.n_draft_tokens_total


def test_slot_file_sdft_round_trip_and_bad_appendix(model, tiny_draft, prompts, reference,
                                                    tmp_path):
    """A slot file carries the draft rows (SDFT); a restore loads them (equal to the draft's
    own computation). An SDFT cut short, or from a draft of another shape, is dropped: the
    target state is kept, the draft rows are computed again, and answers stay right."""
    spec = SPECS["draft-self"][0]
    kw = dict(cache_ram_mib=0, n_parallel=1, slot_save_path=str(tmp_path))
    s = spec_sched(model, model, spec, **kw)
    p = prompts[1]
    assert drive(s, [task(p)])[0] == reference[tuple(p)]
    n = slot_file_round_trip(s)
    # a truncated SDFT: the main part and its tokens stay, the draft rows are dropped
    raw = (tmp_path / "a.bin").read_bytes()
    at = raw.rindex(b"SDFT")
    (tmp_path / "cut.bin").write_bytes(raw[: at + (len(raw) - at) // 2])
    for other, fname in ((s, "cut.bin"),
                         (spec_sched(model, tiny_draft, SPECS["draft-tiny"][0], **kw), "a.bin")):
        assert other.mem.slot_action(0, "restore", fname)["n_restored"] == n
        assert other.slots[0].kv.n_draft == 0 and len(other.slots[0].kv) == n
        q = prompts[1]  # the same prompt again: reused from the restored slot
        assert drive(other, [task(q)])[0] == reference[tuple(q)]
        assert other.slots[0].n_cached > 0
        check_draft_kv(other, model, other.spec.draft)


def test_no_draft_past_the_context_or_n_predict(model, prompts):
    """Drafts never run past n_predict or the slot's context (llama-server's
    get_n_draft_max): the answer has exactly n_predict tokens."""
    p = prompts[0]
    s = spec_sched(model, model, SPECS["draft-self"][0], cache_ram_mib=0, n_parallel=1)
    for n in (1, 2, 5):
        t = CompletionTask(list(p), SamplingParams(temperature=0), n_predict=n, ignore_eos=True)
        assert len(drive(s, [t])[0]) == n
    s.check()
