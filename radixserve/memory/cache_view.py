"""What the cache holds and saves, as one JSON-ready snapshot (`GET /cache`, the page's view).

Built on the engine thread (it reads the pool, the slots and the host tier, which only that
thread touches), so it must stay cheap while a page polls it every second: the tree is walked
only when it changed since the last snapshot (`RadixTree.version`), the slots' cells are scanned
only where cells can be shared (unified KV), and the HTTP side serves one snapshot to every
poll within half a second. Text previews leave the engine as token ids (`PREVIEW` of them) and
are detokenized by the HTTP side, off this thread.

Who sees what follows llama-server's `/slots` (whose prompt text appears only with
`LLAMA_SERVER_SLOTS_DEBUG` set): with `--no-slots` there is no view at all (the route's 501);
prompt text (`text`) is shown only when the server runs with that variable (`show_text`), else
every `text` is None, so a key holder learns sizes and reuse, never what others asked; and a
`cache_salt` namespace never shows its salt or its tokens, whatever the setting: its sizes
appear under an ordinal label ("salted #1").
"""

from __future__ import annotations

import heapq
import time
from typing import TYPE_CHECKING, Any

from radixserve.memory.tiers.legacy import LegacyPromptCache
from radixserve.memory.tiers.radix import RadixPromptCache
from radixserve.memory.tiers.radix_tree import RadixNode, RadixTree

if TYPE_CHECKING:
    from radixserve.memory.manager import MemoryManager

PREVIEW = 12  # tokens of text shown per node or entry
MAX_NODES = 60  # nodes drawn in all; the rest are counted in their parent's `more`
MAX_CHILDREN = 6  # widest branches drawn per node
MAX_LRU = 10


class CacheView:
    """Builds snapshots; the tree's part is kept while the tree is unchanged (its `version`),
    so an idle server's polls cost one pass over the slots' cells, not a walk of the tree."""

    def __init__(self, show_text: bool = False) -> None:
        self.show_text = show_text  # the unsalted namespace's text (LLAMA_SERVER_SLOTS_DEBUG)
        self._memo: tuple[RadixTree | None, int, dict[str, Any] | None] = (None, -1, None)

    def snapshot(self, mem: MemoryManager, m: Any) -> dict[str, Any]:
        """The /cache body, with every `text` a list of token ids (or None: not shown); the
        caller must not modify it (parts are shared with later snapshots). `m`: the engine's
        request counters (totals and the recent prompts' reuse)."""
        cache = mem.cache
        stats = cache.stats()
        disk = mem.tier_figures().get("disk")
        device, per_slot = cells_json(mem)
        return {
            "time": time.time(),
            "text_shown": self.show_text,
            "backend": cache.name,
            "device": device,
            "slots": [slot_json(s, n) for s, n in zip(mem.slots, per_slot)],
            "ram": {
                "bytes": int(stats["bytes"]), "limit_bytes": int(stats["limit_bytes"]),
                "nodes": int(stats["nodes"]), "prompts": int(stats["terminal_nodes"]),
                "unique_tokens": int(stats["unique_tokens"]),
                "logical_tokens": int(stats["logical_tokens"]),
                "hit_tokens": int(stats["hit_tokens"]), "evictions": int(stats["evictions"]),
                "pins": int(stats["pins"]), "pinned_bytes": int(stats["pinned_bytes"]),
            },
            "disk": None if disk is None else {
                "bytes": int(disk["bytes"]), "limit_bytes": int(disk["limit_bytes"]),
                "tokens": int(disk["tokens"]),
                "files": int(disk["tokens"]) // mem.cfg.cache_disk_block,
                "hits": int(disk["hits"]), "misses": int(disk["misses"]),
                "writes": int(disk["writes"]),
            },
            "tree": self._tree(cache.tree) if isinstance(cache, RadixPromptCache) else None,
            "entries": (legacy_entries(cache, self.show_text)
                        if isinstance(cache, LegacyPromptCache) else []),
            "totals": {"requests": m.prompts_done_total, "prompt_tokens": m.prompt_tokens_total,
                       "cached_tokens": m.prompt_tokens_cached_total},
            "history": [{"time": t, "prompt_n": n, "cache_n": c}
                        for t, n, c in m.recent_prompts],
        }

    def _tree(self, tree: RadixTree) -> dict[str, Any]:
        held, version, out = self._memo
        if held is not tree or version != tree.version or out is None:
            out = tree_json(tree, self.show_text)
            self._memo = (tree, tree.version, out)
        return out


def snapshot(mem: MemoryManager, m: Any, show_text: bool = True) -> dict[str, Any]:
    """One snapshot, nothing kept (tests)."""
    return CacheView(show_text).snapshot(mem, m)


def cells_json(mem: MemoryManager) -> tuple[dict[str, int], list[int]]:
    """The pool's figures, and each slot's cells that another slot reads too. Only unified KV
    shares cells (a partitioned pool copies them), so only then are they counted."""
    pool = mem.pool
    per_slot = [0] * len(mem.slots)
    shared: set[int] = set()
    if pool.unified:
        for i, s in enumerate(mem.slots):
            mine = [c for c in pool.seq_cells(s.id) if len(pool.cell_seqs[c]) > 1]
            per_slot[i] = len(mine)
            shared.update(mine)
    return {"n_cells": pool.n_cells, "used_cells": pool.n_cells - pool.n_free,
            "shared_cells": len(shared), "bytes_per_cell": pool.bytes_per_cell}, per_slot


def slot_json(slot: Any, shared_cells: int) -> dict[str, Any]:
    return {
        "id": slot.id, "state": slot.state.value, "n_ctx": slot.n_ctx,
        "n_tokens": len(slot.kv.tokens), "shared_cells": shared_cells,
        "salted": bool(slot.kv.salt),
        # the current (or last) task's reuse; 0 before a slot's first task
        "n_prompt_tokens_cache": slot.n_cached,
        "n_prompt_tokens_processed": slot.n_prompt_processed,
    }


def tree_json(tree: RadixTree, show_text: bool) -> dict[str, Any]:
    """Each namespace's largest subtrees (widest branches first, `MAX_NODES` in all) and the
    stored prompts next in line for eviction; text only of the unsalted namespace, and only
    with `show_text`."""
    agg: dict[int, tuple[int, int, int]] = {}  # id(node) -> (subtree tokens, leaves, bytes)
    leaves: list[tuple[RadixNode, bool]] = []  # (leaf, in the shared namespace)

    def total(node: RadixNode) -> tuple[int, int, int]:
        stack, order = [node], []
        while stack:  # iterative: a long chain of edges must not hit the recursion limit
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        for n in reversed(order):
            toks, nl, nb = len(n.tokens), 0, n.nbytes
            for c in n.children.values():
                ct, cl, cb = agg[id(c)]
                toks, nl, nb = toks + ct, nl + cl, nb + cb
            if not n.children and n.parent is not None:
                nl = 1
                leaves.append((n, show_text and not node.ns))
            agg[id(n)] = (toks, nl, nb)
        return agg[id(node)]

    sizes = {ns: total(root) for ns, root in tree.roots.items()}
    salted = sorted((ns for ns in tree.roots if ns), key=lambda ns: -sizes[ns][2])
    budget = [MAX_NODES]
    roots = []
    for i, ns in enumerate(["", *salted]):
        toks, nl, nb = sizes[ns]
        children, more = _draw(tree.roots[ns], agg, budget, show_text=show_text and not ns)
        roots.append({"namespace": f"salted #{i}" if ns else "", "subtree_tokens": toks,
                      "leaves": nl, "bytes": nb, "children": children, "more": more})
    # what eviction takes first: unlocked leaves, least recently used first
    lru = heapq.nsmallest(MAX_LRU, (e for e in leaves if e[0].lock_ref == 0),
                          key=lambda e: e[0].last_access)
    return {
        "nodes": tree.n_nodes,
        "roots": roots,
        "lru": [{"depth": n.depth, "tokens": len(n.tokens), "bytes": n.nbytes,
                 "text": _tail(n) if shown else None} for n, shown in lru],
    }


def _tail(node: RadixNode) -> list[int]:
    """The last `PREVIEW` tokens of the prompt stored at `node` (edges up to the root)."""
    out: list[int] = []
    n: RadixNode | None = node
    while n is not None and len(out) < PREVIEW:
        out = n.tokens[-(PREVIEW - len(out)):] + out
        n = n.parent
    return out


def _draw(node: RadixNode, agg: dict[int, tuple[int, int, int]], budget: list[int],
          show_text: bool) -> tuple[list[dict[str, Any]], int]:
    """`node`'s widest children as nested dicts, and how many children were left out."""
    kids = sorted(node.children.values(), key=lambda c: -agg[id(c)][0])
    out = []
    for c in kids[:MAX_CHILDREN]:
        if budget[0] <= 0:
            break
        budget[0] -= 1
        toks, nl, nb = agg[id(c)]
        children, more = _draw(c, agg, budget, show_text)
        out.append({"tokens": len(c.tokens), "depth": c.depth, "subtree_tokens": toks,
                    "leaves": nl, "bytes": nb, "text": c.tokens[:PREVIEW] if show_text else None,
                    "children": children, "more": more})
    return out, len(kids) - len(out)


def legacy_entries(cache: LegacyPromptCache, show_text: bool) -> list[dict[str, Any]]:
    """llama.cpp's whole-prompt entries, oldest (next to go) first."""
    return [{"tokens": len(e.tokens), "bytes": e.size,
             "text": e.tokens[-PREVIEW:] if show_text and not e.salt else None}
            for e in cache.states]
