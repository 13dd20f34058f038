"""model/cabi.py: the one table of the kernels' C entry points. Every function csrc/*.c exports
is in it with the argument types its prototype declares, and nothing else is; a buffer of the
wrong size, type or layout is refused before C sees it."""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from radixserve.model import cabi
from radixserve.model import kernel_build as B
from tests.model.kernel_variants import default_kernels

# C parameter or return type -> the ctypes type the table must give it
_SCALARS = {"int": cabi.I32, "int64_t": cabi.I64, "float": cabi.F32, "void": None}
_DEF = re.compile(r"^(int|int64_t|void|float)\s+(\w+)\(([^)]*)\)\s*\{", re.M)


def _prototypes() -> dict[str, tuple[object, list[object]]]:
    """Every non-static function defined in csrc/*.c: name -> (return type, argument types),
    pointers as "pointer"; a function defined twice (#if / #else builds) must agree."""
    found: dict[str, tuple[object, list[object]]] = {}
    for src in sorted(B._CSRC.glob("*.c")):
        for ret, name, params in _DEF.findall(src.read_text()):
            args: list[object] = []
            for p in " ".join(params.split()).split(","):
                p = p.strip()
                if p in ("void", ""):
                    continue
                args.append("pointer" if "*" in p else _SCALARS[p.rsplit(" ", 1)[0]])
            sig = (_SCALARS[ret], args)
            assert found.setdefault(name, sig) == sig, f"{src.name}: {name} defined twice unlike"
    return found


def test_the_table_is_every_exported_function_with_its_prototypes_types():
    protos = _prototypes()
    assert len(protos) > 20  # the parser found the files' functions
    assert set(cabi.SIGNATURES) == set(protos), (
        f"in C only: {set(protos) - set(cabi.SIGNATURES)}; "
        f"in the table only: {set(cabi.SIGNATURES) - set(protos)}")
    for name, (ret, args) in cabi.SIGNATURES.items():
        want_ret, want_args = protos[name]
        assert ret is want_ret, name
        assert len(args) == len(want_args), f"{name}: {len(args)} arguments, C has {len(want_args)}"
        for i, (got, want) in enumerate(zip(args, want_args, strict=True)):
            if want == "pointer":
                assert got is cabi.P or issubclass(got, ctypes._Pointer), (name, i)
            else:
                assert got is want, (name, i, got, want)


def test_bind_sets_each_signature_once_per_library():
    lib = default_kernels().lib
    c = cabi.bind(lib)
    assert cabi.bind(lib) is c
    assert c.qmm_bf16.argtypes == cabi.SIGNATURES["qmm_bf16"][1]
    assert c.attn_work_floats.restype is cabi.I64


def test_a_buffer_is_checked_before_c_sees_it():
    t = torch.zeros(4, 8)
    assert cabi.buf(t, torch.float32, 32, "x") == t.data_ptr()
    assert cabi.buf(None, torch.float32, 32, "x") is None
    assert cabi.buf(t, torch.float32, 16, "x", at_least=True) == t.data_ptr()
    with pytest.raises(ValueError, match="rows: C needs contiguous torch.float32 of 33"):
        cabi.buf(t, torch.float32, 33, "rows")
    with pytest.raises(ValueError, match="of >= 40 elements"):
        cabi.buf(t, torch.float32, 40, "x", at_least=True)
    with pytest.raises(ValueError, match="torch.int32"):
        cabi.buf(t, torch.int32, 32, "x")
    with pytest.raises(ValueError, match="not contiguous"):
        cabi.buf(t.t(), torch.float32, 32, "x")
