"""What crosses between the HTTP handlers and the engine thread: tasks in, results out.

Handlers build a `CompletionTask` (tokens already computed, sampling parameters validated) and
read `PartialResult`s and one `FinalResult` back; a failure arrives as `TaskError`
(radixserve/errors.py) carrying the HTTP status and OpenAI error type. Nothing here holds
tensors but an embedding task's result (a CPU f32 tensor the slot lets go of, turned into JSON
off the engine thread).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixserve.config import SpecConfig
from radixserve.errors import TaskError, invalid_request
from radixserve.memory.key import PromptKey
from radixserve.memory.miss_report import Reuse
from radixserve.sampling.chain import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class CompletionTask:
    prompt_tokens: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    n_predict: int = -1  # -1: until EOS or the slot's context is full
    stop: list[str] = field(default_factory=list)
    id_slot: int = -1
    cache_prompt: bool = True
    n_cache_reuse: int | None = None  # None: the server's --cache-reuse
    # vLLM's `cache_salt`: the cache namespace of this prompt's KV. Requests of different salts
    # never share a cached prefix in any tier (a tenant's prompt cannot speed up, so cannot be
    # probed by, another's); "" is the shared namespace of requests that give none
    cache_salt: str = ""
    # OpenAI's `prompt_cache_retention`: seconds the prompt's nodes stay pinned in the radix
    # tree after the task (0: in_memory, plain LRU)
    pin_s: float = 0.0
    # how much of the prompt a pin keeps: its first `pin_n` tokens (-1: all of it; Anthropic's
    # `cache_control` breakpoints pin the prefix up to the last one)
    pin_n: int = -1
    ignore_eos: bool = False
    special: bool = False  # -sp: special tokens (EOS, <|im_end|>...) appear in the text
    timings_per_token: bool = False  # every partial result carries the timings so far
    # a streamed task's prompt progress: a partial result (`progress`) when its slot starts and
    # after each prompt chunk, as llama-server's `return_progress`
    return_progress: bool = False
    n_probs: int = 0
    # partial results per token; off for a non-streamed request, whose consumer only reads the
    # final result (each partial wakes the HTTP thread: ~10% of decode speed on 2 cores)
    stream: bool = True
    # context shift (--context-shift): prompt tokens kept (-1: all; BOS is added on top, as in
    # llama-server) and tokens discarded after them (0: half of the rest)
    n_keep: int = 0
    n_discard: int = 0
    n_indent: int = 0  # >0: stop at a line indented less than this (llama-server's FIM rule)
    t_max_predict_ms: int = -1  # >0: stop at a newline once generation took longer than this
    index: int = 0  # position of this result in a multi-prompt / n_cmpl > 1 response
    n_cmpl: int = 1  # completions of this prompt in the request (>1: a parent or a child)
    # n_cmpl > 1: the first completion of the same prompt; this task waits until that one's
    # prompt is computed and takes its cells instead of computing them again
    parent: CompletionTask | None = None
    # a compiled llguidance grammar (text/grammar.py) constraining the output, or None
    grammar: str | None = None
    # chat prompts: token positions where a user message starts (llama-server's message spans):
    # sliding-window models take context checkpoints there
    user_starts: tuple[int, ...] = ()
    # speculative decoding for this task: the server's settings with the request's
    # `speculative.*` fields applied (None: the server's; types empty: off for this task)
    spec: SpecConfig | None = None
    # an embedding task (/embedding, /v1/embeddings): its pooling (none, mean, cls, last); it
    # ends when its prompt is computed, its result the output-normed hidden states so pooled
    # ("": a completion). Only `last` reads one row, so only it may reuse a cached prefix
    pooling: str = ""
    id: int = -1  # assigned by the engine
    # the prompt as every cache tier keys it (its tokens under `cache_salt`), made once here
    key: PromptKey = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.key = PromptKey(self.cache_salt, self.prompt_tokens)

    @property
    def pin_key(self) -> PromptKey:
        """What a pin (`pin_s`) keeps: the prompt, or its first `pin_n` tokens."""
        return self.key if self.pin_n < 0 else self.key.prefix(self.pin_n)


@dataclass(slots=True)
class TokenProbs:
    """One generated token and the top candidates after the sampling chain (n_probs > 0)."""

    id: int
    token: str
    bytes: list[int]
    prob: float
    top: list[tuple[int, str, float]]


@dataclass(slots=True)
class Timings:
    cache_n: int = 0
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    draft_n: int | None = None  # draft tokens proposed (None: the task did not speculate)
    draft_n_accepted: int = 0  # of them, accepted by the target
    reuse: Reuse | None = None  # why the prompt's prefix was (not) reused

    def to_json(self) -> dict[str, Any]:
        """llama-server's timings, numbers only (clients check that every value is a finite
        number); generation rates use n-1 steps (the first token is free)."""
        steps = self.predicted_n - 1
        draft = ({} if self.draft_n is None else
                 {"draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted})
        return {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / self.prompt_n if self.prompt_n else 0.0,
            "prompt_per_second": 1e3 * self.prompt_n / self.prompt_ms if self.prompt_ms else 0.0,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": self.predicted_ms / steps if steps > 0 else 0.0,
            "predicted_per_second": 1e3 * steps / self.predicted_ms
            if steps > 0 and self.predicted_ms > 0
            else 0.0,
            **draft,
        }

    def fields(self) -> dict[str, Any]:
        """What a completion carries about its run: `timings` and, beside it, the `reuse`
        report when there is one."""
        out: dict[str, Any] = {"timings": self.to_json()}
        if self.reuse is not None:
            out["reuse"] = self.reuse.to_json()
        return out


@dataclass(slots=True)
class PartialResult:
    """Text released since the last partial (stop-string prefixes are held back)."""

    text: str
    tokens: list[int]
    probs: list[TokenProbs] = field(default_factory=list)
    timings: Timings | None = None  # with timings_per_token
    progress: Progress | None = None  # return_progress: a prompt progress event (no text)


@dataclass(frozen=True, slots=True)
class Progress:
    """Where a prompt's processing stands (llama-server's `prompt_progress`): its tokens, those
    a cache served, those the slot holds so far (served + computed), ms since it started."""

    total: int
    cache: int
    processed: int
    time_ms: int

    def to_json(self) -> dict[str, int]:
        return {"total": self.total, "cache": self.cache, "processed": self.processed,
                "time_ms": self.time_ms}


@dataclass(slots=True)
class FinalResult:
    content: str  # the whole generated text (stop word removed)
    tokens: list[int]  # all generated tokens
    stop_type: str  # none | eos | word | limit
    stopping_word: str
    truncated: bool  # stopped because the slot's context was full
    n_prompt_tokens: int
    n_tokens_cached: int  # tokens the slot holds at the end (llama-server's tokens_cached)
    id_slot: int
    timings: Timings
    probs: list[TokenProbs] = field(default_factory=list)
    has_new_line: bool = False  # a newline was generated (llama-server's has_new_line)
    # an embedding task's result, f32 [rows, n_embd]: one pooled row, or one per prompt token
    # (pooling none)
    embedding: torch.Tensor | None = None


def check_prompt(tokens: list[int], n_ctx_slot: int, n_vocab: int,
                 pooling: str | None = None) -> None:
    """Reject a prompt that can never run: no tokens, unknown ids, or no room in a slot. As
    llama-server, an input pooled over all its rows (embeddings: none, mean, cls) may fill the
    context, since nothing is generated; anything else (completions, `last` pooling) must leave
    room for one more token."""
    n = len(tokens)
    if n == 0:
        raise invalid_request('"prompt" must not be empty')
    if any(not 0 <= t < n_vocab for t in tokens):
        raise invalid_request("Prompt contains invalid tokens")
    if pooling in ("none", "mean", "cls"):
        if n > n_ctx_slot:
            raise TaskError(400, "exceed_context_size_error",
                            f"input ({n} tokens) is larger than the max context size "
                            f"({n_ctx_slot} tokens). skipping",
                            n_prompt_tokens=n, n_ctx=n_ctx_slot)
    elif n >= n_ctx_slot:
        raise TaskError(400, "exceed_context_size_error",
                        f"request ({n} tokens) exceeds the available context size "
                        f"({n_ctx_slot} tokens), try increasing it",
                        n_prompt_tokens=n, n_ctx=n_ctx_slot)
