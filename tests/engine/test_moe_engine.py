"""Qwen3 MoE through the real scheduler: agent sessions on fewer slots than sessions, their
steps batched together (tokens of different requests routed to overlapping experts in one
step), each answer equal token for token to its prompt computed alone with no cache
(deterministic bf16: cached == uncached to the bit), and the reuse figures pinned as for the
dense families (a mixture of experts changes the FFN, not what a prefix's KV is)."""

from __future__ import annotations

import pytest

from radixserve.model.loader import Model, load_model
from radixserve.model.moe import MoEFFN
from tests.engine.test_lfm2_engine import run_agents
from tests.engine.test_swa import Ref
from tests.moe_hf import random_moe, tiny_qwen3moe_config, write_qwen3moe_from_hf


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """A tiny Qwen3 MoE (3 layers, 8 experts of 32, 3 a token), Q8_0, deterministic bf16."""
    d = tmp_path_factory.mktemp("moe-engine")
    path = write_qwen3moe_from_hf(str(d / "q3moe.gguf"),
                                  random_moe(tiny_qwen3moe_config(), seed=23), "q8_0")
    m = load_model(path, "bf16", deterministic="on")
    assert m.deterministic and isinstance(m.transformer.w.layers[0].ffn, MoEFFN)
    return m


@pytest.fixture(scope="module")
def ref(model: Model) -> Ref:
    return Ref(model)


def test_agents_radix_compute_the_unshared_minimum_and_answer_as_alone(model: Model,
                                                                         ref: Ref) -> None:
    """5 sessions on 2 slots, 4 steps each (run_agents: every answer checked against its
    prompt alone): exactly the unshared minimum computed (170, the dense families' figure
    on this workload)."""
    finals, sent, minimum, s = run_agents(model, ref, radix=True, chat=True)
    assert sum(f.timings.prompt_n for f in finals) == minimum == 170
    s.mem.check()


def test_agents_legacy_answer_as_alone(model: Model, ref: Ref) -> None:
    """The whole-prompt cache: the histories lost as for the dense families (390)."""
    finals, sent, minimum, s = run_agents(model, ref, radix=False, chat=True)
    assert sum(f.timings.prompt_n for f in finals) == 390
