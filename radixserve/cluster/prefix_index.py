"""Which replica holds which prompt prefixes: an approximate record of what each was sent.

A router cannot see the replicas' radix trees, so it remembers the prompts it sent each one,
as llm-d's approximate prefix-cache scorer does: a prompt key is cut into blocks of
`block_chars` characters, each block named by a hash chained over all before it, so one name
stands for a whole prefix. A request's match on a replica is the number of its leading block
names that replica was sent; each replica keeps at most `capacity_blocks` names, least
recently used going first, as its own cache evicts. Matching is O(key length / block).
"""

from __future__ import annotations

from collections import OrderedDict


def block_names(key: str, block_chars: int) -> list[int]:
    """The chained hashes of `key`'s whole blocks (a tail shorter than a block is not named:
    a replica caching it would save less than a block)."""
    names, h = [], 0
    for i in range(0, len(key) - block_chars + 1, block_chars):
        h = hash((h, key[i : i + block_chars]))
        names.append(h)
    return names


class PrefixIndex:
    def __init__(self, block_chars: int = 64, capacity_blocks: int = 65536) -> None:
        if block_chars < 1 or capacity_blocks < 1:
            raise ValueError("block_chars and capacity_blocks must be positive")
        self.block_chars, self.capacity_blocks = block_chars, capacity_blocks
        self._held: dict[str, OrderedDict[int, None]] = {}

    def replicas(self) -> list[str]:
        return list(self._held)

    def match(self, key: str, replicas: list[str]) -> dict[str, int]:
        """For each of `replicas`, how many characters of `key`'s leading blocks it holds."""
        names = block_names(key, self.block_chars)
        out = {}
        for r in replicas:
            held = self._held.get(r)
            n = 0
            if held:
                while n < len(names) and names[n] in held:
                    n += 1
            out[r] = n * self.block_chars
        return out

    def insert(self, key: str, replica: str) -> None:
        held = self._held.setdefault(replica, OrderedDict())
        for name in reversed(block_names(key, self.block_chars)):  # the head is the newest:
            held[name] = None  # a prefix's tail is evicted before the blocks it extends
            held.move_to_end(name)
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)

    def clear(self) -> None:
        """Forget every replica's prompts (their caches were flushed)."""
        self._held = {}

    def remove(self, replica: str) -> None:
        self._held.pop(replica, None)

    def blocks(self, replica: str) -> int:
        return len(self._held.get(replica, ()))
