"""The update loop of llama-server in one class: slot choice, pre-decode, continuous batching.

Runs on the engine thread only. Each `step()` builds one batch holding a decode token for every
generating slot plus prompt chunks of prefilling slots (up to the batch budget), runs one forward,
samples, and streams results out through each task's `emit` callback.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from radixserve.cache.base import PromptCache
from radixserve.config import ServerConfig
from radixserve.kv.pool import KVPool, OutOfCells
from radixserve.model.forward import BatchSeq
from radixserve.model.loader import Model
from radixserve.model.sampling import Sampler, sample_batch
from radixserve.http.prometheus import ServerMetrics
from radixserve.engine.host_tier import HostTier
from radixserve.engine.predecode import pre_decode
from radixserve.engine.prefix_plan import share_prefix, waits_for_prefill
from radixserve.engine.slot import Slot, SlotState
from radixserve.engine.slot_choice import choose_slot
from radixserve.engine.task import CompletionTask, TaskError, TokenProbs

log = logging.getLogger(__name__)
Emit = Callable[[Any], None]


def slot_layout(cfg: ServerConfig, n_ctx_train: int) -> tuple[int, int, bool, int]:
    """(n_slots, pool cells, unified, n_ctx per slot) as llama-server derives them."""
    n_slots = cfg.n_parallel if cfg.n_parallel > 0 else 4
    unified = cfg.kv_unified or cfg.n_parallel <= 0  # -np auto: 4 slots, unified KV
    n_ctx = cfg.ctx_size or n_ctx_train
    if unified:
        n_slot = n_ctx
        if cfg.kv_unified_per_slot > 0:
            n_slot = min(n_slot, cfg.kv_unified_per_slot)
    else:
        n_slot = n_ctx // n_slots
        n_ctx = n_slot * n_slots
    if n_slot > n_ctx_train:
        log.warning("the slot context (%d) exceeds the training context (%d) - capping",
                    n_slot, n_ctx_train)
        n_slot = n_ctx_train
    return n_slots, n_ctx, unified, n_slot


class Scheduler:
    def __init__(self, model: Model, cfg: ServerConfig, metrics: ServerMetrics) -> None:
        self.model, self.cfg, self.metrics = model, cfg, metrics
        self.tok = model.tokenizer
        hp = model.hp
        n_slots, n_cells, unified, self.n_ctx_slot = slot_layout(cfg, hp.n_ctx_train)
        self.pool = KVPool(hp.n_layer, hp.n_head_kv, hp.head_dim, n_cells, n_slots, unified,
                           model.dtype, model.rope.rotate, model.device)
        self.slots = [Slot(i, self.n_ctx_slot) for i in range(n_slots)]
        self.deferred: deque[tuple[CompletionTask, Emit]] = deque()
        self.n_budget = max(1, min(cfg.batch_size, cfg.ubatch_size))
        self._next_id = 0
        self.host = HostTier(cfg, self.pool, hp.arch)
        log.info("initializing, n_slots = %d, n_ctx_slot = %d, kv_unified = %s",
                 n_slots, self.n_ctx_slot, unified)

    # -- tasks in ---------------------------------------------------------------------------
    def submit(self, task: CompletionTask, emit: Emit) -> None:
        task.id, self._next_id = self._next_id, self._next_id + 1
        try:
            self._validate(task)
        except TaskError as e:
            emit(e)
            return
        self.deferred.append((task, emit))
        self.launch_deferred()

    def _validate(self, task: CompletionTask) -> None:
        n = len(task.prompt_tokens)
        if n == 0:
            raise TaskError(400, "invalid_request_error", '"prompt" must not be empty')
        if n >= self.n_ctx_slot:
            raise TaskError(
                400, "exceed_context_size_error",
                f"request ({n} tokens) exceeds the available context size "
                f"({self.n_ctx_slot} tokens), try increasing it",
                n_prompt_tokens=n, n_ctx=self.n_ctx_slot,
            )
        if any(not 0 <= t < self.tok.n_vocab for t in task.prompt_tokens):
            raise TaskError(400, "invalid_request_error", "Prompt contains invalid tokens")
        if task.id_slot != -1 and not 0 <= task.id_slot < len(self.slots):
            raise TaskError(400, "invalid_request_error",
                            f"id_slot {task.id_slot} is out of range [0, {len(self.slots)})")

    def cancel(self, task_id: int) -> None:
        for i, (task, _) in enumerate(self.deferred):
            if task.id == task_id:
                del self.deferred[i]
                return
        for slot in self.slots:
            if slot.task is not None and slot.job.id == task_id:
                log.info("slot %d: task %d cancelled", slot.id, task_id)
                self._finish(slot, emit_final=False)
                return

    def launch_deferred(self) -> None:
        waiting = len(self.deferred)
        for _ in range(waiting):
            task, emit = self.deferred.popleft()
            if waits_for_prefill(self.slots, task):
                self.deferred.append((task, emit))
                continue
            slot, update_cache = self.get_available_slot(task)
            if slot is None or slot.is_processing:
                self.deferred.append((task, emit))
                continue
            # radix: publish the other idle slots first, so this prompt can restore from them
            early = self.host.cache.load_always
            if early:
                self.host.publish_idle(self.slots, exclude=slot)
            try:
                self._launch(slot, task, emit, update_cache)
            except TaskError as e:
                emit(e)
                continue
            if not early:
                self.host.publish_idle(self.slots)
        self.metrics.requests_deferred = len(self.deferred)
        self.metrics.requests_processing = sum(s.is_processing for s in self.slots)

    def get_available_slot(self, task: CompletionTask) -> tuple[Slot | None, bool]:
        return choose_slot(self.slots, task, self.cfg.slot_prompt_similarity)

    def _launch(self, slot: Slot, task: CompletionTask, emit: Emit, update_cache: bool) -> None:
        try:
            sampler = Sampler(task.params, self.tok.n_vocab, task.prompt_tokens)
        except ValueError as e:
            raise TaskError(400, "invalid_request_error", f"Failed to initialize samplers: {e}")
        if self.pool.unified:  # room for the whole prompt, so a cached prefix can be restored
            while (self.pool.n_free + len(slot.tokens) < len(task.prompt_tokens)
                   and self.try_clear_idle_slots(exclude=slot)):
                pass
        self.host.exchange(slot, task.prompt_tokens, update_cache)
        if task.cache_prompt:
            share_prefix(self.pool, self.slots, slot, task.prompt_tokens)
        slot.start(task, sampler, emit)
        self._pre_decode(slot)
        log.info("slot %d: task %d, prompt %d tokens, n_past %d", slot.id, task.id,
                 len(task.prompt_tokens), slot.n_past)

    def _pre_decode(self, slot: Slot) -> None:
        task = slot.job
        n_reuse = self.cfg.cache_reuse if task.n_cache_reuse is None else task.n_cache_reuse
        plan = pre_decode(self.pool, slot.id, slot.tokens, slot.prompt, task.cache_prompt, n_reuse)
        slot.n_past, slot.todo = plan.n_reused, plan.todo

    # -- the loop -------------------------------------------------------------------------
    def has_active(self) -> bool:
        return any(s.is_processing for s in self.slots)

    @torch.inference_mode()
    def step(self) -> None:
        """Build and run one batch; on out-of-cells free idle slots or shrink, then retry.

        Any other failure fails the requests of this batch (their KV may be half-written, so it
        is dropped) and nothing else: the server and the other slots carry on.
        """
        budget = self.n_budget
        while True:
            batch, owners = self._build_batch(budget)
            if not batch:
                return
            try:
                hidden = self.model.transformer.hidden(self.pool, batch)
                break
            except OutOfCells:
                if self.try_clear_idle_slots():
                    continue
                n_prompt = sum(len(b.tokens) for b, s in zip(batch, owners)
                               if s.state is SlotState.PROCESSING_PROMPT)
                if n_prompt > 0 and budget > 1:
                    budget = max(1, budget // 2)
                    log.warning("no free KV cells, retrying with batch budget %d", budget)
                    continue
                for s in owners:
                    self._fail(s, TaskError(500, "server_error", "Context size has been exceeded."))
                return
            except Exception as e:
                self._fail_batch(owners, e)
                return
        self.metrics.on_decode(len(owners))
        try:
            self._after_forward(batch, owners, hidden)
        except Exception as e:
            self._fail_batch([s for s in owners if s.is_processing], e)
        if self.deferred:  # tasks waiting on another slot's prefill may go now
            self.launch_deferred()

    def _fail_batch(self, owners: list[Slot], e: Exception) -> None:
        log.exception("batch failed")
        for s in owners:
            self._fail(s, TaskError(500, "server_error", f"Compute error: {e}"))

    def _build_batch(self, budget: int) -> tuple[list[BatchSeq], list[Slot]]:
        batch: list[BatchSeq] = []
        owners: list[Slot] = []
        for s in self.slots:
            if s.state is SlotState.GENERATING and s.pending is not None:
                batch.append(BatchSeq(s.id, [s.pending], len(s.tokens)))
                owners.append(s)
        used = len(batch)
        for s in self.slots:
            if s.state is not SlotState.PROCESSING_PROMPT:
                continue
            p0, p1 = s.todo[0]
            take = min(p1 - p0, max(0, budget - used))
            if take <= 0:
                break
            last = p0 + take == len(s.prompt)
            batch.append(BatchSeq(s.id, s.prompt[p0 : p0 + take], p0, 1 if last else 0))
            owners.append(s)
            used += take
        return batch, owners

    def _after_forward(self, batch: list[BatchSeq], owners: list[Slot],
                       hidden: torch.Tensor) -> None:
        now = time.perf_counter()
        rows: list[int] = []
        to_sample: list[Slot] = []
        row = -1
        for b, s in zip(batch, owners):
            row += 1 if b.n_logits else 0
            if s.state is SlotState.GENERATING:
                s.tokens.extend(b.tokens)
            else:
                s.n_prompt_processed += len(b.tokens)
                p0, p1 = s.todo[0]
                s.todo[0] = (p0 + len(b.tokens), p1)
                if s.todo[0][0] == p1:
                    s.todo.pop(0)
                # tokens = the contiguous prefix with KV; holes later on are still to compute
                s.tokens = s.prompt[: s.todo[0][0]] if s.todo else list(s.prompt)
                if s.todo:
                    continue
                s.state, s.t_first = SlotState.GENERATING, now
                self.metrics.on_prompt_done(s.n_prompt_processed, s.n_past, now - s.t_start)
                if s.job.n_predict == 0:  # prompt only: nothing to sample
                    s.stop_type = "limit"
                    self._finish(s)
                    continue
            rows.append(row)
            to_sample.append(s)
        if not to_sample:
            return
        if len(rows) < hidden.shape[0]:
            hidden = hidden[rows]
        eog = list(self.tok.eog_ids)
        bans = [eog if s.job.ignore_eos else [] for s in to_sample]
        logits = self.model.transformer.w.head.logits(
            hidden, [s.smp.head_need(ban) for s, ban in zip(to_sample, bans)])
        for i, ban in enumerate(bans):
            if ban:
                logits[i, ban] = -math.inf
        tokens = sample_batch([s.smp for s in to_sample], logits)
        for i, (s, t) in enumerate(zip(to_sample, tokens)):
            if s.job.n_probs > 0:
                s.probs.append(self._probs(s, logits[i], t))
            s.smp.accept(t)
            self._process_token(s, t)

    def _probs(self, s: Slot, logits: torch.Tensor, t: int) -> TokenProbs:
        top = s.smp.top_probs(logits, s.job.n_probs)
        p = dict(top).get(t, 0.0)
        piece = self.tok.token_to_piece(t, special=False)
        return TokenProbs(t, piece.decode("utf-8", "replace"), list(piece), p,
                          [(i, self.tok.token_to_piece(i, special=False).decode("utf-8", "replace"), q)
                           for i, q in top])

    def _process_token(self, s: Slot, t: int) -> None:
        task = s.job
        s.generated.append(t)
        stop = False
        if self.tok.is_eog(t) and not task.ignore_eos:
            s.stop_type, stop = "eos", True
        else:
            stop = s.add_text(self.tok.token_to_piece(t, special=False))
        if not stop and 0 <= task.n_predict <= len(s.generated):
            s.stop_type, stop = "limit", True
        if not stop and len(s.tokens) + 1 >= s.n_ctx:
            s.stop_type, s.truncated, stop = "limit", True, True
        if stop:
            self._finish(s)
            return
        s.pending = t
        part = s.partial() if task.stream else None
        if part is not None:
            s.send(part)

    def _finish(self, s: Slot, emit_final: bool = True) -> None:
        now = time.perf_counter()
        self.pool.seq_rm(s.id, len(s.tokens))  # cancelled mid-prompt: drop KV past the prefix
        if emit_final:
            part = s.partial(final=True) if s.job.stream else None
            if part is not None:
                s.send(part)
            s.send(s.final(now))
        if s.generated:
            self.metrics.on_prediction_done(len(s.generated), now - (s.t_first or now))
        self.metrics.observe_n_tokens(len(s.tokens))
        log.info("slot %d: stop processing, n_tokens = %d, truncated = %s",
                 s.id, len(s.tokens), s.truncated)
        s.release()
        self.launch_deferred()

    def _fail(self, s: Slot, err: TaskError) -> None:
        """Fail one request and drop its KV (it may be half-written); others carry on."""
        s.send(err)
        self.pool.seq_rm(s.id)
        s.tokens = []
        s.release()

    def try_clear_idle_slots(self, exclude: Slot | None = None) -> bool:
        """Unified KV only: free the first idle slot holding cells (llama-server's rule).

        Unlike llama-server, the slot's KV goes to the host cache first (when there is one), so
        freeing cells for an active slot loses nothing a later request could reuse.
        """
        if not self.pool.unified:
            return False
        for s in self.slots:
            if not s.is_processing and s.tokens and s is not exclude:
                log.warning("purging slot %d with %d tokens", s.id, len(s.tokens))
                if self.host.cache.save(self.pool, s.id, s.tokens):
                    self.host.cache.update()
                self.pool.seq_rm(s.id)
                s.tokens = []
                return True
        return False

    @property
    def cache(self) -> PromptCache:
        return self.host.cache

    def slots_json(self) -> list[dict[str, Any]]:
        return [s.to_json() for s in self.slots]
