"""Random admit / compute / release / fail / restore sequences through the memory manager alone
(hypothesis, stateful), for every host backend (none, legacy, radix, radix over a disk tier) and
every layout (full attention, sliding window, full attention with a recurrent draft model's
rows: its K/V and its conv input rows), in unified and partitioned KV.

No model runs: the "forward" writes into each reserved cell rows that name their token and
position (`row_of`), as a model's K/V are a function of the tokens up to there. So after every
rule, beside the manager's own invariants (the pool's bookkeeping, each slot's KV owner against
the pool, the host cache's), every row a slot holds must be exactly its token's at its position:
a restore, a share, a slot file or a checkpoint that put rows in the wrong cells, or rows of
another prompt or namespace, fails here. Whole rows are compared: every head and element of
every K/V row, the draft's K/V and conv input rows included.

A manager that always recomputed would pass those checks, so every parametrization also counts
which source served each admit (the reuse report's tier: the slot's own KV, another slot's
cells, the host RAM tier, the disk tier) and each slot-file restore, and asserts that every
path its backend and layout have served at least once (`SERVED`). A task waits as the engine
makes it wait: while another slot computes the prefix it would reuse, that slot's prompt is
computed; while its blocks are read from disk, the reads are awaited; a wait still pending
after that fails the test.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)

from radixserve.config import ServerConfig
from radixserve.errors import TaskError
from radixserve.memory.host_tier import HostTier
from radixserve.memory.key import PromptKey
from radixserve.memory.front import build_pool
from radixserve.memory.layout import CONV, FULL, SLIDING, MemoryLayout
from radixserve.memory.manager import MemoryManager
from radixserve.memory.pool.draft import attach_draft
from radixserve.memory.pool.pool import KVPool
from radixserve.memory.pool.state import fingerprint_of
from radixserve.memory.pool.swa import SWAPool
from radixserve.memory.prefix_plan import pending_prefill
from radixserve.memory.seq_kv import SlotKV

N_SLOTS, N_LAYER, HEADS, DIM, N_SWA = 3, 2, 1, 4, 8
# three documents; two share their first 12 tokens
DOCS = [list(range(100, 130)), list(range(100, 112)) + list(range(200, 215)),
        list(range(300, 326))]


def row_of(token: int, pos: int, layer: int, draft: bool = False) -> float:
    """What the fake forward writes: exact in f32, different for every (token, position,
    layer, part)."""
    return token * 1024.0 + pos + layer / 4 + (0.125 if draft else 0.0)


def no_rotate(k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    raise AssertionError("nothing shifts here (--cache-reuse off)")


@dataclass
class FakeTask:
    key: PromptKey
    id: int
    id_slot: int = -1
    cache_prompt: bool = True
    pin_s: float = 0.0

    @property
    def pin_key(self) -> PromptKey:
        return self.key


@dataclass
class FakeSlot:
    """A holder as the engine's Slot is one: a sequence, the task it serves, its progress."""

    kv: SlotKV
    id: int
    n_ctx: int
    t_last_used: float = -1.0
    prompt: list[int] = field(default_factory=list)
    task: FakeTask | None = None
    todo: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_processing(self) -> bool:
        return self.task is not None

    @property
    def prefilling(self) -> bool:
        return self.task is not None and bool(self.todo)


class FakeTokenizer:
    n_vocab = 4096

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


class FakeModel:
    def identity(self, cache_dir: str | None = None) -> bytes:
        return b"fake model"


def write_rows(pool: KVPool, seq: int, tokens: list[int], pos0: int) -> None:
    """The fake forward: every part's rows of these tokens into their reserved cells."""
    positions = list(range(pos0, pos0 + len(tokens)))
    for part, tag in parts(pool):
        cells = part.cells_at(seq, positions)
        for layer in range(part.n_layer):
            for c, t, p in zip(cells, tokens, positions):
                part.k[layer, :, c] = row_of(t, p, layer + tag)
                part.v[layer, :, c] = -row_of(t, p, layer + tag)


def parts(pool: KVPool) -> list[tuple[KVPool, int]]:
    """The pool's parts with a layer tag each (a sliding window's layers are rows of their own)."""
    return [(pool, 0)] + ([(pool.swa, 100)] if isinstance(pool, SWAPool) else [])


def sync_draft(kv: SlotKV) -> None:
    """A draft model's rows of the tokens held without them (what the speculator computes)."""
    pool = kv.pool
    assert pool.draft is not None
    n = len(kv)
    positions = list(range(kv.n_draft, n))
    for c, p in zip(pool.cells_at(kv.seq, positions), positions):
        for tag, d in enumerate(pool.draft.parts()):  # its K/V, then its conv rows
            for layer in range(d.n_layer):
                d.k[layer, :, c] = row_of(kv.tokens[p], p, layer + 100 * tag, draft=True)
                d.v[layer, :, c] = -row_of(kv.tokens[p], p, layer + 100 * tag, draft=True)
    kv.n_draft = n


def whole(want: list[float], like: torch.Tensor) -> torch.Tensor:
    """`want` (one value a cell) as every element of rows shaped like `like` [heads, cells, dim]."""
    return torch.tensor(want, dtype=like.dtype).view(1, -1, 1).expand(like.shape)


class MemoryMachine(RuleBasedStateMachine):
    layout, backend = "full", "radix"  # set per test (every pair is run)
    served: Counter[str]  # set per test: every run's admits by the tier that served them

    @initialize(unified=st.booleans(), idle_slots=st.booleans())
    def start(self, unified: bool, idle_slots: bool) -> None:
        layout, backend = self.layout, self.backend
        self.dir = tempfile.mkdtemp(prefix="rs-memory-")
        cfg = ServerConfig(ctx_size=192, n_parallel=N_SLOTS, kv_unified=unified,
                           cache_ram_mib=0 if backend == "none" else 16,
                           cache_radix_prompt=backend.startswith("radix"),
                           cache_disk=f"{self.dir}/disk" if backend == "radix-disk" else "",
                           cache_disk_block=8, cache_idle_slots=idle_slots, ubatch_size=16,
                           batch_size=16, slot_save_path=self.dir)
        kinds = ((SLIDING,) if layout == "sliding" else (FULL,)) + (FULL,) * (N_LAYER - 1)
        pool = build_pool(MemoryLayout(HEADS, DIM, kinds, N_SWA if layout == "sliding" else 0),
                          192, N_SLOTS, unified, torch.float32, no_rotate, no_rotate, 16)
        if layout == "draft":  # one attention layer, two short convolutions 2 * DIM wide
            attach_draft(pool, MemoryLayout(HEADS, DIM, (FULL, CONV, CONV), conv_rows=2,
                                            conv_width=2 * DIM),
                         torch.float32, no_rotate, "fake")
        fp = fingerprint_of(pool, "llama")
        n_ckpt = 3 if layout == "sliding" else 0
        n_ctx = 192 if unified else 192 // N_SLOTS
        self.slots = [FakeSlot(SlotKV(pool, i, fp, n_ckpt, 4), i, n_ctx)
                      for i in range(N_SLOTS)]
        if layout == "draft":
            for s in self.slots:
                s.kv.sync_draft = sync_draft
        host = HostTier(cfg, pool, "llama", None, (FakeModel(),))
        self.mem = MemoryManager(cfg, pool, self.slots, host, FakeTokenizer(), "llama",
                                 no_shift=True)
        self.pool, self.next_id, self.clock = pool, 0, 0.0
        self.saved: dict[int, tuple[str, list[int]]] = {}  # slot file -> (namespace, tokens)

    def teardown(self) -> None:
        if hasattr(self, "mem"):
            self.mem.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- tasks ---------------------------------------------------------------------------------
    @rule(doc=st.integers(0, 2), n_tail=st.integers(1, 6), salt=st.sampled_from(["", "", "b"]),
          cut=st.sampled_from([0, 0, 0, 9, 20]), n_gen=st.integers(0, 3))
    def serve(self, doc: int, n_tail: int, salt: str, cut: int, n_gen: int) -> None:
        """A whole request: admitted, its prompt computed in chunks, a few tokens generated,
        released."""
        s = self._admit(doc, n_tail, salt, cut, -1)
        if s is None:
            return
        while s.task is not None and (s.todo or n_gen):
            n_gen -= not s.todo
            self.compute(s.id, 7)
        self.release(s.id, 0.0)

    @rule(doc=st.integers(0, 2), n_tail=st.integers(1, 6), salt=st.sampled_from(["", "", "b"]),
          cut=st.sampled_from([0, 0, 9, 20]), named=st.integers(-1, N_SLOTS - 1))
    def admit(self, doc: int, n_tail: int, salt: str, cut: int, named: int) -> None:
        self._admit(doc, n_tail, salt, cut, named)

    def _admit(self, doc: int, n_tail: int, salt: str, cut: int, named: int) -> FakeSlot | None:
        base = DOCS[doc][:max(4, cut)] if cut else DOCS[doc]
        return self._launch(base + [500 + doc * 10 + i for i in range(n_tail)], salt, named)

    @rule(doc=st.integers(0, 2), n_tail=st.integers(1, 6), salt=st.sampled_from(["", "b"]),
          n_done=st.integers(0, 14))
    def two_at_once(self, doc: int, n_tail: int, salt: str, n_done: int) -> None:
        """Two requests for one document, the second arriving while the first's prompt is
        computed (`n_done` chunks in): it waits for that prefill, then takes the first's cells,
        its own KV or the host's, whichever holds most."""
        a = self._admit(doc, n_tail, salt, 0, -1)
        if a is None:
            return
        for _ in range(n_done):
            if a.prefilling:
                self.compute(a.id, 3)
        self._admit(doc, n_tail + 1, salt, 0, -1)

    @rule(i=st.integers(0, N_SLOTS - 1), n_new=st.integers(1, 5),
          named=st.sampled_from([True, False]))
    def next_turn(self, i: int, n_new: int, named: bool) -> None:
        """A conversation's next turn: what idle slot i holds (its prompt and answer) then new
        tokens, in its namespace, sent to that slot or to whichever llama-server picks."""
        s = self.slots[i]
        if s.is_processing or not len(s.kv) or len(s.kv) + n_new + 8 >= s.n_ctx:
            return
        tokens = list(s.kv.tokens) + [700 + 7 * i + j for j in range(n_new)]
        s2 = self._launch(tokens, s.kv.salt, i if named else -1)
        if s2 is not None:
            while s2.task is not None and s2.todo:
                self.compute(s2.id, 9)
            self.release(s2.id, 0.0)

    @rule(i=st.integers(0, N_SLOTS - 1), into=st.integers(0, N_SLOTS - 1))
    def file_round_trip(self, i: int, into: int) -> None:
        """A slot saved to a file and the file restored at once (into it or another slot)."""
        self.save_file(i)
        self.restore_file(i, into)

    def _launch(self, tokens: list[int], salt: str, named: int) -> FakeSlot | None:
        task = FakeTask(PromptKey(salt, tokens), self.next_id, id_slot=named)
        held, update_cache = self.mem.choose_slot(task)
        if held is None or held.is_processing:
            return None
        while (donor := pending_prefill(self.slots, task)) is not None:
            # another slot computes the prefix this task would reuse: as the engine, the task
            # waits while that slot's prompt is computed (a chunk at a time, or it fails)
            before = (donor.task, len(donor.kv))
            self.compute(donor.id, 12)
            assert (donor.task, len(donor.kv)) != before, "a prefill wait that never ends"
        if self.mem.must_wait(task):
            # its blocks are being read from disk: as the engine, wait for the reads (every
            # job queued so far done), then they must be taken and the task go on
            assert self.mem.disk is not None, "a wait with nothing to wait for"
            self.mem.disk.disk.drain()
            assert self.mem.poll_io(), "the disk reads ended, none was taken"
            self.served["waited for disk"] += 1
        assert not self.mem.must_wait(task), "a wait that never ends"
        slot = self.slots[held.id]
        self.mem.before_launch(slot)
        plan, why = self.mem.admit(slot, task, update_cache=update_cache,
                                   n_cache_reuse=None, prefer=None, slot_only=False)
        self.next_id += 1
        # the slot holds exactly the reused prefix of this prompt, in its namespace
        assert list(slot.kv.tokens) == tokens[:len(slot.kv)]
        assert len(slot.kv) == plan.n_prefix == plan.n_reused < len(tokens)
        assert plan.todo == [(plan.n_prefix, len(tokens))]
        assert slot.kv.salt == salt and why.n_tokens == plan.n_reused
        assert why.n_held >= plan.n_reused
        self.served[why.tier] += 1
        if plan.checkpoint is not None:
            self.served["checkpoint"] += 1
        slot.task, slot.prompt, slot.todo = task, tokens, plan.todo
        self.clock += 1
        slot.t_last_used = self.clock
        self.mem.after_launch()
        return slot

    @precondition(lambda self: any(s.is_processing for s in self.slots))
    @rule(i=st.integers(0, N_SLOTS - 1), n=st.integers(1, 12))
    def compute(self, i: int, n: int) -> None:
        """A prompt chunk, or a generated token once the prompt is done."""
        s = self.slots[i]
        if s.task is None:
            return
        generating = not s.todo
        if generating:
            p0, take = len(s.kv), 1
            if p0 + 1 >= s.n_ctx:
                return
            tokens = [600 + p0 % 50]
        else:
            p0, p1 = s.todo[0]
            take = min(n, p1 - p0)
            if s.kv.n_checkpoints:
                take, _ = self.mem.checkpoint_chunk(s, p0, take, (), self.next_id)
            tokens = s.prompt[p0:p0 + take]
        cells = self.mem.reserve(s, p0, take, generating)
        if cells is None:
            self.fail(i)
            return
        write_rows(self.pool, s.kv.seq, tokens, p0)
        s.kv.commit(p0, tokens)
        self.mem.slide(s, s.task.cache_prompt)
        if not generating:
            s.todo = [] if p0 + take == s.todo[0][1] else [(p0 + take, s.todo[0][1])]

    @rule(i=st.integers(0, N_SLOTS - 1), pin=st.sampled_from([0.0, 0.0, 60.0]))
    def release(self, i: int, pin: float) -> None:
        s = self.slots[i]
        if s.task is None:
            return
        s.task.pin_s = pin
        self.mem.release(s, s.task, answered=True)
        s.task, s.todo = None, []

    @rule(i=st.integers(0, N_SLOTS - 1))
    def fail(self, i: int) -> None:
        s = self.slots[i]
        if s.task is None:
            return
        self.mem.drop(s)
        s.task, s.todo = None, []

    @rule()
    def poll_disk(self) -> None:
        self.mem.poll_io()

    @rule()
    def make_room(self) -> None:
        self.mem.make_room()

    @rule()
    def flush(self) -> None:
        _, disk = self.mem.flush()
        if disk is not None:
            disk.result(timeout=30)

    # -- slot files ----------------------------------------------------------------------------
    @rule(i=st.integers(0, N_SLOTS - 1))
    def save_file(self, i: int) -> None:
        s = self.slots[i]
        try:
            self.mem.slot_action(i, "save", f"s{i}.bin")
        except TaskError as e:
            assert e.status == 409 and s.is_processing
            return
        self.saved[i] = (s.kv.salt, list(s.kv.tokens))

    @precondition(lambda self: bool(self.saved))
    @rule(src=st.integers(0, N_SLOTS - 1), into=st.integers(0, N_SLOTS - 1))
    def restore_file(self, src: int, into: int) -> None:
        if src not in self.saved:
            return
        s = self.slots[into]
        before = (list(s.kv.tokens), s.kv.salt)
        try:
            self.mem.slot_action(into, "restore", f"s{src}.bin")
        except TaskError as e:  # busy, or no room: the slot as it was
            assert e.status in (400, 409)
            assert (list(s.kv.tokens), s.kv.salt) == before
            return
        assert (s.kv.salt, list(s.kv.tokens)) == self.saved[src]
        if self.saved[src][1]:
            self.served["slot file"] += 1

    # -- what must hold after every rule --------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "mem"):
            return
        for s in self.slots:
            if not s.is_processing:  # an idle slot holds its prefix only (nothing ahead)
                assert s.kv.n_held == len(s.kv)
        if not any(s.is_processing for s in self.slots):
            self.mem.check()  # at idle: nothing left locked either
        else:
            self.pool.check()
            for s in self.slots:
                s.kv.check()

    @invariant()
    def rows_are_their_tokens(self) -> None:
        if not hasattr(self, "mem"):
            return
        pool = self.pool
        for s in self.slots:
            toks, seq = list(s.kv.tokens), s.kv.seq
            for part, tag in parts(pool):
                held = [p for p in part.seq_positions(seq) if p < len(toks)]
                cells = part.cells_at(seq, held)
                for layer in range(part.n_layer):
                    want = [row_of(toks[p], p, layer + tag) for p in held]
                    k, v = part.k[layer][:, cells], part.v[layer][:, cells]  # [heads, n, dim]
                    assert k.shape == v.shape == (HEADS, len(held), DIM), k.shape
                    assert torch.equal(k, whole(want, k)), (s.id, tag, layer)
                    assert torch.equal(v, -whole(want, v)), (s.id, tag, layer)
            if pool.draft is not None and not s.is_processing:
                n = min(s.kv.n_draft, len(toks))
                cells = pool.cells_at(seq, list(range(n)))
                for tag, d in enumerate(pool.draft.parts()):
                    assert len(pool.draft.parts()) == 2  # K/V and conv rows
                    for layer in range(d.n_layer):
                        want = [row_of(toks[p], p, layer + 100 * tag, draft=True)
                                for p in range(n)]
                        k, v = d.k[layer][:, cells], d.v[layer][:, cells]
                        # K/V: one head of DIM; conv rows: one group of n_embd / 2 = DIM
                        assert k.shape == v.shape == (HEADS, n, DIM), k.shape
                        assert torch.equal(k, whole(want, k)), (s.id, tag, layer)
                        assert torch.equal(v, -whole(want, v)), (s.id, tag, layer)


def served_paths(backend: str, layout: str) -> set[str]:
    """What must have served at least once in a parametrization's runs: the slot's own KV and
    a slot file everywhere; another slot's cells except on the radix tree with a sliding window
    (a window is shared only as it stands, and the tree, which keeps every row, holds as much);
    the host RAM tier with a host backend; the disk tier, after a wait for its reads, over
    radix-disk; a context checkpoint with a sliding window. (Measured with these settings:
    each at least 4 times a parametrization, most 8-30.)"""
    out = {"slot", "slot file"}
    if not (backend.startswith("radix") and layout == "sliding"):
        out.add("slot_share")
    if backend != "none":
        out.add("ram")
    if backend == "radix-disk":
        out |= {"disk", "waited for disk"}
    if layout == "sliding":
        out.add("checkpoint")
    return out


@pytest.mark.parametrize("backend", ["none", "legacy", "radix", "radix-disk"])
@pytest.mark.parametrize("layout", ["full", "sliding", "draft"])
def test_memory_manager_random_sequences(backend: str, layout: str) -> None:
    served: Counter[str] = Counter()
    machine = type("Machine", (MemoryMachine,),
                   {"backend": backend, "layout": layout, "served": served})
    run_state_machine_as_test(
        machine,
        settings=settings(max_examples=25, stateful_step_count=40, deadline=None,
                          derandomize=True, database=None,
                          suppress_health_check=list(HealthCheck)),
    )
    missing = {p for p in served_paths(backend, layout) if served[p] == 0}
    assert not missing, f"never served: {sorted(missing)}; served {dict(served)}"
