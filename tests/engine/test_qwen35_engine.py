"""Qwen3.5 (its Gated DeltaNet state kept whole, one state cell a sequence: memory/pool/
recurrent.py) through the real scheduler: a slot resuming its own state, context checkpoints
(the state's snapshots) restoring an earlier prefix, the whole-prompt host cache carrying
them, slot files, agent sessions on fewer slots than sessions, and the refusals (speculative
decoding, the disk tier, context shift).

Every answer is compared, token for token, with the same prompt computed alone with no cache
of any kind (deterministic bf16: cached == uncached to the bit), and the reuse figures are
pinned so a run that silently recomputed everything cannot pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from radixserve.config import ServerConfig, SpecConfig
from radixserve.engine.build import build_scheduler
from radixserve.engine.counters import ServerMetrics
from radixserve.memory.host_tier import backend_name
from radixserve.model.loader import Model, load_model
from tests.engine.test_deterministic import drive, run_to_end
from tests.engine.test_lfm2_engine import N_TOOLS, agent_task, run_agents
from tests.engine.test_swa import Ref
from tests.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """A tiny Qwen3.5: 4 layers (three Gated DeltaNet, the last attention), 2 key heads and 4
    value heads of 16."""
    d = tmp_path_factory.mktemp("q35e")
    m = load_model(write_tiny_gguf(str(d / "q35.gguf"), arch="qwen35", ssm_heads=(2, 4),
                                   seed=21), "bf16", deterministic="on")
    assert m.deterministic and m.hp.recurrent and m.layout.n_recurrent == 3
    return m


@pytest.fixture(scope="module")
def ref(model: Model) -> Ref:
    return Ref(model)


def test_the_host_cache_is_the_whole_prompt_one(model: Model) -> None:
    """The radix tree keeps rows a token; a Gated DeltaNet's state has none, so the server
    keeps whole prompts (their states and checkpoints) whatever --cache-radix-prompt says."""
    for radix in (True, False):
        cfg = ServerConfig(cache_radix_prompt=radix)
        assert backend_name(cfg, model.layout) == "legacy"
        s = build_scheduler(model, cfg, ServerMetrics())
        assert s.mem.cache.name == "legacy"
        s.mem.close()
    assert backend_name(ServerConfig(cache_ram_mib=0), model.layout) == "none"


@pytest.mark.parametrize("kw, words", [
    (dict(spec=SpecConfig(types=("ngram-simple",))), "speculative decoding is not supported"),
    (dict(cache_disk="DIR"), "--cache-disk: the disk tier keeps rows a token"),
])
def test_what_the_state_cannot_do_is_refused(model: Model, tmp_path: Path, kw: dict,
                                             words: str) -> None:
    if kw.get("cache_disk") == "DIR":
        kw = {**kw, "cache_disk": str(tmp_path / "disk")}
    with pytest.raises(ValueError, match=words):
        build_scheduler(model, ServerConfig(**kw), ServerMetrics())


def test_context_shift_is_off(model: Model) -> None:
    s = build_scheduler(model, ServerConfig(context_shift=True), ServerMetrics())
    assert not any(slot.context_shift for slot in s.slots)
    s.mem.close()


def test_agents_compute_the_minimum_plus_the_lost_histories(model: Model, ref: Ref) -> None:
    """Agent sessions (5 on 2 slots, chat prompts: a user message, so a checkpoint, at the
    shared tools' end) with the whole-prompt cache: every answer equals its prompt's alone,
    and the prompt tokens computed are LFM2's figure on the same workload (390 = the unshared
    minimum 170 plus the histories llama.cpp's whole-prompt rule drops): the state is kept
    whole, yet a checkpoint at the tools' end gives every later request the 60 tools."""
    finals, sent, minimum, s = run_agents(model, ref, radix=True, chat=True)
    assert s.mem.cache.name == "legacy"
    computed = sum(f.timings.prompt_n for f in finals)
    assert [f.timings.cache_n for f in finals] == [0] + [N_TOOLS] * (len(sent) - 1)
    assert (computed, minimum) == (390, 170)


def test_a_slot_resumes_its_state_and_an_edit_restores_a_checkpoint(model: Model,
                                                                     ref: Ref) -> None:
    """One slot: a prompt, then the same prompt with its answer and a new turn (the slot's
    own state after its last token serves it), then the first prompt with its last tokens
    edited (the slot's state is past the edit: a checkpoint before it serves); each answer
    equals its prompt's alone."""
    s = build_scheduler(model, ServerConfig(ctx_size=512, n_parallel=1, cache_ram_mib=0),
                        ServerMetrics())
    base = [300 + 7 * i for i in range(40)]

    def alone(p: list[int]) -> list[int]:
        return drive(ref.sched, [agent_task(p, chat=False, cache_prompt=False)])[0]

    first = run_to_end(s, [agent_task(base, chat=False)])[0]
    assert first.tokens == alone(base)
    follow = base + first.tokens + [900, 901, 902]
    got = run_to_end(s, [agent_task(follow, chat=False)])[0]
    assert got.tokens == alone(follow)
    # the slot held base + all but the last answer token: everything up to it is reused
    assert got.timings.cache_n == len(base) + len(first.tokens) - 1
    edited = base[:-2] + [5001, 5002]
    got = run_to_end(s, [agent_task(edited, chat=False)])[0]
    assert got.tokens == alone(edited)
    assert 0 < got.timings.cache_n <= len(base) - 2
    s.mem.close()
