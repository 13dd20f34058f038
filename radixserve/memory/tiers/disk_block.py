"""One block file of the disk tier (disk.py): its name, its bytes, the checks it must pass,
and the owner-only way it is written (docs/FORMATS.md §3, docs/SECURITY.md).

- Name of block j: key(-1) = H(model fingerprint, salt), key(j) = H(key(j-1), tokens of block
  j), so a name covers the model (weights, dtype, KV layout, kernels, torch), the tenant and the
  whole token chain up to the block.
- File (`<dir>/<2 hex>/<32 hex>.kvb`): magic, a JSON header (fingerprint, key, position,
  tokens, row shapes), the rows, then a BLAKE2b checksum of all that. Anything that does not
  check out (short, flipped bytes, another fingerprint, key, tokens or shape) decodes to None.
- Snapshot file (a recurrent layout's state, memory/pool/recurrent.py), the same format with a
  blob: for a prefix of n tokens, j = n // block whole blocks and the tail tokens[j*block:n],
  it holds the tail's rows and the state after token n-1 (the tree's sealed snapshot bytes,
  header field "blob": their length). Named `<2 hex>/<P>-<n>-<S>.kvs`: P = key(j-1) (the
  block chain's, key(-1) for j = 0), S = H'(P, tail tokens) (its own BLAKE2b domain), the key
  its header carries; so a scan indexes snapshots by P without opening them, and a prompt
  finds its own by P and the hash of its tail.
- The directory is a trust boundary: whoever can write it could plant KV under a name, and a
  checksum anyone can compute does not stop them. With a secret key (`--cache-disk-key`) H is
  keyed BLAKE2b: the checksum becomes a MAC and the names a keyed chain, so processes without
  the key neither find (nor so remove) the files nor forge one, and a listing of names tells
  nothing about the prompts. Directories and files are created owner-only whatever the umask:
  the tokens are in clear inside.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections.abc import Sequence

import numpy as np

from radixserve.memory.pool.rows import RowSpec

log = logging.getLogger(__name__)

MAGIC = b"RSKVBLK1"
SUFFIX = ".kvb"
SNAP_SUFFIX = ".kvs"  # a snapshot file (a recurrent state and its tail's rows)
DIGEST = 16  # bytes of BLAKE2b in keys and checksums
NAME_PERSON, FILE_PERSON = b"radixserve.name", b"radixserve.file"  # BLAKE2b domains
SNAP_PERSON = b"radixserve.snap"
MAX_HEADER = 1 << 20  # a block file's header is far smaller (its tokens, in JSON)

Part = bytes | memoryview


def _h(person: bytes, key: bytes, *parts: Part) -> bytes:
    """BLAKE2b of `parts`, keyed by `key` (b"": plain); `person` keeps names and checksums
    apart, so no value computed for one can serve as the other."""
    h = hashlib.blake2b(digest_size=DIGEST, key=key, person=person)
    for p in parts:
        h.update(p)
    return h.digest()


def load_key(path: str) -> bytes:
    """The MAC key of `--cache-disk-key FILE`: BLAKE2b-256 of the file's bytes (a trailing
    newline dropped: `echo secret > FILE` and an editor's file give the same key), so a
    secret of any length fits BLAKE2b's 64-byte key. An unreadable or empty file is refused:
    a server that silently ran unkeyed would accept anyone's files."""
    try:
        with open(path, "rb") as f:
            secret = f.read().rstrip(b"\r\n")
    except OSError as e:
        raise ValueError(f"cannot read the disk cache key file {path!r}: {e.strerror}") from None
    if not secret:
        raise ValueError(f"the disk cache key file {path!r} is empty")
    return hashlib.blake2b(secret, digest_size=32).digest()


class BlockFormat:
    """Names and bytes of the block files of one model (`fingerprint`), KV layout and key."""

    def __init__(self, fingerprint: bytes, layout: Sequence[RowSpec], key: bytes = b"") -> None:
        self.fingerprint, self.layout, self.key = fingerprint, tuple(layout), key

    def root(self, ns: str) -> bytes:
        """key(-1) of namespace `ns`: what block 0's name chains from (and the prefix key of
        the snapshots within block 0)."""
        return _h(NAME_PERSON, self.key, self.fingerprint, ns.encode("utf-8", "surrogatepass"))

    def snap_key(self, prefix: bytes, tail: Sequence[int]) -> bytes:
        """S of the snapshot after `tail` (the tokens past the whole blocks whose chain key is
        `prefix`): it covers the whole token chain, as a block's key does."""
        return _h(SNAP_PERSON, self.key, prefix, np.asarray(tail, dtype="<u4").tobytes())

    def keys(self, ns: str, tokens: Sequence[int], block: int, n_blocks: int) -> list[bytes]:
        """The names of the first `n_blocks` blocks of `tokens` in namespace `ns`."""
        key = self.root(ns)
        out = []
        for j in range(n_blocks):
            chunk = np.asarray(tokens[j * block:(j + 1) * block], dtype="<u4").tobytes()
            key = _h(NAME_PERSON, self.key, key, chunk)
            out.append(key)
        return out

    def encode(self, key: bytes, pos0: int, tokens: list[int],
               pieces: list[list[np.ndarray]], blob: bytes = b"") -> list[Part]:
        """A block file's bytes, in parts (the rows are views, not copies); `pieces`: per row
        tensor, uint8 arrays [L, H, t, D * itemsize] along the token axis (none: no tokens).
        `blob`: a snapshot file's state, after the rows."""
        rows = [np.concatenate(p, axis=2) if len(p) > 1 else np.ascontiguousarray(p[0])
                if p else np.empty((r.n_layer, r.n_head_kv, 0, r.width * r.dtype.itemsize),
                                   np.uint8)
                for p, r in zip(pieces, self.layout)]
        head = {
            "fingerprint": self.fingerprint.hex(), "key": key.hex(), "pos0": pos0,
            "tokens": tokens,
            "rows": [{"dtype": r.dtype_name, "shape": r.shape(len(tokens))}
                     for r in self.layout],
        }
        if blob:
            head["blob"] = len(blob)
        header = json.dumps(head).encode()
        parts: list[Part] = [MAGIC, struct.pack("<I", len(header)), header]
        parts += [memoryview(r.data).cast("B") for r in rows if r.size]
        if blob:
            parts.append(blob)
        parts.append(_h(FILE_PERSON, self.key, *parts))
        return parts

    def decode(self, data: bytes, key: bytes, pos0: int,
               tokens: list[int]) -> list[np.ndarray] | None:
        """Block `key`'s rows as uint8 arrays [L, H, n, D * itemsize] after every check a
        block must pass; None if any fails."""
        got = self._decode(data, key, pos0, tokens, False)
        return None if got is None else got[0]

    def decode_snapshot(self, data: bytes, key: bytes, pos0: int,
                        tokens: list[int]) -> tuple[list[np.ndarray], bytes] | None:
        """A snapshot file's tail rows and state blob (`key`: its S), after every check a
        block must pass and a non-empty blob; None if any fails."""
        return self._decode(data, key, pos0, tokens, True)

    def _decode(self, data: bytes, key: bytes, pos0: int, tokens: list[int],
                with_blob: bool) -> tuple[list[np.ndarray], bytes] | None:
        n = len(tokens)
        fixed = len(MAGIC) + 4
        if len(data) < fixed + DIGEST or data[:len(MAGIC)] != MAGIC:
            return None
        if _h(FILE_PERSON, self.key, data[:-DIGEST]) != data[-DIGEST:]:
            return None
        (hlen,) = struct.unpack_from("<I", data, len(MAGIC))
        try:
            header = json.loads(data[fixed:fixed + hlen])
        except ValueError:
            return None
        want_rows = [{"dtype": r.dtype_name, "shape": r.shape(n)} for r in self.layout]
        if (not isinstance(header, dict) or header.get("fingerprint") != self.fingerprint.hex()
                or header.get("key") != key.hex() or header.get("pos0") != pos0
                or header.get("tokens") != tokens or header.get("rows") != want_rows):
            return None
        n_blob = header.get("blob", 0)
        if type(n_blob) is not int or (n_blob > 0) != with_blob:
            return None
        at = fixed + hlen
        if len(data) - DIGEST - at != sum(r.nbytes(n) for r in self.layout) + n_blob:
            return None
        out = []
        for r in self.layout:
            size = r.nbytes(n)
            arr = np.frombuffer(data, np.uint8, size, at).reshape(
                r.n_layer, r.n_head_kv, n, r.width * r.dtype.itemsize)
            out.append(arr)
            at += size
        return out, bytes(data[at:at + n_blob])


# -- owner-only files ---------------------------------------------------------------------
def private_dir(path: str) -> None:
    """Create directory `path` (and missing parents) owner-only whatever the umask: its files
    hold prompts in clear. An existing directory keeps the mode its owner gave it."""
    path = os.path.abspath(path)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return
    except FileNotFoundError:
        private_dir(os.path.dirname(path))
        private_dir(path)
        return
    os.chmod(path, 0o700)  # the umask may have taken the owner's bits too


def write_private(path: str, parts: Sequence[Part]) -> None:
    """Write a new file `path` readable by its owner only, whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with open(fd, "wb") as f:
        os.fchmod(fd, 0o600)
        for p in parts:
            f.write(p)


def warn_if_open(directory: str, keyed: bool) -> None:
    """Others who can write the directory can plant KV unless the files are keyed."""
    try:
        mode = os.stat(directory).st_mode
    except OSError:
        return
    if mode & 0o022 and not keyed:
        log.warning("disk cache: %s is writable by other users, who could plant KV in it: "
                    "make it owner-only or give every server on it --cache-disk-key "
                    "(docs/SECURITY.md)", directory)


def snap_name(name: str) -> tuple[bytes, int, bytes] | None:
    """(P, n, S) of a snapshot file's name (without its suffix), or None: not one."""
    parts = name.split("-")
    if len(parts) != 3 or not is_key(parts[0]) or not is_key(parts[2]):
        return None
    if not (parts[1].isascii() and parts[1].isdigit()) or parts[1] != str(int(parts[1])):
        return None
    return bytes.fromhex(parts[0]), int(parts[1]), bytes.fromhex(parts[2])


def is_key(name: str) -> bool:
    try:
        return len(bytes.fromhex(name)) == DIGEST
    except ValueError:
        return False


def unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
