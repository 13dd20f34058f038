"""Per-request speculative decoding fields (llama-server's flat `speculative.*` keys): parsed
into `CompletionTask.spec` (a copy of the server's --spec-* settings with the overrides), with
older llama-server's clamping, 400s for wrong JSON types, bad values and drafters the server
does not run; and the speculative fields of the task `params` the responses report."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from radixserve.config import RequestDefaults, SpecConfig
from radixserve.errors import TaskError
from radixserve.http.parse import (
    INT32_MAX,
    ParseContext,
    ParsedRequest,
    parse_chat,
    parse_completion,
)
from radixserve.http.responses import (
    ResponseContext,
    completion_json,
    params_json,
    spec_params_json,
)
from radixserve.model.loader import Model
from radixserve.sampling.chain import SamplingParams
from radixserve.text.chat_template import ChatTemplate
from radixserve.text.tokenizer import Tokenizer
from tests.http.test_app import GOOD, assert_error, client, final

SERVER = SpecConfig(types=["ngram-simple", "ngram-mod"], n_max=5, n_min=1, p_min=0.2,
                    ngram_simple_size_n=6, ngram_simple_size_m=20, ngram_simple_min_hits=2)


def server_spec() -> SpecConfig:
    return SpecConfig(**{k: getattr(SERVER, k) for k in SpecConfig.__dataclass_fields__}
                      | {"types": list(SERVER.types)})


@pytest.fixture
def ctx(tok_tmpl: tuple[Tokenizer, ChatTemplate]) -> ParseContext:
    return ParseContext(tok_tmpl[0], tok_tmpl[1], n_ctx_slot=64, n_slots=2,
                        defaults=replace(RequestDefaults.from_config(), spec=server_spec()))


@pytest.fixture
def off_ctx(tok_tmpl: tuple[Tokenizer, ChatTemplate]) -> ParseContext:
    """A server started without --spec-type."""
    return ParseContext(tok_tmpl[0], tok_tmpl[1], n_ctx_slot=64, n_slots=2)


def cmpl(ctx: ParseContext, **fields: Any) -> ParsedRequest:
    return parse_completion({"prompt": "Hello", **fields}, ctx)


def spec(ctx: ParseContext, **fields: Any) -> SpecConfig:
    s = cmpl(ctx, **{f"speculative.{k}": v for k, v in fields.items()}).task.spec
    assert s is not None
    return s


def error(ctx: ParseContext, **fields: Any) -> str:
    with pytest.raises(TaskError) as e:
        cmpl(ctx, **{f"speculative.{k}": v for k, v in fields.items()})
    assert e.value.status == 400
    return str(e.value)


def changed(s: SpecConfig) -> dict[str, Any]:
    """The fields of `s` that differ from the server's."""
    return {k: getattr(s, k) for k in SpecConfig.__dataclass_fields__
            if getattr(s, k) != getattr(SERVER, k)}


# ---- parsing --------------------------------------------------------------------------------


def test_no_speculative_field_leaves_the_task_on_the_servers_settings(ctx: ParseContext) -> None:
    req = cmpl(ctx, n_predict=4, speculative_n_max=8)  # the python name is not a request key
    assert req.task.spec is None
    assert cmpl(ctx, **{"speculative.n_max": None}).task.spec is None  # null: absent


@pytest.mark.parametrize("fields, want", [
    ({"n_max": 8}, {"n_max": 8}),
    ({"n_min": 3}, {"n_min": 3}),
    ({"p_min": 0.5}, {"p_min": 0.5}),
    ({"p_min": 0}, {"p_min": 0.0}),
    ({"p_min": 1}, {"p_min": 1.0}),
    ({"type": "ngram-mod"}, {"types": ["ngram-mod"]}),
    ({"ngram_size_n": 3}, {"ngram_simple_size_n": 3}),
    ({"ngram_size_m": 7}, {"ngram_simple_size_m": 7}),
    ({"ngram_min_hits": 0}, {"ngram_simple_min_hits": 0}),
    ({"ngram_min_hits": 4}, {"ngram_simple_min_hits": 4}),
    ({"n_max": 8.0, "n_min": 2}, {"n_max": 8, "n_min": 2}),  # integral floats are integers
])
def test_each_field_overrides_only_its_setting(ctx: ParseContext, fields: dict[str, Any],
                                               want: dict[str, Any]) -> None:
    s = spec(ctx, **fields)
    assert changed(s) == want
    assert ctx.defaults.spec == server_spec()  # the server's settings are not touched
    assert s is not ctx.defaults.spec and s.types is not ctx.defaults.spec.types


@pytest.mark.parametrize("fields, n_max, n_min", [
    ({"n_max": -3}, 0, 0),
    ({"n_min": -1}, 5, 0),
    ({"n_max": 4, "n_min": 10}, 4, 4),  # n_min = min(n_max, n_min)
    ({"n_min": 9}, 5, 5),  # against the server's n_max
    ({"n_max": 2}, 2, 1),
    ({"n_max": 0}, 0, 0),
    ({"n_max": -2, "n_min": -5}, 0, 0),
    ({"n_max": 2**40, "n_min": 2**40}, INT32_MAX, INT32_MAX),
])
def test_draft_lengths_are_clamped_as_llama_server_did(ctx: ParseContext, fields: dict[str, Any],
                                                       n_max: int, n_min: int) -> None:
    s = spec(ctx, **fields)
    assert (s.n_max, s.n_min) == (n_max, n_min)


@pytest.mark.parametrize("fields, name", [
    ({"p_min": -0.1}, "speculative.p_min"),
    ({"p_min": 1.5}, "speculative.p_min"),
    ({"ngram_size_n": 0}, "speculative.ngram_size_n"),
    ({"ngram_size_n": -4}, "speculative.ngram_size_n"),
    ({"ngram_size_n": 1025}, "speculative.ngram_size_n"),
    ({"ngram_size_m": 0}, "speculative.ngram_size_m"),
    ({"ngram_min_hits": -1}, "speculative.ngram_min_hits"),
])
def test_values_out_of_range_are_400s_naming_the_field(ctx: ParseContext, fields: dict[str, Any],
                                                       name: str) -> None:
    msg = error(ctx, **fields)
    assert f"Field '{name}'" in msg and "Value must be between" in msg


@pytest.mark.parametrize("value, types", [
    ("none", []),
    ("ngram-simple", ["ngram-simple"]),
    ("ngram-mod,ngram-simple", ["ngram-mod", "ngram-simple"]),
    ("ngram-simple, ngram-simple", ["ngram-simple"]),
    ("ngram-mod,none", []),
])
def test_type_picks_among_the_servers_drafters(ctx: ParseContext, value: str,
                                               types: list[str]) -> None:
    assert spec(ctx, type=value).types == types


@pytest.mark.parametrize("value", ["draft-simple", "ngram-cache", "draft-mtp", "bogus",
                                   "ngram-simple,draft-simple", "NGRAM-SIMPLE"])
def test_a_drafter_the_server_does_not_run_is_a_400(ctx: ParseContext, value: str) -> None:
    msg = error(ctx, type=value)
    assert "Field 'speculative.type'" in msg and "not available" in msg
    assert "ngram-simple, ngram-mod" in msg  # what it runs


@pytest.mark.parametrize("value", ["", " , "])
def test_an_empty_type_is_a_400(ctx: ParseContext, value: str) -> None:
    assert "Field 'speculative.type'" in error(ctx, type=value)


def test_without_spec_type_the_server_runs_no_drafter(off_ctx: ParseContext) -> None:
    msg = error(off_ctx, type="ngram-simple")
    assert "Field 'speculative.type'" in msg and "off on this server" in msg
    assert spec(off_ctx, type="none").types == []
    s = spec(off_ctx, n_max=7)
    assert (s.types, s.n_max) == ([], 7)


@pytest.mark.parametrize("name, value, kind", [
    ("n_max", "8", "an integer"),
    ("n_max", True, "an integer"),
    ("n_max", 2.5, "an integer"),
    ("n_min", [1], "an integer"),
    ("p_min", "0.5", "a finite number"),
    ("p_min", False, "a finite number"),
    ("type", 3, "a string"),
    ("type", ["ngram-simple"], "a string"),
    ("ngram_size_n", "12", "an integer"),
    ("ngram_size_m", {"m": 1}, "an integer"),
    ("ngram_min_hits", 1.5, "an integer"),
])
def test_wrong_json_types_are_400s_naming_the_field(ctx: ParseContext, name: str, value: Any,
                                                    kind: str) -> None:
    msg = error(ctx, **{name: value})
    assert msg.startswith(f"Field 'speculative.{name}': Value must be {kind}"), msg


def test_chat_requests_take_them_and_every_task_of_the_request_gets_them(
        ctx: ParseContext) -> None:
    req = parse_chat({"messages": [{"role": "user", "content": "Hi"}], "n": 2,
                      "speculative.type": "ngram-mod", "speculative.n_max": 9}, ctx)
    assert len(req.tasks) == 2
    for t in req.tasks:
        assert t.spec is not None and changed(t.spec) == {"types": ["ngram-mod"], "n_max": 9}
    plain = parse_chat({"messages": [{"role": "user", "content": "Hi"}]}, ctx)
    assert plain.task.spec is None


# ---- what the responses report ----------------------------------------------------------------


def test_spec_params_json_reports_the_task_else_the_server_else_off() -> None:
    task = SpecConfig(types=["ngram-mod", "ngram-simple"], n_max=9, n_min=2, p_min=0.5)
    assert spec_params_json(task, SERVER) == {
        "speculative.types": "ngram-mod,ngram-simple", "speculative.n_max": 9,
        "speculative.n_min": 2, "speculative.p_min": 0.5}
    assert spec_params_json(None, SERVER) == {
        "speculative.types": "ngram-simple,ngram-mod", "speculative.n_max": 5,
        "speculative.n_min": 1, "speculative.p_min": 0.2}
    off = SpecConfig(types=[], n_max=4)  # off: today's llama-server keys only
    assert spec_params_json(off, SERVER) == {"speculative.types": "none"}
    assert spec_params_json(None) == {"speculative.types": "none"}


def test_params_json_carries_the_spec_fields() -> None:
    out = params_json(SamplingParams(), 16, spec=SERVER)
    assert (out["speculative.types"], out["speculative.n_max"]) == ("ngram-simple,ngram-mod", 5)
    keys = list(out)
    i = keys.index("speculative.types")  # where llama-server puts it, the others after it
    assert keys[i - 1] == "generation_prompt" and keys[i + 1 : i + 4] == [
        "speculative.n_max", "speculative.n_min", "speculative.p_min"]
    off = params_json(SamplingParams(), 16)
    assert off["speculative.types"] == "none" and "speculative.n_max" not in off


@pytest.mark.parametrize("fields, want", [
    ({}, ("ngram-simple,ngram-mod", 5, 1, 0.2)),  # the server's
    ({"speculative.type": "none"}, ("none", None, None, None)),
    ({"speculative.type": "ngram-mod", "speculative.n_max": 7, "speculative.n_min": 3,
      "speculative.p_min": 0.9}, ("ngram-mod", 7, 3, 0.9)),
])
def test_generation_settings_report_the_tasks_speculative_settings(
        ctx: ParseContext, tok_tmpl: tuple[Tokenizer, ChatTemplate], fields: dict[str, Any],
        want: tuple[Any, ...]) -> None:
    rctx = ResponseContext("m", tok_tmpl[0], 64)
    settings = completion_json(final(), cmpl(ctx, **fields), rctx)["generation_settings"]
    got = tuple(settings.get(f"speculative.{k}") for k in ("types", "n_max", "n_min", "p_min"))
    assert got == want


# ---- over HTTP: every completion route takes them ---------------------------------------------

ROUTES = [("/completion", {"prompt": "hi"}), ("/v1/completions", {"prompt": "hi"}),
          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]


@pytest.mark.parametrize("path, body", ROUTES)
def test_routes_take_the_fields_and_refuse_bad_ones(model: Model, path: str,
                                                    body: dict[str, Any]) -> None:
    c, engine = client(model, GOOD)
    r = c.post(path, json={**body, "speculative.n_max": 6, "speculative.n_min": 9})
    assert r.status_code == 200, r.text
    s = engine.tasks[-1].spec
    assert s is not None and (s.types, s.n_max, s.n_min) == ([], 6, 6)
    assert c.post(path, json=body).status_code == 200 and engine.tasks[-1].spec is None
    for bad, name in (({"speculative.n_max": "6"}, "speculative.n_max"),
                      ({"speculative.p_min": 2}, "speculative.p_min"),
                      ({"speculative.type": "ngram-simple"}, "speculative.type")):
        r = c.post(path, json={**body, **bad})
        assert_error(r, 400, "invalid_request_error")
        assert f"'{name}'" in r.json()["error"]["message"]
    assert len(engine.tasks) == 2


@pytest.mark.parametrize("path, body", ROUTES)
def test_routes_accept_a_type_the_server_runs(model: Model, path: str,
                                              body: dict[str, Any]) -> None:
    """Needs the server's --spec-* settings in the request defaults (config.RequestDefaults)."""
    c, engine = client(model, GOOD, spec=SpecConfig(types=["ngram-simple", "ngram-mod"]))
    r = c.post(path, json={**body, "speculative.type": "ngram-mod"})
    assert r.status_code == 200, r.text
    s = engine.tasks[-1].spec
    assert s is not None and s.types == ["ngram-mod"]
    assert_error(c.post(path, json={**body, "speculative.type": "draft-simple"}), 400,
                 "invalid_request_error")


def test_props_report_the_servers_speculative_settings(model: Model) -> None:
    """Needs the server's --spec-* settings in /props (http/info.py: params_json(spec=d.spec))."""
    c, _ = client(model, GOOD, spec=SpecConfig(types=["ngram-mod"], n_max=6, p_min=0.5))
    params = c.get("/props").json()["default_generation_settings"]["params"]
    got = tuple(params.get(f"speculative.{k}") for k in ("types", "n_max", "n_min", "p_min"))
    assert got == ("ngram-mod", 6, 0, 0.5)
