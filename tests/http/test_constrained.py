"""Constrained decoding end to end (issue #14): a real server on the default model, requests
with `grammar` (llama.cpp GBNF), `json_schema` and OpenAI `response_format`, and the server's
`--grammar-file` / `-jf` defaults.

Every output is checked by an independent parser: `jsonschema` for the schemas, `lark` with an
equivalent grammar (written here) for the GBNF fixtures in tests/fixtures/grammars/, and it
must be complete: the grammar ended the generation (stop_type "eos"), not the token limit.
The grammars and schemas bound every repetition so that a sentence always ends in time.
"""

from __future__ import annotations

import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tests.http.harness import running_server

lark = pytest.importorskip("lark")

pytestmark = pytest.mark.model

GRAMMARS = Path(__file__).resolve().parents[1] / "fixtures" / "grammars"


def gbnf(name: str) -> str:
    return (GRAMMARS / f"{name}.gbnf").read_text()


# ---------------------------------------------------------------- servers and requests


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The default (bf16) server: 4 slots, driven by 4 concurrent requests."""
    log = str(tmp_path_factory.mktemp("constrained") / "server.log")
    with running_server(["-np", "4", "-c", "8192"], log) as srv:
        yield srv


@pytest.fixture(scope="module")
def exact_server(default_np2_server):
    """The deterministic mode on, where outputs must equal each other token for token (a cached
    and a fresh prompt, a batch of one and of two)."""
    return default_np2_server  # the session's (tests/http/conftest.py), shared with
    # test_tools.py: these tests send prompts of their own to slots they name, and their reuse
    # counts are lower bounds, so whatever ran before on the process changes nothing


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=300)


def complete(srv, body: dict) -> dict:
    r = post(srv, "/completion", body)
    assert r.status_code == 200, r.text
    return r.json()


def chat(srv, body: dict) -> dict:
    r = post(srv, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def tokenize(srv, text: str) -> list[int]:
    return post(srv, "/tokenize", {"content": text}).json()["tokens"]


def sse(srv, path: str, body: dict, on_chunk=None) -> list[dict]:
    """The data chunks of a streamed request (without the final [DONE])."""
    out: list[dict] = []
    with httpx.stream("POST", srv.url + path, json={**body, "stream": True},
                      timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            out.append(json.loads(line[6:]))
            if on_chunk is not None:
                on_chunk(len(out))
    return out


def run_all(fn, items: list) -> list:
    """`fn` over `items`, 4 at a time (one request per slot)."""
    with ThreadPoolExecutor(4) as ex:
        return list(ex.map(fn, items))


def sampling(i: int) -> dict:
    """Every fourth request greedy, the rest sampled at temperature 0.8 with a fixed seed."""
    return {"temperature": 0} if i % 4 == 0 else {"temperature": 0.8, "seed": 1000 + i}


# ---------------------------------------------------------------- independent parsers

# Lark grammars equivalent to the GBNF fixtures, character for character (no %ignore: every
# space is significant). `dynamic_complete` tries every way of splitting the text into
# terminals, as a GBNF matcher does, so a sentence parses here exactly when it is in the
# fixture's language.
LARK = {
    "arithmetic": r"""
        start: line~1..3
        line: expr "=" ws term "\n"
        expr: term (OP ws term)~0..4
        term: IDENT ws | NUM ws | "(" ws expr ")" ws
        ws: " "?
        OP: /[-+*\/]/
        IDENT: /[a-z][a-z0-9_]{0,7}/
        NUM: /[0-9]{1,4}/
    """,
    "json": r"""
        start: object
        value: inner_object | inner_array | scalar
        scalar: string | number | ("true" | "false" | "null") ws
        object: "{" ws (string ":" ws value ("," ws string ":" ws value)~0..3)? "}" ws
        inner_object: "{" ws (inner_member ("," ws inner_member)~0..3)? "}" ws
        inner_member: string ":" ws inner_value
        inner_array: "[" ws (inner_value ("," ws inner_value)~0..3)? "]" ws
        inner_value: flat_array | scalar
        flat_array: "[" ws (scalar ("," ws scalar)~0..3)? "]" ws
        string: "\"" CHAR~0..24 "\"" ws
        CHAR: /[^"\\\x7f\x00-\x1f]/ | /\\(["\\bfnrt]|u[0-9a-fA-F]{4})/
        number: NUMBER ws
        NUMBER: /-?([1-9][0-9]{0,6}|[0-9])(\.[0-9]{1,6})?([eE][-+]?[0-9]{1,2})?/
        ws: (" " | NEWLINE_INDENT)?
        NEWLINE_INDENT: /\n[ \t]{0,8}/
    """,
    "list": r"""
        start: item~1..4
        item: "- " TEXT "\n"
        TEXT: /[^\r\n\x0b\x0c\x85\u2028\u2029]{1,48}/
    """,
    "c": r"""
        start: function~1..2
        function: type " " IDENT "(" params? ") {\n" statement~1..5 "}\n"
        params: type " " IDENT (", " type " " IDENT)~0..2
        type: "int" | "float" | "char"
        statement: "    " (declaration | assignment | return_stmt | if_stmt | while_stmt) "\n"
        declaration: type " " IDENT (" = " expr)? ";"
        assignment: IDENT " = " expr ";"
        return_stmt: "return " expr ";"
        if_stmt: "if (" condition ") { " simple " }"
        while_stmt: "while (" condition ") { " simple " }"
        simple: assignment | return_stmt
        condition: expr " " RELOP " " expr
        RELOP: "<=" | "<" | "==" | "!=" | ">=" | ">"
        expr: term (" " ADDOP " " term)~0..3
        term: factor (" " MULOP " " factor)~0..2
        factor: IDENT | NUMBER | "(" expr ")"
        ADDOP: /[-+]/
        MULOP: /[*\/]/
        IDENT: /[a-zA-Z_][a-zA-Z_0-9]{0,11}/
        NUMBER: /[0-9]{1,6}/
    """,
}


@cache
def parser(name: str):
    return lark.Lark(LARK[name], parser="earley", lexer="dynamic_complete")


def in_language(name: str, text: str) -> bool:
    p = parser(name)  # outside the try: a broken checker grammar must not read as "no"
    try:
        p.parse(text)
    except lark.exceptions.LarkError:
        return False
    if name == "json":
        return isinstance(json.loads(text), dict)
    return True


def test_the_lark_grammars_agree_with_the_fixtures_on_known_sentences():
    """The checkers themselves: sentences in and out of each language."""
    cases = {
        "arithmetic": (["1 + 2 = 3\n", "x = (a*b) \n(y - 2)/3= 7\nz=1\n"],
                       ["1 + 2 = 3", "1 + 2 = 3\n" * 4, "12345 = 1\n", "X = 1\n"]),
        "json": (['{}', '{"a": 1, "b": [true, null]}\n  ', '{"a": {"b": [1, 2]}}', '{"a": 123}',
                  '{"s": "x\\u00e9\\n"}'],
                 ['[]', '{"a": 01}', '{"a": {"b": {"c": 1}}}', '{"a": "' + "x" * 25 + '"}',
                  '{"a": 1}\n\n', '{"a":1,"b":2,"c":3,"d":4,"e":5}']),
        "list": (["- a\n", "- milk, eggs\n- bread\n"],
                 ["- a", "-a\n", "- \n", "- a\n" * 5, "- " + "x" * 49 + "\n"]),
        "c": (["int f(int a, int b) {\n    return a + b;\n}\n",
               "char g() {\n    int x = 1;\n    while (x < 10) { x = x * 2; }\n"
               "    if (x >= (y - 1)) { return x; }\n}\n"],
              ["int f() {\n}\n", "int f() {\n    x = 1\n}\n", "void f() {\n    x = 1;\n}\n",
               "int f() { return 1; }\n"]),
    }
    for name, (good, bad) in cases.items():
        for text in good:
            assert in_language(name, text), (name, text)
        for text in bad:
            assert not in_language(name, text), (name, text)


# ---------------------------------------------------------------- 1. generated JSON schemas

NAMES = ["name", "age", "city", "score", "tags", "active", "id", "color", "size", "count",
         "label", "note", "email", "level", "price", "owner", "status", "kind", "rank", "year"]
WORDS = ["red", "green", "blue", "small", "large", "cat", "dog", "yes", "no", "alpha", "beta"]
PATTERNS = ["^[a-z]{1,8}$", "^[A-Z][a-z]{1,6}$", "^[0-9]{3}-[0-9]{4}$", "^(on|off)$",
            "^[a-z]{2,5}_[0-9]{1,2}$"]


def simple_schema(rng: random.Random) -> dict:
    """A scalar: bounded strings (maxLength, enum or pattern), integer/number ranges,
    boolean, null, enum, const. Numbers are multiples of 0.5 or 0.25 (exact in binary, for
    jsonschema's check): a bare number lets a sampled model run on with digits forever."""
    kind = rng.choice(["string", "string", "integer", "number", "boolean", "null", "enum",
                       "const"])
    if kind == "string":
        form = rng.choice(["max", "enum", "pattern"])
        if form == "max":
            s: dict[str, Any] = {"type": "string", "maxLength": rng.randint(1, 12)}
            if rng.random() < 0.3:
                s["minLength"] = rng.randint(0, s["maxLength"])
            return s
        if form == "enum":
            return {"type": "string", "enum": rng.sample(WORDS, rng.randint(1, 4))}
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == "number":
        lo = rng.randint(-10, 10)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 100),
                "multipleOf": rng.choice([0.5, 0.25])}
    if kind == "enum":
        return {"enum": rng.sample(["a", "b", 1, 2, 3.5, True, None, "x y"], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(["fixed", 7, False, None])}
    return {"type": kind}


def value_schema(rng: random.Random, depth: int) -> dict:
    r = rng.random()
    if r < 0.15:
        lo = rng.randint(0, 2)
        return {"type": "array", "items": simple_schema(rng), "minItems": lo,
                "maxItems": rng.randint(max(lo, 1), 3)}
    if r < 0.25:
        return {"anyOf": [simple_schema(rng), simple_schema(rng)]}
    if r < 0.35 and depth < 2:
        return object_schema(rng, depth + 1)
    return simple_schema(rng)


def object_schema(rng: random.Random, depth: int = 1) -> dict:
    """1-4 properties (1-2 when nested), a random `required` subset, and closed: an open
    object lets the model add keys without end (measured: a quarter of sampled outputs ran
    past 96 tokens), so extra keys are bounded in one of three ways."""
    names = rng.sample(NAMES, rng.randint(1, 4 if depth == 1 else 2))
    s: dict[str, Any] = {"type": "object",
                         "properties": {n: value_schema(rng, depth) for n in names}}
    required = [n for n in names if rng.random() < 0.7]
    if required:
        s["required"] = required
    mode = rng.random()
    if mode < 0.6:
        s["additionalProperties"] = False
    elif mode < 0.8:  # no extra key, by count (llguidance needs every listed key required)
        s["required"], s["maxProperties"] = names, len(names)
    else:  # one extra small integer allowed
        s["required"], s["maxProperties"] = names, len(names) + 1
        s["additionalProperties"] = {"type": "integer", "minimum": 0, "maximum": 9}
    return s


N_SCHEMAS = 200
# Outputs are 10-100 tokens long, but llguidance's JSON allows any run of whitespace between
# tokens (llama.cpp's own json-schema-to-grammar allows at most ~22 characters), and sampled
# runs of tabs pushed one output of 200 past 128 tokens: the limit leaves room for that.
N_PREDICT_JSON = 256


def generated_schemas() -> list[dict]:
    rng = random.Random(14)  # issue #14: the same schemas on every run
    return [object_schema(rng) for _ in range(N_SCHEMAS)]


def test_generated_schemas_cover_the_shapes_they_should():
    schemas = generated_schemas()
    text = json.dumps(schemas)
    for key in ('"maxLength"', '"enum"', '"pattern"', '"minimum"', '"multipleOf"', '"boolean"',
                '"null"', '"const"', '"array"', '"anyOf"', '"required"',
                '"additionalProperties": false', '"maxProperties"'):
        assert key in text, key
    assert any(isinstance(p, dict) and p.get("type") == "object"
               for s in schemas for p in s["properties"].values())
    assert len({json.dumps(s, sort_keys=True) for s in schemas}) == N_SCHEMAS
    for s in schemas:
        jsonschema.Draft202012Validator.check_schema(s)


def test_every_output_of_200_generated_schemas_is_complete_and_valid(server):
    """Half through /completion `json_schema`, half through chat `response_format`
    json_schema (strict); every fourth greedy, the rest sampled with fixed seeds."""
    schemas = generated_schemas()

    def run(i: int) -> tuple[str, str]:
        s = schemas[i]
        if i % 2 == 0:
            res = complete(server, {"prompt": f"JSON matching the schema {json.dumps(s)}:\n",
                                    "json_schema": s, "n_predict": N_PREDICT_JSON,
                                    **sampling(i)})
            return res["content"], res["stop_type"]
        rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s,
                                                     "strict": True}}
        msg = f"Reply with a JSON object for this schema: {json.dumps(s)}"
        res = chat(server, {"messages": [{"role": "user", "content": msg}],
                            "response_format": rf, "max_tokens": N_PREDICT_JSON, **sampling(i)})
        choice = res["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]

    failures = []
    outputs = run_all(run, list(range(N_SCHEMAS)))
    for i, (text, stop) in enumerate(outputs):
        try:
            assert stop in ("eos", "stop"), f"not complete: {stop}"
            jsonschema.validate(json.loads(text), schemas[i])
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            failures.append(f"#{i} {json.dumps(schemas[i])}\n  -> {text!r}\n  {e}")
    assert not failures, f"{len(failures)} of {N_SCHEMAS} failed:\n" + "\n".join(failures)
    assert len(set(outputs)) > N_SCHEMAS * 0.9  # varied outputs, not one answer


# ---------------------------------------------------------------- 2. GBNF grammars

GBNF_PROMPTS = {
    "arithmetic": ["Some arithmetic:\n", "Solve for the values:\n", "x = 3 + 4\n"],
    "json": ["A JSON object describing a cat: ", "Here is the config file in JSON:\n",
             '{"user": '],
    "list": ["Shopping list:\n", "Three reasons to learn Python:\n",
             "Things to pack for a trip:\n"],
    "c": ["// A C function that adds two numbers\n", "/* compute the factorial */\n",
          "int main() {\n"],
}


def test_every_output_of_the_gbnf_fixtures_parses_and_is_complete(server):
    jobs = [(name, prompt, i) for name, prompts in GBNF_PROMPTS.items() for prompt in prompts
            for i in range(3)]

    def run(job: tuple[str, str, int]) -> dict:
        name, prompt, i = job
        return complete(server, {"prompt": prompt, "grammar": gbnf(name), "n_predict": 256,
                                 **sampling(i)})

    failures = []
    for (name, prompt, i), res in zip(jobs, run_all(run, jobs)):
        text = res["content"]
        if res["stop_type"] != "eos" or not in_language(name, text):
            failures.append(f"{name} {prompt!r} #{i}: {res['stop_type']} {text!r}")
    assert not failures, "\n".join(failures)


def test_a_llguidance_lark_grammar_is_accepted_too(server):
    grammar = '%llguidance {}\nstart: "The answer is " ANSWER "."\nANSWER: /(yes|no|maybe)/'
    res = complete(server, {"prompt": "Is the sky blue?", "grammar": grammar, "n_predict": 16,
                            "temperature": 0})
    assert res["stop_type"] == "eos"
    assert res["content"] in ("The answer is yes.", "The answer is no.", "The answer is maybe.")


# ---------------------------------------------------------------- 3. server defaults

DEFAULT_SCHEMA = {"type": "object",
                  "properties": {"answer": {"type": "string", "maxLength": 12},
                                 "confidence": {"type": "integer", "minimum": 0,
                                                "maximum": 100}},
                  "required": ["answer", "confidence"], "additionalProperties": False}
OWN_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}


def _default_requests(srv) -> dict[str, tuple[str, str]]:
    """(output, stop) of requests with no constraint of their own, with their own schema, and
    with their own grammar; completion and chat."""
    msgs = [{"role": "user", "content": "Name three fruits."}]
    rf = {"type": "json_schema", "json_schema": {"schema": OWN_SCHEMA, "strict": True}}
    bodies = {
        "plain": ("/completion", {"prompt": "Name three fruits:\n"}),
        "plain-sampled": ("/completion", {"prompt": "Name three fruits:\n", "temperature": 0.8,
                                          "seed": 5}),
        "plain-chat": ("/v1/chat/completions", {"messages": msgs}),
        "own-schema": ("/completion", {"prompt": "Is water wet? JSON:", "json_schema":
                                       OWN_SCHEMA}),
        "own-schema-chat": ("/v1/chat/completions", {"messages": msgs, "response_format": rf}),
        "own-grammar": ("/completion", {"prompt": "Some arithmetic:\n",
                                        "grammar": gbnf("arithmetic")}),
    }

    def run(key: str) -> tuple[str, str]:
        path, body = bodies[key]
        body = {"temperature": 0, "n_predict": 128, **body}
        if path == "/completion":
            res = complete(srv, body)
            return res["content"], res["stop_type"]
        res = chat(srv, body)
        return res["choices"][0]["message"]["content"], res["choices"][0]["finish_reason"]

    return dict(zip(bodies, run_all(run, list(bodies))))


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_grammar_file_and_json_schema_file_are_defaults_a_request_overrides(tmp_path):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(DEFAULT_SCHEMA))
    base = ["-np", "4", "-c", "4096"]

    with running_server(base + ["--grammar-file", str(GRAMMARS / "list.gbnf")],
                        str(tmp_path / "gbnf.log")) as srv:
        out = _default_requests(srv)
    for key in ("plain", "plain-sampled", "plain-chat"):  # the server's grammar
        text, stop = out[key]
        assert stop in ("eos", "stop") and in_language("list", text), (key, out[key])
    for key in ("own-schema", "own-schema-chat"):  # the request's schema wins
        text, stop = out[key]
        assert stop in ("eos", "stop") and _valid(text, OWN_SCHEMA), (key, out[key])
    assert out["own-grammar"][1] == "eos" and in_language("arithmetic", out["own-grammar"][0])

    with running_server(base + ["-jf", str(schema_file)], str(tmp_path / "json.log")) as srv:
        out = _default_requests(srv)
    for key in ("plain", "plain-sampled", "plain-chat"):
        text, stop = out[key]
        assert stop in ("eos", "stop") and _valid(text, DEFAULT_SCHEMA), (key, out[key])
    for key in ("own-schema", "own-schema-chat"):
        text, stop = out[key]
        assert stop in ("eos", "stop") and _valid(text, OWN_SCHEMA), (key, out[key])
        assert not _valid(text, DEFAULT_SCHEMA)
    assert out["own-grammar"][1] == "eos" and in_language("arithmetic", out["own-grammar"][0])


# ---------------------------------------------------------------- 4. bad requests

MSGS = [{"role": "user", "content": "Say hi."}]
BAD_REQUESTS = [
    # (path, body, words the message must name)
    ("/completion", {"prompt": "x", "grammar": 'root ::= "unterminated'}, ["grammar"]),
    ("/completion", {"prompt": "x", "grammar": 'root ::= "a" undefined-rule'},
     ["grammar", "undefined-rule"]),
    ("/completion", {"prompt": "x", "grammar": "%llguidance {}\nstart: nowhere"},
     ["grammar", "nowhere"]),
    ("/completion", {"prompt": "x", "json_schema": {"type": "strng"}}, ["json_schema", "strng"]),
    ("/completion", {"prompt": "x", "json_schema": [1, 2]}, ["json_schema", "object"]),
    ("/v1/chat/completions", {"messages": MSGS, "response_format": {"type": "xml"}},
     ["response_format", "xml"]),
    ("/v1/chat/completions", {"messages": MSGS, "response_format": {
        "type": "json_schema", "json_schema": {"schema": "not a schema"}}},
     ["response_format", "schema"]),
    ("/v1/chat/completions", {"messages": MSGS, "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 5,
                                                          "maximum": 1}}}},
     ["schema", "minimum"]),
    ("/v1/chat/completions", {"messages": MSGS, "grammar": 'root ::= "a"',
                              "json_schema": {"type": "object"}}, ["grammar", "json_schema"]),
]


N_LONG = 320  # tokens of the generations the bad requests run beside (~50 tokens/s each here,
# ~6 s; the 9 bad requests take well under a second: a machine several times faster overlaps)


def assert_openai_400(r: httpx.Response, words: list[str]) -> None:
    assert r.status_code == 400, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "type"}, body
    err = body["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error", err
    for w in words:
        assert w.lower() in err["message"].lower(), (w, err["message"])


def test_bad_grammars_and_schemas_are_400s_that_leave_running_generations_alone(exact_server):
    srv = exact_server
    prompts = ["Once upon a time, in a kingdom by the sea,", "The history of the printing press"]
    bodies = [{"prompt": p, "n_predict": N_LONG, "temperature": 0, "ignore_eos": True,
               "return_tokens": True} for p in prompts]

    def stream(body: dict, started: threading.Event | None = None) -> dict:
        def on_chunk(n: int) -> None:
            if started is not None and n == 4:
                started.set()
        chunks = sse(srv, "/completion", body, on_chunk)
        return {"content": "".join(c["content"] for c in chunks),
                "tokens": [t for c in chunks for t in c.get("tokens", [])],
                "stop_type": chunks[-1]["stop_type"], "n": chunks[-1]["tokens_predicted"]}

    with ThreadPoolExecutor(2) as ex:
        reference = list(ex.map(stream, bodies))
    assert all(r["n"] == N_LONG and len(r["tokens"]) == N_LONG for r in reference)

    started = [threading.Event(), threading.Event()]
    with ThreadPoolExecutor(2) as ex:
        futures = [ex.submit(stream, b, s) for b, s in zip(bodies, started)]
        for s, f in zip(started, futures):
            assert s.wait(120) or f.result()  # result() raises what went wrong
        for path, body, words in BAD_REQUESTS:
            assert_openai_400(post(srv, path, body), words)
        mid_stream = not any(f.done() for f in futures)
        again = [f.result() for f in futures]
    assert mid_stream, "the bad requests did not overlap the generations: make them longer"
    assert again == reference

    res = complete(srv, {"prompt": "Things to pack for a trip:\n", "grammar": gbnf("list"),
                         "n_predict": 256, "temperature": 0})
    assert res["stop_type"] == "eos" and in_language("list", res["content"])


def test_the_openai_client_gets_bad_request_errors_and_structured_output(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="x", messages=MSGS,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "bad", "schema": {"type": "strng"}}})
    assert "strng" in str(e.value)
    ok = client.chat.completions.create(
        model="x", messages=MSGS, temperature=0, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {
            "name": "ok", "schema": OWN_SCHEMA, "strict": True}})
    assert ok.choices[0].finish_reason == "stop"
    assert _valid(ok.choices[0].message.content, OWN_SCHEMA)
    obj = client.chat.completions.create(  # any JSON object
        model="x", temperature=0, max_tokens=128, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give me a JSON object with a name and an age."}])
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


# ---------------------------------------------------------------- 5. streaming


def test_streamed_constrained_output_equals_the_non_streamed_one(server):
    # cache_prompt off: both runs compute the same prompt the same way (bf16, issue #15)
    schema = {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 12},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
        "required": ["title", "year", "tags"], "additionalProperties": False}
    base = {"temperature": 0, "cache_prompt": False, "n_predict": 160}
    completions = [
        {"prompt": "A movie as JSON:", "json_schema": schema, **base},
        {"prompt": "// A C function that adds two numbers\n", "grammar": gbnf("c"), **base},
        {"prompt": "Things to pack for a trip:\n", "grammar": gbnf("list"), **base},
    ]
    for body in completions:
        whole = complete(server, body)
        assert whole["stop_type"] == "eos", whole
        chunks = sse(server, "/completion", body)
        assert "".join(c["content"] for c in chunks) == whole["content"]
        assert chunks[-1]["stop_type"] == "eos"
        assert chunks[-1]["tokens_predicted"] == whole["tokens_predicted"]

    rf = {"type": "json_schema", "json_schema": {"name": "movie", "schema": schema,
                                                 "strict": True}}
    body = {"messages": [{"role": "user", "content": "Describe a movie as JSON."}],
            "response_format": rf, "temperature": 0, "cache_prompt": False, "max_tokens": 160}
    whole = chat(server, body)
    chunks = sse(server, "/v1/chat/completions", body)
    deltas = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert "".join(deltas) == whole["choices"][0]["message"]["content"]
    assert finish[-1] == whole["choices"][0]["finish_reason"] == "stop"
    assert _valid("".join(deltas), schema)


# ---------------------------------------------------------------- 6. the prompt cache

FACTS = [
    "The Amazon rainforest covers much of the Amazon basin of South America.",
    "It spans nine nations and holds the largest biodiversity of any tropical forest.",
    "Its river carries more water than any other river on Earth.",
    "Scientists estimate that it is home to around 390 billion individual trees.",
    "Deforestation, driven by cattle ranching and farming, threatens large areas of it.",
    "Indigenous peoples have lived in the forest for at least eleven thousand years.",
]
CACHE_SCHEMA = {"type": "object",
                "properties": {"nations": {"type": "integer", "minimum": 1, "maximum": 20},
                               "river": {"type": "string", "maxLength": 12}},
                "required": ["nations", "river"], "additionalProperties": False}


def long_prefix(srv, topic: str) -> tuple[str, int]:
    """A document of >= 300 tokens and its token count."""
    text = f"Notes on {topic}.\n" + "\n".join(FACTS * 4) + "\n"
    n = len(tokenize(srv, text))
    assert n >= 300, n
    return text, n


def test_constrained_and_unconstrained_requests_share_the_prompt_cache(exact_server):
    srv = exact_server
    ask = "Question: how many nations does it span, and what is its river? JSON: "
    free = "Question: what threatens it?\nAnswer:"

    def constrained(prompt: str, **kw: Any) -> dict:
        return complete(srv, {"prompt": prompt, "json_schema": CACHE_SCHEMA, "n_predict": 48,
                              "temperature": 0, **kw})

    def unconstrained(prompt: str, **kw: Any) -> dict:
        return complete(srv, {"prompt": prompt, "n_predict": 8, "temperature": 0, **kw})

    # constrained first, then unconstrained: the prefix the grammar's request left is reused
    doc, n = long_prefix(srv, "the Amazon (1)")
    for q in (ask, free):  # the prefix's tokens start each prompt's tokens
        assert tokenize(srv, doc + q)[:n] == tokenize(srv, doc)
    first = constrained(doc + ask, id_slot=0)
    assert first["stop_type"] == "eos" and _valid(first["content"], CACHE_SCHEMA)
    second = unconstrained(doc + free, id_slot=0)
    assert second["timings"]["cache_n"] >= n

    # unconstrained first, then constrained: its prefix comes from the cache, and its greedy
    # output equals the one computed from scratch
    doc, n = long_prefix(srv, "the Amazon (2)")
    unconstrained(doc + free, id_slot=1)
    cached = constrained(doc + ask, id_slot=1)
    assert cached["timings"]["cache_n"] >= n
    assert cached["stop_type"] == "eos" and _valid(cached["content"], CACHE_SCHEMA)
    fresh = constrained(doc + ask, id_slot=0, cache_prompt=False)
    assert fresh["timings"]["cache_n"] == 0
    assert fresh["content"] == cached["content"]
