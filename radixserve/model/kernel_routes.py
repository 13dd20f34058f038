"""Which kernel runs each weight matrix: one table, keyed by the kernel build and the GGUF type,
read once per matrix at load (weights.py), and printed by `radixserve perf --routes` and
`/props`' `kernel_routes`.

Why one table: the choice had grown into seven places (the loader, three checks in quant.py,
the C entry point), each with its own idea of what a CPU runs; a route that nothing chose
could linger unseen (qmm.c's bf16 dot products did). Here every reachable route is a row, and
tests/model/test_routes.py runs each one.

A row's `few` and `many` say what runs a decode step (up to 4 rows) and a prefill chunk: every
route runs one kernel for both except torch's int4 layout, whose prefill chunks (96 rows and
more, outside deterministic mode) run a bf16 GEMM on weights unpacked for the call. Every build
of our kernels runs the quantized types on the tiles with 8-bit activations (csrc/i8act.c);
the file's own blocks (qmm.c) take what the tiles cannot hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import gguf
import torch

if TYPE_CHECKING:
    from radixserve.model.kernels import Kernels

Q = gguf.GGMLQuantizationType
Q4_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K)  # one affine map a group of 4-bit codes: the 4-bit tiles
FLOAT_TYPES = (Q.F16, Q.BF16, Q.F32)
I8_TYPES = (Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q5_K, Q.Q6_K)  # int8 codes and f32 scales: 8-bit tiles
TILE_ROWS = 16  # the tiles' rows (i8act.c): a matrix whose rows are not a multiple falls back
QMM_GROUP = 32  # qmm.c reads rows of whole 32-weight groups (the float types' too)


@dataclass(frozen=True)
class Route:
    name: str
    few: str  # up to 4 rows (decode)
    many: str  # prefill chunks
    holds: str  # what memory holds


ROUTES = {r.name: r for r in (
    Route("q4-tiles", "i8act.c 4-bit tiles, 8-bit activations",
          "i8act.c 4-bit tiles, 8-bit activations",
          "4-bit codes in 16-row tiles, f16 scale and offset a group"),
    Route("mxfp4-tiles", "i8act.c 4-bit tiles through MXFP4's table, 8-bit activations",
          "i8act.c 4-bit tiles through MXFP4's table, 8-bit activations",
          "MXFP4's 4-bit codes in 16-row tiles, an f32 scale a group"),
    Route("file-rows", "i8act.c tiles gathered from the file's rows, 8-bit activations",
          "i8act.c tiles gathered from the file's rows, 8-bit activations",
          "the file's own Q8_0 / MXFP4 / Q4_K / Q6_K blocks, mapped (expert tensors: not copied)"),
    Route("i8-tiles", "i8act.c 8-bit tiles, 8-bit activations",
          "i8act.c 8-bit tiles, 8-bit activations",
          "int8 codes in 16-row tiles, f32 scales (and offsets) a group"),
    Route("bf16-panels", "bf16_gemm.c", "bf16_gemm.c", "bf16 in 32-row panels"),
    Route("qmm-int", "qmm.c integer dots, groups decoded in registers",
          "qmm.c integer dots, 2x3 tiles over columns decoded once a row block",
          "the file's blocks"),
    Route("qmm-f32", "qmm.c f32 multiply-adds", "qmm.c f32 multiply-adds", "the file's blocks"),
    Route("torch-int4", "torch's int4 weight-only kernel",
          "bf16 GEMM on weights unpacked per call (the int4 kernel in deterministic mode)",
          "torch's int4 layout, scale and zero a group in the compute dtype"),
    Route("torch-dense", "F.linear", "F.linear", "dense in the compute dtype"),
)}

# the kernel builds (model/kernel_build.py's VARIANTS), and "none": no kernels of ours
# (RADIXSERVE_KERNELS=0, no compiler) or a compute dtype they do not take (f16, f32)
BUILDS = ("avx512bf16", "avx512", "avxvnni", "avx2", "neon", "generic", "none")
KINDS = ("4-bit", "5-8-bit", "mxfp4", "float", "other")
_TILES = {"4-bit": "q4-tiles", "5-8-bit": "i8-tiles", "mxfp4": "mxfp4-tiles", "float": "qmm-f32",
          "other": "torch-dense"}
TABLE: dict[tuple[str, str], str] = {
    ("avx512bf16", "4-bit"): "q4-tiles",
    ("avx512bf16", "5-8-bit"): "i8-tiles",
    ("avx512bf16", "mxfp4"): "mxfp4-tiles",
    ("avx512bf16", "float"): "bf16-panels",
    ("avx512bf16", "other"): "bf16-panels",  # dequantized at load
    **{(b, kind): r for b in ("avx512", "avxvnni", "avx2", "neon", "generic")
       for kind, r in _TILES.items()},
    ("none", "4-bit"): "torch-int4",
    ("none", "5-8-bit"): "torch-dense",
    ("none", "mxfp4"): "torch-dense",
    ("none", "float"): "torch-dense",
    ("none", "other"): "torch-dense",
}
# where a matrix cannot take its row's route, what it takes instead, and why
FALLBACK = {
    "q4-tiles": ("qmm-int", f"rows not a multiple of {TILE_ROWS}"),
    "i8-tiles": ("qmm-int", f"rows not a multiple of {TILE_ROWS}"),
    "torch-int4": ("torch-dense", f"rows not a multiple of {TILE_ROWS}"),
}


def kind_of(qtype: Q) -> str:
    if qtype in Q4_TYPES:
        return "4-bit"
    if qtype == Q.MXFP4:
        return "mxfp4"
    if qtype in I8_TYPES:
        return "5-8-bit"
    return "float" if qtype in FLOAT_TYPES else "other"


def build_of(variant: str | None, dtype: torch.dtype) -> str:
    """The table's build for kernels of `variant` (None: none) at this compute dtype (our
    kernels take bf16 activations only)."""
    if variant is None or dtype != torch.bfloat16:
        return "none"
    return variant


def build_for(kern: Kernels | None, dtype: torch.dtype) -> str:
    """The table's build for the kernels `kern` a model is loaded with (None: none)."""
    return build_of(kern.variant if kern is not None else None, dtype)


def route_for(build: str, qtype: Q, n_rows: int, packed: bool = True, n_cols: int = 0) -> str:
    """The route of a matrix of `n_rows` rows of `n_cols` weights in `qtype` under `build`."""
    name = TABLE[build, kind_of(qtype) if packed else "other"]
    if name in FALLBACK and n_rows % TILE_ROWS:
        name = FALLBACK[name][0]
    elif name == "mxfp4-tiles" and n_rows % TILE_ROWS:  # qmm.c does not read MXFP4
        name = TABLE[build, "other"]
    if name.startswith("qmm") and n_cols % QMM_GROUP:  # a float row not in qmm.c's blocks
        name = TABLE[build, "other"]
    return name


# the types whose file rows the tiles' kernels gather (csrc/i8act.c's F_FQ8, F_FMX, F_FQ4K, F_FQ6K)
FILE_ROW_TYPES = {Q.Q8_0: 5, Q.MXFP4: 6, Q.Q4_K: 7, Q.Q6_K: 8}
# the builds whose gather keeps a decode step's Q8_0 and MXFP4 expert products within ~15% of
# their tiles' (docs/PERFORMANCE.md); the others map expert tensors only when asked to
# (--load-mode mmap): AVX2's gather costs 1.1-1.4x its tiles' time at one row, plain C's
# (generic, neon) ~10x. The K-quants' gathers (Q4_K's scales decoded a super-block at a time,
# Q6_K's codes from two places) cost more at one row: mapped when asked to only.
FAST_GATHER = ("avx512bf16", "avx512", "avxvnni")
AUTO_TYPES = (Q.Q8_0, Q.MXFP4)
LOAD_MODES = ("auto", "none", "mmap", "mlock", "mmap+mlock", "dio")


def maps_experts(load_mode: str, build: str, qtype: Q) -> bool:
    """Whether a load in `load_mode` (--load-mode) under `build` maps an expert tensor of
    `qtype` (the file-rows route) instead of copying it into tiles: auto for AUTO_TYPES on the
    FAST_GATHER builds, mmap for every FILE_ROW_TYPES type on every build of our kernels, none
    and dio never (the mlock modes as their other half)."""
    if build == "none" or qtype not in FILE_ROW_TYPES:
        return False
    if load_mode in ("mmap", "mmap+mlock"):
        return True
    return load_mode == "auto" and build in FAST_GATHER and qtype in AUTO_TYPES


def table_text(build: str | None = None) -> str:
    """The table as text, one build's rows (all builds when None)."""
    lines = [f"{'build':<11} {'GGUF types':<34} {'route':<12} few rows | many rows"]
    types = {"4-bit": "Q4_0 Q4_1 Q4_K", "5-8-bit": "Q5_0 Q5_1 Q8_0 Q5_K Q6_K", "mxfp4": "MXFP4",
             "float": "F16 BF16 F32", "other": "any other (dequantized at load)"}
    for b in BUILDS if build is None else (build,):
        for kind in KINDS:
            r = ROUTES[TABLE[b, kind]]
            lines.append(f"{b:<11} {types[kind]:<34} {r.name:<12} {r.few} | {r.many}")
    for name, (to, why) in FALLBACK.items():
        lines.append(f"  {name} -> {to} where {why}")
    lines.append(f"  mxfp4-tiles -> the build's 'other' route where rows not a multiple of "
                 f"{TILE_ROWS}")
    lines.append(f"  qmm-* -> the build's 'other' route where a row's weights are not a multiple "
                 f"of {QMM_GROUP} (a float type's)")
    lines.append("  q4-tiles -> torch-int4 where a scale or offset exceeds f16's range")
    auto = " ".join(t.name for t in AUTO_TYPES)
    if build is None:
        where = f"auto: {auto} on {', '.join(FAST_GATHER)}; mmap: all, on every build of ours"
    else:
        where = f"auto: {auto}; mmap: all" if build in FAST_GATHER else "mmap"
    if build != "none":
        lines.append(f"  expert tensors of {' '.join(t.name for t in FILE_ROW_TYPES)}: "
                     f"file-rows where --load-mode maps them ({where}), rows a multiple of "
                     f"{TILE_ROWS}")
    return "\n".join(lines)
