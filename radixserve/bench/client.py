"""The benchmark client: closed-loop workers streaming completions over HTTP.

It speaks OpenAI chat completions (plus llama-server's optional `cache_prompt`/`ignore_eos`
body fields and `timings` in the last chunk), so the same client measures radixserve and any
other OpenAI-compatible server; or, as a scenario's `api` says, Anthropic's messages API or
OpenAI's responses API, each conversation's later turns chained by `previous_response_id`
(sending only the new message). TTFT is measured here, on the client: request sent -> first
event that carries generated text (a chat role chunk does not count: servers send it before
prefill).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from radixserve.bench.scenarios import Session
from radixserve.bench.stats import RequestRecord

REQUEST_TIMEOUT_S = 600.0
Messages = list[dict[str, str]]


@dataclass(slots=True)
class RequestOptions:
    """What every request carries besides its messages."""

    n_predict: int
    cache_prompt: bool = True  # false: the server must not reuse any prompt KV (strict no-cache)
    model: str = "bench"
    fields: dict[str, Any] = field(default_factory=dict)  # the scenario's request_fields
    api: str = "chat"  # scenarios.APIS


def _llama_fields(opt: RequestOptions) -> dict[str, Any]:
    """Greedy, fixed length (`ignore_eos`) so every mode and API generates the same number of
    tokens; streamed."""
    return {"model": opt.model, "temperature": 0.0, "seed": 0, "stream": True,
            "ignore_eos": True, "cache_prompt": opt.cache_prompt}


def chat_body(messages: list[dict[str, str]], opt: RequestOptions) -> dict[str, Any]:
    return {
        **_llama_fields(opt),
        "messages": messages,
        "max_tokens": opt.n_predict,
        "stream_options": {"include_usage": True},
        **opt.fields,
    }


def _apply_usage(rec: RequestRecord, usage: dict[str, Any]) -> None:
    """OpenAI `usage` as a fallback for servers without llama.cpp's `timings`."""
    prompt = usage.get("prompt_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    if rec.prompt_n is None and isinstance(prompt, int):
        rec.cache_n, rec.prompt_n = cached, prompt - cached
    if rec.predicted_n is None and isinstance(usage.get("completion_tokens"), int):
        rec.predicted_n = usage["completion_tokens"]


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                      rec: RequestRecord, t0: float) -> str:
    """POST one streamed chat completion; fill `rec`'s timings; return the reply text."""
    text: list[str] = []
    ids: list[int] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            rec.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
            return ""
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                rec.error = str(chunk["error"])[:200]
                break
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if rec.ttft_s is None:
                        rec.ttft_s = time.perf_counter() - t0
                    text.append(piece)
                for entry in (choice.get("logprobs") or {}).get("content") or []:
                    if isinstance(entry.get("id"), int):
                        ids.append(entry["id"])
            if "timings" in chunk:
                tm = chunk["timings"]
                rec.cache_n, rec.prompt_n = tm.get("cache_n"), tm.get("prompt_n")
                rec.predicted_n, rec.prompt_ms = tm.get("predicted_n"), tm.get("prompt_ms")
                rec.predicted_ms = tm.get("predicted_ms")
                rec.predicted_per_second = tm.get("predicted_per_second")
                # speculative decoding only (llama-server omits them when nothing was drafted)
                rec.draft_n, rec.draft_n_accepted = tm.get("draft_n"), tm.get("draft_n_accepted")
            usage = chunk.get("usage") or usage
    _apply_usage(rec, usage)
    if ids and rec.error is None:
        rec.reply_ids = ids
    return "".join(text)


async def _events(r: httpx.Response) -> Any:
    """(event name, data) of a named-event SSE stream (Anthropic's, OpenAI responses')."""
    name = ""
    async for line in r.aiter_lines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            yield name, json.loads(line[5:].strip())


def _text_piece(rec: RequestRecord, text: list[str], piece: Any, t0: float) -> None:
    if isinstance(piece, str) and piece:
        if rec.ttft_s is None:
            rec.ttft_s = time.perf_counter() - t0
        text.append(piece)


def _fail(rec: RequestRecord, r: httpx.Response, body: bytes) -> None:
    rec.error = f"HTTP {r.status_code}: {body.decode(errors='replace')[:200]}"


async def stream_messages(client: httpx.AsyncClient, url: str, messages: Messages,
                          opt: RequestOptions, rec: RequestRecord, t0: float) -> str:
    """One streamed Anthropic message: the system prompt apart, the counts from `usage`
    (input_tokens excludes what a cache read or wrote, as Anthropic counts)."""
    system = "".join(m["content"] for m in messages if m["role"] == "system")
    body = {**_llama_fields(opt), "max_tokens": opt.n_predict,
            "messages": [m for m in messages if m["role"] != "system"], **opt.fields}
    if system:
        body["system"] = system
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", url + "/v1/messages", json=body) as r:
        if r.status_code != 200:
            _fail(rec, r, await r.aread())
            return ""
        async for name, data in _events(r):
            if name == "error":
                rec.error = str(data.get("error"))[:200]
                break
            if name == "message_start":
                usage.update(data["message"].get("usage") or {})
            elif name == "message_delta":
                usage.update(data.get("usage") or {})
            elif name == "content_block_delta":
                _text_piece(rec, text, data["delta"].get("text"), t0)
    read, made = usage.get("cache_read_input_tokens") or 0, usage.get("cache_creation_input_tokens")
    rec.cache_n = read
    rec.prompt_n = (usage.get("input_tokens") or 0) + (made or 0)
    rec.predicted_n = usage.get("output_tokens")
    return "".join(text)


async def stream_response(client: httpx.AsyncClient, url: str, messages: Messages,
                          prev_id: str | None, opt: RequestOptions, rec: RequestRecord,
                          t0: float) -> tuple[str, str | None]:
    """One streamed OpenAI response: after the first turn only the new message, chained to
    the conversation the server stored by `previous_response_id`. Returns (text, its id)."""
    body: dict[str, Any] = {**_llama_fields(opt), "max_output_tokens": opt.n_predict,
                            **opt.fields}
    if prev_id is None:
        body["input"] = messages
    else:
        body["input"], body["previous_response_id"] = messages[-1:], prev_id
    text: list[str] = []
    done: dict[str, Any] = {}
    async with client.stream("POST", url + "/v1/responses", json=body) as r:
        if r.status_code != 200:
            _fail(rec, r, await r.aread())
            return "", None
        async for name, data in _events(r):
            if name in ("error", "response.failed"):
                rec.error = str(data)[:200]
                break
            if name == "response.output_text.delta":
                _text_piece(rec, text, data.get("delta"), t0)
            elif name in ("response.completed", "response.incomplete"):
                done = data["response"]  # incomplete: stopped at max_output_tokens
    usage = done.get("usage") or {}
    cached = (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0
    if isinstance(usage.get("input_tokens"), int):
        rec.cache_n, rec.prompt_n = cached, usage["input_tokens"] - cached
    rec.predicted_n = usage.get("output_tokens")
    return "".join(text), done.get("id")


async def _run_turn(client: httpx.AsyncClient, url: str, s: Session, turn: int,
                    messages: Messages, opt: RequestOptions, phase_t0: float,
                    prev_id: str | None = None) -> tuple[RequestRecord, str, str | None]:
    """One request through `opt.api`: its record, the reply and (responses) its id."""
    t0 = time.perf_counter()
    rec = RequestRecord(s.id, s.group, turn, t0 - phase_t0, 0.0)
    new_id = None
    try:
        if opt.api == "messages":
            reply = await stream_messages(client, url, messages, opt, rec, t0)
        elif opt.api == "responses":
            reply, new_id = await stream_response(client, url, messages, prev_id, opt, rec, t0)
        else:
            reply = await stream_chat(client, url, chat_body(messages, opt), rec, t0)
    except Exception as e:  # any failure is one failed request, never a stuck benchmark
        rec.error, reply = f"{type(e).__name__}: {e}"[:200], ""
    rec.reply = reply
    rec.latency_s = time.perf_counter() - t0
    if rec.ttft_s is None and rec.error is None:
        rec.ttft_s = rec.latency_s  # nothing streamed (all text in the last chunk)
    return rec, reply, new_id


async def run_sessions(url: str, sessions: list[Session], concurrency: int, opt: RequestOptions,
                       on_done: Callable[[RequestRecord], None] | None = None,
                       sent: list[tuple[RequestRecord, Messages]] | None = None,
                       ) -> tuple[list[RequestRecord], float]:
    """Run `sessions` with `concurrency` closed-loop clients; returns (records, wall seconds).
    `sent`, when given, collects every request's messages (to tokenize the prompts afterwards).

    A session's next turn goes to the back of the queue when its reply arrives, so many
    conversations interleave turn by turn (and outnumber the slots) as with real chat users.
    """
    queue: asyncio.Queue[tuple[Session, int, Messages, str | None]] = asyncio.Queue()
    for s in sessions:
        queue.put_nowait((s, 0, [{"role": "system", "content": s.system}], None))
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:

        async def worker() -> None:
            while True:
                s, turn, history, prev_id = await queue.get()
                try:
                    messages = history + [{"role": "user", "content": s.user_turns[turn]}]
                    rec, reply, prev_id = await _run_turn(client, url, s, turn, messages, opt,
                                                          t0, prev_id)
                    records.append(rec)
                    if sent is not None:
                        sent.append((rec, messages))
                    if on_done is not None:
                        on_done(rec)
                    if turn + 1 < len(s.user_turns) and rec.error is None:
                        history = history + [{"role": "user", "content": s.user_turns[turn]},
                                             {"role": "assistant", "content": reply}]
                        queue.put_nowait((s, turn + 1, history, prev_id))
                finally:
                    queue.task_done()

        workers = [asyncio.create_task(worker()) for _ in range(max(1, concurrency))]
        await queue.join()
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return records, time.perf_counter() - t0


async def sent_token_ids(url: str, sent: list[tuple[RequestRecord, Messages]],
                         ) -> list[tuple[list[int], list[int]]] | None:
    """The token ids of the successful requests' prompts (through the server's own template
    and tokenizer: llama-server's /apply-template and /tokenize) and of their replies (the
    ids the server generated where it sent them, else the reply text tokenized alone), in the
    order they were sent. None when the server lacks those endpoints."""
    out: list[tuple[list[int], list[int]]] = []
    try:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as c:

            async def tokenize(text: str, add_special: bool) -> list[int] | None:
                r = await c.post(url + "/tokenize",
                                 json={"content": text, "add_special": add_special})
                if r.status_code != 200:
                    return None
                return [t if isinstance(t, int) else t["id"] for t in r.json()["tokens"]]

            for rec, messages in sorted(sent, key=lambda x: x[0].t_start):
                if rec.error is not None:
                    continue
                r = await c.post(url + "/apply-template", json={"messages": messages})
                if r.status_code != 200:
                    return None
                prompt = await tokenize(r.json()["prompt"], True)
                reply = rec.reply_ids if rec.reply_ids is not None else (
                    await tokenize(rec.reply, False) if rec.reply else [])
                if prompt is None or reply is None:
                    return None
                out.append((prompt, reply))
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return out
