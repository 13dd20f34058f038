"""Slot snapshot files (`POST /slots/{id}?action=save|restore`): the format and safe file I/O.

Layout (little-endian, byte tables in docs/FORMATS.md): the main part ("RXSL", u32 version 2,
u32 salt length + the UTF-8 `cache_salt` of the KV, u32 n_tokens, i32 tokens[n], u64 state
length + the sequence state of memory/pool/state.py, u32 CRC-32 of everything before it); then the
checkpoint appendix ("SCKP", u32 version 1, u32 count, per checkpoint i64 n_tokens, i32 pos_min,
i32 pos_max and three u64-length-prefixed buffers: target, draft, speculative); then the draft
appendix ("SDFT", u32 version 1, u64-length-prefixed draft and speculative states; omitted when
both are empty).

The salt is in the file because the KV belongs to a cache namespace (a request's `cache_salt`)
and must come back in it: a restored file serves requests of its own salt and no other. Version
1 (the same main part without the salt field) still loads, in the shared namespace "": where a
version-1 restore always put the KV (the salt it was saved from was not recorded).

Reading rules: every length is checked against the bytes left before anything is allocated; a
bad main part raises `SlotFileError`; a bad or truncated appendix is dropped with a warning and
the main part is kept (the seed's "written half when the process was killed" case).
Writing is atomic: a hidden temp file in the same directory, fsync, rename, fsync the directory.
A new file is owner-only (0600): it holds a tenant's prompt tokens.
"""

from __future__ import annotations

import logging
import os
import stat
import struct
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from radixserve.memory.checkpoint import Checkpoint

log = logging.getLogger(__name__)

MAGIC, VERSION = b"RXSL", 2
VERSIONS = (1, 2)  # readable; version 1 has no salt field
MAX_SALT = 512  # characters: http/parse.py's MAX_CACHE_SALT (no request has a longer salt)
_MAX_SALT_BYTES = 4 * MAX_SALT  # UTF-8, surrogatepass: at most 4 bytes a character
NEW_FILE_MODE = 0o600
CKPT_MAGIC, CKPT_VERSION = b"SCKP", 1
DRAFT_MAGIC, DRAFT_VERSION = b"SDFT", 1
MAX_CHECKPOINTS = 1024  # the seed's writer rejects more; the reader too
_CKPT_MIN = 8 + 4 + 4 + 3 * 8  # smallest checkpoint record: no buffers
NAME_MAX = 255
_FORBIDDEN = set(':*?"<>|/\\') | {"\uff0e", "\u2215", "\u2216", "\ufffd", "\ufeff"}


class SlotFileError(ValueError):
    """The file is not a usable slot snapshot (bad magic/version, truncated, corrupt)."""


@dataclass(slots=True)
class SlotFile:
    tokens: list[int]
    state: bytes  # memory/pool/state.py sequence state (opaque here)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    draft: bytes = b""
    speculative: bytes = b""
    salt: str = ""  # the `cache_salt` namespace of the KV in `state`
    # the version the file was read with (main_size depends on it); the writer writes VERSION
    version: int = field(default=VERSION, compare=False)


# -- file names ---------------------------------------------------------------------------
def validate_filename(name: str) -> None:
    """llama.cpp's fs_validate_filename(allow_subdirs=false), plus: no leading dot."""
    if not isinstance(name, str):
        raise ValueError("filename must be a string")
    if not name:
        raise ValueError("empty filename")
    try:
        raw = name.encode("utf-8")  # lone surrogates (invalid UTF-8 from the client) fail here
    except UnicodeEncodeError:
        raise ValueError("filename is not valid UTF-8") from None
    if len(raw) > NAME_MAX:
        raise ValueError(f"filename is {len(raw)} bytes, at most {NAME_MAX} allowed")
    for ch in name:
        c = ord(ch)
        if c <= 0x1F or 0x7F <= c <= 0x9F:
            raise ValueError(f"filename contains control character U+{c:04X}")
        if ch in _FORBIDDEN:
            raise ValueError(f"filename contains forbidden character {ch!r}")
    if name[0] == " " or name[-1] == " ":
        raise ValueError("filename starts or ends with a space")
    if name[-1] == ".":
        raise ValueError("filename ends with '.'")
    if ".." in name:
        raise ValueError("filename contains '..'")
    if name[0] == ".":
        raise ValueError("filename starts with '.' (hidden files are reserved)")


def resolve_in_dir(directory: str | os.PathLike[str], name: str) -> Path:
    """The real path of `name` inside `directory`; ValueError if it is invalid or escapes it."""
    validate_filename(name)
    root = os.path.realpath(directory)
    real = os.path.realpath(os.path.join(root, name))  # follows a symlink named `name`
    if real == root or os.path.commonpath([root, real]) != root:
        raise ValueError("filename resolves outside the slot save directory")
    return Path(real)


# -- encoding -----------------------------------------------------------------------------
def _lp(b: bytes) -> list[bytes]:
    return [struct.pack("<Q", len(b)), b]


def _salt_bytes(salt: str) -> bytes:
    """As the disk tier names a namespace (disk_block.py): surrogatepass, so any str a salt can
    be encodes, and decodes back to the same str."""
    return salt.encode("utf-8", "surrogatepass")


def pack_slot_file(sf: SlotFile) -> list[bytes]:
    """The file as a list of byte strings (so large states are not concatenated)."""
    if len(sf.checkpoints) > MAX_CHECKPOINTS:
        raise ValueError(f"{len(sf.checkpoints)} checkpoints, at most {MAX_CHECKPOINTS}")
    if len(sf.salt) > MAX_SALT:  # the reader would refuse the file
        raise ValueError(f"salt of {len(sf.salt)} characters, at most {MAX_SALT}")
    salt = _salt_bytes(sf.salt)
    try:
        head = MAGIC + struct.pack(f"<II{len(salt)}sI{len(sf.tokens)}iQ", VERSION, len(salt),
                                   salt, len(sf.tokens), *sf.tokens, len(sf.state))
        crc = zlib.crc32(sf.state, zlib.crc32(head))
        parts = [head, sf.state, struct.pack("<I", crc),
                 CKPT_MAGIC + struct.pack("<II", CKPT_VERSION, len(sf.checkpoints))]
        for c in sf.checkpoints:
            parts.append(struct.pack("<qii", c.n_tokens, c.pos_min, c.pos_max))
            parts += _lp(c.target) + _lp(c.draft) + _lp(c.speculative)
    except struct.error as e:
        raise ValueError(f"slot file field out of range: {e}") from None
    if sf.draft or sf.speculative:
        parts += [DRAFT_MAGIC + struct.pack("<I", DRAFT_VERSION), *_lp(sf.draft),
                  *_lp(sf.speculative)]
    return parts


def main_size(sf: SlotFile) -> int:
    """Bytes of the main part (what llama-server reports as a restore's n_read), in the layout
    of the version `sf` was read with."""
    salt_field = 4 + len(_salt_bytes(sf.salt)) if sf.version >= 2 else 0
    return 4 + 4 + salt_field + 4 + 4 * len(sf.tokens) + 8 + len(sf.state) + 4


class _Cursor:
    def __init__(self, data: memoryview, off: int, what: str) -> None:
        self.data, self.off, self.what = data, off, what

    @property
    def left(self) -> int:
        return len(self.data) - self.off

    def take(self, n: int) -> memoryview:
        if n > self.left:
            raise SlotFileError(f"{self.what} truncated at offset {self.off}: "
                                f"needs {n} bytes, {self.left} left")
        self.off += n
        return self.data[self.off - n : self.off]

    def unpack(self, fmt: str) -> tuple[int, ...]:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def buf(self) -> bytes:
        (n,) = self.unpack("<Q")  # the length may be corrupt: compared before allocating
        return bytes(self.take(n))


def _parse_main(data: memoryview) -> tuple[SlotFile, int]:
    r = _Cursor(data, 0, "slot file")
    if bytes(r.take(4)) != MAGIC:
        raise SlotFileError("not a radixserve slot file (bad magic)")
    (version,) = r.unpack("<I")
    if version not in VERSIONS:
        raise SlotFileError(f"unsupported slot file version {version} (expected "
                            f"{' or '.join(map(str, VERSIONS))})")
    raw_salt = b""
    if version >= 2:
        (n_salt,) = r.unpack("<I")
        if n_salt > _MAX_SALT_BYTES:
            raise SlotFileError(f"bad salt length: {n_salt} bytes, at most {_MAX_SALT_BYTES}")
        if n_salt > r.left:
            raise SlotFileError(f"slot file truncated: salt of {n_salt} bytes, {r.left} left")
        raw_salt = bytes(r.take(n_salt))
    (n,) = r.unpack("<I")
    if n > r.left // 4:
        raise SlotFileError(f"slot file truncated: {n} tokens announced, {r.left} bytes left")
    tokens = list(struct.unpack(f"<{n}i", r.take(4 * n)))
    (n_state,) = r.unpack("<Q")
    if n_state > r.left:
        raise SlotFileError(f"slot file truncated: state of {n_state} bytes, {r.left} left")
    state = r.take(n_state)
    end = r.off
    (crc,) = r.unpack("<I")
    if zlib.crc32(data[:end]) != crc:
        raise SlotFileError("slot file is corrupt (checksum mismatch)")
    try:  # after the checksum, so a flipped salt byte reads as corruption, not as bad text
        salt = raw_salt.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        raise SlotFileError("bad salt: not UTF-8 text") from None
    if len(salt) > MAX_SALT:
        raise SlotFileError(f"bad salt: {len(salt)} characters, at most {MAX_SALT}")
    return SlotFile(tokens, bytes(state), salt=salt, version=version), r.off


def _parse_checkpoints(r: _Cursor) -> list[Checkpoint]:
    r.take(4)  # magic, already matched
    version, count = r.unpack("<II")
    if version != CKPT_VERSION:
        raise SlotFileError(f"unsupported version {version}")
    if count > MAX_CHECKPOINTS or count > r.left // _CKPT_MIN:
        raise SlotFileError(f"bad checkpoint count {count} ({r.left} bytes left)")
    out = []
    for _ in range(count):
        n_tokens, pos_min, pos_max = r.unpack("<qii")
        out.append(Checkpoint(n_tokens, pos_min, pos_max, r.buf(), r.buf(), r.buf()))
    return out


def _parse_draft(r: _Cursor) -> tuple[bytes, bytes]:
    r.take(4)
    (version,) = r.unpack("<I")
    if version != DRAFT_VERSION:
        raise SlotFileError(f"unsupported version {version}")
    return r.buf(), r.buf()


def parse_slot_file(data: bytes | memoryview) -> tuple[SlotFile, list[str]]:
    """Decode a whole file. Raises SlotFileError for a bad main part; appendix problems are
    returned (and logged) as warnings, with that appendix and anything after it dropped."""
    mv = memoryview(data).cast("B")
    sf, off = _parse_main(mv)
    warnings: list[str] = []
    r = _Cursor(mv, off, "appendix")
    for magic, name in ((CKPT_MAGIC, "checkpoint"), (DRAFT_MAGIC, "draft")):
        if r.left == 0:
            break
        head = bytes(mv[r.off : r.off + 4])
        if head != magic and (magic != CKPT_MAGIC or head != DRAFT_MAGIC):
            warnings.append(f"{r.left} unrecognized bytes after offset {r.off} ignored")
            break
        if head != magic:
            continue  # no checkpoint appendix, the draft one follows
        start = r.off
        try:
            if magic == CKPT_MAGIC:
                sf.checkpoints = _parse_checkpoints(r)
            else:
                sf.draft, sf.speculative = _parse_draft(r)
        except SlotFileError as e:
            warnings.append(f"{name} appendix at offset {start} ignored: {e}")
            break
    else:
        if r.left:
            warnings.append(f"{r.left} trailing bytes after offset {r.off} ignored")
    for w in warnings:
        log.warning("slot file: %s", w)
    return sf, warnings


# -- file I/O -----------------------------------------------------------------------------
def read_slot_file(path: str | os.PathLike[str],
                   max_bytes: int | None = None) -> tuple[SlotFile, list[str]]:
    """Read and decode a slot file. OSError for I/O problems (FileNotFoundError when missing),
    SlotFileError for anything else (not a regular file, too large, bad main part)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block us
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SlotFileError("not a regular file")
        if max_bytes is not None and st.st_size > max_bytes:
            raise SlotFileError(f"file of {st.st_size} bytes exceeds the limit of {max_bytes}")
        with open(fd, "rb", buffering=0, closefd=False) as f:
            data = f.readall()
    finally:
        os.close(fd)
    if max_bytes is not None and len(data) > max_bytes:  # it grew while we read
        raise SlotFileError(f"file of {len(data)} bytes exceeds the limit of {max_bytes}")
    return parse_slot_file(data)


def _write_all(fd: int, data: bytes) -> None:
    mv = memoryview(data)
    while mv:
        mv = mv[os.write(fd, mv) :]


def write_slot_file(path: str | os.PathLike[str], sf: SlotFile) -> int:
    """Write atomically: the real name holds the old file or the whole new one, never a torn
    one. On any error the temp file is removed and the error raised. Returns the bytes written.

    A new file is owner-only (it holds a tenant's prompt tokens); a replaced one keeps its
    permission bits, so an operator who opened one up (or locked it down) is not overruled."""
    parts = pack_slot_file(sf)
    path = Path(path)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mode = NEW_FILE_MODE
    fd, tmp = tempfile.mkstemp(prefix=".rxsl-", suffix=".tmp", dir=path.parent)
    try:
        try:
            for p in parts:
                _write_all(fd, p)
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # durability of the rename; the data itself is already safe under the real name
        dfd = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        log.warning("slot file: could not fsync directory %s: %s", path.parent, e)
    return sum(len(p) for p in parts)
