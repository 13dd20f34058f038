"""What every tier keys a sequence's KV by: its cache namespace and its tokens, as one value.

`ns` is a request's `cache_salt` ("" for the shared namespace): KV stored under one namespace
never serves a prompt of another, in any tier (a slot, the radix tree's roots, whole-prompt
entries, disk block names, slot files). The key is made once where a request is parsed
(`CompletionTask.key`) or where a slot's KV is offered (`SlotKV.key`), and travels whole: no
function of memory/ takes a namespace beside a token list.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PromptKey:
    ns: str
    tokens: list[int]  # never modified through the key

    def __len__(self) -> int:
        return len(self.tokens)

    def prefix(self, n: int) -> PromptKey:
        """The key of the first `n` tokens, in the same namespace (itself when n covers all)."""
        return self if n >= len(self.tokens) else PromptKey(self.ns, self.tokens[:n])
