"""Slot save/restore/erase on a real Scheduler with the tiny model: real files, real KV states."""

from __future__ import annotations

import errno
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from radixserve.memory.tiers.slot_file import (
    Checkpoint,
    main_size,
    read_slot_file,
    write_slot_file,
)
from radixserve.config import ServerConfig
from radixserve.engine.counters import ServerMetrics
from radixserve.engine.build import build_scheduler
from radixserve.engine.scheduler import Scheduler
from radixserve.memory.slot_files import NOT_SUPPORTED, slot_action
from radixserve.engine.task import CompletionTask, FinalResult
from radixserve.errors import TaskError
from radixserve.memory.pool.state import fingerprint_of, get_state
from radixserve.model.loader import Model, load_model
from radixserve.sampling.chain import SamplingParams

PROMPT = [1000 + 7 * i for i in range(12)]
OTHER = [3000 + 5 * i for i in range(9)]


@pytest.fixture(scope="module")
def model(tiny_path: str) -> Model:
    return load_model(tiny_path, "f32", weights="native")


def make_sched(model: Model, save_dir: Path | None, ctx: int = 256,
               unified: bool = False) -> Scheduler:
    # no host cache: a continuation's cache_n must come from the restored slot alone
    cfg = ServerConfig(ctx_size=ctx, n_parallel=2, kv_unified=unified, cache_ram_mib=0,
                       slot_save_path=str(save_dir) if save_dir else None)
    return build_scheduler(model, cfg, ServerMetrics())


def run(sched: Scheduler, prompt: list[int], id_slot: int, n_predict: int = 6,
        salt: str = "") -> FinalResult:
    out: list[Any] = []
    sched.submit(CompletionTask(prompt, SamplingParams(temperature=0), n_predict=n_predict,
                                id_slot=id_slot, cache_salt=salt), out.append)
    while sched.has_active():
        sched.step()
    assert isinstance(out[-1], FinalResult), out[-1]
    return out[-1]


def snapshot(sched: Scheduler, slot: int) -> tuple[list[int], bytes]:
    pool = sched.pool
    fp = fingerprint_of(pool, sched.model.hp.arch)
    return list(sched.slots[slot].tokens), get_state(pool, slot, fp)


def timed_action(sched: Scheduler, *args: Any) -> tuple[dict[str, Any], float]:
    """The action's answer and the wall time around it, in ms (a bound for its own timing)."""
    t0 = time.perf_counter()
    res = sched.mem.slot_action(*args)
    return res, (time.perf_counter() - t0) * 1e3


def expect_error(status: int, fn, *args) -> TaskError:
    with pytest.raises(TaskError) as ei:
        fn(*args)
    assert ei.value.status == status, ei.value.message
    return ei.value


@pytest.mark.parametrize("unified", [False, True])
@pytest.mark.parametrize("target", [0, 1])
def test_save_erase_restore_continue(model: Model, tmp_path: Path, unified: bool, target: int):
    ref = make_sched(model, tmp_path, unified=unified)  # the never-erased slot
    sched = make_sched(model, tmp_path, unified=unified)
    first = run(ref, PROMPT, 0)
    assert run(sched, PROMPT, 0).tokens == first.tokens
    run(sched, OTHER, 1)  # slot 1 holds something else
    held = list(sched.slots[0].tokens)
    assert held == PROMPT + first.tokens[:-1]  # the last sampled token is not fed yet

    saved, wall_ms = timed_action(sched, 0, "save", "conv.bin")
    assert saved["id_slot"] == 0 and saved["filename"] == "conv.bin"
    assert saved["n_saved"] == len(held)
    assert saved["n_written"] == (tmp_path / "conv.bin").stat().st_size
    save_ms = saved["timings"]["save_ms"]  # the time of this save, not a placeholder
    assert isinstance(save_ms, float) and 0 < save_ms <= wall_ms
    state_before = snapshot(sched, 0)[1]

    erased = sched.mem.slot_action(0, "erase", None)
    assert erased == {"id_slot": 0, "n_erased": len(held)}
    assert sched.slots[0].tokens == [] and sched.pool.seq_len(0) == 0
    sched.pool.check()

    restored, wall_ms = timed_action(sched, target, "restore", "conv.bin")
    assert restored["id_slot"] == target and restored["n_restored"] == len(held)
    assert restored["n_read"] == main_size(read_slot_file(tmp_path / "conv.bin")[0])
    restore_ms = restored["timings"]["restore_ms"]
    assert isinstance(restore_ms, float) and 0 < restore_ms <= wall_ms
    assert snapshot(sched, target) == (held, state_before)
    sched.pool.check()

    # continue: the prompt is the conversation so far plus a follow-up
    follow = held + [first.tokens[-1], 2024, 2025]
    want = run(ref, follow, 0, n_predict=8)
    got = run(sched, follow, target, n_predict=8)
    assert got.timings.cache_n == want.timings.cache_n == len(held)  # the KV was reused
    assert got.tokens == want.tokens
    sched.pool.check()


def test_restored_kv_keeps_its_cache_salt(model: Model, tmp_path: Path):
    """A file saved from salt "A"'s KV serves, once restored, requests of salt "A" only; one
    saved from the shared namespace serves unsalted requests only. Reused or not, the greedy
    tokens are those of a fresh, uncached run."""
    sched = make_sched(model, tmp_path)
    first_a = run(sched, PROMPT, 0, salt="A")
    held_a = list(sched.slots[0].tokens)
    assert sched.slots[0].kv.salt == "A"
    sched.mem.slot_action(0, "save", "a.bin")
    assert read_slot_file(tmp_path / "a.bin")[0].salt == "A"
    first_s = run(sched, OTHER, 0)  # unsalted: the planner empties A's KV first
    held_s = list(sched.slots[0].tokens)
    assert held_s == OTHER + first_s.tokens[:-1] and sched.slots[0].kv.salt == ""
    sched.mem.slot_action(0, "save", "shared.bin")
    sched.mem.slot_action(0, "erase", None)  # only the restored slot holds either prefix now

    cases = (("a.bin", held_a + [first_a.tokens[-1], 2024, 2025], "A", len(held_a)),
             ("shared.bin", held_s + [first_s.tokens[-1], 2024, 2025], "", len(held_s)))
    for filename, follow, file_salt, n_held in cases:
        fresh = run(make_sched(model, None), follow, 0, n_predict=8)
        assert fresh.timings.cache_n == 0
        for salt in ("", "A", "B"):
            res = sched.mem.slot_action(1, "restore", filename)
            assert res["n_restored"] == n_held and sched.slots[1].kv.salt == file_salt
            got = run(sched, follow, 1, n_predict=8, salt=salt)
            want_cached = n_held if salt == file_salt else 0
            assert got.timings.cache_n == want_cached, (filename, salt)
            assert got.timings.prompt_n == len(follow) - want_cached
            assert got.tokens == fresh.tokens, (filename, salt)
            assert sched.slots[1].kv.salt == salt
            sched.pool.check()


def test_guards(model: Model, tmp_path: Path):
    off = make_sched(model, None)
    for action in ("save", "restore", "erase"):
        e = expect_error(501, slot_action, off.mem, 0, action, "x.bin")
        assert e.type == "not_supported_error" and e.message == NOT_SUPPORTED
    sched = make_sched(model, tmp_path)
    assert expect_error(400, slot_action, sched.mem, 0, "load", "x.bin").message == "Invalid action"
    for bad_id in (-1, 2, 99):
        e = expect_error(400, slot_action, sched.mem, bad_id, "save", "x.bin")
        assert e.message == "Invalid slot ID"
    for missing in (None, ""):
        expect_error(400, slot_action, sched.mem, 0, "save", missing)
    e = expect_error(400, slot_action, sched.mem, 0, "restore", "nope.bin")
    assert "not found" in e.message and e.type == "invalid_request_error"
    # a busy slot: every action is refused with 409 and nothing changes
    out: list[Any] = []
    sched.submit(CompletionTask(PROMPT, SamplingParams(temperature=0), n_predict=4, id_slot=0),
                 out.append)
    assert sched.slots[0].is_processing
    for action in ("save", "restore", "erase"):
        e = expect_error(409, slot_action, sched.mem, 0, action, "x.bin")
        assert e.type == "invalid_request_error"
    assert not (tmp_path / "x.bin").exists()
    while sched.has_active():
        sched.step()
    assert isinstance(out[-1], FinalResult)
    assert sched.mem.slot_action(0, "save", "x.bin")["n_saved"] > 0
    # a directory's name is the client's mistake (400, as its restore), not a server error
    (tmp_path / "adir").mkdir()
    for action in ("save", "restore"):
        expect_error(400, slot_action, sched.mem, 0, action, "adir")
    assert (tmp_path / "adir").is_dir() and not list((tmp_path / "adir").iterdir())


def test_restore_rejects_other_model_and_dtype(model: Model, tiny_paths: dict[str, str],
                                               tmp_path: Path):
    sched = make_sched(model, tmp_path)
    run(sched, PROMPT, 1, n_predict=2)
    before = snapshot(sched, 1)
    for label, other in (("arch", load_model(tiny_paths["qwen2"], "f32")),
                         ("dtype", load_model(tiny_paths["llama"], "bf16"))):
        foreign = make_sched(other, tmp_path)
        run(foreign, PROMPT, 0, n_predict=2)
        foreign.mem.slot_action(0, "save", f"{label}.bin")
        e = expect_error(400, slot_action, sched.mem, 1, "restore", f"{label}.bin")
        assert label in e.message and "another model, dtype or cache type" in e.message
        assert snapshot(sched, 1) == before
        sched.pool.check()


def test_restore_checks_tokens_positions_and_space(model: Model, tmp_path: Path):
    sched = make_sched(model, tmp_path, ctx=64, unified=True)
    run(sched, PROMPT * 3, 0, n_predict=1)  # 36 tokens
    sched.mem.slot_action(0, "save", "big.bin")
    sf, _ = read_slot_file(tmp_path / "big.bin")
    bad = {
        "tokens.bin": (sf.tokens[:-1] + [10**9], "Invalid tokens"),
        "count.bin": (sf.tokens + [5], "do not match its KV state"),
    }
    for name, (tokens, _) in bad.items():
        write_slot_file(tmp_path / name, type(sf)(tokens, sf.state))
    sched.mem.slot_action(0, "erase", None)
    run(sched, OTHER * 4, 1, n_predict=1)  # 36 tokens in slot 1: 28 cells left of 64
    before = snapshot(sched, 0), snapshot(sched, 1)
    for name, (_, msg) in bad.items():
        assert msg in expect_error(400, slot_action, sched.mem, 0, "restore", name).message
    e = expect_error(400, slot_action, sched.mem, 0, "restore", "big.bin")
    assert "No available space" in e.message
    assert (snapshot(sched, 0), snapshot(sched, 1)) == before
    sched.pool.check()
    small = make_sched(model, tmp_path, ctx=64)  # partitioned: 32 cells per slot
    e = expect_error(400, slot_action, small.mem, 0, "restore", "big.bin")
    assert "does not fit" in e.message


@dataclass
class Saved:
    """A saved slot file with a real checkpoint and a draft appendix, and a scheduler to restore
    into (slot 1 holds other tokens)."""

    sched: Scheduler
    dir: Path
    good: bytes  # the whole file
    main_end: int  # where the appendices start
    content: tuple[list[int], bytes]  # the saved slot's tokens and KV state

    def restore(self, data: bytes) -> bool:
        """Restore `data` into slot 1: an error leaves it untouched, success gives the main part."""
        (self.dir / "v.bin").write_bytes(data)
        before = snapshot(self.sched, 1)
        main_ok = len(data) >= self.main_end and data[: self.main_end] == self.good[: self.main_end]
        try:
            res = self.sched.mem.slot_action(1, "restore", "v.bin")
        except TaskError as e:
            assert e.status == 400 and e.message.startswith("Unable to restore slot: ")
            assert snapshot(self.sched, 1) == before
            assert not main_ok, e.message
            ok = False
        else:
            assert main_ok
            assert res["n_restored"] == len(self.content[0]) and res["n_read"] == self.main_end
            assert snapshot(self.sched, 1) == self.content
            ok = True
        self.sched.pool.check()
        return ok


def saved_file(model: Model, tmp_path: Path) -> Saved:
    sched = make_sched(model, tmp_path)
    run(sched, PROMPT[:4], 0, n_predict=2)  # 5 tokens: a ~2.6 KiB state
    run(sched, OTHER[:3], 1, n_predict=2)
    content = snapshot(sched, 0)
    sched.mem.slot_action(0, "save", "s.bin")
    sf, warnings = read_slot_file(tmp_path / "s.bin")
    assert warnings == [] and sf.checkpoints == [] and (sf.tokens, sf.state) == content
    pool = sched.pool
    ckpt_state = get_state(pool, 1, fingerprint_of(pool, sched.model.hp.arch))
    sf.checkpoints = [Checkpoint(3, 0, 2, ckpt_state, b"d", b""), Checkpoint(1, 0, 0, b"t")]
    sf.draft, sf.speculative = b"draft-state", b"spec"
    total = write_slot_file(tmp_path / "s.bin", sf)
    good = (tmp_path / "s.bin").read_bytes()
    assert len(good) == total
    return Saved(sched, tmp_path, good, main_size(sf), content)


def test_truncated_at_every_offset(model: Model, tmp_path: Path):
    """Every prefix of the file (main part, checkpoint and draft appendices): no byte skipped."""
    sv = saved_file(model, tmp_path)
    restored = [n for n in range(len(sv.good) + 1) if sv.restore(sv.good[:n])]
    assert restored == list(range(sv.main_end, len(sv.good) + 1))  # appendix cuts: main kept


def test_random_byte_flips(model: Model, tmp_path: Path):
    """The checksum catches every flip in the main part; appendix flips never fail a restore."""
    sv = saved_file(model, tmp_path)
    rng = random.Random(6)
    offsets = list(range(sv.main_end - 40, len(sv.good)))  # the main part's tail, the appendices
    offsets += [rng.randrange(len(sv.good)) for _ in range(300)]
    outcomes = set()
    for off in offsets:
        data = bytearray(sv.good)
        data[off] ^= 1 << rng.randrange(8)
        outcomes.add((off >= sv.main_end, sv.restore(bytes(data))))
    assert outcomes == {(False, False), (True, True)}


BAD_NAMES = ["../x", "/etc/passwd", "a/b", "a\\b", ".hidden", "..", ".", "x" * 256, "é" * 128,
             "a\x00b", "a\nb", "x..y", " lead", "trail.", "a:b", "\ud800"]


def test_path_traversal_rejected(model: Model, tmp_path: Path):
    save_dir, outside = tmp_path / "slots", tmp_path / "outside"
    save_dir.mkdir()
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious")
    (save_dir / "link_out").symlink_to(outside / "victim")
    (save_dir / "link_dir").symlink_to(outside)
    (save_dir / "dangling").symlink_to(outside / "new")
    sched = make_sched(model, save_dir)
    run(sched, PROMPT[:4], 0, n_predict=2)
    before = snapshot(sched, 0)
    for name in BAD_NAMES + ["link_out", "link_dir", "dangling"]:
        for action in ("save", "restore"):
            e = expect_error(400, slot_action, sched.mem, 0, action, name)
            assert e.message.startswith("Invalid filename"), (name, e.message)
    assert snapshot(sched, 0) == before
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]
    assert (outside / "victim").read_bytes() == b"precious"
    assert sorted(p.name for p in save_dir.iterdir()) == ["dangling", "link_dir", "link_out"]
    assert not (tmp_path / "x").exists() and not (save_dir.parent / "passwd").exists()
    # fine: a 255-byte name, non-ASCII letters, inner spaces
    for name in ["é" * 127 + "x", "slot 1.bin", "日本語.bin"]:
        assert sched.mem.slot_action(0, "save", name)["n_saved"] == len(before[0])


def test_disk_full_keeps_old_file(model: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    sched = make_sched(model, tmp_path)
    run(sched, PROMPT[:4], 0, n_predict=2)
    sched.mem.slot_action(0, "save", "s.bin")
    old = (tmp_path / "s.bin").read_bytes()
    run(sched, OTHER, 0, n_predict=4)  # the slot now holds something else
    real_write, calls = os.write, [0]

    def full(fd: int, data: Any) -> int:
        calls[0] += 1
        if calls[0] > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    e = expect_error(500, slot_action, sched.mem, 0, "save", "s.bin")
    assert e.type == "server_error" and "No space left" in e.message
    monkeypatch.undo()
    assert (tmp_path / "s.bin").read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.bin"]  # no temp file left
    assert sched.mem.slot_action(1, "restore", "s.bin")["n_restored"] == 5
