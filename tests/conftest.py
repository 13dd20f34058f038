"""Shared fixtures: tiny random GGUF models (fast) and the default SmolLM2 model (marked)."""

from __future__ import annotations

import gguf
import pytest
import torch

from radixserve.cache.base import PromptCache
from radixserve.engine.slot_kv import SlotKV
from radixserve.kv.pool import KVPool
from radixserve.kv.swa import make_pool as swa_make_pool
from radixserve.model.chat_template import ChatTemplate
from radixserve.model.default_model import default_model_path
from radixserve.model.forward import Transformer
from radixserve.model.hparams import HParams
from radixserve.model.tokenizer import Tokenizer
from radixserve.model.weights import load_weights
from tests.tiny_gguf import write_tiny_gguf

# the fast tier's marks and its guard (tests/tiers.py)
pytest_plugins = ("tests.tiers",)


def make_transformer(path: str, dtype: torch.dtype = torch.float32) -> Transformer:
    reader = gguf.GGUFReader(path)
    hp = HParams.from_gguf(reader)
    return Transformer(hp, load_weights(reader, hp, dtype), dtype)


def make_pool(tr: Transformer, n_cells: int = 256, n_seq: int = 4, unified: bool = True,
              n_step: int = 256, swa_full: bool = False) -> KVPool:
    """The pool the engine would make for `tr` (a sliding-window pool for gemma3, with room for
    `n_step` new tokens a forward)."""
    hp = tr.hp
    return swa_make_pool(hp.n_layer, hp.swa_layers, hp.n_swa, swa_full, hp.n_head_kv,
                         hp.head_dim, n_cells, n_seq, unified, tr.dtype, tr.rope.rotate,
                         tr.rope_swa.rotate, n_step)


def restore(cache: PromptCache, pool: KVPool, seq: int, slot_tokens: list[int],
            prompt: list[int], salt: str = "") -> list[int] | None:
    """A host-cache restore into `seq` as the engine makes it: the cache hands its rows over
    (`load`, given what the slot keeps), the slot's KV owner writes them. None: the cache had
    nothing better (the sequence untouched); else the tokens it holds now ([]: the restore
    failed, its cells removed)."""
    got = cache.load(pool, seq, slot_tokens, prompt, salt=salt)
    return None if got is None else SlotKV(pool, seq).write_restore(got, salt)


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
def tiny_path(tiny_paths: dict[str, str]) -> str:
    return tiny_paths["llama"]


@pytest.fixture(scope="session")
def tiny_tr(tiny_path: str) -> Transformer:
    return make_transformer(tiny_path)


@pytest.fixture(scope="session")
def default_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def default_tr(default_path: str) -> Transformer:
    return make_transformer(default_path)


@pytest.fixture(scope="session")
def tok_tmpl(tiny_path: str) -> tuple[Tokenizer, ChatTemplate]:
    """The real tokenizer and chat template of the tiny model (copied from the default one)."""
    reader = gguf.GGUFReader(tiny_path)
    tok = Tokenizer.from_gguf(reader)
    return tok, ChatTemplate.from_gguf(reader, tok)
