"""Shared fixtures: tiny random GGUF models (fast) and the default SmolLM2 model (marked).

What is shared, and what stays fresh (issue 37: the suite's model loads, server processes and
reference runs; on 2 cores a load of the default model takes ~1-3 s, of Gemma 3 ~3-6 s, since
the loader reads a GGUF's arrays at once (gguf-py's reader took 2 s and 9 s more), and a server
start ~5 s. Servers and engines whose outputs must equal other runs bit for bit run the default
bf16 path in the deterministic mode, ~8x faster a token than the f32 runs they replaced, except
where f32 itself is under test).

The whole suite runs on pytest-xdist workers (tests/workers.py): "a session" below is a
worker's session, and a module still runs whole on one worker.

Loaded models, one a session (a `Model` is read only: no engine or test changes it; a test that
needs another template or mode makes a copy with `dataclasses.replace`):
  default_tr            f32 Transformer of the default model (model/ tests)
  default_f32           load_model(default, "f32"): http/test_server_defaults.py,
                        http/test_sampling_llama.py, engine/test_disk_tier.py's other dtype
  default_f32_dequant   load_model(default, "f32", weights="dequant"): http/test_multi_task.py,
                        http/test_cache_salt_http.py, http/test_webui.py (two tests)
  engine/conftest.py    `model`, the default model in deterministic bf16: every engine module
                        that does not override it (test_deterministic, test_cache_salt,
                        test_cache_view, test_disk_tier, test_speculative); was one a module
  http/conftest.py      `model`, the tiny model in f32: the in-process app tests; was one a
                        module
Each of those tests still builds its own Engine/Scheduler (slots, caches and counters from zero).
Loads that stay per test: model/test_forward.py's kernel-path model (the test sets and clears
`tr.kern` on it), model/test_deterministic.py's (one per kernel variant, RADIXSERVE_KERNELS set
while loading, and the torch-ops one), test_gemma3/test_step (other models and dtypes).

Server processes (tests/http/harness.py running_server), ~45 a run:
  shared a session      http/conftest.py `shared_server(args)`: one process per argument list;
                        `default_np2_server` (-np 2 -c 4096, deterministic) serves
                        test_tools.py's `server` and test_constrained.py's `exact_server`, which
                        were two processes with the same arguments: their tests read answers to
                        prompts of their own and reuse as lower bounds (`cache_n >= n`)
  shared in a module    test_api.py (one per weight path), test_errors.py, test_slot_http.py,
                        test_tools.py's Qwen3-template server, test_tools_cache.py,
                        test_constrained.py's bf16 server, webui/test_page.py, cluster's
                        single server (session); test_host_cache.py's no-cache reference server
                        now also serves test_cache_ram_zero_disables_the_host_tier (the same
                        arguments; its host-tier counters cannot move with --cache-ram 0)
  fresh, and why        every cache-tier comparison that checks reuse or counters from an
                        empty process: test_swa_http.py (cache_n of the first turns == 0,
                        checkpoints_restored_total == 2, a slot file saved from its own run),
                        test_host_cache.py's tiers (every later turn back from host RAM, loads
                        counted from zero), test_radix_http.py's layouts and
                        shared-prefixes-computed-once (tokens computed since start), the spec
                        servers of test_spec_http.py (draft counts, one flag set each);
                        restarts and directories: test_disk_http.py (two servers on one
                        directory, then a restart); startup flags: test_server_flags.py,
                        test_constrained.py's --grammar-file/-jf servers, test_slot_http.py's
                        server without --slot-save-path; absolute /metrics counters:
                        test_disconnects.py (tokens predicted since start), bench e2e/soak
                        (a restart run, a soak); kills: cluster/test_cluster_prefix.py.
  in process            http/test_webui.py's cache-view tests (totals read from zero: a fresh
                        engine, the shared model), test_radix_http.py's faulty-cache engine.

Reference runs (each prompt alone, no cache): computed once a module, and no two modules ask
for the same one: engine/test_deterministic.py (100 chat prompts x 64 tokens, ~55 s),
test_disk_tier.py, test_cache_salt.py, test_speculative.py, http/test_swa_http.py (Gemma 3),
test_host_cache.py, test_radix_http.py, test_spec_http.py each use prompts, lengths or models
of their own, so there is nothing to share between modules; model/test_gemma3.py's ~80 s setup
is its one HF transformers load and greedy run of Gemma 3 (module-scoped, used by its five
tests), model/test_forward.py's is the same for the default model, used once.
"""

from __future__ import annotations

import os
from typing import Any

# every kernel call range-checks the indices it reads through (model/kernels.py's check mode,
# settled by model/kernel_config.py), in this process and in the servers the tests start
os.environ["RADIXSERVE_KERNEL_CHECKS"] = "1"

import gguf
import pytest
import torch

from radixserve.memory.key import PromptKey
from radixserve.memory.tiers.base import PromptCache
from radixserve.memory.seq_kv import SlotKV
from radixserve.memory.front import KVTypes, build_pool
from radixserve.memory.pool.pool import KVPool
from radixserve.model.default_model import default_model_path
from radixserve.model.forward import Transformer
from radixserve.model.arch import read_hparams
from radixserve.model.loader import Model, load_model
from radixserve.model.arch import memory_layout
from radixserve.model.weights import load_weights
from radixserve.text.chat_template import ChatTemplate
from radixserve.text.tokenizer import Tokenizer
from tests.model.kernel_variants import default_kernels
from tests.tiny_gguf import write_tiny_gguf

# the fast tier's marks and its guard (tests/tiers.py)
pytest_plugins = ("tests.tiers", "tests.workers")


class SharedGGUFReader(gguf.GGUFReader):
    """gguf-py's reader, built once for the last unchanged file read (its path, size, mtime and
    inode) and handed out again: transformers' GGUF loader builds one for the config, another
    for the weights and a third for the tokenizer, ~9 s each for Gemma 3's 262k-token
    vocabulary (gguf-py makes two numpy views an element). The same object, read only, so the
    references are what they were. Only real models' (files over 64 MiB: never written by a
    test) and only the last file's are kept: Gemma 3's holds ~680 MiB."""

    _last: tuple[tuple[str, int, int, int], SharedGGUFReader] | None = None

    def __new__(cls, path: Any, mode: str = "r") -> SharedGGUFReader:
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino)
        if mode != "r" or st.st_size < 64 << 20:
            return super().__new__(cls)
        if cls._last is not None and cls._last[0] == key:
            return cls._last[1]
        self = super().__new__(cls)
        cls._last = (key, self)
        return self

    def __init__(self, path: Any, mode: str = "r") -> None:
        if getattr(self, "_ready", False):
            return
        super().__init__(path, mode)
        self._ready = True


gguf.GGUFReader = SharedGGUFReader  # type: ignore[misc]  # what `from gguf import` finds


def make_transformer(path: str, dtype: torch.dtype = torch.float32) -> Transformer:
    """The model's Transformer on the kernels the environment settles (as load_model's
    default), dense weights."""
    reader = gguf.GGUFReader(path)
    hp = read_hparams(reader)
    kern = default_kernels()
    return Transformer(hp, load_weights(reader, hp, dtype, kern=kern), dtype, kern=kern)


def make_pool(tr: Transformer, n_cells: int = 256, n_seq: int = 4, unified: bool = True,
              n_step: int = 256, swa_full: bool = False) -> KVPool:
    """The pool the engine would make for `tr` (a sliding-window pool for gemma3, with room for
    `n_step` new tokens a forward)."""
    return build_pool(memory_layout(tr.hp), n_cells, n_seq, unified, tr.dtype, tr.rope.rotate,
                      tr.rope_swa.rotate, n_step, swa_full=swa_full)


def model_pool(m: Model, n_cells: int, n_seq: int, unified: bool, n_step: int,
               swa_full: bool = False, types: KVTypes | None = None) -> KVPool:
    """The pool the engine makes for a loaded model (engine/build.py's `model_pool`), through
    the memory front door."""
    return build_pool(m.layout, n_cells, n_seq, unified, m.dtype, m.rope.rotate,
                      m.rope_swa.rotate, n_step, m.device, types, swa_full)


def restore(cache: PromptCache, pool: KVPool, seq: int, slot_tokens: list[int],
            prompt: list[int], salt: str = "") -> list[int] | None:
    """A host-cache restore into `seq` as the engine makes it: the cache hands its rows over
    (`load`, given what the slot keeps), the slot's KV owner writes them. None: the cache had
    nothing better (the sequence untouched); else the tokens it holds now ([]: the restore
    failed, its cells removed)."""
    got = cache.load(pool, seq, slot_tokens, PromptKey(salt, prompt))
    return None if got is None else SlotKV(pool, seq).write_restore(got)


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("tiny")
    # qwen3 with head_dim 128: HF's GGUF config mapping ignores attention.key_length
    shapes = {"llama": {}, "qwen2": {}, "qwen3": {"n_embd": 256, "n_head": 2, "n_head_kv": 1}}
    return {
        arch: write_tiny_gguf(str(d / f"tiny-{arch}.gguf"), arch=arch, seed=i, **kw)
        for i, (arch, kw) in enumerate(shapes.items())
    }


@pytest.fixture(scope="session")
def tiny_swa_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny gemma3: 6 layers (the last global, the others sliding over 16 positions)."""
    d = tmp_path_factory.mktemp("tiny-swa")
    return write_tiny_gguf(str(d / "tiny-gemma3.gguf"), arch="gemma3", n_layer=6, n_head=4,
                           n_head_kv=1, seed=7, sliding_window=16)


@pytest.fixture(scope="session")
def tiny_lfm2_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny LFM2: 6 layers, attention at 2 and 5, the others short convolutions of kernel
    length 3 (their state: the last 2 input rows)."""
    d = tmp_path_factory.mktemp("tiny-lfm2")
    return write_tiny_gguf(str(d / "tiny-lfm2.gguf"), arch="lfm2", n_layer=6, n_head=4,
                           n_head_kv=2, seed=11, attn_layers=(2, 5), l_cache=3)


@pytest.fixture(scope="session")
def tiny_qwen35_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Qwen3.5: 4 layers (three Gated DeltaNet, the last attention), 2 key heads and 4
    value heads of 16 (its state kept whole, one cell a sequence)."""
    d = tmp_path_factory.mktemp("tiny-qwen35")
    return write_tiny_gguf(str(d / "tiny-qwen35.gguf"), arch="qwen35", ssm_heads=(2, 4),
                           seed=21)


@pytest.fixture(scope="session")
def tiny_granite_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny dense Granite 4.0-H (tests/granite_hf.py's tiny_config: Mamba2, attention,
    Mamba2, Mamba2; NoPE), written from a random transformers model as llama.cpp's converter
    writes it, its matrices Q8_0."""
    from tests.granite_hf import random_granite, tiny_config, write_granite_from_hf

    d = tmp_path_factory.mktemp("tiny-granite")
    return write_granite_from_hf(str(d / "tiny-granite.gguf"),
                                 random_granite(tiny_config(), seed=21), "q8_0")


@pytest.fixture(scope="session")
def tiny_path(tiny_paths: dict[str, str]) -> str:
    return tiny_paths["llama"]


@pytest.fixture(scope="session")
def tiny_tr(tiny_path: str) -> Transformer:
    return make_transformer(tiny_path)


@pytest.fixture(scope="session")
def default_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def default_f32_dequant(default_path: str) -> Model:
    """The default model, f32 activations on dequantized weights, loaded once a session: the
    in-process apps of http/test_multi_task.py, test_cache_salt_http.py and
    test_webui.py, each over an engine of its own (a Model is read only)."""
    return load_model(default_path, "f32", weights="dequant")


@pytest.fixture(scope="session")
def default_f32(default_path: str) -> Model:
    """The default model in f32 on its default weights, loaded once a session:
    http/test_server_defaults.py, http/test_sampling_llama.py and
    engine/test_disk_tier.py's other-dtype engine, each over an engine of its own."""
    return load_model(default_path, "f32")


@pytest.fixture(scope="session")
def hf_default_tokenizer(default_path: str) -> Any:
    """transformers' own tokenizer for the default GGUF (the reference; a test-only
    dependency), converted once a session (~8 s): model/test_tokenizer.py,
    test_chat_template.py and test_grammar.py read it (test_tokenizer.py changes a deep copy)."""
    import transformers
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(default_path), gguf_file=os.path.basename(default_path))


@pytest.fixture(scope="session")
def default_tr(default_path: str) -> Transformer:
    return make_transformer(default_path)


@pytest.fixture(scope="session")
def tok_tmpl(tiny_path: str) -> tuple[Tokenizer, ChatTemplate]:
    """The real tokenizer and chat template of the tiny model (copied from the default one)."""
    reader = gguf.GGUFReader(tiny_path)
    tok = Tokenizer.from_gguf(reader)
    return tok, ChatTemplate.from_gguf(reader, tok)
