"""Random interleavings through the real scheduler on the tiny model (hypothesis, stateful).

Tasks with shared prefixes arrive, steps run, tasks are cancelled, slots are saved to files,
erased and restored, idle slots are cleared; host caches (radix, legacy, none, or radix with
every restore faulting part-way) save and restore in between, in unified and partitioned KV, with and without `--cache-reuse`. After
every step the engine's invariants hold (the pool's bookkeeping, each slot's KV owner against
the pool, the host cache's), and without `--cache-reuse` every greedy answer equals the one a
no-cache run of that prompt alone gives.
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from radixserve.memory.tiers.radix import RadixPromptCache
from radixserve.config import ServerConfig
from radixserve.engine.counters import ServerMetrics
from radixserve.engine.build import build_scheduler
from radixserve.engine.task import CompletionTask, FinalResult
from radixserve.errors import TaskError
from radixserve.model.loader import Model, load_model
from radixserve.sampling.chain import SamplingParams

N_SLOTS = 3
# three documents; two of them share their first 24 tokens (a prefix shared across documents)
DOCS = [list(range(2000, 2060)), list(range(2000, 2024)) + list(range(3000, 3040)),
        list(range(4000, 4050))]


def greedy(prompt: list[int], n: int, **kw: Any) -> CompletionTask:
    return CompletionTask(prompt, SamplingParams(temperature=0), n_predict=n, ignore_eos=True,
                          **kw)


class EngineMachine(RuleBasedStateMachine):
    model: Model  # set by the test
    reference: dict[tuple[tuple[int, ...], int], list[int]]

    @initialize(unified=st.booleans(),
                backend=st.sampled_from(["radix", "legacy", "none", "radix-faults"]),
                idle_slots=st.booleans(), ubatch=st.sampled_from([16, 64, 512]),
                fault_after=st.integers(1, 50), cache_reuse=st.sampled_from([0, 0, 4]))
    def start(self, unified: bool, backend: str, idle_slots: bool, ubatch: int,
              fault_after: int, cache_reuse: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="rs-stateful-")
        cfg = ServerConfig(ctx_size=1024, n_parallel=N_SLOTS, kv_unified=unified,
                           cache_ram_mib=0 if backend == "none" else 64,
                           cache_radix_prompt=backend.startswith("radix"),
                           cache_idle_slots=idle_slots, ubatch_size=ubatch,
                           cache_reuse=cache_reuse, slot_save_path=self.dir)
        # --cache-reuse shifts KV computed in another context (llama-server's approximation):
        # answers may then differ from a no-cache run, so only the invariants are checked
        self.exact = cache_reuse == 0
        # every host restore fails part-way: each falls back to a prefill
        faulty = RadixPromptCache(64 * 2**20, fault_after_tokens=fault_after)
        self.sched = build_scheduler(self.model, cfg, ServerMetrics(),
                               faulty if backend == "radix-faults" else None)
        self.outs: dict[int, list[Any]] = {}  # task id -> what it emitted
        self.tasks: dict[int, CompletionTask] = {}
        self.cancelled: set[int] = set()
        self.checked: set[int] = set()
        self.saved: dict[int, list[int]] = {}  # slot -> tokens in its file

    def teardown(self) -> None:
        if hasattr(self, "sched"):
            self.drain()
            self.check_answers()
        if hasattr(self, "dir"):
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- what the server is asked -------------------------------------------------------------
    @rule(doc=st.integers(0, 2), cut=st.integers(8, 60),
          tail=st.lists(st.integers(5000, 5999), min_size=1, max_size=6), n=st.integers(0, 5),
          cache_prompt=st.booleans(), id_slot=st.sampled_from([-1, -1, 0, 1, 2]),
          stream=st.booleans())
    def submit(self, doc: int, cut: int, tail: list[int], n: int, cache_prompt: bool,
               id_slot: int, stream: bool) -> None:
        task = greedy(DOCS[doc][:cut] + tail, n, cache_prompt=cache_prompt, id_slot=id_slot,
                      stream=stream)
        out: list[Any] = []
        self.sched.submit(task, out.append)
        self.tasks[task.id], self.outs[task.id] = task, out

    @rule(n=st.integers(1, 6))
    def step(self, n: int) -> None:
        for _ in range(n):
            if self.sched.has_active() or self.sched.deferred:
                self.sched.step()
                self.sched.check()

    @precondition(lambda self: any(not self.done(i) for i in self.tasks))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        live = sorted(i for i in self.tasks if not self.done(i))
        tid = data.draw(st.sampled_from(live))
        self.sched.cancel(self.tasks[tid])
        self.cancelled.add(tid)

    @rule(slot=st.integers(0, N_SLOTS - 1))
    def save_slot(self, slot: int) -> None:
        s = self.sched.slots[slot]
        if s.is_processing:
            with pytest.raises(TaskError):
                self.sched.mem.slot_action(slot, "save", f"s{slot}.bin")
            return
        self.sched.mem.slot_action(slot, "save", f"s{slot}.bin")
        self.saved[slot] = list(s.tokens)

    @precondition(lambda self: bool(self.saved))
    @rule(data=st.data(), into=st.integers(0, N_SLOTS - 1))
    def restore_slot(self, data: st.DataObject, into: int) -> None:
        src = data.draw(st.sampled_from(sorted(self.saved)))
        if self.sched.slots[into].is_processing:
            return
        try:
            self.sched.mem.slot_action(into, "restore", f"s{src}.bin")
        except TaskError as e:  # no room for it now: the slot must be as it was
            assert "No available space" in e.message, e.message
            return
        assert list(self.sched.slots[into].tokens) == self.saved[src]

    @rule(slot=st.integers(0, N_SLOTS - 1))
    def erase_slot(self, slot: int) -> None:
        if not self.sched.slots[slot].is_processing:
            self.sched.mem.slot_action(slot, "erase", None)
            assert len(self.sched.slots[slot].tokens) == 0

    @rule()
    def clear_idle_slot(self) -> None:
        self.sched.mem.make_room()

    # -- what must hold ----------------------------------------------------------------------
    @invariant()
    def invariants(self) -> None:
        if hasattr(self, "sched"):
            self.sched.check()
            self.check_answers()

    def done(self, tid: int) -> bool:
        out = self.outs[tid]
        return tid in self.cancelled or bool(out) and isinstance(out[-1], (FinalResult,
                                                                           TaskError))

    def drain(self) -> None:
        for _ in range(10_000):
            if not (self.sched.has_active() or self.sched.deferred):
                break
            self.sched.step()
            self.sched.check()
        assert not self.sched.has_active() and not self.sched.deferred

    def check_answers(self) -> None:
        for tid, out in self.outs.items():
            if tid in self.checked or not out or tid in self.cancelled:
                continue
            final = out[-1]
            if not isinstance(final, (FinalResult, TaskError)):
                continue
            assert isinstance(final, FinalResult), f"task {tid} failed: {final.message}"
            task = self.tasks[tid]
            if self.exact:
                assert final.tokens == self.expected(task), f"task {tid} differs from no-cache"
            if task.stream:
                assert "".join(p.text for p in out[:-1]) == final.content
            self.checked.add(tid)

    def expected(self, task: CompletionTask) -> list[int]:
        key = (tuple(task.prompt_tokens), task.n_predict)
        if key not in self.reference:
            ref = build_scheduler(self.model, ServerConfig(ctx_size=256, n_parallel=1, cache_ram_mib=0),
                            ServerMetrics())
            out: list[Any] = []
            ref.submit(greedy(task.prompt_tokens, task.n_predict, cache_prompt=False),
                       out.append)
            while ref.has_active():
                ref.step()
            assert isinstance(out[-1], FinalResult)
            self.reference[key] = out[-1].tokens
        return self.reference[key]


def test_random_interleavings_keep_invariants_and_answers(tiny_path: str) -> None:
    EngineMachine.model = load_model(tiny_path, "f32", weights="native")
    EngineMachine.reference = {}
    run_state_machine_as_test(
        EngineMachine,
        settings=settings(max_examples=100, stateful_step_count=50, deadline=None,
                          suppress_health_check=list(HealthCheck)),
    )
