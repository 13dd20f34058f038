"""One batched forward over several sequences, for every family (model/arch/).

All tokens of the batch go through the dense layers together as one [T, n_embd] matrix;
attention runs per sequence over that sequence's cells only. Prefill chunks and single decode
tokens mix freely, which is what continuous batching needs. Logits are computed only for the
rows the caller will sample (the output head is a third of a decode step on CPU).

bf16 steps with our kernels run each layer's glue in C: RoPE, the K/V store and attention in
one call a layer, the norms and gates in one call each (step.py's KernelStep, one skeleton for
every architecture: q/k norms, sliding windows, post norms and GeGLU plugged in), when
every sequence's new tokens end its cells; the general path (torch_step.py's TorchStep) does
the same arithmetic with torch's attention where they do not.

Why the layer loop is short: the layers are objects the family built at load (model/layers.py:
a block of a norm, a mixer - attention or a short convolution - and an FFN, with its residual
adds), and the two paths are step objects with one interface (attend a layer's fused q/k/v, the
norms and gates) that every layer calls. What differs between layers was chosen at load: each
layer's kind of memory (global or sliding attention, a convolution's state, and its row in its
cache), its q/k norms, its block. Which step runs is chosen per step, as it depends on where
the batch's new tokens sit in their sequences' cells.

Gemma 3 adds sliding-window layers: a query at position p sees keys at p - n_swa < k <= p only
(llama.cpp's LLAMA_SWA_TYPE_STANDARD), rotated with their own RoPE base. Their K/V live either
in the same cache as the global layers' (`--swa-full`: every layer, every cell, the window
applied by the mask) or in a separate window-sized cache whose cells each step names in
`SeqStep.swa` (memory/pool/swa.py), so a long context costs the sliding layers n_swa cells only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.model import step as kstep
from radixserve.model.step import KernelStep, LayerKind
from radixserve.model.delta_net import DeltaPlan
from radixserve.model.head import RowNeed
from radixserve.model.hparams import HParams
from radixserve.model.layers import Run
from radixserve.model.kernels import Kernels, KVTypes
from radixserve.memory.pool.kv_types import of_dtype
from radixserve.model.quant import Int4Linear
from radixserve.model.rope import Rope
from radixserve.model.short_conv import ShortConv
from radixserve.model.torch_step import Sliding, TorchStep, rms_norm, sliding
from radixserve.model.weights import ModelWeights

__all__ = ["SeqStep", "SwaStep", "Transformer", "resolve_deterministic", "rms_norm"]

log = logging.getLogger(__name__)

@dataclass(slots=True)
class SwaStep:
    """A sequence's part of a forward in the sliding layers' own cache (the split layout): the
    same three things as SeqStep's, in that cache's cells. The cache keeps only the window, so
    kv_positions may start anywhere after 0."""

    cells: list[int]  # where the new tokens' sliding-layer K/V go, one per token
    kv_cells: slice | torch.Tensor  # every cell the sliding layers read, in position order
    kv_positions: list[int]  # their positions


@dataclass(slots=True)
class SeqStep:
    """One sequence's part of a forward, with its cells already reserved by the caller.

    The model knows cells only as row indices of the K/V tensors it is given: which cells a
    sequence owns, and whether there are any left, is the pool's business (kv/), decided
    before the forward runs, so a forward never runs out of cells half-way.
    """

    tokens: list[int]  # new tokens, at consecutive positions from pos0
    pos0: int
    cells: list[int]  # where the new tokens' K/V go, one per token
    kv_cells: slice | torch.Tensor  # every cell attention reads, in position order (new ones too)
    kv_positions: list[int]  # their positions
    n_logits: int = 1  # logits for the last n_logits tokens (0: none)
    swa: SwaStep | None = None  # the sliding layers' cells when they have a cache of their own


def resolve_deterministic(mode: str, dtype: torch.dtype, kernels_built: bool,
                          w: ModelWeights) -> bool:
    """Whether a token's logits will depend only on its token sequence (docs/PERFORMANCE.md).

    Only the bf16 path with our kernels is batch-invariant: torch's f32 matmul and SDPA pick
    their kernels and blockings by shape, so a row's bits change with the rows beside it. `on`
    where that path cannot run is an error rather than a mode that silently is not one. `auto`
    is on wherever it costs nothing measurable; torch's int4 kernel (4-bit weights on CPUs
    without AVX512-BF16) would have to skip its dense GEMM on prefill chunks, ~2x slower
    there, so auto leaves the mode off for it."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"--deterministic must be auto, on or off, got {mode!r}")
    linears = [m for layer in w.layers for m in layer.matrices().values()]
    why = None
    if dtype != torch.bfloat16:
        why = f"--dtype is {str(dtype).removeprefix('torch.')}"
    elif not kernels_built:
        why = "the kernels did not build"
    elif not all(m.row_invariant for m in linears):
        why = "some layer matrices run torch's bf16 GEMM, whose rows change with the row count"
    if mode == "on" and why is not None:
        raise ValueError(f"--deterministic on needs bf16 compute with radixserve's kernels "
                         f"({why}); use --deterministic off or auto")
    if mode == "auto" and why is None and any(isinstance(m, Int4Linear) for m in linears):
        why = "torch's int4 kernel is slow on prefill chunks without its dense switch"
    if mode == "auto" and why is not None:
        log.info("deterministic mode off: %s", why)
    return why is None and mode != "off"


def _new_tokens_last(b: SeqStep) -> bool:
    """The step's tokens are the last cells of the sequence, after every other position."""
    n, kp = len(b.tokens), b.kv_positions
    return (len(kp) >= n and kp[-n] == b.pos0 and kp[-1] == b.pos0 + n - 1
            and (len(kp) == n or kp[-n - 1] < b.pos0))


class Transformer:
    def __init__(self, hp: HParams, w: ModelWeights, dtype: torch.dtype,
                 kern: Kernels | None = None, deterministic: str = "auto") -> None:
        self.hp, self.w, self.dtype = hp, w, dtype
        # bf16 steps run their glue and decode attention in our kernels (model/csrc/), given
        # by the loader when they build (None: torch's ops); f32 (the reference path) stays on
        # torch ops
        self.kern = kern if dtype == torch.bfloat16 else None
        self.deterministic = resolve_deterministic(deterministic, dtype, self.kern is not None,
                                                   w)
        self._warned = False
        self.device = w.output_norm.device  # the model's one device (weights.place)
        self.rope = Rope(hp, w.rope_freqs, device=self.device)
        # sliding layers: their own base, and no position scaling (llama.cpp's
        # rope_freq_scale_train_swa = 1) unless the family scales them as the global ones
        # (gpt-oss); a pool re-rotates their cache with this one
        scaled = hp.rope_swa_scaled
        self.rope_swa = (Rope(hp, w.rope_freqs, base=hp.rope_base_swa,
                              scale=None if scaled else 1.0, device=self.device, yarn=scaled)
                         if hp.n_layer_swa else self.rope)
        # q.k's scale (Gemma 3 27B's and Granite's are not 1/sqrt(head_dim)): our kernel's and
        # SDPA's alike
        self.attn_scale = hp.attn_scale or hp.head_dim ** -0.5
        self.q_dim = hp.n_head * hp.head_dim
        self.kv_dim = hp.n_head_kv * hp.head_dim
        # chosen once here, per layer: the kind of its memory, as (kind, cache index) with
        # all layers in one cache (False) or the sliding ones in their own (True), and its q/k
        # norms (qwen3, gemma3) or None
        self._checked: dict[tuple[int, int], torch.Tensor] = {}  # the C step's norms, checked
        kind = [layer.mixer.kind for layer in w.layers]
        if kind != [hp.layer_kind(li) for li in range(hp.n_layer)]:
            raise ValueError("the layers' mixers do not match the hyperparameters' pattern")
        self.layer_kinds = {split: [(k, hp.cache_index(li, split)) for li, k in enumerate(kind)]
                            for split in (False, True)}
        self._cache_index = {split: [ci for _, ci in kinds]
                             for split, kinds in self.layer_kinds.items()}
        self._norm_pairs = [(getattr(layer.mixer, "q_norm", None),
                             getattr(layer.mixer, "k_norm", None)) for layer in w.layers]
        self._qk_norms = [None if qn is None or kn is None else (qn, kn)
                          for qn, kn in self._norm_pairs]

    @property
    def own_attention(self) -> bool:
        """Attention runs our kernel (bf16 with the kernels built)."""
        return self.kern is not None

    def logits(self, hidden: torch.Tensor, needs: list[RowNeed]) -> torch.Tensor:
        """The head over `hidden`'s rows, for samplers that need what `needs` says
        (model/head.py)."""
        return self.w.head.logits(hidden, needs)

    @torch.inference_mode()
    def hidden(self, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: list[SeqStep],
               k_swa: torch.Tensor | None = None, v_swa: torch.Tensor | None = None,
               types: KVTypes | None = None) -> torch.Tensor:
        """Run `batch`, storing its K/V into `cells` of the caches [n_layer, n_head_kv, n_cells,
        head_dim]; returns the output-normed f32 hidden states [sum n_logits, n_embd] of the
        rows to sample (the head turns them into logits).

        A model with sliding layers given `k_swa`/`v_swa` (the split layout): k_cache/v_cache
        hold the global layers only ([n_layer_full, ...], layer li at hp.cache_index(li)),
        k_swa/v_swa the sliding ones ([n_layer_swa, n_head_kv, n_swa_cells, head_dim]), and
        every step's `.swa` names their cells. Without them (--swa-full) the caches hold every
        layer and the sliding layers read the step's own cells through the window mask.
        `types`: the caches' K and V types (memory/pool/kv_types.py; None: the tensors' float
        dtypes), the sliding caches' too; their last axis is then a stored row's width.

        The step object (KernelStep or TorchStep) is chosen per step, as it depends
        on where the batch's new tokens sit; what each layer runs within it was chosen at load."""
        hp = self.hp
        if types is None:
            types = (of_dtype(k_cache.dtype), of_dtype(v_cache.dtype))
        conv = rec = None
        if hp.n_layer_conv:  # the window part holds the conv layers' input rows, not K/V
            conv = ShortConv.plan(hp, batch, k_swa, v_swa, self.kern)
            k_swa = v_swa = None
        if hp.n_layer_rec:  # ... or the DeltaNet layers' state cells
            rec = DeltaPlan.plan(hp, batch, k_swa, v_swa, self.kern)
            k_swa = v_swa = None
        split = self._split(k_cache, batch, k_swa, v_swa)
        cells = [c for b in batch for c in b.cells]
        device = k_cache.device
        tokens = torch.tensor([t for b in batch for t in b.tokens], dtype=torch.long, device=device)
        pos = torch.tensor(
            [p for b in batch for p in range(b.pos0, b.pos0 + len(b.tokens))], device=device
        )
        cos, sin = self.rope.cos_sin(pos)
        # our attention kernel takes each sequence's new tokens as the last of its cells (all
        # but --cache-reuse's holes); it is the same arithmetic for a decode token and a prefill
        # chunk, so only it keeps a token's bits independent of chunking (and it is faster)
        tail = self.own_attention and all(_new_tokens_last(b) for b in batch)
        if self.deterministic and not tail and not self._warned:
            self._warned = True
            log.warning("deterministic mode: a step with tokens inside a sequence's cells "
                        "runs torch's attention; its bits may depend on the batch")
        swa = sliding(self, batch, pos, split, device) if hp.n_layer_swa else None

        # the residual stream stays in f32: bf16 there flips near-tie greedy choices
        x = self.w.embed(tokens)
        if hp.embd_scale != 1.0:
            x.mul_(hp.embd_scale)
        # then RoPE, the K/V store and attention of the whole step are one kernel call a layer
        # (model/csrc/decode_attn.c) where the C step runs it, else the general path's
        args = (batch, cells, cos, sin, x, swa, split, k_cache, v_cache, k_swa, v_swa, types)
        step: KernelStep | TorchStep | None = None
        if tail:
            step = self._kernel_step(*args)
        if step is None:
            step = TorchStep(self, batch, cells, tail, cos, sin, swa, split, k_cache, v_cache,
                             k_swa, v_swa, types)
        run = Run(step, conv, self._cache_index[split], self.deterministic, rec)
        layers = self.w.layers
        h = step.norm(x, None, layers[0].attn_norm)
        for li, layer in enumerate(layers):
            assert h is not None
            nxt = layers[li + 1].attn_norm if li + 1 < len(layers) else None
            h = layer(run, li, x, h, nxt)
        return self._output(x, batch, device)

    def _split(self, k_cache: torch.Tensor, batch: list[SeqStep], k_swa: torch.Tensor | None,
               v_swa: torch.Tensor | None) -> bool:
        """Whether the sliding layers have a cache of their own (checked against the model)."""
        hp = self.hp
        split = k_swa is not None and hp.n_layer_swa > 0
        if split:
            assert k_swa is not None and v_swa is not None
            if k_cache.shape[0] != hp.n_layer_full or k_swa.shape[0] != hp.n_layer_swa:
                raise ValueError(f"split caches need {hp.n_layer_full} global and "
                                 f"{hp.n_layer_swa} sliding layers, got {k_cache.shape[0]} "
                                 f"and {k_swa.shape[0]}")
            if any(b.swa is None for b in batch):
                raise ValueError("a split sliding-window cache needs every step's .swa")
        return split

    def _output(self, x: torch.Tensor, batch: list[SeqStep],
                device: torch.device) -> torch.Tensor:
        """The output-normed f32 rows of x that the batch samples."""
        hp = self.hp
        rows: list[int] = []
        start = 0
        for b in batch:
            n = len(b.tokens)
            rows.extend(range(start + n - min(b.n_logits, n), start + n))
            start += n
        if not rows:
            return torch.empty(0, hp.n_embd, device=device)
        xr = x[torch.tensor(rows, device=device)] if len(rows) < len(x) else x
        return F.rms_norm(xr, (hp.n_embd,), self.w.output_norm, hp.rms_eps)

    def norm(self, x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor) -> torch.Tensor:
        """x += y (the f32 residual stream; f32 += bf16 needs no conversion op), then its
        RMSNorm in the compute dtype."""
        if self.kern is not None:
            return self.kern.add_rms_norm(x, y, w, self.hp.rms_eps)
        if y is not None:
            x.add_(y)
        return F.rms_norm(x, (self.hp.n_embd,), w, self.hp.rms_eps).to(self.dtype)

    def post_norm(self, x: torch.Tensor, y: torch.Tensor, wp: torch.Tensor,
                  wn: torch.Tensor | None) -> torch.Tensor | None:
        """Gemma's residual step: x += rms_norm(y) * wp (y's norm in f32), then the next
        norm of x in the compute dtype (None when wn is None: after the last layer)."""
        if self.kern is not None:
            return kstep.post_norm(self.kern, x, y, wp, wn, self.hp.rms_eps)
        x.add_(F.rms_norm(y.float(), (self.hp.n_embd,), wp, self.hp.rms_eps))
        return None if wn is None else self.norm(x, None, wn)

    def silu(self, gu: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the fused [gate | up] rows, in the compute dtype."""
        if self.kern is not None:
            return self.kern.silu_mul(gu)
        return F.silu(gu[:, : self.hp.n_ff]) * gu[:, self.hp.n_ff :]

    def gelu(self, gu: torch.Tensor) -> torch.Tensor:
        """Gemma's GeGLU: gelu(gate) * up with the tanh-approximated GELU (HF's
        gelu_pytorch_tanh, llama.cpp's ggml_gelu), in the compute dtype."""
        if self.kern is not None:
            return kstep.gelu_mul(self.kern, gu)
        return F.gelu(gu[:, : self.hp.n_ff], approximate="tanh") * gu[:, self.hp.n_ff :]

    def _kernel_step(self, batch: list[SeqStep], cells: list[int], cos: torch.Tensor,
                     sin: torch.Tensor, x: torch.Tensor, swa: Sliding | None, split: bool,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, k_swa: torch.Tensor | None,
                     v_swa: torch.Tensor | None, types: KVTypes) -> KernelStep | None:
        """The step's glue in C (step.py), for every architecture, when our kernel reads every
        sliding plan too (new tokens at the end of contiguous positions), else None: the general
        path. The global layers read each sequence's cells (positions from 0, as
        attend_causal), the sliding ones its sliding plan's (their own cache in the split
        layout); each layer's q/k norms as loaded (none for llama)."""
        if swa is not None and not all(p.tail for p in swa.plans):
            return None
        hp, kern = self.hp, self.kern
        assert kern is not None
        n_new = [len(b.tokens) for b in batch]
        kinds = {"global": LayerKind(k_cache, v_cache, [b.kv_cells for b in batch], None, 0, cells,
                                 n_new, cos, sin, types)}
        layer_kind = self.layer_kinds[split]
        if swa is not None:
            ks, vs = (k_swa, v_swa) if split else (k_cache, v_cache)
            assert ks is not None and vs is not None
            kinds["sliding"] = LayerKind(ks, vs, [p.cells for p in swa.plans],
                                     [p.pos0 for p in swa.plans], hp.n_swa,
                                     swa.cells, n_new, swa.cos, swa.sin, types)
        return KernelStep(kern, hp.n_head, hp.n_head_kv, hp.head_dim, kinds, layer_kind,
                         self._norm_pairs, x, hp.rms_eps, hp.n_ff, self.attn_scale,
                         self._checked)
