"""Scenario files load, and workloads are a pure function of the scenario (seed included)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path

import pytest

from radixserve.bench.client import RequestOptions, chat_body
from radixserve.bench.scenarios import (
    KIND_PARAMS,
    QUOTE_SYSTEM,
    Scenario,
    build_workload,
    cleanup_session,
    load_scenario,
    make_text,
    quote_passages,
    scenario_names,
    split_at_restart,
    warmup_sessions,
)
from radixserve.text.chat_template import ChatTemplate
from radixserve.text.tokenizer import Tokenizer


REQUIRED = {"shared-prefix-main", "exact-reuse", "no-sharing", "prefix-512", "prefix-1024",
            "prefix-2048", "prefix-4096", "concurrency-1", "concurrency-4", "capacity-lru-512",
            "multi-turn-chat", "shared-prefix-shuffled", "shared-prefix-long", "single-stream",
            "decode-4", "rag-quote", "restart-shared-prefix", "agent-loop", "capacity-hot8-200"}


def test_engine_yardsticks_compute_every_prompt() -> None:
    """Issue #11's scenarios: long answers on shared prefixes; engine rates with the cache off."""
    long = load_scenario("shared-prefix-long")
    assert long.kind == "shared-prefix" and long.n_predict >= 200 and long.cache_prompt
    for name in ("single-stream", "decode-4"):
        s = load_scenario(name)
        assert s.cache_prompt is False and s.params["doc_tokens"] == 1600
    assert load_scenario("single-stream").concurrency == 1
    assert load_scenario("decode-4").concurrency == 4


def _prompts(s: Scenario) -> list[tuple[str, tuple[str, ...]]]:
    return [(x.system, x.user_turns) for x in build_workload(s)]


def test_every_required_scenario_ships_and_loads() -> None:
    assert REQUIRED <= set(scenario_names())
    for name in scenario_names():
        s = load_scenario(name)
        assert s.name == name and s.kind in KIND_PARAMS
        assert build_workload(s), name


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_same_seed_same_prompts(name: str) -> None:
    assert _prompts(load_scenario(name)) == _prompts(load_scenario(name))


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_different_seed_different_prompts(name: str) -> None:
    s = load_scenario(name)
    other = dataclasses.replace(s, seed=s.seed + 1)
    assert _prompts(s) != _prompts(other)


def test_make_text_is_deterministic_and_sized() -> None:
    a, b = make_text(random.Random(5), 130), make_text(random.Random(5), 130)
    assert a == b and a != make_text(random.Random(6), 130)
    # 120 words + 10 sentence-ending periods ~ 130 tokens for the default tokenizer
    assert len(a.split()) == 120 and a.count(".") == 10


def test_shared_prefix_shape() -> None:
    s = load_scenario("shared-prefix-main")
    w = build_workload(s)
    p = s.params
    assert (p["n_docs"], p["n_questions"], s.concurrency) == (4, 8, 4)  # issue #5's measure
    assert len(w) == p["n_docs"] * p["n_questions"]
    assert len({x.system for x in w}) == p["n_docs"]  # questions share their document
    assert len({x.user_turns for x in w}) == len(w)  # every question differs
    # grouped: each document's questions together, in question order
    assert [x.id for x in w] == [f"d{d}q{q}" for d in range(4) for q in range(8)]


def test_shuffled_and_round_robin_orders_use_the_same_prompts() -> None:
    main = load_scenario("shared-prefix-main")
    shuffled = load_scenario("shared-prefix-shuffled")
    assert shuffled.order == "shuffle" and main.params == shuffled.params
    w, ws = build_workload(main), build_workload(shuffled)
    assert sorted(_prompts(main)) == sorted(_prompts(shuffled))
    assert [x.id for x in ws] != [x.id for x in w]
    rr = build_workload(dataclasses.replace(main, order="round-robin"))
    assert [x.id for x in rr][:5] == ["d0q0", "d1q0", "d2q0", "d3q0", "d0q1"]


def test_no_sharing_prompts_differ_from_the_first_word() -> None:
    w = build_workload(load_scenario("no-sharing"))
    firsts = [x.system.split()[0] for x in w]
    assert len({x.system for x in w}) == len(w)
    assert len(set(firsts)) > 1


def test_exact_reuse_repeats_one_prompt() -> None:
    w = build_workload(load_scenario("exact-reuse"))
    assert len({(x.system, x.user_turns) for x in w}) == 1 and len(w) > 1


def test_multi_turn_sessions() -> None:
    s = load_scenario("multi-turn-chat")
    w = build_workload(s)
    assert len(w) == s.params["n_conversations"]
    assert all(len(x.user_turns) == s.params["n_turns"] for x in w)
    assert len({x.system for x in w}) == 1  # one shared system prompt


def test_agent_loop_sessions_share_the_tools_and_outnumber_the_slots() -> None:
    s = load_scenario("agent-loop")
    w = build_workload(s)
    p = s.params
    assert len(w) == p["n_sessions"] and len({x.system for x in w}) == 1  # the tools, shared
    assert all(len(x.user_turns) == p["n_steps"] for x in w)
    assert all(x.user_turns[0].startswith("task: ") for x in w)
    assert all(t.startswith("tool result: ") for x in w for t in x.user_turns[1:])
    assert len({x.user_turns[0] for x in w}) == len(w)  # each its own task
    n_slots = int(s.server_args[s.server_args.index("-np") + 1])
    assert len(w) > n_slots and s.concurrency == n_slots
    assert len(w[0].system.split()) > 1500 and s.n_predict <= 64  # long tools, short answers


def test_capacity_hot_set_is_refreshed_between_cold_rounds() -> None:
    s = load_scenario("capacity-lru-512")
    w = build_workload(s)
    p = s.params
    hot = [x for x in w if x.group == "hot"]
    cold = [x for x in w if x.group == "cold"]
    assert len(cold) == p["n_cold"] and len({x.system for x in cold}) == p["n_cold"]
    assert len({x.system for x in hot}) == p["n_hot"]
    assert w[-1].group == "hot" and w[0].group == "cold"
    # the cold sweep alone must exceed the host cache (23 KiB of bf16 KV per SmolLM2 token)
    cache_mib = int(s.server_args[s.server_args.index("--cache-ram") + 1])
    assert p["n_cold"] * p["doc_tokens"] * 23 * 1024 > cache_mib * 2**20


def test_warmup_and_cleanup_share_nothing_with_the_workload() -> None:
    for name in REQUIRED:
        s = load_scenario(name)
        texts = {x.system for x in build_workload(s)}
        extra = [*warmup_sessions(s), cleanup_session(s)]
        assert all(x.system not in texts for x in extra)
        assert all(x.system.split()[0] != "you" for x in extra)  # not the shared instruction


def test_bad_scenarios_are_rejected(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown scenario"):
        load_scenario("no-such-scenario")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "bad", "kind": "shared-prefix", "seed": 1,
                               "concurrency": 1, "n_predict": 1}))
    with pytest.raises(ValueError, match="lacks n_docs"):
        load_scenario(str(bad))
    bad.write_text(json.dumps({"name": "bad", "kind": "nope"}))
    with pytest.raises(ValueError, match="kind"):
        load_scenario(str(bad))
    bad.write_text(json.dumps({"name": "bad", "kind": "shared-prefix", "order": "sorted"}))
    with pytest.raises(ValueError, match="order must be one of shuffle, round-robin, grouped"):
        load_scenario(str(bad))


def _quote_parts(user: str) -> tuple[str, str]:
    """A rag-quote user message -> (document, opening named by the request)."""
    head, _, request = user.rpartition("\n\n")
    assert head.startswith("Document:\n")
    assert request.startswith("Repeat verbatim the paragraph that begins with \"")
    return head.removeprefix("Document:\n"), request.split('"')[1]


def test_rag_quote_requests_quote_real_paragraphs_of_their_document() -> None:
    s = load_scenario("rag-quote")
    p = s.params
    w = build_workload(s)
    docs = [d["text"] for d in s.documents]
    assert len(docs) >= 3 and all(len(d) > 800 for d in docs)
    assert all(any("\u4e00" <= ch <= "\u9fff" for ch in d) for d in docs)  # Chinese text
    assert len(w) == len(docs) * p["n_quotes"] and p["n_quotes"] >= 2
    assert {x.group for x in w} == {f"doc{d}" for d in range(len(docs))}
    asked = set()
    for x in w:
        assert x.system == QUOTE_SYSTEM and len(x.user_turns) == 1
        doc, opening = _quote_parts(x.user_turns[0])
        assert doc == docs[int(x.group.removeprefix("doc"))]
        # the opening names exactly one place in the document: the start of a paragraph
        # (one line, long enough that the whole answer can be a quote)
        assert len(opening) >= p["opening_chars"] and doc.count(opening) == 1
        para = next(q for q in doc.split("\n\n") if q.startswith(opening))
        assert "\n" not in para and len(para) >= p["passage_min_chars"]
        asked.add((x.group, opening))
    assert len(asked) == len(w)  # every request asks for a different paragraph
    # requests on one document share the system prompt and the document: a reusable prefix
    for d in range(len(docs)):
        users = [x.user_turns[0] for x in w if x.group == f"doc{d}"]
        assert all(u.startswith("Document:\n" + docs[d] + "\n\n") for u in users)
    # shuffled: one document's requests do not all come together
    groups = [x.group for x in w]
    assert any(a != b for a, b in zip(groups, sorted(groups, key=groups.index)))


def test_rag_quote_is_greedy_and_long_enough_to_quote() -> None:
    s = load_scenario("rag-quote")
    assert 96 <= s.n_predict <= 256 and s.cache_prompt
    body = chat_body([{"role": "user", "content": "x"}],
                     RequestOptions(s.n_predict, fields=s.request_fields))
    assert body["temperature"] == 0.0 and body["max_tokens"] == s.n_predict


def test_quote_passages_picks_prose_paragraphs_named_uniquely() -> None:
    prose = " ".join(["alpha beta gamma delta"] * 3)
    doc = "\n\n".join([
        "short one.",                       # too short
        "code line one\n" + prose,          # spans lines: code, lists, tables
        " " + prose,                        # indented (a list item)
        "Same start, then " + prose,        # shares its first 10 characters with the next
        "Same start, than " + prose,
        "x" * 9 + "word" + prose,           # a cut inside an ASCII word moves past it
    ])
    ps = quote_passages(doc, min_chars=40, opening_chars=10)
    assert [p.text[:5] for p in ps] == ["Same ", "Same ", "xxxxx"]
    # unique from "Same start, the" on; then the cut moves to the end of the word
    assert [p.opening for p in ps[:2]] == ["Same start, then", "Same start, than"]
    assert ps[2].opening == "x" * 9 + "wordalpha"
    assert all(doc.count(p.opening) == 1 and p.text.startswith(p.opening) for p in ps)


def test_rag_quote_orders_and_bad_documents(tmp_path) -> None:
    s = load_scenario("rag-quote")
    rr = build_workload(dataclasses.replace(s, order="round-robin"))
    n = len(s.documents)
    assert [x.group for x in rr][:n + 1] == [f"doc{d}" for d in range(n)] + ["doc0"]
    grouped = build_workload(dataclasses.replace(s, order="grouped"))
    assert [x.group for x in grouped] == sorted(x.group for x in grouped)
    obj = json.loads((Path(__file__).resolve().parents[2] / "radixserve" / "bench"
                      / "scenarios" / "rag-quote.json").read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(obj | {"n_quotes": 50}))
    with pytest.raises(ValueError, match="n_quotes is 50"):
        load_scenario(str(bad))
    bad.write_text(json.dumps(obj | {"documents": []}))
    with pytest.raises(ValueError, match="needs documents"):
        load_scenario(str(bad))


def test_restart_scenario_restarts_halfway_before_a_return_to_a_document() -> None:
    s = load_scenario("restart-shared-prefix")
    assert s.kind == "shared-prefix" and s.restart_after == "halfway" and s.cache_prompt
    assert s.n_predict <= 16 and s.concurrency in (1, 2)  # short greedy answers
    before, after = split_at_restart(s)
    assert len(before) == len(after) == 6
    # the first request after the restart needs a document the first server saw: a disk tier
    # can give its prefix back, a RAM-only cache cannot
    assert after[0].system in {x.system for x in before}
    assert {x.group for x in before} == {x.group for x in after} == {"doc0", "doc1"}
    assert split_at_restart(load_scenario("prefix-512")) == (
        build_workload(load_scenario("prefix-512")), [])


def test_restart_scenario_prefix_is_about_4k_tokens_and_fits(
        tok_tmpl: tuple[Tokenizer, ChatTemplate]) -> None:
    """On the default model's tokenizer and template (the tiny model's are copies)."""
    tok, tmpl = tok_tmpl
    s = load_scenario("restart-shared-prefix")
    w = build_workload(s)

    def ids(x: object) -> list[int]:
        return tok.encode(tmpl.render([{"role": "system", "content": x.system},
                                       {"role": "user", "content": x.user_turns[0]}]))

    same = [ids(x) for x in w if x.group == "doc0"][:2]
    other = next(ids(x) for x in w if x.group == "doc1")
    prefix = len(os.path.commonprefix(same))
    assert 3500 <= prefix <= 4500
    assert len(os.path.commonprefix([same[0], other])) < 100  # the documents differ early
    # both documents' prompts and answers fit the (unified) context at once
    ctx = int(s.server_args[s.server_args.index("-c") + 1])
    assert 2 * (max(len(same[0]), len(other)) + s.n_predict) <= ctx


def _with_restart(tmp_path: Path, name: str, restart_after: object, **kw: object) -> Path:
    """A small scenario file: 2 documents x 2 questions unless `kw` gives another kind."""
    path = tmp_path / f"{name}.json"
    sizes = kw or {"kind": "shared-prefix", "n_docs": 2, "doc_tokens": 8, "n_questions": 2,
                   "question_tokens": 4}
    obj = {"name": name, "seed": 1, "concurrency": 1, "n_predict": 1,
           "restart_after": restart_after, **sizes}
    path.write_text(json.dumps(obj))
    return path


def test_restart_points_are_checked(tmp_path: Path) -> None:
    s = load_scenario(str(_with_restart(tmp_path, "three", 3)))
    assert [len(x) for x in split_at_restart(s)] == [3, 1]
    for bad, match in ((0, "no requests on one side"), (4, "no requests on one side"),
                       ("soon", "number of requests or 'halfway'"),
                       (True, "number of requests")):
        with pytest.raises(ValueError, match=match):
            load_scenario(str(_with_restart(tmp_path, "bad", bad)))
    # multi-turn sessions are not cut in two: 3 conversations x 2 turns
    chat = {"kind": "multi-turn", "n_conversations": 3, "n_turns": 2, "system_tokens": 8,
            "turn_tokens": 4}
    with pytest.raises(ValueError, match="inside a multi-turn session"):
        load_scenario(str(_with_restart(tmp_path, "chat", 3, **chat)))
    s = load_scenario(str(_with_restart(tmp_path, "chat", "halfway", **chat)))
    assert [len(x) for x in split_at_restart(s)] == [2, 1]  # 4 of 6 requests, then 2
