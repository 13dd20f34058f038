"""Products with weights held in a GGUF type's own blocks (csrc/qmm.c), through ctypes.

Apart from kernels.py because the matrix owns its bytes and its shape checks: each product
checks only its input, and the block geometry (weights and bytes per block) comes from the C
side, so Python and C cannot disagree about a row's length.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from radixserve.model.cabi import bind


def codes(lib: ctypes.CDLL, qtype: int, raw: np.ndarray, k: int
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows raw (uint8 [n, row bytes]) of a Q5_0 / Q5_1 / Q8_0 / Q5_K / Q6_K matrix as int8
    codes c [n, k], f32 scales d [n, k / 16] (one a half group) and offsets m [n, k / 32],
    w = d c + m as gguf-py computes it (qmm.c's qmm_codes); ValueError for another type."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    n = raw.shape[0]
    if raw.ndim != 2 or raw.shape[1] != row_bytes(lib, qtype, k):
        raise ValueError(f"codes need rows of {k} weights in type {qtype}")
    c = np.empty((n, k), np.int8)
    d = np.empty((n, k // 16), np.float32)
    m = np.empty((n, k // 32), np.float32)
    if bind(lib).qmm_codes(qtype, raw.ctypes.data, raw.shape[1], n, k, c.ctypes.data,
                           d.ctypes.data, m.ctypes.data) != 0:
        raise ValueError(f"type {qtype} has no int8 codes form")
    return c, d, m


def available(lib: ctypes.CDLL) -> bool:
    return hasattr(lib, "qmm_bf16")


def row_bytes(lib: ctypes.CDLL, qtype: int, k: int) -> int:
    """Bytes of a row of k weights in type qtype; ValueError for a type or length it cannot
    run."""
    size = ctypes.c_int64(0)
    per = bind(lib).qmm_block(qtype, ctypes.byref(size))
    if per == 0 or k <= 0 or k % per:
        raise ValueError(f"qmm cannot run type {qtype} with rows of {k} weights")
    return k // per * size.value


class QuantMatrix:
    """W [n, k] in type qtype's blocks, rows as in the file (raw: uint8 [n, row bytes])."""

    def __init__(self, lib: ctypes.CDLL, qtype: int, raw: torch.Tensor, k: int) -> None:
        rb = row_bytes(lib, qtype, k)
        if not (raw.dtype == torch.uint8 and raw.is_contiguous() and raw.dim() == 2
                and raw.shape[1] == rb):
            raise ValueError(f"qmm needs contiguous uint8 rows of {rb} bytes, got "
                             f"{raw.dtype} {list(raw.shape)}")
        self.raw, self.qtype, self.n, self.k, self.row_bytes = raw, qtype, raw.shape[0], k, rb
        c = bind(lib)
        self._mm, self._rows, self._dots = c.qmm_bf16, c.qmm_rows_f32, c.qmm_head_dots

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, k] bf16 (contiguous) times W^T -> [rows, n] bf16."""
        if not (x.dtype == torch.bfloat16 and x.is_contiguous() and x.dim() == 2
                and x.shape[1] == self.k):
            raise ValueError(f"qmm needs contiguous bf16 rows of {self.k}")
        y = torch.empty(x.shape[0], self.n, dtype=torch.bfloat16)
        rc = self._mm(self.qtype, self.raw.data_ptr(), self.row_bytes, x.data_ptr(), x.shape[0],
                      self.n, self.k, y.data_ptr())
        if rc == 2:
            raise MemoryError("qmm: no memory for the f32 rows")
        if rc != 0:
            raise ValueError("qmm refused the shape")
        return y

    def head_dots(self, h: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Exact f32 logits [n, m] = W[ids] . h row by row (every row when ids is None) for f32
        h [n, k]: kernels.py's head_dots over rows(ids), bit for bit, each row decoded once
        into a thread's buffer instead of into an f32 matrix."""
        if not (h.dtype == torch.float32 and h.is_contiguous() and h.dim() == 2
                and h.shape[1] == self.k):
            raise ValueError(f"head_dots needs contiguous f32 rows of {self.k}")
        m, ptr = self.n, None
        if ids is not None:
            ids = ids.to(torch.int64).contiguous()
            m, ptr = ids.numel(), ids.data_ptr()
        out = torch.empty(h.shape[0], m)
        if m and h.shape[0]:
            rc = self._dots(self.qtype, self.raw.data_ptr(), self.row_bytes, self.n, self.k, ptr,
                            m, h.data_ptr(), h.shape[0], out.data_ptr())
            if rc == 3:
                raise IndexError("qmm head_dots: id outside the matrix")
            if rc == 2:
                raise MemoryError("qmm head_dots: no memory for a row buffer")
            if rc != 0:
                raise ValueError("qmm head_dots refused the shape")
        return out

    def rows(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `ids` of W (every row when None) as f32 [m, k]: the values the matmul uses."""
        if ids is None:
            ids = torch.arange(self.n)
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), self.k)
        rc = self._rows(self.qtype, self.raw.data_ptr(), self.row_bytes, self.n, self.k,
                        ids.data_ptr(), ids.numel(), out.data_ptr())
        if rc == 3:
            raise IndexError("qmm rows: id outside the matrix")
        if rc != 0:
            raise ValueError("qmm rows refused the shape")
        return out
