"""The disk tier's files (memory/tiers/disk.py) on their own: keys, round trips, damage, the LRU bound,
a full disk (injected, and a real one filled by others), processes sharing a directory, flush,
the directory as a trust boundary (modes, a key, what names the files); and the radix cache
writing through to it."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import multiprocessing
import os
import random
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from radixserve.memory.key import PromptKey
from radixserve.memory.tiers.disk import DiskTier
from radixserve.memory.checkpoint import seal
from radixserve.memory.tiers.disk_block import (DIGEST, FILE_PERSON, SNAP_SUFFIX, SUFFIX, RowSpec,
                                                load_key)
from radixserve.memory.tiers.radix import RadixPromptCache
from radixserve.config import ServerConfig
from radixserve.memory.host_tier import make_disk
from radixserve.model.kernel_config import KernelConfig
from radixserve.model.loader import Model
from tests.cache.test_radix import fake_pool, fill, pool_rows, prefix_hashes
from tests.conftest import restore

B = 4  # tokens a block
LAYOUT = [RowSpec(2, 1, 3, torch.bfloat16)] * 2 + [RowSpec(1, 1, 2, torch.float32)] * 2


def block_rows(tokens: list[int], pos0: int, n: int) -> list[torch.Tensor]:
    """Rows of tokens[pos0:pos0+n] for LAYOUT: values a function of the token prefix."""
    hs = torch.tensor(prefix_hashes(tokens)[pos0:pos0 + n])
    out = []
    for i, spec in enumerate(LAYOUT):
        base = (hs % 1000).view(1, 1, n, 1) + i
        t = base + torch.arange(spec.n_layer * spec.width).view(spec.n_layer, 1, 1, -1)[
            :, :, :, :spec.width] * 0.5
        out.append(t.expand(spec.n_layer, spec.n_head_kv, n, spec.width).to(spec.dtype)
                   .contiguous())
    return out


def tier(path, fp: bytes = b"model-a", limit: int = 0, **kw) -> DiskTier:
    return DiskTier(str(path), limit, B, fp, LAYOUT, **kw)


def write_prompt(d: DiskTier, tokens: list[int], ns: str = "") -> int:
    """Write every whole block of `tokens` (each row split in two pieces, as edges split it)."""
    n = len(tokens) // B
    for j, key in enumerate(d.keys(ns, tokens, n)):
        rows = block_rows(tokens, j * B, B)
        d.write(key, j * B, tokens[j * B:(j + 1) * B], [[t[:, :, :1], t[:, :, 1:]] for t in rows])
    d.drain()
    return n


def read_prompt(d: DiskTier, tokens: list[int], ns: str = "", j0: int = 0):
    n = len(tokens) // B
    keys = d.keys(ns, tokens, n)[j0:]
    ticket = d.load(ns, tokens[:n * B], j0, keys)
    d.drain()
    got = d.take_loaded()
    assert [g.ticket for g in got] == [ticket]
    return got[0]


def files(path) -> list[str]:
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs)


TOKENS = list(range(100, 118))  # 4 whole blocks and 2 tokens


def test_round_trip_is_bitwise_and_stops_at_the_first_missing_block(tmp_path):
    d = tier(tmp_path)
    assert write_prompt(d, TOKENS) == 4
    assert len(files(tmp_path)) == 4 and all(f.endswith(SUFFIX) for f in files(tmp_path))
    got = read_prompt(d, TOKENS)
    assert got.start == 0 and got.tokens == TOKENS[:16]
    for i, t in enumerate(got.rows):
        assert t.dtype == LAYOUT[i].dtype
        assert torch.equal(t, block_rows(TOKENS, 0, 16)[i])
    got = read_prompt(d, TOKENS, j0=2)  # from the third block on
    assert got.start == 8 and torch.equal(got.rows[0], block_rows(TOKENS, 8, 8)[0])
    os.unlink(d._path(d.keys("", TOKENS, 3)[2]))  # evicted by someone: a hole at block 2
    got = read_prompt(d, TOKENS)
    assert got.tokens == TOKENS[:8] and got.rows[0].shape[2] == 8
    f = d.figures()
    assert (f["hits"], f["misses"], f["hit_tokens"], f["writes"]) == (3, 0, 16 + 8 + 8, 4)
    d.close()


def test_keys_cover_model_salt_and_the_whole_chain(tmp_path):
    d = tier(tmp_path)
    k = d.keys("", TOKENS, 4)
    assert len(set(k)) == 4
    assert d.keys("tenant", TOKENS, 4)[0] != k[0]
    other = tier(tmp_path / "b", fp=b"model-b")
    assert other.keys("", TOKENS, 4)[0] != k[0]
    changed = [999] + TOKENS[1:]  # a change in block 0 changes every later key
    assert all(a != b for a, b in zip(d.keys("", changed, 4), k))
    write_prompt(d, TOKENS)
    assert read_prompt(d, TOKENS, ns="tenant").rows == []  # another salt: nothing
    other.close()
    d.close()


def test_another_model_never_sees_the_files(tmp_path):
    d = tier(tmp_path)
    write_prompt(d, TOKENS)
    d.close()
    other = tier(tmp_path, fp=b"model-b")
    assert read_prompt(other, TOKENS).rows == []
    assert other.figures()["misses"] == 1 and len(files(tmp_path)) == 4
    other.close()


def test_a_file_under_another_blocks_name_is_a_bad_file(tmp_path):
    d = tier(tmp_path)
    write_prompt(d, TOKENS)
    k = d.keys("", TOKENS, 2)
    os.replace(d._path(k[0]), d._path(k[1]))  # block 0's bytes under block 1's name
    d.known.clear()
    got = read_prompt(d, TOKENS, j0=1)
    assert got.rows == [] and d.figures()["bad_files"] == 1
    assert not os.path.exists(d._path(k[1]))  # removed
    d.close()


def test_truncated_at_every_offset_and_flipped_bytes_are_misses(tmp_path):
    d = tier(tmp_path)
    write_prompt(d, TOKENS[:4])
    path = d._path(d.keys("", TOKENS, 1)[0])
    good = open(path, "rb").read()
    rng = random.Random(0)
    cases = [good[:n] for n in range(len(good))]
    for _ in range(60):
        bad = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
        cases.append(bytes(bad))
    for n_bad, data in enumerate(cases, 1):
        with open(path, "wb") as f:
            f.write(data)
        assert read_prompt(d, TOKENS[:4]).rows == []
        assert d.figures()["bad_files"] == n_bad and not os.path.exists(path)
    with open(path, "wb") as f:
        f.write(good)
    assert torch.equal(read_prompt(d, TOKENS[:4]).rows[1], block_rows(TOKENS, 0, 4)[1])
    d.close()


def test_a_file_longer_than_a_block_is_removed_unread(tmp_path):
    d = tier(tmp_path)
    key = d.keys("", TOKENS, 1)[0]
    os.makedirs(os.path.dirname(d._path(key)))
    with open(d._path(key), "wb") as f:
        f.truncate(d.block_bytes + (1 << 21))
    assert read_prompt(d, TOKENS[:4]).rows == [] and not os.path.exists(d._path(key))
    assert d.figures()["bad_files"] == 1 and d.figures()["bytes"] == 0
    d.close()


def test_nothing_read_before_a_flush_reaches_the_tree_after_it(tmp_path):
    """A read running when the flush comes belongs to the old epoch; the removal runs before
    any read queued after the flush, which then finds nothing."""
    gate, started = threading.Event(), threading.Event()

    def slow(op: str) -> None:
        if op == "read":
            started.set()
            assert gate.wait(30)

    d = tier(tmp_path, fault=slow)
    write_prompt(d, TOKENS)
    old = d.load("", TOKENS[:16], 0, d.keys("", TOKENS, 4))
    assert started.wait(30)
    fut = d.flush()
    new = d.load("", TOKENS[:16], 0, d.keys("", TOKENS, 4))
    gate.set()
    assert fut.result(30) == 4
    d.drain()
    got = {g.ticket: g for g in d.take_loaded()}
    assert got[old].rows == [] and got[new].rows == []
    d.fault = None
    d.close()


def test_a_failing_read_still_answers_its_ticket(tmp_path):
    def broken(op: str) -> None:
        if op == "read":
            raise RuntimeError("injected")

    d = tier(tmp_path, fault=broken)
    write_prompt(d, TOKENS)
    assert read_prompt(d, TOKENS).rows == []  # answered (empty), the thread still alive
    d.fault = None
    assert read_prompt(d, TOKENS).rows
    d.close()


def test_lru_bound_keeps_recently_read_blocks(tmp_path):
    probe = tier(tmp_path / "probe")
    write_prompt(probe, TOKENS[:4])
    size = os.path.getsize(files(tmp_path / "probe")[0])
    probe.close()
    d = tier(tmp_path / "d", limit=3 * size)
    prompts = [[p * 10 + i for i in range(4)] for p in range(1, 6)]
    for i, p in enumerate(prompts):
        write_prompt(d, p)
        if i >= 1:
            os.utime(d._path(d.keys("", prompts[0], 1)[0]))  # prompt 0 keeps being read
            assert read_prompt(d, prompts[0]).rows
    d._put(0, "scan")
    d.drain()
    on_disk = files(tmp_path / "d")
    assert sum(os.path.getsize(f) for f in on_disk) <= 3 * size
    assert d.figures()["evictions"] >= 2 and d.figures()["bytes"] <= 3 * size
    assert read_prompt(d, prompts[0]).rows  # the recently read block stayed
    assert read_prompt(d, prompts[1]).rows == []  # the oldest went
    d.close()


class FullDisk:
    """A `fault` whose writes (and free-space queries) fail with `code` while `full`, on a clock
    the test moves; it records when each write was tried."""

    def __init__(self, code: int = errno.ENOSPC) -> None:
        self.code, self.full, self.now, self.tries = code, False, 0.0, []

    def __call__(self, op: str) -> None:
        if op == "write":
            self.tries.append(self.now)
        if op in ("write", "room") and self.full:
            raise OSError(self.code, os.strerror(self.code))


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_full_disk_pauses_writes_for_a_doubling_interval_and_evicts_nothing(tmp_path, code):
    disk = FullDisk(code)
    d = tier(tmp_path, fault=disk, backoff=(1.0, 4.0), clock=lambda: disk.now)
    other = [7, 8, 9, 10]
    write_prompt(d, other)  # a block from before the disk filled
    before = {p: open(p, "rb").read() for p in files(tmp_path)}
    disk.full = True
    write_prompt(d, TOKENS)  # the first block is tried and fails; the other three dropped
    f = d.figures()
    assert (f["write_errors"], f["writes"], len(disk.tries)) == (4, 1, 2)
    assert {p: open(p, "rb").read() for p in files(tmp_path)} == before  # nothing evicted
    assert not set(d.keys("", TOKENS, 4)) & (d.known | d.queued)  # a later save tries again
    for pause in (1.0, 2.0, 4.0, 4.0):  # doubling, up to the longest
        n = len(disk.tries)
        disk.now += pause - 0.25
        write_prompt(d, TOKENS)
        assert len(disk.tries) == n  # still paused: dropped untried
        disk.now += 0.25
        write_prompt(d, TOKENS)
        assert len(disk.tries) == n + 1  # one try once the pause is over: fails, pauses again
    assert torch.equal(read_prompt(d, other).rows[0], block_rows(other, 0, 4)[0])  # reads go on
    disk.full = False
    if code == errno.EDQUOT:  # a quota does not show in the filesystem's free space: wait
        write_prompt(d, TOKENS)
        assert d.figures()["writes"] == 1
        disk.now += 4.0
    # a full filesystem: writing resumes as soon as it reports room again
    assert write_prompt(d, TOKENS) == 4 and d.figures()["writes"] == 5
    assert len(files(tmp_path)) == 5
    assert all(p.endswith(SUFFIX) for p in files(tmp_path))  # no temporary file left
    disk.full = True  # full again: a success reset the pause to the first one
    write_prompt(d, [1, 2, 3, 4])
    disk.now += 1.0
    n = len(disk.tries)
    write_prompt(d, [1, 2, 3, 4])
    assert len(disk.tries) == n + 1
    d.close()


def test_other_write_errors_do_not_pause_writing(tmp_path):
    disk = FullDisk(errno.EIO)
    disk.full = True
    d = tier(tmp_path, fault=disk, clock=lambda: disk.now)
    write_prompt(d, TOKENS)
    assert len(disk.tries) == 4 and d.figures()["write_errors"] == 4 and files(tmp_path) == []
    d.close()


@contextlib.contextmanager
def small_filesystem(path, size: str = "2m") -> Iterator[None]:
    """A tmpfs of `size` mounted at `path` (needs root): a disk that really fills."""
    os.makedirs(path)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                            str(path)], capture_output=True, text=True, timeout=30)
        err = r.stderr.strip() if r.returncode else ""
    except OSError as e:
        err = str(e)
    if err:
        pytest.fail(f"this test mounts a {size} tmpfs at {path} to fill a real disk, which "
                    f"needs root (or CAP_SYS_ADMIN): mount failed: {err}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True, timeout=30)


def fill_up(path) -> None:
    """Write `path` until the filesystem is full (to the last page)."""
    with open(path, "wb", buffering=0) as f:
        for chunk in (1 << 16, 1 << 12, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\xff" * chunk)


def test_a_disk_filled_by_others_costs_only_our_writes(tmp_path):
    """A real full disk (ENOSPC): everything that was there stays there (another server's
    blocks, our older ones, a file of someone else), nothing half-written is left, reads go on,
    and writes come back once there is room and the pause is over."""
    fs = tmp_path / "fs"
    with small_filesystem(fs):
        d = tier(fs, backoff=(0.05, 0.2))
        write_prompt(d, TOKENS)  # ours, from before the disk filled
        other = tier(fs, fp=b"model-b")  # another server's blocks
        for p in range(20):
            write_prompt(other, [p * 10 + i for i in range(4)])
        other.close()
        filler = fs / "someone-else.bin"
        fill_up(filler)
        os.truncate(filler, os.path.getsize(filler) - 6 * 4096)  # room for a few blocks
        before = {p: open(p, "rb").read() for p in files(fs)}
        prompts = ([1000 + p * 10 + i for i in range(4)] for p in range(1000))
        while d.figures()["write_errors"] == 0:  # until the disk is full
            write_prompt(d, next(prompts))
            assert d.figures()["writes"] < 100, "the tmpfs never filled up"
        write_prompt(d, next(prompts))  # offered while writing is paused: dropped, counted
        now = {p: open(p, "rb").read() for p in files(fs)}
        assert {p: now.get(p) for p in before} == before  # every file that was there, intact
        assert not [p for p in now if p.endswith(".tmp")]
        f = d.figures()
        assert f["write_errors"] >= 2 and f["evictions"] == 0
        got = read_prompt(d, TOKENS)  # serving from what is on disk goes on
        assert got.tokens == TOKENS[:16]
        assert all(torch.equal(a, b) for a, b in zip(got.rows, block_rows(TOKENS, 0, 16)))
        os.unlink(filler)
        time.sleep(0.25)  # past the longest pause
        p = next(prompts)
        write_prompt(d, p)
        assert d.figures()["writes"] == f["writes"] + 1
        assert os.path.exists(d._path(d.keys("", p, 1)[0]))
        d.close()


def test_two_tiers_on_one_directory_share_blocks(tmp_path):
    a, b = tier(tmp_path), tier(tmp_path)
    write_prompt(a, TOKENS)
    got = read_prompt(b, TOKENS)
    assert got.tokens == TOKENS[:16] and torch.equal(got.rows[2], block_rows(TOKENS, 0, 16)[2])
    write_prompt(b, TOKENS)  # already there: not written twice
    assert b.figures()["writes"] == 0
    a._flush()  # a removes everything while b knows the blocks
    assert read_prompt(b, TOKENS).rows == [] and b.figures()["bad_files"] == 0
    a.close()
    b.close()


SHARED = [list(range(200 + 8 * p, 208 + 8 * p)) for p in range(6)]  # 2 blocks each


def own_prompts(name: str) -> list[list[int]]:
    """Prompts only process `name` writes (6 of 2 blocks; they share no block with others')."""
    base = 5000 if name == "a" else 9000
    return [list(range(base + 8 * p, base + 8 * p + 8)) for p in range(6)]


def share_worker(directory: str, name: str, other: str, barrier, out) -> None:
    """One server process: write the shared prompts and its own, at the same time as the other
    process, then read the other's blocks back and check them bitwise."""
    try:
        d = tier(directory)
        barrier.wait(120)
        for p in [*SHARED, *own_prompts(name)]:
            write_prompt(d, p)
        barrier.wait(120)  # both wrote everything
        bitwise = []
        for p in [*own_prompts(other), *SHARED]:
            got = read_prompt(d, p)
            bitwise.append(got.tokens == p and all(
                torch.equal(a, b) for a, b in zip(got.rows, block_rows(p, 0, 8))))
        d.close()
        out.put((name, all(bitwise), d.figures()))
    except BaseException as e:  # reported, not hung: the parent waits on `out`
        out.put((name, False, repr(e)))
        raise


def test_processes_sharing_a_directory_read_each_others_blocks(tmp_path):
    """Two real processes write overlapping and distinct blocks to one directory at the same
    time, then each reads the other's bitwise."""
    ctx = multiprocessing.get_context("spawn")  # no fork of a process running torch threads
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=share_worker, args=(str(tmp_path), a, b, barrier, out))
             for a, b in (("a", "b"), ("b", "a"))]
    for p in procs:
        p.start()
    try:
        results = {name: (ok, figs) for name, ok, figs in (out.get(timeout=300) for _ in procs)}
    finally:
        for p in procs:
            p.join(60)
    assert [p.exitcode for p in procs] == [0, 0], results
    for name, (ok, figs) in results.items():
        assert ok, (name, figs)
        assert figs["bad_files"] == 0 and figs["write_errors"] == 0 and figs["hits"] == 12
    names = files(tmp_path)
    assert not [f for f in names if not f.endswith(SUFFIX)]  # no temporary file left
    assert len(names) == 2 * (len(SHARED) + 2 * 6)  # each block once
    assert results["a"][1]["writes"] + results["b"][1]["writes"] >= len(names)  # races: both


def test_stale_temporary_files_are_removed_and_fresh_ones_kept(tmp_path):
    d = tier(tmp_path)
    write_prompt(d, TOKENS[:4])
    sub = os.path.dirname(files(tmp_path)[0])
    old, new = os.path.join(sub, "x.kvb.1.2.tmp"), os.path.join(sub, "y.kvb.1.2.tmp")
    for p in (old, new):
        open(p, "wb").close()
    os.utime(old, (1, 1))
    d._put(0, "scan")
    d.drain()
    assert not os.path.exists(old) and os.path.exists(new)
    d.close()


def test_flush_removes_every_block_and_drops_queued_writes(tmp_path):
    d = tier(tmp_path)
    write_prompt(d, TOKENS)
    assert d.flush().result(10) == 4 and files(tmp_path) == []
    assert d.figures()["bytes"] == 0 and read_prompt(d, TOKENS).rows == []
    d.close()


# ----- the directory as a trust boundary ------------------------------------------------
@pytest.mark.parametrize("umask", [0o000, 0o277])
def test_directories_and_files_are_owner_only_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        d = tier(tmp_path / "new" / "kv")
        write_prompt(d, TOKENS)
        d.close()
    finally:
        os.umask(old)
    assert d.figures()["writes"] == 4

    def mode(p) -> int:
        return stat.S_IMODE(os.stat(p).st_mode)

    assert mode(tmp_path / "new") == mode(tmp_path / "new" / "kv") == 0o700
    for f in files(tmp_path / "new"):
        assert mode(f) == 0o600 and mode(os.path.dirname(f)) == 0o700


def key_file(path, secret: bytes) -> bytes:
    path.write_bytes(secret)
    return load_key(str(path))


def test_the_key_file_is_read_once_and_must_hold_a_secret(tmp_path):
    k = key_file(tmp_path / "a", b"s3cret\n")
    assert len(k) == 32 and k == key_file(tmp_path / "b", b"s3cret")  # the newline is not key
    assert k != key_file(tmp_path / "c", b"s3cret2")
    for secret in (b"", b"\n"):
        with pytest.raises(ValueError, match="is empty"):
            key_file(tmp_path / "e", secret)
    with pytest.raises(ValueError, match="cannot read"):
        load_key(str(tmp_path / "missing"))


def test_with_a_key_only_the_same_key_finds_the_files(tmp_path):
    k1, k2 = key_file(tmp_path / "k1", b"one"), key_file(tmp_path / "k2", b"two")
    kv = tmp_path / "kv"
    tiers = {"none": tier(kv), "k1": tier(kv, key=k1), "k1 again": tier(kv, key=k1),
             "k2": tier(kv, key=k2)}
    names = {n: set(t.keys("", TOKENS, 4)) for n, t in tiers.items()}
    assert names["k1"] == names["k1 again"]
    assert not names["none"] & names["k1"] and not names["k1"] & names["k2"]
    write_prompt(tiers["k1"], TOKENS)
    assert read_prompt(tiers["none"], TOKENS).rows == []
    assert read_prompt(tiers["k2"], TOKENS).rows == []
    got = read_prompt(tiers["k1 again"], TOKENS)
    assert all(torch.equal(a, b) for a, b in zip(got.rows, block_rows(TOKENS, 0, 16)))
    write_prompt(tiers["none"], TOKENS)
    write_prompt(tiers["k2"], TOKENS)
    assert len(files(kv)) == 12  # nobody removed anybody's files
    assert all(t.figures()["bad_files"] == 0 for t in tiers.values())
    for t in tiers.values():
        t.close()


@pytest.mark.parametrize("keyed", [False, True])
def test_a_block_forged_without_the_key_is_a_miss(tmp_path, keyed):
    """Someone who can write the directory but has no key rewrites a block's rows and its
    checksum as the format says: accepted without a key (the trust model: docs/SECURITY.md),
    a miss (removed) with one."""
    d = tier(tmp_path, key=key_file(tmp_path / "k", b"secret") if keyed else b"")
    write_prompt(d, TOKENS[:4])
    path = d._path(d.keys("", TOKENS, 1)[0])
    data = bytearray(open(path, "rb").read())
    data[-DIGEST - 1] ^= 0x40  # the last byte of the last row
    body = bytes(data[:-DIGEST])
    forged = body + hashlib.blake2b(body, digest_size=DIGEST, person=FILE_PERSON).digest()
    with open(path, "wb") as f:
        f.write(forged)
    got = read_prompt(d, TOKENS[:4])
    if keyed:
        assert got.rows == [] and d.figures()["bad_files"] == 1 and not os.path.exists(path)
    else:
        assert got.rows and not torch.equal(got.rows[3], block_rows(TOKENS, 0, 4)[3])
    d.close()


class Identified:
    """A model as make_disk sees it: its identity (it records where its digest may be kept)."""

    def __init__(self) -> None:
        self.memo: list[str | None] = []

    def identity(self, cache_dir: str | None = None) -> bytes:
        self.memo.append(cache_dir)
        return b"identity"


def test_make_disk_keys_the_tier_with_the_key_file(tmp_path):
    """With a key, names are keyed and the weights' digest is not kept in the directory (a
    writer without the key could plant a false one there)."""
    pool, model = fake_pool(), Identified()
    (tmp_path / "key").write_bytes(b"secret\n")
    base = dict(cache_disk=str(tmp_path / "kv"), cache_disk_block=B)
    plain = make_disk(ServerConfig(**base), pool, (model,))
    keyed = make_disk(ServerConfig(**base, cache_disk_key=str(tmp_path / "key")), pool,
                      (model,))
    assert stat.S_IMODE(os.stat(tmp_path / "kv").st_mode) == 0o700
    assert plain.keys("", TOKENS, 1) != keyed.keys("", TOKENS, 1)
    assert model.memo == [str(tmp_path / "kv"), None]
    plain.close()
    keyed.close()
    with pytest.raises(ValueError, match="disk cache key file .* is empty"):
        (tmp_path / "empty").write_bytes(b"")
        make_disk(ServerConfig(**base, cache_disk_key=str(tmp_path / "empty")), pool, (model,))


def test_model_identity_covers_kernel_build_torch_and_cpu_capability(tmp_path, monkeypatch):
    """What can change the KV's bits names the files: two identities that differ only in the
    kernels' build, torch's version or its CPU capability differ."""
    cfg = KernelConfig.from_env()
    kern = cfg.load()
    assert kern is not None, "the kernels did not build (is a C compiler installed?)"
    assert (cfg.cache_dir / f"radixserve-kernels-{kern.build_key}.so").exists()
    (tmp_path / "m.gguf").write_bytes(b"weights")
    tr = SimpleNamespace(kern=kern, own_attention=True, deterministic=True)
    m = Model(str(tmp_path / "m.gguf"), "hparams", None, None, tr, torch.bfloat16,
              torch.device("cpu"), 0.0, "native")  # type: ignore[arg-type]
    base = m.identity()
    seen = {base}
    with monkeypatch.context() as mp:
        mp.setattr(tr, "kern", SimpleNamespace(build_key="another build"))
        seen.add(m.identity())
    with monkeypatch.context() as mp:
        mp.setattr(torch, "__version__", "0.0.0+another")
        seen.add(m.identity())
    with monkeypatch.context() as mp:
        mp.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "ANOTHER")
        seen.add(m.identity())
    assert len(seen) == 4 and m.identity() == base


# ----- the radix cache over a disk tier -------------------------------------------------
def radix_over_disk(path, limit: int = 0) -> tuple[RadixPromptCache, DiskTier]:
    layout = [RowSpec(1, 1, 2, torch.float32)] * 2
    d = DiskTier(str(path), 0, B, b"fake", layout)
    return RadixPromptCache(limit, disk=d), d


def test_radix_writes_through_and_a_new_cache_restores_from_disk(tmp_path):
    pool = fake_pool()
    tokens = list(range(1, 15))  # 3 whole blocks
    cache, d = radix_over_disk(tmp_path)
    fill(pool, 0, tokens)
    assert cache.save(pool, 0, PromptKey("", tokens))
    d.drain()
    assert d.figures()["writes"] == 3
    cache.close()
    fresh, d2 = radix_over_disk(tmp_path)  # a restart
    prompt = tokens + [77]
    ticket = fresh.disk_lookup(PromptKey("", prompt), 0)
    assert ticket is not None
    d2.drain()
    assert fresh.take_disk_loads() == [ticket]
    pool.seq_rm(0)
    assert restore(fresh, pool, 1, [], prompt) == tokens[:12]
    expect = torch.tensor(prefix_hashes(tokens)[:12])
    assert torch.equal(pool_rows(pool, 1), expect)
    assert fresh.disk_lookup(PromptKey("", prompt), 0) is None  # the tree has it now
    assert fresh.disk_lookup(PromptKey("other salt", prompt), 0) is not None  # another namespace
    fresh.check()
    fresh.close()


def test_evicted_leaves_reach_disk_and_come_back(tmp_path):
    pool = fake_pool()
    cache, d = radix_over_disk(tmp_path)
    a = list(range(1, 10))
    fill(pool, 0, a)
    cache.save(pool, 0, PromptKey("", a))
    d.drain()
    for f in files(tmp_path):  # as if write-through had been lost
        os.unlink(f)
    d.known.clear()
    cache.limit_bytes = 1
    cache.update()  # evicts the leaf: its 2 whole blocks are written first
    d.drain()
    assert cache.tree.n_nodes == 0 and d.figures()["writes"] == 4
    assert cache.disk_lookup(PromptKey("", a + [5]), 0) is None  # 1 byte of RAM: nothing worth reading
    cache.limit_bytes = 0
    ticket = cache.disk_lookup(PromptKey("", a + [5]), 0)
    d.drain()
    assert cache.take_disk_loads() == [ticket] and cache.tree.match(a).length == 8
    cache.check()
    cache.close()


@pytest.mark.parametrize("keep", [0, 5])
def test_disk_read_joins_what_the_tree_holds_now(tmp_path, keep):
    """The tree changed while a read ran: only the rows past its match go in (a copy)."""
    pool = fake_pool()
    tokens = list(range(1, 18))
    cache, d = radix_over_disk(tmp_path)
    fill(pool, 0, tokens)
    cache.save(pool, 0, PromptKey("", tokens))
    d.drain()
    cache.tree.clear()
    ticket = cache.disk_lookup(PromptKey("", tokens), 0)
    if keep:
        fill(pool, 0, tokens[:keep])
        cache.save(pool, 0, PromptKey("", tokens[:keep]))
    d.drain()
    cache.take_disk_loads()
    assert cache.tree.match(tokens).length == 16 and ticket
    cache.check()
    pool.seq_rm(0)
    assert restore(cache, pool, 1, [], tokens) == tokens[:16]
    assert torch.equal(pool_rows(pool, 1), torch.tensor(prefix_hashes(tokens)[:16]))
    cache.close()


@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_the_weights_digest_memo_is_owner_only_whatever_the_umask(tmp_path, umask):
    """The digest memo the disk tier keeps beside its blocks names a model file: like every
    file the server writes under a cache directory it is readable by its owner alone."""
    from radixserve.model.loader import weights_digest

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    cache = tmp_path / "kv"
    cache.mkdir(mode=0o700)
    old = os.umask(umask)
    try:
        first = weights_digest(str(model), str(cache))
    finally:
        os.umask(old)
    memos = list(cache.iterdir())
    assert len(memos) == 1 and memos[0].name.endswith(".digest")
    assert stat.S_IMODE(memos[0].stat().st_mode) == 0o600
    # the digest of the file's bytes, and what a restart reads back from the memo
    assert first == hashlib.blake2b(model.read_bytes(), digest_size=16).digest()
    memos[0].write_text("00" * 16)
    assert weights_digest(str(model), str(cache)) == bytes(16)


# -- snapshot files (a recurrent layout's state, beside the blocks) -------------------------
def state(n: int) -> bytes:
    """A sealed state standing for the one after n tokens (as the tree keeps snapshots)."""
    return seal(bytes([n % 256]) * (40 + n))


def snap_tier(path, **kw) -> DiskTier:
    return tier(path, max_blob=4096, **kw)


def write_snapshot(d: DiskTier, tokens: list[int], n: int, ns: str = "") -> str:
    """The snapshot file after tokens[:n] (its tail's rows split in pieces as edges split
    them); returns its path."""
    j = n // B
    prefix = ([d.root(ns)] + d.keys(ns, tokens, j))[j]
    key = d.snap_key(prefix, tokens[j * B:n])
    rows = block_rows(tokens, j * B, n - j * B)
    pieces = [[t[:, :, :1], t[:, :, 1:]] if n > j * B else [] for t in rows]
    assert d.write_snapshot(prefix, key, j * B, tokens[j * B:n], pieces, state(n))
    d.drain()
    return d._snap_path(prefix, n, key)


def read_snapshot(d: DiskTier, prompt: list[int], j0: int = 0, floor: int = 0,
                  ns: str = ""):
    """What a snapshot load of `prompt` (a restore: up to its last token but one) finds."""
    n = len(prompt) - 1
    prefixes = [d.root(ns)] + d.keys(ns, prompt, n // B)
    ticket = d.load_snapshot(ns, prompt[:n], j0, prefixes, floor, n // B)
    d.drain()
    got = d.take_loaded()
    assert [g.ticket for g in got] == [ticket]
    return got[0]


def test_snapshot_files_round_trip_through_a_scan_and_the_deepest_is_found(tmp_path):
    """Blocks and snapshot files (a tail of 2 tokens at 14, none at 8) written by one tier are
    found by another on the same directory (its scan indexes them by name): the deepest
    snapshot of the prompt with the blocks below it and its tail's rows, bit for bit; a
    prompt ending earlier gets the shallower one, another tail of the same length nothing."""
    d = snap_tier(tmp_path)
    write_prompt(d, TOKENS)
    write_snapshot(d, TOKENS, 14)
    write_snapshot(d, TOKENS, 8)
    assert d.figures()["snapshots"] == 2 and d.figures()["snapshot_writes"] == 2
    d.close()
    other = snap_tier(tmp_path)  # a restart: only the scan knows the files
    got = read_snapshot(other, TOKENS)
    assert (got.start, got.tokens, got.snapshot) == (0, TOKENS[:14], state(14))
    for i, t in enumerate(got.rows):
        assert t.dtype == LAYOUT[i].dtype and torch.equal(t, block_rows(TOKENS, 0, 14)[i])
    got = read_snapshot(other, TOKENS, j0=2)  # the tree holds 8 tokens: blocks 2.. only
    assert got.start == 8 and torch.equal(got.rows[0], block_rows(TOKENS, 8, 6)[0])
    got = read_snapshot(other, TOKENS[:14])  # n <= 13: the one at 8, no rows of a tail
    assert (got.tokens, got.snapshot, got.rows[1].shape[2]) == (TOKENS[:8], state(8), 8)
    assert read_snapshot(other, TOKENS, floor=14).rows == []  # nothing deeper than held
    assert read_snapshot(other, TOKENS[:12] + [5, 6, 7]).snapshot == state(8)  # another tail
    assert read_snapshot(other, TOKENS, ns="tenant").rows == []
    f = other.figures()
    assert (f["hits"], f["misses"], f["snapshots"], f["bad_files"]) == (4, 2, 2, 0)
    other.close()


def test_a_prompt_without_a_snapshot_reads_no_block(tmp_path):
    """Blocks alone serve a recurrent layout nothing: a load finds no snapshot and reads no
    block; once the directory was scanned, the index tells the engine not to ask at all."""
    reads: list[str] = []
    d = snap_tier(tmp_path, fault=reads.append)
    write_prompt(d, TOKENS)
    reads.clear()
    got = read_snapshot(d, TOKENS)
    assert got.rows == [] and reads == [] and d.figures()["misses"] == 1
    prefixes = [d.root("")] + d.keys("", TOKENS, 4)
    assert d.scanned and not d.may_have_snapshot(TOKENS[:17], prefixes, 0, 4)
    write_snapshot(d, TOKENS, 10)
    assert d.may_have_snapshot(TOKENS[:17], prefixes, 0, 4)
    assert not d.may_have_snapshot(TOKENS[:17], prefixes, 10, 4)  # not deeper than held
    assert not d.may_have_snapshot(TOKENS[:17], prefixes, 0, 1)  # past what may be read
    assert not d.may_have_snapshot(TOKENS[:8] + [1, 2, 3], prefixes, 0, 4)  # another tail
    d.close()


@pytest.mark.parametrize("damage", ["truncate", "flip", "seal", "rename"])
def test_a_bad_snapshot_file_is_a_miss_and_removed(tmp_path, damage):
    """A truncated file, flipped bytes, a state whose own seal fails (rewritten with a valid
    file checksum) or another snapshot's file under this name: a miss, removed; the load
    falls back to the next snapshot down (at 8) and serving never sees an error."""
    d = snap_tier(tmp_path)
    write_prompt(d, TOKENS)
    deep, shallow = write_snapshot(d, TOKENS, 14), write_snapshot(d, TOKENS, 8)
    data = bytearray(open(deep, "rb").read())
    if damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "flip":
        data[len(data) // 2] ^= 0x04
    elif damage == "seal":  # the state's CRC broken, the file re-checksummed (as a writer could)
        blob = bytearray(state(14))
        blob[3] ^= 1
        j = 14 // B
        prefix = d.keys("", TOKENS, j)[j - 1]
        key = d.snap_key(prefix, TOKENS[j * B:14])
        rows = [t.view(torch.uint8).numpy() for t in block_rows(TOKENS, j * B, 14 - j * B)]
        data = bytearray(b"".join(bytes(p) for p in d.format.encode(
            key, j * B, TOKENS[j * B:14], [[r] for r in rows], bytes(blob))))
    else:
        data = bytearray(open(shallow, "rb").read())
    with open(deep, "wb") as f:
        f.write(bytes(data))
    got = read_snapshot(d, TOKENS)
    assert (got.tokens, got.snapshot) == (TOKENS[:8], state(8))
    assert d.figures()["bad_files"] == 1 and not os.path.exists(deep) and os.path.exists(shallow)
    assert d.figures()["snapshots"] == 1
    d.close()


def test_a_snapshot_whose_blocks_went_gives_way_to_a_shallower_one(tmp_path):
    d = snap_tier(tmp_path)
    write_prompt(d, TOKENS)
    write_snapshot(d, TOKENS, 14)
    write_snapshot(d, TOKENS, 6)
    os.unlink(d._path(d.keys("", TOKENS, 3)[2]))  # block 2 evicted by someone
    got = read_snapshot(d, TOKENS)
    assert (got.tokens, got.snapshot) == (TOKENS[:6], state(6))
    os.unlink(d._path(d.keys("", TOKENS, 1)[0]))  # and block 0: nothing can serve
    assert read_snapshot(d, TOKENS).rows == []
    d.close()


def test_the_byte_limit_evicts_snapshot_files_with_blocks(tmp_path):
    """Blocks and snapshot files share one LRU under the byte limit: the prompts written
    first lose both kinds (their snapshot is then a miss); one read all along keeps both;
    what is left fits."""
    probe = snap_tier(tmp_path / "probe")
    write_prompt(probe, TOKENS[:9])
    write_snapshot(probe, TOKENS, 9)
    size = sum(map(os.path.getsize, files(tmp_path / "probe")))  # 2 blocks and a snapshot
    probe.close()
    d = snap_tier(tmp_path / "d", limit=3 * size)
    prompts = [[p * 100 + i for i in range(10)] for p in range(1, 7)]
    for i, p in enumerate(prompts):
        write_prompt(d, p[:9])
        write_snapshot(d, p, 9)
        if i >= 1:  # prompt 0 keeps being read (its files touched: the LRU signal)
            assert read_snapshot(d, prompts[0]).snapshot == state(9)
    d._put(0, "scan")
    d.drain()
    on_disk = files(tmp_path / "d")
    assert sum(map(os.path.getsize, on_disk)) <= 3 * size
    assert d.figures()["bytes"] <= 3 * size and d.figures()["evictions"] >= 2 * 3
    snaps = [f for f in on_disk if f.endswith(SNAP_SUFFIX)]
    assert 0 < len(snaps) < len(prompts) and d.figures()["snapshots"] == len(snaps)
    assert read_snapshot(d, prompts[0]).snapshot == state(9)  # kept, blocks and snapshot
    assert read_snapshot(d, prompts[1]).rows == []  # the oldest: both kinds went
    gone = [k for k in d.keys("", prompts[1], 2) if os.path.exists(d._path(k))]
    assert gone == [] and d.figures()["bad_files"] == 0
    d.close()
