"""A mixture-of-experts FFN: a router scores every expert for each token, the `n_used` best run,
and their outputs are summed with the router's weights (llama.cpp's build_moe_ffn).

Only the chosen experts' matrices are read: the tokens of a step are grouped by expert, and each
expert's own matrices (`ExpertMatrices`: one linear an expert, in the same packed layouts as
every layer matrix) run once over its tokens. A token's bits do not depend on the tokens beside
it: each expert's matmul keeps a row's result independent of the row count (deterministic mode,
as every layer matrix), and a token's expert outputs are summed in the order the router ranked
them, whoever else shares its batch or its experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixserve.model import qmm
from radixserve.model.hparams import MoeDims
from radixserve.model.kernels import Kernels
from radixserve.model.quant import Linear

if TYPE_CHECKING:
    from radixserve.model.layers import Run


class ExpertMatrices(Linear):
    """One role's matrices over a layer's experts (their fused gate/up, or their down), an
    expert's own linear each: reported as one matrix (its routes, its bytes, whether every
    expert's rows are batch-invariant), run an expert at a time."""

    def __init__(self, parts: list[Linear]) -> None:
        self.parts = parts
        self.n_out, self.bias = parts[0].n_out, None
        self.row_invariant = all(p.row_invariant for p in parts)
        self.route = "+".join(sorted({p.route for p in parts}))

    def __getitem__(self, e: int) -> Linear:
        return self.parts[e]

    def __len__(self) -> int:
        return len(self.parts)

    def __call__(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        raise TypeError("expert matrices run one expert at a time")

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


class Router(Linear):
    """The router's [n_expert, n_embd] matrix, its logits exact f32 dot products of the
    token's row: with our kernels the file's own rows (qmm.c's head dots, each logit one
    fixed-order sum, so a token's choice never depends on its batch), else an f32 matmul.
    Choices near a tie flip on the rounding of a logit, so it is not rounded to the compute
    dtype as a layer matrix's output would be."""

    def __init__(self, w: torch.Tensor | qmm.QuantMatrix, bias: torch.Tensor | None = None
                 ) -> None:
        """`bias`: f32 [n_expert] added to the logits (gpt-oss's), or None."""
        self.w, self.bias, self.n_out = w, bias, w.n if isinstance(w, qmm.QuantMatrix) else \
            w.shape[0]
        self.row_invariant = isinstance(w, qmm.QuantMatrix)
        self.route = "qmm-f32" if self.row_invariant else "torch-dense"

    def __call__(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        h = x.float().contiguous()
        y = self.w.head_dots(h) if isinstance(self.w, qmm.QuantMatrix) else F.linear(h, self.w)
        return y if self.bias is None else y + self.bias

    @property
    def nbytes(self) -> int:
        b = 0 if self.bias is None else self.bias.nbytes
        return b + (self.w.raw.nbytes if isinstance(self.w, qmm.QuantMatrix) else self.w.nbytes)


def exact_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + e^-x) rounded to f32 with the same bits whichever rows share the call: torch's
    sigmoid (and exp) take a vectorized path for most elements and a scalar one for a tail
    whose place depends on the tensor's size and the threads, and the two can differ by an
    ulp, which a near-tie turns into another expert. Here e^-x is csrc/exp_f.h's evaluation
    in double (clamp, the 2^n split, a degree-8 polynomial, an exact power-of-two scaling)
    out of torch ops that are each correctly rounded, so no path can differ (within 2 ulp of
    torch's sigmoid)."""
    d = (-x.double()).clamp(-708.0, 708.0)  # 2^n stays a normal double; f32 rounds the rest
    shift = 6755399441055744.0  # 1.5 * 2^52: adding it rounds to an integer
    n = (d * 1.4426950408889634 + shift) - shift
    r = d - n * 0.6931471805599453
    p = torch.full_like(r, 1.0 / 40320)
    for c in (1.0 / 5040, 1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0):
        p = p * r + c
    two_n = ((n.to(torch.int64) + 1023) << 52).view(torch.float64)  # 2^n, exactly
    return (1.0 / (1.0 + p * two_n)).float()


# gpt-oss's clamped SwiGLU (llama.cpp's swiglu_oai fixes them in code, as HF's config does)
OAI_ALPHA, OAI_LIMIT = 1.702, 7.0


def swiglu_oai(gu: torch.Tensor) -> torch.Tensor:
    """gpt-oss's expert gate on fused [gate | up] rows, f32: gate clamped above at 7 and up to
    [-7, 7], then gate * sigmoid(1.702 gate) * (up + 1). Row-invariant: exact_sigmoid."""
    n = gu.shape[1] // 2
    g = gu[:, :n].float().clamp(max=OAI_LIMIT)
    u = gu[:, n:].float().clamp(-OAI_LIMIT, OAI_LIMIT)
    return g * exact_sigmoid(g * OAI_ALPHA) * (u + 1)


def route(logits: torch.Tensor, dims: MoeDims, select_bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's f32 logits [T, n_expert] -> (the chosen experts [T, n_used], best first;
    their weights [T, n_used] f32), as build_moe_ffn: probabilities by the gating function, a
    selection bias added for choosing only, then the weights renormalized (clamped below as
    llama.cpp does) and scaled."""
    if dims.gating == "softmax":
        probs = torch.softmax(logits, dim=-1)
    elif dims.gating == "sigmoid":
        probs = exact_sigmoid(logits)
    else:  # softmax_weight: the softmax is over the chosen logits, below
        probs = logits
    chooser = probs if select_bias is None else probs + select_bias
    idx = torch.topk(chooser, dims.n_used, dim=-1, sorted=True).indices
    w = probs.gather(1, idx)
    if dims.gating == "softmax_weight":
        w = torch.softmax(w, dim=-1)
    if dims.norm_w:
        w = w / w.sum(dim=-1, keepdim=True).clamp_min(6.103515625e-5)
    if dims.w_scale not in (0.0, 1.0):
        w = w * dims.w_scale
    return idx, w


@dataclass(slots=True)
class MoEFFN:
    """Router, experts (SwiGLU: act(gate) * up, then down, each expert's own matrices) and
    the weighted sum of the chosen experts' outputs. `act`: "silu", or "swiglu_oai"
    (gpt-oss's clamped gate)."""

    router: Router
    gate_up: ExpertMatrices  # an expert's [2 n_ff, n_embd] each
    down: ExpertMatrices  # an expert's [n_embd, n_ff] each
    dims: MoeDims
    select_bias: torch.Tensor | None = None  # [n_expert] f32, added for choosing only
    kern: Kernels | None = None  # our kernels (None: torch's ops)
    act: str = "silu"
    shared: SharedExpert | None = None

    def __call__(self, run: Run, h: torch.Tensor) -> torch.Tensor:
        x32 = h.float().contiguous()  # the router's rows, and the shared gate's
        out = self._routed(run, h, x32)
        if self.shared is not None:  # its gated output added in f32, as the routed sum
            out.add_(self.shared(run, h, x32, self.kern))
        return out.to(h.dtype)

    def _routed(self, run: Run, h: torch.Tensor, x32: torch.Tensor) -> torch.Tensor:
        """The chosen experts' weighted sum, f32 [T, n_embd]; x32: h in f32."""
        idx, w = route(self.router(x32), self.dims, self.select_bias)
        n_tok, k = idx.shape
        if n_tok == 1:  # a decode step's token: its experts in rank order, nothing to group
            out = None
            for j, e in enumerate(idx[0].tolist()):
                y = self._expert(run, e, h).float() * w[:, j:j + 1]
                out = y if out is None else out.add_(y)
            assert out is not None
            return out
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, rank) slots grouped by expert
        counts = torch.bincount(flat, minlength=self.dims.n_expert).tolist()
        ys = torch.empty(n_tok * k, h.shape[1], dtype=torch.float32)
        at = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            slots = order[at:at + n]
            at += n
            ys.index_copy_(0, slots, self._expert(run, e, h.index_select(0, slots // k)).float())
        ys = ys.view(n_tok, k, -1)
        out = ys[:, 0] * w[:, :1]
        for j in range(1, k):  # rank order, whatever the batch
            out.add_(ys[:, j] * w[:, j:j + 1])
        return out

    def _expert(self, run: Run, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's SwiGLU over the rows x (the same bits for a row whatever rows share it:
        each matrix is row-invariant)."""
        gu = self.gate_up[e](x, run.inv)
        if self.act != "swiglu_oai":
            gated = silu_mul(self.kern, gu)
        elif self.kern is not None and gu.dtype == torch.bfloat16:
            gated = self.kern.swiglu_oai(gu.contiguous())  # the same in C, one pass
        else:
            gated = swiglu_oai(gu).to(gu.dtype)
        return self.down[e](gated, run.inv)

    def matrices(self) -> dict[str, Linear]:
        out: dict[str, Linear] = {"ffn_router": self.router, "ffn_gate_up_exps": self.gate_up,
                                  "ffn_down_exps": self.down}
        if self.shared is not None:
            out |= {"ffn_gate_up_shexp": self.shared.gate_up, "ffn_down_shexp": self.shared.down}
        return out


def silu_mul(kern: Kernels | None, gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of fused [gate | up] rows: our kernel on bf16 rows (as the dense FFN's,
    row-invariant), else torch's ops."""
    if kern is not None and gu.dtype == torch.bfloat16:
        return kern.silu_mul(gu.contiguous())
    n = gu.shape[1] // 2
    return F.silu(gu[:, :n]) * gu[:, n:]


@dataclass(slots=True)
class SharedExpert:
    """A SwiGLU expert every token runs beside the routed ones (Qwen3.5's), its output times
    sigmoid(gate . x): the gate's logit an exact f32 dot of the token's row (our kernels'
    fixed-order dots, else an f32 matmul) and exact_sigmoid, so its bits never depend on the
    batch."""

    gate: torch.Tensor  # f32 [1, n_embd]
    gate_up: Linear  # [2 n_ff_shared, n_embd]
    down: Linear  # [n_embd, n_ff_shared]

    def __call__(self, run: Run, h: torch.Tensor, x32: torch.Tensor, kern: Kernels | None
                 ) -> torch.Tensor:
        """f32 [T, n_embd] for the rows h (x32: the same rows in f32, contiguous)."""
        logit = kern.head_dots(self.gate, x32) if kern is not None else F.linear(x32, self.gate)
        y = self.down(silu_mul(kern, self.gate_up(h, run.inv)), run.inv)
        return y.float() * exact_sigmoid(logit)
