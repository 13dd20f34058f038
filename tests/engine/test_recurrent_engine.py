"""Qwen3.5 and Granite 4.0-H (their Gated DeltaNet or Mamba2 state kept whole, one state cell
a sequence: memory/pool/recurrent.py) through the real scheduler: a slot resuming its own state, context checkpoints
(the state's snapshots) restoring an earlier prefix, the whole-prompt host cache carrying
them, slot files, agent sessions on fewer slots than sessions, n-gram speculative decoding
(a rejected draft rolled back to the state the step read, the kept tokens computed again), the
disk tier (a restarted scheduler resuming them from snapshot files), and the refusals (a draft
model, context shift).

Every answer is compared, token for token, with the same prompt computed alone with no cache
of any kind (deterministic bf16: cached == uncached to the bit), and the reuse figures are
pinned so a run that silently recomputed everything cannot pass.
"""

from __future__ import annotations

import gc
import os
import random
import weakref
from pathlib import Path
from typing import Any

import pytest

from radixserve.config import ServerConfig, SpecConfig
from radixserve.engine.build import build_scheduler
from radixserve.engine.counters import ServerMetrics
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.task import FinalResult
from radixserve.memory.pool.state import fingerprint_of
from radixserve.memory.seq_kv import SlotKV
from radixserve.memory.tiers.disk_block import SNAP_SUFFIX, SUFFIX
from radixserve.memory.tiers.radix import RadixPromptCache
from radixserve.model.loader import Model, load_model
from radixserve.sampling.chain import SamplingParams
from tests.engine.test_deterministic import drive, run_to_end
from tests.engine.test_lfm2_engine import (N_SESSIONS, N_STEPS, N_TOOLS, agent_task,
                                           check_n_cmpl, rand_tokens, run_agents)
from tests.engine.test_speculative import N_PREDICT, plain, spec_sched, task
from tests.engine.test_swa import Ref
from tests.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module", params=["qwen35", "granitehybrid"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Model:
    """A tiny Qwen3.5: 4 layers (three Gated DeltaNet, the last attention), 2 key heads and 4
    value heads of 16; or a tiny Granite 4.0-H: 4 layers (three Mamba2, the second attention),
    8 heads of 16 in 2 groups with a state of 16. Both keep their state whole, a cell a
    sequence, the same way."""
    if request.param == "qwen35":
        d = tmp_path_factory.mktemp("q35e")
        path = write_tiny_gguf(str(d / "q35.gguf"), arch="qwen35", ssm_heads=(2, 4), seed=21)
    else:
        path = request.getfixturevalue("tiny_granite_path")
    m = load_model(path, "bf16", deterministic="on")
    assert m.deterministic and m.hp.recurrent and m.layout.n_recurrent == 3
    return m


@pytest.fixture(scope="module")
def ref(model: Model) -> Ref:
    return Ref(model)


def test_a_draft_model_is_refused(model: Model) -> None:
    spec = SpecConfig(types=["ngram-simple", "draft-simple"], draft_model="default")
    with pytest.raises(ValueError, match="draft-simple is not supported for models with Gated "
                                         "DeltaNet or Mamba2 layers"):
        build_scheduler(model, ServerConfig(spec=spec), ServerMetrics())


def test_context_shift_is_off(model: Model) -> None:
    s = build_scheduler(model, ServerConfig(context_shift=True), ServerMetrics())
    assert not any(slot.context_shift for slot in s.slots)
    s.mem.close()


@pytest.mark.parametrize("chat", [True, False])
def test_agents_radix_computes_exactly_the_unshared_minimum(model: Model, ref: Ref,
                                                            chat: bool) -> None:
    """Agent sessions (5 on 2 slots: the shared tools, then each session's history growing by
    its answer and a tool result) with the radix tree keeping the state as snapshots on its
    nodes: the prompt tokens computed are exactly the unshared minimum (170, LFM2's figure on
    this workload, whose state has rows a token), with or without a user message at the
    tools' end. Without one, the first prompt of the round is cut where the waiting second
    diverges from it (a fork) and snapshotted there; each session's state after its answer is
    its node's snapshot. Every answer equals its prompt's alone (run_agents)."""
    finals, sent, minimum, s = run_agents(model, ref, radix=True, chat=chat)
    computed = sum(f.timings.prompt_n for f in finals)
    assert (computed, minimum) == (170, 170)
    st = s.mem.cache.stats()
    assert st["snapshots"] > 0 and 0 < st["snapshot_bytes"] < st["bytes"]
    assert st["loads"] > 0 and st["evictions"] == st["snapshots_dropped"] == 0
    s.mem.check()


@pytest.mark.parametrize("chat", [True, False])
def test_agents_legacy_compute_the_minimum_plus_the_lost_histories(model: Model, ref: Ref,
                                                                   chat: bool) -> None:
    """The whole-prompt cache (llama.cpp's rule: consulted only when a slot keeps under half
    its tokens) with the forks' checkpoints: every request but the first reuses the 60 tools
    and the sessions' histories are lost, 390 = 170 + 220, LFM2's chat figure; without a user
    message too (the fork at the tools' end stands in for it)."""
    finals, sent, minimum, s = run_agents(model, ref, radix=False, chat=chat)
    assert s.mem.cache.name == "legacy"
    computed = sum(f.timings.prompt_n for f in finals)
    assert [f.timings.cache_n for f in finals] == [0] + [N_TOOLS] * (len(sent) - 1)
    assert (computed, minimum) == (390, 170)


def _held_bytes(s: Scheduler, cache: RadixPromptCache) -> int:
    """What --cache-ram counts: the tree, and the slots' checkpoints it does not hold, once."""
    held = cache.holds()
    own = {id(c.target): c.size for x in s.slots for c in x.kv.checkpoints
           if id(c.target) not in held}
    return int(cache.stats()["bytes"]) + sum(own.values())


def test_a_small_budget_drops_snapshots_and_answers_stay(model: Model, ref: Ref) -> None:
    """The budget at a quarter of what the sessions hold unbounded, the tree and the slots'
    own checkpoints counted together (Qwen3.5: 250,000 of 1,023,054 bytes measured; Granite,
    whose snapshots are larger: 400,000 of 1,800,592): superseded snapshots (a session's
    earlier steps) go first, from the tree and the slots alike, then leaves; a prefix whose
    snapshot went is served up to the nearest kept one, so more is computed than the minimum
    (214 and 287 measured), less than the whole-prompt cache (390), and every answer is
    unchanged."""
    budget = {"qwen35": 250_000, "granitehybrid": 400_000}[model.hp.arch]
    fp = fingerprint_of(build_scheduler(model, ServerConfig(cache_ram_mib=0),
                                        ServerMetrics()).pool, model.hp.arch)
    cache = RadixPromptCache(budget, fingerprint=fp)
    finals, sent, minimum, s = run_agents(model, ref, radix=True, chat=True, cache=cache)
    computed = sum(f.timings.prompt_n for f in finals)
    st = cache.stats()
    assert st["snapshots_dropped"] > 0 and st["evictions"] > 0
    assert _held_bytes(s, cache) <= budget
    assert minimum == 170 < computed < 390, computed
    # the reuse report says where a snapshot, not the text held, stopped the reuse
    reports = [f.timings.reuse for f in finals]
    short = [r for r in reports if r is not None and r.n_tokens < r.n_held - 1]
    assert short and all(r.limit == "snapshot" for r in short), short
    s.mem.check()


def test_the_slots_checkpoints_alone_over_the_budget_go_oldest_first(model: Model,
                                                                     ref: Ref) -> None:
    """A budget below what one round's prompts checkpoint in the slots (about 2.3 states):
    the slots drop their oldest checkpoints so what they keep alone stays within half of it
    (the other half the tree's), and every answer is unchanged (recomputed, never wrong)."""
    budget = int(2.3 * model.layout.state_bytes)
    fp = fingerprint_of(build_scheduler(model, ServerConfig(cache_ram_mib=0),
                                        ServerMetrics()).pool, model.hp.arch)
    cache = RadixPromptCache(budget, fingerprint=fp)
    finals, sent, minimum, s = run_agents(model, ref, radix=True, chat=True, cache=cache)
    n, n_bytes = s.mem.checkpoints()
    assert s.metrics.checkpoints_dropped_total > 0 and 0 < n_bytes <= budget // 2 and n == 1
    assert _held_bytes(s, cache) <= budget
    assert sum(f.timings.prompt_n for f in finals) > 390
    s.mem.check()


def test_a_snapshot_the_tree_drops_goes_from_the_slots_too(model: Model, ref: Ref) -> None:
    """The slots' checkpoints saved into the tree are the tree's snapshots (the same bytes):
    when the tree's own limit makes it drop some, the slots holding them drop them as well
    (kept by a slot, a dropped snapshot would free nothing), and nothing else goes."""
    fp = fingerprint_of(build_scheduler(model, ServerConfig(cache_ram_mib=0),
                                        ServerMetrics()).pool, model.hp.arch)
    cache = RadixPromptCache(10**9, fingerprint=fp)
    finals, sent, minimum, s = run_agents(model, ref, radix=True, chat=True, cache=cache)
    for slot in s.slots:
        s.mem.host.offer(slot)
    slot_bufs = {id(c.target) for x in s.slots for c in x.kv.checkpoints}
    assert slot_bufs and slot_bufs <= cache.holds().keys()
    cache.limit_bytes = int(cache.stats()["bytes"]) // 4  # the host's budget stays as it was
    s.mem.host.update()
    now = cache.holds().keys()
    assert slot_bufs - now, "the tree dropped none of the slots' snapshots"
    assert {id(c.target) for x in s.slots for c in x.kv.checkpoints} == slot_bufs & now
    s.mem.check()


def test_sleeping_frees_the_slots_and_their_pool(model: Model) -> None:
    """The host cache outlives the scheduler (sleep): it keeps no reference to the slots whose
    checkpoints it counted, so the pool goes with them."""
    s = build_scheduler(model, ServerConfig(cache_ram_mib=64), ServerMetrics())
    assert s.mem.cache.beside is not None
    cache, _ = s.mem.keep_host()
    assert cache.beside is None
    pool = weakref.ref(s.pool)
    del s
    gc.collect()
    assert pool() is None


def test_a_slot_resumes_its_state_and_an_edit_restores_a_checkpoint(model: Model,
                                                                     ref: Ref) -> None:
    """One slot: a prompt, then the same prompt with its answer and a new turn (the slot's
    own state after its last token serves it), then the first prompt with its last tokens
    edited (the slot's state is past the edit: a checkpoint before it serves); each answer
    equals its prompt's alone."""
    s = build_scheduler(model, ServerConfig(ctx_size=512, n_parallel=1, cache_ram_mib=0),
                        ServerMetrics())
    base = [300 + 7 * i for i in range(40)]

    def alone(p: list[int]) -> list[int]:
        return drive(ref.sched, [agent_task(p, chat=False, cache_prompt=False)])[0]

    first = run_to_end(s, [agent_task(base, chat=False)])[0]
    assert first.tokens == alone(base)
    follow = base + first.tokens + [900, 901, 902]
    got = run_to_end(s, [agent_task(follow, chat=False)])[0]
    assert got.tokens == alone(follow)
    # the slot held base + all but the last answer token: everything up to it is reused
    assert got.timings.cache_n == len(base) + len(first.tokens) - 1
    edited = base[:-2] + [5001, 5002]
    got = run_to_end(s, [agent_task(edited, chat=False)])[0]
    assert got.tokens == alone(edited)
    assert 0 < got.timings.cache_n <= len(base) - 2
    s.mem.close()


@pytest.mark.parametrize("host", ["none", "radix"])
@pytest.mark.parametrize("unified", [True, False])
def test_n_cmpl_children_take_the_parents_prompt(model: Model, ref: Ref, monkeypatch,
                                                 unified: bool, host: str) -> None:
    """As for LFM2 (test_lfm2_engine.py): the children wait for the parent's prompt and
    compute only its last token, each answer its prompt's alone. The parent's state is after
    the whole prompt by then, so a child takes the parent's rows and the state of its
    checkpoint before the last token (a fork), shared (unified) or copied."""
    check_n_cmpl(model, ref, monkeypatch, unified, host)


def test_pins_count_rows_and_snapshots_come_and_go_on_pinned_paths(model: Model) -> None:
    """A pinned prompt's path gains snapshots later (another prompt forks inside it, slots
    are saved before reuse): pins count the rows they keep, so their bytes stay what they
    were and the cache's checks hold."""
    s = build_scheduler(model, ServerConfig(n_parallel=2, ctx_size=1024, cache_ram_mib=64,
                                            cache_pin_mib=64), ServerMetrics())
    rng = random.Random(5)
    system = rand_tokens(rng, 60)
    a, b = system + rand_tokens(rng, 33), system + rand_tokens(rng, 33)
    run_to_end(s, [agent_task(a, chat=False, pin_s=100.0)], check_steps=True)
    cache = s.mem.cache
    assert isinstance(cache, RadixPromptCache) and len(cache.pins) == 1
    pinned = cache.pinned_bytes
    run_to_end(s, [agent_task(b, chat=False), agent_task(a + [7, 8, 9] * 10, chat=False)],
               check_steps=True)
    run_to_end(s, [agent_task(rand_tokens(rng, 40), chat=False) for _ in range(2)],
               check_steps=True)
    assert cache.pinned_bytes == pinned and cache.stats()["snapshots"] > 0
    s.mem.check()


def test_a_regenerated_answer_and_an_edited_early_message(model: Model, ref: Ref) -> None:
    """A chat (system, a user turn, the answer, a second user turn): regenerating the last
    answer resumes from the fork before the prompt's last token (all but one token reused,
    through the radix tree after another prompt took the slot); editing the first user
    message resumes from the checkpoint at its start (the system prompt reused). Each answer
    equals its prompt's alone."""
    s = build_scheduler(model, ServerConfig(n_parallel=1, ctx_size=1024), ServerMetrics())
    rng = random.Random(8)
    system, first, second = rand_tokens(rng, 40), rand_tokens(rng, 12), rand_tokens(rng, 9)

    def chat(prompt: list[int], starts: tuple[int, ...]) -> Any:
        task = agent_task(prompt, chat=False)
        task.user_starts = starts
        got = run_to_end(s, [task], check_steps=True)[0]
        assert got.tokens == drive(ref.sched, [agent_task(prompt, chat=False,
                                                          cache_prompt=False)])[0]
        return got

    turn1 = system + first
    answer = chat(turn1, (0, 40)).tokens
    prompt = turn1 + answer + second
    starts = (0, 40, len(turn1) + len(answer))
    chat(prompt, starts)
    chat(rand_tokens(rng, 30), (0,))  # another prompt takes the slot: the tree keeps ours
    again = chat(prompt, starts)
    assert again.timings.cache_n == len(prompt) - 1
    edited = system + rand_tokens(rng, 12) + answer + second
    got = chat(edited, starts)
    assert got.timings.cache_n == len(system)
    s.mem.check()


# -- speculative decoding: a rejected draft rolled back by recomputing --------------------------
SPEC_KINDS = {
    "ngram-simple": dict(types=["ngram-simple"], ngram_simple_size_n=3, ngram_simple_size_m=8),
    "ngram-mod": dict(types=["ngram-mod"], ngram_mod_n_match=4, ngram_mod_n_min=2,
                      ngram_mod_n_max=8),
}
# the tiny Granite's logits are flat: only a low temperature leaves runs for n-grams to draft
TEMPERATURE = {"qwen35": 0.7, "granitehybrid": 0.03}


@pytest.fixture(scope="module")
def echo_prompts(model: Model) -> list[list[int]]:
    """Four prompts that quote their own continuation: a random prompt with, planted early on,
    its last two tokens, the first three tokens the model answers it with, and six random
    ones. The tiny models answer in runs of one token, so ngram-simple finds its drafts at the
    plant (accepted while the answer follows it, rejected where the random tokens start) and
    ngram-mod its table's runs (accepted) and planted turns (rejected). The plant may change
    the answer: the tests check the totals over the four."""
    rng = random.Random(5)
    s = plain(model)
    out = []
    for _ in range(4):
        r = [rng.randrange(100, 5000) for _ in range(30)]
        g = drive(s, [task(r, cache_prompt=False)])[0]
        plant = r[-2:] + g[:3] + [rng.randrange(100, 5000) for _ in range(6)]
        out.append(r[:10] + plant + r[10:])
    s.mem.close()
    return out


@pytest.fixture(scope="module")
def echo_reference(model: Model, echo_prompts: list[list[int]]) -> dict[tuple[int, ...],
                                                                        FinalResult]:
    """Each echo prompt alone, greedy: one slot, no cache, no speculation."""
    s = plain(model)
    return {tuple(p): run_to_end(s, [task(p, cache_prompt=False)])[0] for p in echo_prompts}


def spy_rollbacks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of tokens each rollback leaves to compute again (the model runs as is)."""
    out: list[int] = []
    rollback = SlotKV.rollback

    def spy(kv: SlotKV, n: int) -> None:
        out.append(len(kv) - n)
        rollback(kv, n)

    monkeypatch.setattr(SlotKV, "rollback", spy)
    return out


def check_drafts(s: Scheduler, finals: list[FinalResult], rolled: list[int]) -> None:
    """Drafts were accepted and rejected (each rejection rolled back by recomputing), and the
    totals agree with /metrics'."""
    drafted = sum(f.timings.draft_n or 0 for f in finals)
    accepted = sum(f.timings.draft_n_accepted for f in finals)
    assert drafted > accepted > 0, (drafted, accepted)
    assert rolled and min(rolled) >= 1, rolled  # the old pending token at least
    m = s.metrics
    assert (m.n_draft_tokens_total, m.n_draft_accepted_total) == (drafted, accepted)


@pytest.mark.parametrize("kind", list(SPEC_KINDS))
def test_speculation_rolls_back_by_recomputing_and_answers_stay(
        model: Model, echo_prompts: list[list[int]], echo_reference: dict,
        monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """n-gram drafts on a recurrent target, two slots side by side, every memory invariant
    checked after every step: each greedy answer is its prompt's without speculation, token
    for token and in its text, while drafts were both accepted and rejected. A rejection drops
    the step back to the state it read and the next step feeds its kept tokens again: they
    count nowhere (predicted_n is the answer's length, prompt_n the prompt's). The slots'
    KV then serves the same prompts again, with the same answers (a task ending with tokens
    still to feed again: test_a_rollback_left_at_cancel_is_forgotten)."""
    rolled = spy_rollbacks(monkeypatch)
    s = spec_sched(model, None, SPEC_KINDS[kind], n_parallel=2, cache_ram_mib=0)
    finals = run_to_end(s, [task(p) for p in echo_prompts], check_steps=True)
    for f, p in zip(finals, echo_prompts):
        want = echo_reference[tuple(p)]
        assert (f.tokens, f.content) == (want.tokens, want.content)
        t = f.timings
        assert (t.predicted_n, t.prompt_n, t.cache_n) == (N_PREDICT, len(p), 0)
    check_drafts(s, finals, rolled)
    last = echo_prompts[::-1]  # the slots hold the last two: those first
    again = run_to_end(s, [task(p) for p in last], check_steps=True)
    assert [f.tokens for f in again] == [echo_reference[tuple(p)].tokens for p in last]
    assert all(f.timings.cache_n > 0 for f in again[:2]), [f.timings for f in again]
    assert not any(slot.kv.redo for slot in s.slots)
    s.mem.close()


def test_seeded_sampling_with_rollbacks_equals_no_speculation(
        model: Model, echo_prompts: list[list[int]], echo_reference: dict,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A seeded sampled answer (temperature > 0: the draws decide, it is not the greedy one)
    is the same with ngram-simple, rejected drafts rolled back: every row is sampled with the
    task's chain in the order it would be without speculation, and a recomputed state is the
    state."""
    params = SamplingParams(temperature=TEMPERATURE[model.hp.arch], top_k=40, seed=1234)
    ref = plain(model)
    want = [drive(ref, [task(p, params=params, cache_prompt=False)])[0] for p in echo_prompts]
    assert any(w != echo_reference[tuple(p)].tokens for w, p in zip(want, echo_prompts))
    rolled = spy_rollbacks(monkeypatch)
    s = spec_sched(model, None, SPEC_KINDS["ngram-simple"], n_parallel=1, cache_ram_mib=0)
    finals = [run_to_end(s, [task(p, params=params)], check_steps=True)[0]
              for p in echo_prompts]
    assert [f.tokens for f in finals] == want
    check_drafts(s, finals, rolled)
    s.mem.close()


def test_rollbacks_do_not_pile_up(model: Model, echo_prompts: list[list[int]],
                                  echo_reference: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts forced to be partly rejected every time ([pending, pending, a token the tiny
    models never answer]): after a rollback the slot feeds its kept tokens again with no draft,
    so the state catches up and the next draft starts past them; what a step feeds again
    stays below the draft's length, and the whole forward below four tokens a generated one
    (drafting on top of the tokens to feed again fed 15 a generated token). The answer is the
    one without speculation."""
    import radixserve.engine.speculative as speculative

    monkeypatch.setattr(speculative, "ngram_simple_draft",
                        lambda past, pending, n, m: [pending, pending, 4321])
    fed: list[tuple[int, int]] = []
    schedule = Scheduler._schedule

    def spy(self: Scheduler) -> list[Any]:
        batch = schedule(self)
        fed.extend((len(b.tokens), len(sl.kv.redo)) for sl, b in batch)
        return batch

    monkeypatch.setattr(Scheduler, "_schedule", spy)
    rolled = spy_rollbacks(monkeypatch)
    s = spec_sched(model, None, SPEC_KINDS["ngram-simple"], n_parallel=1, cache_ram_mib=0)
    p = echo_prompts[0]
    fed.clear()
    f = run_to_end(s, [task(p, cache_prompt=False)], check_steps=True)[0]
    assert f.tokens == echo_reference[tuple(p)].tokens
    assert rolled and max(redo for _, redo in fed) <= 3, fed
    decode = sum(n for n, _ in fed) - len(p)  # the prompt's chunks, then the decode steps
    assert decode < 4 * N_PREDICT, (decode, fed)
    s.mem.close()


def test_a_rollback_left_at_cancel_is_forgotten(model: Model, echo_prompts: list[list[int]],
                                                echo_reference: dict) -> None:
    """A task cancelled while its slot has tokens to compute again: the slot keeps the KV
    before them (its state the one it read), nothing to re-feed, and the next task on it -
    the same prompt, its prefix reused - answers as without speculation."""
    s = spec_sched(model, None, SPEC_KINDS["ngram-simple"], n_parallel=1, cache_ram_mib=0)
    slot = s.slots[0]
    for p in echo_prompts:
        out: list[Any] = []
        t = task(p)
        s.submit(t, out.append)
        while s.has_active() and not slot.kv.redo:
            s.step()
            s.check()
        if slot.kv.redo:
            break
    else:
        pytest.fail("no rollback left tokens to compute again")
    n = len(slot.kv)
    s.cancel(t)
    assert not slot.is_processing and not slot.kv.redo and len(slot.kv) == n
    s.check()
    got = run_to_end(s, [task(p)], check_steps=True)[0]
    assert got.tokens == echo_reference[tuple(p)].tokens and got.timings.cache_n > 0


def disk_sessions(model: Model, ref: Ref, directory: Path, chat: bool, **kw: Any
                  ) -> tuple[list[Any], list[list[int]], list[list[int]]]:
    """Agent sessions as run_agents's (the same tools, histories and steps) on a scheduler
    with `--cache-disk directory` (blocks of 16 tokens); the scheduler closed at the end (its
    writes done). Returns (finals, the prompts sent, each session's next prompt)."""
    rng = random.Random(36)
    tools = rand_tokens(rng, N_TOOLS)
    hist = [[3000 + 97 * i] + rand_tokens(rng, 7) for i in range(N_SESSIONS)]
    s = build_scheduler(model, ServerConfig(n_parallel=2, ctx_size=1024,
                                            cache_disk=str(directory), cache_disk_block=16,
                                            **kw), ServerMetrics())
    finals, sent = [], []
    for step in range(N_STEPS):
        prompts = [tools + h for h in hist]
        got = run_to_end(s, [agent_task(p, chat) for p in prompts], check_steps=True)
        for i, (p, f) in enumerate(zip(prompts, got)):
            assert f.tokens == drive(ref.sched, [agent_task(p, chat, cache_prompt=False)])[0]
            hist[i] = hist[i] + f.tokens + [4000 + 89 * i] + rand_tokens(rng, 5)
        finals += got
        sent += prompts
    s.mem.check()
    s.mem.close()
    return finals, sent, [tools + h for h in hist]


@pytest.mark.parametrize("chat", [True, False])
def test_a_restarted_server_resumes_the_sessions_from_disk_snapshots(model: Model, ref: Ref,
                                                                     tmp_path: Path,
                                                                     chat: bool) -> None:
    """Agent sessions with `--cache-disk`: the attention rows go to block files and the
    tree's snapshots (the state after each saved prefix) to snapshot files beside them. A new
    scheduler (new pool and tree: a restart) on the same directory serves each session's next
    prompt from the deepest snapshot of it on disk (the state after the session's last answer
    but its last token): it computes 7 tokens a session (the answer's last token and the tool
    result's 6), as the tree would in RAM, where no cache computes every token; every answer
    equals its prompt's alone."""
    finals, sent, nxt = disk_sessions(model, ref, tmp_path, chat)
    names = [f for _, _, fs in os.walk(tmp_path) for f in fs]
    assert any(f.endswith(SNAP_SUFFIX) for f in names) and any(f.endswith(SUFFIX) for f in names)
    s = build_scheduler(model, ServerConfig(n_parallel=2, ctx_size=1024,
                                            cache_disk=str(tmp_path), cache_disk_block=16),
                        ServerMetrics())
    assert s.mem.cache.stats()["bytes"] == 0
    got = run_to_end(s, [agent_task(p, chat) for p in nxt], check_steps=True)
    for p, f in zip(nxt, got):
        assert f.tokens == drive(ref.sched, [agent_task(p, chat, cache_prompt=False)])[0]
        assert f.timings.prompt_n + f.timings.cache_n == len(p)
    computed = sum(f.timings.prompt_n for f in got)
    uncached = sum(map(len, nxt))
    assert (computed, uncached) == (7 * N_SESSIONS, 550) == (35, 550)
    fig = s.mem.tier_figures()["disk"]
    assert (fig["hits"], fig["misses"], fig["bad_files"]) == (N_SESSIONS, 0, 0)
    assert fig["snapshots"] > 0
    assert any(f.timings.reuse is not None and f.timings.reuse.tier == "disk" for f in got)
    s.mem.check()
    s.mem.close()
