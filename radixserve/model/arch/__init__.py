"""The model families, one module each, registered by the GGUF `general.architecture` names
they read. A module in this package that exports `FAMILIES` (a list of `Family` objects) is
found by scanning the package: adding a family is adding its file (docs/ARCHITECTURE.md, "Adding
a model family").
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

import gguf

from radixserve.memory.layout import MemoryLayout
from radixserve.model.arch.base import Family
from radixserve.model.hparams import HParams, UnsupportedModelError, field_value


@functools.cache
def registry() -> dict[str, Family]:
    """{architecture name: family}, from every module of this package that exports FAMILIES."""
    out: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for fam in getattr(module, "FAMILIES", ()):
            for arch in fam.archs:
                if arch in out:
                    raise RuntimeError(f"architecture {arch!r} is registered twice "
                                       f"({type(out[arch]).__name__}, {type(fam).__name__})")
                out[arch] = fam
    return out


# architectures known and not served yet, with why (one line at start-up, as any refusal)
NOT_YET = {
    "qwen3next": "Qwen3-Next (a mixture-of-experts Gated DeltaNet with a shared expert) is not "
                 "supported yet",
}


def family_of(arch: object) -> Family:
    """The family that serves `arch`, or UnsupportedModelError listing the registry."""
    fams = registry()
    if isinstance(arch, str) and arch in NOT_YET:
        raise UnsupportedModelError(f"model architecture {arch!r}: {NOT_YET[arch]}")
    if not isinstance(arch, str) or arch not in fams:
        raise UnsupportedModelError(f"unsupported model architecture {arch!r} "
                                    f"(supported: {', '.join(sorted(fams))})")
    return fams[arch]


def read_hparams(reader: gguf.GGUFReader) -> HParams:
    """The GGUF's hyperparameters as its family reads them."""
    arch = field_value(reader, "general.architecture")
    return family_of(arch).hparams(reader, arch)


def memory_layout(hp: HParams) -> MemoryLayout:
    """What the model's sequences need kept, as its family declares it."""
    return family_of(hp.arch).memory_layout(hp)
