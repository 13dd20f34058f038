"""GGUF tensors -> the engine's weights: packed 4-bit linears or dense ones, and the output head.

`packed=True` (the native path) keeps quantized matrices packed (model/quant.py): Q4_0 / Q4_1 /
Q4_K in our 4-bit tiles (AVX512-BF16) or torch's int4 layout (no kernels of ours), every other
common type, and the Q4 ones on other CPUs, in the file's own blocks (csrc/qmm.c); a type none of
those runs is dequantized once at load with `gguf.quants` into the compute dtype (the dequant
path does that for every type). Q/K/V and
gate/up are fused into one [out, in] matrix each, because on CPU one larger matmul beats several
small ones. GGUF `llama` Q/K rows are stored permuted for
the interleaved rotation; we undo the permutation (rows of codes and scales alike) so every
architecture uses the half-split (NeoX) rotation, exactly as HF transformers does with a GGUF.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from radixserve.model import qmm
from radixserve.model.head import OutputHead
from radixserve.model.hparams import HParams, UnsupportedModelError
from radixserve.model.kernels import Kernels
from radixserve.model.quant import (
    I8_FORMATS,
    QMM_ROW_TYPES,
    Codes,
    ConcatLinear,
    DenseLinear,
    I8Linear,
    Linear,
    QuantLinear,
    packed_linear,
    raw_rows,
    split_blocks,
)
from radixserve.model.kernel_routes import build_for, route_for

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor
    wqkv: Linear  # [(n_head + 2 n_head_kv) * head_dim, n_embd], q/k/v biases included (qwen2)
    q_norm: torch.Tensor | None  # qwen3 / gemma3 per-head RMS norm
    k_norm: torch.Tensor | None
    wo: Linear
    ffn_norm: torch.Tensor
    w_gate_up: Linear  # [2 * n_ff, n_embd]
    w_down: Linear
    # gemma3: RMS norms of the attention and FFN outputs before their residual adds
    post_attn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None
    # LFM2's short-convolution layers: the depthwise kernel [n_embd, l_cache] (f32); their
    # wqkv is the in-projection to [B | C | x] and wo the out-projection
    conv: torch.Tensor | None = None


@dataclass(slots=True)
class ModelWeights:
    # [n_vocab, n_embd] in the compute dtype; None when the embedding is the head's own rows
    # (tied: the head's f32 matrix or the file's blocks)
    tok_embd: torch.Tensor | qmm.QuantMatrix | None
    output_norm: torch.Tensor
    head: OutputHead
    layers: list[LayerWeights]
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
        for lw in self.layers:
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                r = getattr(lw, name).route
                out.setdefault(name, {})
                out[name][r] = out[name].get(r, 0) + 1
        return out

    def route_bytes(self) -> dict[str, int]:
        """Bytes each layer matrix holds in memory over all layers, {matrix: bytes}."""
        return {name: sum(getattr(lw, name).nbytes for lw in self.layers)
                for name in ("wqkv", "wo", "w_gate_up", "w_down")}

    @property
    def nbytes(self) -> int:
        """Bytes the weights hold in memory."""
        lin = sum(
            m.nbytes for lw in self.layers for m in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)
        )
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

    for lw in w.layers:
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            linear(getattr(lw, name))
        for name in ("attn_norm", "q_norm", "k_norm", "ffn_norm", "post_attn_norm",
                     "post_ffn_norm", "conv"):
            setattr(lw, name, move(getattr(lw, name)))
    if isinstance(w.tok_embd, qmm.QuantMatrix):
        raise ValueError(f"a token embedding in the file's blocks cannot move to {device}")
    w.head.to(device)
    w.tok_embd, w.rope_freqs = move(w.tok_embd), move(w.rope_freqs)
    w.output_norm = move(w.output_norm)
    return w


def _row_order(rows: int, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's llama Q/K permutation (interleaved -> half-split)."""
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(rows)


def _dense(t: gguf.ReaderTensor) -> np.ndarray:
    arr = gguf.quants.dequantize(t.data, t.tensor_type)
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))
    return np.array(arr.reshape(shape), dtype=np.float32)  # a writable copy, not the mmap


class _Loader:
    def __init__(self, reader: gguf.GGUFReader, dtype: torch.dtype, packed: bool,
                 kern: Kernels | None = None) -> None:
        self.tensors = {t.name: t for t in reader.tensors}
        self.dtype, self.packed = dtype, packed
        self.kern = kern  # our kernels (None: torch's ops), as load_model was given them
        self.build = build_for(kern, dtype)  # the route table's row for this load

    def tensor(self, name: str, required: bool = True) -> gguf.ReaderTensor | None:
        t = self.tensors.get(name)
        if t is None and required:
            raise UnsupportedModelError(f"GGUF is missing tensor {name!r}")
        return t

    def expect(self, name: str, shape: tuple[int, ...]) -> None:
        """UnsupportedModelError naming the tensor when its shape is not what the metadata
        says (numpy order: rows first)."""
        t = self.tensor(name)
        assert t is not None
        got = tuple(int(x) for x in reversed(t.shape.tolist()))
        if got != shape:
            raise UnsupportedModelError(f"tensor {name!r} has shape {list(got)}; the GGUF's "
                                        f"metadata says {list(shape)}")

    def array(self, name: str, required: bool = True) -> np.ndarray | None:
        t = self.tensor(name, required)
        return None if t is None else _dense(t)

    def torch(self, name: str, required: bool = True, f32: bool = False) -> torch.Tensor | None:
        a = self.array(name, required)
        if a is None:
            return None
        return torch.from_numpy(a).to(torch.float32 if f32 else self.dtype).contiguous()

    def rows(self, name: str, dtype: torch.dtype | None = None
             ) -> torch.Tensor | qmm.QuantMatrix:
        """A table read by rows (the token embedding, the output head): in the file's own
        blocks (csrc/qmm.c decodes the rows a step needs) when the weights are packed and our
        kernels run its type, else dense in `dtype` (default f32). The head's rows are f32
        exactly either way; Gemma 3's tied Q8_0 table costs 178 MB held so, 671 MB as f32."""
        t = self.tensor(name)
        assert t is not None
        kern = self.kern
        qtype = t.tensor_type
        if (self.packed and kern is not None and qmm.available(kern.lib) and len(t.shape) == 2
                and qtype in QMM_ROW_TYPES):
            k = int(t.shape[0])
            try:
                qmm.row_bytes(kern.lib, int(qtype), k)
            except ValueError:  # rows not whole blocks: dense below
                pass
            else:
                raw = torch.from_numpy(np.array(raw_rows(t)))
                return qmm.QuantMatrix(kern.lib, int(qtype), raw, k)
        out = self.torch(name, f32=dtype is None)
        assert out is not None
        return out if dtype is None else out.to(dtype)

    def _route(self, t: gguf.ReaderTensor) -> str:
        """The matrix's route (model/kernel_routes.py's table)."""
        return route_for(self.build, t.tensor_type, int(t.shape[1]), self.packed)

    def _run_key(self, t: gguf.ReaderTensor) -> tuple[str, object]:
        """Parts with equal keys run as one matrix: 4-bit and dense parts of any type, the
        file's blocks of one type, 8-bit tiles of one tile format (Q5_0 beside Q8_0)."""
        route = self._route(t)
        if route == "i8-tiles":
            return route, I8_FORMATS[t.tensor_type]
        return route, t.tensor_type if route.startswith("qmm") else None

    def linear(self, names: list[str], heads: list[int | None],
               biases: list[np.ndarray] | None = None) -> Linear:
        """One linear of the row-concatenated matrices `names` (rows un-permuted where `heads`
        gives a head count): packed 4-bit tiles, 8-bit tiles, the file's own blocks, or dense;
        parts that cannot share one matrix (_run_key) become a ConcatLinear of runs that can."""
        ts = [self.tensor(n) for n in names]
        kinds = [self._run_key(t) for t in ts]
        if len(set(kinds)) > 1:  # e.g. Q4_K_M: attn_v in Q6_K next to Q4_K q/k
            runs: list[list[int]] = []
            for i, kd in enumerate(kinds):
                if runs and kinds[runs[-1][-1]] == kd:
                    runs[-1].append(i)
                else:
                    runs.append([i])
            return ConcatLinear([
                self.linear([names[i] for i in run], [heads[i] for i in run],
                            None if biases is None else [biases[i] for i in run])
                for run in runs
            ])
        bias = None if biases is None else torch.from_numpy(np.concatenate(biases)).to(self.dtype)
        route = kinds[0][0]
        qtype = ts[0].tensor_type
        if route in ("q4-tiles", "torch-int4"):
            parts = [split_blocks(t) for t in ts]
            parts = [c if h is None else c.rows(_row_order(c.q.shape[0], h))
                     for c, h in zip(parts, heads)]
            return packed_linear(Codes.concat(parts), bias, self.dtype, self.kern)
        if route in ("qmm-int", "qmm-f32", "i8-tiles"):
            kern = self.kern
            assert kern is not None and qtype is not None
            raws = [raw_rows(t) for t in ts]
            raws = [r if h is None else r[_row_order(r.shape[0], h)] for r, h in zip(raws, heads)]
            k = int(ts[0].shape[0])
            if route == "i8-tiles":
                return I8Linear([(t.tensor_type, r) for t, r in zip(ts, raws)], k, bias, kern)
            return QuantLinear(qtype, np.concatenate(raws), k, bias, kern)
        arrays = []
        for t, h in zip(ts, heads):
            a = _dense(t)
            arrays.append(a if h is None else a[_row_order(a.shape[0], h)])
        w = torch.from_numpy(np.concatenate(arrays)).to(self.dtype).contiguous()
        return DenseLinear(w, bias, self.kern)


def load_weights(reader: gguf.GGUFReader, hp: HParams, dtype: torch.dtype,
                 packed: bool = False, kern: Kernels | None = None) -> ModelWeights:
    ld = _Loader(reader, dtype, packed, kern)
    perm_q, perm_k = (hp.n_head, hp.n_head_kv) if hp.arch == "llama" else (None, None)
    qk_norm = hp.arch in ("qwen3", "gemma3", "lfm2")
    post_norms = hp.arch == "gemma3"
    layers = []
    for i in range(hp.n_layer):
        p = f"blk.{i}."
        if hp.conv_layers[i]:
            layers.append(_conv_layer(ld, hp, p))
            continue
        biases = [ld.array(p + f"attn_{n}.bias", required=False) for n in "qkv"]
        if any(b is not None for b in biases) and any(b is None for b in biases):
            raise UnsupportedModelError(f"layer {i}: only some of the q/k/v biases are present")
        # llama.cpp's converter already adds gemma's +1 to its norm weights: plain RMSNorms
        layers.append(LayerWeights(
            attn_norm=ld.torch(p + "attn_norm.weight", f32=True),
            wqkv=ld.linear([p + f"attn_{n}.weight" for n in "qkv"], [perm_q, perm_k, None],
                           None if biases[0] is None else biases),
            q_norm=ld.torch(p + "attn_q_norm.weight", qk_norm, f32=True),
            k_norm=ld.torch(p + "attn_k_norm.weight", qk_norm, f32=True),
            wo=ld.linear([p + "attn_output.weight"], [None]),
            ffn_norm=ld.torch(p + "ffn_norm.weight", f32=True),
            w_gate_up=ld.linear([p + "ffn_gate.weight", p + "ffn_up.weight"], [None, None]),
            w_down=ld.linear([p + "ffn_down.weight"], [None]),
            post_attn_norm=ld.torch(p + "post_attention_norm.weight", post_norms, f32=True)
            if post_norms else None,
            post_ffn_norm=ld.torch(p + "post_ffw_norm.weight", post_norms, f32=True)
            if post_norms else None,
        ))
    out = ld.tensor("output.weight", required=False)
    # LFM2's final norm is stored as token_embd_norm (llama.cpp's LLM_TENSOR_OUTPUT_NORM_LFM2)
    out_norm = "token_embd_norm.weight" if hp.arch == "lfm2" else "output_norm.weight"
    tok_embd: torch.Tensor | qmm.QuantMatrix | None = None
    if out is None:
        log.info("output.weight absent: using tied token embeddings as the output head")
        head = OutputHead(ld.rows("token_embd.weight"), shortlist=packed, kern=kern)
    else:
        head = OutputHead(ld.rows("output.weight"), shortlist=packed, kern=kern)
        tok_embd = ld.rows("token_embd.weight", dtype=dtype)
    n_params = sum(int(np.prod(t.shape)) for t in reader.tensors)
    return ModelWeights(tok_embd, ld.torch(out_norm, f32=True), head, layers,
                        ld.torch("rope_freqs.weight", required=False, f32=True), n_params, packed,
                        dtype)


def _conv_layer(ld: _Loader, hp: HParams, p: str) -> LayerWeights:
    """An LFM2 short-convolution layer (llama.cpp's tensor names), its shapes checked against
    the metadata: the norms and FFN of any layer, the in-projection to [B | C | x] (3 n_embd
    rows, in that order), the depthwise kernel and the out-projection."""
    e = hp.n_embd
    ld.expect(p + "shortconv.in_proj.weight", (3 * e, e))
    ld.expect(p + "shortconv.conv.weight", (e, hp.l_cache))
    ld.expect(p + "shortconv.out_proj.weight", (e, e))
    conv = ld.torch(p + "shortconv.conv.weight", f32=True)
    return LayerWeights(
        attn_norm=ld.torch(p + "attn_norm.weight", f32=True),
        wqkv=ld.linear([p + "shortconv.in_proj.weight"], [None]),
        q_norm=None, k_norm=None,
        wo=ld.linear([p + "shortconv.out_proj.weight"], [None]),
        ffn_norm=ld.torch(p + "ffn_norm.weight", f32=True),
        w_gate_up=ld.linear([p + "ffn_gate.weight", p + "ffn_up.weight"], [None, None]),
        w_down=ld.linear([p + "ffn_down.weight"], [None]),
        conv=conv,
    )
