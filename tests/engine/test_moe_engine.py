"""The mixture-of-experts families through the real scheduler (Qwen3 MoE; gpt-oss, whose
sliding layers keep a window of 8 here; Qwen3.5 MoE, whose DeltaNet layers keep a state):
agent sessions on fewer slots than sessions, their steps batched together (tokens of different
requests routed to overlapping experts in one step), each answer equal token for token to its
prompt computed alone with no cache (deterministic bf16: cached == uncached to the bit), and
the reuse figures pinned as for the dense families (a mixture of experts changes the FFN, not
what a prefix's memory is)."""

from __future__ import annotations

import pytest

from radixserve.model.loader import Model, load_model
from radixserve.model.moe import MoEFFN
from tests.engine.test_lfm2_engine import run_agents
from tests.engine.test_swa import Ref
from tests.model.test_qwen35moe import random_qwen35moe
from tests.moe_hf import (random_moe, tiny_gptoss_config, tiny_qwen3moe_config,
                          write_gptoss_from_hf, write_qwen3moe_from_hf)
from tests.tiny_gguf import write_qwen35_from_hf


@pytest.fixture(scope="module", params=["qwen3moe", "gpt-oss", "qwen35moe"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Model:
    """A tiny model of each family (8 experts of 32, 3 a token), Q8_0 (gpt-oss's experts
    MXFP4), deterministic bf16."""
    d = tmp_path_factory.mktemp("moe-engine")
    if request.param == "qwen3moe":
        path = write_qwen3moe_from_hf(str(d / "m.gguf"),
                                      random_moe(tiny_qwen3moe_config(), seed=23), "q8_0")
    elif request.param == "gpt-oss":
        path = write_gptoss_from_hf(str(d / "m.gguf"),
                                    random_moe(tiny_gptoss_config(), seed=23), "mxfp4")
    else:
        path = write_qwen35_from_hf(str(d / "m.gguf"), random_qwen35moe(23), wtype="q8_0")
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
