"""Load a GGUF file into a ready-to-run model: hyper-parameters, weights, tokenizer, template."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass

import torch

from radixserve.memory.layout import MemoryLayout
from radixserve.model.default_model import resolve_model_path
from radixserve.model.device import DeviceError, device_name, resolve_device
from radixserve.model.forward import Transformer
from radixserve.model.gguf_check import read_gguf
from radixserve.model.arch import read_hparams
from radixserve.model.hparams import HParams, UnsupportedModelError
from radixserve.model.kernel_config import KernelConfig
from radixserve.model.kernels import Kernels
from radixserve.model.arch import memory_layout
from radixserve.model.rope import Rope
from radixserve.model.weights import load_weights, place
from radixserve.text.chat_template import ChatTemplate
from radixserve.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
WEIGHT_MODES = ("auto", "native", "dequant")  # what `resolve_weights` takes (--weights)
DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def weights_digest(path: str, cache_dir: str | None = None) -> bytes:
    """A digest of every byte of the GGUF file (~1 s a GB). With `cache_dir`, it is kept there
    under the file's path, size, mtime and inode, so a restart on an unchanged file reads it
    back instead of hashing again."""
    st = os.stat(path)
    memo = None
    if cache_dir is not None:
        stamp = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
        name = hashlib.blake2b(stamp.encode(), digest_size=16).hexdigest()
        memo = os.path.join(cache_dir, f"weights-{name}.digest")
        try:
            with open(memo) as f:
                return bytes.fromhex(f.read().strip())
        except (OSError, ValueError):
            pass
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    if memo is not None:
        # owner-only, as every file under a cache directory: the memo names a model file
        tmp = f"{memo}.{os.getpid()}.tmp"
        try:
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                f.write(h.hexdigest())
            os.replace(tmp, memo)
        except OSError:
            pass
    return h.digest()


def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls are only fast with AVX512-BF16 or AMX; elsewhere they are emulated."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device, kern: Kernels | None = None) -> torch.dtype:
    """The compute dtype `name` (auto, f32, bf16, f16) means on `device` with our kernels
    `kern` (None: none)."""
    if name in _DTYPES:
        return _DTYPES[name]
    if name != "auto":
        raise ValueError(f"unknown dtype {name!r} (auto, f32, bf16, f16)")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # our kernels (any variant) take bf16 activations and never run torch's emulated bf16
    # matmuls, so a CPU without AVX512-BF16 computes in bf16 too when they built
    return torch.bfloat16 if cpu_has_fast_bf16() or kern is not None else torch.float32


@dataclass(slots=True)
class Model:
    path: str
    hp: HParams
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    transformer: Transformer
    dtype: torch.dtype
    device: torch.device
    load_s: float
    weights: str  # "native" (4-bit blocks packed) or "dequant" (every weight dense)

    @property
    def deterministic(self) -> bool:
        return self.transformer.deterministic

    @property
    def rope(self) -> Rope:
        return self.transformer.rope

    @property
    def rope_swa(self) -> Rope:
        """The sliding layers' RoPE (their own base): what re-rotates their cache on a K-shift;
        the same object as `rope` for models without sliding layers."""
        return self.transformer.rope_swa

    @property
    def layout(self) -> MemoryLayout:
        """What its sequences need kept (memory/layout.py): every pool is built from it."""
        return memory_layout(self.hp)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def identity(self, cache_dir: str | None = None) -> bytes:
        """What the KV this model computes depends on: the GGUF's bytes, the hyper-parameters as
        loaded (overrides included), the compute dtype, the weight path and the code computing
        it, which sets the KV's last bits: our kernels' build (Kernels.build_key: its variant,
        sources, compiler and flags), torch's version, the vector width its CPU ops run at and
        the device (a GPU's name: its kernels round otherwise).
        The disk cache keys its files by it, so machines or installs that differ there never
        share them."""
        tr = self.transformer
        kern = tr.kern.build_key if tr.kern is not None else None
        desc = repr((self.hp, str(self.dtype), self.weights, self.deterministic, kern,
                     tr.own_attention, str(torch.__version__),
                     torch.backends.cpu.get_cpu_capability(), device_name(self.device)))
        digest = weights_digest(self.path, cache_dir)
        return hashlib.blake2b(digest + desc.encode(), digest_size=16).digest()


def resolve_weights(name: str, dtype: torch.dtype,
                    device: torch.device = torch.device("cpu")) -> str:
    """`auto`: packed 4-bit blocks with bf16/f16 compute; f32 compute dequantizes, because our
    Q4 kernel takes bf16 activations only and torch's int4 f32 path is ~10x slower than a dense
    f32 matmul (exact, though: tests use it). Off the CPU every weight is dense: the packed
    layouts are our CPU kernels' (and torch's CPU int4 op's)."""
    if name not in WEIGHT_MODES:
        raise ValueError(f"unknown weights mode {name!r} ({', '.join(WEIGHT_MODES)})")
    if device.type != "cpu":
        if name == "native":
            raise DeviceError(f"--weights native packs 4-bit blocks for the CPU kernels; on "
                              f"{device} the weights are dense (--weights dequant or auto)")
        return "dequant"
    if name == "auto":
        return "dequant" if dtype == torch.float32 else "native"
    return name


def load_model(path: str | None = "default", dtype: str = "auto", device: str = "cpu",
               weights: str = "auto", deterministic: str = "auto",
               gpu_layers: str = "auto", kernels: KernelConfig | None = None,
               load_mode: str = "auto") -> Model:
    """`device` and `gpu_layers` as --device and -ngl take them (model/device.py): a model
    off the CPU is built without our kernels (torch's ops, as RADIXSERVE_KERNELS=0 runs it on
    the CPU), dense, then moved there whole. `kernels`: the kernels settled at start-up
    (cli.py); None settles them from the environment now, for library callers and tests.
    `load_mode`: --load-mode (kernel_routes.maps_experts: expert tensors mapped or copied)."""
    t0 = time.perf_counter()
    path = resolve_model_path(path)
    reader = read_gguf(path)  # its structure checked (naming a malformed tensor) first
    hp = read_hparams(reader)
    dev = resolve_device(device, gpu_layers, hp.n_layer)
    if hp.moe is not None and dev.type != "cpu":
        raise UnsupportedModelError(f"{hp.arch}: mixture-of-experts models run on the CPU only "
                                    f"(their experts are this engine's packed matrices); "
                                    f"--device {dev} is not supported for them")
    # our kernels read CPU memory only: a model for another device is built on torch's ops
    # (every choice made while loading: dense panels, int8 head, glue)
    kern = None
    if dev.type == "cpu":
        kern = (kernels if kernels is not None else KernelConfig.from_env()).load()
    dt = resolve_dtype(dtype, dev, kern)
    mode = resolve_weights(weights, dt, dev)
    if load_mode in ("mlock", "mmap+mlock"):
        log.warning("--load-mode %s: pages are not locked in memory (as %s)", load_mode,
                    "mmap" if load_mode == "mmap+mlock" else "none")
    w = place(load_weights(reader, hp, dt, packed=mode == "native", kern=kern,
                           load_mode=load_mode), dev)
    tr = Transformer(hp, w, dt, kern=kern, deterministic=deterministic)
    tok = Tokenizer.from_gguf(reader)
    template = ChatTemplate.from_gguf(reader, tok)
    load_s = time.perf_counter() - t0
    mapped = w.mapped_bytes
    log.info("loaded %s (%s, %d layers, %s, %s weights, %.1f MiB%s, deterministic %s) on %s "
             "in %.2f s", path, hp.arch, hp.n_layer, dt, mode, w.nbytes / 2**20,
             f" ({mapped / 2**20:.1f} MiB of it expert tensors mapped from the file)"
             if mapped else "",
             "on" if tr.deterministic else "off", dev, load_s)
    return Model(path, hp, tok, template, tr, dt, dev, load_s, mode)
