"""Kernels of our own (model/csrc/*.c), compiled on first use with the system C compiler.

Why compiled here rather than shipped: the sources are plain C with no torch headers, so a build
takes ~1 s, and `-march=native` gives them the vector width of the CPU at hand. The shared
object is cached under the user's cache directory, keyed by the source, the compiler, the flags
and the CPU's feature flags, and written atomically (a crash mid-build leaves no half file).
Without a compiler, or with RADIXSERVE_KERNELS=0, callers keep their torch path.

Calls go through ctypes with raw pointers into torch tensors; the caller guarantees dtype,
layout and bounds (checked here once per call, cheaply), and the kernel's OpenMP calls resolve to
the libgomp torch has loaded, so both share one thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
          "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros"]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "radixserve" / "kernels"


def _cpu_signature() -> str:
    """The CPU's model and feature flags: a cached -march=native build must match them."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="ignore")
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(keep))  # one copy per distinct line, not one per core


def build() -> Path | None:
    """Compile every csrc/*.c into one shared object (or reuse the cached build); None when it
    cannot be built."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: kernels disabled, torch ops used instead")
        return None
    sources = sorted(_CSRC.glob("*.c"))
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, check=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("C compiler %s unusable (%s): kernels disabled", cc, e)
        return None
    parts = [p.read_bytes() for p in sorted(_CSRC.iterdir())]
    key = hashlib.sha256(b"\0".join([*parts, version, " ".join(_FLAGS).encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    out = cache_dir() / f"radixserve-kernels-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *_FLAGS, *map(str, sources), "-o", tmp, "-lm"],
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            log.warning("building the kernels failed, torch ops used instead:\n%s",
                        r.stderr[-2000:])
            return None
        os.replace(tmp, out)
        return out
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("building the kernels failed (%s), torch ops used instead", e)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cells_arg(cells: slice | torch.Tensor, n_cells: int) -> tuple[int | None, int, int]:
    """A sequence's cells as the kernels take them: (index pointer or None, first cell, count)."""
    if isinstance(cells, slice):
        c0 = cells.start or 0
        n = (n_cells if cells.stop is None else cells.stop) - c0
        if c0 < 0 or n <= 0 or c0 + n > n_cells:
            raise IndexError(f"cells {cells} outside a pool of {n_cells}")
        return None, c0, n
    if cells.dtype != torch.int64 or not cells.is_contiguous() or cells.numel() == 0:
        raise ValueError("cell index must be a non-empty contiguous int64 tensor")
    return cells.data_ptr(), 0, cells.numel()


class Kernels:
    """The bf16 kernels (csrc/): the 4-bit matmul and its unpack, decode attention reading K/V in
    place from the pool (alone, or fused with RoPE and the K/V store for a whole decode step),
    the residual add fused with RMSNorm-to-bf16, the SiLU gate and the head's int8 pass.
    Pointers go to C unchecked, so every entry point checks dtype and layout first (cheaply, or
    once per step)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        self._attn = lib.decode_attn_bf16
        self._attn.restype = i32
        self._attn.argtypes = [p, p, p, i64, p, i64, i64, i32, i32, i32, f32, p, p]
        self._step_attn = lib.decode_step_attn_bf16
        self._step_attn.restype = i32
        self._step_attn.argtypes = [p, p, p, p, p, i64, p, p, p, p, i32, i32, i32, i32, f32, p, p]
        self._work_floats = lib.decode_attn_work_floats
        self._work_floats.restype = i64
        self._work_floats.argtypes = [i64, i32, i32, i32]
        self._norm = lib.add_rms_norm_bf16
        self._norm.restype = None
        self._norm.argtypes = [p, i64, p, p, i64, i32, f32, p]
        self._silu = lib.silu_mul_bf16
        self._silu.restype = None
        self._silu.argtypes = [p, i64, i64, p]
        self._int8_head = lib.int8_head
        self._int8_head.restype = i32
        self._int8_head.argtypes = [p, p, p, p, p, i64, i64, i32, p]
        self.has_int8_head = bool(lib.int8_head_available())  # needs AVX512-VNNI
        self._q4 = lib.q4_matmul_bf16
        self._q4.restype = i32
        self._q4.argtypes = [p, p, i64, i64, i64, p]
        self._q4_dequant = lib.q4_dequant_t_bf16
        self._q4_dequant.restype = i32
        self._q4_dequant.argtypes = [p, i64, i64, p]
        self.has_q4 = bool(lib.q4_available())  # needs AVX512-BF16
        self._work = torch.empty(0)
        self._need: dict[tuple[int, ...], int] = {}

    def _pool_args(self, k: torch.Tensor, v: torch.Tensor, n_head: int) -> tuple[int, ...]:
        """(n_kv, n_cells, d, g) of pool K/V [..., n_kv, n_cells, d]; sizes the scratch."""
        n_kv, n_cells, d = k.shape[-3:]
        if not (k.dtype == v.dtype == torch.bfloat16 and k.stride() == v.stride()
                and k.is_contiguous() and n_head % n_kv == 0):
            raise ValueError("decode attention needs bf16 K/V in the pool's layout")
        g = n_head // n_kv
        shape = (n_cells, n_kv, g, d, torch.get_num_threads())
        need = self._need.get(shape)
        if need is None:  # scratch sized for the longest sequence the pool can hold
            need = self._need[shape] = self._work_floats(n_cells, n_kv, g, d)
        if self._work.numel() < need:
            self._work = torch.empty(need, dtype=torch.float32)
        return n_kv, n_cells, d, g

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cells: slice | torch.Tensor) -> torch.Tensor:
        """q [1, n_head, d]; k, v one layer of the pool [n_head_kv, n_cells, d]; cells the
        sequence's cells in position order (a run or an int64 index) -> [1, n_head * d]."""
        if q.dtype != torch.bfloat16 or not q.is_contiguous():
            raise ValueError("decode attention needs a contiguous bf16 query")
        n_kv, n_cells, d, g = self._pool_args(k, v, q.shape[1])
        idx, c0, n = _cells_arg(cells, n_cells)
        out = torch.empty(1, q.shape[1] * d, dtype=torch.bfloat16)
        rc = self._attn(q.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), idx, c0, n, n_kv,
                        g, d, d**-0.5, out.data_ptr(), self._work.data_ptr())
        if rc != 0:
            raise ValueError(f"decode attention kernel refused g={g} d={d} n={n}")
        return out

    def decode_step(self, k: torch.Tensor, v: torch.Tensor, n_head: int,
                    cells: list[slice | torch.Tensor], dst: list[int], cos: torch.Tensor,
                    sin: torch.Tensor, x: torch.Tensor, eps: float, n_ff: int) -> DecodeStep:
        """A step of single decode tokens, one per sequence: k, v the whole pool [n_layer,
        n_head_kv, n_cells, d]; per sequence its cells (including the new one) and its new
        cell `dst`; cos/sin the tokens' Rope.cos_sin tables [n, 1, d]; x the f32 residual
        rows [n, n_embd]."""
        n_kv, n_cells, d, g = self._pool_args(k, v, n_head)
        if not (cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous()
                and sin.is_contiguous() and cos.numel() == sin.numel() == len(dst) * d
                and len(cells) == len(dst) and all(0 <= c < n_cells for c in dst)
                and x.dtype == torch.float32 and x.is_contiguous() and x.shape[0] == len(dst)):
            raise ValueError("decode_step: bad rope tables, cells or residual rows")
        args = [_cells_arg(c, n_cells) for c in cells]
        return DecodeStep(self, k, v, (n_kv, g, d, n_head), args, dst, cos, sin, cells, x, eps,
                          n_ff)

    def add_rms_norm(self, x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """x += y (in place, f32 rows [T, d]; skipped when y is None), then bf16(rms_norm(x) *
        w): the residual add and the next layer's norm in one pass."""
        rows, d = x.shape
        if not (x.dtype == w.dtype == torch.float32 and x.stride(1) == 1
                and w.is_contiguous() and w.numel() == d
                and (y is None or (y.dtype == torch.bfloat16 and y.is_contiguous()
                                   and y.shape == x.shape))):
            raise ValueError("add_rms_norm needs f32 rows, an f32 weight and bf16 addends")
        out = torch.empty(rows, d, dtype=torch.bfloat16)
        self._norm(x.data_ptr(), x.stride(0), None if y is None else y.data_ptr(), w.data_ptr(),
                   rows, d, eps, out.data_ptr())
        return out

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for bf16 rows gu [T, 2 ff] = [gate | up] -> [T, ff]."""
        rows, ff2 = gu.shape
        if not (gu.dtype == torch.bfloat16 and gu.is_contiguous() and ff2 % 2 == 0):
            raise ValueError("silu_mul kernel needs contiguous bf16 [gate | up] rows")
        out = torch.empty(rows, ff2 // 2, dtype=torch.bfloat16)
        self._silu(gu.data_ptr(), rows, ff2 // 2, out.data_ptr())
        return out

    def int8_head(self, q8: torch.Tensor, rowsum: torch.Tensor, scale: torch.Tensor,
                  a: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """y [n, V] f32 = scale * sum over the two parts p of s_p * (a_p - 128) . q8 for int8
        rows q8 [V, D] (rowsum their int32 row sums, scale f32 [V]) and hidden states split
        into int8 parts a [2n, D] uint8 (+128) with scales s [2n] (head.py's split_int8)."""
        rows, d = q8.shape
        n = a.shape[0] // 2
        if not (self.has_int8_head and q8.dtype == torch.int8 and rowsum.dtype == torch.int32
                and scale.dtype == s.dtype == torch.float32 and a.dtype == torch.uint8
                and all(t.is_contiguous() for t in (q8, rowsum, scale, a, s))
                and rowsum.numel() == scale.numel() == rows and a.shape == (2 * n, d)
                and s.numel() == 2 * n and d % 64 == 0):
            raise ValueError("int8_head needs int8 rows, int32 sums, f32 scales, uint8 parts")
        y = torch.empty(n, rows)
        rc = self._int8_head(q8.data_ptr(), rowsum.data_ptr(), scale.data_ptr(), a.data_ptr(),
                             s.data_ptr(), rows, d, n, y.data_ptr())
        if rc != 0:
            raise ValueError("int8_head kernel refused the shape")
        return y

    def q4(self, tiles: torch.Tensor, n: int, k: int) -> Q4Matrix:
        """The 4-bit matrix W [n, k] held in q4_gemv.c's tiles (uint8 [n / 16, k / 32, 320],
        quant.py's pack_q4), checked once here so each product only checks its input."""
        if not (self.has_q4 and tiles.dtype == torch.uint8 and tiles.is_contiguous()
                and n % 16 == 0 and k % 32 == 0 and tiles.shape == (n // 16, k // 32, 320)):
            raise ValueError("q4 kernels need uint8 tiles [n / 16, k / 32, 320]")
        return Q4Matrix(self, tiles, n, k)


class Q4Matrix:
    """A 4-bit matrix in q4_gemv.c's tiles: products with bf16 rows, and its bf16 unpack."""

    def __init__(self, kern: Kernels, tiles: torch.Tensor, n: int, k: int) -> None:
        self.tiles, self.n, self.k = tiles, n, k
        self._ptr, self._mm, self._unpack = tiles.data_ptr(), kern._q4, kern._q4_dequant

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, k] bf16 (contiguous) times W^T -> [rows, n] bf16."""
        if not (x.dtype == torch.bfloat16 and x.is_contiguous() and x.dim() == 2
                and x.shape[1] == self.k):
            raise ValueError(f"q4 matmul needs contiguous bf16 rows of {self.k}")
        y = torch.empty(x.shape[0], self.n, dtype=torch.bfloat16)
        rc = self._mm(self._ptr, x.data_ptr(), x.shape[0], self.n, self.k, y.data_ptr())
        if rc == 2:
            raise MemoryError("q4 matmul: no memory for the group sums")
        if rc != 0:
            raise ValueError("q4 matmul kernel refused the shape")
        return y

    def weight(self) -> torch.Tensor:
        """bf16 W [n, k]: a transposed view of a [k, n] buffer, the layout the unpack writes
        fastest."""
        wt = torch.empty(self.k, self.n, dtype=torch.bfloat16)
        if self._unpack(self._ptr, self.n, self.k, wt.data_ptr()) != 0:
            raise ValueError("q4 unpack kernel refused the shape")
        return wt.t()


class DecodeStep:
    """One decode step's glue, layer by layer: everything that is the same in every layer
    (cells, new cells, rope rows, the residual rows, output buffers, pointers) is checked and
    marshalled once, so a layer costs four C calls: attention (RoPE, the K/V store and
    attention for every sequence), two add + norms and the SiLU gate. The norm and gate outputs
    are buffers reused every layer: each is consumed by the next matmul before it is rewritten."""

    def __init__(self, kern: Kernels, k: torch.Tensor, v: torch.Tensor,
                 shape: tuple[int, int, int, int], cells: list[tuple[int | None, int, int]],
                 dst: list[int], cos: torch.Tensor, sin: torch.Tensor, keep: object,
                 x: torch.Tensor, eps: float, n_ff: int) -> None:
        n_seq = len(dst)
        arr = ctypes.c_int64 * n_seq
        self.n_layer = k.shape[0]
        self._call, self._norm, self._silu = kern._step_attn, kern._norm, kern._silu
        n_kv, g, d, n_head = shape
        self.n_seq, self.width, self.row = n_seq, n_head * d, (n_head + 2 * n_kv) * d
        layer = k.stride(0) * k.element_size()
        self._k0, self._v0, self._layer = k.data_ptr(), v.data_ptr(), layer
        self._fixed = (k.stride(1), arr(*dst), (ctypes.c_void_p * n_seq)(*(c[0] for c in cells)),
                       arr(*(c[1] for c in cells)), arr(*(c[2] for c in cells)), n_seq, n_kv,
                       g, d, d**-0.5)
        self._cos, self._sin, self._work = cos.data_ptr(), sin.data_ptr(), kern._work.data_ptr()
        self.x, self.n_embd, self.n_ff, self._eps = x, x.shape[1], n_ff, eps
        self.h = torch.empty(n_seq, x.shape[1], dtype=torch.bfloat16)
        self.act = torch.empty(n_seq, n_ff, dtype=torch.bfloat16)
        # the pointers above stay valid while we live
        self._keep = (k, v, cos, sin, keep, kern._work)

    def attend(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [n_seq, (n_head + 2 n_head_kv) * d] bf16, this layer's fused projections ->
        attention outputs [n_seq, n_head * d]; K/V stored in the pool on the way."""
        if not (qkv.dtype == torch.bfloat16 and qkv.is_contiguous()
                and qkv.shape == (self.n_seq, self.row) and 0 <= layer < self.n_layer):
            raise ValueError("decode step: bad qkv rows or layer")
        out = torch.empty(self.n_seq, self.width, dtype=torch.bfloat16)
        off = layer * self._layer
        rc = self._call(qkv.data_ptr(), self._cos, self._sin, self._k0 + off, self._v0 + off,
                        *self._fixed, out.data_ptr(), self._work)
        if rc != 0:
            raise ValueError("decode attention kernel refused the shape")
        return out

    def norm(self, x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor) -> torch.Tensor:
        """Transformer.norm for this step's residual rows: x += y, then bf16(rms_norm(x) * w),
        into the step's reused buffer."""
        if x is not self.x or not (
                w.dtype == torch.float32 and w.is_contiguous() and w.numel() == self.n_embd
                and (y is None or (y.dtype == torch.bfloat16 and y.is_contiguous()
                                   and y.shape == (self.n_seq, self.n_embd)))):
            raise ValueError("decode step: not this step's residual, an f32 norm or bf16 rows")
        self._norm(x.data_ptr(), self.n_embd, None if y is None else y.data_ptr(), w.data_ptr(),
                   self.n_seq, self.n_embd, self._eps, self.h.data_ptr())
        return self.h

    def silu(self, gu: torch.Tensor) -> torch.Tensor:
        """Transformer.silu into the step's reused buffer."""
        if not (gu.dtype == torch.bfloat16 and gu.is_contiguous()
                and gu.shape == (self.n_seq, 2 * self.n_ff)):
            raise ValueError("decode step: bad [gate | up] rows")
        self._silu(gu.data_ptr(), self.n_seq, self.n_ff, self.act.data_ptr())
        return self.act


@functools.cache
def kernels() -> Kernels | None:
    """The compiled kernels, or None (no compiler, build failed, RADIXSERVE_KERNELS=0)."""
    if os.environ.get("RADIXSERVE_KERNELS", "1") == "0":
        return None
    path = build()
    return Kernels(ctypes.CDLL(str(path))) if path else None
