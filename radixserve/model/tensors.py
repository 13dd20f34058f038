"""GGUF tensors -> what a family's layers hold: packed linears (our 4-bit or 8-bit tiles, the
file's own blocks, torch's int4 layout) or dense ones, norm vectors, and tables read by rows.

`packed=True` (the native path) keeps quantized matrices packed (model/quant.py): Q4_0 / Q4_1 /
Q4_K in our 4-bit tiles (AVX512-BF16) or torch's int4 layout (no kernels of ours), every other
common type, and the Q4 ones on other CPUs, in the file's own blocks (csrc/qmm.c); a type none of
those runs is dequantized once at load with `gguf.quants` into the compute dtype (the dequant
path does that for every type). Q/K/V and gate/up are fused into one [out, in] matrix each,
because on CPU one larger matmul beats several small ones. GGUF `llama` Q/K rows are stored
permuted for the interleaved rotation; a family that names a head count for a part has its
rows un-permuted (codes and scales alike), so every architecture uses the half-split (NeoX)
rotation, exactly as HF transformers does with a GGUF.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from radixserve.model import qmm
from radixserve.model.hparams import UnsupportedModelError
from radixserve.model.kernel_routes import (
    TILE_ROWS,
    build_for,
    maps_experts,
    route_for,
)
from radixserve.model.kernels import Kernels
from radixserve.model.quant import (
    I8_FORMATS,
    QMM_ROW_TYPES,
    Codes,
    ConcatLinear,
    DenseLinear,
    FileRowsLinear,
    I8Linear,
    Linear,
    MxLinear,
    QuantLinear,
    packed_linear,
    raw_rows,
    split_blocks,
)


def _row_order(rows: int, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's llama Q/K permutation (interleaved -> half-split)."""
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(rows)




def _order(rows: int, h: int | np.ndarray) -> np.ndarray:
    """The rows a part keeps, in order: un-permuted llama Q/K for a head count, else `h`
    itself (a reordering or a selection of the part's rows)."""
    return _row_order(rows, h) if isinstance(h, int) else h


def _dense(t: gguf.ReaderTensor) -> np.ndarray:
    arr = gguf.quants.dequantize(t.data, t.tensor_type)
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))
    return np.array(arr.reshape(shape), dtype=np.float32)  # a writable copy, not the mmap


class TensorLoader:
    """A GGUF's tensors as the engine holds them: dense arrays, tables read by rows, and linears
    (packed tiles, the file's blocks or dense), each shape checked where a family asks."""

    def __init__(self, reader: gguf.GGUFReader, dtype: torch.dtype, packed: bool,
                 kern: Kernels | None = None, load_mode: str = "auto") -> None:
        self.tensors = {t.name: t for t in reader.tensors}
        self.reader = reader
        self.dtype, self.packed = dtype, packed
        self.kern = kern  # our kernels (None: torch's ops), as load_model was given them
        self.build = build_for(kern, dtype)  # the route table's row for this load
        self.load_mode = load_mode  # expert tensors mapped or copied (maps_experts)

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

    def rows(self, name: str, dtype: torch.dtype | None = None, blocks: bool | None = None
             ) -> torch.Tensor | qmm.QuantMatrix:
        """A table read by rows (the token embedding, the output head): in the file's own
        blocks (csrc/qmm.c decodes the rows a step needs) when the weights are packed (or
        `blocks`) and our kernels run its type, else dense in `dtype` (default f32). The head's
        rows are f32 exactly either way; Gemma 3's tied Q8_0 table costs 178 MB held so, 671 MB
        as f32."""
        t = self.tensor(name)
        assert t is not None
        kern = self.kern
        qtype = t.tensor_type
        if ((self.packed if blocks is None else blocks) and kern is not None
                and qmm.available(kern.lib) and len(t.shape) == 2 and qtype in QMM_ROW_TYPES):
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
        return route_for(self.build, t.tensor_type, int(t.shape[1]), self.packed,
                         int(t.shape[0]))

    def _run_key(self, t: gguf.ReaderTensor) -> tuple[str, object]:
        """Parts with equal keys run as one matrix: 4-bit and dense parts of any type, the
        file's blocks of one type, 8-bit tiles of one tile format (Q5_0 beside Q8_0)."""
        route = self._route(t)
        if route == "i8-tiles":
            return route, I8_FORMATS[t.tensor_type]
        return route, t.tensor_type if route.startswith("qmm") else None

    def linear(self, names: list[str], heads: list[int | np.ndarray | None],
               biases: list[np.ndarray] | None = None) -> Linear:
        """One linear of the row-concatenated matrices `names` (rows un-permuted where `heads`
        gives a head count, taken in the order an array gives: a name may appear twice, each
        time for some of its rows; biases follow their rows): packed 4-bit tiles, 8-bit tiles,
        the file's own blocks, or dense; parts that cannot share one matrix (_run_key) become
        a ConcatLinear of runs that can."""
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
        # a bias is a vector over the matrix's rows: in the rows' order (un-permuted with them)
        bias = None if biases is None else torch.from_numpy(np.concatenate(
            [b if h is None else b[_order(len(b), h)] for b, h in zip(biases, heads)])
        ).to(self.dtype)
        route = kinds[0][0]
        qtype = ts[0].tensor_type
        if route in ("q4-tiles", "torch-int4"):
            parts = [split_blocks(t) for t in ts]
            parts = [c if h is None else c.rows(_order(c.q.shape[0], h))
                     for c, h in zip(parts, heads)]
            return packed_linear(Codes.concat(parts), bias, self.dtype, self.kern)
        if route in ("qmm-int", "qmm-f32", "i8-tiles", "mxfp4-tiles"):
            kern = self.kern
            assert kern is not None and qtype is not None
            raws = [raw_rows(t) for t in ts]
            raws = [r if h is None else r[_order(r.shape[0], h)] for r, h in zip(raws, heads)]
            k = int(ts[0].shape[0])
            if route == "mxfp4-tiles":
                return MxLinear(raws, k, bias, kern)
            if route == "i8-tiles":
                return I8Linear([(t.tensor_type, r) for t, r in zip(ts, raws)], k, bias, kern)
            return QuantLinear(qtype, np.concatenate(raws), k, bias, kern)
        arrays = []
        for t, h in zip(ts, heads):
            a = _dense(t)
            arrays.append(a if h is None else a[_order(a.shape[0], h)])
        w = torch.from_numpy(np.concatenate(arrays)).to(self.dtype).contiguous()
        return DenseLinear(w, bias, self.kern)

    def experts(self, names: list[str], n_expert: int, shape: tuple[int, int],
                biases: list[str] | None = None) -> list[Linear]:
        """Each expert's linear of the row-concatenated 3-D tensors `names` ([n_expert, rows,
        cols] each, `shape` = (rows, cols) per expert, checked): expert e's slice of every
        tensor, fused as `linear` fuses whole matrices; `biases`: a [n_expert, rows] tensor
        for each of `names` (already checked), expert e's row its bias."""
        for n in names:
            self.expect(n, (n_expert, *shape))
        bias = None if biases is None else [self.array(n) for n in biases]
        qtypes = {self.tensors[n].tensor_type for n in names}
        qtype = next(iter(qtypes))
        if (self.packed and len(qtypes) == 1 and maps_experts(self.load_mode, self.build, qtype)
                and shape[0] % TILE_ROWS == 0):
            assert self.kern is not None
            return [FileRowsLinear(
                qtype, [raw_rows(self.tensors[n])[e * shape[0]:(e + 1) * shape[0]] for n in names],
                shape[1], None if bias is None else torch.from_numpy(
                    np.concatenate([b[e] for b in bias])).to(self.dtype), self.kern)
                for e in range(n_expert)]
        out = []
        for e in range(n_expert):
            views = []
            for n in names:
                t = self.tensors[n]
                view = f"{n}[{e}]"
                per = t.n_bytes // n_expert
                self.tensors[view] = gguf.ReaderTensor(
                    name=view, tensor_type=t.tensor_type, shape=t.shape[:2].copy(),
                    n_elements=t.n_elements // n_expert, n_bytes=per,
                    data_offset=t.data_offset + e * per, data=t.data[e], field=t.field)
                views.append(view)
            try:
                out.append(self.linear(views, [None] * len(views),
                                       None if bias is None else [b[e] for b in bias]))
            finally:  # the views name no tensor of the file
                for v in views:
                    del self.tensors[v]
        return out

    def release(self) -> None:
        """The file's pages read so far dropped from memory (gguf_check.GGUFFile.release),
        where the reader maps the file."""
        release = getattr(self.reader, "release", None)
        if release is not None:
            release()

    def norm(self, name: str, required: bool = True) -> torch.Tensor | None:
        """A norm's weight vector, f32 (norms are computed in f32 whatever the compute dtype)."""
        return self.torch(name, required, f32=True)
