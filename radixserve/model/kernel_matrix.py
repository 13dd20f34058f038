"""The matrices held in our kernels' own layouts (csrc/i8act.c's tiles, csrc/bf16_gemm.c's
panels): each owns its bytes, checked once where Kernels.tiles or Kernels.bf16 binds it, so a
product checks only its input. Apart from kernels.py (the entry points) because these are
weights the model holds, as qmm.py's QuantMatrix is."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from radixserve.model.kernels import Kernels

# csrc/i8act.c's tile formats (its F_Q4, F_I8*, F_MX) -> bytes per (tile, group)
TILE_BLOCK_BYTES = {0: 320, 1: 576, 2: 640, 3: 640, 4: 320}


class _KernelMatrix:
    """What the matrices held in a kernel's own layout share: W [n, k] at `_ptr`, and products
    with bf16 rows through `_mm(ptr, x, rows, n, k, y)`, which returns 0, 2 (out of memory for
    `_oom`) or another code (a shape it refuses). One check of the input, one output buffer and
    one reading of the return code for every layout, so they cannot drift apart."""

    n: int
    k: int
    _ptr: int
    _mm: Any
    _name: str  # for the errors: "tile", "bf16"
    _oom: str  # what the kernel allocates per call

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, k] bf16 (contiguous) times W^T -> [rows, n] bf16."""
        if not (x.dtype == torch.bfloat16 and x.is_contiguous() and x.dim() == 2
                and x.shape[1] == self.k):
            raise ValueError(f"{self._name} matmul needs contiguous bf16 rows of {self.k}")
        y = torch.empty(x.shape[0], self.n, dtype=torch.bfloat16)
        rc = self._mm(self._ptr, x.data_ptr(), x.shape[0], self.n, self.k, y.data_ptr())
        if rc == 2:
            raise MemoryError(f"{self._name} matmul: no memory for {self._oom}")
        if rc != 0:
            raise ValueError(f"{self._name} matmul kernel refused the shape")
        return y


class TileMatrix(_KernelMatrix):
    """A matrix in csrc/i8act.c's 16-row tiles, 4-bit (format 0) or 8-bit: products with bf16
    rows through 8-bit activations."""

    _name, _oom = "tile", "the activation codes"

    def __init__(self, kern: Kernels, tiles: torch.Tensor, n: int, k: int, fmt: int) -> None:
        self.tiles, self.n, self.k, self.fmt = tiles, n, k, fmt
        self._ptr, self._mm = tiles.data_ptr(), functools.partial(kern._tiles, fmt)


# csrc/i8act.c's file formats (its F_FQ8: Q8_0 rows, F_FMX: MXFP4, F_FQ4K: Q4_K, F_FQ6K: Q6_K)
# -> (weights, bytes) a block (a K-quant's: a super-block of 8 groups)
FILE_BLOCKS = {5: (32, 34), 6: (32, 17), 7: (256, 144), 8: (256, 210)}


class FileRowsMatrix(_KernelMatrix):
    """A matrix whose rows are a GGUF file's own Q8_0, MXFP4, Q4_K or Q6_K blocks where they
    lie (views of the mapped file: nothing copied), one or two row blocks (a fused gate and up,
    two tensors of the file): products as the tiles compute them, bit for bit."""

    _name, _oom = "tile", "the activation codes"

    def __init__(self, kern: Kernels, parts: list[np.ndarray], fmt: int, k: int) -> None:
        self.parts, self.fmt, self.k = parts, fmt, k  # the views keep the mapping alive
        self.n = sum(p.shape[0] for p in parts)
        n0, rb = parts[0].shape
        second = parts[1].ctypes.data if len(parts) > 1 else None
        self._ptr = parts[0].ctypes.data
        self._mm = functools.partial(kern._file_rows, fmt, n0, rb, second)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


BF16_PANEL = 32  # output rows per panel of bf16_gemm.c's layout


class Bf16Matrix(_KernelMatrix):
    """A bf16 matrix in bf16_gemm.c's panels: products with bf16 rows, each row's bits the same
    whatever the rows and threads sharing the call."""

    _name, _oom = "bf16", "padded rows"

    def __init__(self, kern: Kernels, panels: torch.Tensor, n: int, k: int) -> None:
        self.panels, self.n, self.k = panels, n, k
        self._ptr, self._mm = panels.data_ptr(), kern._bf16_mm

    def weight(self) -> torch.Tensor:
        """W [n, k] bf16, unpacked (a copy)."""
        p, half = self.panels.shape[:2]
        w = self.panels.permute(0, 2, 1, 3).reshape(p * BF16_PANEL, 2 * half)
        return w[: self.n, : self.k].contiguous()
