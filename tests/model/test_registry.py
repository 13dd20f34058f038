"""The family registry (model/arch/): every family is found by the architecture names it reads,
an unknown architecture is refused in one line listing them, and no family is registered
without its reference test against HF transformers and a synthetic GGUF of a real shape for
benchmarks."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from radixserve.bench.synth_model import SHAPES
from radixserve.model.arch import family_of, registry
from radixserve.model.arch.base import Family
from radixserve.model.hparams import UnsupportedModelError

TESTS = Path(__file__).parent


def family_references() -> dict[str, list[str]]:
    """{architecture: the tests marked family_reference for it}, read from tests/model/'s modules."""
    out: dict[str, list[str]] = {}
    for path in sorted(TESTS.glob("test_*.py")):
        if "family_reference" not in path.read_text():
            continue
        module = importlib.import_module(f"tests.model.{path.stem}")
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            for mark in getattr(fn, "pytestmark", []):
                if mark.name == "family_reference":
                    for arch in mark.args:
                        out.setdefault(arch, []).append(f"{path.name}::{name}")
    return out


def test_the_registry_holds_every_family_once() -> None:
    fams = registry()
    assert set(fams) == {"llama", "qwen2", "qwen3", "gemma3", "lfm2", "qwen35", "granitehybrid",
                         "qwen3moe", "lfm2moe", "gpt-oss", "qwen35moe"}
    for arch, fam in fams.items():
        assert isinstance(fam, Family) and arch in fam.archs
        assert family_of(arch) is fam


def test_every_family_has_a_transformers_reference_test() -> None:
    refs = family_references()
    missing = sorted(set(registry()) - set(refs))
    assert missing == [], f"families without a test marked family_reference: {missing}"
    # the reader finds the marks it should (so the check above can fail)
    assert "test_lfm2.py::test_tiny_lfm2_matches_hf" in refs["lfm2"]
    assert "test_forward.py::test_tiny_architectures_match_hf" in refs["qwen2"]


def test_every_family_has_a_synthetic_gguf_shape() -> None:
    archs = {s.arch for s in SHAPES.values()}
    missing = sorted(set(registry()) - archs)
    assert missing == [], f"families without a bench/synth_model.py shape: {missing}"


@pytest.mark.parametrize("arch", ["deepseek2", "mamba2", None, 3])
def test_an_unknown_architecture_is_refused_in_one_line_naming_the_registry(arch) -> None:
    with pytest.raises(UnsupportedModelError) as e:
        family_of(arch)
    msg = str(e.value)
    assert "\n" not in msg and f"unsupported model architecture {arch!r}" in msg
    assert all(a in msg for a in registry())


def renamed(src: str, dst: Path, arch: str) -> str:
    """A copy of GGUF `src` whose architecture (and its keys' prefix) is `arch`."""
    r = gguf.GGUFReader(src)
    old = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name.replace(f"{old}.", f"{arch}.", 1), f.contents(), f.types[0],
                        sub_type=sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(dst)


def test_optional_qk_norms_are_used_wherever_a_file_has_them(tiny_paths: dict[str, str],
                                                            tmp_path: Path) -> None:
    """qwen2 is qwen3 less the q/k norms that qwen3 requires: a qwen3 file read as qwen2 loads
    its norms all the same, so it computes qwen3's logits to the bit (and a family never drops
    a tensor of the file silently)."""
    from tests.conftest import make_transformer
    from tests.model.test_forward import PROMPTS, our_logits

    as_qwen2 = make_transformer(renamed(tiny_paths["qwen3"], tmp_path / "q.gguf", "qwen2"))
    assert as_qwen2.hp.arch == "qwen2"
    assert all(layer.mixer.q_norm is not None and layer.mixer.k_norm is not None
               for layer in as_qwen2.w.layers)
    want = our_logits(make_transformer(tiny_paths["qwen3"]), PROMPTS[1])
    assert torch.equal(our_logits(as_qwen2, PROMPTS[1]), want)
