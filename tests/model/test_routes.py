"""The route table (model/kernel_routes.py): every row is what the loader builds, every route is
reached, and each route's matrix multiplies as gguf-py's dequantized weights do, on one row
(decode) and on many (prefill), in every kernel build and without kernels."""

from __future__ import annotations

import re

from collections.abc import Iterator
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from radixserve.model import kernel_routes
from radixserve.model.kernel_build import ENV
from radixserve.model.kernel_routes import BUILDS, FALLBACK, KINDS, ROUTES, TABLE, route_for
from radixserve.model.tensors import TensorLoader
from tests.model.kernel_variants import config_for, variant_kernels

Q = gguf.GGMLQuantizationType
# one type of each kind: a 4-bit one, an 8-bit one, MXFP4, a float one, one no kernel of ours
# reads
KIND_TYPE = {"4-bit": Q.Q4_K, "5-8-bit": Q.Q6_K, "mxfp4": Q.MXFP4, "float": Q.F16,
             "other": Q.Q3_K}
KDIM = 512


def tensor(qtype: Q, n: int, seed: int) -> SimpleNamespace:
    """A matrix [n, KDIM] of `qtype` as the GGUF reader gives it: random blocks whose scales
    (the leading f16s; Q6_K's and Q3_K's d at the end) keep weights small."""
    rng = np.random.default_rng(seed)
    if qtype in (Q.F16,):
        data = (rng.standard_normal((n, KDIM)) * 0.05).astype(np.float16)
        return SimpleNamespace(name="w", tensor_type=qtype, shape=np.array([KDIM, n]),
                               data=data)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, KDIM // block, size), dtype=np.uint8)
    d = rng.uniform(0.001, 0.01, size=(n, KDIM // block, 2)).astype(np.float16).view(np.uint8)
    if qtype in (Q.Q6_K, Q.Q3_K):
        raw[..., size - 2:] = d[..., :2]
    elif qtype == Q.MXFP4:  # the E8M0 exponent: 2^(e - 128), about the others' scales
        raw[..., 0] = rng.integers(118, 122, size=(n, KDIM // block))
    else:
        raw[..., :4] = d.reshape(n, KDIM // block, 4)
    return SimpleNamespace(name="w", tensor_type=qtype, shape=np.array([KDIM, n]),
                           data=raw.reshape(n, -1))


# neon runs on aarch64 only: its routes are qmm's, which tests/model/test_neon.py runs for every
# type under qemu-user against the generic build's
@pytest.fixture(params=[b for b in BUILDS if b != "neon"])
def build(request: pytest.FixtureRequest) -> Iterator[str]:
    """A build of the table (kernels_of gives its kernels, as RADIXSERVE_KERNELS=<build> does;
    "none": 0, no kernels)."""
    if request.param != "none":
        variant_kernels(request.param)
    yield request.param


def kernels_of(build: str):
    """The kernels RADIXSERVE_KERNELS=<build> settles ("none": 0, None)."""
    return config_for("0" if build == "none" else build).load()


def test_every_build_and_kind_has_a_route_and_every_route_is_reached():
    """Every route is the table's, a fallback's, or (file-rows) where --load-mode maps expert
    tensors (its products: tests/model/test_moe.py, test_i8act.py)."""
    assert set(TABLE) == {(b, k) for b in BUILDS for k in KINDS}
    reached = set(TABLE.values()) | {to for to, _ in FALLBACK.values()} | {"file-rows"}
    assert reached == set(ROUTES), f"routes nothing reaches: {set(ROUTES) - reached}"
    text = kernel_routes.table_text()
    assert all(name in text for name in ROUTES)


def experts_tensor(qtype: Q, name: str, n_expert: int, rows: int, seed: int) -> gguf.ReaderTensor:
    """A 3-D expert tensor [n_expert, rows, KDIM] of `qtype` (tensor()'s random blocks)."""
    t = tensor(qtype, n_expert * rows, seed)
    data = t.data.reshape(n_expert, rows, -1)
    return gguf.ReaderTensor(name=name, tensor_type=qtype,
                             shape=np.array([KDIM, rows, n_expert], np.uint64),
                             n_elements=n_expert * rows * KDIM, n_bytes=data.nbytes,
                             data_offset=0, data=data, field=None)


@pytest.mark.parametrize("variant", ["avx512bf16", "avx2", "generic"])
def test_mapped_expert_tensors_are_views_with_the_copys_bits(variant: str):
    """--load-mode mmap: a fused gate and up (two tensors) of Q8_0, MXFP4, Q4_K and Q6_K are
    each expert's rows of the file's arrays (no copy: they share its memory), and each expert's
    products equal bit for bit those of its copy in the tiles (--load-mode none); a Q5_K expert
    tensor is copied into the 8-bit tiles either way."""
    kern = kernels_of(variant)
    x = (torch.randn(9, KDIM, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    tiles = {Q.Q8_0: "i8-tiles", Q.MXFP4: "mxfp4-tiles", Q.Q4_K: "q4-tiles", Q.Q6_K: "i8-tiles",
             Q.Q5_K: "i8-tiles"}
    for qtype, copied in tiles.items():
        ts = [experts_tensor(qtype, n, 3, 32, seed) for seed, n in enumerate(("g", "u"))]
        reader = SimpleNamespace(tensors=ts)
        got = {mode: TensorLoader(reader, torch.bfloat16, True, kern, mode).experts(
            ["g", "u"], 3, (32, KDIM)) for mode in ("mmap", "none")}
        mapped = qtype != Q.Q5_K
        for e in range(3):
            m, c = got["mmap"][e], got["none"][e]
            assert c.route == copied and m.route == ("file-rows" if mapped else copied)
            assert torch.equal(m(x, True), c(x, True)), (qtype, e)
            if mapped:
                assert all(np.shares_memory(p, t.data) for p, t in zip(m.mat.parts, ts))


def test_which_loads_map_expert_tensors():
    """auto maps Q8_0 and MXFP4 on the builds whose gather of the file's rows keeps up with
    their tiles (not AVX2's, measured slower at one row), mmap (and mmap+mlock) every
    file-row type (Q4_K and Q6_K too) on every build of our kernels, none / dio / mlock never,
    nothing without our kernels, and no other type."""
    gather = {"avx512bf16", "avx512", "avxvnni"}
    for build in BUILDS:
        ours = build != "none"
        for qtype in (Q.Q8_0, Q.MXFP4, Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q4_0, Q.F16):
            mappable = qtype in (Q.Q8_0, Q.MXFP4, Q.Q4_K, Q.Q6_K)
            auto = build in gather and qtype in (Q.Q8_0, Q.MXFP4)
            assert kernel_routes.maps_experts("auto", build, qtype) == auto
            for mode in ("mmap", "mmap+mlock"):
                assert kernel_routes.maps_experts(mode, build, qtype) == (ours and mappable)
            for mode in ("none", "dio", "mlock"):
                assert not kernel_routes.maps_experts(mode, build, qtype)
    assert set(kernel_routes.LOAD_MODES) == {"auto", "none", "mmap", "mlock", "mmap+mlock", "dio"}


@pytest.mark.parametrize("n_rows", [32, 40], ids=["tiled-rows", "odd-rows"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_loader_builds_the_tables_route_and_it_multiplies_the_files_weights(
        build: str, kind: str, n_rows: int):
    qtype = KIND_TYPE[kind]
    t = tensor(qtype, n_rows, seed=int(qtype) + n_rows)
    ld = TensorLoader(SimpleNamespace(tensors=[t]), torch.bfloat16, packed=True,
                      kern=kernels_of(build))
    assert ld.build == build
    lin = ld.linear(["w"], [None])
    want = route_for(build, qtype, n_rows)
    assert lin.route == want, f"{build} {qtype.name}: built {lin.route}, table says {want}"
    if n_rows % 16:
        assert want not in ("q4-tiles", "i8-tiles", "mxfp4-tiles", "torch-int4")
    w = torch.from_numpy(np.asarray(gguf.quants.dequantize(t.data, qtype), np.float32)
                         .reshape(n_rows, KDIM))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(130, KDIM, generator=g).to(torch.bfloat16)
    ref = x.double() @ w.double().T
    scale = (x.double().abs() @ w.double().abs().T)
    many = lin(x).double()  # a prefill chunk
    few = torch.cat([lin(x[i:i + 1]) for i in range(0, 130, 13)]).double()  # decode rows
    # bf16 output rounding plus the route's own (bf16 weights or activations): 2^-7 relative
    # to the sum of magnitudes
    for got, rows in ((many, slice(None)), (few, slice(0, 130, 13))):
        err = (got - ref[rows]).abs()
        assert (err <= scale[rows] * 2.0**-7 + 1e-6).all(), (
            f"{lin.route}: worst error {(err / (scale[rows] + 1e-12)).max():.2e} of the scale")


def test_a_float_row_outside_qmms_groups_runs_dense(build: str):
    """qmm.c reads whole groups of 32: an F16 matrix whose rows are 48 weights long (the
    converter's F16 fallback for a Q8_0 row that does not divide) takes the build's dense
    route, and multiplies as its weights."""
    rng = np.random.default_rng(5)
    a = (rng.standard_normal((32, 48)) * 0.05).astype(np.float16)
    t = SimpleNamespace(name="w", tensor_type=Q.F16, shape=np.array([48, 32]), data=a)
    lin = TensorLoader(SimpleNamespace(tensors=[t]), torch.bfloat16, packed=True,
                       kern=kernels_of(build)).linear(["w"], [None])
    assert lin.route == TABLE[build, "other"]
    x = torch.randn(5, 48).to(torch.bfloat16)
    ref = x.double() @ torch.from_numpy(a).double().T
    assert (lin(x).double() - ref).abs().max() <= 2.0**-7 * ref.abs().max() + 1e-3


def test_dequant_weights_run_every_type_dense(build: str):
    t = tensor(Q.Q4_K, 32, seed=1)
    lin = TensorLoader(SimpleNamespace(tensors=[t]), torch.bfloat16, packed=False,
                       kern=kernels_of(build)).linear(["w"], [None])
    assert lin.route == ("bf16-panels" if build == "avx512bf16" else "torch-dense")


def test_perf_routes_prints_the_table_and_the_models_routes(tiny_path, capsys, monkeypatch):
    """`radixserve perf --routes`: this build's rows of the table, then each layer matrix's
    route as the loaded model took it, with the bytes it holds beside the file's (the tiny
    model's Q4_1 q/k/gate, Q8_0 v/o/up and f32 down on the avx2 build: the tiles and the file's
    blocks)."""
    from radixserve.cli import main

    monkeypatch.setenv(ENV, "avx2")  # the command settles its kernels from the environment
    assert main(["perf", "--routes", "-m", tiny_path]) == 0
    out = capsys.readouterr().out
    assert out.startswith("kernel build: avx2")
    assert "avx2        Q4_0 Q4_1 Q4_K" in out and "q4-tiles" in out
    assert "avx512bf16" not in out  # only this build's rows
    # q/k (Q4_1) and v (Q8_0) are two runs, 4- and 8-bit tiles; down is f32 in the file's blocks
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  w")}
    assert " q4-tiles+i8-tiles x2 " in lines["wqkv"] and " qmm-f32 x2 " in lines["w_down"]
    # f32 in its blocks holds the file's bytes; Q4_1's tiles 0.625 bytes a weight (the file's)
    assert re.search(r"held ([\d.]+) MiB, file \1 MiB", lines["w_down"])


def test_a_bias_follows_its_rows_when_they_are_reordered():
    """llama's Q/K rows are stored permuted (the converter permutes q/k biases alike): the
    loader un-permutes a bias with its rows, so the linear is the file's W x + b in the
    un-permuted order (and a row order given as an array moves the bias too)."""
    from radixserve.model.tensors import _order

    n_head, n = 4, 32
    t = tensor(Q.F16, n, seed=2)
    w = t.data.astype(np.float32)
    b = np.arange(n, dtype=np.float32) / 8
    x = torch.randn(3, KDIM)
    for heads in (n_head, np.arange(n)[::-1].copy()):
        lin = TensorLoader(SimpleNamespace(tensors=[t]), torch.float32, packed=False,
                           kern=None).linear(["w"], [heads], [b])
        order = _order(n, heads)
        want = (x @ torch.from_numpy(w).T + torch.from_numpy(b))[:, order]
        assert torch.allclose(lin(x, False), want, atol=1e-5), heads
