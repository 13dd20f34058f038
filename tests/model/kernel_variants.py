"""Every x86 variant of our C kernels (model/kernels.py's VARIANTS), for the tests that check
the kernels: this project's machines run all four (AVX512-BF16), so a variant this CPU cannot
run fails the test that asks for it, naming the missing flags; it never skips. The aarch64
variant (neon) is built and run under qemu-user by tests/model/test_neon.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from radixserve.model import kernels as K

VARIANTS = ["avx512bf16", "avx512", "avx2", "generic"]
# (has_q4, has_bf16_gemm, has_int8_head) of each variant's build: the 4-bit and bf16 matmuls
# need AVX512-BF16; the head's int8 pass runs in every build (VNNI, AVX2 or plain C)
HAS = {"avx512bf16": (True, True, True), "avx512": (False, False, True),
       "avx2": (False, False, True), "generic": (False, False, True)}


def variant_kernels(variant: str) -> K.Kernels:
    """`variant`'s kernels (load_kernels: built once per process, the environment untouched),
    which must run here and build."""
    missing = K.missing_flags(variant, K.cpu_flags())
    assert not missing, (f"this CPU cannot run the {variant} kernels: it lacks "
                         f"{' '.join(missing)}")
    kern = K.load_kernels(variant)
    assert kern is not None, f"the {variant} kernels did not build (is a C compiler installed?)"
    assert kern.variant == variant and kern.build_key.startswith(variant + "-")
    assert (kern.has_q4, kern.has_bf16_gemm, kern.has_int8_head) == HAS[variant], variant
    return kern


@pytest.fixture(params=VARIANTS)
def variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Runs the test once per variant with kernels() (what quant.py, head.py and forward.py
    call) returning that variant's kernels, as RADIXSERVE_KERNELS=<variant> does."""
    variant_kernels(request.param)
    monkeypatch.setenv(K.ENV, request.param)
    K.kernels.cache_clear()
    assert K.kernels() is K.load_kernels(request.param)
    yield request.param
    K.kernels.cache_clear()  # before monkeypatch restores the environment


@pytest.fixture(scope="module", params=VARIANTS)
def kern(request: pytest.FixtureRequest) -> K.Kernels:
    """Each variant's kernels in turn (load_kernels: the environment untouched)."""
    return variant_kernels(request.param)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """Runs the test on 1 and on 2 threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
