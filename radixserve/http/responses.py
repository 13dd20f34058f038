"""JSON bodies of finished completions: native /completion, OpenAI text and chat.

Shapes follow llama-server (shared/reference/llama-server-shapes/): same keys, nesting and
value types, so llama.cpp clients, the OpenAI SDK and llama.cpp's own tests read them as is.
Streaming chunks are built in `sse.py` from the same helpers.
"""

from __future__ import annotations

import logging
import math
import secrets
import string
import time
from dataclasses import dataclass, field
from typing import Any

from radixserve import __version__
from radixserve.engine.task import CompletionTask, FinalResult, TokenProbs
from radixserve.http.parse import ParsedRequest
from radixserve.model.sampling import SamplingParams
from radixserve.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

BUILD_INFO = f"b{__version__}-radixserve"  # llama-server's system_fingerprint starts with "b"
SAMPLERS = ["penalties", "top_k", "top_p", "min_p", "temperature"]  # our chain, in order
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


def finish_reason(final: FinalResult) -> str:
    """llama-server: "stop" for EOS or a stop word, else (n_predict, context) "length"."""
    return "stop" if final.stop_type in ("eos", "word") else "length"


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


def params_json(
    params: SamplingParams,
    n_predict: int,
    *,
    ignore_eos: bool = False,
    stream: bool = False,
    stop: list[str] | None = None,
    post_sampling_probs: bool = False,
) -> dict[str, Any]:
    """llama-server's task `params` object (props, /slots, generation_settings). Samplers we
    do not implement are reported at their disabled values so clients see the truth."""
    return {
        "seed": 0xFFFFFFFF if params.seed == -1 else params.seed,
        "temperature": params.temperature,
        "dynatemp_range": 0.0,
        "dynatemp_exponent": 1.0,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "top_n_sigma": -1.0,
        "xtc_probability": 0.0,
        "xtc_threshold": 0.1,
        "typical_p": 1.0,
        "repeat_last_n": params.repeat_last_n,
        "repeat_penalty": params.repeat_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "dry_multiplier": 0.0,
        "dry_base": 1.75,
        "dry_allowed_length": 2,
        "dry_penalty_last_n": 64,
        "mirostat": 0,
        "mirostat_tau": 5.0,
        "mirostat_eta": 0.1,
        "adaptive_target": -1.0,
        "adaptive_decay": 0.9,
        "max_tokens": n_predict,
        "n_predict": n_predict,
        "n_keep": 0,
        "n_discard": 0,
        "ignore_eos": ignore_eos,
        "stream": stream,
        "n_probs": params.n_probs,
        "min_keep": 0,
        "chat_format": "Content-only",
        "reasoning_format": "none",
        "reasoning_in_content": False,
        "generation_prompt": "",
        "samplers": list(SAMPLERS),
        "speculative.types": "none",
        "timings_per_token": False,
        "post_sampling_probs": post_sampling_probs,
        "backend_sampling": False,
        "lora": [],
        **({"stop": list(stop)} if stop is not None else {}),
    }


def task_params_json(task: CompletionTask, stream: bool = False) -> dict[str, Any]:
    """`params_json` of a task (what /slots shows for a slot's current or last task)."""
    return params_json(
        task.params, task.n_predict, ignore_eos=task.ignore_eos, stream=stream, stop=task.stop
    )


def completion_json(
    final: FinalResult, req: ParsedRequest, ctx: ResponseContext, streamed: bool = False
) -> dict[str, Any]:
    """Native /completion final object; `streamed`: the SSE last chunk (content already sent)."""
    task = req.task
    out: dict[str, Any] = {
        "index": 0,
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
        )
        | {"n_ctx": ctx.n_ctx_slot},
        "prompt": ctx.tokenizer.decode(task.prompt_tokens),
        "has_new_line": "\n" in final.content,
        "truncated": final.truncated,
        "stop_type": final.stop_type,
        "stopping_word": final.stopping_word,
        "tokens_cached": final.n_tokens_cached,
        "timings": final.timings.to_json(),
    }
    if task.n_probs > 0 and not streamed:
        out["completion_probabilities"] = probs_json(
            final.probs, ctx.tokenizer, req.post_sampling_probs
        )
    return out


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
        "index": 0,
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
        "timings": final.timings.to_json(),
    }


def chat_completion_json(
    final: FinalResult, req: ParsedRequest, ctx: ResponseContext
) -> dict[str, Any]:
    """/v1/chat/completions, stream false (chat_nonstream.json)."""
    choice: dict[str, Any] = {
        "finish_reason": finish_reason(final),
        "index": 0,
        "message": {"role": "assistant", "content": final.content},
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
        "timings": final.timings.to_json(),
    }
