"""radixserve.text.grammar (llguidance) and where its masks go: the Constraint's masks equal
llguidance's own LLMatcher bit for bit on the default model's vocabulary; compile errors are
ValueErrors naming the problem; the Sampler applies a grammar in llama.cpp's order (sample,
then resample a rejected token from the allowed ones, the RNG running on); and the output
head's shortlist is exact for the best allowed tokens."""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import replace
from pathlib import Path

import gguf
import llguidance as llg
import numpy as np
import pytest
import torch

from radixserve.model.head import OutputHead, RowNeed
from radixserve.sampling.chain import Sampler, SamplingParams, sample_batch
from radixserve.text import grammar as G
from radixserve.text.tokenizer import Tokenizer
from tests.model.kernel_variants import default_kernels

GRAMMARS = Path(__file__).resolve().parents[1] / "fixtures" / "grammars"

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", 3]}, "maxItems": 3},
    "pet": {"type": "object", "properties": {"kind": {"type": "string", "pattern": "^[a-z]+$"},
                                             "legs": {"type": "number"}},
            "required": ["kind"], "additionalProperties": False},
    "ok": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}},
    "required": ["name", "age"], "additionalProperties": False}

# (grammar source, a complete sentence of it)
CASES = {
    "schema": (lambda: G.from_json_schema(SCHEMA),
               '{"name": "Ann", "age": 31, "tags": ["a", 3], "pet": {"kind": "cat", '
               '"legs": 4.5}, "ok": null}'),
    "arithmetic": (lambda: G.from_gbnf((GRAMMARS / "arithmetic.gbnf").read_text()),
                   "(a*b) + 12 = x\ny=3\n"),
    "json": (lambda: G.from_gbnf((GRAMMARS / "json.gbnf").read_text()),
             '{"a": [1, 2.5e3, "\\u00e9"],\n  "b": {"c": true}} '),
    "list": (lambda: G.from_gbnf((GRAMMARS / "list.gbnf").read_text()),
             "- milk\n- eggs, bread\n- 2 × apples ☺\n- tea\n"),
    "c": (lambda: G.from_gbnf((GRAMMARS / "c.gbnf").read_text()),
          "int add(int a, int b) {\n    int c = a + b * 2;\n    if (c > 10) { return c; }\n"
          "    return (c - 1);\n}\n"),
    "lark": (lambda: G.from_gbnf('%llguidance {}\nstart: "Answer: " ANSWER "."\n'
                                 'ANSWER: /[0-9]{1,3}|(yes|no)/'), "Answer: 42."),
}


@pytest.fixture(scope="module")
def tok(default_path: str) -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(default_path))


@pytest.fixture(scope="module")
def reference_vocab(request: pytest.FixtureRequest, tok: Tokenizer) -> llg.LLTokenizer:
    """llguidance's own tokenizer, built by llguidance.hf from the HF tokenizer that
    transformers converts the GGUF into: nothing shared with grammar.py's _Vocab."""
    pytest.importorskip("transformers")
    import llguidance.hf

    # the session's conversion of the default GGUF (tests/conftest.py), read only here
    hf = request.getfixturevalue("hf_default_tokenizer")
    return llguidance.hf.from_tokenizer(hf, n_vocab=tok.n_vocab, eos_token=sorted(tok.eog_ids))


def bitmask(m: llg.LLMatcher, n: int) -> torch.Tensor:
    """The matcher's mask as bools [n], read word by word (bit j of u32 word w: token 32w+j)."""
    words = np.frombuffer(m.compute_bitmask(), dtype="<u4").astype(np.int64)
    ids = np.arange(n)
    return torch.from_numpy(((words[ids >> 5] >> (ids & 31)) & 1).astype(bool))


def encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special=False, parse_special=False)


# ---------------------------------------------------------------- masks, bit for bit


@pytest.mark.model
@pytest.mark.parametrize("case", list(CASES))
def test_masks_equal_llguidances_own_matcher_bit_for_bit(tok, reference_vocab, case):
    """Along the sentence's own tokens and along random walks through the grammar (a random
    allowed token each step), the Constraint's mask equals an LLMatcher's on llguidance's own
    tokenizer and on grammar.py's, and `done` equals the matcher's `is_stopped`."""
    compile_, sentence = CASES[case]
    grammar = G.check(compile_(), tok)
    n = tok.n_vocab
    walks: list[list[int] | None] = [encode(tok, sentence)] + [None] * 6
    for w, path in enumerate(walks):
        rng = random.Random(w)
        c = G.Constraint(grammar, tok)
        refs = [llg.LLMatcher(reference_vocab, grammar), llg.LLMatcher(G.ll_tokenizer(tok),
                                                                       grammar)]
        for step in range(64 if path is None else len(path)):
            mask = c.mask()
            assert mask.dtype == torch.bool and mask.shape == (n,)
            for ref in refs:
                assert not ref.is_error(), ref.get_error()
                assert torch.equal(mask, bitmask(ref, n)), (case, w, step)
                assert c.done == ref.is_stopped()
            if c.done:
                break
            if path is None:
                allowed = mask.nonzero().squeeze(1).tolist()
                token = rng.choice(allowed)
                if tok.is_eog(token):
                    break
            else:
                token = path[step]
            assert c.allows(token)
            c.accept(token)
            for ref in refs:
                assert ref.consume_token(token)
        if path is not None:  # the whole sentence: end of generation is allowed now
            assert any(c.allows(t) for t in tok.eog_ids), case


@pytest.mark.model
def test_the_two_tokenizers_decode_every_token_the_same(tok, reference_vocab):
    mine = G.ll_tokenizer(tok)
    for t in range(tok.n_vocab):
        assert mine.decode_bytes([t]) == reference_vocab.decode_bytes([t]), t
        assert mine.is_special_token(t) == reference_vocab.is_special_token(t), t


# ---------------------------------------------------------------- errors


@pytest.mark.model
@pytest.mark.parametrize("text, words", [
    ("", ["non-empty"]),
    ("   \n", ["non-empty"]),
    ('root ::= "a" undefined-rule', ["invalid grammar", "undefined-rule"]),
    ('root ::= "unterminated', ["invalid grammar", "unterminated"]),
    ('begin ::= "a"', ["invalid grammar", "root"]),
    ("root ::= [0-9]{5,2}", ["invalid grammar", "range"]),
    ("root ::= <[2]>", ["invalid grammar"]),
    ("%llguidance {}\nstart: nowhere", ["invalid grammar", "nowhere"]),
    ('%llguidance {}\nstart: "a', ["invalid grammar", "lexer"]),
])
def test_bad_grammars_are_value_errors_naming_the_problem(tok, text, words):
    with pytest.raises(ValueError) as e:
        G.check(G.from_gbnf(text), tok)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    with pytest.raises(ValueError, match="non-empty string"):
        G.from_gbnf(None)  # type: ignore[arg-type]


@pytest.mark.model
def test_a_gbnf_rule_named_start_is_an_ordinary_rule(tok):
    """llguidance's converter names root `start`; a user's `start` rule is renamed, and a
    "start" inside a string, a character class or a comment is left alone."""
    grammar = G.check(G.from_gbnf('root ::= start "b"\nstart ::= "a"'), tok)
    c = G.Constraint(grammar, tok)
    for t in encode(tok, "ab"):
        assert c.allows(t)
        c.accept(t)
    assert c.done
    g = G.check(G.from_gbnf('root ::= start " start"  # start\nstart ::= [start] start_'
                            '\nstart_ ::= "!"'), tok)
    c = G.Constraint(g, tok)
    for t in encode(tok, "s! start"):
        assert c.allows(t)
        c.accept(t)
    assert c.done


@pytest.mark.model
@pytest.mark.parametrize("schema, words", [
    ({"type": "strng"}, ["strng"]),
    ([1, 2], ["must be an object", "list"]),
    (5, ["must be an object", "int"]),
    ("{not json", ["not JSON"]),
    ({"type": "integer", "minimum": 5, "maximum": 1}, ["minimum"]),
    ({"$ref": "#/definitions/missing"}, ["missing"]),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, ["propertyNames"]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "maxProperties": 2},
     ["maxProperties"]),
])
def test_bad_schemas_are_value_errors_naming_the_problem(tok, schema, words):
    with pytest.raises(ValueError) as e:
        G.check(G.from_json_schema(schema), tok, "JSON schema")
    msg = str(e.value)
    assert msg.startswith("invalid JSON schema: "), msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.model
def test_good_schemas_in_every_accepted_form(tok):
    def sentence_ok(grammar: str, text: str) -> bool:
        c = G.Constraint(grammar, tok)
        for t in encode(tok, text):
            if not c.allows(t):
                return False
            c.accept(t)
        return any(c.allows(t) for t in tok.eog_ids)

    as_text = G.check(G.from_json_schema(json.dumps({"type": "integer"})), tok)
    assert sentence_ok(as_text, "42") and not sentence_ok(as_text, '"42"')
    any_object = G.check(G.from_json_schema({}), tok)  # llama-server: {} is any object
    assert sentence_ok(any_object, '{"x": [1, {"y": null}]}')
    assert not sentence_ok(any_object, "[1]")
    assert G.check(G.from_json_schema(SCHEMA), None)  # no vocabulary: still checked


@pytest.mark.model
def test_a_constraint_on_a_bad_grammar_is_a_value_error(tok):
    with pytest.raises(ValueError, match="invalid grammar"):
        G.Constraint("this is not a grammar", tok)


# ---------------------------------------------------------------- done


@pytest.mark.model
def test_done_exactly_when_the_grammar_is_complete(tok):
    c = G.Constraint(G.from_gbnf('root ::= ("yes" | "no") "."'), tok)
    for t in encode(tok, "yes"):
        assert not c.done
        c.accept(t)
    assert not c.done and not any(c.allows(t) for t in tok.eog_ids)
    c.accept(encode(tok, ".")[0])
    assert c.done and c.error == ""
    assert set(c.mask().nonzero().squeeze(1).tolist()) == set(tok.eog_ids)

    # the list may stop after any item: not done, but end of generation is allowed
    c = G.Constraint(G.from_gbnf((GRAMMARS / "list.gbnf").read_text()), tok)
    for t in encode(tok, "- a\n"):
        c.accept(t)
    assert not c.done and all(c.allows(t) for t in tok.eog_ids) and c.allows(encode(tok,
                                                                                     "-")[0])
    for t in encode(tok, "- b\n- c\n- d\n"):  # the fourth item is the last one allowed
        c.accept(t)
    assert c.done

    c = G.Constraint(G.from_json_schema(SCHEMA), tok)
    for t in encode(tok, '{"name": "Bo", "age": 7'):
        c.accept(t)
    assert not c.done
    c.accept(encode(tok, "}")[0])
    assert c.done


@pytest.mark.model
def test_a_token_the_grammar_rejects_ends_the_sequence_with_an_error(tok, caplog):
    c = G.Constraint(G.from_gbnf('root ::= "yes" | "no"'), tok)
    bad = encode(tok, "maybe")[0]
    assert not c.allows(bad) and not c.allows(-1) and not c.allows(tok.n_vocab)
    with caplog.at_level(logging.ERROR, logger="radixserve.text.grammar"):
        c.accept(bad)
    assert c.done and "maybe" in c.error
    assert any("grammar rejected token" in r.message for r in caplog.records)


# ---------------------------------------------------------------- the sampler


def masked(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(~mask, -math.inf)


YES_NO = 'root ::= ("yes" | "no" | "maybe" | "sure" | "never") " " [a-z]{1,6} "."'


@pytest.mark.model
def test_greedy_picks_the_best_allowed_token(tok):
    grammar = G.check(G.from_gbnf(YES_NO), tok)
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randn(tok.n_vocab, generator=g) * 3
        c = G.Constraint(grammar, tok)
        best = int(masked(logits, c.mask()).argmax())
        assert not c.allows(int(logits.argmax()))  # the test means something
        s = Sampler(SamplingParams(temperature=0), tok.n_vocab, constraint=c)
        assert s.sample(logits) == best
        # sample_batch's one argmax over greedy rows, beside an unconstrained greedy row
        s2 = Sampler(SamplingParams(temperature=0), tok.n_vocab,
                     constraint=G.Constraint(grammar, tok))
        free = Sampler(SamplingParams(temperature=0), tok.n_vocab)
        assert sample_batch([s2, free], torch.stack([logits, logits])) == [
            best, int(logits.argmax())]

    # with repetition penalties: the best allowed token of the penalized row
    logits = torch.randn(tok.n_vocab, generator=g) * 3
    c = G.Constraint(grammar, tok)
    top_allowed = torch.topk(masked(logits, c.mask()), 3).indices.tolist()
    params = SamplingParams(temperature=0, repeat_penalty=3.0)
    s = Sampler(params, tok.n_vocab, prompt_tokens=top_allowed[:1], constraint=c)
    twin = Sampler(params, tok.n_vocab, prompt_tokens=top_allowed[:1])
    want = int(masked(twin.penalize(logits), c.mask()).argmax())
    assert s.sample(logits) == want


def rng_state(s: Sampler) -> tuple:
    st = s._state
    return tuple(st.rng_dist.mt), st.rng_dist.i


@pytest.mark.model
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, seed=0),  # llama-server's chain: top_k 40, top_p, min_p
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0),  # whole row
    SamplingParams(temperature=0.7, top_k=10, seed=0, repeat_penalty=1.3),
], ids=["default-chain", "whole-row", "penalties"])
def test_sampling_rejects_then_resamples_as_llama_cpp(tok, params):
    """An allowed draw is the unconstrained draw, RNG state included; a rejected one is
    resampled from the allowed tokens with the RNG running on (llama.cpp's
    common_sampler_sample order), and is allowed."""
    grammar = G.check(G.from_gbnf(YES_NO), tok)
    mask = G.Constraint(grammar, tok).mask()
    g = torch.Generator().manual_seed(1)
    counts = {"allowed": 0, "resampled": 0}
    for seed in range(60):
        p = replace(params, seed=seed)
        logits = torch.randn(tok.n_vocab, generator=g)
        # the allowed tokens raised from nowhere (mostly rejected) to far ahead (allowed)
        logits[mask] += 12.0 * seed / 60 + torch.rand(int(mask.sum()), generator=g)
        s = Sampler(p, tok.n_vocab, constraint=G.Constraint(grammar, tok))
        free = Sampler(p, tok.n_vocab)
        got, first = s.sample(logits), free.sample(logits)
        if mask[first]:
            counts["allowed"] += 1
            assert got == first
        else:
            counts["resampled"] += 1
            assert mask[got]
            assert got == free.sample(masked(logits, mask))  # the RNG ran on
        assert rng_state(s) == rng_state(free)
    assert counts["allowed"] >= 8 and counts["resampled"] >= 8, counts


@pytest.mark.model
def test_a_constrained_generation_follows_the_reference_order_step_by_step(tok):
    """Twenty steps through the JSON schema: each token is what an unconstrained sampler
    and a separate LLMatcher give in llama.cpp's order, and every token is allowed."""
    grammar = G.check(G.from_json_schema(SCHEMA), tok)
    g = torch.Generator().manual_seed(2)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    s = Sampler(params, tok.n_vocab, constraint=G.Constraint(grammar, tok))
    ref, matcher = Sampler(params, tok.n_vocab), llg.LLMatcher(G.ll_tokenizer(tok), grammar)
    for step in range(20):
        if s.constraint.done:
            break
        logits = torch.randn(tok.n_vocab, generator=g) * 2
        allowed = bitmask(matcher, tok.n_vocab)
        logits[allowed] += 4.0
        t = ref.sample(logits)
        if not allowed[t]:
            t = ref.sample(masked(logits, allowed))
        got = s.sample(logits)
        assert got == t, step
        s.accept(got)
        ref.accept(t)
        assert matcher.consume_token(t)
    assert s.constraint.error == ""


# ---------------------------------------------------------------- the output head

V, D = 8192, 64
vnni_paths = pytest.mark.parametrize("vnni", [True, False], ids=["vnni", "torch-int8"])


def make_head(seed: int, vnni: bool) -> OutputHead:
    """A random head shaped like test_head's: outlier rows and an outlier dimension."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, D, generator=g) * 0.05
    w[torch.randint(0, V, (64,), generator=g)] *= 8
    w[:, 3] *= 6
    head = OutputHead(w, shortlist=True, kern=default_kernels())
    if vnni and head.kern is None:
        pytest.skip("the VNNI head pass is not built here (needs AVX512-VNNI)")
    if not vnni:
        head.kern = None
    return head


def hidden(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed)) * 6


def some_masks(full_row: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tail = torch.zeros(V, dtype=torch.bool)
    tail[torch.topk(-full_row, 50).indices] = True  # only tokens far below the best
    few = torch.zeros(V, dtype=torch.bool)
    few[torch.randint(0, V, (3,), generator=g)] = True  # fewer than top
    return {"half": torch.rand(V, generator=g) < 0.5, "sparse": torch.rand(V, generator=g) < 0.02,
            "tail": tail, "few": few}


@vnni_paths
def test_the_best_allowed_tokens_are_exact(vnni):
    head = make_head(0, vnni)
    h = hidden(12, 1)
    full = head.full(h)
    for r in range(len(h)):
        for name, mask in some_masks(full[r], r).items():
            for top in (1, 5, 40):
                k = min(top, int(mask.sum()))
                want = torch.topk(masked(full[r], mask), k)
                for only in (True, False):
                    got = head.logits(h[r : r + 1], [RowNeed(top, allowed=mask,
                                                             allowed_only=only)])[0]
                    have = torch.topk(masked(got, mask), k)
                    assert torch.equal(have.indices, want.indices), (name, top, only)
                    assert torch.allclose(have.values, want.values, rtol=1e-6, atol=1e-5)
                    if only:  # nothing else is scored: the rest is -inf
                        assert torch.isinf(got[~mask]).all()
                    else:  # and the unconstrained best ones are exact too
                        best = torch.topk(full[r], top)
                        assert torch.equal(torch.topk(got, top).indices, best.indices)
    assert head.stats.rescored < head.stats.rows_short * V / 4  # a shortlist, not the head


@vnni_paths
def test_rows_with_and_without_a_grammar_share_one_call(vnni):
    head = make_head(2, vnni)
    h = hidden(4, 3)
    full = head.full(h)
    mask = some_masks(full[1], 0)["tail"]
    needs = [RowNeed(1), RowNeed(1, allowed=mask, allowed_only=True), RowNeed(0),
             RowNeed(40, allowed=mask)]
    got = head.logits(h, needs)
    assert int(got[0].argmax()) == int(full[0].argmax())
    assert int(masked(got[1], mask).argmax()) == int(masked(full[1], mask).argmax())
    assert torch.allclose(got[2], full[2], rtol=1e-6, atol=1e-5)  # f32 GEMM of 1 row vs 4
    assert torch.equal(torch.topk(got[3], 40).indices, torch.topk(full[3], 40).indices)
    assert torch.equal(torch.topk(masked(got[3], mask), 40).indices,
                       torch.topk(masked(full[3], mask), 40).indices)


class MaskConstraint:
    """A fixed mask with Constraint's interface (the random head's vocabulary is not the
    model's, so a real grammar cannot drive it)."""

    def __init__(self, mask: torch.Tensor) -> None:
        self._mask = mask
        self.done = False

    def mask(self) -> torch.Tensor:
        return self._mask

    def allows(self, token: int) -> bool:
        return 0 <= token < len(self._mask) and bool(self._mask[token])

    def accept(self, token: int) -> None:
        pass


@vnni_paths
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8, seed=5),
    SamplingParams(temperature=1.0, top_k=10, top_p=0.9, min_p=0.02, seed=3),
    SamplingParams(temperature=0.8, top_k=40, seed=9, repeat_penalty=1.5),
], ids=["greedy", "default-chain", "top-k-10", "penalties"])
def test_a_constrained_sampler_draws_from_its_head_need_what_the_full_head_gives(vnni, params):
    """Sampler.head_need() with a grammar asks the head for what the sampler reads: the
    draw from that shortlist equals the draw from the full f32 logits, rejections included."""
    head = make_head(4, vnni)
    h = hidden(16, 5)
    full = head.full(h)
    history = torch.topk(full[0], 30).indices.tolist()[::3]
    for r in range(len(h)):
        for name, mask in some_masks(full[r], 100 + r).items():
            a = Sampler(params, V, history, constraint=MaskConstraint(mask))
            b = Sampler(params, V, history, constraint=MaskConstraint(mask))
            need = a.head_need()
            row = head.logits(h[r : r + 1], [need])[0]
            got, want = a.sample(row), b.sample(full[r])
            assert got == want, (r, name)
            assert mask[got]
