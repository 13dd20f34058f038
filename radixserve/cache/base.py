"""The host tier's contract: what the scheduler may ask of a prompt cache backend.

Rules every backend keeps (SGLang-style contracts):
- `save` copies a sequence's KV out of the pool and never modifies the pool.
- `load` either leaves the sequence untouched (returns None) or replaces its KV and returns the
  tokens the sequence now holds (possibly [] after a failed restore: the caller then prefills).
- Evicting nothing is always safe; `update` only enforces limits.
- `check` raises AssertionError when the bookkeeping is inconsistent (tests call it after every
  operation).
"""

from __future__ import annotations

from typing import Protocol

from radixserve.cache.prefix import common_prefix
from radixserve.kv.pool import KVPool

__all__ = ["NullPromptCache", "PromptCache", "common_prefix"]


class PromptCache(Protocol):
    name: str
    load_always: bool  # try `load` for every new prompt, not only when the slot is overwritten

    def save(self, pool: KVPool, seq: int, tokens: list[int]) -> bool:
        """Copy `seq`'s KV (token i at position i) into the cache; False if it was skipped."""
        ...

    def load(self, pool: KVPool, seq: int, slot_tokens: list[int], prompt: list[int]) -> list[int] | None:
        """Restore a better prefix of `prompt` than `slot_tokens` into `seq`, if the cache has one."""
        ...

    def update(self) -> None:
        """Enforce the size limits (evict)."""
        ...

    def stats(self) -> dict[str, float]:
        """Figures for /metrics (as radixserve:<key>) and /props."""
        ...

    def check(self) -> None:
        ...


class NullPromptCache:
    """`--cache-ram 0`: no host tier at all."""

    name = "none"
    load_always = False

    def save(self, pool: KVPool, seq: int, tokens: list[int]) -> bool:
        return False

    def load(self, pool: KVPool, seq: int, slot_tokens: list[int], prompt: list[int]) -> list[int] | None:
        return None

    def update(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}

    def check(self) -> None:
        pass
