"""Token sampling that follows llama.cpp's default sampler chain (common/sampling.cpp).

Chain: penalties -> top_k -> top_p -> min_p -> temperature -> draw. Matching the order matters
because the filters are not commutative (top_p/min_p see the *unscaled* distribution), and
users porting llama-server settings expect the same behaviour. Everything works on torch
tensors so no Python loop ever touches the vocabulary (49k-152k entries).
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve.model.head import RowNeed

_MAX_N_PROBS = 100
_MAX_SEED = 2**64  # torch.Generator.manual_seed accepts [0, 2**64)


@dataclass(slots=True)
class SamplingParams:
    """Per-request knobs, named and defaulted like llama-server's /completion fields."""

    temperature: float = 0.8  # <= 0 -> greedy (argmax), as llama.cpp's --temp 0
    top_k: int = 40  # <= 0 -> disabled
    top_p: float = 0.95  # >= 1 -> disabled
    min_p: float = 0.05  # <= 0 -> disabled
    repeat_penalty: float = 1.0  # 1.0 -> disabled
    repeat_last_n: int = 64  # 0 -> disabled, -1 -> whole context
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1  # -1 -> random seed
    n_probs: int = 0  # return top-n probabilities of each sampled position

    def validate(self) -> None:
        """Raise ValueError for values that would silently produce NaNs or nonsense."""
        for name in ("temperature", "presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)!r}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not (math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0.0):
            raise ValueError(f"repeat_penalty must be > 0, got {self.repeat_penalty!r}")
        if self.repeat_last_n < -1:
            raise ValueError(f"repeat_last_n must be >= -1, got {self.repeat_last_n!r}")
        if self.seed != -1 and not 0 <= self.seed < _MAX_SEED:
            raise ValueError(f"seed must be -1 (random) or in [0, 2**64), got {self.seed!r}")
        if not 0 <= self.n_probs <= _MAX_N_PROBS:
            raise ValueError(f"n_probs must be in [0, {_MAX_N_PROBS}], got {self.n_probs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class Sampler:
    """Per-sequence sampler state: RNG seeded once per request, token history for penalties.

    `sample` does not record the token; call `accept` with the token actually emitted (as
    llama.cpp's common_sampler_accept), so callers may also feed forced/grammar tokens.
    """

    def __init__(
        self, params: SamplingParams, vocab_size: int, prompt_tokens: Sequence[int] = ()
    ) -> None:
        params.validate()
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
        self.params = params
        self.vocab_size = vocab_size
        self._seed = params.seed if params.seed != -1 else random.SystemRandom().getrandbits(32)
        # CPU generator: draws are identical whether logits live on CPU or GPU.
        self._gen = torch.Generator(device="cpu").manual_seed(self._seed)
        n = params.repeat_last_n
        self._window: deque[int] = deque(maxlen=None if n == -1 else n)
        self._counts: Counter[int] = Counter()
        pens = (params.repeat_penalty, params.presence_penalty, params.frequency_penalty)
        self._penalize_on = n != 0 and pens != (1.0, 0.0, 0.0)
        if self._penalize_on:
            for tok in prompt_tokens[-n:] if n > 0 else prompt_tokens:
                self.accept(tok)

    @property
    def seed(self) -> int:
        """The seed actually used, so a random-seed run can be reproduced later."""
        return self._seed

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def accept(self, token: int) -> None:
        """Record a token in the penalty window; O(1), so long generations stay cheap."""
        if not self._penalize_on:
            return
        w = self._window
        if w.maxlen is not None and len(w) == w.maxlen:
            old = w.popleft()
            self._counts[old] -= 1
            if self._counts[old] <= 0:
                del self._counts[old]
        w.append(token)
        self._counts[token] += 1

    def head_need(self, banned: Sequence[int] = ()) -> RowNeed:
        """What this sampler reads of a logits row (model/head.py computes only that exactly):
        greedy the best token, top-k sampling the best k, else the whole vocabulary. `banned`
        tokens are set to -inf before sampling (ignore_eos)."""
        p = self.params
        top = 1 if self.greedy else max(p.top_k, 0)
        ban = list(banned)

        def adjust(row: torch.Tensor) -> torch.Tensor:
            row = self.penalize(row)
            if ban:
                row = row.clone()
                row[ban] = -math.inf
            return row

        return RowNeed(top, list(self._counts), adjust if (self._counts or ban) else None)

    def penalize(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits with repeat/frequency/presence penalties applied; never mutates the input.

        Returns `logits` itself when there is nothing to penalize (no copy of the vocab).
        """
        counts = {t: c for t, c in self._counts.items() if 0 <= t < logits.numel()}
        if not counts:
            return logits
        out = logits.to(torch.float32, copy=True)
        p = self.params
        ids = torch.tensor(list(counts), dtype=torch.long, device=out.device)
        cnt = torch.tensor(list(counts.values()), dtype=torch.float32, device=out.device)
        vals = out[ids]
        vals = torch.where(vals <= 0, vals * p.repeat_penalty, vals / p.repeat_penalty)
        out[ids] = vals - cnt * p.frequency_penalty - p.presence_penalty  # every count is > 0
        return out

    def _candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, logits / T) surviving penalties/top_k/top_p/min_p, sorted by logit desc."""
        p = self.params
        x = self.penalize(logits).to(torch.float32)
        ids: torch.Tensor | None = None
        if 0 < p.top_k < x.numel():
            x, ids = torch.topk(x, p.top_k)  # shrink to k values before anything else
        lse = torch.logsumexp(x, 0)  # top_p's normaliser: every candidate left after top_k
        if p.min_p > 0.0:
            # prob_i >= min_p * prob_max  <=>  logit_i >= logit_max + log(min_p). top_p and
            # min_p both keep a prefix of the sorted order, so pruning first is exact and
            # spares a full-vocab sort when top_k is off.
            sub = (x >= x.max() + math.log(p.min_p)).nonzero().squeeze(1)
            x, ids = x[sub], (sub if ids is None else ids[sub])
        vals, order = torch.sort(x, descending=True, stable=True)
        ids = order if ids is None else ids[order]
        if p.top_p < 1.0:
            cdf = (vals - lse).exp().cumsum(0)
            target = torch.tensor([p.top_p], dtype=cdf.dtype, device=cdf.device)
            # Smallest prefix whose mass reaches top_p (llama.cpp: stop once cum_sum >= p).
            keep = int(torch.searchsorted(cdf, target).item()) + 1
            vals, ids = vals[:keep], ids[:keep]
        return ids, vals / p.temperature

    def sample(self, logits: torch.Tensor) -> int:
        """Pick the next token from 1-D `logits` [vocab]; deterministic given seed + history."""
        if logits.dim() != 1:
            raise ValueError(f"logits must be 1-D, got shape {tuple(logits.shape)}")
        if self.greedy:
            return int(torch.argmax(self.penalize(logits)).item())
        ids, scaled = self._candidates(logits)
        cdf = torch.softmax(scaled, dim=0).cumsum(0)
        # Inverse-CDF draw from one CPU uniform; side="right" never lands on a zero-prob token.
        u = torch.rand((), generator=self._gen).item() * cdf[-1]
        idx = torch.searchsorted(cdf, u.reshape(1), right=True).clamp_(max=ids.numel() - 1)
        return int(ids[idx].item())

    def top_probs(self, logits: torch.Tensor, n: int) -> list[tuple[int, float]]:
        """Top-n (token, prob) of the post-chain distribution, like llama-server's n_probs.

        Only tokens that survive the chain are listed, so fewer than n may come back; a
        greedy sampler reports its single choice with probability 1.
        """
        if n <= 0:
            return []
        if self.greedy:
            return [(self.sample(logits), 1.0)]
        ids, scaled = self._candidates(logits)
        probs = torch.softmax(scaled, dim=0)[:n]  # already sorted descending
        return list(zip(ids[:n].tolist(), probs.tolist()))


def sample_batch(samplers: list[Sampler], logits: torch.Tensor) -> list[int]:
    """Sample one token per row of `logits` [n, vocab].

    Greedy rows share a single batched argmax (one device sync instead of one per row);
    results equal calling `samplers[i].sample(logits[i])` row by row.
    """
    if logits.dim() != 2 or logits.shape[0] != len(samplers):
        raise ValueError(f"logits shape {tuple(logits.shape)} != ({len(samplers)}, vocab)")
    out = [0] * len(samplers)
    greedy = [i for i, s in enumerate(samplers) if s.greedy]
    if greedy:
        rows = logits[greedy].to(torch.float32)  # advanced indexing: already a copy
        for j, i in enumerate(greedy):
            if samplers[i]._counts:  # per-row penalties, then still one argmax for all rows
                rows[j] = samplers[i].penalize(logits[i])
        for i, tok in zip(greedy, rows.argmax(dim=-1).tolist()):
            out[i] = tok
    for i, s in enumerate(samplers):
        if not s.greedy:
            out[i] = s.sample(logits[i])
    return out
