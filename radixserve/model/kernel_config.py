"""Which of our kernels a process runs, settled once at start-up: `KernelConfig`.

Why a settled object rather than a global read where the kernels are used: the choice comes
from the environment (RADIXSERVE_KERNELS, RADIXSERVE_KERNEL_CHECKS, CC, XDG_CACHE_HOME), and
reading it deep in the loader made every module below the entry points depend on it and tests
patch it. The entry points (cli.py: serve, perf, generate, cluster) settle it with
`KernelConfig.from_env`, which is also where a bad value stops start-up (KernelsError), and
hand it to `load_model`; the loader turns it into the `Kernels` object (or None: torch's ops)
that the weights, the head and the Transformer are given. This module is the only one that
reads those variables.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from radixserve.model.kernel_build import ENV, VARIANTS, KernelsError, select_variant
from radixserve.model.kernels import Kernels, load_kernels

log = logging.getLogger(__name__)

CHECKS_ENV = "RADIXSERVE_KERNEL_CHECKS"


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """The kernels a process runs. `variant`: the build (kernel_build.VARIANTS) that
    RADIXSERVE_KERNELS selects, None for 0 (torch's ops); `forced`: the value named that
    variant (not auto), so a build that fails is an error rather than torch's ops; `checks`:
    RADIXSERVE_KERNEL_CHECKS=1, every index a kernel reads through range-checked before the
    call; `cc`: the C compiler ($CC, else cc or gcc on PATH; None: none found); `cache_dir`: the
    directory the builds are cached in ($XDG_CACHE_HOME or ~/.cache, then radixserve/kernels)."""

    variant: str | None
    forced: bool
    checks: bool
    cc: str | None
    cache_dir: Path

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelConfig:
        """The configuration `environ` (default: this process's environment) describes. Raises
        KernelsError for a RADIXSERVE_KERNELS that names no variant or one this CPU cannot
        run."""
        env = os.environ if environ is None else environ
        raw = env.get(ENV)
        variant = select_variant(raw)
        forced = variant is not None and (raw or "auto").strip().lower() not in ("auto", "1")
        cc = env.get("CC") or shutil.which("cc") or shutil.which("gcc")
        base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return cls(variant, forced, env.get(CHECKS_ENV, "") == "1", cc,
                   Path(base) / "radixserve" / "kernels")

    def load(self) -> Kernels | None:
        """The kernels this configuration selects, built (or taken from the cache) and loaded
        once per process; None for RADIXSERVE_KERNELS=0 or, under auto, no compiler or a failed
        build. Raises KernelsError when a forced variant did not build."""
        return _load(self)


@functools.cache  # one log line a configuration, as the process settles it once
def _load(cfg: KernelConfig) -> Kernels | None:
    if cfg.variant is None:
        log.info("kernels: none (%s=0: torch ops)", ENV)
        return None
    kern = load_kernels(cfg.variant, cfg.cc, cfg.cache_dir, cfg.checks)
    if kern is None:
        if cfg.forced:
            raise KernelsError(f"{ENV}={cfg.variant}: the {cfg.variant} kernels did not build "
                               f"(see the warning above); unset {ENV} or set it to 0 for "
                               f"torch's ops")
        log.info("kernels: none (no build: torch ops)")
        return None
    log.info("kernels: %s (%s)", cfg.variant, VARIANTS[cfg.variant].what)
    return kern
