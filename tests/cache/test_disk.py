"""The disk tier's files (cache/disk.py) on their own: keys, round trips, damage, the LRU bound,
a full disk, two tiers on one directory, flush; and the radix cache writing through to it."""

from __future__ import annotations

import errno
import os
import random
import threading

import pytest
import torch

from radixserve.cache.disk import SUFFIX, DiskTier, RowSpec
from radixserve.cache.radix import RadixPromptCache
from tests.cache.test_radix import fake_pool, fill, pool_rows, prefix_hashes

B = 4  # tokens a block
LAYOUT = [RowSpec(2, 1, 3, torch.bfloat16)] * 2 + [RowSpec(1, 1, 2, torch.float32)] * 2


def block_rows(tokens: list[int], pos0: int, n: int) -> list[torch.Tensor]:
    """Rows of tokens[pos0:pos0+n] for LAYOUT: values a function of the token prefix."""
    hs = torch.tensor(prefix_hashes(tokens)[pos0:pos0 + n])
    out = []
    for i, spec in enumerate(LAYOUT):
        base = (hs % 1000).view(1, 1, n, 1) + i
        t = base + torch.arange(spec.n_layer * spec.head_dim).view(spec.n_layer, 1, 1, -1)[
            :, :, :, :spec.head_dim] * 0.5
        out.append(t.expand(spec.n_layer, spec.n_head_kv, n, spec.head_dim).to(spec.dtype)
                   .contiguous())
    return out


def tier(path, fp: bytes = b"model-a", limit: int = 0, fault=None) -> DiskTier:
    return DiskTier(str(path), limit, B, fp, LAYOUT, fault=fault)


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


def test_full_disk_leaves_nothing_behind_and_serving_goes_on(tmp_path):
    full = threading.Event()
    full.set()

    def fault(op: str) -> None:
        if op == "write" and full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")

    d = tier(tmp_path, fault=fault)
    write_prompt(d, TOKENS)
    f = d.figures()
    assert f["write_errors"] == 4 and f["writes"] == 0 and files(tmp_path) == []
    assert not d.known and not d.queued  # a later save tries again
    full.clear()
    assert write_prompt(d, TOKENS) == 4 and len(files(tmp_path)) == 4
    assert read_prompt(d, TOKENS).rows
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
    assert cache.save(pool, 0, tokens)
    d.drain()
    assert d.figures()["writes"] == 3
    cache.close()
    fresh, d2 = radix_over_disk(tmp_path)  # a restart
    prompt = tokens + [77]
    ticket = fresh.disk_lookup(prompt, "", 0)
    assert ticket is not None
    d2.drain()
    assert fresh.take_disk_loads() == [ticket]
    pool.seq_rm(0)
    assert fresh.load(pool, 1, [], prompt) == tokens[:12]
    expect = torch.tensor(prefix_hashes(tokens)[:12])
    assert torch.equal(pool_rows(pool, 1), expect)
    assert fresh.disk_lookup(prompt, "", 0) is None  # the tree has it now
    assert fresh.disk_lookup(prompt, "other salt", 0) is not None  # another namespace
    fresh.check()
    fresh.close()


def test_evicted_leaves_reach_disk_and_come_back(tmp_path):
    pool = fake_pool()
    cache, d = radix_over_disk(tmp_path)
    a = list(range(1, 10))
    fill(pool, 0, a)
    cache.save(pool, 0, a)
    d.drain()
    for f in files(tmp_path):  # as if write-through had been lost
        os.unlink(f)
    d.known.clear()
    cache.limit_bytes = 1
    cache.update()  # evicts the leaf: its 2 whole blocks are written first
    d.drain()
    assert cache.tree.n_nodes == 0 and d.figures()["writes"] == 4
    assert cache.disk_lookup(a + [5], "", 0) is None  # 1 byte of RAM: nothing worth reading
    cache.limit_bytes = 0
    ticket = cache.disk_lookup(a + [5], "", 0)
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
    cache.save(pool, 0, tokens)
    d.drain()
    cache.tree.clear()
    ticket = cache.disk_lookup(tokens, "", 0)
    if keep:
        fill(pool, 0, tokens[:keep])
        cache.save(pool, 0, tokens[:keep])
    d.drain()
    cache.take_disk_loads()
    assert cache.tree.match(tokens).length == 16 and ticket
    cache.check()
    pool.seq_rm(0)
    assert cache.load(pool, 1, [], tokens) == tokens[:16]
    assert torch.equal(pool_rows(pool, 1), torch.tensor(prefix_hashes(tokens)[:16]))
    cache.close()
