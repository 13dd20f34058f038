"""A model's weights: the layer stack its family builds (model/arch/, from model/tensors.py's
packed or dense linears), the embedding, the final norm and the output head; their routes and
bytes (`perf --routes`), and the move of dense weights to another device.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from radixserve.model import qmm
from radixserve.model.arch import family_of
from radixserve.model.head import OutputHead
from radixserve.model.hparams import HParams
from radixserve.model.kernels import Kernels
from radixserve.model.layers import Block
from radixserve.model.moe import ExpertMatrices
from radixserve.model.quant import ConcatLinear, DenseLinear, Linear
from radixserve.model.tensors import TensorLoader

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelWeights:
    # [n_vocab, n_embd] in the compute dtype; None when the embedding is the head's own rows
    # (tied: the head's f32 matrix or the file's blocks)
    tok_embd: torch.Tensor | qmm.QuantMatrix | None
    output_norm: torch.Tensor
    head: OutputHead
    layers: list[Block]
    rope_freqs: torch.Tensor | None  # llama3-style per-frequency divisors
    n_params: int  # as llama.cpp counts them (a tied output matrix once)
    packed: bool
    dtype: torch.dtype = torch.float32  # the compute dtype (an untied embedding's rounding)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The f32 embedding rows of `tokens` (int64 [T]): the head's exact rows when tied,
        else token_embd's in the compute dtype (decoded from the file's blocks when it is held
        in them)."""
        if self.tok_embd is None:
            return self.head.embed(tokens)
        if isinstance(self.tok_embd, qmm.QuantMatrix):
            return self.tok_embd.rows(tokens).to(self.dtype).float()
        return F.embedding(tokens, self.tok_embd).float()

    def routes(self) -> dict[str, dict[str, int]]:
        """Each layer matrix's route (model/kernel_routes.py; a fused matrix of mixed routes is one
        route a part, joined by "+"), as {matrix: {route: layers}}."""
        out: dict[str, dict[str, int]] = {}
        for layer in self.layers:
            for name, m in layer.matrices().items():
                out.setdefault(name, {})
                out[name][m.route] = out[name].get(m.route, 0) + 1
        return out

    def route_bytes(self) -> dict[str, int]:
        """Bytes each layer matrix holds in memory over all layers, {matrix: bytes}."""
        out: dict[str, int] = {}
        for layer in self.layers:
            for name, m in layer.matrices().items():
                out[name] = out.get(name, 0) + m.nbytes
        return out

    @property
    def mapped_bytes(self) -> int:
        """Of nbytes, the file's pages the mapped expert tensors read (the file-rows route):
        resident once read, shared with the page cache, never a copy."""
        return sum(p.nbytes for layer in self.layers for m in layer.matrices().values()
                   if isinstance(m, ExpertMatrices) for p in m.parts if p.route == "file-rows")

    @property
    def nbytes(self) -> int:
        """Bytes the weights hold in memory (mapped_bytes among them)."""
        lin = sum(m.nbytes for layer in self.layers for m in layer.matrices().values())
        if self.tok_embd is None:
            embd = 0
        elif isinstance(self.tok_embd, qmm.QuantMatrix):
            embd = self.tok_embd.raw.nbytes
        else:
            embd = self.tok_embd.nbytes
        return lin + self.head.nbytes + embd


def place(w: ModelWeights, device: torch.device) -> ModelWeights:
    """Move dense weights (the dequant path, built without our kernels) to `device`; on the
    CPU nothing moves. Packed matrices and the file's blocks are refused: they are our CPU
    kernels' layouts, which no other device reads."""
    if device.type == "cpu":
        return w

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    def linear(m: Linear) -> None:
        if isinstance(m, ConcatLinear):
            for part in m.parts:
                linear(part)
        elif isinstance(m, DenseLinear) and m.w is not None:
            m.w, m.bias = move(m.w), move(m.bias)
        else:
            raise ValueError(f"a {m.route} matrix cannot move to {device}: only dense weights "
                             "(--weights dequant, built without our kernels) run there")

    def piece(obj: object) -> None:
        """A layer piece's tensors (norm weights, a convolution's kernel), its matrices and its
        nested pieces (model/layers.py's dataclasses), moved."""
        for f in dataclasses.fields(obj):  # type: ignore[arg-type]
            v = getattr(obj, f.name)
            if isinstance(v, torch.Tensor):
                setattr(obj, f.name, move(v))
            elif isinstance(v, Linear):
                linear(v)
            elif dataclasses.is_dataclass(v):
                piece(v)

    for layer in w.layers:
        piece(layer)
    if isinstance(w.tok_embd, qmm.QuantMatrix):
        raise ValueError(f"a token embedding in the file's blocks cannot move to {device}")
    w.head.to(device)
    w.tok_embd, w.rope_freqs = move(w.tok_embd), move(w.rope_freqs)
    w.output_norm = move(w.output_norm)
    return w


def load_weights(reader: gguf.GGUFReader, hp: HParams, dtype: torch.dtype,
                 packed: bool = False, kern: Kernels | None = None,
                 load_mode: str = "auto") -> ModelWeights:
    """The GGUF's weights: the layer stack its family builds (model/arch/), the embedding, the
    final norm and the output head; `load_mode` (--load-mode): whether expert tensors are
    mapped (kernel_routes.maps_experts)."""
    fam = family_of(hp.arch)
    ld = TensorLoader(reader, dtype, packed, kern, load_mode)
    layers = fam.layers(ld, hp)
    out = ld.tensor("output.weight", required=False)
    tok_embd: torch.Tensor | qmm.QuantMatrix | None = None
    if out is None:
        log.info("output.weight absent: using tied token embeddings as the output head")
        head = OutputHead(ld.rows("token_embd.weight"), shortlist=packed, kern=kern,
                          logit_scale=hp.logit_scale)
    else:
        head = OutputHead(ld.rows("output.weight"), shortlist=packed, kern=kern,
                          logit_scale=hp.logit_scale)
        tok_embd = ld.rows("token_embd.weight", dtype=dtype)
    # the pages the head and embedding were read from: mapped expert tensors keep the mapping
    # (and so every page read through it) for the model's life
    ld.release()
    n_params = sum(int(np.prod(t.shape)) for t in reader.tensors)
    return ModelWeights(tok_embd, ld.norm(fam.output_norm), head, layers,
                        ld.norm("rope_freqs.weight", required=False), n_params, packed, dtype)
