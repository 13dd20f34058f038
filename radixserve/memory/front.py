"""The engine's door to the device memory (and the one-shot tools': generate, perf, bench): what
it may hold and call of a pool without naming a pool class or importing pool/ (the room rule,
tests/memory/test_rooms.py). A pool is built from a model's declared layout (`build_pool`),
a draft model's rows are attached from the draft's layout (`attach_draft`), and what the
engine must know of the memory it reads from the pool's `layout` (memory/layout.py)."""

from radixserve.memory.pool.draft import attach_draft
from radixserve.memory.pool.factory import build_pool
from radixserve.memory.pool.kv_types import resolve as resolve_kv_types
from radixserve.memory.pool.pool import KVPool as Pool  # the type a pool is held by
from radixserve.memory.pool.pool import KVTypes, OutOfCells
from radixserve.memory.pool.state import fingerprint_of

__all__ = ["Pool", "KVTypes", "OutOfCells", "attach_draft", "build_pool", "fingerprint_of",
           "resolve_kv_types"]
