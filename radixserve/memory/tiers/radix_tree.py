"""The radix fork's tree: token ids on compressed edges, each owning the K/V rows of its tokens.

Pure data structure (no pool): `radix.py` copies rows out of the device pool and hands them
over for a restore, which the slot's KV owner (memory/seq_kv.py) writes into it.

- A node's `k`/`v` are [n_layer, n_head_kv, len(tokens), head_dim] host tensors that own their
  storage (a split copies both halves), so `bytes` is exactly the memory the tree holds.
- `match` is read-only: the same prefix serves any number of requests (not consumed). Only
  `touch` stamps the LRU clock, on the node and all its ancestors, so a parent is never older
  than its children.
- Eviction takes least-recently-used unlocked leaves from a lazy heap (stale entries are
  skipped when popped), so it never scans the tree. A prefix shared by several branches is an
  inner node and stays until its children go. A node left childless becomes terminal: its
  tokens are a real prefix someone computed, and every leaf is then a stored prompt.
- `insert` allocates (split copies) before it changes anything, so a failure leaves the tree
  exactly as it was.
- Namespaces (`ns`, a request's `cache_salt`): each has its own root, so prompts of different
  namespaces never match each other; they share the byte counter and the LRU heap, so
  eviction stays one global LRU. A namespace other than "" goes when its last leaf does.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from radixserve.memory.tiers.prefix import common_prefix


@dataclass(slots=True, eq=False)
class RadixNode:
    """One compressed edge and the node it leads to; `depth` counts tokens from the root."""

    tokens: list[int]
    k: torch.Tensor  # [n_layer, n_head_kv, len(tokens), head_dim]
    v: torch.Tensor
    parent: RadixNode | None
    depth: int
    children: dict[int, RadixNode] = field(default_factory=dict)
    terminal: bool = False  # a saved prompt ends here
    lock_ref: int = 0  # restores in progress through this node (locks count up the path)
    last_access: int = 0
    evicted: bool = False
    # the rows of the pool's other row groups for the same tokens (a conv window's input rows,
    # a draft model's K/V: the pool's row_layout after its first K and V), else empty
    more: tuple[torch.Tensor, ...] = ()
    ns: str = ""  # a namespace root's name (only read on roots)
    # a recurrent state after this node's last token (a sealed context checkpoint's bytes),
    # for a layout whose state has no rows a token (memory/pool/recurrent.py); b"": none
    snapshot: bytes = b""

    @property
    def row_bytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + sum(t.nbytes for t in self.more)

    @property
    def nbytes(self) -> int:
        return self.row_bytes + len(self.snapshot)

    def rows(self) -> tuple[torch.Tensor, ...]:
        return (self.k, self.v, *self.more)


@dataclass(slots=True)
class RadixMatch:
    """Longest prefix found: `length` tokens along `path` (the last node may match in part)."""

    length: int
    path: list[RadixNode]

    def segments(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(pos0, k rows, v rows) of each matched piece, in position order."""
        for pos0, rows in self.all_rows():
            yield pos0, rows[0], rows[1]

    def all_rows(self) -> Iterator[tuple[int, tuple[torch.Tensor, ...]]]:
        """(pos0, (k, v, *more)) of each matched piece, in position order."""
        for node in self.path:
            pos0 = node.depth - len(node.tokens)
            take = min(len(node.tokens), self.length - pos0)
            yield pos0, tuple(t[:, :, :take] for t in node.rows())


def own_rows(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy with its own storage (pinned if `t` is), so byte counts stay exact."""
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_pinned())
    return out.copy_(t)


class RadixTree:
    def __init__(self) -> None:
        self.root = self._new_root("")  # the shared namespace: never evicted, never removed
        self.roots: dict[str, RadixNode] = {"": self.root}
        self.bytes = 0
        self.n_nodes = 0  # not counting the root
        self.n_terminal = 0
        self.unique_tokens = 0  # tokens stored (shared prefixes once)
        self.n_snapshots = self.snapshot_bytes = 0  # snapshots held on nodes, their bytes
        self.logical_tokens = 0  # sum of terminal depths (shared prefixes once per prompt)
        self._clock = 0
        self.version = 0  # bumped by every change a reader could see (the cache view's memo)
        self._heap: list[tuple[int, int, RadixNode]] = []  # (last_access, tiebreak, leaf)
        self._tiebreak = 0

    # ##### Public API #####
    def match(self, tokens: list[int], ns: str = "") -> RadixMatch:
        """Longest stored prefix of `tokens` in namespace `ns`; changes nothing (call `touch`
        to count a use)."""
        node, i, path = self.roots.get(ns), 0, []
        if node is None:
            return RadixMatch(0, [])
        while i < len(tokens) and (child := node.children.get(tokens[i])) is not None:
            n = len(child.tokens)
            c = common_prefix(child.tokens, tokens[i : i + n])
            path.append(child)
            i += c
            if c < n:
                break
            node = child
        return RadixMatch(i, path)

    def insert(self, tokens: list[int], k: torch.Tensor, v: torch.Tensor,
               more: tuple[torch.Tensor, ...] = (), ns: str = "") -> RadixNode:
        """Store `tokens` given the rows of the part past `match(tokens, ns)` (and those of
        the other row groups); returns the end node."""
        m = self.match(tokens, ns)
        if (k.shape[2] != len(tokens) - m.length or v.shape != k.shape
                or any(t.shape[2] != k.shape[2] for t in more)):
            need = len(tokens) - m.length
            raise ValueError(f"insert needs rows for {need} tokens, got {tuple(k.shape)}")
        if m.path:
            node = m.path[-1]
        else:
            node = self.roots.get(ns) or self.roots.setdefault(ns, self._new_root(ns))
        if node.depth > m.length:
            node = self._split(node, len(node.tokens) - (node.depth - m.length))
        if m.length < len(tokens):
            leaf = RadixNode(tokens[m.length :], k, v, node, len(tokens), more=tuple(more))
            node.children[leaf.tokens[0]] = leaf
            self.bytes += leaf.nbytes
            self.n_nodes += 1
            self.unique_tokens += len(leaf.tokens)
            node = leaf
        self._set_terminal(node)
        self.touch(node)
        return node

    def touch(self, node: RadixNode) -> None:
        """Mark `node` and its ancestors as used now (the LRU signal)."""
        self._clock += 1
        self.version += 1
        n: RadixNode | None = node
        while n is not None and n.parent is not None:
            n.last_access = self._clock
            n = n.parent
        self._push_if_evictable(node)

    def cut(self, node: RadixNode, depth: int) -> RadixNode:
        """The node ending `depth` tokens from the root on the way to `node`, whose edge spans
        that depth: `node` itself, or the upper part of its edge, split there (a pin of a
        prompt's prefix keeps that much only)."""
        if depth >= node.depth:
            return node
        return self._split(node, depth - (node.depth - len(node.tokens)))

    def node_at(self, end: RadixNode, depth: int) -> RadixNode:
        """The node ending `depth` tokens from the root on the way to `end` (0 < depth <=
        end.depth), an edge split there when it spans that depth."""
        node = end
        while node.depth - len(node.tokens) >= depth:
            assert node.parent is not None
            node = node.parent
        return self.cut(node, depth)

    def attach(self, node: RadixNode, snapshot: bytes) -> None:
        """Keep `snapshot` (the state after `node`'s last token) on `node`, replacing any."""
        self.bytes += len(snapshot) - len(node.snapshot)
        self.snapshot_bytes += len(snapshot) - len(node.snapshot)
        self.n_snapshots += bool(snapshot) - bool(node.snapshot)
        node.snapshot = snapshot
        self.version += 1

    def drop_snapshots(self, limit_bytes: int) -> int:
        """Drop the snapshots of unlocked nodes with one child, least recently used first,
        until bytes <= limit_bytes; returns how many. Such a snapshot is the state where a
        prompt once ended and a longer one went on (an agent's earlier step): its prefix is
        then served up to the nearest snapshot above it. A leaf's goes with the leaf, and a
        branch point's (where prompts diverge) stays until eviction makes it a leaf."""
        if self.bytes <= limit_bytes or not self.n_snapshots:
            return 0
        cands = sorted((n for n in self.nodes() if n.snapshot and len(n.children) == 1
                        and n.lock_ref == 0), key=lambda n: n.last_access)
        dropped = 0
        for n in cands:
            if self.bytes <= limit_bytes:
                break
            self.attach(n, b"")
            dropped += 1
        return dropped

    def lock(self, node: RadixNode) -> None:
        """Pin `node` and its ancestors: eviction skips them until `unlock`."""
        self.version += 1
        n: RadixNode | None = node
        while n is not None:
            n.lock_ref += 1
            n = n.parent

    def unlock(self, node: RadixNode) -> None:
        self.version += 1
        n: RadixNode | None = node
        while n is not None:
            n.lock_ref -= 1
            assert n.lock_ref >= 0, "radix node unlocked more often than locked"
            n = n.parent
        self._push_if_evictable(node)

    def evict(self, limit_bytes: int,
              on_evict: Callable[[RadixNode], None] | None = None) -> tuple[int, int]:
        """Drop LRU unlocked leaves until bytes <= limit_bytes; returns (nodes, tokens) dropped.
        `on_evict` sees each leaf just before it goes, its path still attached (the disk tier
        writes what it lacks)."""
        n_nodes = n_tokens = 0
        while self.bytes > limit_bytes and self._heap:
            entry = heapq.heappop(self._heap)
            if not self._live(entry):
                continue  # stale: touched, locked or given a child since it was pushed
            leaf = entry[2]
            n_nodes, n_tokens = n_nodes + 1, n_tokens + len(leaf.tokens)
            if on_evict is not None:
                on_evict(leaf)
            self._remove_leaf(leaf)
        return n_nodes, n_tokens

    def clear(self) -> tuple[int, int]:
        """Drop every unlocked leaf, repeatedly (an admin flush); returns (nodes, tokens)."""
        return self.evict(-1)

    @staticmethod
    def path_to(node: RadixNode) -> list[RadixNode]:
        """The nodes from below the root down to `node`, in position order."""
        path: list[RadixNode] = []
        n: RadixNode | None = node
        while n is not None and n.parent is not None:
            path.append(n)
            n = n.parent
        return path[::-1]

    def nodes(self) -> Iterator[RadixNode]:
        """Every node but the roots, parents before children (for checks and stats)."""
        stack = [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check(self) -> None:
        """Recompute every counter from scratch and check the structure (AssertionError if off)."""
        n_bytes = n_nodes = n_terminal = unique = logical = 0
        evictable: set[int] = set()
        for ns, r in self.roots.items():
            assert r.lock_ref >= 1 and not r.tokens and r.parent is None and r.ns == ns, "root"
            assert r.children or r is self.root, "an empty namespace was kept"
        for node in self.nodes():
            p = node.parent
            assert p is not None and not node.evicted and node.tokens, "detached or empty node"
            assert p.children.get(node.tokens[0]) is node, "child not keyed by its first token"
            assert node.depth == p.depth + len(node.tokens), "depth off"
            for t in node.rows():
                assert t.shape[2] == len(node.tokens), "rows do not match the edge's tokens"
                owned = t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes
                assert owned, "rows share storage: byte counts would be wrong"
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()) >= 0
            assert p.parent is None or p.last_access >= node.last_access, "parent older than child"
            assert node.terminal or node.children, "a leaf that is not a stored prompt"
            n_bytes, n_nodes, unique = n_bytes + node.nbytes, n_nodes + 1, unique + len(node.tokens)
            if node.terminal:
                n_terminal, logical = n_terminal + 1, logical + node.depth
            if self._evictable(node):
                evictable.add(id(node))
        assert (n_bytes, n_nodes, n_terminal) == (self.bytes, self.n_nodes, self.n_terminal)
        snaps = [len(n.snapshot) for n in self.nodes() if n.snapshot]
        assert (len(snaps), sum(snaps)) == (self.n_snapshots, self.snapshot_bytes), "snapshots"
        assert (unique, logical) == (self.unique_tokens, self.logical_tokens), "token counters"
        live = {id(e[2]) for e in self._heap if self._live(e)}
        assert live == evictable, "LRU heap does not hold exactly the evictable leaves"

    # ##### Internal helpers #####
    @staticmethod
    def _new_root(ns: str) -> RadixNode:
        empty = torch.empty(0, device="cpu")  # host rows, as every node's
        return RadixNode([], empty, empty, None, 0, lock_ref=1, ns=ns)  # never evicted

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Cut `child`'s edge after `at` tokens; the new upper node inherits locks and stamp."""
        head_k, head_v = own_rows(child.k[:, :, :at]), own_rows(child.v[:, :, :at])
        tail_k, tail_v = own_rows(child.k[:, :, at:]), own_rows(child.v[:, :, at:])
        head_d = tuple(own_rows(t[:, :, :at]) for t in child.more)
        tail_d = tuple(own_rows(t[:, :, at:]) for t in child.more)
        parent = child.parent
        assert parent is not None
        depth = child.depth - len(child.tokens) + at
        mid = RadixNode(
            child.tokens[:at],
            head_k,
            head_v,
            parent,
            depth,
            lock_ref=child.lock_ref,
            last_access=child.last_access,
            more=head_d,
        )
        parent.children[mid.tokens[0]] = mid
        child.tokens, child.k, child.v, child.parent = child.tokens[at:], tail_k, tail_v, mid
        child.more = tail_d
        mid.children[child.tokens[0]] = child
        self.n_nodes += 1
        self.version += 1
        return mid

    def _set_terminal(self, node: RadixNode) -> None:
        if not node.terminal and node.parent is not None:
            node.terminal = True
            self.n_terminal += 1
            self.logical_tokens += node.depth

    def _remove_leaf(self, leaf: RadixNode) -> None:
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.terminal
        del parent.children[leaf.tokens[0]]
        self.version += 1
        self.bytes -= leaf.nbytes
        self.snapshot_bytes -= len(leaf.snapshot)
        self.n_snapshots -= bool(leaf.snapshot)
        self.n_nodes -= 1
        self.n_terminal -= 1
        self.unique_tokens -= len(leaf.tokens)
        self.logical_tokens -= leaf.depth
        leaf.evicted, leaf.parent = True, None
        leaf.k = leaf.v = self.root.k  # release the rows now
        leaf.more, leaf.snapshot = (), b""
        if parent.children:
            return
        if parent.parent is not None:
            self._set_terminal(parent)
            self._push_if_evictable(parent)
        elif parent is not self.root:
            del self.roots[parent.ns]  # the namespace's last prompt went

    def _evictable(self, node: RadixNode) -> bool:
        return not node.evicted and not node.children and node.lock_ref == 0

    def _live(self, entry: tuple[int, int, RadixNode]) -> bool:
        return self._evictable(entry[2]) and entry[2].last_access == entry[0]

    def _push_if_evictable(self, node: RadixNode) -> None:
        if node.parent is None or not self._evictable(node):
            return
        self._tiebreak += 1
        heapq.heappush(self._heap, (node.last_access, self._tiebreak, node))
        if len(self._heap) > 2 * self.n_nodes + 64:  # drop stale and repeated entries
            live = {id(e[2]): e for e in self._heap if self._live(e)}  # amortized O(1) a push
            self._heap = list(live.values())
            heapq.heapify(self._heap)
