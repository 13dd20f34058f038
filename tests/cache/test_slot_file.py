"""Slot snapshot files: layout, reading rules, file names, atomic writes, and a fuzzed reader."""

from __future__ import annotations

import errno
import os
import struct
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.memory.tiers.slot_file import (
    MAX_SALT,
    Checkpoint,
    SlotFile,
    SlotFileError,
    main_size,
    pack_slot_file,
    parse_slot_file,
    read_slot_file,
    resolve_in_dir,
    validate_filename,
    write_slot_file,
)
from radixserve.engine.batch import BatchSeq, forward
from radixserve.http.parse import MAX_CACHE_SALT
from radixserve.memory.pool.state import fingerprint_of, get_state, parse_state
from radixserve.model.forward import Transformer
from tests.conftest import make_pool

TOKENS = [11, 22, 33, 44, 55]
SALT = "tenant-Ä\U0001f600"  # 1-, 2- and 4-byte UTF-8 characters


@pytest.fixture(scope="module")
def real_states(tiny_tr: Transformer) -> tuple[bytes, bytes]:
    """Sequence states of the tiny model: 5 tokens, and its first 2 (a checkpoint's target)."""
    pool = make_pool(tiny_tr, n_cells=32, n_seq=2)
    forward(tiny_tr, pool, [BatchSeq(0, TOKENS, 0), BatchSeq(1, TOKENS[:2], 0)])
    fp = fingerprint_of(pool, tiny_tr.hp.arch)
    return get_state(pool, 0, fp), get_state(pool, 1, fp)


def full_file(states: tuple[bytes, bytes]) -> SlotFile:
    main, ckpt = states
    return SlotFile(TOKENS, main, [Checkpoint(2, 0, 1, ckpt, b"dft", b""),
                                   Checkpoint(-1, -5, 7, b"", b"", b"spec")], b"draft", b"spec!",
                    salt=SALT)


def packed(sf: SlotFile) -> bytes:
    return b"".join(pack_slot_file(sf))


def pack_v1(tokens: list[int], state: bytes) -> bytes:
    """A version-1 main part, packed as the version-1 writer did (no salt field)."""
    head = b"RXSL" + struct.pack(f"<II{len(tokens)}iQ", 1, len(tokens), *tokens, len(state))
    return head + state + struct.pack("<I", zlib.crc32(state, zlib.crc32(head)))


def main_v2(raw_salt: bytes, tokens: list[int], state: bytes) -> bytes:
    """A version-2 main part packed by hand, with any salt bytes (the writer only packs good
    ones) and a right CRC."""
    head = b"RXSL" + struct.pack(f"<II{len(raw_salt)}sI{len(tokens)}iQ", 2, len(raw_salt),
                                 raw_salt, len(tokens), *tokens, len(state))
    return head + state + struct.pack("<I", zlib.crc32(state, zlib.crc32(head)))


def boundaries(sf: SlotFile) -> tuple[int, int, int]:
    """(end of main part, end of checkpoint appendix, end of file)."""
    main = main_size(sf)
    ckpt = 12 + sum(16 + 24 + len(c.target) + len(c.draft) + len(c.speculative)
                    for c in sf.checkpoints)
    return main, main + ckpt, len(packed(sf))


# -- layout and round trips ------------------------------------------------------------------
def test_round_trip_with_real_state(real_states, tiny_tr: Transformer, tmp_path: Path):
    sf = full_file(real_states)
    n = write_slot_file(tmp_path / "a.bin", sf)
    assert n == (tmp_path / "a.bin").stat().st_size
    got, warnings = read_slot_file(tmp_path / "a.bin")
    assert got == sf and warnings == [] and got.salt == SALT
    pool_ = make_pool(tiny_tr)
    st_ = parse_state(got.state, fingerprint_of(pool_, tiny_tr.hp.arch), pool_.types)
    assert st_.positions == list(range(len(TOKENS)))


@pytest.mark.parametrize("salt", ["", SALT])
def test_plain_file_layout(real_states, salt: str):
    """No checkpoints, no draft: SCKP with count 0 and no SDFT, byte for byte."""
    state = real_states[0]
    sf = SlotFile(TOKENS, state, salt=salt)
    data = packed(sf)
    n, raw = len(TOKENS), salt.encode()
    k = len(raw)
    assert data[: 12 + k + 4] == b"RXSL" + struct.pack("<II", 2, k) + raw + struct.pack("<I", n)
    assert struct.unpack_from(f"<{n}i", data, 16 + k) == tuple(TOKENS)
    assert struct.unpack_from("<Q", data, 16 + k + 4 * n) == (len(state),)
    assert data[24 + k + 4 * n : 24 + k + 4 * n + len(state)] == state
    end = 24 + k + 4 * n + len(state)
    assert struct.unpack_from("<I", data, end) == (zlib.crc32(data[:end]),)
    assert main_size(sf) == end + 4
    assert data[end + 4 :] == b"SCKP" + struct.pack("<II", 1, 0)
    assert parse_slot_file(data) == (sf, [])


def test_appendix_layout():
    sf = SlotFile([7], b"S", [Checkpoint(9, 1, 2, b"T", b"DD", b"")], b"", b"x")
    data = packed(sf)
    m = main_size(sf)
    assert data[m:] == (b"SCKP" + struct.pack("<IIqii", 1, 1, 9, 1, 2)
                        + struct.pack("<Q", 1) + b"T" + struct.pack("<Q", 2) + b"DD"
                        + struct.pack("<Q", 0)
                        + b"SDFT" + struct.pack("<IQ", 1, 0) + struct.pack("<Q", 1) + b"x")


def test_writer_rejects_out_of_range_fields():
    with pytest.raises(ValueError):
        pack_slot_file(SlotFile([2**31], b""))
    with pytest.raises(ValueError):
        pack_slot_file(SlotFile([], b"", [Checkpoint(0, 0, 0, b"")] * 1025))
    with pytest.raises(ValueError, match="salt"):  # the reader would refuse it
        pack_slot_file(SlotFile([1], b"", salt="x" * (MAX_SALT + 1)))


# -- reading rules ---------------------------------------------------------------------------
def test_truncation_at_every_offset(real_states):
    sf = full_file(real_states)
    data = packed(sf)
    main, ckpt_end, total = boundaries(sf)
    for n in range(total + 1):
        if n < main:
            with pytest.raises(SlotFileError):
                parse_slot_file(data[:n])
            continue
        got, warnings = parse_slot_file(data[:n])
        assert (got.tokens, got.state) == (sf.tokens, sf.state)
        clean = n in (main, ckpt_end, total)  # at an appendix boundary nothing is half-there
        assert (warnings == []) == clean, (n, warnings)
        assert got.checkpoints == (sf.checkpoints if n >= ckpt_end else [])
        want_draft = (sf.draft, sf.speculative) if n == total else (b"", b"")
        assert (got.draft, got.speculative) == want_draft


def put(data: bytes, off: int, raw: bytes) -> bytes:
    return data[:off] + raw + data[off + len(raw) :]


def test_bad_appendices_are_dropped_with_a_warning(real_states):
    sf = full_file(real_states)
    data = packed(sf)
    main, ckpt_end, _ = boundaries(sf)
    cases = {
        "checkpoint appendix": put(data, main + 4, struct.pack("<I", 2)),  # version
        "unrecognized": put(data, main, b"JUNK"),  # magic
        "bad checkpoint count": put(data, main + 8, struct.pack("<I", 1025)),
        "truncated": put(data, main + 12 + 16, struct.pack("<Q", 2**64 - 1)),  # buffer length
    }
    for what, bad in cases.items():
        got, warnings = parse_slot_file(bad)
        assert (got.tokens, got.state, got.checkpoints, got.draft) == (sf.tokens, sf.state, [], b"")
        assert len(warnings) == 1 and what in warnings[0], warnings
    got, warnings = parse_slot_file(put(data, ckpt_end + 4, struct.pack("<I", 9)))
    assert got.checkpoints == sf.checkpoints and got.draft == b""
    assert "draft appendix" in warnings[0]
    got, warnings = parse_slot_file(data + b"xyz")
    assert got == sf and "3 trailing bytes" in warnings[0]
    # no checkpoint appendix at all, the draft one directly: accepted
    no_ckpt = data[:main] + data[ckpt_end:]
    want = SlotFile(sf.tokens, sf.state, [], sf.draft, sf.speculative, sf.salt)
    assert parse_slot_file(no_ckpt) == (want, [])


def test_bad_main_part_is_an_error(real_states):
    data = packed(SlotFile(TOKENS, real_states[0]))
    n = len(TOKENS)
    cases = {
        "bad magic": put(data, 0, b"GGSQ"),
        "version 3": put(data, 4, struct.pack("<I", 3)),
        "version 0": put(data, 4, struct.pack("<I", 0)),
        "tokens announced": put(data, 12, struct.pack("<I", 2**32 - 1)),
        "state of": put(data, 16 + 4 * n, struct.pack("<Q", 2**63)),
        "checksum": put(data, 30, bytes([data[30] ^ 0x40])),
    }
    for what, bad in cases.items():
        with pytest.raises(SlotFileError, match=what):
            parse_slot_file(bad)


def test_read_slot_file_io_errors(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        read_slot_file(tmp_path / "missing")
    with pytest.raises(SlotFileError, match="regular file"):
        read_slot_file(tmp_path)  # a directory
    os.mkfifo(tmp_path / "fifo")  # must not block the engine thread
    with pytest.raises(SlotFileError, match="regular file"):
        read_slot_file(tmp_path / "fifo")
    write_slot_file(tmp_path / "f", SlotFile([1], b"abc"))
    with pytest.raises(SlotFileError, match="exceeds the limit"):
        read_slot_file(tmp_path / "f", max_bytes=10)


# -- the cache namespace (cache_salt) ------------------------------------------------------
def test_salt_bound_is_the_requests():
    assert MAX_SALT == MAX_CACHE_SALT


@pytest.mark.parametrize("salt", ["", "A", SALT, "\U0001f600" * MAX_SALT, "x" * MAX_SALT,
                                  "lone \ud800 surrogate"])
def test_salt_round_trip(real_states, tmp_path: Path, salt: str):
    """Whatever salt a slot's KV can have comes back the same str (the longest ones too: 512
    four-byte characters; a lone surrogate as the disk tier encodes it, surrogatepass)."""
    sf = full_file(real_states)
    sf.salt = salt
    write_slot_file(tmp_path / "s.bin", sf)
    got, warnings = read_slot_file(tmp_path / "s.bin")
    assert warnings == [] and got == sf and got.salt == salt
    assert main_size(got) == main_size(sf) == boundaries(sf)[0]
    assert got.checkpoints == sf.checkpoints and got.draft == sf.draft


def test_version_1_file_loads_unsalted(real_states, tmp_path: Path):
    """A file of the version-1 writer (no salt field) still loads, in the shared namespace, with
    its appendices, and main_size is the bytes of its own main part."""
    state = real_states[0]
    salted = packed(full_file(real_states))
    v1 = pack_v1(TOKENS, state)
    assert len(v1) == 24 + 4 * len(TOKENS) + len(state)
    (tmp_path / "v1.bin").write_bytes(v1 + salted[main_size(full_file(real_states)) :])
    got, warnings = read_slot_file(tmp_path / "v1.bin")
    assert warnings == [] and got.salt == "" and got.version == 1
    want = full_file(real_states)
    want.salt = ""
    assert got == want
    assert main_size(got) == len(v1)
    assert parse_slot_file(v1) == (SlotFile(TOKENS, state), [])
    for n in range(len(v1)):  # a torn version-1 main part is still an error
        with pytest.raises(SlotFileError):
            parse_slot_file(v1[:n])
    with pytest.raises(SlotFileError, match="checksum"):  # still checked
        parse_slot_file(put(v1, 40, bytes([v1[40] ^ 0x10])))


def test_bad_salt_field_is_a_bad_main_part(real_states):
    """Torn, corrupted, oversized or undecodable: the file is refused, never read as another
    namespace (the shared one above all)."""
    sf = full_file(real_states)
    data = packed(sf)
    k = len(SALT.encode())
    for n in range(8, 12 + k + 4):  # cut inside the salt length, the salt, right after it
        with pytest.raises(SlotFileError, match="truncated"):
            parse_slot_file(data[:n])
    cases = {
        "bad salt length": put(data, 8, struct.pack("<I", 4 * MAX_SALT + 1)),
        "salt of 2048 bytes": put(packed(SlotFile([1], b"", salt="ab")), 8,
                                  struct.pack("<I", 4 * MAX_SALT)),
        "checksum": put(data, 12, b"T"),  # "tenant" read as "Tenant": another namespace
        "not UTF-8": main_v2(b"ab\xff", [1], b"S"),  # a right CRC: written so, not corrupted
        "513 characters": main_v2(b"x" * (MAX_SALT + 1), [1], b"S"),
    }
    for what, bad in cases.items():
        with pytest.raises(SlotFileError, match=what):
            parse_slot_file(bad)
    for off in range(8, 12 + k):  # any flip in the length or the salt: never a clean read
        for bit in range(8):
            flipped = put(data, off, bytes([data[off] ^ (1 << bit)]))
            with pytest.raises(SlotFileError):
                parse_slot_file(flipped)


# -- file names ----------------------------------------------------------------------------
GOOD_NAMES = ["slot1.bin", "a", "x" * 255, "é" * 127 + "x", "日本語 ok.bin", "a.b.c", "a-b_c"]
BAD_NAMES = ["", ".", "..", "../x", "x/..", "/etc/passwd", "a/b", "a\\b", ".hidden", "a..b",
             "x" * 256, "é" * 128, "a\x00b", "a\tb", "a\x7fb", "a\x85b", " a", "a ", "a.",
             "a:b", "a*b", "a?b", 'a"b', "a<b", "a>b", "a|b", "a\uff0eb", "a\u2215b",
             "a\u2216b", "a\ufffdb", "\ufeffa", "\udc80"]


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_valid_filenames(name: str, tmp_path: Path):
    validate_filename(name)
    assert resolve_in_dir(tmp_path, name) == Path(os.path.realpath(tmp_path)) / name


@pytest.mark.parametrize("name", BAD_NAMES)
def test_invalid_filenames(name: str, tmp_path: Path):
    with pytest.raises(ValueError):
        validate_filename(name)
    with pytest.raises(ValueError):
        resolve_in_dir(tmp_path, name)


def test_symlinks_must_stay_inside(tmp_path: Path):
    d, out = tmp_path / "d", tmp_path / "out"
    d.mkdir()
    out.mkdir()
    (d / "sub").mkdir()
    (d / "in").symlink_to(d / "sub" / "target")
    (d / "escape").symlink_to(out / "x")
    (d / "escape_dir").symlink_to(out)
    (d / "up").symlink_to("../out/x")
    (tmp_path / "dlink").symlink_to(d)  # the directory itself may be a symlink
    assert resolve_in_dir(tmp_path / "dlink", "in") == Path(os.path.realpath(d / "sub" / "target"))
    for name in ("escape", "escape_dir", "up"):
        with pytest.raises(ValueError, match="outside"):
            resolve_in_dir(d, name)


# -- atomic writes ---------------------------------------------------------------------------
def fail_nth(monkeypatch: pytest.MonkeyPatch, name: str, n: int, err: int) -> None:
    real, calls = getattr(os, name), [0]

    def fake(*args):
        calls[0] += 1
        if calls[0] >= n:
            raise OSError(err, os.strerror(err))
        return real(*args)

    monkeypatch.setattr(os, name, fake)


@pytest.mark.parametrize("fault", [("write", 1), ("write", 3), ("fsync", 1), ("replace", 1)])
def test_failed_write_keeps_old_file(real_states, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     fault: tuple[str, int]):
    path = tmp_path / "s.bin"
    old = SlotFile([1, 2], b"old state")
    write_slot_file(path, old)
    old_bytes = path.read_bytes()
    fail_nth(monkeypatch, fault[0], fault[1], errno.ENOSPC if fault[0] == "write" else errno.EIO)
    with pytest.raises(OSError):
        write_slot_file(path, full_file(real_states))
    monkeypatch.undo()
    assert path.read_bytes() == old_bytes
    assert os.listdir(tmp_path) == ["s.bin"]  # the temp file is gone
    assert read_slot_file(path) == (old, [])


def test_new_file_is_owner_only(tmp_path: Path):
    """It holds a tenant's prompt tokens: 0600 whatever the umask."""
    old = os.umask(0o002)
    try:
        write_slot_file(tmp_path / "s.bin", SlotFile([1], b"x"))
    finally:
        os.umask(old)
    assert ((tmp_path / "s.bin").stat().st_mode & 0o777) == 0o600


def test_write_replaces_whole_file_and_keeps_mode(real_states, tmp_path: Path):
    """An operator's chmod of a saved file survives saving over it (not 0600 again)."""
    path = tmp_path / "s.bin"
    write_slot_file(path, full_file(real_states))
    path.chmod(0o640)
    small = SlotFile([3], b"tiny")
    assert write_slot_file(path, small) == path.stat().st_size == len(packed(small))
    assert read_slot_file(path) == (small, []) and (path.stat().st_mode & 0o777) == 0o640
    assert os.listdir(tmp_path) == ["s.bin"]


# -- fuzzing ---------------------------------------------------------------------------------
def check_parse(data: bytes) -> tuple[SlotFile, list[str]] | None:
    try:
        return parse_slot_file(data)
    except SlotFileError:
        return None


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_random_bytes(data: bytes):
    check_parse(data)
    check_parse(b"RXSL" + data)
    check_parse(b"RXSL\x01\x00\x00\x00" + data)
    check_parse(b"RXSL\x02\x00\x00\x00" + data)
    check_parse(b"RXSL\x02\x00\x00\x00\x00\x00\x00\x00" + data)


i32 = st.integers(-(2**31), 2**31 - 1)
slot_files = st.builds(
    SlotFile,
    tokens=st.lists(i32, max_size=20),
    state=st.binary(max_size=64),
    checkpoints=st.lists(st.builds(Checkpoint, st.integers(-(2**63), 2**63 - 1), i32, i32,
                                   st.binary(max_size=16), st.binary(max_size=16),
                                   st.binary(max_size=16)), max_size=3),
    draft=st.binary(max_size=16),
    speculative=st.binary(max_size=16),
    salt=st.text(max_size=8),
)


@settings(max_examples=300, deadline=None)
@given(slot_files)
def test_fuzz_round_trip(sf: SlotFile):
    assert parse_slot_file(packed(sf)) == (sf, [])


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(slot_files, st.data())
def test_fuzz_corrupted_files(sf: SlotFile, data: st.DataObject):
    """Truncate, flip, overwrite with extreme lengths, splice: only SlotFileError, and a change
    confined to the appendices never loses the main part."""
    raw = packed(sf)
    main = main_size(sf)
    kind = data.draw(st.sampled_from(["truncate", "flip", "u64", "u32", "insert", "delete"]))
    off = data.draw(st.integers(0, len(raw)))
    if kind == "truncate":
        bad = raw[:off]
    elif kind == "flip":
        off = min(off, len(raw) - 1)
        bad = put(raw, off, bytes([raw[off] ^ data.draw(st.integers(1, 255))]))
    elif kind in ("u64", "u32"):
        fmt = "<Q" if kind == "u64" else "<I"
        v = data.draw(st.sampled_from([0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1]) if kind == "u64"
                      else st.sampled_from([0, 1, 1025, 2**31, 2**32 - 1]))
        bad = raw[:off] + struct.pack(fmt, v) + raw[off + struct.calcsize(fmt) :]
    elif kind == "insert":
        bad = raw[:off] + data.draw(st.binary(min_size=1, max_size=12)) + raw[off:]
    else:
        bad = raw[:off] + raw[off + data.draw(st.integers(1, 12)) :]
    got = check_parse(bad)
    if bad[:main] == raw[:main] and len(bad) >= main:
        assert got is not None and (got[0].tokens, got[0].state) == (sf.tokens, sf.state)
    if got is not None and bad == raw:
        assert got == (sf, [])


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=200))
def test_fuzz_read_slot_file(tmp_path: Path, data: bytes):
    (tmp_path / "f").write_bytes(data)
    try:
        read_slot_file(tmp_path / "f")
    except SlotFileError:
        pass
