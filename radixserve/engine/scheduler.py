"""Admission and continuous batching: llama-server's update loop, minus what lives elsewhere.

Runs on the engine thread only. Sequence memory is the manager's (memory/manager.py): admission
asks it which slot takes a task and has it make the slot hold the prompt's longest reusable
prefix (saving what the slot would lose first); the scheduler never decides what is cached.
Each `step()` is schedule -> run -> postprocess: schedule reserves cells (through the manager)
for a decode token of every generating slot plus prompt chunks of prefilling slots (up to the
batch budget) before anything runs, so a forward never runs out of cells half-way; run is one
forward; postprocess commits the new KV, samples, and streams results out through each task's
`emit` callback.

Also llama-server's: `--context-shift` (a generating slot whose context is full keeps n_keep
tokens, discards n_discard after them and moves the rest left, through SlotKV.shift; the
shifted KV is dropped when the task ends, never reused), and n_cmpl > 1 children, which wait
until their parent's prompt is computed and then take its cells (prefix_plan's `prefer`).

Sliding-window models add llama-server's context checkpoints, placed by the memory manager
(`checkpoint_chunk`: where a prompt chunk ends and whether one is taken before it runs).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from radixserve.config import ServerConfig
from radixserve.engine.batch import run, seq_step
from radixserve.engine.counters import ServerMetrics
from radixserve.engine.slot import Slot, SlotState
from radixserve.engine.speculative import Speculator
from radixserve.engine.task import CompletionTask, check_prompt
from radixserve.errors import TaskError
from radixserve.memory.manager import MemoryManager
from radixserve.memory.miss_report import describe
from radixserve.model.forward import SeqStep
from radixserve.model.loader import Model
from radixserve.sampling.chain import Sampler, sample_batch
from radixserve.text.grammar import Constraint

log = logging.getLogger(__name__)
Emit = Callable[[Any], None]


class Scheduler:
    """Built by `engine/build.py` (the composition root): it schedules what it is handed and
    builds nothing. Sequence memory is reached through `mem` alone; each slot's KV owner
    (`slot.kv`) takes the steps' cells and commits."""

    def __init__(self, model: Model, cfg: ServerConfig, metrics: ServerMetrics,
                 mem: MemoryManager, slots: list[Slot], spec: Speculator | None,
                 n_ctx_slot: int, n_budget: int) -> None:
        self.model, self.cfg, self.metrics, self.mem = model, cfg, metrics, mem
        self.tok = model.tokenizer
        self.pool, self.slots, self.spec = mem.pool, slots, spec
        self.n_ctx_slot, self.n_budget = n_ctx_slot, n_budget
        self.deferred: deque[tuple[CompletionTask, Emit]] = deque()
        self._next_id = 0

    # -- tasks in ---------------------------------------------------------------------------
    def submit(self, task: CompletionTask, emit: Emit) -> None:
        task.id, self._next_id = self._next_id, self._next_id + 1
        try:
            check_prompt(task.prompt_tokens, self.n_ctx_slot, self.tok.n_vocab, task.pooling)
            if task.id_slot != -1 and not 0 <= task.id_slot < len(self.slots):
                raise TaskError(400, "invalid_request_error", f"id_slot {task.id_slot} is "
                                f"out of range [0, {len(self.slots)})")
        except TaskError as e:
            emit(e)
            return
        self.deferred.append((task, emit))
        self.launch_deferred()

    def cancel(self, task: CompletionTask) -> None:
        """Stop `task` (its client left): dropped while it waits, its slot freed while it runs,
        nothing once it ended. Matched by identity: it may have been cancelled before it was
        submitted here, as long as the Submit came first (one queue keeps that order)."""
        for i, (t, _) in enumerate(self.deferred):
            if t is task:
                del self.deferred[i]
                self.mem.forget(task.id)
                return
        for slot in self.slots:
            if slot.is_processing and slot.task is task:
                log.info("slot %d: task %d cancelled", slot.id, task.id)
                self._finish(slot, emit_final=False)
                return

    def launch_deferred(self) -> None:
        waiting = len(self.deferred)
        for _ in range(waiting):
            task, emit = self.deferred.popleft()
            if task.parent is not None and self._prefilling(task.parent):
                self.deferred.append((task, emit))  # n_cmpl child: wait for the parent's prompt
                continue
            if self.mem.must_wait(task):
                self.deferred.append((task, emit))
                continue
            held, update_cache = self.mem.choose_slot(task)
            slot = self.slots[held.id] if held is not None else None
            if slot is None or slot.is_processing:
                self.deferred.append((task, emit))
                continue
            self.mem.before_launch(slot)
            try:
                self._launch(slot, task, emit, update_cache)
            except TaskError as e:
                self.mem.forget(task.id)
                emit(e)
                continue
            self.mem.after_launch()
        self.metrics.requests_deferred = len(self.deferred)
        self.metrics.requests_processing = sum(s.is_processing for s in self.slots)
        self._count_checkpoints()

    def _count_checkpoints(self) -> None:
        m = self.metrics
        m.checkpoints, m.checkpoint_bytes = self.mem.checkpoints()
        m.checkpoints_dropped_total += self.mem.take_checkpoints_dropped()

    def poll_io(self) -> None:
        """Take finished disk reads into the radix tree and let their tasks go on (the engine
        calls this on every turn of its loop; the disk tier wakes it when a read ends)."""
        if self.mem.poll_io():
            self.launch_deferred()

    def _launch(self, slot: Slot, task: CompletionTask, emit: Emit, update_cache: bool) -> None:
        try:
            # ignore_eos: -inf biases on the EOG tokens, appended to logit_bias as llama-server
            constraint = None if task.grammar is None else Constraint(task.grammar, self.tok)
            sampler = Sampler(task.params, self.tok.n_vocab, task.prompt_tokens,
                              banned=sorted(self.tok.eog_ids) if task.ignore_eos else (),
                              constraint=constraint)
        except ValueError as e:
            raise TaskError(400, "invalid_request_error", f"Failed to initialize samplers: {e}")
        plan, why = self.mem.admit(slot, task, update_cache=update_cache,
                                   n_cache_reuse=task.n_cache_reuse,
                                   prefer=self._holder(task.parent),
                                   slot_only=bool(task.pooling))  # embeddings: no host tiers
        if plan.checkpoint is not None:
            self.metrics.checkpoints_restored_total += 1
        slot.start(task, sampler, emit, plan.todo, plan.n_reused, why)
        slot.report_progress()  # what the caches served: llama-server's first, at 0 computed
        if self.spec is not None:
            slot.speculative = bool(self.spec.spec_of(slot).types)
            self.spec.begin(slot)
        log.info("slot %d: task %d, prompt %d tokens, %d reused; %s", slot.id, task.id,
                 len(task.prompt_tokens), plan.n_reused, describe(why))

    def _prefilling(self, parent: CompletionTask) -> bool:
        """The parent of an n_cmpl > 1 child is still waiting or computing its prompt."""
        if any(t is parent for t, _ in self.deferred):
            return True
        return any(s.state is SlotState.PROCESSING_PROMPT and s.task is parent
                   for s in self.slots)

    def _holder(self, parent: CompletionTask | None) -> Slot | None:
        """The slot that ran (or runs) `parent`: a child takes its prompt cells from there."""
        if parent is None:
            return None
        for s in self.slots:
            if (s.task if s.is_processing else s.last_task) is parent:
                return s
        return None

    def _context_shift(self, s: Slot) -> bool:
        """llama-server's context shift (server-context.cpp pre_decode): the generating slot's
        context is full; keep n_keep tokens (-1: the prompt; +1 for BOS; at most n_ctx - 4),
        discard n_discard after them (0: half of the rest) and move the rest left. False when
        the task failed instead."""
        task = s.task
        if not self.cfg.context_shift:  # unreachable: accept() stops the task first
            self._fail(s, TaskError(500, "server_error", "context shift is disabled"))
            return False
        if task.n_cmpl > 1:
            self._fail(s, TaskError(500, "server_error",
                                    "context shift cannot be used for shared prompt"))
            return False
        n_keep = len(task.prompt_tokens) if task.n_keep < 0 else task.n_keep
        if self.tok.add_bos:
            n_keep += 1
        n_keep = min(s.n_ctx - 4, n_keep)
        n_left = len(s.kv) - n_keep
        n_discard = task.n_discard or int(n_left / 2)
        n_discard = min(max(n_discard, 0), max(0, n_left - 1))
        log.warning("slot %d: context shift, n_keep = %d, n_left = %d, n_discard = %d",
                    s.id, n_keep, n_left, n_discard)
        self.mem.offer_before_drop(s)  # the shifted KV is never reused: keep it first
        if not s.kv.shift(n_keep, n_discard):
            self._fail(s, TaskError(500, "server_error", "Context size has been exceeded."))
            return False
        s.truncated = True
        return True

    # -- the loop: schedule -> run -> postprocess ---------------------------------------------
    def has_active(self) -> bool:
        return any(s.is_processing for s in self.slots)

    @torch.inference_mode()
    def step(self) -> None:
        """Run one batch. A failure of the forward or of sampling fails the requests of this
        batch (their KV may be half-written, so it is dropped) and nothing else: the server and
        the other slots carry on. Tasks waiting (on another slot's prefill, for a busy slot, or
        for room) are tried again after every step."""
        self.poll_io()
        try:
            self._run_batch()
        finally:
            if self.deferred:
                self.launch_deferred()

    def _run_batch(self) -> None:
        try:
            batch = self._schedule()
        except Exception as e:  # noqa: BLE001 - a broken invariant: fail what runs, keep serving
            self._fail_batch([s for s in self.slots if s.is_processing], e)
            return
        if not batch:
            return
        try:
            hidden = run(self.model.transformer, self.pool, [b for _, b in batch])
            if self.spec is not None:  # the draft model reads what the target read
                self.spec.follow([(s.kv, b) for s, b in batch])
        except Exception as e:  # noqa: BLE001 - any compute failure fails this batch only
            self._fail_batch([s for s, _ in batch], e)
            return
        self.metrics.on_decode(len(batch))
        try:
            self._postprocess(batch, hidden)
        except Exception as e:  # noqa: BLE001 - likewise for sampling
            self._fail_batch([s for s, _ in batch if s.is_processing], e)

    def _fail_batch(self, owners: list[Slot], e: Exception) -> None:
        log.exception("batch failed")
        for s in owners:
            self._fail(s, TaskError(500, "server_error", f"Compute error: {e}"))

    def _reserve(self, s: Slot, pos0: int, n: int = 0) -> SeqStep | None:
        """The forward's view of `s` once the memory gave it cells for its tokens at pos0..:
        n tokens of its prompt, or (generating, at len(s.kv)) the tokens a rollback left to
        compute again (`s.kv.redo`: engine/speculative.py), the pending token and its draft;
        None when it has no room."""
        generating = s.state is SlotState.GENERATING
        tokens = ([*s.kv.redo, s.pending, *s.draft] if generating
                  else s.prompt[pos0 : pos0 + n])
        cells = self.mem.reserve(s, pos0, len(tokens), generating)
        if cells is None:
            return None
        return seq_step(self.pool, s.kv.seq, tokens, pos0, cells)  # type: ignore[arg-type]

    def _schedule(self) -> list[tuple[Slot, SeqStep]]:
        """One decode token per generating slot (and its draft, speculative decoding), then
        prompt chunks while the budget and the free cells last. A generating slot that cannot
        get a cell fails (its context cannot grow); a prefilling one waits while others run,
        and fails only when nothing can."""
        batch: list[tuple[Slot, SeqStep]] = []
        gen = []
        for s in self.slots:
            if s.state is SlotState.GENERATING and s.pending is not None:
                if s.n_past + 1 >= s.n_ctx and not self._context_shift(s):
                    continue
                gen.append(s)
        n_fed = sum(1 + len(s.kv.redo) for s in gen)  # pending tokens, and any fed again
        drafts = self.spec.drafts(gen, self.n_budget - n_fed) if self.spec and gen else {}
        for s in gen:
            s.draft = drafts.get(s.id, [])
            if self.pool.seq_pos_max(s.kv.seq) > len(s.kv) + len(s.draft):
                s.kv.truncate(len(s.kv))  # cells drafted into for a draft then dropped (n_min)
            step = self._reserve(s, len(s.kv))
            if step is None and s.draft:  # no room to verify the draft: plain decoding
                s.kv.truncate(len(s.kv))  # (a slot with tokens to feed again has no draft)
                s.draft = []
                step = self._reserve(s, len(s.kv))
            if step is None:
                self._fail(s, TaskError(500, "server_error", "Context size has been exceeded."))
                continue
            step.n_logits = 1 + len(s.draft)  # no logits for tokens fed again
            batch.append((s, step))
        used, starved = sum(len(b.tokens) for _, b in batch), []
        for s in self.slots:
            room = self.n_budget - used
            if s.state is not SlotState.PROCESSING_PROMPT or room <= 0:
                continue
            p0, p1 = s.todo[0]
            if s.kv.n_free() == 0 and not batch:  # nothing else can run: clearing alone helps
                self.mem.make_room()
            take = min(p1 - p0, room, s.kv.n_free())
            if take > 0 and s.kv.n_checkpoints:
                take, made = self.mem.checkpoint_chunk(s, p0, take, s.task.user_starts,
                                                       s.task.id)
                self.metrics.checkpoints_created_total += made
                self._count_checkpoints()
            step = self._reserve(s, p0, take) if take > 0 else None
            if step is None:
                starved.append(s)
                continue
            step.n_logits = s.rows_wanted(p0, take)
            batch.append((s, step))
            used += take
        if not batch and starved:  # nothing can run: fail one prompt, its cells go to the rest
            self._fail(starved[0], TaskError(500, "server_error",
                                             "Context size has been exceeded."))
            return self._schedule()
        return batch

    def _postprocess(self, batch: list[tuple[Slot, SeqStep]], hidden: torch.Tensor) -> None:
        now = time.perf_counter()
        rows: list[int] = []
        to_sample: list[Slot] = []
        pos0: list[int] = []  # each sampled slot's step's first position
        row = -1
        first: list[int] = []  # each sampled slot's first row in `rows`
        for s, b in batch:
            row += b.n_logits
            if s.state is SlotState.GENERATING:  # the draft's tokens wait for verification
                s.kv.commit(b.pos0, b.tokens[: len(b.tokens) - len(s.draft)])
                first.append(len(rows))
                rows.extend(range(row - b.n_logits + 1, row + 1))
                to_sample.append(s)
                pos0.append(b.pos0)
                continue
            s.kv.commit(b.pos0, b.tokens)
            self.mem.slide(s, s.task.cache_prompt)
            if s.state is SlotState.PROCESSING_PROMPT:
                if s.task.pooling:  # an embedding keeps its chunk's rows
                    s.keep_rows(hidden[row - b.n_logits + 1 : row + 1])
                s.n_prompt_processed += len(b.tokens)
                s.report_progress()
                p0, p1 = s.todo[0]
                s.todo[0] = (p0 + len(b.tokens), p1)
                if s.todo[0][0] == p1:
                    s.todo.pop(0)
                if s.todo:
                    continue
                s.state, s.t_first = SlotState.GENERATING, now
                self.metrics.on_prompt_done(s.n_prompt_processed, s.n_cached, now - s.t_start)
                if s.task.pooling:  # an embedding: its rows pooled are the result
                    s.pool_rows()
                    self._finish(s)
                    continue
                if s.task.n_predict == 0:  # prompt only: nothing to sample
                    s.stop_type = "limit"
                    self._finish(s)
                    continue
            first.append(len(rows))
            rows.append(row)
            to_sample.append(s)
            pos0.append(b.pos0)
        if not to_sample:
            return
        if len(rows) < hidden.shape[0]:
            hidden = hidden[rows]
        needs = [s.sampler.head_need() for s in to_sample]
        ends = first[1:] + [len(rows)]
        logits = self.model.transformer.logits(
            hidden, [nd for nd, a, b in zip(needs, first, ends) for _ in range(b - a)])
        # the rows stay raw (n_probs reports them); ignore_eos bans are biases in the chain;
        # every slot's first row in one call (one batched argmax for the greedy ones)
        heads = logits if len(first) == logits.shape[0] else logits[first]  # no copy unless drafts
        tokens = sample_batch([s.sampler for s in to_sample], heads)
        for s, i, t, p0 in zip(to_sample, first, tokens, pos0):
            done = s.accept(t, logits[i], self.tok)
            if s.state is SlotState.GENERATING:
                if s.draft:
                    assert self.spec is not None
                    done = self.spec.verify(s, t, done, logits[i + 1 : i + 1 + len(s.draft)],
                                            self.tok, self.metrics, p0)
                self.mem.slide(s, s.task.cache_prompt)
            if done:
                self._finish(s)

    def _finish(self, s: Slot, emit_final: bool = True) -> None:
        now = time.perf_counter()
        if emit_final:
            part = s.partial(final=True) if s.task.stream else None
            if part is not None:
                s.send(part)
            s.send(s.final(now))
        if s.generated:
            self.metrics.on_prediction_done(len(s.generated), now - (s.t_first or now))
        self.metrics.observe_n_tokens(len(s.tokens))
        log.info("slot %d: stop processing, n_tokens = %d, truncated = %s",
                 s.id, len(s.tokens), s.truncated)
        self.mem.release(s, s.task, answered=emit_final)
        s.release()
        self.launch_deferred()

    def _fail(self, s: Slot, err: TaskError) -> None:
        """Fail one request and drop its KV (it may be half-written); others carry on."""
        s.send(err)
        self.mem.drop(s)
        s.release()

    def check(self) -> None:
        """Every invariant the engine keeps (tests call this after every step)."""
        self.mem.check()
