"""JSON bodies of finished completions: native /completion, OpenAI text and chat.

Shapes follow llama-server's: same keys, nesting and
value types, so llama.cpp clients, the OpenAI SDK and llama.cpp's own tests read them as is.
Streaming chunks are built in `sse.py` from the same helpers.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import string
import time
from dataclasses import dataclass, field
from typing import Any

from radixserve import __version__
from radixserve.config import SpecConfig
from radixserve.engine.task import FinalResult, TokenProbs
from radixserve.http.parse import ParsedRequest
from radixserve.sampling.chain import SamplingParams
from radixserve.text.chat_parse import ParsedMessage, message_json
from radixserve.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

BUILD_INFO = f"b{__version__}-radixserve"  # llama-server's system_fingerprint starts with "b"
LOGPROB_FLOOR = -9999.0  # log(0) has no JSON form; OpenAI uses -9999.0 for "never"
_ALNUM = string.ascii_letters + string.digits


def random_id(prefix: str) -> str:
    """`chatcmpl-<32 alnum>` / `cmpl-<32 alnum>`, as llama-server's `gen_chatcmplid`."""
    return prefix + "".join(secrets.choice(_ALNUM) for _ in range(32))


@dataclass(slots=True)
class ResponseContext:
    """Per-request constants of a response: names, ids, the tokenizer for text/bytes fields."""

    model: str  # the model name reported to clients (alias, else the file name)
    tokenizer: Tokenizer
    n_ctx_slot: int
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    fingerprint: str = BUILD_INFO


def ended_by_itself(final: FinalResult) -> bool:
    """Whether the reply ended by itself (EOS, a stop word), not at a limit (n_predict, the
    context): chat's finish_reason "stop", Anthropic's end_turn, a completed Response."""
    return final.stop_type in ("eos", "word")


def parse_reply(final: FinalResult, req: ParsedRequest) -> ParsedMessage:
    """The final reply as a message: parsed into reasoning, content and tool calls by the
    request's parser (tools, reasoning), else its text as the content; after the assistant
    message it continues, if any (`req.prefill`)."""
    if req.chat_output is None:
        return ParsedMessage(content=req.prefill + final.content)
    msg = req.chat_output.parser().parse(final.content)
    msg.content = req.prefill + msg.content
    return msg


def finish_reason(final: FinalResult, msg: ParsedMessage | None = None) -> str:
    """llama-server: "stop" for EOS or a stop word ("tool_calls" when the parsed message
    `msg` has calls), else (n_predict, context) "length"."""
    if not ended_by_itself(final):
        return "length"
    return "tool_calls" if msg is not None and msg.tool_calls else "stop"


def usage_json(final: FinalResult) -> dict[str, Any]:
    n_gen = len(final.tokens)
    return {
        "completion_tokens": n_gen,
        "prompt_tokens": final.n_prompt_tokens,
        "total_tokens": final.n_prompt_tokens + n_gen,
        "prompt_tokens_details": {"cached_tokens": final.timings.cache_n},
    }


def _logprob(p: float) -> float:
    return math.log(p) if p > 0 else LOGPROB_FLOOR


def probs_json(
    probs: list[TokenProbs], tok: Tokenizer, post_sampling: bool
) -> list[dict[str, Any]]:
    """`completion_probabilities` entries: `{id, token, bytes, logprob, top_logprobs}`, or
    with `post_sampling_probs` `{id, token, bytes, prob, top_probs}` (llama-server names)."""
    key, tops_key = ("prob", "top_probs") if post_sampling else ("logprob", "top_logprobs")

    def value(p: float) -> float:
        return p if post_sampling else _logprob(p)

    out = []
    for pr in probs:
        tops = [
            {
                "id": i,
                "token": text,
                "bytes": list(tok.token_to_piece(i, special=False)),
                key: value(p),
            }
            for i, text, p in pr.top
        ]
        out.append(
            {"id": pr.id, "token": pr.token, "bytes": pr.bytes, key: value(pr.prob), tops_key: tops}
        )
    return out


def spec_params_json(
    spec: SpecConfig | None, server: SpecConfig | None = None
) -> dict[str, Any]:
    """The speculative fields of a task's `params`: `spec` (a task's), else `server` (the
    server's --spec-* settings), else the defaults (SpecConfig.params_json)."""
    return (spec or server or SpecConfig()).params_json()


def params_json(
    params: SamplingParams,
    n_predict: int,
    *,
    ignore_eos: bool = False,
    stream: bool = False,
    stop: list[str] | None = None,
    post_sampling_probs: bool = False,
    spec: SpecConfig | None = None,
) -> dict[str, Any]:
    """llama-server's task `params` object (to_json(only_metrics), as /props and
    generation_settings show it): the sampling chain's settings as they are, the speculative
    settings (`spec`: the task's or the server's; None: off), plus the fields of features
    this server does not have at their off values (chat parsing, LoRA)."""
    return {
        **params.llama_fields(),
        "max_tokens": n_predict,
        "n_predict": n_predict,
        "n_keep": 0,
        "n_discard": 0,
        "ignore_eos": ignore_eos,
        "stream": stream,
        "chat_format": "Content-only",
        "reasoning_format": "none",
        "reasoning_in_content": False,
        "generation_prompt": "",
        **spec_params_json(spec),
        "timings_per_token": False,
        "post_sampling_probs": post_sampling_probs,
        "backend_sampling": False,
        "lora": [],
        **({"stop": list(stop)} if stop is not None else {}),
    }


def completion_json(
    final: FinalResult, req: ParsedRequest, ctx: ResponseContext, streamed: bool = False
) -> dict[str, Any]:
    """Native /completion final object; `streamed`: the SSE last chunk (content already sent)."""
    task = req.task
    out: dict[str, Any] = {
        "index": task.index,
        "content": "" if streamed else final.content,
        "tokens": final.tokens if req.return_tokens and not streamed else [],
        "id_slot": final.id_slot,
        "stop": True,
        "model": ctx.model,
        "tokens_predicted": len(final.tokens),
        "tokens_evaluated": final.n_prompt_tokens,
        "generation_settings": params_json(
            task.params,
            task.n_predict,
            ignore_eos=task.ignore_eos,
            stream=req.stream,
            stop=task.stop,
            post_sampling_probs=req.post_sampling_probs,
            spec=task.spec if task.spec is not None else req.server_spec,
        )
        | {"n_ctx": ctx.n_ctx_slot, "n_keep": task.n_keep, "n_discard": task.n_discard},
        "prompt": ctx.tokenizer.decode(task.prompt_tokens),
        "has_new_line": final.has_new_line,
        "truncated": final.truncated,
        "stop_type": final.stop_type,
        "stopping_word": final.stopping_word,
        "tokens_cached": final.n_tokens_cached,
        **final.timings.fields(),
    }
    if task.n_probs > 0 and not streamed:
        out["completion_probabilities"] = probs_json(
            final.probs, ctx.tokenizer, req.post_sampling_probs
        )
    return select_fields(out, req.response_fields) if req.response_fields else out


def select_fields(obj: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """`response_fields` (llama-server's json_get_nested_values): for each path, "a/b" walks
    into nested objects and the value goes to the root under the path as written; a path
    that does not resolve is left out without error."""
    out: dict[str, Any] = {}
    for path in paths:
        cur: Any = obj
        for key in path.split("/"):
            if not (isinstance(cur, dict) and key in cur):
                break
            cur = cur[key]
        else:
            out[path] = cur
    return out


def verbose_json(final: FinalResult, req: ParsedRequest, ctx: ResponseContext
                 ) -> dict[str, Any]:
    """`__verbose` for a `verbose` request: the native result, i.e. the prompt as rendered and
    the raw text (llama-server's to_json_non_oaicompat); nothing otherwise."""
    if not req.verbose:
        return {}
    return {"__verbose": completion_json(final, dataclasses.replace(req, response_fields=[]),
                                         ctx)}


def oai_logprobs(
    probs: list[TokenProbs], req: ParsedRequest, tok: Tokenizer
) -> dict[str, Any] | None:
    """OpenAI `logprobs` object (llama-server: `{"content": [...]}`), None without n_probs."""
    if req.task.n_probs <= 0:
        return None
    return {"content": probs_json(probs, tok, req.post_sampling_probs)}


def text_completion_json(
    final: FinalResult, req: ParsedRequest, ctx: ResponseContext
) -> dict[str, Any]:
    """/v1/completions, stream false."""
    choice = {
        "text": final.content,
        "index": req.task.index,
        "logprobs": oai_logprobs(final.probs, req, ctx.tokenizer),
        "finish_reason": finish_reason(final),
    }
    return {
        "choices": [choice],
        "created": ctx.created,
        "model": ctx.model,
        "system_fingerprint": ctx.fingerprint,
        "object": "text_completion",
        "usage": usage_json(final),
        "id": ctx.id,
        **verbose_json(final, req, ctx),
        **final.timings.fields(),
    }


def chat_completion_json(
    final: FinalResult, req: ParsedRequest, ctx: ResponseContext
) -> dict[str, Any]:
    """/v1/chat/completions, stream false (chat_nonstream.json); with tools or reasoning the
    text is parsed into content, reasoning_content and tool_calls."""
    msg = parse_reply(final, req)
    choice: dict[str, Any] = {
        "finish_reason": finish_reason(final, msg),
        "index": req.task.index,
        "message": {"role": "assistant", "content": msg.content} if req.chat_output is None
        else message_json(msg),
    }
    logprobs = oai_logprobs(final.probs, req, ctx.tokenizer)
    if logprobs is not None:
        choice["logprobs"] = logprobs
    return {
        "choices": [choice],
        "created": ctx.created,
        "model": ctx.model,
        "system_fingerprint": ctx.fingerprint,
        "object": "chat.completion",
        "usage": usage_json(final),
        "id": ctx.id,
        **verbose_json(final, req, ctx),
        **final.timings.fields(),
    }
