"""One slot's KV: the only writer of a slot's cells in the pool and of the tokens they hold.

llama.cpp keeps `slot.cache_tokens` next to the sequence's cells and updates both by hand at
every call site; here every change goes through one object (as nano-vllm's BlockManager is the
only writer of a block table), so the rule holds by construction and `check` can prove it:

    the pool holds, for this sequence, exactly positions 0 .. len(tokens) - 1 (their tokens are
    `tokens`) plus the `ahead` chunks: prompt ranges that `--cache-reuse` shifted into place
    past a hole still to compute; nothing else.

Cells reserved for a forward (`reserve`) are the one transient exception: they are committed
(`commit`) when the forward succeeded or dropped with the rest when it failed.

Context shift (`shift`, `--context-shift`): when a generating slot's context is full, the tokens
after the first n_keep are partly discarded and the rest moved left with K re-rotated, as
llama-server does. The KV that results is NOT the KV a fresh computation of the new token list
would give (the kept tokens attended to the discarded ones), and the project promises cached ==
uncached, so the rule is: a shifted slot's KV is never reused. `reusable` is False from the
shift on; `save_to` refuses it, `share_from` refuses it as a donor (the prefix planner does not
offer it), and the scheduler drops it when the task ends (so no later request, host-cache save,
idle-slot save or slot file ever sees it). `drop` makes the slot reusable again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from radixserve.cache.base import PromptCache
from radixserve.kv.pool import KVPool, OutOfCells
from radixserve.kv.state import write_rows

log = logging.getLogger(__name__)


class SlotKV:
    def __init__(self, pool: KVPool, seq: int) -> None:
        self.pool, self.seq = pool, seq
        self._tokens: list[int] = []
        self._ahead: list[tuple[int, list[int]]] = []  # (pos0, tokens), ascending, past tokens
        self.shifted = False  # a context shift ran: the KV must not be reused (docstring)

    # -- reading ---------------------------------------------------------------------------
    @property
    def tokens(self) -> Sequence[int]:
        """Tokens whose KV the pool holds at positions 0.. (read-only: change them here)."""
        return self._tokens

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def n_held(self) -> int:
        """Tokens held: the contiguous prefix plus the chunks placed ahead of it."""
        return len(self._tokens) + sum(len(t) for _, t in self._ahead)

    @property
    def reusable(self) -> bool:
        """Whether another request, tier or file may take this KV as that of its tokens."""
        return not self.shifted

    def n_free(self) -> int:
        """Cells this sequence could still get from the pool."""
        return self.pool.n_free_for(self.seq)

    def save_to(self, cache: PromptCache) -> bool:
        """Copy the contiguous prefix into the host cache (the pool is only read)."""
        if self.shifted:
            return False
        return bool(self._tokens) and cache.save(self.pool, self.seq, list(self._tokens))

    # -- replacing the content ---------------------------------------------------------------
    def drop(self) -> None:
        self.pool.seq_rm(self.seq)
        self._tokens, self._ahead = [], []
        self.shifted = False

    def truncate(self, n: int) -> None:
        """Keep the first `n` tokens; everything past them (chunks ahead included) goes."""
        self.pool.seq_rm(self.seq, n)
        del self._tokens[n:]
        self._ahead = []

    def share_from(self, donor: SlotKV, n: int) -> bool:
        """Take the donor's first `n` cells (shared in unified KV, copied in a partition);
        False, with this slot emptied, when a partition has no room for the copy."""
        assert donor.reusable, f"slot {donor.seq}: shifted KV cannot be shared"
        self.drop()
        try:
            self.pool.seq_cp(donor.seq, self.seq, 0, n)
        except OutOfCells:
            return False
        self._tokens = list(donor.tokens[:n])
        return True

    def restore_from(self, cache: PromptCache, prompt: list[int]) -> bool:
        """Let the host cache write its best prefix of `prompt`; False if it had none better
        (slot untouched) or the restore failed (slot emptied: the caller plans again)."""
        loaded = cache.load(self.pool, self.seq, list(self._tokens), prompt)
        if loaded is None:
            return False
        self._tokens, self._ahead = list(loaded), []
        return bool(loaded)

    def load_rows(self, tokens: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Replace the content with `tokens` and their K/V rows (a slot file's state)."""
        self.drop()
        write_rows(self.pool, self.seq, list(range(len(tokens))), k, v)
        self._tokens = list(tokens)

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
        self.shifted = True
        try:
            self.pool.seq_rm(self.seq, n_keep, n_keep + n_discard)
            self.pool.seq_add(self.seq, n_keep + n_discard, n, -n_discard)
        except OutOfCells:
            self.drop()
            return False
        del self._tokens[n_keep : n_keep + n_discard]
        return True

    # -- a forward's cells ---------------------------------------------------------------------
    def reserve(self, pos0: int, n: int) -> list[int]:
        """Cells for `n` new tokens at pos0.. (OutOfCells, nothing taken, when there is no room)."""
        return self.pool.alloc(self.seq, list(range(pos0, pos0 + n)))

    def commit(self, pos0: int, tokens: list[int]) -> None:
        """The forward wrote the reserved cells of `tokens` at pos0..: they are held now."""
        self._place(pos0, tokens)

    def _place(self, pos0: int, tokens: list[int]) -> None:
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
