"""The cache view (`GET /cache`'s body, memory/cache_view.py) against the engine's own state, on
the default model: cells two slots really share, the radix tree's real shape after two prompts
with one document, the reuse each task reported, and salted namespaces shown without text."""

from __future__ import annotations

import json
import random

import pytest

from radixserve.bench.scenarios import make_text
from radixserve.memory.tiers.prefix import common_prefix
from radixserve.config import ServerConfig
from radixserve.memory.cache_view import PREVIEW, CacheView, snapshot
from radixserve.engine.counters import ServerMetrics
from radixserve.engine.build import build_scheduler
from radixserve.engine.slot import SlotState
from radixserve.engine.task import CompletionTask, FinalResult
from radixserve.model.loader import Model
from radixserve.sampling.chain import SamplingParams
from tests.engine.test_deterministic import run_to_end

pytestmark = pytest.mark.model


def greedy(prompt: list[int], salt: str = "") -> CompletionTask:
    return CompletionTask(list(prompt), SamplingParams(temperature=0), n_predict=8,
                          ignore_eos=True, cache_salt=salt)


@pytest.fixture(scope="module")
def prompts(model: Model) -> dict[str, list[int]]:
    rng, enc = random.Random(5), model.tokenizer.encode
    doc = enc("document: " + make_text(rng, 120))
    return {"doc": doc,
            "a": doc + [2101] + enc(" question: " + make_text(rng, 8), add_special=False),
            "b": doc + [2202] + enc(" question: " + make_text(rng, 8), add_special=False)}


def test_view_of_slots_sharing_cells_then_of_the_tree(model: Model,
                                                        prompts: dict[str, list[int]]) -> None:
    cfg = ServerConfig(ctx_size=1024, n_parallel=2, kv_unified=True, ubatch_size=64)
    sched = build_scheduler(model, cfg, ServerMetrics())
    outs: list[list] = [[], []]
    for p, out in zip((prompts["a"], prompts["b"]), outs):
        sched.submit(greedy(p), out.append)
    while not all(s.state is SlotState.GENERATING for s in sched.slots):
        sched.step()
    # mid-run: the second task waited for the first's prefill and reads the same cells
    pool, view = sched.pool, snapshot(sched.mem, sched.metrics)
    both = set(pool.seq_cells(0)) & set(pool.seq_cells(1))
    assert len(both) >= len(prompts["doc"])
    assert view["device"] == {"n_cells": pool.n_cells, "used_cells": pool.n_cells - pool.n_free,
                              "shared_cells": len(both), "bytes_per_cell": pool.bytes_per_cell}
    for s, v in zip(sched.slots, view["slots"]):
        assert v["id"] == s.id and v["state"] == "generating" and v["salted"] is False
        assert v["n_tokens"] == len(s.kv.tokens) and v["shared_cells"] == len(both)
    while sched.has_active():
        sched.step()
    finals = [o[-1] for o in outs]
    assert all(isinstance(f, FinalResult) for f in finals)
    assert finals[1].timings.cache_n >= len(prompts["doc"])

    # both idle slots go to the radix tree: one node for the shared part, one leaf per prompt
    held = [list(s.kv.tokens) for s in sched.slots]
    sched.mem.host.cache_idle_slots(sched.slots)
    view = snapshot(sched.mem, sched.metrics)
    tree = sched.mem.host.cache.tree  # type: ignore[attr-defined]
    assert view["backend"] == "radix" and view["entries"] == []
    (root,) = view["tree"]["roots"]
    assert root["namespace"] == "" and root["leaves"] == 2 and root["more"] == 0
    assert root["subtree_tokens"] == tree.unique_tokens == sum(map(len, held)) - common_prefix(
        *held)
    assert root["bytes"] == tree.bytes == view["ram"]["bytes"]
    (shared,) = root["children"]
    lcp = common_prefix(*held)
    assert (shared["depth"], shared["tokens"], shared["leaves"]) == (lcp, lcp, 2)
    assert shared["text"] == prompts["doc"][:PREVIEW]
    assert sorted((c["depth"], c["tokens"]) for c in shared["children"]) == sorted(
        (len(h), len(h) - lcp) for h in held)
    assert all(c["children"] == [] and c["leaves"] == 1 for c in shared["children"])
    lru = view["tree"]["lru"]
    assert sorted(e["depth"] for e in lru) == sorted(map(len, held))
    assert sorted(e["text"] for e in lru) == sorted(h[-PREVIEW:] for h in held)
    assert view["ram"]["prompts"] == 2 and view["ram"]["unique_tokens"] == tree.unique_tokens
    assert view["ram"]["logical_tokens"] == sum(map(len, held))
    assert all(v["n_tokens"] == 0 and v["state"] == "idle" for v in view["slots"])

    # reuse over time: what each task reported (both prompts were done in the same step)
    assert sorted((h["prompt_n"], h["cache_n"]) for h in view["history"]) == sorted(
        (f.timings.prompt_n, f.timings.cache_n) for f in finals)
    assert view["history"][0]["time"] <= view["history"][1]["time"] <= view["time"]
    assert view["totals"] == {"requests": 2,
                              "prompt_tokens": sum(f.timings.prompt_n for f in finals),
                              "cached_tokens": sum(f.timings.cache_n for f in finals)}


def test_a_salted_namespace_is_shown_without_its_salt_or_text(
        model: Model, prompts: dict[str, list[int]]) -> None:
    sched = build_scheduler(model, ServerConfig(ctx_size=1024, n_parallel=2), ServerMetrics())
    run_to_end(sched, [greedy(prompts["a"])])
    (f,) = run_to_end(sched, [greedy(prompts["b"], salt="tenant-secret-7")])
    assert f.timings.cache_n == 0  # salts never share
    n_salted = len(next(s for s in sched.slots if s.kv.salt).kv.tokens)
    view = snapshot(sched.mem, sched.metrics)
    assert [v["salted"] for v in view["slots"]] == [bool(s.kv.salt) for s in sched.slots]
    sched.mem.host.cache_idle_slots(sched.slots)
    view = snapshot(sched.mem, sched.metrics)
    open_, hidden = view["tree"]["roots"]
    assert open_["namespace"] == "" and hidden["namespace"] == "salted #1"
    assert (hidden["subtree_tokens"], hidden["leaves"]) == (n_salted, 1)
    assert open_["children"][0]["text"] == prompts["a"][:PREVIEW]

    def texts(node: dict) -> list:
        return [node.get("text")] + [t for c in node["children"] for t in texts(c)]

    assert texts(hidden)[1:] and all(t is None for t in texts(hidden)[1:])
    assert sorted(e["text"] is None for e in view["tree"]["lru"]) == [False, True]
    assert "tenant-secret-7" not in json.dumps(view)


@pytest.mark.parametrize("legacy", [False, True])
def test_no_text_at_all_unless_the_server_shows_it(model: Model, prompts: dict[str, list[int]],
                                                   legacy: bool) -> None:
    """The engine's view as `serve` builds it without LLAMA_SERVER_SLOTS_DEBUG: no namespace's
    text, in the tree, the eviction order or the legacy entries."""
    cfg = ServerConfig(ctx_size=1024, n_parallel=2, cache_radix_prompt=not legacy)
    sched = build_scheduler(model, cfg, ServerMetrics())
    run_to_end(sched, [greedy(prompts["a"])])
    run_to_end(sched, [greedy(prompts["b"], salt="s")])
    sched.mem.host.cache_idle_slots(sched.slots)

    def texts(v: object) -> list[object]:
        if isinstance(v, dict):
            return [x for k, w in v.items() for x in ([w] if k == "text" else texts(w))]
        return [x for w in v for x in texts(w)] if isinstance(v, list) else []

    shown = snapshot(sched.mem, sched.metrics, show_text=True)
    hidden = snapshot(sched.mem, sched.metrics, show_text=False)
    assert any(t is not None for t in texts(shown))  # there is text to hide
    assert texts(hidden) and all(t is None for t in texts(hidden))
    assert (shown["text_shown"], hidden["text_shown"]) == (True, False)


def test_legacy_entries_oldest_first(model: Model, prompts: dict[str, list[int]]) -> None:
    cfg = ServerConfig(ctx_size=1024, n_parallel=2, cache_radix_prompt=False)
    sched = build_scheduler(model, cfg, ServerMetrics())
    run_to_end(sched, [greedy(prompts["a"])])
    run_to_end(sched, [greedy(list(range(3000, 3040)))])  # unrelated: another slot
    held = [list(s.kv.tokens) for s in sched.slots if len(s.kv)]
    assert len(held) == 2
    sched.mem.host.cache_idle_slots(sched.slots)
    view = snapshot(sched.mem, sched.metrics)
    assert view["backend"] == "legacy" and view["tree"] is None
    assert sorted(e["tokens"] for e in view["entries"]) == sorted(map(len, held))
    assert [e["tokens"] for e in view["entries"]] == [len(e.tokens)
                                                      for e in sched.mem.host.cache.states]
    assert sorted(e["text"] for e in view["entries"]) == sorted(h[-PREVIEW:] for h in held)
    assert view["ram"]["prompts"] == 2 and view["ram"]["bytes"] == sum(
        e["bytes"] for e in view["entries"])


def test_the_tree_part_is_kept_until_the_tree_changes_and_locked_leaves_are_not_next(
        model: Model, prompts: dict[str, list[int]]) -> None:
    """Polls of an unchanged tree reuse its drawing; any change (a new prompt, a lock) is seen
    by the next poll; a leaf a restore holds is not listed for eviction; the eviction list
    shows a prompt's last words even when its own edge is shorter."""
    sched = build_scheduler(model, ServerConfig(ctx_size=1024, n_parallel=1), ServerMetrics())
    run_to_end(sched, [greedy(prompts["a"])])
    sched.mem.host.cache_idle_slots(sched.slots)
    view = CacheView(show_text=True)
    first = view.snapshot(sched.mem, sched.metrics)
    # unchanged: not walked again
    assert view.snapshot(sched.mem, sched.metrics)["tree"] is first["tree"]
    # a prompt one token past the stored one: its own edge is 1 token (any rows will do here:
    # the view reads tokens and sizes, never the K/V values)
    tree = sched.mem.host.cache.tree  # type: ignore[attr-defined]
    stored = list(sched.slots[0].kv.tokens)
    k, v = next(tree.match(stored).all_rows())[1][:2]
    node = tree.insert(stored + [7], k[:, :, :1].clone(), v[:, :, :1].clone())
    second = view.snapshot(sched.mem, sched.metrics)
    assert second["tree"] is not first["tree"] and second["tree"]["nodes"] == 2
    (leaf,) = second["tree"]["lru"]
    assert (leaf["tokens"], leaf["depth"]) == (1, len(stored) + 1)
    assert leaf["text"] == (stored + [7])[-PREVIEW:]
    tree.lock(node)
    assert view.snapshot(sched.mem, sched.metrics)["tree"]["lru"] == []  # eviction would skip it
    tree.unlock(node)
    assert len(view.snapshot(sched.mem, sched.metrics)["tree"]["lru"]) == 1
    # one slot: nothing shared
    assert view.snapshot(sched.mem, sched.metrics)["device"]["shared_cells"] == 0


def test_salted_namespaces_are_numbered_by_size(model: Model,
                                                prompts: dict[str, list[int]]) -> None:
    sched = build_scheduler(model, ServerConfig(ctx_size=1024, n_parallel=2), ServerMetrics())
    run_to_end(sched, [greedy(prompts["a"][:20], salt="small-first")])
    run_to_end(sched, [greedy(prompts["b"], salt="large-second")])
    sched.mem.host.cache_idle_slots(sched.slots)
    roots = snapshot(sched.mem, sched.metrics)["tree"]["roots"]
    assert [r["namespace"] for r in roots] == ["", "salted #1", "salted #2"]
    assert roots[0]["leaves"] == 0 and roots[1]["bytes"] > roots[2]["bytes"] > 0
    assert roots[1]["subtree_tokens"] > roots[2]["subtree_tokens"]
