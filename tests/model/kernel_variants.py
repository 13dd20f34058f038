"""Every x86 variant of our C kernels (model/kernel_build.py's VARIANTS), for the tests that check
the kernels: this project's machines run all five (AVX512-BF16 and AVX-VNNI), so a variant this
CPU cannot run fails the test that asks for it, naming the missing flags; it never skips. The
aarch64 variant (neon) is built and run under qemu-user by tests/model/test_neon.py. And what
the tests of products through 8-bit activations (csrc/i8act.c's tiles) compare with:
act8_tolerance, the error those activations may cost."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from radixserve.model import kernel_build as B
from radixserve.model import kernels as K
from radixserve.model.kernel_build import ENV
from radixserve.model.kernel_config import KernelConfig

VARIANTS = ["avx512bf16", "avx512", "avxvnni", "avx2", "generic"]
# (has_bf16_gemm, has_int8_head) of each variant's build: the bf16 matmul needs AVX512-BF16;
# the head's int8 pass runs in every build (VNNI, AVX2 or plain C), as do the 4- and 8-bit
# tiles (csrc/i8act.c, no flag: every build has them)
HAS = {"avx512bf16": (True, True), "avx512": (False, True), "avxvnni": (False, True),
       "avx2": (False, True), "generic": (False, True)}


def config_for(variant: str) -> KernelConfig:
    """The configuration RADIXSERVE_KERNELS=<variant> settles (this process's environment
    otherwise: the suite's check mode, its compiler and cache); "0" for none."""
    return KernelConfig.from_env({**os.environ, ENV: variant})


NO_KERNELS = config_for("0")  # RADIXSERVE_KERNELS=0: torch's ops


def default_kernels() -> K.Kernels | None:
    """The kernels this process's environment settles (as a server started with it runs):
    what the tests hand the holders they build when no variant is under test."""
    return KernelConfig.from_env().load()


def variant_kernels(variant: str) -> K.Kernels:
    """`variant`'s kernels (config_for(variant).load(): built once per process, the environment
    untouched), which must run here and build."""
    missing = B.missing_flags(variant, B.cpu_flags())
    assert not missing, (f"this CPU cannot run the {variant} kernels: it lacks "
                         f"{' '.join(missing)}")
    kern = config_for(variant).load()
    assert kern is not None, f"the {variant} kernels did not build (is a C compiler installed?)"
    assert kern.variant == variant and kern.build_key.startswith(variant + "-")
    assert (kern.has_bf16_gemm, kern.has_int8_head) == HAS[variant], variant
    return kern


@pytest.fixture(params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> str:
    """Runs the test once per variant (its name; variant_kernels gives the kernels the test
    hands what it builds, as the loader does with RADIXSERVE_KERNELS=<variant>)."""
    assert config_for(request.param).load() is variant_kernels(request.param)
    return request.param


@pytest.fixture(scope="module", params=VARIANTS)
def kern(request: pytest.FixtureRequest) -> K.Kernels:
    """Each variant's kernels in turn (variant_kernels: the environment untouched)."""
    return variant_kernels(request.param)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """Runs the test on 1 and on 2 threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def act8_tolerance(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x W^T in f64, what a product through 8-bit activations may differ from it by) for bf16
    rows x [rows, k] and weights w [n, k], a bound that holds for any input: csrc/i8act.c
    quantizes each row's half group of 16 to d a with d = amax / 127 and a = rint(x / d), so an
    activation moves by at most d / 2 = amax / 254, within its group of 32's amax / 254 (1.01:
    the f32 roundings of d and 1 / d), and an output by that times the group's |w| summed over
    the groups; then the bf16 output
    rounding (2^-8 of the value) and the f32 steps (the integer sums are exact; at most 6
    roundings a group, each within 2^-24 of the products' magnitudes: outputs near 0). A weight
    in the wrong lane, or the wrong group's scale, errs by the size of the weights themselves,
    far beyond it (the tests that use it show so)."""
    rows, k = x.shape
    xd, wd = x.double(), w.double()
    amax = xd.abs().view(rows, k // 32, 32).amax(-1)
    ref = xd @ wd.T
    quant = (amax * (1.01 / 254)).repeat_interleave(32, 1) @ wd.abs().T
    f32 = (xd.abs() @ wd.abs().T) * ((6 * (k // 32) + 2) * 1.01 * 2.0**-24)
    return ref, quant + ref.abs() * 2.0**-8 + f32


def permuted_lanes(w: torch.Tensor) -> torch.Tensor:
    """w [n, k] with each 8 weights of a row in the tiles' stored order (0 4 1 5 2 6 3 7,
    quant.PERM): a layout slip that must fail act8_tolerance."""
    n, k = w.shape
    return w.view(n, k // 8, 8)[..., [0, 4, 1, 5, 2, 6, 3, 7]].reshape(n, k)
