"""The device path (issue 39) on a machine without a GPU: `--device` / `-ngl` read as
llama-server reads them, and the model built for a CUDA device (torch's ops, dense weights)
run where no CPU tensor can hide.

Two checks stand in for a GPU here. The forward and the pool's operations run on torch's `meta`
device, whose tensors hold no data: an op mixing a meta tensor with a CPU one fails, as it
fails on CUDA, so every tensor the step builds or reads must live where the model lives. And
a whole scheduler run (the host tier's saves and restores included) runs under `NamedDevices`,
which records every tensor factory on the device side of the code (model/, kv/, cache/,
engine/) that names no device: on a CUDA server such a tensor lands on the CPU.
"""

from __future__ import annotations

import dataclasses

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

from radixserve.config import ServerConfig, SpecConfig
from radixserve.engine.batch import BatchSeq, hidden
from radixserve.engine.counters import ServerMetrics
from radixserve.engine.build import build_scheduler
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.task import CompletionTask, FinalResult
from radixserve.flags.spec import FlagError, FlagExit, parse
from radixserve.flags.table import ALL_FLAGS as FLAGS
from radixserve.memory.front import build_pool
from radixserve.model.arch import memory_layout
from radixserve.model import device as D
from radixserve.model.forward import Transformer
from radixserve.model.loader import load_model, resolve_weights
from radixserve.model.weights import ModelWeights, place
from radixserve.sampling.chain import SamplingParams
from tests.model.kernel_variants import NO_KERNELS

META = torch.device("meta")
CONSTRUCTORS = _device_constructors()
DEVICE_SIDE = ("radixserve/model/", "radixserve/memory/", "radixserve/engine/")


# -- --device / -ngl -------------------------------------------------------------------------
@pytest.mark.parametrize("value, want", [
    ("auto", "auto"), ("cpu", "cpu"), ("none", "cpu"), ("CPU", "cpu"), ("cuda", "cuda:0"),
    ("cuda:1", "cuda:1"), ("CUDA0", "cuda:0"), ("CUDA12", "cuda:12"), (" cuda:0 ", "cuda:0"),
])
def test_device_spellings(value: str, want: str) -> None:
    assert D.parse_device(value) == want


@pytest.mark.parametrize("value, says", [
    ("cuda:0,cuda:1", "name one device"), ("CUDA0,CUDA1", "name one device"), ("", "name one"),
    ("gpu", "unknown device"), ("cuda:x", "unknown device"), ("Vulkan0", "unknown device"),
])
def test_device_refusals(value: str, says: str) -> None:
    with pytest.raises(D.DeviceError, match=says):
        D.parse_device(value)


def test_gpu_layer_values() -> None:
    assert [D.parse_gpu_layers(v) for v in ("auto", "all", "-1", "0", "99", " 7 ")] == \
        ["auto", "all", "-1", "0", "99", "7"]
    for bad in ("x", "-2", "1.5"):
        with pytest.raises(D.DeviceError):
            D.parse_gpu_layers(bad)


def test_resolve_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(D, "cuda_count", lambda: 0)
    for dev, ngl in (("auto", "auto"), ("cpu", "all"), ("none", "99"), ("cuda", "0"),
                     ("auto", "0"), ("auto", "30"), ("auto", "-1"), ("auto", "12"),
                     ("cpu", "12")):
        assert D.resolve_device(dev, ngl, 30) == torch.device("cpu"), (dev, ngl)
    with pytest.raises(D.DeviceError, match=r"--device cuda:0: not available \(torch sees 0"):
        D.resolve_device("cuda", "auto", 30)


def test_resolve_with_two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(D, "cuda_count", lambda: 2)
    assert D.resolve_device("auto", "auto", 30) == torch.device("cuda:0")
    assert D.resolve_device("CUDA1", "all", 30) == torch.device("cuda:1")
    assert D.resolve_device("cuda:1", "30", 30) == torch.device("cuda:1")  # every layer
    assert D.resolve_device("cuda:1", "0", 30) == torch.device("cpu")  # -ngl 0: none offloaded
    with pytest.raises(D.DeviceError, match="torch sees 2 CUDA device"):
        D.resolve_device("cuda:2", "all", 30)
    # a part of the layers: refused, naming the two values that work
    with pytest.raises(D.DeviceError, match=r"-ngl 12: the model has 30 layers.*-ngl 0 .*all"):
        D.resolve_device("cuda:0", "12", 30)
    with pytest.raises(D.DeviceError, match=r"-ngl 29: .*every layer on cuda:0"):
        D.resolve_device("auto", "29", 30)


def test_list_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    class Props:
        name, total_memory = "NVIDIA H200", 141 * 2**30

    monkeypatch.setattr(D, "cuda_count", lambda: 0)
    assert D.list_devices().splitlines() == ["Available devices:",
                                            "  cpu: CPU (radixserve's C kernels, PyTorch)"]
    monkeypatch.setattr(D, "cuda_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    assert D.list_devices().splitlines()[-1] == "  cuda:0 (CUDA0): NVIDIA H200 (144384 MiB)"


def test_flags_set_the_device() -> None:
    p = parse(FLAGS, ["-dev", "CUDA1", "-ngl", "all"], {})
    assert (p.cfg.device, p.cfg.gpu_layers) == ("cuda:1", "all")
    p = parse(FLAGS, [], {"LLAMA_ARG_DEVICE": "none", "LLAMA_ARG_N_GPU_LAYERS": "0"})
    assert (p.cfg.device, p.cfg.gpu_layers) == ("cpu", "0")
    p = parse(FLAGS, ["--device", "cuda:0"], {"LLAMA_ARG_DEVICE": "cpu"})  # the line wins
    assert p.cfg.device == "cuda:0"
    assert not [n for n in p.notes if "device" in n]  # honored, not "not applicable"
    with pytest.raises(FlagError, match="-dev.*name one device"):
        parse(FLAGS, ["-dev", "CUDA0,CUDA1"], {})
    with pytest.raises(FlagError, match="-ngl.*layer count"):
        parse(FLAGS, ["-ngl", "most"], {})
    with pytest.raises(FlagExit) as e:
        parse(FLAGS, ["--list-devices"], {})
    assert e.value.text == D.list_devices()


def test_a_device_torch_cannot_reach_is_refused_at_load(tiny_path: str) -> None:
    if D.cuda_count():
        pytest.skip("this machine has a CUDA device: scripts/gpu-check.sh runs it")
    with pytest.raises(D.DeviceError, match="--device cuda:0: not available"):
        load_model(tiny_path, "f32", device="cuda")
    with pytest.raises(D.DeviceError, match="-ngl 1: the model has 2 layers"):
        load_model(tiny_path, "f32", device="cuda", gpu_layers="1")
    assert load_model(tiny_path, "f32", device="cuda", gpu_layers="0").device.type == "cpu"
    cuda = torch.device("cuda:0")
    assert resolve_weights("auto", torch.bfloat16, cuda) == "dequant"
    with pytest.raises(D.DeviceError, match="--weights native packs 4-bit blocks"):
        resolve_weights("native", torch.bfloat16, cuda)


# -- the model on a device where no CPU tensor can hide ----------------------------------------
def weight_tensors(w: ModelWeights) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor the weights hold, named."""
    def linear(name: str, m: Any) -> Iterator[tuple[str, torch.Tensor]]:
        for i, part in enumerate(getattr(m, "parts", [])):
            yield from linear(f"{name}.{i}", part)
        for attr in ("w", "bias"):
            t = getattr(m, attr, None)
            if isinstance(t, torch.Tensor):
                yield f"{name}.{attr}", t

    def piece(name: str, obj: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """A layer piece's fields (model/layers.py): tensors, linears and nested pieces."""
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if isinstance(v, torch.Tensor):
                yield f"{name}.{f.name}", v
            elif dataclasses.is_dataclass(v):
                yield from piece(f"{name}.{f.name}", v)
            else:
                yield from linear(f"{name}.{f.name}", v)

    for li, layer in enumerate(w.layers):
        yield from piece(f"blk.{li}", layer)
    for name in ("tok_embd", "output_norm", "rope_freqs"):
        if isinstance(getattr(w, name), torch.Tensor):
            yield name, getattr(w, name)
    yield "head.w", w.head.w


def device_build(path: str, dtype: str = "bf16") -> Transformer:
    """The model as load_model builds it for a CUDA device (torch's ops, dense weights,
    the full f32 head), placed on the meta device."""
    m = load_model(path, dtype, weights="dequant", kernels=NO_KERNELS)
    tr = m.transformer
    assert tr.kern is None and tr.w.head.q8 is None and tr.w.head.dots is None
    return Transformer(m.hp, place(tr.w, META), tr.dtype, kern=None)


@pytest.mark.parametrize("which", ["default", "tiny_swa", "gemma3"])
def test_forward_and_pool_run_on_the_model_device(which: str, default_path: str,
                                                 tiny_swa_path: str) -> None:
    """The forward (batched prefill past the sliding window, decode, a sliding-window model's
    split cache, a q8_0 cache) and the pool's shift and copy run on the meta device: every
    weight, table, index and cell tensor is where the model is. Gemma 3 270M: its 262k-token
    head, its two RoPE bases, its 512-token window."""
    from radixserve.model.default_model import gemma3_model_path

    paths = {"default": default_path, "tiny_swa": tiny_swa_path}
    tr = device_build(paths[which] if which in paths else gemma3_model_path())
    moved = dict(weight_tensors(tr.w))
    assert len(moved) > 4 * len(tr.w.layers)
    assert {n: t.device for n, t in moved.items() if t.device != META} == {}
    assert tr.rope.inv_freq.device == META and tr.rope_swa.inv_freq.device == META
    hp = tr.hp
    n = hp.n_swa + 24 if hp.n_swa else 40  # the first prompt: past the window
    for types in (None, ("q8_0", "q8_0")) if hp.head_dim % 32 == 0 else (None,):
        kw = {} if types is None else {"types": _kv_types(types, tr.dtype)}
        pool = build_pool(memory_layout(hp), n + 64, 2, True, tr.dtype, tr.rope.rotate,
                          tr.rope_swa.rotate, n, META, **kw)
        assert pool.k.device == META
        with NamedDevices() as nd:
            h = hidden(tr, pool, [BatchSeq(0, list(range(5, 5 + n)), 0)])
            assert h.shape == (1, hp.n_embd) and h.device == META
            h = hidden(tr, pool, [BatchSeq(0, [7], n), BatchSeq(1, [3, 4, 5], 0, n_logits=3)])
            assert h.shape == (4, hp.n_embd) and h.device == META
            pool.seq_cp(0, 1, 0, 20)
            pool.seq_rm(0, 5, 10)
            pool.seq_add(0, 10, n + 1, -5)  # a K-shift: rotates cached keys on the device
            h = hidden(tr, pool, [BatchSeq(0, [9, 10], n - 4)])
            assert h.device == META
        assert nd.missing == []


def _kv_types(names: tuple[str, str], dtype: torch.dtype) -> Any:
    from radixserve.memory.pool import kv_types
    return kv_types.resolve(*names, dtype)


# -- the whole engine, every tensor it makes on the device side naming its device --------------
class NamedDevices(TorchFunctionMode):
    """Records (file:line) each tensor factory called without `device=` from the device side
    of the code (DEVICE_SIDE): with a CUDA model such a tensor is made on the CPU. Host-side
    code (samplers, text, HTTP) makes host tensors and is not checked."""

    def __init__(self) -> None:
        super().__init__()
        self.missing: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if (func in CONSTRUCTORS and kwargs.get("device") is None
                and not (args and isinstance(args[0], torch.Tensor))):
            site = _caller()
            if site is not None and site not in self.missing:
                self.missing.append(site)
        return func(*args, **kwargs)


def _caller() -> str | None:
    """The innermost radixserve frame, when it is on the device side."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename.replace("\\", "/")
        if "/radixserve/" in name and "/tests/" not in name:
            rel = name[name.rindex("/radixserve/") + 1:]
            return f"{rel}:{f.f_lineno}" if rel.startswith(DEVICE_SIDE) else None
        f = f.f_back
    return None


def test_named_devices_catches_a_factory_without_its_device() -> None:
    """The check can fail: a factory without its device in device-side code is reported at
    its line; one naming its device, or in host-side code, is not."""
    x = torch.ones(2)

    def run_as(path: str, code: str) -> list[str]:
        with NamedDevices() as nd:
            exec(compile(code, path, "exec"), {"torch": torch, "x": x})
        return nd.missing

    assert run_as("/x/radixserve/memory/planted.py", "a = 1\nt = torch.zeros(3)\n") == \
        ["radixserve/memory/planted.py:2"]
    assert run_as("/x/radixserve/engine/planted.py", "torch.tensor([1, 2])") == \
        ["radixserve/engine/planted.py:1"]
    assert run_as("/x/radixserve/memory/planted.py", "torch.zeros(3, device='cpu')") == []
    assert run_as("/x/radixserve/memory/planted.py", "torch.as_tensor(x)") == []
    assert run_as("/x/radixserve/sampling/planted.py", "torch.zeros(3)") == []


def _run(sched: Scheduler, prompts: list[list[int]], slot: int = -1, n: int = 6,
         pooling: str = "") -> list[FinalResult]:
    """Greedy answers to `prompts`, submitted together, stepped until all are done."""
    outs: list[list] = [[] for _ in prompts]
    for p, out in zip(prompts, outs):
        sched.submit(CompletionTask(p, SamplingParams(temperature=0), n_predict=n,
                                    ignore_eos=True, id_slot=slot, pooling=pooling), out.append)
    while sched.has_active() or sched.deferred:
        sched.step()
    assert all(isinstance(o[-1], FinalResult) for o in outs), [o[-1] for o in outs]
    return [o[-1] for o in outs]


def ask(sched: Scheduler, prompt: list[int], n: int = 12, slot: int = -1,
        pooling: str = "") -> FinalResult:
    return _run(sched, [prompt], slot, n, pooling)[0]


# the devices the engine test runs on: the CPU, and the one scripts/gpu-check.sh names
GPU = os.environ.get("RADIXSERVE_TEST_DEVICE", "")
DEVICES = ["cpu"] + ([GPU] if GPU else [])


@pytest.mark.parametrize("device", DEVICES)
def test_engine_on_the_device_build_names_every_device(device: str,
                                                       request: pytest.FixtureRequest) -> None:
    """A scheduler over the device build of the default model (f32; on the CPU the same build,
    torch's ops on dense weights), with the host tier: two sessions share a system prompt, the
    first is evicted to the host tier by a third and comes back from it. No device-side
    factory leaves out its device, and every answer equals the same prompt's answer computed
    alone without any cache."""
    # scripts/gpu-check.sh may name the model (the device machine's carry limit)
    path = os.environ.get("RADIXSERVE_TEST_MODEL") or request.getfixturevalue("default_path")
    model = load_model(path, "f32", device=device, weights="dequant", kernels=NO_KERNELS)
    want = torch.device(D.parse_device(device))
    assert model.device == want and model.transformer.kern is None
    system = list(range(1000, 1100))
    a, b, c = system + [5, 6, 7], system + [8, 9], list(range(3000, 3150))
    cfg = ServerConfig(ctx_size=512, n_parallel=2, kv_unified=True, cache_idle_slots=True)
    sched = build_scheduler(model, cfg, ServerMetrics())
    assert sched.pool.k.device == model.device
    with NamedDevices() as nd:
        first = _run(sched, [a, b])
        _run(sched, [c], slot=0)
        _run(sched, [c[:100] + [1, 2]], slot=1)  # both slots now hold other prompts
        again = _run(sched, [a + first[0].tokens[:2]])[0]
    assert nd.missing == []
    assert again.timings.cache_n >= len(a)  # served from the host tier
    plain = build_scheduler(model, ServerConfig(ctx_size=512, n_parallel=1, cache_ram_mib=0),
                      ServerMetrics())
    for prompt, got in ((a, first[0]), (b, first[1]), (a + first[0].tokens[:2], again)):
        assert _run(plain, [prompt])[0].tokens == got.tokens


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", ["tiny", "tiny_swa"])
def test_every_tier_on_the_device_build_names_every_device(which: str, device: str,
                                                           tiny_path: str, tiny_swa_path: str,
                                                           tmp_path: Any) -> None:
    """The rest of the engine on the device build of two tiny models (a llama, a gemma3 with
    a sliding-window pool): speculation (the llama drafting with itself; the gemma3 with
    n-grams enabled, drafting where its text repeats), a context shift (the llama), an
    embedding, a
    slot saved to a file, erased and restored, and a restart that restores from the disk
    tier. No device-side factory leaves out its device; every answer equals the uncached
    one."""

    path = tiny_path if which == "tiny" else tiny_swa_path
    model = load_model(path, "f32", device=device, weights="dequant", kernels=NO_KERNELS)
    assert model.device == torch.device(D.parse_device(device))
    shift = which == "tiny"
    # the llama drafts with itself (draft-simple: a draft pool beside the target's, its rows
    # in every tier), the gemma3 with n-grams (draft-simple refuses sliding-window models)
    spec = (SpecConfig(types=["draft-simple"], draft_model=path) if shift
            else SpecConfig(types=["ngram-simple"]))

    def sched() -> Scheduler:
        cfg = ServerConfig(ctx_size=512, n_parallel=2, kv_unified=True, cache_disk=str(tmp_path
                           / "disk"), cache_disk_block=16, slot_save_path=str(tmp_path),
                           context_shift=shift, spec=spec, cache_idle_slots=False)
        return build_scheduler(model, cfg, ServerMetrics())

    long_prompt = [7, 8, 9] * 60 + list(range(300, 400))  # repeats: the n-gram drafts hit
    s = sched()
    with NamedDevices() as nd:
        first = ask(s, long_prompt, n=24, slot=0)
        emb = ask(s, list(range(50, 90)), slot=1, pooling="mean").embedding
        saved = s.mem.slot_action(0, "save", "dev.bin")
        s.mem.slot_action(0, "erase", None)
        restored = s.mem.slot_action(1, "restore", "dev.bin")
        follow = ask(s, long_prompt + first.tokens + [11, 12], slot=1)
        shifted = ask(s, list(range(600, 1000)), n=200, slot=0) if shift else None
        s.mem.disk.disk.drain()
        s.mem.close()
        s = sched()  # a restart: the disk tier serves the long prompt
        again = ask(s, long_prompt + [5], slot=0)
        s.mem.close()
    assert nd.missing == []
    if shift:  # the draft is the target itself: every drafted token is accepted
        assert first.timings.draft_n and first.timings.draft_n_accepted == first.timings.draft_n
    assert saved["n_saved"] == restored["n_restored"] == len(long_prompt) + 23
    assert follow.timings.cache_n >= len(long_prompt) + 23
    assert again.timings.reuse is not None and again.timings.reuse.tier == "disk"
    plain = build_scheduler(model, ServerConfig(ctx_size=512, n_parallel=1, cache_ram_mib=0,
                                          context_shift=shift), ServerMetrics())
    assert ask(plain, long_prompt, n=24).tokens == first.tokens
    assert ask(plain, long_prompt + first.tokens + [11, 12]).tokens == follow.tokens
    assert ask(plain, long_prompt + [5]).tokens == again.tokens
    assert torch.equal(ask(plain, list(range(50, 90)), pooling="mean").embedding, emb)
    if shifted is not None:
        assert shifted.truncated and len(shifted.tokens) == 200  # shifted (llama-server)
        assert ask(plain, list(range(600, 1000)), n=200).tokens == shifted.tokens


def test_perf_measures_the_device_build_at_each_batch(tiny_path: str) -> None:
    """`radixserve perf --device D --batches ...` (scripts/gpu-check.sh's figures): one decode
    figure per batch size, the device named, on the model built for it."""
    from radixserve import perf

    [fig] = perf.run(tiny_path, "f32", "dequant", 1, 32, device="cpu", batches=(1, 3),
                     kernels=NO_KERNELS)
    assert fig["device"] == "cpu" and fig["kernels"] == "none" and fig["weights"] == "dequant"
    assert [k for k in fig if k.startswith("decode_")] == ["decode_b1_tok_s_ctx32",
                                                          "decode_b3_tok_s_ctx32"]
    assert all(fig[k] > 0 for k in fig if k.endswith("_tok_s") or "_tok_s_" in k)
