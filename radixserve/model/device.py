"""Where the model runs: llama-server's `--device` / `-ngl` read as one torch device.

radixserve keeps the whole model on one device, with its KV pool beside it: the CPU (our C
kernels, the default where no GPU is) or one CUDA device (torch's ops: the path
RADIXSERVE_KERNELS=0 runs on CPU). llama.cpp can also split layers between a GPU and the CPU
(`-ngl 12` of 32); that halves the point of a device pool (every step crosses the bus twice per
split), so a partial `-ngl` is refused naming the two values that work, rather than silently
rounded either way.

Spellings taken, as llama-server's and torch's: `auto` (the first CUDA device when torch sees
one, else the CPU), `cpu` / `none` (llama-server: do not offload), `cuda` / `cuda:N`, and
llama.cpp's device names `CUDA0`, `CUDA1`... One device only: a list names a split, refused.
"""

from __future__ import annotations

import re

import torch


class DeviceError(ValueError):
    """A device that cannot be used here, named with why: start-up stops (exit 1)."""


_LLAMA_NAME = re.compile(r"^cuda(\d+)$")
ALL_LAYERS = ("auto", "all", "-1")  # -ngl values that follow --device


def parse_device(value: str) -> str:
    """`--device`'s value, canonical (`auto`, `cpu` or `cuda:N`); DeviceError for a list or a
    name that is none of the spellings above."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    if len(names) != 1:
        raise DeviceError(f"--device {value!r}: name one device (auto, cpu, none, cuda, cuda:N "
                          "or CUDA<N>); splitting a model over devices is not implemented")
    name = names[0].lower()
    if name in ("auto", "cpu"):
        return name
    if name == "none":
        return "cpu"
    m = _LLAMA_NAME.match(name)
    if m:
        return f"cuda:{int(m.group(1))}"
    if name == "cuda":
        return "cuda:0"
    if name.startswith("cuda:") and name[5:].isdigit():
        return f"cuda:{int(name[5:])}"
    raise DeviceError(f"--device {value!r}: unknown device (auto, cpu, none, cuda, cuda:N or "
                      "CUDA<N>; --list-devices lists this machine's)")


def parse_gpu_layers(value: str) -> str:
    """`-ngl`'s value as given (`auto`, `all` or an integer); DeviceError for anything else.
    Whether a count is all of the model's layers is known at load (resolve_device)."""
    v = value.strip().lower()
    if v in ALL_LAYERS:
        return v
    try:
        n = int(v)
    except ValueError:
        raise DeviceError(f"-ngl {value!r}: expected a layer count, 'auto' or 'all'") from None
    if n < -1:
        raise DeviceError(f"-ngl {value!r}: a layer count is 0 or more ('all': every layer)")
    return str(n)


def cuda_count() -> int:
    """CUDA devices torch can use (0 on a CPU-only build)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(device: str, gpu_layers: str, n_layer: int) -> torch.device:
    """The one device the model and its KV pool go to. `-ngl 0` keeps everything on the CPU
    (llama-server: no layer offloaded), as `auto` does where torch sees no CUDA device;
    `auto`/`all`/-1 or a count of at least every repeating layer (the head goes with them)
    puts the whole model on `device`; a count between is refused. DeviceError for a CUDA device
    torch cannot reach, naming what it has."""
    device, ngl = parse_device(device), parse_gpu_layers(gpu_layers)
    n = cuda_count()
    # no layer offloaded, or nowhere to offload them (llama-server's CPU build takes any -ngl)
    if device == "cpu" or ngl == "0" or (device == "auto" and not n):
        return torch.device("cpu")
    if ngl not in ALL_LAYERS and int(ngl) < n_layer:
        raise DeviceError(
            f"-ngl {ngl}: the model has {n_layer} layers and radixserve does not split a model "
            f"between the CPU and a GPU; use -ngl 0 (CPU) or -ngl all (every layer on "
            f"{'cuda:0' if device == 'auto' else device})")
    if device == "auto":
        return torch.device("cuda:0")
    index = int(device.split(":")[1])
    if index >= n:
        have = f"torch sees {n} CUDA device(s)"
        if torch.version.cuda is None:
            have += f"; torch {torch.__version__} is a build without CUDA"
        raise DeviceError(f"--device {device}: not available ({have}); --device cpu or -ngl 0 "
                          "runs on the CPU")
    return torch.device(device)


def device_name(device: torch.device) -> str:
    """What /props and the cache identity name: `cpu`, or `cuda:N (<the GPU's name>)`."""
    if device.type != "cuda":
        return device.type
    return f"{device} ({torch.cuda.get_device_name(device)})"


def list_devices() -> str:
    """`--list-devices`: the CPU, then each CUDA device torch sees, with the spelling
    `--device` takes and its memory."""
    lines = ["Available devices:", "  cpu: CPU (radixserve's C kernels, PyTorch)"]
    for i in range(cuda_count()):
        p = torch.cuda.get_device_properties(i)
        lines.append(f"  cuda:{i} (CUDA{i}): {p.name} ({p.total_memory // 2**20} MiB)")
    return "\n".join(lines) + "\n"
