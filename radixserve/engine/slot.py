"""A slot: one sequence of the KV pool serving one task at a time (llama-server's server_slot).

Its KV (`kv`, a SlotKV: the tokens the pool holds for this sequence, and the only way to change
them) survives the task: the slot-level prompt cache. The slot itself keeps the task's side:
progress through the prompt, generated tokens, and the text (incremental UTF-8 decoding and stop
strings, holding back text that could still become a stop word).
"""

from __future__ import annotations

import codecs
import enum
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from radixserve.config import SpecConfig
from radixserve.memory.seq_kv import SlotKV
from radixserve.engine.task import (CompletionTask, FinalResult, PartialResult, Progress, Reuse,
                                   Timings, TokenProbs)
from radixserve.sampling.chain import Sampler
from radixserve.text.tokenizer import Tokenizer


class SlotState(enum.Enum):
    IDLE = "idle"
    PROCESSING_PROMPT = "processing_prompt"
    GENERATING = "generating"


class Slot:
    def __init__(self, kv: SlotKV, n_ctx: int, context_shift: bool = False) -> None:
        self.id, self.n_ctx, self.kv = kv.seq, n_ctx, kv
        self.context_shift = context_shift  # --context-shift: a full context shifts, not stops
        self.state = SlotState.IDLE
        self.t_last_used = -1.0
        self._task: CompletionTask | None = None
        self.last_task: CompletionTask | None = None  # what /slots shows once idle
        self.emit: Callable[[object], None] | None = None  # the running task's consumer
        self.can_speculate = False  # the server drafts (/slots "speculative")
        self.server_spec = SpecConfig()  # the server's --spec-* (a task's own may differ)
        self.reuse: Reuse | None = None  # the last task's reuse report
        self._reset_task_state()

    def _reset_task_state(self) -> None:
        self._sampler: Sampler | None = None
        self.prompt: list[int] = []
        self.n_cached = 0  # prompt tokens reused (any tier, shifted chunks): timings.cache_n
        self.todo: list[tuple[int, int]] = []  # prompt position ranges still to compute
        self.generated: list[int] = []
        self.pending: int | None = None  # sampled, not yet fed back through the model
        self.text = ""
        self.n_sent = 0
        self.n_tokens_sent = 0
        self.probs: list[TokenProbs] = []
        self.n_probs_sent = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.t_start = 0.0
        self.t_first = 0.0
        self.stop_type, self.stopping_word, self.truncated = "none", "", False
        self.n_prompt_processed = 0
        self.has_new_line = False  # a released piece contained "\n" (llama-server's flag)
        self.last_nl_pos = 0  # n_indent: start of the line being checked
        self._piece = ""  # text the last token added
        # speculative decoding: whether this task drafts, the draft under verification and
        # the task's totals (timings.draft_n / draft_n_accepted)
        self.speculative = False
        self.draft: list[int] = []
        self.n_drafted = 0
        self.n_draft_accepted = 0
        # an embedding task: the hidden-state rows it keeps (`keep_rows`), then its result
        self.rows: list[torch.Tensor] = []
        self.embedding: torch.Tensor | None = None

    @property
    def tokens(self) -> Sequence[int]:
        """The tokens whose KV the slot holds (read-only; `kv` changes them)."""
        return self.kv.tokens

    @property
    def n_past(self) -> int:
        """The pending token's position: the tokens the KV holds, and those a rollback left to
        compute again (`kv.redo`, engine/speculative.py)."""
        return len(self.kv) + len(self.kv.redo)

    @property
    def task(self) -> CompletionTask:
        """The running task (only while processing)."""
        assert self._task is not None, f"slot {self.id} has no task"
        return self._task

    @property
    def sampler(self) -> Sampler:
        """The running task's sampler (only while processing)."""
        assert self._sampler is not None, f"slot {self.id} has no sampler"
        return self._sampler

    def send(self, item: object) -> None:
        """Hand a result to the task's consumer (nothing once the task is gone)."""
        if self.emit is not None:
            self.emit(item)

    @property
    def is_processing(self) -> bool:
        return self.state is not SlotState.IDLE

    @property
    def prefilling(self) -> bool:
        return self.state is SlotState.PROCESSING_PROMPT

    def start(self, task: CompletionTask, sampler: Sampler, emit: Callable[[object], None],
              todo: list[tuple[int, int]], n_cached: int, reuse: Reuse | None = None) -> None:
        """Take `task`, whose prompt's reused part the slot's KV already holds; `todo`: the
        position ranges still to compute; `reuse`: where that part came from (kept after the
        task ends: /slots shows the last)."""
        self._reset_task_state()
        self._task, self._sampler, self.emit = task, sampler, emit
        self.prompt = task.prompt_tokens
        self.todo, self.n_cached, self.reuse = todo, n_cached, reuse
        self.state = SlotState.PROCESSING_PROMPT
        self.t_start = time.perf_counter()

    # -- generation ----------------------------------------------------------------------
    def accept(self, t: int, logits: torch.Tensor, tok: Tokenizer) -> bool:
        """Take the token sampled from `logits`; True when the task is done (EOS, a stop string,
        n_predict, the slot's context full without --context-shift, n_indent,
        t_max_predict_ms). Otherwise `t` waits to be fed back (`pending`) and a streamed task
        gets the text released so far. The checks and their order are llama-server's
        (server-context.cpp process_token)."""
        task = self.task
        if task.n_probs > 0:
            self.probs.append(self._token_probs(t, logits, tok))
        self.sampler.accept(t)
        self.generated.append(t)
        if tok.is_eog(t) and not task.ignore_eos:
            self.stop_type = "eos"
            return True
        done = self.add_text(tok.token_to_piece(t, special=task.special))
        if not self.context_shift and len(self.kv) + 1 >= self.n_ctx:
            self.stop_type, self.truncated, done = "limit", True, True
        if not done and 0 <= task.n_predict <= len(self.generated):
            self.stop_type, done = "limit", True
        constraint = self.sampler.constraint
        if not done and constraint is not None and constraint.done:
            self.stop_type, done = "eos", True  # complete: only end-of-generation is left
        if self.has_new_line and task.n_indent > 0:
            done = self._check_indent(task.n_indent) or done
        if "\n" in self._piece:
            self.has_new_line = True
            # after a newline, stop on time (measured from the first token) at the next one
            ms = (time.perf_counter() - self.t_first) * 1e3
            if task.t_max_predict_ms > 0 and ms > task.t_max_predict_ms:
                self.stop_type, done = "limit", True
        if done:
            return True
        self.pending = t
        part = self.partial() if task.stream else None
        if part is not None:
            self.send(part)
        return False

    def _token_probs(self, t: int, logits: torch.Tensor, tok: Tokenizer) -> TokenProbs:
        # llama-server's populate_token_probs: raw softmax, or the chain's with post_sampling
        prob, top = self.sampler.token_probs(t, logits, self.task.n_probs)

        def text(i: int) -> str:
            return tok.token_to_piece(i, special=self.task.special).decode("utf-8", "replace")

        piece = tok.token_to_piece(t, special=self.task.special)
        return TokenProbs(t, piece.decode("utf-8", "replace"), list(piece), prob,
                          [(i, text(i), q) for i, q in top])

    def _check_indent(self, n_indent: int) -> bool:
        """llama-server's n_indent rule: once the line after the last newline has a character
        that is not a space or tab, and its indentation is below n_indent, stop and cut the
        text after the indentation. Advances to the next line (one line per token, as there)."""
        stop = False
        text = self.text
        if self.last_nl_pos > 0:
            pos = self.last_nl_pos
            while pos < len(text) and text[pos] in " \t":
                pos += 1
            if pos < len(text) and pos - self.last_nl_pos < n_indent:
                self.stop_type, stop = "limit", True
                self.text = text[:pos]
        nl = self.text.find("\n", self.last_nl_pos)
        if nl >= 0:
            self.last_nl_pos = nl + 1
        return stop

    def add_text(self, piece: bytes) -> bool:
        """Append a token's bytes; returns True when a stop string completed."""
        self._piece = self._utf8.decode(piece)
        self.text += self._piece
        stops = self._task.stop if self._task else []
        if not stops:
            return False
        longest = max(len(s) for s in stops)
        search_from = max(0, self.n_sent - longest)
        best = -1
        for s in stops:
            if not s:
                continue
            i = self.text.find(s, search_from)
            if i >= 0 and (best < 0 or i < best):
                best, self.stopping_word = i, s
        if best >= 0:
            self.text = self.text[:best]
            self.stop_type = "word"
            return True
        return False

    def _held_back(self) -> int:
        """Characters at the end of the text that could still start a stop string."""
        hold = 0
        for s in self._task.stop if self._task else []:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def partial(self, final: bool = False) -> PartialResult | None:
        end = len(self.text) if final else len(self.text) - self._held_back()
        new_probs = self.probs[self.n_probs_sent :]
        if end <= self.n_sent and not new_probs:
            return None
        text = self.text[self.n_sent : max(end, self.n_sent)]
        self.n_sent = max(end, self.n_sent)
        self.n_probs_sent = len(self.probs)
        tokens = self.generated[self.n_tokens_sent :]
        self.n_tokens_sent = len(self.generated)
        timings = self.timings(time.perf_counter()) if self.task.timings_per_token else None
        return PartialResult(text, tokens, new_probs, timings)

    def report_progress(self) -> None:
        """A `return_progress` task's prompt progress event, now."""
        if self.task.return_progress:
            ms = int((time.perf_counter() - self.t_start) * 1e3)
            self.send(PartialResult("", [], progress=Progress(
                len(self.prompt), self.n_cached, self.n_cached + self.n_prompt_processed, ms)))

    def timings(self, now: float) -> Timings:
        t_first = self.t_first or now
        return Timings(
            cache_n=self.n_cached,
            prompt_n=self.n_prompt_processed,
            prompt_ms=(t_first - self.t_start) * 1e3,
            predicted_n=len(self.generated),
            predicted_ms=max((now - t_first) * 1e3, 1e-3) if self.generated else 0.0,
            draft_n=self.n_drafted if self.speculative else None,
            draft_n_accepted=self.n_draft_accepted,
            reuse=self.reuse,
        )

    def final(self, now: float) -> FinalResult:
        return FinalResult(
            content=self.text,
            tokens=list(self.generated),
            stop_type=self.stop_type,
            stopping_word=self.stopping_word,
            truncated=self.truncated,
            n_prompt_tokens=len(self.prompt),
            n_tokens_cached=len(self.tokens),
            id_slot=self.id,
            timings=self.timings(now),
            probs=list(self.probs),
            has_new_line=self.has_new_line,
            embedding=self.embedding,
        )

    # -- embeddings ----------------------------------------------------------------------
    def rows_wanted(self, p0: int, n: int) -> int:
        """Hidden-state rows the forward returns for prompt tokens p0..p0+n (the last ones of
        the chunk): a completion's and a `last` pooling's final token, every token for
        none / mean, the first for cls."""
        end = p0 + n == len(self.prompt)
        pooling = self.task.pooling
        if pooling in ("none", "mean"):
            return n
        if pooling == "cls" and p0 == 0:
            return n
        return 1 if end else 0

    def keep_rows(self, h: torch.Tensor) -> None:
        """An embedding task keeps the output-normed hidden states of its chunk (f32)."""
        if len(h):
            self.rows.append(h.float().clone())

    def pool_rows(self) -> None:
        """The prompt is computed: llama.cpp's pooling of the kept rows (mean in f32). Every
        row is kept until now, not a running sum: a sum taken chunk by chunk would round by
        how the prompt was chunked, and the result must not depend on it. The result goes to
        JSON on the HTTP side (a long list conversion would stall every slot here)."""
        h = torch.cat(self.rows)
        pooling = self.task.pooling
        out = {"none": h, "mean": h.mean(0, keepdim=True), "cls": h[:1], "last": h[-1:]}
        self.embedding, self.rows = out[pooling], []

    def release(self) -> None:
        self.rows, self.embedding = [], None  # a cancelled embedding's rows, a sent result
        self.state = SlotState.IDLE
        self.t_last_used = time.monotonic()
        self.last_task = self._task
        self._task, self.emit, self._sampler = None, None, None

    # -- /slots --------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "n_ctx": self.n_ctx,
            "speculative": self.can_speculate,
            "is_processing": self.is_processing,
        }
        if self.kv.n_checkpoints:  # a sliding-window model: its context checkpoints
            out["n_checkpoints"] = len(self.kv.checkpoints)
            out["checkpoint_bytes"] = self.kv.checkpoint_bytes
        task = self._task or self.last_task
        if task is None:
            return out
        n_predict = task.n_predict
        n_decoded = len(self.generated) if self._task else 0
        out.update(
            id_task=task.id,
            n_prompt_tokens=len(self.tokens),
            n_prompt_tokens_processed=self.n_prompt_processed,
            n_prompt_tokens_cache=self.n_cached,
            **({} if self.reuse is None else {"reuse": self.reuse.to_json()}),
            params={
                **task.params.llama_fields(),
                "n_predict": n_predict,
                "max_tokens": n_predict,
                "ignore_eos": task.ignore_eos,
                "stop": list(task.stop),
                "id_slot": task.id_slot,
                "cache_prompt": task.cache_prompt,
                **(task.spec or self.server_spec).params_json(),
            },
            next_token=[
                {
                    "has_next_token": self.state is SlotState.GENERATING,
                    "has_new_line": self.has_new_line,
                    "n_remain": (n_predict - n_decoded) if self._task and n_predict >= 0 else -1,
                    "n_decoded": n_decoded,
                }
            ],
        )
        return out
