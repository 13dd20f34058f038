"""Request fields: every field llama-server's completion schema honors (server-schema.cpp of
the reference build) is either honored here or refused with a 400 naming it; unknown fields
are ignored, as llama-server ignores them."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.http.fields import _UNIMPLEMENTED
from radixserve.http.schemas import ChatRequest, CompletionRequest
from radixserve.model.loader import Model
from tests.http.test_app import GOOD, assert_error, client

# The fields of llama.cpp's make_llama_cmpl_schema (tools/server/server-schema.cpp), aliases
# included, plus the OpenAI fields llama-server's chat and completion front-ends read.
LLAMA_SERVER_FIELDS = """
verbose timings_per_token stream stream_options cache_prompt return_tokens return_progress
sse_ping_interval n_predict max_completion_tokens max_tokens n_indent n_keep n_discard n_cmpl n
n_cache_reuse t_max_predict_ms response_fields top_k top_p min_p top_n_sigma xtc_probability
xtc_threshold typical_p temperature dynatemp_range dynatemp_exponent repeat_last_n
repeat_penalty frequency_penalty presence_penalty dry_multiplier dry_base dry_allowed_length
dry_penalty_last_n mirostat mirostat_tau mirostat_eta adaptive_target adaptive_decay seed
n_probs logprobs min_keep backend_sampling post_sampling_probs lora dry_sequence_breakers
json_schema grammar grammar_lazy chat_format reasoning_format generation_prompt
parse_tool_calls chat_parser continue_final_message echo preserved_tokens grammar_triggers
reasoning_control reasoning_budget_tokens reasoning_budget_start_tag reasoning_budget_end_tags
reasoning_budget_end_tag reasoning_budget_message logit_bias ignore_eos stop samplers id_slot
prompt messages tools tool_choice parallel_tool_calls response_format top_logprobs
chat_template_kwargs add_generation_prompt model image_data multimodal_data
""".split()


def test_every_llama_server_field_is_declared() -> None:
    declared = set(CompletionRequest.model_fields) | set(ChatRequest.model_fields)
    assert set(LLAMA_SERVER_FIELDS) <= declared, set(LLAMA_SERVER_FIELDS) - declared


REAL_VALUES: dict[str, Any] = {
    "grammar": "root ::= \"a\"", "json_schema": {"type": "object"}, "grammar_lazy": True,
    "grammar_triggers": [{"type": 0, "value": "x"}], "preserved_tokens": ["<x>"],
    "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
    "parallel_tool_calls": "yes", "parse_tool_calls": True, "lora": [{"id": 0, "scale": 1}],
    "chat_format": 1, "chat_parser": "x", "generation_prompt": "<think>",
    "reasoning_format": "deepseek", "reasoning_control": True, "reasoning_budget_tokens": 10,
    "reasoning_budget_start_tag": "<think>", "reasoning_budget_end_tags": ["</think>"],
    "reasoning_budget_end_tag": "</think>", "reasoning_budget_message": "stop",
    "continue_final_message": True, "echo": True, "image_data": [{"data": "x", "id": 1}],
    "multimodal_data": ["x"], "return_progress": True, "verbose": True,
}
HARMLESS: dict[str, Any] = {
    "grammar": "", "grammar_lazy": False, "tools": [], "tool_choice": "auto",
    "parallel_tool_calls": False, "lora": [], "reasoning_format": "none",
    "reasoning_budget_tokens": -1, "echo": False, "image_data": [], "return_progress": False,
}


@pytest.mark.parametrize("name", sorted(_UNIMPLEMENTED))
def test_unimplemented_fields_are_refused_naming_them(model: Model, name: str) -> None:
    c, engine = client(model, GOOD)
    for path, body in (("/completion", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = c.post(path, json={**body, name: REAL_VALUES[name]})
        assert_error(r, 400, "invalid_request_error")
        assert f"'{name}'" in r.json()["error"]["message"]
        if name in HARMLESS:
            assert c.post(path, json={**body, name: HARMLESS[name]}).status_code == 200
        assert c.post(path, json={**body, name: None}).status_code == 200
    assert len(engine.tasks) == 2 * (2 if name in HARMLESS else 1)


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("path, body, fields", [
    ("/completion", {"prompt": "hi"}, {"grammar": 'root ::= "a" | "b"'}),
    ("/completion", {"prompt": "hi"}, {"grammar": '%llguidance {}\nstart: "a"'}),
    ("/completion", {"prompt": "hi"}, {"json_schema": SCHEMA}),
    ("/completion", {"prompt": "hi"}, {"json_schema": {}}),
    ("/v1/chat/completions", CHAT, {"response_format": {"type": "json_object"}}),
    ("/v1/chat/completions", CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": True}}}),
])
def test_grammar_fields_reach_the_task(model: Model, path: str, body: dict, fields: dict) -> None:
    c, engine = client(model, GOOD)
    assert c.post(path, json={**body, **fields}).status_code == 200
    assert engine.tasks[-1].grammar
    assert c.post(path, json=body).status_code == 200
    assert engine.tasks[-1].grammar is None
    ok = c.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "text"}})
    assert ok.status_code == 200 and engine.tasks[-1].grammar is None


@pytest.mark.parametrize("path, body, fields, message", [
    ("/completion", {"prompt": "hi"}, {"grammar": "root ::= foo"}, "Rule 'foo' not found"),
    ("/completion", {"prompt": "hi"}, {"grammar": 'root = "a"'}, "Field 'grammar'"),
    ("/completion", {"prompt": "hi"}, {"grammar": 5}, "must be a string"),
    ("/completion", {"prompt": "hi"}, {"json_schema": {"type": "objekt"}}, "objekt"),
    ("/completion", {"prompt": "hi"}, {"json_schema": [1]}, "must be an object"),
    ("/v1/chat/completions", CHAT, {"response_format": {"type": "xml"}}, "xml"),
    ("/v1/chat/completions", CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "strin"}}}}, "invalid JSON schema"),
    ("/v1/chat/completions", CHAT, {"grammar": 'root ::= "a"', "json_schema": SCHEMA},
     "Cannot use both json_schema and grammar"),
])
def test_bad_grammars_are_400_before_the_engine(model: Model, path: str, body: dict,
                                                fields: dict, message: str) -> None:
    c, engine = client(model, GOOD)
    r = c.post(path, json={**body, **fields})
    assert_error(r, 400, "invalid_request_error")
    assert message in r.json()["error"]["message"]
    assert not engine.tasks  # nothing reached the engine: no slot was touched
    assert c.post(path, json=body).status_code == 200


def test_unknown_fields_are_ignored(model: Model) -> None:
    c, engine = client(model, GOOD)
    r = c.post("/completion", json={"prompt": "hi", "no_such_field": {"x": 1}, "user": "u1"})
    assert r.status_code == 200 and len(engine.tasks) == 1

