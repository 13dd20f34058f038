"""Server-sent-event chunks for streamed completions (native, OpenAI text, OpenAI chat).

One formatter per request turns engine results into chunk dicts; `sse_event` frames them.
Formatters remember how much text they have sent, so text the engine released only in the
`FinalResult` (a held-back stop-word prefix that turned out not to be one) still reaches the
client before the closing chunk.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from radixserve.engine.task import FinalResult, PartialResult, TaskError, TokenProbs
from radixserve.http.parse import ParsedRequest
from radixserve.http.responses import (
    ResponseContext,
    completion_json,
    finish_reason,
    oai_logprobs,
    probs_json,
    usage_json,
)

log = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(obj: Any) -> bytes:
    """`data: <compact json>\\n\\n` (llama-server framing)."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def sse_error(err: TaskError) -> bytes:
    """An error after the stream started: llama-server sends it as one more data event."""
    return sse_event(err.to_json())


class StreamFormatter:
    """Base: track what was sent; subclasses shape chunks. `done` ends OpenAI streams."""

    done: bytes | None = None

    def __init__(self, req: ParsedRequest, ctx: ResponseContext) -> None:
        self.req, self.ctx = req, ctx
        self.text_sent = ""
        self.n_tokens = 0  # tokens reported so far (running tokens_predicted)
        self.n_probs_sent = 0

    def start(self) -> list[dict[str, Any]]:
        """Chunks sent before the first result (chat's role chunk)."""
        return []

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

    def _close(self, f: FinalResult) -> list[dict[str, Any]]:
        """Finish chunk; with include_usage a usage chunk (empty choices) carries the timings."""
        last = self._envelope([self._finish_choice(f)])
        if not self.req.include_usage:
            return [last | {"timings": f.timings.to_json()}]
        usage = self._envelope([]) | {"usage": usage_json(f), "timings": f.timings.to_json()}
        return [last, usage]

    def _finish_choice(self, f: FinalResult) -> dict[str, Any]:
        raise NotImplementedError


class ChatStream(_OAIStream):
    """chat.completion.chunk events (chat_stream.sse, chat_stream_usage.sse)."""

    object = "chat.completion.chunk"

    def start(self) -> list[dict[str, Any]]:
        role = {"role": "assistant", "content": None}
        choice = {"finish_reason": None, "index": self.req.task.index, "delta": role}
        return [self._envelope([choice])]

    def _chunk(self, text: str, tokens: list[int], probs: list[TokenProbs]) -> dict[str, Any]:
        choice: dict[str, Any] = {"finish_reason": None, "index": self.req.task.index,
                                  "delta": {"content": text}}
        logprobs = oai_logprobs(probs, self.req, self.ctx.tokenizer)
        if logprobs is not None:
            choice["logprobs"] = logprobs
        return self._envelope([choice])

    def _finish_choice(self, f: FinalResult) -> dict[str, Any]:
        return {"finish_reason": finish_reason(f), "index": self.req.task.index, "delta": {}}


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
