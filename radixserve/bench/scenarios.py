"""Benchmark scenarios: JSON parameter files shipped in the package -> deterministic workloads.

A scenario file names a workload *kind* and its sizes; `build_workload` turns it into sessions
(a system prompt plus one or more user turns) using only `random.Random(seed)` and a fixed word
list, so the same file gives the same prompts on every machine and run, with no downloads.
Sizes are in tokens of the default model's tokenizer (every word of `WORDS` is one token there);
the figures that matter (prompt tokens computed/reused) are read back from the server anyway.

A scenario may restart the server mid-way (`"restart_after": K` measured requests, or
`"halfway"`): the runner stops the server it started once the first K requests have completed,
starts a new one with the same flags (the same `--cache-disk` directory in the `radix-disk`
mode) and sends the rest there (`split_at_restart`). That measures what survives a restart: a
disk tier keeps the prefixes the first process wrote, a RAM-only cache keeps nothing.

The `rag-quote` kind is the exception: its documents are real text shipped in the scenario file
(three excerpts of Chinese technical prose on llama.cpp's prompt cache and a radix-tree
backend), and each request asks the model to copy one
of a document's paragraphs verbatim, named by its opening characters, so the answers quote the
prompt (the case n-gram speculative decoding is for).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from radixserve.bench.words import WORDS

INSTRUCTION = "you are a document assistant. answer the question from the document only."
AGENT_INSTRUCTION = "you are an agent. call one of the tools below, or answer when done."
# shared-prefix request orders: questions spread out at random, one per document in turn, or
# each document's questions together (a burst of traffic on one hot document at a time)
ORDERS = ("shuffle", "round-robin", "grouped")
APIS = ("chat", "messages", "responses")  # Scenario.api
# kind -> the size parameters its JSON must give
KIND_PARAMS: dict[str, tuple[str, ...]] = {
    "shared-prefix": ("n_docs", "doc_tokens", "n_questions", "question_tokens"),
    "exact-reuse": ("doc_tokens", "question_tokens", "n_requests"),
    "no-sharing": ("doc_tokens", "question_tokens", "n_requests"),
    "multi-turn": ("n_conversations", "n_turns", "system_tokens", "turn_tokens"),
    # agent sessions: a long shared tool prefix, a task, then a tool result after each answer
    "agent-loop": ("n_sessions", "n_steps", "tools_tokens", "task_tokens", "result_tokens"),
    "capacity": ("n_hot", "n_cold", "cold_per_round", "doc_tokens", "question_tokens"),
    # documents come from the file's `documents`; each is asked for `n_quotes` of its paragraphs
    "rag-quote": ("n_quotes", "passage_min_chars", "opening_chars"),
}
# rag-quote: the document goes in the user message, the request after it. SmolLM2-135M copies
# text of the document far more often so than with the document in the system message (it
# then mostly answers in English); it still often copies another paragraph than the one asked
QUOTE_SYSTEM = "You copy text exactly."
QUOTE_REQUEST = 'Repeat verbatim the paragraph that begins with "{opening}".'
# `restart_after`: restart once half of the measured requests (rounded down) have completed
HALFWAY = "halfway"


@dataclass(slots=True)
class Scenario:
    """One JSON file. `server_args` go to `radixserve serve` before the mode's own flags."""

    name: str
    kind: str
    seed: int
    concurrency: int
    n_predict: int
    params: dict[str, int]
    description: str = ""
    server_args: list[str] = field(default_factory=list)
    warmup_requests: int = 2
    warmup_tokens: int = 128
    order: str = "shuffle"  # shared-prefix: one of ORDERS
    # false: every request recomputes its whole prompt in every mode (engine yardsticks), so
    # an external server measured repeatedly cannot answer from what an earlier run cached
    cache_prompt: bool = True
    # more body fields for every measured request (e.g. a `json_schema` constraint)
    request_fields: dict[str, Any] = field(default_factory=dict)
    # rag-quote: real documents, [{"source": where the excerpt comes from, "text": ...}]
    documents: list[dict[str, str]] = field(default_factory=list)
    # restart the server after this many measured requests (or HALFWAY); None: never.
    # Only servers the benchmark starts can be restarted (not --url)
    restart_after: int | str | None = None
    # the API the requests go through (bench/client.py APIS): OpenAI chat completions,
    # Anthropic messages, or OpenAI responses chained by `previous_response_id`
    api: str = "chat"

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Scenario:
        obj = dict(obj)
        kind = obj.pop("kind", None)
        if obj.get("order", "shuffle") not in ORDERS:
            raise ValueError(f"scenario order must be one of {', '.join(ORDERS)}, "
                             f"got {obj['order']!r}")
        if kind not in KIND_PARAMS:
            raise ValueError(f"scenario kind must be one of {sorted(KIND_PARAMS)}, got {kind!r}")
        params = {k: int(obj.pop(k)) for k in KIND_PARAMS[kind] if k in obj}
        missing = [k for k in KIND_PARAMS[kind] if k not in params]
        if missing:
            raise ValueError(f"scenario {obj.get('name')!r} ({kind}) lacks {', '.join(missing)}")
        bad = [k for k, v in params.items() if v < 1]
        if bad or int(obj.get("concurrency", 0)) < 1 or int(obj.get("n_predict", 0)) < 1:
            raise ValueError(f"scenario {obj.get('name')!r}: concurrency, n_predict and "
                             f"sizes must be >= 1 {bad or ''}")
        s = cls(kind=kind, params=params, **obj)
        if s.api not in APIS:
            raise ValueError(f"scenario api must be one of {', '.join(APIS)}, got {s.api!r}")
        if kind == "rag-quote":
            _check_documents(s)
        if s.restart_after is not None:
            split_at_restart(s)  # a restart point that leaves nothing on one side is an error
        return s


@dataclass(slots=True, frozen=True)
class Session:
    """A client conversation: its turns run in order, each after the previous one's reply."""

    id: str
    group: str
    system: str
    user_turns: tuple[str, ...]


def _scenario_dir() -> Path:
    return Path(str(resources.files("radixserve.bench") / "scenarios"))


def scenario_names() -> list[str]:
    """Names of the scenarios shipped in the package."""
    return sorted(p.stem for p in _scenario_dir().glob("*.json"))


def load_scenario(name_or_path: str) -> Scenario:
    """A shipped scenario by name, or any JSON file by path."""
    path = Path(name_or_path)
    if not (path.suffix == ".json" and path.is_file()):
        path = _scenario_dir() / f"{name_or_path}.json"
        if not path.is_file():
            raise ValueError(
                f"unknown scenario {name_or_path!r}; shipped: {', '.join(scenario_names())} "
                "(server flags go after `--`)"
            )
    return Scenario.from_json(json.loads(path.read_text()))


def make_text(rng: random.Random, n_tokens: int) -> str:
    """About `n_tokens` tokens of words, in sentences of 12 words (a period is a token too)."""
    n_words = max(1, round(n_tokens * 12 / 13))
    words = [rng.choice(WORDS) for _ in range(n_words)]
    return " ".join(w + "." if i % 12 == 11 else w for i, w in enumerate(words))


def _doc(rng: random.Random, n_tokens: int) -> str:
    return INSTRUCTION + "\n\ndocument:\n" + make_text(rng, n_tokens)


def _question(rng: random.Random, n_tokens: int) -> str:
    return "question: " + make_text(rng, n_tokens) + "?"


@dataclass(slots=True, frozen=True)
class Passage:
    """A paragraph of a document that a rag-quote request asks for, named by `opening`: its
    first characters, as many as it takes to occur only once in the document."""

    text: str
    opening: str


def quote_passages(doc: str, min_chars: int, opening_chars: int) -> list[Passage]:
    """The paragraphs of `doc` (blank-line separated) a request may quote: one line of prose
    (lists, tables and code span lines), at least `min_chars` long, in document order."""
    out = []
    for para in doc.split("\n\n"):
        if "\n" in para or para != para.strip() or len(para) < min_chars:
            continue
        n = opening_chars
        while n < len(para) and (doc.count(para[:n]) > 1 or not _clean_cut(para, n)):
            n += 1
        out.append(Passage(para, para[:n]))
    return out


def _clean_cut(text: str, n: int) -> bool:
    """`text[:n]` ends neither in a blank nor inside an ASCII word or number."""
    a, b = text[n - 1], text[n] if n < len(text) else " "
    return not a.isspace() and not (a.isascii() and a.isalnum() and b.isascii() and b.isalnum())


def _check_documents(s: Scenario) -> None:
    p = s.params
    if not s.documents or not all(isinstance(d.get("text"), str) for d in s.documents):
        raise ValueError(f"scenario {s.name!r} (rag-quote) needs documents: "
                         '[{"source": ..., "text": ...}, ...]')
    for i, d in enumerate(s.documents):
        n = len(quote_passages(d["text"], p["passage_min_chars"], p["opening_chars"]))
        if n < p["n_quotes"]:
            raise ValueError(f"scenario {s.name!r}: document {i} has {n} paragraphs of "
                             f">= {p['passage_min_chars']} characters, n_quotes is "
                             f"{p['n_quotes']}")


def quote_request(doc: str, passage: Passage) -> str:
    """The user message of a rag-quote request: the document, then what to copy from it."""
    return "Document:\n" + doc + "\n\n" + QUOTE_REQUEST.format(opening=passage.opening)


def _rag_quote(s: Scenario, rng: random.Random) -> list[Session]:
    """`n_quotes` paragraphs per document, picked at random; every request of a document
    starts with the same system prompt and document (the prefix the caches can reuse)."""
    p = s.params
    out = []
    for d, doc in enumerate(x["text"] for x in s.documents):
        passages = quote_passages(doc, p["passage_min_chars"], p["opening_chars"])
        picked = sorted(rng.sample(range(len(passages)), p["n_quotes"]))
        out += [Session(f"d{d}p{k}", f"doc{d}", QUOTE_SYSTEM, (quote_request(doc, passages[k]),))
                for k in picked]
    return _order(s, rng, out)


def _order(s: Scenario, rng: random.Random, out: list[Session]) -> list[Session]:
    """Requests in the scenario's `order`, from a list grouped by document."""
    if s.order == "shuffle":
        rng.shuffle(out)
    elif s.order == "round-robin":  # one request per document in turn
        groups: dict[str, list[Session]] = {}
        for x in out:
            groups.setdefault(x.group, []).append(x)
        out = [g[i] for i in range(max(map(len, groups.values()))) for g in groups.values()
               if i < len(g)]
    return out


def build_workload(s: Scenario) -> list[Session]:
    """The measured sessions, in the order clients pick them up."""
    rng = random.Random(s.seed)
    p = s.params
    if s.kind == "shared-prefix":
        docs = [_doc(rng, p["doc_tokens"]) for _ in range(p["n_docs"])]
        out = [Session(f"d{d}q{q}", f"doc{d}", docs[d], (_question(rng, p["question_tokens"]),))
               for q in range(p["n_questions"]) for d in range(p["n_docs"])]
        if s.order == "grouped":  # each document's questions together, in their own order
            out.sort(key=lambda x: docs.index(x.system))
        elif s.order == "shuffle":  # questions about one document arrive spread out (RAG traffic)
            rng.shuffle(out)
        # round-robin: every return to a document comes after the other documents' turns, so
        # its prefix has left the slot and must come back from the host cache
        return out
    if s.kind == "exact-reuse":
        doc, q = _doc(rng, p["doc_tokens"]), _question(rng, p["question_tokens"])
        return [Session(f"r{i}", "same", doc, (q,)) for i in range(p["n_requests"])]
    if s.kind == "no-sharing":
        # the unique text comes first, so prompts share nothing past the chat template's header
        return [Session(f"u{i}", "unique", make_text(rng, p["doc_tokens"]) + "\n\n" + INSTRUCTION,
                        (_question(rng, p["question_tokens"]),)) for i in range(p["n_requests"])]
    if s.kind == "rag-quote":
        return _rag_quote(s, rng)
    if s.kind == "multi-turn":
        system = INSTRUCTION + "\n\n" + make_text(rng, p["system_tokens"])
        return [Session(f"c{c}", "chat", system,
                        tuple(make_text(rng, p["turn_tokens"]) for _ in range(p["n_turns"])))
                for c in range(p["n_conversations"])]
    if s.kind == "agent-loop":
        return _agent_loop(s, rng)
    return _capacity(s, rng)


def _agent_loop(s: Scenario, rng: random.Random) -> list[Session]:
    """Agent sessions: every request starts with the same long system prompt of tool
    definitions; a session's first turn is its task, each later one a tool result appended
    after the model's answer, so its history grows by an answer and a result a step. With more
    sessions than slots, a session comes back to a slot another session took, keeping only the
    tools: its own history must come from the host cache, or be computed again."""
    p = s.params
    tools = AGENT_INSTRUCTION + "\n\ntools:\n" + make_text(rng, p["tools_tokens"])
    return [Session(f"a{i}", "agent", tools,
                    ("task: " + make_text(rng, p["task_tokens"]),
                     *("tool result: " + make_text(rng, p["result_tokens"])
                       for _ in range(p["n_steps"] - 1))))
            for i in range(p["n_sessions"])]


def _capacity(s: Scenario, rng: random.Random) -> list[Session]:
    """Rounds of `cold_per_round` never-seen documents followed by one question per hot
    document: the cold sweep pushes the host cache over its limit, the hot set stays in use."""
    p = s.params
    hot = [_doc(rng, p["doc_tokens"]) for _ in range(p["n_hot"])]
    out: list[Session] = []
    n_rounds = -(-p["n_cold"] // p["cold_per_round"])
    for r in range(n_rounds):
        lo, hi = r * p["cold_per_round"], min(p["n_cold"], (r + 1) * p["cold_per_round"])
        out += [Session(f"cold{i}", "cold", _doc(rng, p["doc_tokens"]),
                        (_question(rng, p["question_tokens"]),)) for i in range(lo, hi)]
        out += [Session(f"hot{h}r{r}", "hot", hot[h], (_question(rng, p["question_tokens"]),))
                for h in range(p["n_hot"])]
    return out


def split_at_restart(s: Scenario) -> tuple[list[Session], list[Session]]:
    """The measured sessions sent to the first server and to the restarted one, in workload
    order (all and none without `restart_after`). A session's turns never straddle the
    restart (its history would be lost with nothing to learn from it), so an integer
    `restart_after` must fall between sessions; HALFWAY takes the first sessions that make up
    at least half of the requests (rounded down). Raises ValueError when either side would be
    empty, as the scenario would then not measure a restart."""
    sessions = build_workload(s)
    if s.restart_after is None:
        return sessions, []
    total = sum(len(x.user_turns) for x in sessions)
    if s.restart_after == HALFWAY:
        k = total // 2
    elif isinstance(s.restart_after, int) and not isinstance(s.restart_after, bool):
        k = s.restart_after
    else:
        raise ValueError(f"scenario {s.name!r}: restart_after must be a number of requests or "
                         f"{HALFWAY!r}, got {s.restart_after!r}")
    done = n = 0
    while n < len(sessions) and done < k:
        done += len(sessions[n].user_turns)
        n += 1
    if done != k and s.restart_after != HALFWAY:
        raise ValueError(f"scenario {s.name!r}: restart_after {k} falls inside a multi-turn "
                         "session; give a number of requests that ends a session")
    if not 0 < n < len(sessions):
        raise ValueError(f"scenario {s.name!r}: restart_after {s.restart_after!r} leaves no "
                         f"requests on one side of the restart ({total} requests)")
    return sessions[:n], sessions[n:]


def warmup_sessions(s: Scenario) -> list[Session]:
    """Unrelated prompts (own seed, random first words): they warm the compute path without
    putting any of the scenario's prefixes into a slot or the host cache."""
    rng = random.Random(s.seed + 7919)
    return [Session(f"warm{i}", "warmup", make_text(rng, s.warmup_tokens),
                    (make_text(rng, 16),)) for i in range(s.warmup_requests)]


def cleanup_session(s: Scenario) -> Session:
    """One short unrelated request. Starting it makes the server publish its idle slots to the
    host cache (and clear them with unified KV): `--cache-idle-slots`, as in production."""
    rng = random.Random(s.seed + 104729)
    return Session("cleanup", "cleanup", make_text(rng, 8), (make_text(rng, 4),))
