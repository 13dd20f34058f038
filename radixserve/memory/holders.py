"""What memory/ reads of the engine's objects, as protocols: the engine's `Slot` and
`CompletionTask` satisfy them by their shape, so this room never imports engine/.

A holder is a slot: one pool sequence (its `kv`, the per-sequence owner, `SlotKV`) and the task
it serves, if any. A request is what a task asks of the memory: the prompt, its cache
namespace, the slot it names and whether it may reuse cached KV.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from radixserve.memory.key import PromptKey
    from radixserve.memory.seq_kv import SlotKV


class Request(Protocol):
    id: int  # the engine's task id
    id_slot: int  # -1: any slot
    cache_prompt: bool  # false: compute the whole prompt (nothing reused)
    pin_s: float  # seconds the prompt stays pinned in the host tier after the task (0: none)

    @property
    def key(self) -> PromptKey:
        """The prompt and its cache namespace: KV of another namespace never serves it."""
        ...

    @property
    def pin_key(self) -> PromptKey:
        """What a pin keeps: `key`, or a prefix of it (Anthropic's cache breakpoints)."""
        ...


class Holder(Protocol):
    kv: SlotKV
    t_last_used: float
    n_ctx: int  # the most tokens its KV may hold
    prompt: list[int]  # the running task's prompt

    @property
    def id(self) -> int: ...

    @property
    def is_processing(self) -> bool: ...

    @property
    def prefilling(self) -> bool:
        """Computing its task's prompt."""
        ...

    @property
    def task(self) -> object: ...


class ModelIdentity(Protocol):
    """A model as the disk tier keys its files: what the KV it computes depends on."""

    def identity(self, cache_dir: str | None = None) -> bytes: ...
