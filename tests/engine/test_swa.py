"""Sliding-window KV through the real scheduler, on a tiny gemma3 (window 16): whatever tier
supplies a prefix - the slot's own window, a context checkpoint, a legacy host entry with its
checkpoints, the radix tree (write-through), a slot file's SCKP appendix - the greedy tokens
equal those of the same prompt computed alone with no cache. Prompts are far longer than the
window and diverge before and after its edge; each test asserts the tier really served tokens.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve.memory.tiers.slot_file import parse_slot_file, read_slot_file
from radixserve.config import ServerConfig
from radixserve.engine.counters import ServerMetrics
from radixserve.memory.prefix_plan import Source
from radixserve.engine.build import build_scheduler
from radixserve.engine.scheduler import Scheduler
from radixserve.memory.pool.conv import ConvPool
from radixserve.memory.pool.swa import SWAPool
from radixserve.model.loader import Model, load_model
from tests.engine.test_deterministic import Recorder, drive, greedy

N_DOC, N_Q = 60, 6


PATHS = {"gemma3": "tiny_swa_path", "lfm2": "tiny_lfm2_path", "qwen35": "tiny_qwen35_path"}


@pytest.fixture(scope="module", params=list(PATHS))
def model(request: pytest.FixtureRequest) -> Model:
    """The window layouts: Gemma 3's sliding attention (window 16), LFM2's short
    convolutions (their state a window of 3 input rows, memory/pool/conv.py) and Qwen3.5's
    Gated DeltaNet (its state kept whole, one cell after a sequence's last token,
    memory/pool/recurrent.py)."""
    return _load(request)


@pytest.fixture(scope="module", params=["gemma3", "lfm2"])
def row_model(request: pytest.FixtureRequest) -> Model:
    """The layouts whose windowed group has rows a token, which the radix tree keeps (a Gated
    DeltaNet's state has none: its host cache is the whole-prompt one)."""
    return _load(request)


def _load(request: pytest.FixtureRequest) -> Model:
    m = load_model(request.getfixturevalue(PATHS[request.param]), "bf16", deterministic="on")
    assert m.deterministic and m.hp.arch == request.param
    assert m.layout.rows_every_position == (m.hp.arch != "qwen35")
    return m


def make_prompts(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    docs = [[rng.randrange(200, 40000) for _ in range(N_DOC)] for _ in range(3)]
    qs = [[rng.randrange(200, 40000) for _ in range(N_Q)] for _ in range(3)]
    return docs, qs


DOCS, QS = make_prompts(16)


def P(d: int, q: int) -> list[int]:
    return DOCS[d] + QS[q]


def edit(p: list[int]) -> list[int]:
    """The prompt with its last two tokens changed: it diverges after the checkpoint at n - 4
    and, once the slot has generated, before the window's edge."""
    return p[:-2] + [5001, 5002]


class Ref:
    """Each prompt alone, one slot, no cache of any kind."""

    def __init__(self, model: Model) -> None:
        self.sched = build_scheduler(model, ServerConfig(ctx_size=512, n_parallel=1, cache_ram_mib=0),
                               ServerMetrics())
        self.memo: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, p: list[int]) -> list[int]:
        key = tuple(p)
        if key not in self.memo:
            self.run(p)
        return self.memo[key]

    def run(self, p: list[int]) -> list[int]:
        """Compute `p` afresh; the slot then holds its KV (`kv_rows`)."""
        self.memo[tuple(p)] = drive(self.sched, [greedy(p, cache_prompt=False)])[0]
        return self.memo[tuple(p)]


def kv_rows(s: Scheduler, seq: int) -> tuple[torch.Tensor, ...]:
    """The K/V a slot holds: every position's global rows, the window's sliding rows."""
    pool = s.pool
    assert isinstance(pool, SWAPool)
    main = torch.tensor(pool.seq_cells(seq))
    # the window's rows (a conv window may hold more, up to its next prune: history-dependent)
    w0 = pool.snapshot_from(seq)
    held = [(p, c) for p, c in zip(pool.swa.seq_positions(seq), pool.swa.seq_cells(seq))
            if p >= w0]
    win = torch.tensor([c for _, c in held])
    return (torch.tensor([p for p, _ in held]), pool.k[:, :, main], pool.v[:, :, main],
            pool.swa.k[:, :, win], pool.swa.v[:, :, win])


@pytest.fixture(scope="module")
def ref(model: Model) -> Ref:
    return Ref(model)


@pytest.fixture(scope="module")
def row_ref(row_model: Model) -> Ref:
    return Ref(row_model)


def sched(model: Model, **kw: Any) -> Scheduler:
    cfg = dict(ctx_size=512, n_parallel=1, ubatch_size=8)
    cfg.update(kw)
    s = build_scheduler(model, ServerConfig(**cfg), ServerMetrics())
    assert isinstance(s.pool, SWAPool)
    return s


def check_run(s: Scheduler, ref: Ref, prompts: list[list[int]]) -> None:
    """Tokens equal to a fresh computation's, and so is the KV the slot then holds, bit for
    bit: global rows and the window's sliding rows (deterministic mode)."""
    for p in prompts:
        want = ref.run(p)  # first: the plans recorded last are then the scheduler's under test
        assert drive(s, [greedy(p)])[0] == want
        slot = max(s.slots, key=lambda sl: sl.t_last_used)
        got, exp = kv_rows(s, slot.id), kv_rows(ref.sched, 0)
        assert all(torch.equal(a, b) for a, b in zip(got, exp)), "KV differs from a fresh run"


def at_end(model: Model, prompt: list[int]) -> list[int]:
    """A snapshot layout's checkpoint before the prompt's last token (a fork, memory/
    manager.py's `_forks`: where a regenerated answer resumes); none for the others."""
    return [] if model.layout.rows_every_position else [len(prompt) - 1]


def restored(rec: Recorder) -> list[Any]:
    return [p.checkpoint for p in rec.plans if p.checkpoint is not None]


def test_reference_runs_past_the_window(model: Model, ref: Ref):
    """The reference itself: one prompt in 8-token chunks vs 64-token chunks, and with
    full-size caches (--swa-full): the window's pruning changes no token."""
    s64 = sched(model, ubatch_size=64, cache_ram_mib=0)
    full = build_scheduler(model, ServerConfig(ctx_size=512, n_parallel=1, cache_ram_mib=0,
                                         swa_full=True), ServerMetrics())
    # --swa-full is for sliding attention: a recurrent state keeps its window part
    assert isinstance(full.pool, ConvPool) == (model.hp.arch == "lfm2")
    assert isinstance(full.pool, SWAPool) == (model.hp.arch != "gemma3")
    for p in (P(0, 0), P(1, 1)):
        assert drive(s64, [greedy(p, cache_prompt=False)])[0] == ref(p)
        assert drive(full, [greedy(p, cache_prompt=False)])[0] == ref(p)


def test_in_slot_window_and_checkpoint(model: Model, ref: Ref, monkeypatch):
    rec = Recorder(monkeypatch)
    s = sched(model, cache_ram_mib=0)
    first = P(0, 0)
    check_run(s, ref, [first])
    kv = s.slots[0].kv
    # checkpoints before the chunks that start n_ubatch + 4 and 4 tokens from the end
    assert [c.n_tokens for c in kv.checkpoints] == [len(first) - 12, len(first) - 4,
                                                    *at_end(model, first)]
    n_ck = 2 + len(at_end(model, first))
    assert s.metrics.checkpoints == n_ck and s.metrics.checkpoints_created_total == n_ck
    # after the window: an edit of the prompt's end restores the checkpoint at n - 4
    check_run(s, ref, [edit(first)])
    assert [c.n_tokens for c in restored(rec)] == [len(first) - 4]
    assert s.metrics.checkpoints_restored_total == 1
    assert rec.plans[-1].n_reused == len(first) - 4
    # the report says reuse stopped at the snapshot, not where the prompt left the slot's text
    r = s.slots[0].reuse
    assert r is not None and (r.n_tokens, r.n_held, r.limit) == (len(first) - 4,
                                                                   len(first) - 2, "snapshot")
    # the conversation goes on: the window covers the end, the slot's own KV serves it
    turn2 = edit(first) + ref(edit(first))[:-1] + QS[1]
    check_run(s, ref, [turn2])
    assert rec.plans[-1].source is Source.OWN and rec.plans[-1].checkpoint is None
    assert s.slots[0].reuse is not None and s.slots[0].reuse.limit is None
    assert rec.plans[-1].n_reused == len(edit(first)) + len(ref(edit(first))) - 1
    # a new question on the same document: the window has gone, the checkpoint taken
    # n_ubatch + 4 tokens before the first prompt's end (inside the document) serves it
    check_run(s, ref, [P(0, 2)])
    assert rec.plans[-1].n_reused == len(first) - 12
    assert rec.plans[-1].checkpoint is not None
    # a prompt that leaves the document earlier than every checkpoint: everything is computed
    # (llama-server's "forcing full prompt re-processing")
    check_run(s, ref, [DOCS[0][:30] + QS[2]])
    assert rec.plans[-1].n_reused == 0
    r = s.slots[0].reuse
    assert r is not None and (r.n_held, r.limit) == (30, "window")
    s.check()


def test_legacy_entries_carry_checkpoints(model: Model, ref: Ref, monkeypatch):
    rec = Recorder(monkeypatch)
    s = sched(model, cache_radix_prompt=False)
    check_run(s, ref, [P(0, 0), P(1, 0)])  # the second overwrites the slot: doc 0 -> host
    entry = s.mem.cache.states[0]
    assert entry.tokens[: len(P(0, 0))] == P(0, 0) and len(entry.checkpoints) == 2 + len(at_end(model, P(0, 0)))
    assert entry.size == len(entry.data) + sum(c.size for c in entry.checkpoints)
    check_run(s, ref, [edit(P(0, 0))])
    assert any(sp.source is Source.HOST for p in rec.plans for sp in p.spans)
    assert [c.n_tokens for c in restored(rec)] == [len(P(0, 0)) - 4]
    assert all(c.id_task == -1 for c in s.slots[0].kv.checkpoints if c.n_tokens
               < len(P(0, 0)) - 4)
    s.check()


def test_radix_tree_serves_prefixes_the_window_dropped(row_model: Model, row_ref: Ref, monkeypatch):
    rec = Recorder(monkeypatch)
    s = sched(row_model)
    check_run(s, row_ref, [P(0, 0), P(1, 0)])
    rec.plans.clear()
    check_run(s, row_ref, [P(0, 1), P(1, 2), edit(P(0, 0))])
    host = [sp.p1 - sp.p0 for p in rec.plans for sp in p.spans if sp.source is Source.HOST]
    assert host[:2] == [N_DOC, N_DOC] and host[2] == len(P(0, 0)) - 2
    s.check()


def test_concurrent_slots_every_tier(model: Model, ref: Ref):
    prompts = [P(d, q) for q in range(3) for d in range(3)] + [edit(P(d, 0)) for d in range(3)]
    for kw in (dict(), dict(cache_radix_prompt=False), dict(cache_ram_mib=0)):
        s = sched(model, n_parallel=3, kv_unified=True, **kw)
        tasks = [greedy(p) for p in prompts]
        assert drive(s, tasks) == [ref(p) for p in prompts], kw


def test_slot_file_carries_checkpoints(model: Model, ref: Ref, tmp_path: Path, monkeypatch):
    rec = Recorder(monkeypatch)
    s = sched(model, cache_ram_mib=0, slot_save_path=str(tmp_path))
    check_run(s, ref, [P(2, 0)])
    s.mem.slot_action(0, "save", "a.bin")
    sf, warnings = read_slot_file(tmp_path / "a.bin")
    assert not warnings and [c.n_tokens for c in sf.checkpoints] == [
        len(P(2, 0)) - 12, len(P(2, 0)) - 4, *at_end(model, P(2, 0))]
    s.mem.slot_action(0, "erase", None)
    n_held = len(P(2, 0)) + len(ref(P(2, 0))) - 1
    assert s.mem.slot_action(0, "restore", "a.bin")["n_restored"] == n_held
    assert [c.id_task for c in s.slots[0].kv.checkpoints] == [-1] * len(sf.checkpoints)
    check_run(s, ref, [edit(P(2, 0))])
    assert [c.n_tokens for c in restored(rec)] == [len(P(2, 0)) - 4]
    s.check()


def test_broken_checkpoint_appendix_keeps_the_main_state(model: Model, ref: Ref,
                                                        tmp_path: Path):
    """SCKP cut at every offset: the reader keeps the main part and drops the appendix. Cut at
    sampled offsets, or with bytes flipped, the restored slot holds only intact checkpoints
    (each is sealed with a CRC), never crashes, and answers as a fresh computation does."""
    s = sched(model, cache_ram_mib=0, slot_save_path=str(tmp_path))
    check_run(s, ref, [P(2, 1)])
    s.mem.slot_action(0, "save", "a.bin")
    data = (tmp_path / "a.bin").read_bytes()
    good, _ = parse_slot_file(data)
    assert len(good.checkpoints) == 2 + len(at_end(model, P(2, 1)))
    start = data.index(b"SCKP")
    for i in range(start, len(data)):
        sf, warnings = parse_slot_file(data[:i])
        assert (sf.tokens, sf.state, sf.checkpoints) == (good.tokens, good.state, [])
        assert warnings or i == start
    rng = random.Random(3)
    variants = [data] + [data[:i] for i in rng.sample(range(start, len(data)), 12)]
    for _ in range(40):
        b = bytearray(data)
        i = rng.randrange(start, len(data))
        b[i] ^= 1 << rng.randrange(8)
        variants.append(bytes(b))
    kept = set()
    for i, v in enumerate(variants):
        (tmp_path / "b.bin").write_bytes(v)
        s.mem.slot_action(0, "erase", None)
        assert s.mem.slot_action(0, "restore", "b.bin")["n_restored"] == len(good.tokens)
        cks = s.slots[0].kv.checkpoints
        kept.add(len(cks))
        assert all(c.target in [g.target for g in good.checkpoints] for c in cks)
        s.check()
        if i % 10 == 0:  # the next prompt is still right, checkpoints or not
            check_run(s, ref, [edit(P(2, 1))])
    # none, all, and some in between (each sealed with its own CRC)
    assert {0, len(good.checkpoints)} < kept <= set(range(len(good.checkpoints) + 1))


def test_checkpoint_at_the_last_user_message(model: Model, ref: Ref, monkeypatch):
    """Chat prompts carry their user messages' starts: chunks end there and checkpoints are
    taken there (llama-server's message spans), so a new last message reuses all before it."""
    rec = Recorder(monkeypatch)
    s = sched(model, cache_ram_mib=0)
    first = DOCS[0] + QS[0] + QS[1]  # "system" 0..59, a user turn 60..65, the last 66..71
    task = greedy(first)
    task.user_starts = (0, 60, 66)
    want = ref.run(first)
    assert drive(s, [task])[0] == want
    assert [c.n_tokens for c in s.slots[0].kv.checkpoints] == [60, 66, 68, *at_end(model, first)]
    check_run(s, ref, [DOCS[0] + QS[0] + QS[2]])
    ck = rec.plans[-1].checkpoint
    assert ck is not None and ck.n_tokens == 66 and rec.plans[-1].n_reused == 66


def test_radix_serves_what_the_slot_window_dropped(row_model: Model, row_ref: Ref, monkeypatch):
    """The slot shares a prefix with the prompt but its window has left it and no checkpoint
    covers it: the radix tree (which the slot's own tokens do not outbid) restores it."""
    rec = Recorder(monkeypatch)
    s = sched(row_model, ctx_checkpoints=0)
    check_run(s, row_ref, [P(1, 0)])
    rec.plans.clear()
    check_run(s, row_ref, [DOCS[1][:30] + QS[2]])
    host = [sp.p1 - sp.p0 for p in rec.plans for sp in p.spans if sp.source is Source.HOST]
    assert host == [30]


def test_write_through_stores_runs_not_a_node_a_token(row_model: Model, row_ref: Ref):
    """A long generation slides the window many times; the radix tree's write-through stores
    the rows leaving it in runs (LFM2's window of 3 rows is pruned in runs of PRUNE_SLACK), so
    one prompt and its answer are a handful of nodes, not one a decoded token."""
    s = sched(row_model)
    p = P(2, 2)
    task = greedy(p)
    task.n_predict = 150
    out = drive(s, [task])[0]
    tree, pool = s.mem.cache.tree, s.pool
    assert isinstance(pool, SWAPool) and len(out) == 150
    run = max(pool.n_keep - pool.n_swa, pool.n_swa)  # tokens between two write-throughs
    assert run >= 16
    assert tree.n_nodes <= 2 + (len(p) + 150) // run, tree.n_nodes
    s.check()
