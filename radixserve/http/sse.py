"""Server-sent-event chunks for streamed completions (native, OpenAI text, OpenAI chat).

One formatter per request turns engine results into chunk dicts; `sse_event` frames them.
Formatters remember how much text they have sent, so text the engine released only in the
`FinalResult` (a held-back stop-word prefix that turned out not to be one) still reaches the
client before the closing chunk.

The per-token event of a plain stream (text only: no logprobs, no per-token timings, no
tool/reasoning parsing) is the one chunk that goes out for every token, so `partial_bytes`
writes it from a template: the chunk's JSON cut around its varying fields once per request,
then only the text is encoded per token (`json.dumps` of a string is the same bytes inside a
dict as alone). The bytes are exactly those of `sse_event(chunk)`; tests compare the two.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from radixserve.engine.task import FinalResult, PartialResult, Progress, TokenProbs
from radixserve.errors import TaskError
from radixserve.http.parse import ParsedRequest
from radixserve.http.responses import (
    ResponseContext,
    completion_json,
    finish_reason,
    oai_logprobs,
    probs_json,
    usage_json,
    verbose_json,
)
from radixserve.text.chat_parse import ParsedMessage, message_deltas

log = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(obj: Any) -> bytes:
    """`data: <compact json>\\n\\n` (llama-server framing)."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def sse_named(event: str, data: Any) -> bytes:
    """`event: <event>\\ndata: <compact json>\\n\\n`: a named event (the Responses and
    Anthropic Messages framing)."""
    return b"event: " + event.encode() + b"\n" + sse_event(data)


_MARK = "\x00radixserve-field-{}\x00"  # a string no chunk field holds: cut points


def _template(chunk: dict[str, Any], n_fields: int) -> list[bytes]:
    """`sse_event(chunk)` cut at the fields set to `_MARK.format(i)`, i < n_fields, in the
    order they appear: n_fields + 1 constant pieces to put each field's JSON between."""
    event = sse_event(chunk)
    pieces = []
    for i in range(n_fields):
        head, sep, event = event.partition(json.dumps(_MARK.format(i)).encode())
        assert sep, "template field not found"
        pieces.append(head)
    return pieces + [event]


def _text_json(text: str) -> bytes:
    return json.dumps(text, ensure_ascii=False).encode()


def sse_error(err: TaskError) -> bytes:
    """An error after the stream started: llama-server sends it as one more data event."""
    return sse_event(err.to_json())


class StreamFormatter:
    """Base: track what was sent; subclasses shape chunks. `done` ends OpenAI streams.
    `frame` and `error` write the wire form: llama-server's `data:` events here; an API with
    named events (Anthropic's, OpenAI Responses') frames its own."""

    done: bytes | None = None

    def frame(self, chunk: dict[str, Any]) -> bytes:
        return sse_event(chunk)

    def error(self, err: TaskError) -> bytes:
        """An error after the stream started, as this API sends one."""
        return sse_error(err)

    def __init__(self, req: ParsedRequest, ctx: ResponseContext) -> None:
        self.req, self.ctx = req, ctx
        self.text_sent = ""
        self.n_tokens = 0  # tokens reported so far (running tokens_predicted)
        self.n_probs_sent = 0
        self._tpl: list[bytes] | None = None  # the plain text event, cut (`_text_event`)

    def start(self) -> list[dict[str, Any]]:
        """Chunks sent before the first result (chat's role chunk)."""
        return []

    def partial_bytes(self, p: PartialResult) -> bytes:
        """The SSE events of `partial(p)`, framed; plain text chunks from the template."""
        if p.progress is not None:
            return self.frame(self.progress(p.progress))
        if p.probs or p.timings is not None or not self._plain():
            return b"".join(self.frame(c) for c in self.partial(p))
        self.n_tokens += len(p.tokens)
        if not p.text:
            return b""
        self.text_sent += p.text
        return self._text_event(p.text, p.tokens)

    def progress(self, pr: Progress) -> dict[str, Any]:
        """A `return_progress` event: an empty chunk with `prompt_progress`."""
        return self._chunk("", [], []) | {"prompt_progress": pr.to_json()}

    def _plain(self) -> bool:
        """Whether text chunks are plain (the template applies)."""
        return False

    def _text_event(self, text: str, tokens: list[int]) -> bytes:
        raise NotImplementedError

    def partial(self, p: PartialResult) -> list[dict[str, Any]]:
        self.n_tokens += len(p.tokens)
        chunks = self._delta(p.text, p.tokens, p.probs) if p.text or p.probs else []
        if chunks and p.timings is not None:  # timings_per_token, as llama-server's chunks
            chunks[-1]["timings"] = p.timings.to_json()
        return chunks

    def final(self, f: FinalResult) -> list[dict[str, Any]]:
        """Any text not streamed yet, then the closing chunk(s)."""
        out: list[dict[str, Any]] = []
        rest = f.content[len(self.text_sent) :] if f.content.startswith(self.text_sent) else ""
        rest_probs = f.probs[self.n_probs_sent :] if self.req.task.n_probs > 0 else []
        if rest or rest_probs:
            out += self._delta(rest, [], rest_probs)
        self.n_tokens = len(f.tokens)
        return out + self._close(f)

    def _delta(self, text: str, tokens: list[int], probs: list[TokenProbs]) -> list[dict[str, Any]]:
        self.text_sent += text
        self.n_probs_sent += len(probs)
        return [self._chunk(text, tokens, probs)]

    def _chunk(self, text: str, tokens: list[int], probs: list[TokenProbs]) -> dict[str, Any]:
        raise NotImplementedError

    def _close(self, f: FinalResult) -> list[dict[str, Any]]:
        raise NotImplementedError


class NativeStream(StreamFormatter):
    """/completion: partial objects, then the full final object with empty content; no [DONE]."""

    def _chunk(self, text: str, tokens: list[int], probs: list[TokenProbs]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "index": self.req.task.index,
            "content": text,
            "tokens": tokens,
            "stop": False,
            "id_slot": -1,
            "tokens_predicted": self.n_tokens,
            "tokens_evaluated": len(self.req.task.prompt_tokens),
        }
        if self.req.task.n_probs > 0:
            chunk["completion_probabilities"] = probs_json(
                probs, self.ctx.tokenizer, self.req.post_sampling_probs
            )
        return chunk

    def _close(self, f: FinalResult) -> list[dict[str, Any]]:
        return [completion_json(f, self.req, self.ctx, streamed=True)]

    def _plain(self) -> bool:
        return self.req.task.n_probs <= 0

    def _text_event(self, text: str, tokens: list[int]) -> bytes:
        tpl = self._tpl
        if tpl is None:
            chunk = self._chunk(_MARK.format(0), [], [])
            chunk["tokens"], chunk["tokens_predicted"] = _MARK.format(1), _MARK.format(2)
            tpl = self._tpl = _template(chunk, 3)
        ids = ",".join(map(str, tokens))
        return b"".join((tpl[0], _text_json(text), tpl[1], b"[", ids.encode(), b"]", tpl[2],
                         str(self.n_tokens).encode(), tpl[3]))


class _OAIStream(StreamFormatter):
    done = SSE_DONE
    object = ""

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        c = self.ctx
        return {
            "choices": choices,
            "created": c.created,
            "id": c.id,
            "model": c.model,
            "system_fingerprint": c.fingerprint,
            "object": self.object,
        }

    def _plain(self) -> bool:
        return self.req.task.n_probs <= 0

    def _text_event(self, text: str, tokens: list[int]) -> bytes:
        tpl = self._tpl
        if tpl is None:
            tpl = self._tpl = _template(self._chunk(_MARK.format(0), [], []), 1)
        return tpl[0] + _text_json(text) + tpl[1]

    def _close(self, f: FinalResult) -> list[dict[str, Any]]:
        """Finish chunk (with `__verbose` when asked); with include_usage a usage chunk (empty
        choices) carries the timings."""
        last = self._envelope([self._finish_choice(f)]) | verbose_json(f, self.req, self.ctx)
        if not self.req.include_usage:
            return [last | f.timings.fields()]
        usage = self._envelope([]) | {"usage": usage_json(f), **f.timings.fields()}
        return [last, usage]

    def _finish_choice(self, f: FinalResult) -> dict[str, Any]:
        raise NotImplementedError


class ChatStream(_OAIStream):
    """chat.completion.chunk events (chat_stream.sse, chat_stream_usage.sse).

    With tools or reasoning (`req.chat_output`) the text so far is parsed at each result and
    the deltas from what the client already has are sent (llama-server's msg diffs): the
    parser holds back what is not decided yet, so the deltas add up to the final message.
    Logprobs wait for the next chunk that goes out."""

    object = "chat.completion.chunk"

    def __init__(self, req: ParsedRequest, ctx: ResponseContext) -> None:
        super().__init__(req, ctx)
        self.parser = None if req.chat_output is None else req.chat_output.parser()
        self.sent = ParsedMessage()  # what the client has
        self.raw = ""  # the reply's text so far
        self.msg: ParsedMessage | None = None  # the final parse
        self.held_probs: list[TokenProbs] = []

    def _plain(self) -> bool:
        return self.parser is None and super()._plain()

    def partial(self, p: PartialResult) -> list[dict[str, Any]]:
        if self.parser is None:
            return super().partial(p)
        self.n_tokens += len(p.tokens)
        self.raw += p.text
        self.held_probs += p.probs
        chunks = self._parsed(self.parser.parse(self.raw, partial=True), flush=False)
        if chunks and p.timings is not None:
            chunks[-1]["timings"] = p.timings.to_json()
        return chunks

    def final(self, f: FinalResult) -> list[dict[str, Any]]:
        if self.parser is None:
            return super().final(f)
        self.msg = self.parser.parse(f.content)
        self.held_probs = f.probs[self.n_probs_sent :] if self.req.task.n_probs > 0 else []
        self.n_tokens = len(f.tokens)
        return self._parsed(self.msg, flush=True) + self._close(f)

    def _parsed(self, msg: ParsedMessage, flush: bool) -> list[dict[str, Any]]:
        """Chunks for the deltas up to `msg`; held logprobs go with the first (`flush`: in a
        chunk of their own when there is no delta)."""
        deltas = message_deltas(self.sent, msg)
        if not deltas and flush and self.held_probs:
            deltas = [{}]
        chunks = []
        for delta in deltas:
            choice: dict[str, Any] = {"finish_reason": None, "index": self.req.task.index,
                                      "delta": delta}
            if self.held_probs:
                choice["logprobs"] = oai_logprobs(self.held_probs, self.req, self.ctx.tokenizer)
                self.n_probs_sent += len(self.held_probs)
                self.held_probs = []
            chunks.append(self._envelope([choice]))
        return chunks

    def start(self) -> list[dict[str, Any]]:
        """The role chunk; then the continued assistant message's text, as llama-server
        sends it (not counted as sent text: the replies' parses do not hold it)."""
        role = {"role": "assistant", "content": None}
        choice = {"finish_reason": None, "index": self.req.task.index, "delta": role}
        out = [self._envelope([choice])]
        if self.req.prefill and self.req.stream_prefill:
            out.append(self._envelope([{"finish_reason": None, "index": self.req.task.index,
                                        "delta": {"content": self.req.prefill}}]))
        return out

    def progress(self, pr: Progress) -> dict[str, Any]:
        """As llama-server: the role delta again, with `prompt_progress`."""
        return ChatStream.start(self)[0] | {"prompt_progress": pr.to_json()}

    def _chunk(self, text: str, tokens: list[int], probs: list[TokenProbs]) -> dict[str, Any]:
        choice: dict[str, Any] = {"finish_reason": None, "index": self.req.task.index,
                                  "delta": {"content": text}}
        logprobs = oai_logprobs(probs, self.req, self.ctx.tokenizer)
        if logprobs is not None:
            choice["logprobs"] = logprobs
        return self._envelope([choice])

    def _finish_choice(self, f: FinalResult) -> dict[str, Any]:
        return {"finish_reason": finish_reason(f, self.msg), "index": self.req.task.index,
                "delta": {}}


class TextStream(_OAIStream):
    """/v1/completions stream: text_completion chunks, then [DONE]."""

    object = "text_completion"

    def _chunk(self, text: str, tokens: list[int], probs: list[TokenProbs]) -> dict[str, Any]:
        logprobs = oai_logprobs(probs, self.req, self.ctx.tokenizer)
        choice = {"text": text, "index": self.req.task.index, "logprobs": logprobs,
                  "finish_reason": None}
        return self._envelope([choice])

    def _finish_choice(self, f: FinalResult) -> dict[str, Any]:
        return {"text": "", "index": self.req.task.index, "logprobs": None,
                "finish_reason": finish_reason(f)}
