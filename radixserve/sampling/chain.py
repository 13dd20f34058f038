"""Token sampling: llama.cpp's sampler chain (common/sampling.cpp common_sampler_init), sampler
by sampler as src/llama-sampler.cpp computes it.

The chain: logit_bias (user biases, then -inf for EOG tokens when ignore_eos), the configured
samplers in `samplers` order (default penalties, dry, top_n_sigma, top_k, typ_p, top_p, min_p,
xtc, temperature), then dist (or adaptive_p when listed). mirostat 1/2 replace the configured
samplers with temperature + mirostat. Each sampler works on llama.cpp's candidate array
(ids, logits, probs, a `sorted` flag, in its order), in float32 like the C code, and with its
own std::mt19937 seeded like llama.cpp (ops.MT19937 below), so a seeded request draws what
llama-server draws from the same logits. No Python loop touches the vocabulary: full-vocab
steps are numpy/torch ops; loops run over the history (DRY) or a few candidates only.

Fast paths (model/head.py): a greedy chain is one argmax over the biased/penalized row
(batched across rows), and a chain whose only steps before top_k are bias/penalties/DRY reads
only the best k tokens (RowNeed(top=k), those steps applied in `adjust`). Rows that report
llama-server's pre-sampling n_probs need the whole row (RowNeed(top=0)).
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from radixserve.model.head import MAX_TOP, RowNeed
from radixserve.sampling import ops
from radixserve.text.grammar import Constraint

_MAX_N_PROBS = 100
_MAX_SEED = 2**64  # requests may send any uint64; llama.cpp keeps the low 32 bits
LLAMA_DEFAULT_SEED = 0xFFFFFFFF
_F32 = np.float32
_NEG_INF = _F32(-np.inf)

# ---------------------------------------------------------------- sampler names

SAMPLER_CHARS = {
    "dry": "d", "top_k": "k", "typ_p": "y", "top_p": "p", "top_n_sigma": "s", "min_p": "m",
    "temperature": "t", "xtc": "x", "infill": "i", "penalties": "e", "adaptive_p": "a",
}
DEFAULT_SAMPLERS = (
    "penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature",
)
_UNSUPPORTED = {"infill"}  # needs llama.cpp's FIM token logic (llama_sampler_init_infill)


def _name_map() -> dict[str, str]:
    m: dict[str, str] = {}
    for canon in SAMPLER_CHARS:  # aliases as common_sampler_types_from_names generates them
        if "_" in canon:
            m.setdefault(canon.replace("_", "-"), canon)
            m.setdefault(canon.replace("_", ""), canon)
    m.update(nucleus="top_p", temp="temperature", typ="typ_p")
    m.update({c: c for c in SAMPLER_CHARS})
    return m


_NAMES = _name_map()
_CHARS = {c: name for name, c in SAMPLER_CHARS.items()}


def samplers_from_names(names: Sequence[str], strict: bool = True) -> list[str]:
    """Canonical sampler names for `names` (case-insensitive; "top-k", "topk", "nucleus",
    "temp", "typ", ...), as common_sampler_types_from_names. Unknown names raise ValueError
    when `strict`, else are skipped (llama-server skips them with a warning)."""
    out = []
    for n in names:
        canon = _NAMES.get(str(n).lower())
        if canon is None:
            if strict:
                raise ValueError(f"unknown sampler name {n!r}")
            continue
        out.append(canon)
    return out


def samplers_from_chars(chars: str, strict: bool = True) -> list[str]:
    """Canonical sampler names for a string of sampler chars ("edskypmxt"), as
    common_sampler_types_from_chars."""
    out = []
    for c in chars:
        if c not in _CHARS:
            if strict:
                raise ValueError(f"unknown sampler char {c!r}")
            continue
        out.append(_CHARS[c])
    return out


# ---------------------------------------------------------------- params


@dataclass(slots=True)
class SamplingParams:
    """Per-request knobs, named like llama-server's /completion fields, defaults from
    llama.cpp's common_params_sampling (common/common.h)."""

    temperature: float = 0.8  # <= 0 -> greedy
    top_k: int = 40  # <= 0 -> disabled
    top_p: float = 0.95  # >= 1 -> disabled
    min_p: float = 0.05  # <= 0 -> disabled
    typical_p: float = 1.0  # >= 1 -> disabled
    top_n_sigma: float = -1.0  # <= 0 -> disabled
    xtc_probability: float = 0.0  # <= 0 -> disabled
    xtc_threshold: float = 0.1  # > 0.5 -> disabled
    dynatemp_range: float = 0.0  # <= 0 -> disabled
    dynatemp_exponent: float = 1.0
    repeat_penalty: float = 1.0  # 1.0 -> disabled
    repeat_last_n: int = 64  # 0 -> disabled, -1 -> whole context
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.0  # 0 -> disabled
    dry_base: float = 1.75  # < 1 -> disabled
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64  # 0 -> disabled, -1 -> whole context
    dry_sequence_breakers: list[str] = field(default_factory=lambda: ["\n", ":", '"', "*"])
    # the breakers as llama.cpp processes them: head token -> token tails (see dry_breakers)
    dry_breaker_tokens: dict[int, list[tuple[int, ...]]] | None = None
    mirostat: int = 0  # 0 off, 1 mirostat, 2 mirostat 2.0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    adaptive_target: float = -1.0  # < 0 -> adaptive-p only samples
    adaptive_decay: float = 0.9
    logit_bias: list[tuple[int, float]] = field(default_factory=list)  # (token, bias), summed
    min_keep: int = 0
    seed: int = -1  # -1 -> random seed
    n_probs: int = 0  # report the top-n probabilities of each sampled position
    post_sampling_probs: bool = False  # ... after the chain instead of the raw softmax
    samplers: list[str] = field(default_factory=lambda: list(DEFAULT_SAMPLERS))

    def validate(self) -> None:
        """Raise ValueError for values that would silently produce NaNs or nonsense."""
        for name in ("temperature", "presence_penalty", "frequency_penalty", "typical_p",
                     "top_n_sigma", "xtc_probability", "xtc_threshold", "dynatemp_range",
                     "dynatemp_exponent", "dry_multiplier", "dry_base", "mirostat_tau",
                     "mirostat_eta", "adaptive_target", "adaptive_decay"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)!r}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        rp = self.repeat_penalty
        if not (math.isfinite(rp) and rp > 0.0 and math.isfinite(_F32(1.0) / _F32(rp))):
            raise ValueError(f"repeat_penalty must be > 0, got {self.repeat_penalty!r}")
        if self.repeat_last_n < -1:
            raise ValueError(f"repeat_last_n must be >= -1, got {self.repeat_last_n!r}")
        if self.dry_penalty_last_n < -1:
            raise ValueError(f"dry_penalty_last_n must be >= -1, got {self.dry_penalty_last_n!r}")
        if self.dry_allowed_length < 0:
            raise ValueError(f"dry_allowed_length must be >= 0, got {self.dry_allowed_length!r}")
        if self.mirostat not in (0, 1, 2):
            raise ValueError(f"mirostat must be 0, 1 or 2, got {self.mirostat!r}")
        if self.min_keep < 0:
            raise ValueError(f"min_keep must be >= 0, got {self.min_keep!r}")
        if self.seed != -1 and not 0 <= self.seed < _MAX_SEED:
            raise ValueError(f"seed must be -1 (random) or in [0, 2**64), got {self.seed!r}")
        if not 0 <= self.n_probs <= _MAX_N_PROBS:
            raise ValueError(f"n_probs must be in [0, {_MAX_N_PROBS}], got {self.n_probs!r}")
        for s in self.samplers:
            if s not in SAMPLER_CHARS:
                raise ValueError(f"samplers: unknown sampler {s!r}")
            if s in _UNSUPPORTED:
                raise ValueError(f"samplers: the {s!r} sampler is not supported")
        for b in self.logit_bias:
            if len(b) != 2 or math.isnan(b[1]):
                raise ValueError(f"logit_bias entries must be (token, bias), got {b!r}")

    @property
    def greedy(self) -> bool:
        """The chain reduces to argmax (of the biased/penalized logits): temperature <= 0
        applied by the plain temperature sampler, and nothing that could drop the best token."""
        s = self.samplers
        return (
            self.mirostat == 0 and self.temperature <= 0.0 and self.dynatemp_range <= 0.0
            and "temperature" in s and "adaptive_p" not in s
            and ("typ_p" not in s or self.typical_p >= 1.0)
            and ("xtc" not in s or not _xtc_on(self))
        )

    def llama_fields(self) -> dict[str, Any]:
        """The sampling fields of llama-server's task params JSON (/props, /slots,
        generation_settings)."""
        return {
            "seed": LLAMA_DEFAULT_SEED if self.seed == -1 else self.seed % 2**32,
            "temperature": self.temperature,
            "dynatemp_range": self.dynatemp_range,
            "dynatemp_exponent": self.dynatemp_exponent,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "top_n_sigma": self.top_n_sigma,
            "xtc_probability": self.xtc_probability,
            "xtc_threshold": self.xtc_threshold,
            "typical_p": self.typical_p,
            "repeat_last_n": self.repeat_last_n,
            "repeat_penalty": self.repeat_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "dry_multiplier": self.dry_multiplier,
            "dry_base": self.dry_base,
            "dry_allowed_length": self.dry_allowed_length,
            "dry_penalty_last_n": self.dry_penalty_last_n,
            "mirostat": self.mirostat,
            "mirostat_tau": self.mirostat_tau,
            "mirostat_eta": self.mirostat_eta,
            "adaptive_target": self.adaptive_target,
            "adaptive_decay": self.adaptive_decay,
            "n_probs": self.n_probs,
            "min_keep": self.min_keep,
            "samplers": list(self.samplers),
            "post_sampling_probs": self.post_sampling_probs,
        }


def _xtc_on(p: SamplingParams) -> bool:
    return p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5


def _penalties_on(p: SamplingParams) -> bool:
    return p.repeat_last_n != 0 and (p.repeat_penalty, p.frequency_penalty,
                                     p.presence_penalty) != (1.0, 0.0, 0.0)


def _dry_on(p: SamplingParams) -> bool:
    return p.dry_multiplier != 0.0 and p.dry_base >= 1.0 and p.dry_penalty_last_n != 0


def _enabled(name: str, p: SamplingParams) -> bool:
    """False where llama.cpp's init returns an empty (no-op) sampler."""
    return {
        "penalties": _penalties_on(p),
        "dry": _dry_on(p),
        "top_n_sigma": p.top_n_sigma > 0.0,
        "top_k": p.top_k > 0,
        "typ_p": p.typical_p < 1.0,
        "top_p": p.top_p < 1.0,
        "min_p": p.min_p > 0.0,
        "xtc": _xtc_on(p),
        "temperature": not (p.temperature == 1.0 and p.dynatemp_range <= 0.0),
    }.get(name, True)


# ---------------------------------------------------------------- DRY sequence breakers

_BREAKER_CACHE: dict[tuple[int, tuple[str, ...]], tuple[Any, dict]] = {}


def dry_breakers(breakers: Sequence[str], n_vocab: int, piece: Callable[[int], bytes],
                 tokenize: Callable[[str], list[int]]) -> dict[int, list[tuple[int, ...]]]:
    """llama_sampler_init_dry's processing of sequence breakers: for every token whose text
    contains a breaker, or ends with a breaker's head, that token -> the tokenized rest of the
    breaker (at most 20 tokens; breakers cut to 40 bytes). `piece(t)`: the token's text with
    special tokens rendered; `tokenize(s)`: no BOS, no special-token parsing."""
    out: dict[int, list[tuple[int, ...]]] = {}
    words = [piece(t) for t in range(n_vocab)]
    for s in breakers:
        b = s.encode("utf-8")[:40]
        if not b:
            continue
        for t, word in enumerate(words):
            if b in word:
                tails = out.setdefault(t, [])
                if () not in tails:
                    tails.append(())
                continue
            pos = word.find(b[:1])
            while pos != -1:
                i = 1
                match = True
                while i < len(b) and i + pos < len(word):
                    if word[pos + i] != b[i]:
                        match = False
                        break
                    i += 1
                if match:
                    tail = tuple(tokenize(b[i:].decode("utf-8", "replace"))[:20])
                    tails = out.setdefault(t, [])
                    if tail not in tails:
                        tails.append(tail)
                pos = word.find(b[:1], pos + 1)
    return out


def dry_breakers_for(tok: Any, breakers: Sequence[str]) -> dict[int, list[tuple[int, ...]]]:
    """`dry_breakers` for a radixserve Tokenizer, cached per (tokenizer, breakers): the vocab
    scan runs once, not per request."""
    key = (id(tok), tuple(breakers))
    hit = _BREAKER_CACHE.get(key)
    if hit is not None and hit[0] is tok:
        return hit[1]
    table = dry_breakers(
        breakers, tok.n_vocab, lambda t: tok.token_to_piece(t, special=True),
        lambda s: tok.encode(s, add_special=False, parse_special=False))
    _BREAKER_CACHE[key] = (tok, table)
    return table


@dataclass(slots=True)
class _State:
    """What sampling itself mutates (so a dry run can work on a copy)."""

    rng_dist: ops.MT19937
    rng_xtc: ops.MT19937
    mu: float
    ap_sum: float = 0.0
    ap_weight: float = 0.0
    ap_orig: np.ndarray | None = None
    ap_pending: int = -1
    ap_idx: int = -1

    def copy(self) -> _State:
        return _State(self.rng_dist.copy(), self.rng_xtc.copy(), self.mu, self.ap_sum,
                      self.ap_weight, self.ap_orig, self.ap_pending, self.ap_idx)


# ---------------------------------------------------------------- the sampler


class Sampler:
    """Per-sequence sampler state: the chain's RNGs (seeded once per request), the token
    history for penalties and DRY, mirostat's mu, adaptive-p's average.

    `sample` does not record the token; call `accept` with the token actually emitted (as
    llama.cpp's common_sampler_accept). The prompt is accepted at construction, as
    llama-server's init_sampler does.
    """

    def __init__(
        self, params: SamplingParams, vocab_size: int, prompt_tokens: Sequence[int] = (),
        banned: Sequence[int] = (), constraint: Constraint | None = None,
    ) -> None:
        params.validate()
        self.constraint = constraint  # a grammar: llama.cpp's grammar sampler
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
        p = self.params = params
        self.vocab_size = vocab_size
        if params.seed == -1:
            seed = random.SystemRandom().getrandbits(32)
            while seed == LLAMA_DEFAULT_SEED:
                seed = random.SystemRandom().getrandbits(32)
        else:
            seed = params.seed % 2**32
        self._seed = seed
        self._state = _State(ops.MT19937(seed), ops.MT19937(seed),
                             2.0 * float(_F32(p.mirostat_tau)))
        self._decay = min(max(p.adaptive_decay, 0.0), 0.99)
        tgt = float(_F32(p.adaptive_target))
        self._state.ap_sum = tgt / (1.0 - self._decay)
        self._state.ap_weight = 1.0 / (1.0 - self._decay)
        # the chain, as common_sampler_init builds it
        if p.mirostat == 0:
            self._steps = [s for s in p.samplers if s != "adaptive_p" and _enabled(s, p)]
        else:
            self._steps = ["temp_plain"]
        self._adaptive = p.mirostat == 0 and "adaptive_p" in p.samplers
        self._pen_on = p.mirostat == 0 and "penalties" in p.samplers and _penalties_on(p)
        self._dry_on = p.mirostat == 0 and "dry" in p.samplers and _dry_on(p)
        n = p.repeat_last_n
        self._window: deque[int] = deque(maxlen=None if n < 0 else n)
        self._counts: Counter[int] = Counter()
        m = p.dry_penalty_last_n
        self._dry_hist: deque[int] = deque(maxlen=None if m < 0 else m)
        self._dry_breakers = p.dry_breaker_tokens or {}
        self._dry_cache: tuple[int, dict[int, float] | None] | None = None
        self._n_accepted = 0
        self._user_bias = [(int(t), float(b)) for t, b in p.logit_bias if 0 <= t < vocab_size]
        self._bias: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.int64), np.zeros(0, _F32))
        self._bias_t: tuple[torch.Tensor, torch.Tensor] | None = None
        self._set_bias(banned)
        self._last: ops.Candidates | None = None  # the last draw's (post-sampling probs)
        # greedy with a fast path (argmax of the biased/penalized row); a greedy chain
        # without one runs in full (the temperature step keeps only the best token)
        self.greedy = p.greedy and self._pre_steps("temperature") is not None
        for tok in prompt_tokens:
            self._accept_history(int(tok))

    @property
    def seed(self) -> int:
        """The seed actually used, so a random-seed run can be reproduced later."""
        return self._seed

    # -- history ------------------------------------------------------------------------
    def _accept_history(self, token: int) -> None:
        self._n_accepted += 1
        if self._pen_on:
            w = self._window
            self._counts[token] += 1
            if w.maxlen is not None and len(w) == w.maxlen:
                old = w.popleft()
                self._counts[old] -= 1
                if self._counts[old] <= 0:
                    del self._counts[old]
            w.append(token)
        if self._dry_on:
            self._dry_hist.append(token)

    def accept(self, token: int) -> None:
        """Record an emitted token (penalty and DRY windows, adaptive-p's average)."""
        st = self._state
        if self._adaptive and self.params.adaptive_target >= 0.0:
            if st.ap_pending == token and st.ap_orig is not None:
                st.ap_sum = float(_F32(st.ap_orig[st.ap_idx]) + _F32(self._decay) * _F32(st.ap_sum))
                st.ap_weight = float(_F32(1.0) + _F32(self._decay) * _F32(st.ap_weight))
            st.ap_pending, st.ap_idx = -1, -1
        self._accept_history(int(token))
        if self.constraint is not None:
            self.constraint.accept(int(token))

    # -- the steps before top_k that only touch some tokens -------------------------------
    def _set_bias(self, banned: Sequence[int]) -> None:
        """logit_bias: the user's, then -inf for `banned` (the EOG tokens with ignore_eos),
        as llama-server appends them."""
        pairs = self._user_bias + [(int(t), -math.inf) for t in banned
                                   if 0 <= t < self.vocab_size]
        if not pairs:
            return
        ids = np.array([t for t, _ in pairs], dtype=np.int64)
        self._bias = (ids, np.array([b for _, b in pairs], dtype=_F32))
        # each token once: the bias alone can be one torch scatter-add (same float32 sums)
        self._bias_t = (torch.from_numpy(ids), torch.from_numpy(self._bias[1])) \
            if np.unique(ids).size == ids.size else None

    def _dry_penalties(self) -> dict[int, float] | None:
        """DRY's penalty per token for the current history (None: DRY returns early)."""
        if self._dry_cache is not None and self._dry_cache[0] == self._n_accepted:
            return self._dry_cache[1]
        out = self._dry_compute()
        self._dry_cache = (self._n_accepted, out)
        return out

    def _dry_compute(self) -> dict[int, float] | None:
        p = self.params
        hist = list(self._dry_hist)
        last_n = p.dry_penalty_last_n if p.dry_penalty_last_n > 0 else len(hist)
        n = min(len(hist), last_n)
        allowed = p.dry_allowed_length
        if n <= allowed:
            return None

        def rat(i: int) -> int:
            return hist[-1 - i]

        brk = self._dry_breakers
        rep_limit = n
        for i in range(n):
            tails = brk.get(rat(i))
            if not tails:
                continue
            longest = -1
            for tail in tails:
                sl = len(tail)
                if longest < sl <= i and all(tail[o] == rat(i - o - 1) for o in range(sl)):
                    longest = sl
            if longest >= 0:
                rep_limit = i - longest
                break
        if rep_limit < allowed:
            return None
        cnt = [0] * n
        last, rt, lt = n - 1, 0, 0
        for k in range(1, n):  # Z-algorithm, backwards (llama_sampler_dry_apply step 2)
            if k > rt:
                m = 0
                while m + k < n and rat(m) == rat(m + k):
                    m += 1
                cnt[last - k] = min(m, rep_limit)
                if m > 0:
                    lt, rt = k, k + m - 1
            else:
                pp = k - lt
                right = rt - k + 1
                if cnt[last - pp] < right:
                    cnt[last - k] = min(cnt[last - pp], rep_limit)
                else:
                    j = rt + 1
                    while j < n and rat(j) == rat(j - k):
                        j += 1
                    cnt[last - k] = min(j - k, rep_limit)
                    lt, rt = k, j - 1
        best: dict[int, int] = {}
        for i in range(n - 1):
            r = cnt[i]
            if r >= allowed:
                tok = rat(n - 2 - i)
                if best.get(tok, -1) < r:
                    best[tok] = r
        base = _F32(p.dry_base)
        max_exp = int(_F32(88.7228391) / np.log(base)) if base > _F32(1.000001) else 0
        out: dict[int, float] = {}
        for tok, r in best.items():
            if () in brk.get(tok, ()):
                continue  # single-token breakers are never penalized
            e = r - allowed
            if max_exp > 0 and e > max_exp:
                e = max_exp
            out[tok] = float(_F32(float(_F32(p.dry_multiplier)) * float(base) ** e))
        return out

    def _apply_step(self, cur: ops.Candidates, name: str, st: _State) -> None:
        p = self.params
        if name == "bias":
            ids, vals = self._bias
            if ids.size:
                pos, k = cur.positions(ids)
                cur.logit = cur.logit.copy()  # never write into the caller's row
                np.add.at(cur.logit, pos, vals[k])
        elif name == "penalties":
            if self._counts:
                toks = np.fromiter(self._counts.keys(), np.int64, len(self._counts))
                cnt = np.fromiter(self._counts.values(), _F32, len(self._counts))
                pos, k = cur.positions(toks)
                v = cur.logit[pos]
                rp = _F32(p.repeat_penalty)
                v = np.where(v <= 0, v * rp, v / rp)
                c = cnt[k]
                v = v - (c * _F32(p.frequency_penalty) + (c > 0).astype(_F32)
                         * _F32(p.presence_penalty))
                cur.logit = cur.logit.copy()
                cur.logit[pos] = v
            cur.sorted = False
        elif name == "dry":
            pen = self._dry_penalties()
            if pen is None:
                return
            if pen:
                toks = np.fromiter(pen.keys(), np.int64, len(pen))
                vals = np.fromiter(pen.values(), _F32, len(pen))
                pos, k = cur.positions(toks)
                cur.logit = cur.logit.copy()
                cur.logit[pos] = cur.logit[pos] - vals[k]
            cur.sorted = False
        elif name == "top_n_sigma":
            ops.top_n_sigma(cur, p.top_n_sigma)
        elif name == "top_k":
            ops.top_k(cur, p.top_k)
        elif name == "typ_p":
            ops.typical(cur, p.typical_p, p.min_keep)
        elif name == "top_p":
            ops.top_p(cur, p.top_p, p.min_keep)
        elif name == "min_p":
            ops.min_p(cur, p.min_p, p.min_keep)
        elif name == "xtc":
            ops.xtc(cur, p.xtc_probability, p.xtc_threshold, p.min_keep, st.rng_xtc)
        elif name == "temperature":
            ops.temp_ext(cur, p.temperature, p.dynatemp_range, p.dynatemp_exponent)
        elif name == "temp_plain":
            ops.temp_impl(cur, p.temperature)
        else:  # pragma: no cover - validate() rejects unknown names
            raise ValueError(f"unknown sampler {name!r}")

    def _final(self, cur: ops.Candidates, st: _State) -> None:
        """dist, adaptive-p or mirostat: the step that picks the token."""
        p = self.params
        if p.mirostat == 1:
            ops.softmax(cur, True)
            m = min(99, cur.size - 1)
            i = np.arange(m, dtype=_F32)
            t = np.log((i + 2) / (i + 1))
            with np.errstate(divide="ignore", invalid="ignore"):
                b = np.log(cur.p[:m] / cur.p[1 : m + 1])
                s_hat = ops.seq_sum(t * b) / ops.seq_sum(t * t)
                eps = s_hat - _F32(1)
                k = np.power((eps * np.power(_F32(2), _F32(st.mu)))
                             / (_F32(1) - np.power(_F32(self.vocab_size), -eps)), _F32(1) / s_hat)
            kk = int(k) if math.isfinite(k) and abs(k) < 2**31 else -(2**31)
            ops.top_k(cur, max(kk, 1))
            ops.softmax(cur, True)
            self._mirostat_pick(cur, st)
        elif p.mirostat == 2:
            ops.softmax(cur, True)
            with np.errstate(divide="ignore"):
                over = np.nonzero(-np.log2(cur.p) > _F32(st.mu))[0]
            cur.take(slice(0, max(int(over[0]) if over.size else cur.size, 1)))
            cur.sorted = True
            ops.softmax(cur, True)
            self._mirostat_pick(cur, st)
        elif self._adaptive:
            ops.softmax(cur, False)
            if p.adaptive_target < 0.0:
                cur.selected = st.rng_dist.discrete(cur.p)
                return
            st.ap_orig = cur.p.copy()
            target = min(max(_F32(p.adaptive_target), _F32(0)), _F32(1))
            adapted = target if st.ap_weight == 0.0 else (
                _F32(2) * target - _F32(st.ap_sum) / _F32(st.ap_weight))
            adapted = min(max(_F32(adapted), _F32(0)), _F32(1))
            d = np.abs((cur.p - adapted) * _F32(1.0 / 0.3))
            lg = _F32(5.0) - _F32(10.0) * d * d / (_F32(1) + d)
            cur.logit = np.where(cur.logit == _NEG_INF, cur.logit, lg).astype(_F32)
            ops.softmax(cur, False)
            cur.selected = st.rng_dist.discrete(cur.p)
            st.ap_pending, st.ap_idx = int(cur.ids[cur.selected]), cur.selected
        else:
            ops.dist(cur, st.rng_dist)

    def _mirostat_pick(self, cur: ops.Candidates, st: _State) -> None:
        p = self.params
        idx = st.rng_dist.discrete(cur.p)
        cur.selected = idx
        e = -np.log2(cur.p[idx]) - _F32(p.mirostat_tau)
        st.mu = float(_F32(st.mu) - _F32(p.mirostat_eta) * e)

    def _row(self, logits: torch.Tensor) -> np.ndarray:
        if logits.dim() != 1:
            raise ValueError(f"logits must be 1-D, got shape {tuple(logits.shape)}")
        return logits.detach().to("cpu", torch.float32).numpy()

    def _run(self, logits: torch.Tensor, st: _State) -> ops.Candidates:
        cur = ops.Candidates(self._row(logits))
        if self._bias[0].size:
            self._apply_step(cur, "bias", st)
        steps, p, i = self._steps, self.params, 0
        while i < len(steps):
            if (steps[i] == "top_p" and steps[i + 1 : i + 2] == ["min_p"] and p.min_keep == 0
                    and not cur.sorted and cur.size > 1024):
                ops.top_p_then_min_p(cur, p.top_p, p.min_p)  # the same result, no full sort
                i += 2
                continue
            self._apply_step(cur, steps[i], st)
            i += 1
        self._final(cur, st)
        return cur

    # -- the fast paths --------------------------------------------------------------------
    def _pre_steps(self, upto: str) -> list[str] | None:
        """The token-wise steps (bias, penalties, DRY) that run before the first `upto`
        step, when every other step before it is harmless to a fast path: none for top_k
        (the shortlist), or best-token-keeping filters for a greedy pick (temperature),
        provided no penalty comes after such a filter. None: no fast path."""
        if upto not in self._steps:
            return None
        out = ["bias"] if self._bias[0].size else []
        filtered = False
        for name in self._steps:
            if name == upto:
                return out
            if name in ("penalties", "dry"):
                if filtered:
                    return None
                out.append(name)
            elif upto == "temperature" and name in ("top_k", "top_p", "min_p", "top_n_sigma"):
                filtered = True
            else:
                return None
        return None

    def _adjusted(self, row: torch.Tensor, steps: list[str]) -> torch.Tensor:
        """`row` after the token-wise `steps` (bias, penalties, DRY), computed on the tokens
        they touch only (the same float32 operations as on the whole row, so the same bits);
        the rest of the row is copied once."""
        if steps == ["bias"] and self._bias_t is not None:  # ignore_eos bans: the common case
            out = row.to(torch.float32, copy=True)
            return out.index_add_(0, *self._bias_t)
        ids = np.asarray(self._touched(steps), dtype=np.int64)
        if ids.size == 0:
            return row
        cur = ops.Candidates.of(ids, self._row(row)[ids])
        for name in steps:
            self._apply_step(cur, name, self._state)
        out = row.to(torch.float32, copy=True)
        out[torch.from_numpy(ids)] = torch.from_numpy(cur.logit)
        return out

    def _touched(self, steps: list[str], exact: bool = False) -> list[int]:
        """Tokens the token-wise `steps` change; `exact`: only those whose exact logit
        matters (a -inf bias bans a token whatever its logit, so the head need not score it)."""
        ids: set[int] = set()
        if "bias" in steps:
            b_ids, b_vals = self._bias
            ids.update((b_ids[np.isfinite(b_vals)] if exact else b_ids).tolist())
        if "penalties" in steps:
            ids.update(self._counts)
        if "dry" in steps:
            ids.update(self._dry_penalties() or ())
        return sorted(t for t in ids if 0 <= t < self.vocab_size)

    def head_need(self) -> RowNeed:
        """What the chain reads of a logits row (model/head.py computes only that exactly):
        greedy the best token, a chain starting (after bias/penalties/DRY) with top_k <= 256
        the best k, else the whole vocabulary; pre-sampling n_probs always the whole row."""
        p = self.params
        if p.n_probs > 0 and not p.post_sampling_probs:
            return RowNeed(0)
        if self.greedy:
            top, steps = 1, self._pre_steps("temperature")
        else:
            top, steps = p.top_k, self._pre_steps("top_k")
        if steps is None or not 0 < top <= MAX_TOP:
            return RowNeed(0)
        if self.constraint is not None:
            return self._constrained_need(top, steps)
        if not steps:
            return RowNeed(top)

        def adjust(row: torch.Tensor) -> torch.Tensor:
            return self._adjusted(row, steps)

        return RowNeed(top, self._touched(steps, exact=True), adjust)

    def _constrained_need(self, top: int, steps: list[str]) -> RowNeed:
        """With a grammar the head ranks the allowed tokens too: a greedy pick needs only the
        best allowed one (the unconstrained best, when allowed, is that same token); sampling
        needs both the unconstrained top k (llama.cpp samples first) and the allowed top k
        (its resample after a rejection). Rows with bias/penalty steps get the whole row."""
        assert self.constraint is not None
        allowed = self.constraint.mask()
        ids, vals = self._bias
        # greedy with bans only (ignore_eos): a banned token is just one more unallowed one
        if self.greedy and steps == ["bias"] and bool(np.isneginf(vals).all()):
            allowed = allowed.clone()
            allowed[torch.from_numpy(ids)] = False
        elif steps:
            return RowNeed(0)
        return RowNeed(top, allowed=allowed, allowed_only=self.greedy)

    def greedy_row(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The row a greedy chain takes the argmax of (after bias/penalties), or None when
        that is `logits`."""
        steps = self._pre_steps("temperature") or []
        return self._adjusted(logits, steps) if steps else None

    def _greedy_allowed(self, token: int, row: torch.Tensor) -> int:
        """A greedy pick `token` of `row`, or with a grammar that rejects it the best allowed
        token (llama.cpp's resample; a shortlist row under a grammar holds allowed tokens
        only, so the full-row mask is rarely needed)."""
        c = self.constraint
        if c is None or c.allows(token):
            return token
        return int(torch.argmax(row.masked_fill(~c.mask(), -math.inf)))

    def penalize(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with only the repetition penalties applied (llama.cpp's penalties
        sampler); returns `logits` itself when there is nothing to penalize."""
        if not self._pen_on or not self._counts:
            return logits
        return self._adjusted(logits, ["penalties"])

    # -- sampling ------------------------------------------------------------------------
    def _greedy_pick(self, token: int) -> int:
        cur = ops.Candidates(np.zeros(1, dtype=_F32))
        cur.ids, cur.p, cur.sorted, cur.selected = np.array([token]), np.ones(1, _F32), True, 0
        self._last = cur
        return token

    def sample(self, logits: torch.Tensor) -> int:
        """Pick the next token from 1-D `logits` [vocab]; deterministic given seed + history.

        A grammar joins where llama.cpp's common_sampler_sample puts it: the chain samples
        first; a token the grammar rejects is resampled from the logits with the disallowed
        tokens at -inf (the chain's RNG continues). Greedy: the best allowed token, which is
        what that reject-and-resample gives."""
        c = self.constraint
        if self.greedy:
            row = self.greedy_row(logits)
            row = logits if row is None else row
            return self._greedy_pick(self._greedy_allowed(int(torch.argmax(row)), row))
        cur = self._run(logits, self._state)
        if c is not None and not c.allows(int(cur.ids[cur.selected])):
            cur = self._run(logits.masked_fill(~c.mask(), -math.inf), self._state)
        self._last = cur
        return int(cur.ids[cur.selected])

    def token_probs(self, token: int, logits: torch.Tensor, n: int
                    ) -> tuple[float, list[tuple[int, float]]]:
        """llama-server's populate_token_probs for the token just sampled from `logits`:
        (its probability, the top-n (token, prob)). Pre-sampling (default): the softmax of
        the raw logits over the whole vocabulary. post_sampling_probs: the chain's final
        candidates, sorted by probability, zero-probability ones left out, and 1.0 for a
        token not among them."""
        if n <= 0:
            return 1.0, []
        if self.params.post_sampling_probs:
            cur = self._last
            if cur is None:
                return 1.0, []
            ids, p = cur.ids, cur.p
            if not cur.sorted:
                order = np.argsort(-p, kind="stable")
                ids, p = ids[order], p[order]
            hit = np.nonzero(ids == token)[0]
            prob = float(p[hit[0]]) if hit.size else 1.0
            k = min(n, ids.size)
            zero = np.nonzero(p[:k] == 0.0)[0]
            k = int(zero[0]) if zero.size else k
            return prob, list(zip(ids[:k].tolist(), p[:k].astype(float).tolist()))
        x = logits.detach().to("cpu", torch.float32)
        top_v, top_i = torch.topk(x, min(n, x.numel()))
        e = torch.exp(x - top_v[0])
        s = e.sum()
        return float(e[token] / s), list(zip(top_i.tolist(), (e[top_i] / s).tolist()))

    def top_probs(self, logits: torch.Tensor, n: int) -> list[tuple[int, float]]:
        """Top-n (token, prob) after the whole chain (what post_sampling_probs reports),
        without advancing the sampler's state; zero-probability candidates left out."""
        if n <= 0:
            return []
        if self.greedy:
            row = self.greedy_row(logits)
            row = logits if row is None else row
            return [(self._greedy_allowed(int(torch.argmax(row)), row), 1.0)]
        cur = self._run(logits, self._state.copy())
        order = np.argsort(-cur.p, kind="stable")[:n]
        return [(int(cur.ids[i]), float(cur.p[i])) for i in order if cur.p[i] > 0.0]


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
        rows = logits[greedy]  # advanced indexing: already a copy
        for j, i in enumerate(greedy):
            adj = samplers[i].greedy_row(logits[i])
            if adj is not None:  # per-row bias/penalties, still one argmax for all rows
                rows[j] = adj.to(rows.dtype)
        for j, (i, tok) in enumerate(zip(greedy, rows.argmax(dim=-1).tolist())):
            out[i] = samplers[i]._greedy_pick(samplers[i]._greedy_allowed(tok, rows[j]))
    for i, s in enumerate(samplers):
        if not s.greedy:
            out[i] = s.sample(logits[i])
    return out


_INT_KEY = re.compile(r"^\s*[+-]?\d+$")


def parse_logit_bias(value: Any, n_vocab: int, tokenize: Callable[[str], list[int]]
                     ) -> list[tuple[int, float]]:
    """llama-server's `logit_bias`: [[token|string, bias|false], ...] or
    {"token"|"string": bias|false}; false bans (-inf); strings are tokenized (no BOS, no
    special tokens); malformed entries and out-of-range ids are skipped."""
    out: list[tuple[int, float]] = []

    def bias_of(v: Any) -> float | None:
        if v is False:
            return -math.inf
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(_F32(v))
        return None

    if isinstance(value, list):
        for el in value:
            if not isinstance(el, list) or len(el) != 2:
                continue
            b = bias_of(el[1])
            if b is None:
                continue
            t = el[0]
            if isinstance(t, int) and not isinstance(t, bool):
                if 0 <= t < n_vocab:
                    out.append((t, b))
            elif isinstance(t, str):
                out += [(tok, b) for tok in tokenize(t)]
    elif isinstance(value, dict):
        for key, v in value.items():
            b = bias_of(v)
            if b is None:
                continue
            if key == "" or _INT_KEY.match(key):  # strtol consumed the whole key
                t = int(key) if key else 0
                if 0 <= t < n_vocab:
                    out.append((t, b))
            else:
                out += [(tok, b) for tok in tokenize(key)]
    return out
