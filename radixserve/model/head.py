"""The output head: exact f32 logits where they decide a token, found by a fast int8 pass.

An f32 head (49152 x 576 for SmolLM2) is a third of a decode step on CPU; a bf16 head is coarse
enough (0.125 at logit 25) to flip near-tie greedy choices and derail a generation. So when the
sampler only looks at the best `k` tokens (greedy: 1; top-k sampling: k), the head runs an int8
per-row matmul (a quarter of the f32 bytes) that gives approximate logits y and a *certified*
bound |z - y| <= B per token. Every token that could still be among the best k (y + B at least the
k-th largest y - B) is re-scored exactly in f32, with the penalized history; after the sampler's
penalties and bans, the window is widened once if they pushed the k-th value down. Tokens left out
provably cannot reach the k best, so every choice and every top-k probability is what the full f32
head gives. Rows that need the whole distribution (top_k off) get the full f32 head.

The bound, per token i, for h in f32 and its bf16 rounding h':
    |z_i - y_i| <= e_i |h|_1 + a_i (|h - h'|_1 + K 2^-24 |h'|_1) + 2^-7 |y_i|
e_i: the row's largest weight error of the int8 copy, a_i: its largest int8 weight; the terms
are the weight error, the input rounding, f32 accumulation, and the bf16 output rounding (the
int8 kernel accumulates exactly in f32). With our int8 pass (csrc/int8_head.c: VNNI, AVX2 or
plain C, the same integer sums in each) h' is instead
s1 h1 + s2 h2, two int8 parts of h with exact integer sums, so the input term is
|h - h'|_1 plus 2^-20 (|s1 h1|_1 + |s2 h2|_1) for the f32 combination and scaling, and the
output term 2^-20 |y_i| (no bf16 rounding). On the default model B is ~8: a greedy step
re-scores ~10 tokens (at most ~80 seen), a top-40 step ~400 (docs/PERFORMANCE.md).

With our pass the bound is applied in the pass itself (int8_head_bound: each token's upper
and lower bound, and the largest lower bound of the row, in the same f32 formula), and the
tokens above the floor are picked in C (head_candidates), so a greedy row costs the int8 pass,
one pass over its upper bounds and the re-scoring: no vocabulary-sized torch op (Gemma 3's
262,144 tokens made ~10 of them ~1 ms a step, more on a busy machine).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.model.cabi import bind, buf
from radixserve.model.hparams import UnsupportedModelError
from radixserve.model.kernels import Kernels
from radixserve.model.qmm import QuantMatrix

MAX_TOP = 256  # samplers looking at more tokens than this get the full head
_MARGIN = 1.01  # slack on the bound for the kernel's own rounding order
_CHUNK = 4096  # rows decoded at a time for the int8 copy at load
# The widest head whose int8 pass sums exactly in int32 (csrc/int8_head.c): a product is an
# activation byte a + 128 in [0, 255] times a weight code in [-128, 127] (|.| <= 32640), and a
# logit's sum runs over the width, so width x 32640 must stay within 2^31 - 1: 65793. Wider
# heads are refused at load rather than summed with overflow (undefined behaviour in C).
INT8_HEAD_MAX_WIDTH = (2**31 - 1) // (255 * 128)


@dataclass(slots=True)
class RowNeed:
    """What the sampler of one row looks at."""

    top: int  # that many best tokens must be exact (0: the whole vocabulary)
    extra: Sequence[int] = ()  # tokens whose exact logit is needed too (penalized history)
    adjust: Callable[[torch.Tensor], torch.Tensor] | None = None  # penalties / bans, as sampled
    # a grammar's mask [V] bool: the best `top` allowed tokens are exact too (and, with
    # allowed_only, only those: a greedy pick under a grammar needs nothing else)
    allowed: torch.Tensor | None = None
    allowed_only: bool = False


@dataclass(slots=True)
class HeadStats:
    rows_short: int = 0  # rows served from a certified shortlist
    rows_full: int = 0  # rows that got the full f32 head
    rescored: int = 0  # tokens re-scored exactly for shortlist rows
    widened: int = 0  # rows whose window penalties or bans made wider


class OutputHead:
    """The head over its exact f32 rows: `w` an f32 matrix [V, D], or the file's own blocks
    (qmm.QuantMatrix: a quantized head costs its bytes in the file, and its rows are decoded
    to f32 where they are needed: the int8 copy at load, the re-scored tokens, the embedding
    of the step's tokens, every row for the full head). The decoded rows are qmm's, which are
    gguf-py's dequantization (bit for bit for Q8_0, the type of the heads in the common
    GGUFs), so either holder gives the same logits. `kern`: our kernels (None: torch's ops; a
    head in the file's blocks needs them). `logit_scale`: logits are divided by it (Granite's
    logits_scaling), done as the hidden rows divided by it in f32 before the head."""

    def __init__(self, w: torch.Tensor | QuantMatrix, shortlist: bool,
                 kern: Kernels | None = None, logit_scale: float = 1.0) -> None:
        self.logit_scale = logit_scale
        if isinstance(w, QuantMatrix):
            self.w, self.blocks = None, w
            n, d = w.n, w.k
        else:
            self.w, self.blocks = w.float().contiguous(), None  # [V, D] exact f32
            n, d = self.w.shape
        self.shape = (n, d)
        self.stats = HeadStats()
        self.q8: torch.Tensor | None = None
        self.kern: Kernels | None = None
        # exact logits by our fixed-order dot products when the kernels build: torch's f32
        # matmul gives other last bits for other row or token counts (csrc/f32_head.c)
        self.dots = kern
        if self.blocks is not None and self.dots is None:
            raise ValueError("a head in the file's blocks needs our kernels")
        if not shortlist:
            return
        if d > INT8_HEAD_MAX_WIDTH:
            raise UnsupportedModelError(
                f"output head of width {d}: the int8 pass's sums are exact up to "
                f"{INT8_HEAD_MAX_WIDTH} (csrc/int8_head.c; head.py's INT8_HEAD_MAX_WIDTH)")
        self.q8 = torch.empty(n, d, dtype=torch.int8)
        self.s8 = torch.empty(n, dtype=torch.bfloat16)
        self.err, self.amax = torch.empty(n), torch.empty(n)
        self.rowsum = torch.empty(n, dtype=torch.int32)  # for our pass's +128 offset
        for r in range(0, n, _CHUNK):  # in row blocks: no vocabulary-sized f32 temporaries
            w = self.rows(r, min(r + _CHUNK, n))
            s8 = (w.abs().amax(1) / 127).clamp(min=1e-30).to(torch.bfloat16)
            self.s8[r : r + _CHUNK] = s8
            sf = s8.float()[:, None]
            q = torch.round(w / sf).clamp_(-128, 127)
            self.q8[r : r + _CHUNK] = q.to(torch.int8)
            self.rowsum[r : r + _CHUNK] = q.sum(1).to(torch.int32)  # exact: |sum| < 2^24
            w8 = q.mul_(sf)
            self.amax[r : r + _CHUNK] = w8.abs().amax(1)
            self.err[r : r + _CHUNK] = w8.sub_(w).abs_().amax(1)
        if kern is not None and kern.has_int8_head and d % 64 == 0:
            # our int8 pass (csrc/int8_head.c; VNNI, AVX2 or plain C): 3x torch's int8
            # kernel on AVX512, and it keeps the vocabulary-sized passes out of torch
            self.kern = kern
            self.s8f = self.s8.float()
            self._ids = torch.empty(n, dtype=torch.int64)  # head_candidates' output

    @property
    def nbytes(self) -> int:
        held = self.blocks.raw.nbytes if self.blocks is not None else self.w.nbytes
        extra = 0 if self.q8 is None else self.q8.nbytes + self.s8.nbytes
        return held + extra

    def to(self, device: torch.device) -> None:
        """Hold the f32 matrix on `device` (a CUDA model's head: its full pass there, the
        logits back to the host). The int8 shortlist and the file's blocks are CPU kernels'."""
        if self.w is None or self.q8 is not None or self.dots is not None:
            raise ValueError(f"an output head on {device} needs the dense f32 head without our "
                             "kernels (the int8 shortlist and the file's blocks are CPU-only)")
        self.w = self.w.to(device)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Exact f32 rows start..stop [m, D] (a view of the f32 matrix, or decoded)."""
        if self.blocks is None:
            return self.w[start:stop]
        return self.blocks.rows(torch.arange(start, stop))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The rows of `tokens` (int64 [T]) as f32 [T, D]: the token embedding, when tied."""
        if self.blocks is None:
            return F.embedding(tokens, self.w)
        return self.blocks.rows(tokens)

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.logit_scale == 1.0 else h / self.logit_scale

    def full(self, h: torch.Tensor) -> torch.Tensor:
        """Exact f32 logits [n, V] for normed hidden states h [n, D] f32."""
        return self._dots(self._scaled(h))

    def _dots(self, h: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:  # each row decoded once, then head_dots' dot products
            return self.blocks.head_dots(h.contiguous())
        if self.dots is not None:
            return self.dots.head_dots(self.w, h.contiguous())
        return F.linear(h, self.w)

    def logits(self, h: torch.Tensor, needs: list[RowNeed]) -> torch.Tensor:
        """Logits [n, V] for the samplers: exact wherever they look, -inf where they provably
        cannot (rows with a shortlist), or the full f32 head."""
        short = [i for i, nd in enumerate(needs) if 0 < nd.top <= MAX_TOP]
        h = self._scaled(h)
        if not short or self.q8 is None:
            self.stats.rows_full += len(needs)
            return self._dots(h).cpu()  # the samplers run on the host (a device model's too)
        out = torch.empty(h.shape[0], self.shape[0])  # every row filled below
        self._shortlist(h[short], [needs[i] for i in short], out, short)
        rest = sorted(set(range(len(needs))) - set(short))
        if rest:
            idx = torch.tensor(rest)
            out[idx] = self._dots(h[idx])
        self.stats.rows_full += len(rest)
        self.stats.rows_short += len(short)
        return out

    def _shortlist(self, h: torch.Tensor, needs: list[RowNeed], out: torch.Tensor,
                   rows: list[int]) -> None:
        """Fill rows `rows` of `out`: -inf, then the exact logits of every token that could be
        among each row's best `top`."""
        lomax = None  # [n] the largest lower bound of each row, when the pass gives it
        if self.kern is not None:  # the bound and its max in the C pass, no torch pass
            want_lower = any(nd.top > 1 or nd.allowed is not None for nd in needs)
            upper, lower, lomax = self._bounds(h, want_lower)
        else:
            y, c_a, rel = self._approx(h)
            c_w = h.abs().sum(1, keepdim=True)
            bound = torch.addcmul(self.err * c_w, self.amax, c_a).add_(y.abs(), alpha=rel)
            bound.mul_(_MARGIN)
            upper, lower = y + bound, y - bound
        for j, (nd, r) in enumerate(zip(needs, rows)):
            row, up = out[r], upper[j]
            if nd.allowed is None:
                if lomax is not None and nd.top == 1:
                    floor = float(lomax[j])
                else:
                    assert lower is not None
                    floor = self._floor(lower[j], nd.top)
                keep = self._above(up, floor, row)  # and row = -inf
            else:  # ranked among the allowed tokens (a grammar's few, or most of them)
                assert lower is not None
                row.fill_(-torch.inf)
                ok = nd.allowed.nonzero().squeeze(1)
                keep = ok[self._candidates(lower[j][ok], up[ok], nd.top)] if ok.numel() else ok
                if not nd.allowed_only:
                    keep = torch.unique(torch.cat([
                        keep, self._candidates(lower[j], up, nd.top).nonzero().squeeze(1)]))
            ids = self._rescore(h[j], row, keep, nd.extra)
            if nd.adjust is None:
                continue
            seen = nd.adjust(row)
            kth = torch.topk(seen[ids], min(nd.top, ids.numel())).values[-1]
            more = ((up >= kth) & torch.isinf(row)).nonzero().squeeze(1)
            if more.numel():  # penalties or bans lowered the k-th value: widen the window
                self.stats.widened += 1
                self._rescore(h[j], row, more, ())

    @staticmethod
    def _floor(lower: torch.Tensor, top: int) -> float:
        """A floor <= the true top-th best logit: the top-th largest lower bound."""
        if top == 1:
            return float(lower.max())
        return float(torch.topk(lower, min(top, lower.numel())).values[-1])

    @classmethod
    def _candidates(cls, lower: torch.Tensor, upper: torch.Tensor, top: int) -> torch.Tensor:
        """Tokens that could be among the best `top`: upper bound >= a floor that is <= the
        true top-th best logit."""
        return upper >= cls._floor(lower, top)

    def _above(self, up: torch.Tensor, floor: float, row: torch.Tensor) -> torch.Tensor:
        """The tokens with up >= floor, in order; `row` set to -inf on the way."""
        if self.kern is None:
            row.fill_(-torch.inf)
            return (up >= floor).nonzero().squeeze(1)
        v = up.numel()
        n = bind(self.kern.lib).head_candidates(
            buf(up, torch.float32, v, "candidates' bounds"), v, floor,
            buf(self._ids, torch.int64, v, "candidates' ids", at_least=True),
            buf(row, torch.float32, v, "candidates' logits row"))
        return self._ids[:n].clone()

    def _bounds(self, h: torch.Tensor, want_lower: bool
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Our int8 pass with the bound applied in it (csrc/int8_head.c's int8_head_bound):
        upper and (when wanted) lower bounds [n, V] of the exact logits, and each row's
        largest lower bound [n]. The same arithmetic as the torch path's addcmul, add and mul
        over _approx's y (one rounding order, covered by _MARGIN like the kernel's own)."""
        assert self.kern is not None
        n, (rows, d) = h.shape[0], self.q8.shape
        a, sc, c_a = _parts(h)
        c_w = h.abs().sum(1).contiguous()
        c_a = c_a.view(-1).contiguous()
        upper = torch.empty(n, rows)
        lower = torch.empty(n, rows) if want_lower else None
        lomax = torch.empty(n)
        # the copy's own tensors were made to its shape at load, the outputs just above: the
        # per-call inputs are what is checked
        f32 = torch.float32
        rc = bind(self.kern.lib).int8_head_bound(
            self.q8.data_ptr(), self.rowsum.data_ptr(), self.s8f.data_ptr(),
            self.err.data_ptr(), self.amax.data_ptr(),
            buf(a, torch.uint8, 2 * n * d, "int8 parts"), buf(sc, f32, 2 * n, "part scales"),
            rows, d, n, buf(c_w, f32, n, "bound weights term"),
            buf(c_a, f32, n, "bound input term"), 2.0**-20, _MARGIN, upper.data_ptr(),
            None if lower is None else lower.data_ptr(), lomax.data_ptr())
        if rc != 0:
            raise ValueError("int8_head_bound kernel refused the shape")
        return upper, lower, lomax

    def _approx(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Approximate logits y [n, V] of the int8 copy, the input term c_a [n, 1] of the
        bound (times a row's largest int8 weight), and the relative rounding of y."""
        if self.kern is not None:
            a, sc, c_a = _parts(h)
            return self.kern.int8_head(self.q8, self.rowsum, self.s8f, a, sc), c_a, 2.0**-20
        # torch's kernel: bf16 input (rounded), f32 sums, bf16 output (rounded)
        hb = h.to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(hb, self.q8, self.s8).float()
        hbf = hb.float()
        c_a = (h - hbf).abs().sum(1, keepdim=True) + hbf.abs().sum(1, keepdim=True) * (
            h.shape[1] * 2.0**-24)
        return y, c_a, 2.0**-7

    def _rescore(self, h: torch.Tensor, row: torch.Tensor, ids: torch.Tensor,
                 extra: Sequence[int]) -> torch.Tensor:
        if extra:
            ids = torch.unique(torch.cat([ids, torch.tensor(list(extra), dtype=torch.long)]))
        if self.blocks is not None:  # the same dot products, over the decoded rows
            row[ids] = self.blocks.head_dots(h[None].contiguous(), ids)[0]
        elif self.dots is not None:
            row[ids] = self.dots.head_dots(self.w, h[None].contiguous(), ids)[0]
        else:
            row[ids] = F.linear(h, self.w[ids])
        self.stats.rescored += ids.numel()
        return ids


def _parts(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """split_int8's parts and scales for our pass, and the bound's input term c_a [n, 1]:
    the integer sums are exact; the parts' f32 combination and the scale round twice."""
    a, sc, approx, parts_l1 = split_int8(h)
    return a, sc, (h - approx).abs().sum(1, keepdim=True) + parts_l1 * 2.0**-20


def split_int8(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [n, D] f32 as two int8 parts h ~ s1 h1 + s2 h2 (s2 = s1 / 254: the second part holds
    the first one's rounding error), for our int8 head pass. Returns the parts +128 as uint8
    [2n, D] (rows h1_0, h2_0, h1_1, ...), their scales [2n], the f32 value s1 h1 + s2 h2 they
    stand for, and |s1 h1|_1 + |s2 h2|_1 [n, 1] (for the bound's rounding term)."""
    s1 = h.abs().amax(1, keepdim=True).clamp(min=1e-30) / 127
    h1 = torch.round(h / s1).clamp_(-127, 127)
    s2 = s1 / 254
    h2 = torch.round((h - h1 * s1) / s2).clamp_(-127, 127)
    p1, p2 = h1 * s1, h2 * s2
    a = torch.stack([h1, h2], 1).add_(128).to(torch.uint8).view(-1, h.shape[1])
    sc = torch.cat([s1, s2], 1).view(-1)
    return a, sc, p1 + p2, p1.abs().sum(1, keepdim=True) + p2.abs().sum(1, keepdim=True)
