"""The aarch64 builds, run under emulation: kernel_harness.c linked with the kernels built for
the neon variant and for the generic one (each source with the flags kernel_build.py gives it on
aarch64), cross-compiled by Debian's aarch64-linux-gnu-gcc and run by qemu-user. Every kernel's
outputs on the same inputs must agree bit for bit: the same arithmetic in the same order (the
integer sums exact, the float sums' orders fixed, every multiply-add fused on aarch64).
scripts/setup.sh test installs both packages; without them this test fails naming them (it
never skips). This checks correctness
only: qemu says nothing about speed on ARM hardware, which is not measured here."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from radixserve.model import kernel_build as B
from radixserve.model import kernels as K

CC, QEMU, OBJDUMP = "aarch64-linux-gnu-gcc", "qemu-aarch64", "aarch64-linux-gnu-objdump"
HARNESS = Path(__file__).with_name("kernel_harness.c")
# qmm_codes runs the types with an int8 codes form and refuses the others (rc 1)
CODES_TYPES = {6, 7, 8, 13, 14}


def _tool(name: str, package: str) -> str:
    path = shutil.which(name)
    assert path, (f"{name} not found: install Debian's {package} (scripts/setup.sh test does, "
                  f"as root with apt-get) to test the aarch64 kernels")
    return path


def _build(variants: tuple[str, ...], out: Path) -> dict[str, Path]:
    """The harness linked with every csrc/*.c built as kernel_build.py builds each variant on
    aarch64 (static: qemu then needs no aarch64 libraries); all objects compiled at once."""
    cc = _tool(CC, "gcc-aarch64-linux-gnu")
    sources = sorted(B._CSRC.glob("*.c"))

    def compile_one(job: tuple[str, Path]) -> None:
        variant, src = job
        subprocess.run([cc, *B.compile_flags(src.name, variant, "aarch64"), "-c", str(src),
                        "-o", str(out / f"{variant}-{src.stem}.o")], check=True,
                       capture_output=True, timeout=300)

    # the slowest source first (qmm.c: ~30 s under -O3), so the two cores finish together
    jobs = sorted(((v, s) for v in variants for s in sources), key=lambda j: j[1].name != "qmm.c")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(compile_one, jobs))
    exes = {}
    for variant in variants:
        exes[variant] = out / variant
        subprocess.run([cc, "-O2", "-fopenmp", "-static", str(HARNESS),
                        *(str(out / f"{variant}-{s.stem}.o") for s in sources), "-lm", "-o",
                        str(exes[variant])], check=True, capture_output=True, timeout=300)
    return exes


def _run(exe: Path, threads: int) -> list[tuple[str, bytes]]:
    qemu = _tool(QEMU, "qemu-user")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    r = subprocess.run([qemu, str(exe)], check=True, capture_output=True, timeout=600, env=env)
    records, b, i = [], r.stdout, 0
    while i < len(b):
        (n,) = struct.unpack_from("<I", b, i)
        name = b[i + 4:i + 4 + n].decode()
        (m,) = struct.unpack_from("<Q", b, i + 4 + n)
        i += 12 + n
        records.append((name, b[i:i + m]))
        i += m
    return records


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[str, bytes]]]:
    out = tmp_path_factory.mktemp("aarch64")
    exes = _build(("neon", "generic"), out)
    dis = {v: subprocess.run([_tool(OBJDUMP, "binutils-aarch64-linux-gnu"), "-d", str(e)],
                             check=True, capture_output=True, text=True).stdout
           for v, e in exes.items()}
    # the neon build runs NEON code of its own (sdot in the head pass, smull/addp in qmm's
    # integer dot products, the 4-lane attention), the generic one none of it
    assert "sdot" in dis["neon"] and "sdot" not in dis["generic"]
    runs = {v: _run(e, 2) for v, e in exes.items()}
    runs["neon 1 thread"] = _run(exes["neon"], 1)
    runs["neon 3 threads"] = _run(exes["neon"], 3)
    return runs


def test_neon_is_auto_on_aarch64_with_dot_products():
    assert B.select_variant("auto", "Features : fp asimd asimddp", "aarch64") == "neon"
    assert B.select_variant("auto", "Features : fp asimd", "aarch64") == "generic"
    assert B.compile_flags("qmm.c", "neon", "aarch64")[-1] == "-march=armv8.2-a+dotprod"
    with pytest.raises(B.KernelsError, match="lacks asimddp"):
        B.select_variant("neon", "Features : fp asimd", "aarch64")
    with pytest.raises(B.KernelsError, match="aarch64 build and this machine is x86_64"):
        B.select_variant("neon", "flags : fpu sse sse2", "x86_64")


def test_every_kernel_ran_and_returned_success(runs):
    recs = runs["neon"]
    names = {n for n, _ in recs}
    for prefix in ("qmm_bf16", "i8a_matmul", "qmm_rows_f32", "qmm_head_dots", "qmm_codes",
                   "int8_head ",
                   "int8_head_bound", "head_candidates", "f32_head_dots", "attn_causal",
                   "attn_step", "attn_head_norm", "add_rms_norm", "post_norm_add", "silu_mul",
                   "gelu_mul", "swiglu_oai", "short_conv"):
        assert any(n.startswith(prefix) for n in names), prefix
    for run in ("neon", "generic"):
        recs = runs[run]
        avail = dict(recs)["available bf16_gemm int8_head"]
        assert struct.unpack("<q", avail)[0] == 1  # x86's bf16 GEMM absent, the int8 head present
        for name, b in recs:
            if name.endswith(" rc"):
                rc = struct.unpack("<q", b)[0]
                t = int(name.split()[1][1:]) if name.startswith("qmm_codes") else None
                assert rc == (1 if t is not None and t not in CODES_TYPES else 0), (run, name)
            elif not (name.startswith("qmm_codes") and name.endswith(" m")):
                assert len(b) and any(b), (run, name)  # something written
    counts = [struct.unpack("<q", b)[0] for n, b in runs["neon"]
              if n.startswith("head_candidates") and len(b) == 8]
    assert counts and all(0 < c < 300 for c in counts)  # the floor cuts some, keeps some


def test_neon_outputs_equal_the_generic_builds(runs):
    """Bit for bit, every output, but attention's (the stored K/V rows compared bitwise too):
    the neon path sums each q.k in two 4-lane partial sums added across lanes (decode_attn.c's
    attend_neon), the plain C in another order, so the f32 scores, and the partials after
    them, differ in the last bits, and a bf16 output can round either side of a boundary: one
    unit in the last place in a few places (3 of 15,744 values at most in this harness; with
    bf16 K/V and no sinks none, by chance), so attention's outputs are compared within one
    unit in the last place in fewer than 0.1% of the values."""
    neon, generic = runs["neon"], runs["generic"]
    assert [n for n, _ in neon] == [n for n, _ in generic]
    loose = 0
    for (name, a), (_, b) in zip(neon, generic, strict=True):
        if re.match(r"attn_(causal|step) t", name) and not name.endswith(" rc"):
            x, y = (np.frombuffer(v, np.uint16).astype(np.int32) for v in (a, b))
            diff = np.abs(x - y)
            assert diff.max() <= 1 and (diff > 0).mean() < 1e-3, f"{name} differs"
            loose += 1
        else:
            assert a == b, f"{name} differs"
    assert loose == 18  # 3 cache types x 2 group sizes x (2 causal windows, the second with
    # sinks, + 1 step with sinks)


def test_neon_outputs_do_not_depend_on_the_thread_count(runs):
    assert runs["neon 1 thread"] == runs["neon"] == runs["neon 3 threads"]
