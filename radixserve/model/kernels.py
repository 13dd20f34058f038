"""Kernels of our own (model/csrc/*.c), compiled on first use with the system C compiler.

Why compiled here rather than shipped: the sources are plain C with no torch headers, so a build
takes a few seconds. Each build is a *variant*: the same sources with fixed flags, so a build
is reproducible (the same bits on any machine with the same compiler) and every variant can be
built and tested on one machine that runs them all:

    avx512bf16  -march=x86-64-v4 -mavx512bf16 -mavx512vnni  (every kernel: the tiles' 8-bit
                products on 512-bit vpdpbusd, the bf16 GEMM of the float types, the VNNI head
                pass, the AVX-512 attention path)
    avx512      -march=x86-64-v4 -mavx512vnni  (no BF16: the tiles as above; the float types
                in qmm.c, on the GGUF's own blocks; the head's int8 pass on VNNI)
    avxvnni     -march=x86-64-v3 -mavxvnni  (AVX2 and AVX-VNNI's 256-bit vpdpbusd, what Intel's
                client cores since 2021 have: the tiles on vpdpbusd, the rest as avx2)
    avx2        -march=x86-64-v3  (AVX2, FMA, F16C, BMI: the tiles on vpmaddubsw, the plain-C
                paths auto-vectorized, AVX2 intrinsics in the head's int8 pass and qmm's byte
                widening)
    neon        -march=armv8.2-a+dotprod on aarch64 (NEON intrinsics: the tiles and the head's
                int8 pass on sdot, qmm's integer dot products, attention's dot products in
                4-lane f32 vectors); cross-compiled and run under qemu-user by the tests
                (tests/model/test_neon.py), its speed on real ARM hardware not measured
    generic     -march=x86-64 (SSE2), or no -march off x86: plain C, correct everywhere

RADIXSERVE_KERNELS picks one: `auto` (the default; `1` is the same) takes the best this CPU's
flags (/proc/cpuinfo) allow, a variant's name forces it, `0` turns the kernels off (callers keep
their torch path, as they do when no compiler is found). An unknown value, or a variant this
CPU lacks a flag for, is a KernelsError at start-up (`radixserve serve` exits naming it).

Each source becomes an object file with the common flags, which allow reassociation, except
the sources in _STRICT_FP, whose sums must run in the order written; the objects are linked into
one shared object per variant, cached under the user's cache directory, keyed by the variant,
the sources, the compiler and every flag, and written atomically (a crash mid-build leaves no
half file).

Calls go through ctypes with raw pointers into torch tensors, every entry point bound by
cabi.py's one table; the caller guarantees dtype, layout and bounds (checked here once per call,
cheaply, or once where a holder binds a matrix or the pool), and the kernel's OpenMP calls
resolve to the libgomp torch has loaded, so both share one thread pool.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixserve.model.cabi import bind
from radixserve.memory.pool.kv_types import TYPES, KVType

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_PREFIX = "radixserve-kernels-"  # the shared object's name: this, then its build key
ENV = "RADIXSERVE_KERNELS"
# every object file: optimized, position-independent, OpenMP, no errno from libm
_COMMON = ("-O3", "-fopenmp", "-fPIC", "-fno-math-errno")
# and, except for the sources in _STRICT_FP, sums the compiler may reorder (vectorize)
_REASSOC = ("-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros")
# sources whose floating-point sums must run exactly as written (no reassociation)
_STRICT_FP = frozenset({"qmm.c", "i8act.c", "kv_rows.c", "short_conv.c"})
# and, of those, the sources whose roundings are exactly as written: no fused multiply-adds
_NO_CONTRACT = frozenset({"i8act.c", "kv_rows.c", "short_conv.c"})
# and sources built without partial redundancy elimination: it translated the gates' division
# through exp_clamped's clamp into one copy for each arm (5 divisions a vector where 1 does:
# the SiLU gate 8x slower)
_NO_PRE = frozenset({"rowwise.c"})
_LINK = ("-shared", "-fopenmp")


class KernelsError(ValueError):
    """RADIXSERVE_KERNELS names no variant, or one this CPU cannot run (or that did not build):
    start-up stops with this message."""


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    arch: str  # the machine it is built for ("x86_64", "aarch64"), "" for any (generic)
    cflags: tuple[str, ...]  # its -march (and extensions) there
    needs: tuple[str, ...]  # /proc/cpuinfo flags it needs ("a|b": either)
    what: str  # for the log: "x86-64-v3 build"

    def flags(self, machine: str | None = None) -> tuple[str, ...]:
        """Its compiler flags on `machine` (default this one's): generic takes the x86-64
        baseline on x86-64 and the compiler's default elsewhere."""
        if self.arch:
            return self.cflags
        return self.cflags if arch_of(machine) == "x86_64" else ()


# x86-64-v2 (SSE3 is "pni"), then -v3 (LZCNT is "abm" on Linux), then -v4's AVX-512 set
_V2 = ("pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16", "lahf_lm")
_V3 = (*_V2, "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm|lzcnt", "xsave")
_V4 = (*_V3, "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd")
# best first: `auto` takes the first this CPU runs
VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("avx512bf16", "x86_64", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
            (*_V4, "avx512_vnni", "avx512_bf16"), "x86-64-v4 + AVX512-VNNI + AVX512-BF16 build"),
    Variant("avx512", "x86_64", ("-march=x86-64-v4", "-mavx512vnni"), (*_V4, "avx512_vnni"),
            "x86-64-v4 + AVX512-VNNI build"),
    # AVX2 with AVX-VNNI's 256-bit vpdpbusd: Intel's client cores since 2021 (Alder Lake on),
    # which have no AVX-512
    Variant("avxvnni", "x86_64", ("-march=x86-64-v3", "-mavxvnni"), (*_V3, "avx_vnni"),
            "x86-64-v3 + AVX-VNNI build"),
    Variant("avx2", "x86_64", ("-march=x86-64-v3",), _V3, "x86-64-v3 build"),
    # asimddp: the dot-product instructions (sdot), ARMv8.2's optional, in every v8.4 core
    Variant("neon", "aarch64", ("-march=armv8.2-a+dotprod",), ("asimd", "asimddp"),
            "ARMv8.2-A + dot-product build"),
    Variant("generic", "", ("-march=x86-64",), (), "baseline build"),
)}
CHOICES = ("auto", *VARIANTS, "0")  # what RADIXSERVE_KERNELS takes (and "1", meaning auto)
_ARCH_NAMES = {"x86_64": "x86-64", "aarch64": "aarch64"}


def arch_of(machine: str | None = None) -> str:
    """`machine` (default platform.machine()) as a variant's arch: x86_64, aarch64 or as
    given."""
    m = (machine if machine is not None else platform.machine()).lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(m, m)


def _choices(machine: str | None = None) -> tuple[str, ...]:
    """What RADIXSERVE_KERNELS may name on `machine`."""
    here = arch_of(machine)
    return ("auto", *(n for n, v in VARIANTS.items() if v.arch in ("", here)), "0")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "radixserve" / "kernels"


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str] | None:
    """The CPU's feature flags: those every core lists in /proc/cpuinfo (or in `cpuinfo`, the
    text of one); None when there is no such file."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="ignore")
        except OSError:
            return None
    sets = [frozenset(line.split(":", 1)[1].split()) for line in cpuinfo.splitlines()
            if line.split(":", 1)[0].strip() in ("flags", "Features") and ":" in line]
    return frozenset.intersection(*sets) if sets else frozenset()


def missing_flags(variant: str, flags: frozenset[str] | None,
                  machine: str | None = None) -> list[str]:
    """The CPU flags `variant` needs that `flags` lacks (["x86-64"] for an x86 variant on
    another machine, ["aarch64"] for neon); [] when it runs here."""
    v = VARIANTS[variant]
    if v.arch and v.arch != arch_of(machine):
        return [_ARCH_NAMES[v.arch]]
    if not v.needs:
        return []
    have = flags or frozenset()
    return [n for n in v.needs if not any(a in have for a in n.split("|"))]


def supported_variants(cpuinfo: str | None = None, machine: str | None = None) -> list[str]:
    """The variants this CPU runs, best first (generic always)."""
    flags = cpu_flags(cpuinfo)
    return [name for name in VARIANTS if not missing_flags(name, flags, machine)]


def select_variant(value: str | None = None, cpuinfo: str | None = None,
                   machine: str | None = None) -> str | None:
    """The variant RADIXSERVE_KERNELS asks for (`value`; by default the environment's): None
    for 0 (kernels off); for auto, 1 or unset the best this CPU runs; a name forces that
    variant. Raises KernelsError for an unknown value, or a variant the CPU lacks flags for.
    `cpuinfo` and `machine` stand in for /proc/cpuinfo and platform.machine() (tests)."""
    raw = os.environ.get(ENV) if value is None else value
    choice = (raw or "auto").strip().lower()
    if choice == "0":
        return None
    if choice in ("auto", "1"):
        return supported_variants(cpuinfo, machine)[0]
    allowed = ", ".join(_choices(machine))
    if choice not in VARIANTS:
        raise KernelsError(f"{ENV}={raw!r} is not a kernel variant; allowed values: {allowed} "
                           f"(unset means auto)")
    flags = cpu_flags(cpuinfo)
    missing = missing_flags(choice, flags, machine)
    if missing:
        runs = ", ".join(supported_variants(cpuinfo, machine))
        v = VARIANTS[choice]
        if v.arch and v.arch != arch_of(machine):
            why = (f"it is an {_ARCH_NAMES[v.arch]} build and this machine is "
                   f"{machine or platform.machine()}")
        elif flags is None:
            why = "the CPU's flags are unknown (no /proc/cpuinfo)"
        else:
            why = f"this CPU lacks {' '.join(missing)}"
        raise KernelsError(f"{ENV}={choice}: the {choice} kernels ({VARIANTS[choice].what}) "
                           f"cannot run here: {why}; this CPU runs {runs}; allowed values: "
                           f"{allowed}")
    return choice


def compile_flags(source: str, variant: str, machine: str | None = None) -> list[str]:
    """The flags that compile csrc/`source` (a file name) to an object file for `variant`."""
    fp = () if source in _STRICT_FP else _REASSOC
    fp += ("-ffp-contract=off",) if source in _NO_CONTRACT else ()
    fp += ("-fno-tree-pre",) if source in _NO_PRE else ()
    return [*_COMMON, *fp, *VARIANTS[variant].flags(machine)]


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(variant: str | None = None) -> Path | None:
    """Compile every csrc/*.c for `variant` (default: the best this CPU runs) and link them
    into one shared object, or reuse the cached build; None when it cannot be built."""
    variant = variant or supported_variants()[0]
    if variant not in VARIANTS:
        raise KernelsError(f"no kernel variant {variant!r} ({', '.join(VARIANTS)})")
    cc = _compiler()
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
    # the build's inputs: every source and header, the compiler, each source's flags
    h = hashlib.sha256(version)
    for p in sorted(q for q in _CSRC.iterdir() if q.suffix in (".c", ".h")):
        h.update(b"\0" + p.name.encode() + b"\0" + p.read_bytes())
    for p in sources:
        h.update(b"\0" + " ".join(compile_flags(p.name, variant)).encode())
    h.update(b"\0" + " ".join(_LINK).encode())
    out = cache_dir() / f"{_PREFIX}{variant}-{h.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)

    def compile_one(src: Path) -> str | None:
        """Compile one source into the build's directory; its errors, or None."""
        cmd = [cc, *compile_flags(src.name, variant), "-c", str(src), "-o",
               os.path.join(tmp, src.stem + ".o")]
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
        return None if r.returncode == 0 else f"{src.name}:\n{r.stderr[-2000:]}"

    try:
        # objects and the linked file in a private directory beside the cache: one rename
        # publishes the build, and the directory goes whatever happens
        with tempfile.TemporaryDirectory(prefix=".build-", dir=out.parent) as tmp:
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                errors = [e for e in pool.map(compile_one, sources) if e]
            if errors:
                log.warning("building the %s kernels failed, torch ops used instead:\n%s",
                            variant, "\n".join(errors))
                return None
            so = os.path.join(tmp, "kernels.so")
            r = subprocess.run([cc, *_LINK, *(os.path.join(tmp, p.stem + ".o")
                                              for p in sources), "-o", so, "-lm"],
                               check=False, capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                log.warning("linking the %s kernels failed, torch ops used instead:\n%s",
                            variant, r.stderr[-2000:])
                return None
            os.replace(so, out)
            return out
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("building the %s kernels failed (%s), torch ops used instead", variant, e)
        return None


CHECKS_ENV = "RADIXSERVE_KERNEL_CHECKS"


def checks_on() -> bool:
    """RADIXSERVE_KERNEL_CHECKS=1: every index a kernel reads through is range-checked before
    the call (a pass over it: the test suite runs so, a server need not; the sizes a kernel
    trusts are checked either way, once, where the matrix, pool or head is bound)."""
    return os.environ.get(CHECKS_ENV, "") == "1"


def _cells_arg(cells: slice | torch.Tensor, n_cells: int) -> tuple[int | None, int, int]:
    """A sequence's cells as the kernels take them: (index pointer or None, first cell, count);
    an index tensor's entries must lie in the pool (checked in check mode: decode_attn.c reads
    kh + cells[j] d unchecked)."""
    if isinstance(cells, slice):
        c0 = cells.start or 0
        n = (n_cells if cells.stop is None else cells.stop) - c0
        if c0 < 0 or n <= 0 or c0 + n > n_cells:
            raise IndexError(f"cells {cells} outside a pool of {n_cells}")
        return None, c0, n
    if cells.dtype != torch.int64 or not cells.is_contiguous() or cells.numel() == 0:
        raise ValueError("cell index must be a non-empty contiguous int64 tensor")
    if checks_on() and not (0 <= int(cells.min()) and int(cells.max()) < n_cells):
        raise IndexError(f"cell index outside a pool of {n_cells} cells "
                         f"({int(cells.min())}..{int(cells.max())})")
    return cells.data_ptr(), 0, cells.numel()


KVTypes = tuple[KVType, KVType]


def pool_args(k: torch.Tensor, v: torch.Tensor, n_head: int, d: int,
              types: KVTypes | None) -> tuple[int, ...]:
    """(n_kv, n_cells, g, kt code, vt code, K head stride in bytes, V head stride in bytes) of
    pool K/V [..., n_kv, n_cells, width] (one layer or all) holding
    rows of head size d in the cache types `types` (None: bf16, the compute dtype); ValueError
    unless the tensors are what those types store, contiguous."""
    kt, vt = types or (TYPES["bf16"], TYPES["bf16"])
    n_kv, n_cells = k.shape[-3:-1]
    if not (k.dtype == kt.storage and v.dtype == vt.storage and k.shape[-1] == kt.width(d)
            and v.shape[-1] == vt.width(d) and k.shape[:-1] == v.shape[:-1]
            and k.is_contiguous() and v.is_contiguous() and n_head % n_kv == 0
            and d % 2 == 0 and d % kt.block == 0 and d % vt.block == 0):
        raise ValueError(f"attention needs {kt.name}/{vt.name} K/V rows of head size {d} "
                         f"in the pool's layout")
    return (n_kv, n_cells, n_head // n_kv, kt.code, vt.code,
            k.stride(-3) * k.element_size(), v.stride(-3) * v.element_size())


class Kernels:
    """The bf16 kernels (csrc/): the tiles' products with 8-bit activations, the row-invariant
    bf16 matmul, causal attention reading K/V in place from the pool in fixed blocks (alone, or fused
    with RoPE and the K/V store for a whole step of decode tokens and prefill chunks),
    the residual add fused with RMSNorm-to-bf16, the SiLU gate, the head's int8 pass and its
    exact f32 dot products.
    Pointers go to C unchecked, so every entry point checks dtype and layout first (cheaply, or
    once per step). `variant` names the build's flags (VARIANTS), `build_key` the whole build
    (the variant, sources, compiler, flags): the bits these kernels compute depend on it, so
    KV kept across processes is keyed by it (Model.identity). `lib` is the shared object, for
    the callers that hold matrices or steps of their own (their entry points: cabi.bind)."""

    def __init__(self, lib: ctypes.CDLL, build_key: str = "", variant: str = "") -> None:
        self.lib, self.build_key, self.variant = lib, build_key, variant
        c = bind(lib)
        self._attn, self._work_floats = c.attn_causal_win_bf16, c.attn_work_floats
        self._norm, self._silu = c.add_rms_norm_bf16, c.silu_mul_bf16
        self._int8_head, self._dots = c.int8_head, c.f32_head_dots
        self._tiles = c.i8a_matmul  # the 4- and 8-bit tiles' products, 8-bit activations
        self._bf16_mm = c.bf16_matmul
        self._short_conv = c.short_conv_bf16
        self.has_int8_head = bool(c.int8_head_available())  # every build (VNNI, AVX2, NEON, C)
        self.has_bf16_gemm = bool(c.bf16_gemm_available())  # needs AVX512-BF16
        self._work = torch.empty(0)

    def _scratch(self, longest: int, n_tok: int, n_kv: int, g: int, d: int) -> torch.Tensor:
        """The attention scratch, grown (never shrunk) to fit a call: it is sized by the
        longest cell list, the query count and the thread count."""
        need = self._work_floats(longest, n_tok, n_kv, g, d)
        if self._work.numel() < need:
            self._work = torch.empty(need, dtype=torch.float32)
        return self._work

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cells: slice | torch.Tensor) -> torch.Tensor:
        """q [1, n_head, d]; k, v one layer of the pool [n_head_kv, n_cells, d]; cells the
        sequence's cells in position order (a run or an int64 index) -> [1, n_head * d].
        attend_causal for a single query, which sees every cell."""
        return self.attend_causal(q, k, v, cells)

    def attend_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cells: slice | torch.Tensor, *, window: int = 0,
                      pos0: int = 0, types: KVTypes | None = None) -> torch.Tensor:
        """q [n, n_head, d] rotated queries of a sequence's last n cells, whose K/V are already
        in k, v (one layer of the pool [n_head_kv, n_cells, d]); cells the sequence's cells in
        position order (a run or an int64 index), entry j at position pos0 + j; query i (at
        position p = pos0 + len - n + i) sees the entries at positions k <= p, and with
        window > 0 only those with p - window < k -> [n, n_head * d]. Bitwise the same whatever
        n is and however many older entries precede a query's window (decode_attn.c's blocks,
        aligned to absolute positions). `types`: the pool's cache types (None: bf16 rows)."""
        d = q.shape[-1]
        n_kv, n_cells, g, kt, vt, k_hs, v_hs = pool_args(k, v, q.shape[1], d, types)
        idx, c0, length = _cells_arg(cells, n_cells)
        n = q.shape[0]
        if not (q.dtype == torch.bfloat16 and q.is_contiguous() and q.dim() == 3
                and q.shape[2] == d and 1 <= n <= length):
            raise ValueError("attention needs contiguous bf16 queries [n <= cells, n_head, d]")
        if not (0 <= window < 2**62 and 0 <= pos0 < 2**62):
            raise ValueError(f"attention needs window >= 0 and pos0 >= 0 ({window}, {pos0})")
        # the scratch holds the blocks the list spans: from its first block's start
        work = self._scratch(max(length + pos0 % ATTN_BLOCK, n_cells), n, n_kv, g, d)
        out = torch.empty(n, q.shape[1] * d, dtype=torch.bfloat16)
        arr = ctypes.c_int64 * 1
        rc = self._attn(q.data_ptr(), k.data_ptr(), v.data_ptr(), kt, vt, k_hs, v_hs, 1,
                        (ctypes.c_void_p * 1)(idx), arr(c0), arr(length), arr(n), arr(pos0),
                        window, n_kv, g, d, d**-0.5, out.data_ptr(), work.data_ptr(),
                        work.numel())
        if rc != 0:
            raise ValueError(f"attention kernel refused g={g} d={d} n={n} of {length} (rc {rc})")
        return out

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

    def short_conv(self, bcx: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor,
                   new: torch.Tensor, reads: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """LFM2's short convolution of one layer (csrc/short_conv.c; model/short_conv.py's
        arithmetic): the in-projection's bf16 rows bcx [T, 3 e], the layer's input rows in the
        window part ck, cv [n_cells, e / 2] (written at the cells `new` [T]), the cells each
        output reads [T * L] (-1: before position 0), the kernel w [e, L] f32 -> [T, e]."""
        rows, e3 = bcx.shape
        e, L = w.shape
        ok = (bcx.dtype == ck.dtype == cv.dtype == torch.bfloat16 and w.dtype == torch.float32
              and e3 == 3 * e and e % 2 == 0 and ck.shape == cv.shape and ck.shape[1] == e // 2
              and all(t.is_contiguous() for t in (bcx, ck, cv, w))
              and new.dtype == reads.dtype == torch.int64 and new.numel() == rows
              and reads.numel() == rows * L)
        if not ok:
            raise ValueError("short_conv kernel needs contiguous bf16 rows and caches, an f32 "
                             "kernel [e, L] and int64 cells")
        out = torch.empty(rows, e, dtype=torch.bfloat16)
        self._short_conv(bcx.data_ptr(), rows, e, L, ck.data_ptr(), cv.data_ptr(),
                         new.data_ptr(), reads.data_ptr(), w.data_ptr(), out.data_ptr())
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

    def head_dots(self, w: torch.Tensor, h: torch.Tensor,
                  ids: torch.Tensor | None = None) -> torch.Tensor:
        """Exact f32 logits [n, m]: w[ids] . h row by row (every row of w when ids is None),
        each one dot product in a fixed order (csrc/f32_head.c), so a logit never depends on
        which rows or tokens share the call."""
        if not (w.dtype == h.dtype == torch.float32 and w.is_contiguous() and h.is_contiguous()
                and h.dim() == 2 and w.dim() == 2 and h.shape[1] == w.shape[1]):
            raise ValueError("head_dots needs contiguous f32 rows of the head's width")
        m = w.shape[0]
        if ids is not None:
            if not (ids.dtype == torch.int64 and ids.is_contiguous() and ids.dim() == 1):
                raise ValueError("head_dots needs a contiguous int64 token index")
            m = ids.numel()
        out = torch.empty(h.shape[0], m)
        if m and h.shape[0] and self._dots(
                w.data_ptr(), w.shape[0], w.shape[1], None if ids is None else ids.data_ptr(),
                m, h.data_ptr(), h.shape[0], out.data_ptr()) != 0:
            raise IndexError("head_dots: token id outside the head")
        return out

    def tiles(self, tiles: torch.Tensor, fmt: int, n: int, k: int) -> TileMatrix:
        """The matrix W [n, k] held in csrc/i8act.c's tile format `fmt` (TILE_BLOCK_BYTES:
        uint8 [n / 16, k / 32, block bytes], quant.py's pack_q4 and pack_i8), checked once here
        so each product only checks its input."""
        size = TILE_BLOCK_BYTES.get(fmt)
        if not (size is not None and tiles.dtype == torch.uint8 and tiles.is_contiguous()
                and n % 16 == 0 and k % 32 == 0 and tiles.shape == (n // 16, k // 32, size)):
            raise ValueError(f"tile kernels need uint8 tiles [n / 16, k / 32, {size}]")
        return TileMatrix(self, tiles, n, k, fmt)

    def bf16(self, panels: torch.Tensor, n: int, k: int) -> Bf16Matrix:
        """The bf16 matrix W [n, k] held in bf16_gemm.c's panels (bf16 [ceil(n / 32),
        ceil(k / 32) * 16, 32, 2], quant.py's pack_bf16), checked once here so each product only
        checks its input."""
        shape = (-(-n // BF16_PANEL), -(-k // 32) * 16, BF16_PANEL, 2)
        if not (self.has_bf16_gemm and panels.dtype == torch.bfloat16 and n > 0 and k > 0
                and panels.is_contiguous() and panels.shape == shape):
            raise ValueError(f"bf16 kernel needs bf16 panels {list(shape)}")
        return Bf16Matrix(self, panels, n, k)


# csrc/i8act.c's tile formats (its F_Q4, F_I8*) -> bytes per (tile, group)
TILE_BLOCK_BYTES = {0: 320, 1: 576, 2: 640, 3: 640}


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


BF16_PANEL = 32  # output rows per panel of bf16_gemm.c's layout
ATTN_BLOCK = 256  # positions a block of decode_attn.c's attention (its BLOCK)


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


def variant_name(kern: Kernels | None) -> str:
    """What /props and `radixserve perf` report: the kernels' variant, "none" without them."""
    return kern.variant if kern is not None else "none"


@functools.cache
def load_kernels(variant: str) -> Kernels | None:
    """`variant`'s kernels, built (or taken from the cache) and loaded once per process; None
    when they do not build. Raises KernelsError when this CPU cannot run them."""
    if variant not in VARIANTS:
        raise KernelsError(f"no kernel variant {variant!r}; allowed: {', '.join(VARIANTS)}")
    missing = missing_flags(variant, cpu_flags())
    if missing:
        raise KernelsError(f"the {variant} kernels cannot run on this CPU: it lacks "
                           f"{' '.join(missing)}")
    path = build(variant)
    if path is None:
        return None
    return Kernels(ctypes.CDLL(str(path)), path.stem.removeprefix(_PREFIX), variant)


# set while a model for another device than the CPU is built: our kernels read CPU memory
# only, so every choice made there (dense panels, int8 head, glue) takes torch's ops instead
_torch_ops_only: contextvars.ContextVar[bool] = contextvars.ContextVar("torch_ops_only",
                                                                       default=False)


@contextlib.contextmanager
def torch_ops_only(on: bool = True) -> Iterator[None]:
    """Within (when `on`, or already within): `kernels()` is None (a model built for a CUDA
    device), whatever the CPU has."""
    token = _torch_ops_only.set(on or _torch_ops_only.get())
    try:
        yield
    finally:
        _torch_ops_only.reset(token)


def kernels() -> Kernels | None:
    """The kernels RADIXSERVE_KERNELS selects (select_variant), or None (RADIXSERVE_KERNELS=0,
    or under auto no compiler or a failed build, or within torch_ops_only). Raises KernelsError
    for a value that names no variant, a variant this CPU cannot run, or a forced variant that
    did not build."""
    return None if _torch_ops_only.get() else _selected()


@functools.cache
def _selected() -> Kernels | None:
    variant = select_variant()
    if variant is None:
        log.info("kernels: none (%s=0: torch ops)", ENV)
        return None
    kern = load_kernels(variant)
    if kern is None:
        if (os.environ.get(ENV) or "auto").strip().lower() not in ("auto", "1"):
            raise KernelsError(f"{ENV}={variant}: the {variant} kernels did not build (see the "
                               f"warning above); unset {ENV} or set it to 0 for torch's ops")
        log.info("kernels: none (no build: torch ops)")
        return None
    log.info("kernels: %s (%s)", variant, VARIANTS[variant].what)
    return kern


kernels.cache_clear = _selected.cache_clear  # type: ignore[attr-defined]  # tests re-select
