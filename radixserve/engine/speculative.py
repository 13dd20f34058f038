"""Speculative decoding: cheap drafts, checked by the target in the forward it runs anyway.

Each step, a generating slot may propose tokens that likely follow its pending one: from a draft
model (`draft-simple`) or from its own text (`ngram-simple`, `ngram-mod`: engine/ngram.py). The
scheduler then feeds the target [pending, d1 .. dk] at once (k + 1 positions; every slot of the
batch in the same forward) and samples each row in turn with the task's own sampler chain: row i
is the target's token after d1 .. di, and d(i+1) is kept only if it equals that token
(llama.cpp's rule, common_sampler_sample_and_accept_n). So every emitted token is the one the
target samples at its position - the same sampler, the same random draws, and (deterministic
mode) the same logits as without speculation: the output is identical, greedy or seeded, and
the drafts only decide how many tokens one forward yields. Rejected positions leave the KV.

Rollback on recurrent layouts (Qwen3.5's Gated DeltaNet, Granite 4.0-H's Mamba2: the layout's
`rollback_recomputes`): a state exists only where a step ended, so after a partly rejected
draft there is no state after the kept tokens to cut back to (the verify step wrote only the
one after its last fed position); it is recomputed from the last state kept. The step's state
cell at pos0 - 1 (the one it read) stays alive until verification (the window is pruned only
after it: `MemoryManager.slide`). Every draft accepted: the step's own state is the
sequence's, and the old one is pruned as usual. Any rejected: every position from pos0 on goes
(the old pending token and the accepted drafts: `SlotKV.rollback`), the cell at pos0 - 1 is again the sequence's last state, and those tokens
wait in `kv.redo`; the slot's next step feeds them again, at their positions, before its new
pending token (with no draft: `n_draft_max`), their logits unused, so their K/V rows and the
state are recomputed bit for bit (deterministic mode: a token's bits do not depend on the step
it is in) and the answer is the one without speculation. They are no new tokens: the slot's
text, `generated` and every counter stay as they are (timings.predicted_n counts each generated token once, prompt_n only prompt tokens,
draft_n / draft_n_accepted the drafts as verified); only the forward is longer. A task that
ends right after a rollback keeps the KV of the tokens before pos0 (n_tokens_cached and /slots'
n_prompt_tokens count those). Every truncation or reset of the slot's KV (task end, cancel,
failure, slot erase / restore, a new task) empties `redo`.

draft-simple is refused on such a target: the draft model's KV rides in the target's cells
and drafts from len(kv) on, and a recurrent draft would need its own state handling.

With a draft model, its K/V lives in the target's cells (memory/pool/draft.py) and follows
them through every tier; `SlotKV.n_draft` says how many of a slot's tokens have draft rows. The draft runs
every forward the target runs (`follow`, as llama.cpp's draft context processes every batch),
writes the rows of the drafted positions while drafting, and computes whatever a restore did
not bring (`sync`: a slot file whose draft part was dropped) before it drafts or is saved.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from radixserve.config import ServerConfig, SpecConfig
from radixserve.engine.batch import seq_step
from radixserve.engine.counters import ServerMetrics
from radixserve.engine.ngram import NgramMod, ngram_simple_draft
from radixserve.engine.slot import Slot
from radixserve.memory.front import OutOfCells, Pool, attach_draft, resolve_kv_types
from radixserve.memory.seq_kv import SlotKV
from radixserve.model.default_model import resolve_model_path
from radixserve.model.forward import SeqStep
from radixserve.model.loader import Model, load_model
from radixserve.sampling.chain import sample_batch
from radixserve.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)
DRAFT_TOP_K = 10  # llama.cpp's draft sampler: top-k 10, the most likely token proposed


def load_draft(cfg: ServerConfig, target: Model) -> Model | None:
    """The draft model of `-md`, checked against the target (None without draft-simple). The
    target's own file is not loaded twice: the draft then shares its weights (its KV is its
    own)."""
    spec = cfg.spec
    if "draft-simple" not in spec.types or not spec.draft_model:
        return None
    path = resolve_model_path(spec.draft_model)
    draft = target if path == target.path else load_model(
        path, cfg.dtype, device=str(target.device), weights=cfg.weights,
        deterministic=cfg.deterministic,
        kernels=cfg.kernels,
        load_mode=cfg.load_mode)  # -devd / -ngld: the draft runs where the target does
    check_draft(target, draft, path)
    log.info("draft model %s: %d layers, draft up to %d tokens (min %d, p_min %.2f)", path,
             draft.hp.n_layer, spec.n_max, spec.n_min, spec.p_min)
    return draft


def check_draft(target: Model, draft: Model, path: str = "") -> None:
    """ValueError unless `draft` can draft for `target` (draft-simple): its rows live beside
    the target's in the same cells, so neither may keep a sliding window; a recurrent draft
    (its conv rows kept a cell, never rotated) needs a target that refuses context shifts (a
    recurrent one); and it must share the target's vocabulary."""
    for m in (target, draft):
        if m.layout.n_sliding:
            raise ValueError("draft-simple: models with sliding-window layers (as target or "
                             "draft) are not supported; use ngram-simple or ngram-mod")
    if not draft.layout.can_shift and target.layout.can_shift:
        raise ValueError("draft-simple: a draft model with recurrent (short-convolution) "
                         "layers needs a recurrent target: its state cannot follow the "
                         "target's context shift; use ngram-simple or ngram-mod")
    a, b = target.tokenizer, draft.tokenizer
    if a.vocab.tokens != b.vocab.tokens or (a.bos_id, a.eos_id) != (b.bos_id, b.eos_id):
        raise ValueError(f"draft model {path or draft.path}: its vocabulary differs from the "
                         f"target's ({b.n_vocab} vs {a.n_vocab} tokens); draft-simple needs "
                         "the same one")


@dataclass(slots=True)
class _Job:
    """One slot's drafting with the draft model this step."""

    slot: Slot
    n_max: int
    feed: int  # the token to feed next
    pos: int  # at this position
    out: list[int] = field(default_factory=list)  # the draft so far
    last: bool = False  # `feed` is the last draft token: its rows only, no proposal


class Speculator:
    def __init__(self, cfg: SpecConfig, pool: Pool, n_seq: int, n_budget: int,
                 draft: Model | None = None) -> None:
        self.cfg, self.pool, self.n_budget = cfg, pool, n_budget
        self.draft = draft
        # the draft's rows in the target's cells, as its layout needs them
        self.rows = None if draft is None else attach_draft(
            pool, draft.layout, draft.dtype, draft.rope.rotate, draft.hp.arch,
            resolve_kv_types(cfg.cache_type_k, cfg.cache_type_v, draft.dtype))
        self.mod = NgramMod(cfg.ngram_mod_n_match, cfg.ngram_mod_n_min, cfg.ngram_mod_n_max,
                            n_seq) if "ngram-mod" in cfg.types else None

    # -- per task ----------------------------------------------------------------------------
    def spec_of(self, slot: Slot) -> SpecConfig:
        return slot.task.spec if slot.task.spec is not None else self.cfg

    def begin(self, slot: Slot) -> None:
        """A task starts on `slot` (llama.cpp's common_speculative_begin)."""
        if self.mod is not None and "ngram-mod" in self.spec_of(slot).types:
            self.mod.begin(slot.id, slot.prompt)

    def n_draft_max(self, slot: Slot) -> int:
        """llama-server's get_n_draft_max: room left in the context, and in n_predict. None
        while a rollback's tokens wait to be fed again: that step brings the state up to the
        pending token first (drafting on top of it, a rejection would roll back to the same
        position again, and the tokens fed again would grow with every partly rejected
        draft)."""
        if not self.spec_of(slot).types or slot.kv.redo:
            return 0
        n = slot.n_ctx - len(slot.kv) - 2
        n_predict = slot.task.n_predict
        if n_predict >= 0:
            n = min(n, n_predict - len(slot.generated) - 1)
        return max(0, n)

    # -- drafting ----------------------------------------------------------------------------
    def drafts(self, slots: list[Slot], budget: int) -> dict[int, list[int]]:
        """Drafts for generating slots, by slot id (tokens after the pending one), within
        `budget` draft tokens in all. A draft model's jobs reserve the drafted positions'
        cells and write their draft rows; an n-gram draft reserves nothing here."""
        out: dict[int, list[int]] = {}
        jobs: list[_Job] = []
        for s in slots:
            n_max = min(self.n_draft_max(s), budget)
            spec = self.spec_of(s)
            if n_max <= 0:
                continue
            assert s.pending is not None
            for kind in spec.types:
                d: list[int] = []
                if kind == "draft-simple" and self.draft is not None:
                    jobs.append(_Job(s, min(n_max, spec.n_max), s.pending, len(s.kv)))
                    budget -= jobs[-1].n_max
                    break
                if kind == "ngram-simple":
                    d = ngram_simple_draft(s.kv.tokens, s.pending, spec.ngram_simple_size_n,
                                           spec.ngram_simple_size_m)
                elif kind == "ngram-mod" and self.mod is not None:
                    d = self.mod.draft(s.id, s.kv.tokens, s.pending, n_max)
                if d:
                    out[s.id] = d[:n_max]
                    budget -= len(out[s.id])
                    break
        if jobs:
            out.update(self._draft_model(jobs))
        return out

    def verify(self, s: Slot, t: int, done: bool, logits: torch.Tensor, tok: Tokenizer,
               m: ServerMetrics, pos0: int) -> bool:
        """Speculative decoding (`s.draft` not empty): the target sampled `t` after the pending
        token; while it equals the next draft token, that token's KV is kept and the target's
        next row is sampled in turn (llama.cpp's rule). The rest of the draft leaves the KV;
        the caller then lets a sliding window slide. `pos0`: the step's first position; a
        layout that cannot cut a step back (`rollback_recomputes`) rolls back to the state
        before it, whose tokens the next step computes again (the module's docstring)."""
        n_acc = 0
        for d, row in zip(s.draft, logits):
            if done or t != d:
                break
            s.kv.commit(len(s.kv), [d])
            n_acc += 1
            t = sample_batch([s.sampler], row[None])[0]
            done = s.accept(t, row, tok)
        if n_acc < len(s.draft) and self.pool.layout.rollback_recomputes:
            s.kv.rollback(pos0)  # back to the state the step read: the step's tokens go to redo
        else:
            s.kv.truncate(len(s.kv))  # rejected positions (their cells) go
        s.n_drafted += len(s.draft)
        s.n_draft_accepted += n_acc
        m.n_draft_tokens_total += len(s.draft)
        m.n_draft_accepted_total += n_acc
        m.n_drafts_total += 1
        self.accepted(s, n_acc)
        s.draft = []
        return done

    def accepted(self, slot: Slot, n_accepted: int) -> None:
        if self.mod is not None:
            self.mod.accept(slot.id, n_accepted)

    def _draft_model(self, jobs: list[_Job]) -> dict[int, list[int]]:
        """Draft with the draft model, every job in one forward per drafted position. Rows are
        computed for every fed position, the last draft token included (rows only), so after
        verification every kept token has its draft rows."""
        assert self.draft is not None
        for j in jobs:
            self.sync(j.slot.kv)
        active = jobs
        while active:
            fed: list[tuple[_Job, SeqStep]] = []
            for j in active:
                kv = j.slot.kv
                try:
                    cells = kv.reserve(j.pos, 1)
                except OutOfCells:  # no cell to verify this draft token at: it goes
                    if j.pos > len(kv):
                        j.out.pop()
                    continue
                fed.append((j, seq_step(self.pool, kv.seq, [j.feed], j.pos, cells,
                                        0 if j.last else 1)))
            if not fed:
                break
            h = self._hidden([st for _, st in fed])
            row, active = 0, []
            for j, _ in fed:
                j.slot.kv.n_draft = j.pos + 1
                if j.last:
                    continue
                tok, p = self._propose(h[row])
                row += 1
                if p < self.spec_of(j.slot).p_min:
                    continue  # llama.cpp: only confident tokens are drafted
                j.out.append(tok)
                j.feed, j.pos, j.last = tok, j.pos + 1, len(j.out) >= j.n_max
                active.append(j)
        return {j.slot.id: j.out if len(j.out) >= self.spec_of(j.slot).n_min else []
                for j in jobs}

    def _propose(self, h: torch.Tensor) -> tuple[int, float]:
        """The draft's most likely token and its probability among its top DRAFT_TOP_K."""
        assert self.draft is not None
        logits = self.draft.transformer.w.head.full(h[None])[0]
        top = torch.topk(logits, DRAFT_TOP_K)
        p = torch.softmax(top.values.float(), dim=-1)
        return int(top.indices[0]), float(p[0])

    def _hidden(self, steps: list[SeqStep]) -> torch.Tensor:
        """The draft's forward over `steps` (the target's cells and views); a recurrent
        draft's conv layers read their rows in the same cells, so each step's window is its
        own view of the sequence."""
        d = self.rows
        assert self.draft is not None and d is not None
        k, v, conv_k, conv_v = d.caches()
        if conv_k is None:
            return self.draft.transformer.hidden(k, v, steps, types=d.types)
        own = [dataclasses.replace(b, swa=dataclasses.replace(b, swa=None)) for b in steps]
        return self.draft.transformer.hidden(k, v, own, conv_k, conv_v, types=d.types)

    # -- keeping the draft rows in step --------------------------------------------------------
    def follow(self, steps: list[tuple[SlotKV, SeqStep]]) -> None:
        """Run the draft over the target's forward (rows only), for the slots whose draft rows
        reach the step's first position; the others catch up later (`sync`)."""
        if self.draft is None:
            return
        todo = [(kv, dataclasses.replace(b, n_logits=0)) for kv, b in steps
                if kv.n_draft == b.pos0]
        if todo:
            self._hidden([b for _, b in todo])
            for kv, b in todo:
                kv.n_draft = b.pos0 + len(b.tokens)

    def sync(self, kv: SlotKV) -> None:
        """Compute the draft rows of the tokens `kv` holds without them (in forward-sized
        chunks over their cells)."""
        if self.draft is None:
            return
        n = len(kv)
        while kv.n_draft < n:
            p0 = kv.n_draft
            p1 = min(n, p0 + self.n_budget)
            cells = self.pool.cells_at(kv.seq, list(range(p0, p1)))
            view = self.pool.view(kv.seq)  # positions 0 .. n - 1: read those before p1
            c = view.cells
            kv_cells = slice(c.start or 0, (c.start or 0) + p1) if isinstance(c, slice) else c[:p1]
            step = SeqStep(list(kv.tokens[p0:p1]), p0, cells, kv_cells, view.positions[:p1], 0)
            self._hidden([step])
            kv.n_draft = p1
