"""Building our kernels (model/csrc/*.c) with the system C compiler: the variants, the CPU
flags that pick one, each source's flags, and the compile, link and cache of one shared object
per variant. Nothing here reads the environment: the compiler and the cache directory come
from the settled configuration (kernel_config.py), and the ctypes side is kernels.py.

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
CPU lacks a flag for, is a KernelsError at start-up (`radixserve serve` exits naming it):
select_variant, which kernel_config.py calls once with the environment's value.

Each source becomes an object file with the common flags, which allow reassociation, except
the sources in _STRICT_FP, whose sums must run in the order written; the objects are linked into
one shared object per variant, cached under the user's cache directory, keyed by the variant,
the sources, the compiler and every flag, and written atomically (a crash mid-build leaves no
half file).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_PREFIX = "radixserve-kernels-"  # the shared object's name: this, then its build key
ENV = "RADIXSERVE_KERNELS"
# every object file: optimized, position-independent, OpenMP, no errno from libm
_COMMON = ("-O3", "-fopenmp", "-fPIC", "-fno-math-errno")
# and, except for the sources in _STRICT_FP, sums the compiler may reorder (vectorize)
_REASSOC = ("-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros")
# sources whose floating-point sums must run exactly as written (no reassociation)
_STRICT_FP = frozenset({"qmm.c", "i8act.c", "kv_rows.c", "short_conv.c", "delta_net.c",
                        "mamba2.c"})
# and, of those, the sources whose roundings are exactly as written: no fused multiply-adds
_NO_CONTRACT = frozenset({"i8act.c", "kv_rows.c", "short_conv.c", "delta_net.c", "mamba2.c"})
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


def select_variant(value: str | None, cpuinfo: str | None = None,
                   machine: str | None = None) -> str | None:
    """The variant RADIXSERVE_KERNELS's `value` asks for (None: unset): None for 0 (kernels
    off); for auto, 1 or unset the best this CPU runs; a name forces that variant. Raises
    KernelsError for an unknown value, or a variant the CPU lacks flags for. `cpuinfo` and
    `machine` stand in for /proc/cpuinfo and platform.machine() (tests)."""
    raw = value
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


def build(variant: str | None, cc: str | None, cache: Path) -> Path | None:
    """Compile every csrc/*.c for `variant` (None: the best this CPU runs) with the compiler
    `cc` (None: none was found) and link them into one shared object in the directory `cache`,
    or reuse the cached build there; None when it cannot be built."""
    variant = variant or supported_variants()[0]
    if variant not in VARIANTS:
        raise KernelsError(f"no kernel variant {variant!r} ({', '.join(VARIANTS)})")
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
    out = cache / f"{_PREFIX}{variant}-{h.hexdigest()[:16]}.so"
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
