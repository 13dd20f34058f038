"""Shared fixtures: tiny random GGUF models (fast) and the default SmolLM2 model (marked)."""

from __future__ import annotations

import gguf
import pytest
import torch

from radixserve.kv.pool import KVPool
from radixserve.model.chat_template import ChatTemplate
from radixserve.model.default_model import default_model_path
from radixserve.model.forward import Transformer
from radixserve.model.hparams import HParams
from radixserve.model.tokenizer import Tokenizer
from radixserve.model.weights import load_weights
from tests.tiny_gguf import write_tiny_gguf


def make_transformer(path: str, dtype: torch.dtype = torch.float32) -> Transformer:
    reader = gguf.GGUFReader(path)
    hp = HParams.from_gguf(reader)
    return Transformer(hp, load_weights(reader, hp, dtype), dtype)


def make_pool(tr: Transformer, n_cells: int = 256, n_seq: int = 4, unified: bool = True) -> KVPool:
    hp = tr.hp
    return KVPool(
        hp.n_layer, hp.n_head_kv, hp.head_dim, n_cells, n_seq, unified, tr.dtype, tr.rope.rotate
    )


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
