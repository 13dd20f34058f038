"""--context-shift, n_cmpl children, n_indent and t_max_predict_ms in the engine (no HTTP).

The context-shift rule checked here is llama-server's (server-context.cpp pre_decode): when a
generating slot holds n_ctx - 1 tokens, keep n_keep (-1: the prompt; +1 for BOS; at most
n_ctx - 4), discard n_discard after them (0: half of the rest, clamped to n_left - 1) and move
the rest left. `expected_tokens` replays that rule on the token list independently of the
engine; the engine's slot must hold exactly that list after every step, and the pool must
hold exactly its positions (`Scheduler.check`).
"""

from __future__ import annotations

import time

import pytest

from radixserve.config import ServerConfig
from radixserve.engine.counters import ServerMetrics
from radixserve.engine.build import build_scheduler
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.slot import Slot, SlotState
from radixserve.engine.task import CompletionTask, FinalResult
from radixserve.model.loader import load_model
from radixserve.sampling.chain import Sampler, SamplingParams
from tests.engine.test_scheduler import run as drive


@pytest.fixture(scope="module")
def model(tiny_path):
    return load_model(tiny_path, "f32", weights="dequant")


def task(prompt, n=8, **kw) -> CompletionTask:
    return CompletionTask(list(prompt), SamplingParams(temperature=0), n_predict=n,
                          ignore_eos=True, **kw)


def sched_of(model, **kw) -> Scheduler:
    cfg = dict(ctx_size=64, n_parallel=1, cache_ram_mib=0, context_shift=True)
    return build_scheduler(model, ServerConfig(**(cfg | kw)), ServerMetrics())


def expected_tokens(prompt, generated, n_ctx, n_keep, n_discard, add_bos) -> list[int]:
    """The slot's token list after feeding `generated` back, by llama-server's rule."""
    toks = list(prompt)
    for t in generated:
        if len(toks) + 1 >= n_ctx:
            keep = len(prompt) if n_keep < 0 else n_keep
            keep = min(n_ctx - 4, keep + (1 if add_bos else 0))
            n_left = len(toks) - keep
            d = n_discard or int(n_left / 2)
            d = min(max(d, 0), max(0, n_left - 1))
            toks = toks[:keep] + toks[keep + d :]
        toks.append(t)
    return toks


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("n_keep, n_discard", [(0, 0), (5, 0), (-1, 0), (3, 7), (200, 0)])
def test_generation_continues_past_the_context_as_llama_server(model, unified, n_keep,
                                                                n_discard):
    sched = sched_of(model, n_parallel=2, ctx_size=128, kv_unified=unified)
    n_ctx = sched.n_ctx_slot
    prompt = list(range(300, 320))
    t = task(prompt, n=3 * n_ctx, n_keep=n_keep, n_discard=n_discard, id_slot=0)
    slot = sched.slots[0]
    shifted = []

    def each_step() -> None:
        if slot.state is SlotState.GENERATING and slot.is_processing:
            want = expected_tokens(prompt, slot.generated[:-1], n_ctx, n_keep, n_discard,
                                   sched.tok.add_bos)
            assert list(slot.tokens) == want
            assert len(slot.tokens) < n_ctx
            shifted.append(slot.kv.shifted)

    out = drive(sched, [t], each_step)[0]
    final = out[-1]
    assert isinstance(final, FinalResult), final
    assert len(final.tokens) == 3 * n_ctx and final.truncated and final.stop_type == "limit"
    assert any(shifted)
    # the shifted KV is gone with the task: nothing can reuse it
    assert slot.tokens == [] and not slot.kv.shifted
    assert sched.pool.n_free == sched.pool.n_cells


def test_without_context_shift_the_task_stops_truncated(model):
    sched = sched_of(model, context_shift=False)
    final = drive(sched, [task(range(300, 320), n=500)])[0][-1]
    assert final.truncated and final.stop_type == "limit"
    assert 20 + len(final.tokens) == sched.n_ctx_slot  # stopped when n_tokens + 1 == n_ctx
    assert len(sched.slots[0].tokens) == sched.n_ctx_slot - 1  # kept for reuse (not shifted)


@pytest.mark.parametrize("cache", ["none", "legacy", "radix"])
def test_shifted_kv_is_never_reused(model, cache):
    """While the shifted task runs, and after it, a request for the slot's token list computes
    it all and equals a run with no cache at all (device sharing, own slot, host tier)."""
    kw = {"none": dict(cache_ram_mib=0), "legacy": dict(cache_ram_mib=64),
          "radix": dict(cache_ram_mib=64, cache_radix_prompt=True)}[cache]
    sched = sched_of(model, n_parallel=2, ctx_size=256, kv_unified=True,
                     kv_unified_per_slot=128, **kw)
    prompt = list(range(400, 430))
    first = task(prompt, n=200, id_slot=0)  # two shifts: at 127 and 127 + 63 tokens
    first.params = SamplingParams(temperature=1.0, seed=42)  # varied tokens
    slot = sched.slots[0]
    outs = [[]]
    sched.submit(first, outs[0].append)
    while not slot.kv.shifted:
        sched.step()
        sched.check()
    during = list(slot.tokens)
    second = task(during, n=6, id_slot=1)
    outs.append([])
    sched.submit(second, outs[1].append)
    seen = []
    while sched.has_active() or sched.deferred:
        sched.step()
        sched.check()
        if slot.is_processing:
            seen.append(list(slot.tokens))
    held_at_end = outs[0][-1]
    assert isinstance(held_at_end, FinalResult) and held_at_end.truncated
    b = outs[1][-1]
    assert b.timings.cache_n == 0 and b.timings.prompt_n == len(during)

    fresh = sched_of(model, n_parallel=1, ctx_size=128, cache_ram_mib=0)
    alone = drive(fresh, [task(during, n=6, cache_prompt=False)])[0][-1]
    assert b.tokens == alone.tokens
    # after the task: the last token list the shifted slot held, again on that slot; the only
    # legitimate source is slot 1's fresh KV (and the host copy of it)
    late = seen[-1]
    fresh_kv = during + b.tokens[:-1]  # what slot 1 holds, computed fresh
    legit = next((i for i, (x, y) in enumerate(zip(late, fresh_kv)) if x != y),
                 min(len(late), len(fresh_kv)))
    assert legit < len(late) - 1  # reusing the shifted KV would show as cache_n > legit
    again = drive(sched, [task(late, n=6, id_slot=0)])[0][-1]
    alone = drive(fresh, [task(late, n=6, cache_prompt=False)])[0][-1]
    assert again.timings.cache_n <= legit and again.tokens == alone.tokens


# -- n_indent and t_max_predict_ms on a slot, with scripted token pieces ---------------------
class _Tok:
    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def is_eog(self, t: int) -> bool:
        return False

    def token_to_piece(self, t: int, special: bool = False) -> bytes:
        return self.pieces[t].encode()


class _KV:
    seq = 0
    tokens: list[int] = []

    def __len__(self) -> int:
        return 0


def feed(pieces: list[str], **kw) -> tuple[Slot, int]:
    """Accept the pieces in order; returns the slot and how many were accepted."""
    slot = Slot(_KV(), n_ctx=10_000)  # type: ignore[arg-type]
    t = CompletionTask([1], SamplingParams(temperature=0), stream=False, **kw)
    slot.start(t, Sampler(t.params, len(pieces), [1]), lambda _: None, [], 0)
    slot.t_first = time.perf_counter()
    tok = _Tok(pieces)
    for i in range(len(pieces)):
        if slot.accept(i, None, tok):  # type: ignore[arg-type]
            return slot, i + 1
    return slot, len(pieces)


def test_n_indent_stops_at_a_less_indented_line_and_cuts_it():
    pieces = ["def f():", "\n", "    ", "return 1", "\n", "x = 2", "\n", "y"]
    slot, n = feed(pieces, n_indent=4)
    assert n == 6 and slot.stop_type == "limit"
    assert slot.text == "def f():\n    return 1\n"  # cut after the (missing) indentation
    slot, n = feed(pieces[:5] + ["    z"], n_indent=4)
    assert n == 6 and slot.stop_type == "none"
    slot, n = feed(pieces, n_indent=0)
    assert n == len(pieces) and slot.stop_type == "none"


def test_t_max_predict_ms_stops_at_a_newline_after_the_time():
    pieces = ["a", "b\n", "c", "d\n", "e"]
    slot, n = feed(pieces, t_max_predict_ms=60_000)
    assert n == len(pieces) and slot.has_new_line  # within the time: no stop
    slot = Slot(_KV(), n_ctx=10_000)  # type: ignore[arg-type]
    t = CompletionTask([1], SamplingParams(temperature=0), stream=False, t_max_predict_ms=5)
    slot.start(t, Sampler(t.params, len(pieces), [1]), lambda _: None, [], 0)
    slot.t_first = time.perf_counter() - 1.0  # the first token came a second ago
    tok = _Tok(pieces)
    done = [slot.accept(i, None, tok) for i in range(2)]  # type: ignore[arg-type]
    assert done == [False, True] and slot.stop_type == "limit" and slot.text == "ab\n"
