"""One slot's KV: the only writer of a slot's cells in the pool and of the tokens they hold.

llama.cpp keeps `slot.cache_tokens` next to the sequence's cells and updates both by hand at
every call site; here every change goes through one object (as nano-vllm's BlockManager is the
only writer of a block table), so the rule holds by construction and `check` can prove it:

    the pool holds, for this sequence, exactly positions 0 .. len(tokens) - 1 (their tokens are
    `tokens`) plus the `ahead` chunks: prompt ranges that `--cache-reuse` shifted into place
    past a hole still to compute; nothing else.

Cells reserved for a forward (`reserve`) are the one transient exception: they are committed
(`commit`) when the forward succeeded or dropped with the rest when it failed.

A rollback inside a step (`rollback`: a rejected draft on a layout whose state exists only
after a step's last position, `layout.rollback_recomputes`) drops every position from the
step's first on and keeps their tokens as `redo`: tokens of the sequence at positions
len(tokens).. whose KV is not held, to be fed again, at those positions, by the next forward
(its `commit` takes them back). Every other change (`truncate`, `drop`, a restore, a shift)
empties `redo`: the tokens past what is kept go, these with the rest.

Host-cache restores (`restore_from`): a cache never writes the pool. It hands its rows over
(tiers/base.py's `Restore`: segments of rows in the pool's layout, the tokens they are of, the
checkpoints that came with them) and this object writes them (`write_restore`); when writing
fails part-way (a bad segment, out of cells, an injected fault) the cells written so far go,
the slot is left empty and the cache is told, so it counts a fallback and releases its locks.

Context shift (`shift`, `--context-shift`): when a generating slot's context is full, the tokens
after the first n_keep are partly discarded and the rest moved left with K re-rotated, as
llama-server does. The KV that results is NOT the KV a fresh computation of the new token list
would give (the kept tokens attended to the discarded ones), and the project promises cached ==
uncached, so the rule is: a shifted slot's KV is never reused. `reusable` is False from the
shift on; `save_to` refuses it, `share_from` refuses it as a donor (the prefix planner does not
offer it), and the scheduler drops it when the task ends (so no later request, host-cache save,
idle-slot save or slot file ever sees it). `drop` makes the slot reusable again.

Windowed layouts (the pool's `layout.window` > 0: a sliding window, pool/swa.py; a short
convolution's state rows, pool/conv.py; reached through `pool.windowed`): the window part holds
only a sequence's last positions, so a prefix of the tokens is usable only while the window
still holds the rows its next token reads (`usable_prefix`), else from a context checkpoint
(checkpoint.py) this object keeps with the tokens: taken before prompt chunks (`take_checkpoint`, llama.cpp's create_checkpoint rules),
restored when a new prompt diverges where the window has gone (`keep_prefix`), and carried with
the tokens into the host cache and slot files.

Cache namespaces (a request's `cache_salt`): `salt` names the namespace the KV belongs to, and
every writer keeps it true: `drop` resets it to the shared "", a slot file's rows take the
salt the file carries, a share copies the donor's, a host restore takes the salt it was restored under, and `claim`
stamps the task's once the prefix planner made the slot hold only what that task may reuse. The
planner never reuses KV across salts; `save_to` files it under its own salt.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Sequence

import torch

from radixserve.memory.tiers.base import PromptCache, Restore
from radixserve.memory.tiers.prefix import common_prefix
from radixserve.memory.checkpoint import Checkpoint, seal, unseal
from radixserve.memory.key import PromptKey
from radixserve.memory.pool.pool import KVPool, OutOfCells
from radixserve.memory.pool.state import (Fingerprint, StateError, get_swa_state, parse_swa_state,
                                  set_draft_state, set_swa_state)

MiB = 1024 * 1024

log = logging.getLogger(__name__)


class SlotKV:
    def __init__(self, pool: KVPool, seq: int, fp: Fingerprint | None = None,
                 n_checkpoints: int = 0, checkpoint_min_step: int = 0) -> None:
        """`fp` (the pool's fingerprint) and `n_checkpoints` > 0: take context checkpoints
        (a layout that needs them), at most that many, `checkpoint_min_step` tokens apart."""
        self.pool, self.seq = pool, seq
        self._tokens: list[int] = []
        self._ahead: list[tuple[int, list[int]]] = []  # (pos0, tokens), ascending, past tokens
        self._redo: list[int] = []  # tokens at len(tokens).. rolled back, to feed again
        self.shifted = False  # a context shift ran: the KV must not be reused (docstring)
        self.flushed = False  # an admin flush came while a task ran: never reused either
        # the KV stays out of the host tiers (RAM, disk): an embedding task's, as llama-server
        # keeps embeddings out of its prompt cache (a bulk embedding job would wash out the
        # chat prefixes); the slot itself still serves it. Reset by the next task's claim
        self.slot_only = False
        self.swa = pool.windowed  # the window's operations (None: every position is kept)
        self.fp = fp
        self.n_checkpoints = (n_checkpoints if pool.layout.needs_checkpoints and fp is not None
                              else 0)
        self.checkpoint_min_step = checkpoint_min_step
        self.checkpoints: list[Checkpoint] = []  # oldest first
        self.saved_upto = 0  # tokens a write-through host tier holds (memory/pool/swa.py, radix)
        self.salt = ""  # the cache namespace (`cache_salt`) of the KV held: see the docstring
        # a draft model's rows (pool/draft.py) are computed for positions < n_draft (may run past
        # the tokens while drafting: cells reserved for a verification); `sync_draft` computes
        # the missing ones (engine/speculative.py), set by the scheduler when there is a draft
        self.n_draft = 0
        self.sync_draft: Callable[[SlotKV], None] | None = None

    # -- reading ---------------------------------------------------------------------------
    @property
    def tokens(self) -> Sequence[int]:
        """Tokens whose KV the pool holds at positions 0.. (read-only: change them here)."""
        return self._tokens

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def redo(self) -> Sequence[int]:
        """Tokens at positions len(tokens).. whose KV a rollback dropped (`rollback`): the
        next forward feeds them again before anything new (read-only)."""
        return self._redo

    @property
    def n_held(self) -> int:
        """Tokens held: the contiguous prefix plus the chunks placed ahead of it."""
        return len(self._tokens) + sum(len(t) for _, t in self._ahead)

    @property
    def reusable(self) -> bool:
        """Whether another request, tier or file may take this KV as that of its tokens."""
        return not (self.shifted or self.flushed)

    def n_free(self) -> int:
        """Cells this sequence could still get from the pool."""
        return self.pool.n_free_for(self.seq)

    def save_to(self, cache: PromptCache) -> bool:
        """Copy the contiguous prefix into the host cache (the pool is only read; a draft
        model's missing rows are computed first, so the entry carries both parts whole)."""
        if not self.reusable or not self._tokens or self.slot_only:
            return False
        self.complete_draft()
        if not cache.save(self.pool, self.seq, self.key, self.checkpoints):
            return False
        self.saved_upto = len(self._tokens)
        return True

    @property
    def key(self) -> PromptKey:
        """The contiguous prefix held, under the namespace it belongs to (a copy of the
        tokens: the key stays what it was when this KV changes)."""
        return PromptKey(self.salt, list(self._tokens))

    def complete_draft(self) -> None:
        """Make the draft rows cover every token held (no-op without a draft model)."""
        if self.sync_draft is not None and self.n_draft < len(self._tokens):
            self.sync_draft(self)

    # -- replacing the content ---------------------------------------------------------------
    def claim(self, key: PromptKey) -> None:
        """The KV now serves the prompt `key`: what the slot still holds must be of its
        namespace already (the prefix planner empties a slot of another namespace's KV), so
        later saves, shares and plans see the KV under the namespace of the task extending it."""
        assert not self.n_held or self.salt == key.ns, \
            f"slot {self.seq}: KV of another cache_salt kept for a task"
        self.salt = key.ns
        self.slot_only = False

    def drop(self) -> None:
        self.pool.seq_rm(self.seq)
        self._tokens, self._ahead, self._redo = [], [], []
        self.salt = ""
        self.shifted = self.flushed = False
        self.checkpoints = []
        self.saved_upto = 0
        self.n_draft = 0

    def truncate(self, n: int) -> None:
        """Keep the first `n` tokens; everything past them (chunks ahead and `redo`
        included) goes."""
        self.pool.seq_rm(self.seq, n)
        del self._tokens[n:]
        self._ahead = []
        self._forget_past(n)

    def rollback(self, n: int) -> None:
        """Keep the first `n` tokens and their KV; the tokens after them become `redo` (their
        cells go), to be computed again by the next forward. For a layout whose state exists
        only after a step's last position: a step's KV cut back to the state it read."""
        redo = list(self._tokens[n:])
        assert not self._ahead, f"slot {self.seq}: rollback with chunks ahead"
        self.truncate(n)
        assert n == 0 or self.swa is None or n - 1 in self.swa.swa.seq_positions(self.seq), \
            f"slot {self.seq}: no state at position {n - 1} to roll back to"
        self._redo = redo

    def _forget_past(self, n: int) -> None:
        """Only the first n tokens are what they were: checkpoints, write-through marks, draft
        rows and tokens to compute again past them describe other tokens now."""
        self._redo = []
        self.saved_upto = min(self.saved_upto, n)
        self.n_draft = min(self.n_draft, n)
        for c in self.checkpoints:
            if c.n_tokens > n:
                log.debug("slot %d: erased invalidated context checkpoint (pos_min = %d, "
                          "pos_max = %d, n_tokens = %d)", self.seq, c.pos_min, c.pos_max,
                          c.n_tokens)
        self.checkpoints = [c for c in self.checkpoints if c.n_tokens <= n]

    # -- sliding window: which prefix is usable, checkpoints -------------------------------------
    def _window_holds(self, pos_min: int, n: int) -> bool:
        """Sliding KV starting at `pos_min` has every key the token at position n reads (a
        recurrent state kept whole: it is the state at n - 1 exactly)."""
        if self.pool.layout.n_recurrent:
            return pos_min == n - 1
        return 0 <= pos_min <= max(0, n - self.pool.layout.window + 1)

    def usable_prefix(self, n: int) -> tuple[int, Checkpoint | None]:
        """How much of the first `n` tokens can be kept as KV for a prompt that continues with
        a token at position n, and the checkpoint that must be restored for it (None: the slot
        as it stands). Full attention: all of it. Sliding window: all of it while the window
        still holds the keys that token reads; else the longest prefix a checkpoint restores
        (the newest of equals); else none. llama.cpp's test is stricter by a token or two
        (pos_min < n - n_swa): this one is exact, its reuse equal to recomputation."""
        if self.swa is None or n == 0:
            return n, None
        pm = self.swa.swa_pos_min(self.seq)
        if n <= len(self._tokens) and self._window_holds(pm, n):
            return n, None
        best, m_best = None, 0
        for ck in self.checkpoints:
            m = min(n, ck.n_tokens)
            if m >= m_best and ck.pos_max >= m - 1 and self._window_holds(ck.pos_min, m):
                best, m_best = ck, m
        return m_best, best

    def offered(self, key: PromptKey) -> list[int]:
        """The tokens this slot offers a host cache as its own for the prompt `key`: all of
        them, but with a sliding window only the prefix it can reuse (a cache
        must not decline to restore what the window has dropped); none for another salt (that
        KV will not be kept, so it must not make the cache decline either)."""
        if key.ns != self.salt:
            return []
        prompt = key.tokens
        if self.swa is None:
            return list(self._tokens)
        want = min(common_prefix(self._tokens, prompt), len(prompt) - 1)
        n = self.usable_prefix(want)[0]
        return list(self._tokens) if n == want else list(self._tokens[:n])

    def keep_prefix(self, n: int, ck: Checkpoint | None) -> bool:
        """Keep the first `n` tokens, restoring `ck`'s sliding KV first when given (`n` and
        `ck` from `usable_prefix`); checkpoints past what is kept go, as llama.cpp erases those
        with pos_max > pos_next. False, with the slot emptied, when the checkpoint fails to
        load."""
        if ck is not None:
            assert self.swa is not None and self.fp is not None
            try:
                set_swa_state(self.swa, self.seq, unseal(ck.target), self.fp)
            except (ValueError, OutOfCells) as e:
                log.warning("slot %d: context checkpoint failed to load (%s)", self.seq, e)
                self.drop()
                return False
            log.info("slot %d: restored context checkpoint (pos_min = %d, pos_max = %d, "
                     "n_tokens = %d, n_past = %d, size = %.3f MiB)", self.seq, ck.pos_min,
                     ck.pos_max, ck.n_tokens, n, ck.size / MiB)
        self.truncate(n)
        return True

    def take_checkpoint(self, id_task: int) -> Checkpoint | None:
        """llama.cpp's create_checkpoint, before a prompt chunk near the prompt's end runs: the
        sliding KV of the tokens held now. When the list is full, checkpoints of other tasks
        within checkpoint_min_step tokens of an earlier one go first, then the oldest; one at
        the same token count is replaced."""
        if not self.n_checkpoints or not self._tokens or self._ahead:
            return None
        assert self.swa is not None and self.fp is not None
        n, step = len(self._tokens), self.checkpoint_min_step
        cks = self.checkpoints
        if len(cks) + 1 >= self.n_checkpoints:
            last, kept = -1, []
            for c in cks:
                if c.id_task != id_task and last >= 0 and c.n_tokens <= last + step:
                    log.debug("slot %d: erasing context checkpoint too close to an earlier one "
                              "(n_tokens = %d)", self.seq, c.n_tokens)
                    continue
                last = c.n_tokens
                kept.append(c)
            cks = kept
        while len(cks) >= self.n_checkpoints:
            c = cks.pop(0)
            log.warning("slot %d: erasing old context checkpoint (pos_min = %d, pos_max = %d, "
                        "n_tokens = %d, size = %.3f MiB)", self.seq, c.pos_min, c.pos_max,
                        c.n_tokens, c.size / MiB)
        cks = [c for c in cks if c.n_tokens != n]
        ck = Checkpoint(n, self.swa.snapshot_from(self.seq), self.pool.seq_pos_max(self.seq),
                        seal(get_swa_state(self.swa, self.seq, self.fp)), id_task=id_task)
        cks.append(ck)
        self.checkpoints = cks
        log.info("slot %d: created context checkpoint %d of %d (pos_min = %d, pos_max = %d, "
                 "n_tokens = %d, size = %.3f MiB)", self.seq, len(cks), self.n_checkpoints,
                 ck.pos_min, ck.pos_max, n, ck.size / MiB)
        return ck

    def drop_checkpoints(self, buffers: Container[int]) -> None:
        """Drop the checkpoints whose state buffers' ids are in `buffers` (a byte budget)."""
        self.checkpoints = [c for c in self.checkpoints if id(c.target) not in buffers]

    def set_checkpoints(self, cks: list[Checkpoint]) -> None:
        """Checkpoints that came with restored tokens (host cache, slot file): id_task -1,
        and only those that fit what is held and that this model's sliding part would load."""
        if self.swa is None or self.fp is None:
            self.checkpoints = []
            return
        good = []
        for c in cks:
            try:
                st = parse_swa_state(self.swa, unseal(c.target), self.fp)
            except ValueError as e:
                log.warning("slot %d: context checkpoint dropped (%s)", self.seq, e)
                continue
            span = (min(st.positions), max(st.positions)) if st.positions else (-1, -1)
            if span != (c.pos_min, c.pos_max) or c.n_tokens != c.pos_max + 1 \
                    or c.n_tokens > len(self._tokens):
                log.warning("slot %d: context checkpoint dropped (positions %s do not match "
                            "its header)", self.seq, span)
                continue
            c.id_task = -1
            good.append(c)
        self.checkpoints = good[-self.n_checkpoints:] if self.n_checkpoints else good

    @property
    def checkpoint_bytes(self) -> int:
        return sum(c.size for c in self.checkpoints)

    def window_unsaved(self) -> bool:
        """Pruning the window now would drop sliding KV a write-through tier lacks."""
        return (self.swa is not None and self.pool.layout.rows_every_position
                and self.swa.window_start(self.seq) > self.saved_upto)

    def prune(self) -> None:
        """Drop sliding cells no later token reads (memory/pool/swa.py)."""
        if self.swa is not None:
            self.swa.prune(self.seq)

    def share_from(self, donor: SlotKV, n: int, ck: Checkpoint | None = None) -> bool:
        """Take the donor's first `n` cells (shared in unified KV, copied in a partition), and
        the state of its checkpoint `ck` where the donor's own state is past n (a recurrent
        state kept whole); False, with this slot emptied, when a partition has no room for
        the copy or the checkpoint fails to load."""
        assert donor.reusable, f"slot {donor.seq}: shifted KV cannot be shared"
        self.drop()
        try:
            self.pool.seq_cp(donor.seq, self.seq, 0, n)
            if ck is not None:
                assert self.swa is not None and self.fp is not None
                set_swa_state(self.swa, self.seq, unseal(ck.target), self.fp)
        except (OutOfCells, ValueError) as e:
            log.warning("slot %d: sharing %d tokens of slot %d failed (%s)", self.seq, n,
                        donor.seq, e)
            self.pool.seq_rm(self.seq)
            return False
        self._tokens = list(donor.tokens[:n])
        self.salt = donor.salt
        self.n_draft = min(donor.n_draft, n)  # the cells came with their draft rows
        return True

    def restore_from(self, cache: PromptCache, key: PromptKey) -> bool:
        """Restore the host cache's best prefix of the prompt `key`, from its namespace (the
        cache hands its rows over, this object writes them); False if it had none better (slot
        untouched) or the restore failed (slot emptied: the caller plans again)."""
        got = cache.load(self.pool, self.seq, self.offered(key), key)
        if got is None:
            return False
        return bool(self.write_restore(got))

    def write_restore(self, got: Restore) -> list[int]:
        """Replace the content with the rows a host cache handed over, as KV of the namespace
        they were stored under; returns the tokens now held. Any error while writing (a bad segment, out of
        cells, an injected fault) removes the cells written so far: the slot then holds nothing
        and [] is returned. Either way the cache hears the outcome (`Restore.done`: it counts
        the load or the fallback, and releases what it locked)."""
        failed: BaseException | None = None
        try:
            self.pool.seq_rm(self.seq)
            for seg in got.segments:
                self.pool.write_segment(self.seq, seg)
        except BaseException as e:  # reported to the cache; an interrupt re-raised below
            self.pool.seq_rm(self.seq)  # the cells written so far go
            failed = e
        tokens = [] if failed is not None else list(got.tokens)
        self._tokens, self._ahead, self._redo = tokens, [], []
        self.salt = got.ns
        self.saved_upto = len(tokens) if got.kept else 0  # radix keeps what it gave
        self.n_draft = len(tokens)  # every tier restores the draft rows with the target's
        self.set_checkpoints(list(got.checkpoints) if tokens else [])
        got.done(failed)
        if failed is not None and not isinstance(failed, Exception):
            raise failed  # an interrupt: the slot and the cache are consistent, go on up
        return tokens

    def load_rows(self, tokens: list[int], k: torch.Tensor, v: torch.Tensor,
                  swa: tuple[list[int], torch.Tensor, torch.Tensor] | None = None,
                  checkpoints: Sequence[Checkpoint] = (), draft: bytes = b"", *,
                  salt: str = "") -> None:
        """Replace the content with `tokens` and their K/V rows (a slot file's state): `swa`
        the sliding part (positions, K, V) of a sliding-window pool; `draft` a draft model's
        state of the same tokens, test-loaded: dropped (the rows recomputed when needed) when
        it does not fit this draft model or these tokens; `salt` the cache namespace the rows
        belong to (a slot file's), so the planner serves them to that namespace alone."""
        self.drop()
        self.salt = salt
        self.pool.write_rows(self.seq, list(range(len(tokens))), k, v)
        if swa is not None:
            assert self.swa is not None
            self.swa.swa.write_rows(self.seq, *swa)
        self._tokens = list(tokens)
        self.set_checkpoints(list(checkpoints))
        if draft and self.pool.draft is not None:
            try:
                set_draft_state(self.pool, self.seq, draft)
                self.n_draft = len(tokens)
            except StateError as e:
                log.warning("slot %d: draft state dropped (%s); the draft rows will be "
                            "recomputed", self.seq, e)

    def shift_chunks(self, prompt: list[int], n_keep: int,
                     chunks: list[tuple[int, int, int]]) -> bool:
        """Keep [0, n_keep), move each (cache start, prompt start, length) chunk onto its prompt
        position (`--cache-reuse`), drop every other cell. False, with only [0, n_keep) kept,
        when a shifted cell shared with another slot had to be copied and there was no room
        (shifts only touch positions past n_keep).

        Left shifts go left to right and right shifts right to left: no chunk ever lands on a
        position another chunk still occupies.
        """
        pool, seq = self.pool, self.seq
        try:
            at = n_keep
            for c, _, n in chunks:
                pool.seq_rm(seq, at, c)
                at = c + n
            pool.seq_rm(seq, at)
            for c, p, n in [ch for ch in chunks if ch[1] <= ch[0]]:
                pool.seq_add(seq, c, c + n, p - c)
            for c, p, n in reversed([ch for ch in chunks if ch[1] > ch[0]]):
                pool.seq_add(seq, c, c + n, p - c)
        except OutOfCells:
            self.truncate(n_keep)
            return False
        self._tokens = list(prompt[:n_keep])
        self._ahead = []
        self._forget_past(n_keep)
        for _, p, n in chunks:
            self._place(p, prompt[p : p + n])
        return True

    def shift(self, n_keep: int, n_discard: int) -> bool:
        """Context shift: drop positions [n_keep, n_keep + n_discard), move the rest left by
        n_discard (K re-rotated); the tokens follow. Marks the KV shifted (never reused). False,
        with the slot emptied, when a moved cell shared with another slot had to be copied and
        there was no room."""
        assert not self._ahead, f"slot {self.seq}: shift with chunks ahead"
        n = len(self._tokens)
        assert 0 <= n_keep and 0 <= n_discard and n_keep + n_discard <= n
        assert not self._redo, f"slot {self.seq}: shift with tokens to compute again"
        self.shifted = True
        self.checkpoints, self.saved_upto = [], min(self.saved_upto, n_keep)
        try:
            self.pool.seq_rm(self.seq, n_keep, n_keep + n_discard)
            self.pool.seq_add(self.seq, n_keep + n_discard, n, -n_discard)
        except OutOfCells:
            self.drop()
            return False
        del self._tokens[n_keep : n_keep + n_discard]
        # draft rows moved (and re-rotated) with their cells
        self.n_draft = n - n_discard if self.n_draft >= n else min(self.n_draft, n_keep)
        return True

    # -- a forward's cells ---------------------------------------------------------------------
    def reserve(self, pos0: int, n: int) -> list[int]:
        """Cells for `n` new tokens at pos0.. (OutOfCells, nothing taken, when there is no room)."""
        return self.pool.alloc_step(self.seq, list(range(pos0, pos0 + n)))

    def commit(self, pos0: int, tokens: list[int]) -> None:
        """The forward wrote the reserved cells of `tokens` at pos0..: they are held now."""
        self._place(pos0, tokens)

    def _place(self, pos0: int, tokens: list[int]) -> None:
        if self._redo:  # the tokens rolled back are computed again first, where they were
            assert pos0 == len(self._tokens) and tokens[: len(self._redo)] == self._redo, \
                f"slot {self.seq}: a forward after a rollback must feed its tokens again"
            self._redo = []
        if pos0 == len(self._tokens):
            self._tokens.extend(tokens)
            while self._ahead and self._ahead[0][0] == len(self._tokens):
                self._tokens.extend(self._ahead.pop(0)[1])
        else:
            assert pos0 > len(self._tokens), f"slot {self.seq}: position {pos0} already held"
            self._ahead.append((pos0, list(tokens)))
            self._ahead.sort(key=lambda a: a[0])

    # -- invariant -----------------------------------------------------------------------------
    def check(self) -> None:
        """AssertionError unless the pool holds exactly what this object says it does."""
        want = list(range(len(self._tokens)))
        for p0, toks in self._ahead:
            assert not want or p0 > want[-1], f"slot {self.seq}: chunk at {p0} overlaps"
            want.extend(range(p0, p0 + len(toks)))
        got = self.pool.seq_positions(self.seq)
        assert got == want, f"slot {self.seq}: pool positions {got[:8]}.. != tokens' {want[:8]}.."
        if self.swa is not None:  # the window: one run ending where the tokens end
            w = self.swa.swa.seq_positions(self.seq)
            assert w == list(range(w[0], len(self._tokens))) if w else True, \
                f"slot {self.seq}: sliding positions {w[:4]}.. are not the tokens' last"
            assert not w or len(w) <= self.swa.n_keep or self._ahead, "window not pruned"
        for c in self.checkpoints:
            assert c.n_tokens == c.pos_max + 1 <= self.n_held, f"slot {self.seq}: checkpoint"
        assert self.n_draft <= self.n_held, f"slot {self.seq}: draft rows past the tokens"
        assert not (self._redo and self._ahead), f"slot {self.seq}: redo with chunks ahead"
