"""The disk tier under the radix cache (`--cache-disk DIR`): KV blocks as content-addressed files.

Beyond the seeds, whose radix cache lives in one process's memory: a prefix written here
survives a restart and is read by every server process on the same directory (SGLang's HiCache
L3 and LMCache do this for SGLang and vLLM).

- Unit: a block of `block` tokens at positions [j*block, (j+1)*block), every layer's K/V rows
  (a draft model's too), whatever radix edges the tokens lie on. Fixed, aligned blocks make a
  prefix's files findable from the tokens alone, with no index another process must share.
- Key of block j: key(-1) = H(model fingerprint, salt), key(j) = H(key(j-1), tokens of block j),
  so a name covers the model (weights, dtype, KV layout, kernels, torch), the tenant and the
  whole token chain up to the block. A prompt's tail shorter than a block is not stored.
- File (`<dir>/<2 hex>/<32 hex>.kvb`, docs/FORMATS.md): magic, a JSON header (fingerprint, key,
  position, tokens, row shapes), the rows, then a BLAKE2b checksum of all that. Anything that
  does not check out (short, flipped bytes, another fingerprint, key, tokens or shape) is a miss
  and the file is removed: never an error, never wrong KV.
- The directory is a trust boundary (docs/SECURITY.md): whoever can write it could plant KV
  under a name, and a checksum anyone can compute does not stop them. With a secret `key`
  (`--cache-disk-key`) H is keyed BLAKE2b: the checksum becomes a MAC and the names a keyed
  chain, so processes without the key neither find (nor so remove) the files nor forge one,
  and a listing of names tells nothing about the prompts. Directories and files are created
  owner-only whatever the umask: the tokens are in clear inside.
- Writes go to a temporary file then `os.replace`: readers in any process see a whole file or
  none. Readers tolerate eviction by others: a file gone between lookup and open is a miss.
- Bytes are bounded (`limit_bytes`) by LRU over the directory: a read touches the file's mtime;
  when the directory (as last scanned, plus this process's writes) is over the limit, the
  oldest files go. Every process enforces it on the shared directory, and that bound is the
  only reason a file is evicted: a full disk (ENOSPC, EDQUOT), maybe filled by someone else,
  pauses this process's writes instead, its offered writes dropped, for a growing interval or
  (a full filesystem, not a quota) until the filesystem reports room again.
- One I/O thread does every file operation; the engine thread only queues jobs and collects
  finished loads (`take_loaded`), so loading never stalls other slots' decoding. Write jobs
  carry numpy views of the tree's rows (the tree never writes rows in place, and views keep
  evicted rows alive until written). The I/O thread uses numpy and hashlib only, never torch
  kernels: a second thread running torch's OpenMP kernels slows the engine's (engine.py).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import itertools
import json
import logging
import os
import queue
import secrets
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

log = logging.getLogger(__name__)

MAGIC = b"RSKVBLK1"
SUFFIX = ".kvb"
DIGEST = 16  # bytes of BLAKE2b in keys and checksums
NAME_PERSON, FILE_PERSON = b"radixserve.name", b"radixserve.file"  # BLAKE2b domains
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})  # write failures that pause writing
BACKOFF_S = (1.0, 60.0)  # the first pause after a full disk, and the longest (it doubles)
MAX_PENDING_WRITE_BYTES = 256 * 2**20  # queued writes beyond this are dropped (counted)
RESCAN_S = 10.0  # other processes write too: re-read the directory's size this often
STALE_TMP_S = 600.0  # a temporary file this old belongs to a writer that died
MAX_HEADER = 1 << 20  # a block file's header is far smaller (its tokens, in JSON)
IO_NICE = 19  # the I/O thread's nice value: it hashes and copies, it must not slow decoding


def _h(person: bytes, key: bytes, *parts: bytes | memoryview) -> bytes:
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


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


@dataclass(slots=True, frozen=True)
class RowSpec:
    """One row tensor of a block: [n_layer, n_head_kv, block, head_dim] of `dtype`."""

    n_layer: int
    n_head_kv: int
    head_dim: int
    dtype: torch.dtype

    def shape(self, n: int) -> list[int]:
        return [self.n_layer, self.n_head_kv, n, self.head_dim]

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def nbytes(self, n: int) -> int:
        return self.n_layer * self.n_head_kv * n * self.head_dim * self.dtype.itemsize


@dataclass(slots=True)
class Loaded:
    """A finished load: rows [n_layer, n_head_kv, end - start, head_dim] of `tokens[start:]`
    (`rows` empty: nothing found)."""

    ticket: int
    ns: str
    tokens: list[int]
    start: int
    rows: list[torch.Tensor]
    epoch: int


@dataclass(slots=True)
class _Write:
    key: bytes
    pos0: int
    tokens: list[int]
    pieces: list[list[np.ndarray]]  # per row tensor, uint8 views [L, H, t, D * itemsize]
    nbytes: int
    epoch: int


@dataclass(slots=True)
class _Load:
    ticket: int
    ns: str
    tokens: list[int]  # the prompt up to the last block's end
    j0: int
    keys: list[bytes]  # of blocks j0..
    epoch: int


@dataclass(slots=True)
class DiskStats:
    """Figures of this process's view of the directory (bytes and blocks: the whole directory
    as last scanned, at most RESCAN_S ago when idle, plus what this process wrote, read or
    removed since)."""

    bytes: int = 0
    blocks: int = 0
    hits: int = 0  # loads that found at least one block
    misses: int = 0  # loads that found none
    hit_tokens: int = 0
    writes: int = 0  # blocks written
    # writes that failed (a full disk...), or were dropped while a full disk pauses writing:
    # nothing is left behind
    write_errors: int = 0
    dropped: int = 0  # writes not queued: the I/O thread was too far behind
    evictions: int = 0  # files removed by the LRU bound
    bad_files: int = 0  # files that did not check out (removed)
    flushed: int = 0  # files removed by flushes
    lock: threading.Lock = field(default_factory=threading.Lock)


class DiskTier:
    def __init__(self, directory: str, limit_bytes: int, block: int, fingerprint: bytes,
                 layout: Sequence[RowSpec], *, key: bytes = b"",
                 backoff: tuple[float, float] = BACKOFF_S,
                 fault: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`limit_bytes` <= 0: no bound. `key` (`load_key`; b"": none) keys names and
        checksums. After a full disk, writes pause for `backoff[0]` seconds, doubling up to
        `backoff[1]` while the disk stays full. Tests only: `fault` is called with "write"
        before each file is written and with "room" before the filesystem is asked for free
        space (either may raise OSError: a full disk), and with "read" before each file is read
        (it may block: a slow disk); `clock` times the pauses."""
        if block < 1:
            raise ValueError(f"disk block must be >= 1 token, got {block}")
        self.dir = os.path.abspath(directory)
        private_dir(self.dir)
        self.limit_bytes, self.block = limit_bytes, block
        self.fingerprint, self.layout = fingerprint, tuple(layout)
        self.block_bytes = sum(r.nbytes(block) for r in self.layout)
        self._name = functools.partial(_h, NAME_PERSON, key)
        self._mac = functools.partial(_h, FILE_PERSON, key)
        self.backoff, self._pause_s, self._resume_at, self._pause_errno = backoff, 0.0, 0.0, 0
        self.fault, self._clock = fault, clock
        self.stats = DiskStats()
        self.known: set[bytes] = set()  # keys on disk, as far as this process knows
        self.queued: set[bytes] = set()  # keys whose write is queued
        self.epoch = 0  # a flush starts a new one: older jobs and loads are dropped
        self.wake: Callable[[], None] = lambda: None  # the engine: a load finished
        self._pending_bytes = 0
        self._jobs: queue.PriorityQueue[tuple[int, int, object]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._tickets = itertools.count(1)
        self._done: queue.SimpleQueue[Loaded] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="radixserve-disk", daemon=True)
        self._thread.start()
        self._put(0, "scan")
        log.info("disk cache: %s, %s, %d tokens a block (%.2f MiB), %s", self.dir,
                 f"{limit_bytes / 2**20:.0f} MiB" if limit_bytes > 0 else "no byte limit",
                 block, self.block_bytes / 2**20, "keyed" if key else "no key")
        _warn_if_open(self.dir, bool(key))

    # ##### engine thread #####
    def keys(self, ns: str, tokens: Sequence[int], n_blocks: int) -> list[bytes]:
        """The keys of the first `n_blocks` blocks of `tokens` in namespace `ns`."""
        b, key = self.block, self._name(self.fingerprint, ns.encode("utf-8", "surrogatepass"))
        out = []
        for j in range(n_blocks):
            key = self._name(key, _token_bytes(tokens[j * b:(j + 1) * b]))
            out.append(key)
        return out

    def write(self, key: bytes, pos0: int, tokens: list[int],
              pieces: list[list[torch.Tensor]]) -> bool:
        """Queue block `key` (its tokens at pos0.., the rows as pieces along the token axis);
        False when it was known already or the queue is full."""
        if key in self.known or key in self.queued:
            return False
        if self._pending_bytes + self.block_bytes > MAX_PENDING_WRITE_BYTES:
            with self.stats.lock:
                self.stats.dropped += 1
            return False
        views = [[t.view(torch.uint8).numpy() for t in row] for row in pieces]
        self.queued.add(key)
        with self.stats.lock:
            self._pending_bytes += self.block_bytes
        self._put(2, _Write(key, pos0, tokens, views, self.block_bytes, self.epoch))
        return True

    def load(self, ns: str, tokens: list[int], j0: int, keys: list[bytes]) -> int:
        """Queue reading blocks j0.. (stopping at the first missing or bad one); returns the
        ticket its `Loaded` will carry."""
        ticket = next(self._tickets)
        self._put(0, _Load(ticket, ns, tokens, j0, keys, self.epoch))
        return ticket

    def take_loaded(self) -> list[Loaded]:
        """Loads finished since the last call (from the current epoch)."""
        out: list[Loaded] = []
        while True:
            try:
                got = self._done.get_nowait()
            except queue.Empty:
                return out
            out.append(got if got.epoch == self.epoch else
                       Loaded(got.ticket, got.ns, got.tokens, got.start, [], got.epoch))

    def flush(self) -> Future[int]:
        """Drop queued writes and reads and remove every block file in the directory (every
        model's, every process's); the future gives the number of files removed. The removal
        goes before any job queued after it (loads included), and a read already running
        belongs to the old epoch: nothing read before the flush reaches the tree after it."""
        self.epoch += 1
        self.known.clear()
        self.queued.clear()
        fut: Future[int] = Future()
        self._put(-1, ("flush", fut))
        return fut

    def figures(self) -> dict[str, float]:
        s = self.stats
        with s.lock:
            return {"bytes": s.bytes, "tokens": s.blocks * self.block, "hits": s.hits,
                    "misses": s.misses, "hit_tokens": s.hit_tokens, "writes": s.writes,
                    "write_errors": s.write_errors, "dropped": s.dropped,
                    "evictions": s.evictions, "bad_files": s.bad_files,
                    "limit_bytes": max(0, self.limit_bytes)}

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued writes (a restart then finds them), then stop the I/O thread."""
        if self._thread.is_alive():
            self._put(9, "stop")
            self._thread.join(timeout)

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until every job queued so far is done (tests, benchmarks)."""
        fut: Future[int] = Future()
        self._put(8, ("barrier", fut))
        fut.result(timeout)

    # ##### I/O thread #####
    def _put(self, prio: int, job: object) -> None:
        self._jobs.put((prio, next(self._seq), job))

    def _run(self) -> None:
        try:  # Linux: a thread is a task with its own nice value; the engine's compute comes first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), IO_NICE)
        except (AttributeError, OSError):
            pass
        t_scan = time.monotonic()
        while True:
            try:
                _, _, job = self._jobs.get(timeout=RESCAN_S)
            except queue.Empty:
                job = "scan"
            if job == "stop":
                return
            if job == "scan" or time.monotonic() - t_scan > RESCAN_S:
                t_scan = time.monotonic()  # other processes write and evict too: re-read
                self._guarded("scan")
            if job != "scan":
                self._guarded(job)

    def _guarded(self, job: object) -> None:
        """Run one job; a failure is logged and answered (a load as found nothing, so its
        task goes on), never the end of the I/O thread."""
        try:
            self._do(job)
        except Exception as e:
            log.exception("disk cache job failed")
            if isinstance(job, _Load):
                self._done.put(Loaded(job.ticket, job.ns, job.tokens, job.j0 * self.block, [],
                                      job.epoch))
                self.wake()
            elif isinstance(job, tuple) and not job[1].done():
                job[1].set_exception(e)

    def _do(self, job: object) -> None:
        if isinstance(job, _Write):
            try:
                if job.epoch == self.epoch:
                    self._write(job)
            finally:
                with self.stats.lock:
                    self._pending_bytes -= job.nbytes
                self.queued.discard(job.key)
        elif isinstance(job, _Load):
            self._done.put(self._load(job))
            self.wake()
        elif job == "scan":
            self._enforce()
        elif isinstance(job, tuple) and job[0] == "flush":
            job[1].set_result(self._flush())
        elif isinstance(job, tuple) and job[0] == "barrier":
            job[1].set_result(0)

    def _path(self, key: bytes) -> str:
        name = key.hex()
        return os.path.join(self.dir, name[:2], name + SUFFIX)

    def _write(self, job: _Write) -> None:
        path = self._path(job.key)
        if os.path.exists(path):  # another process wrote it
            self.known.add(job.key)
            return
        if self._paused():
            self._write_failed(None)
            return
        parts = self._encode(job)
        tmp = f"{path}.{secrets.token_hex(8)}.tmp"  # unique across processes and hosts
        try:
            if self.fault is not None:
                self.fault("write")
            private_dir(os.path.dirname(path))
            _write_private(tmp, parts)
            os.replace(tmp, path)
        except OSError as e:
            _unlink(tmp)
            self._write_failed(e)
            return
        self._pause_s = 0.0  # there is room again: the next full disk pauses briefly first
        size = sum(len(p) for p in parts)
        self.known.add(job.key)
        with self.stats.lock:
            self.stats.writes += 1
            self.stats.bytes += size
            self.stats.blocks += 1
        if 0 < self.limit_bytes < self.stats.bytes:
            self._enforce()

    def _encode(self, job: _Write) -> list[bytes | memoryview]:
        """A block file's bytes, in pieces (the rows are views, not copies)."""
        rows = [np.concatenate(p, axis=2) if len(p) > 1 else np.ascontiguousarray(p[0])
                for p in job.pieces]
        header = json.dumps({
            "fingerprint": self.fingerprint.hex(), "key": job.key.hex(), "pos0": job.pos0,
            "tokens": job.tokens,
            "rows": [{"dtype": r.dtype_name, "shape": r.shape(len(job.tokens))}
                     for r in self.layout],
        }).encode()
        parts: list[bytes | memoryview] = [MAGIC, struct.pack("<I", len(header)), header]
        parts += [memoryview(r.data).cast("B") for r in rows]
        parts.append(self._mac(*parts))
        return parts

    def _paused(self) -> bool:
        """Whether writing is paused: after a full disk, until the pause is over or, when the
        filesystem itself was full (a quota does not show in its figures), it reports room for
        blocks again: someone freed space, no need to wait."""
        if self._clock() >= self._resume_at:
            return False
        if self._pause_errno == errno.ENOSPC and self._has_room():
            self._resume_at = 0.0
            return False
        return True

    def _has_room(self) -> bool:
        """Room for two blocks and a header's bound: a margin, as others write too."""
        try:
            if self.fault is not None:
                self.fault("room")
            st = os.statvfs(self.dir)
        except OSError:
            return False
        return st.f_favail > 0 and st.f_bavail * st.f_frsize >= 2 * self.block_bytes + MAX_HEADER

    def _write_failed(self, e: OSError | None) -> None:
        """Count a write that failed (`e`) or was dropped while writing is paused. A full disk
        pauses writing, for twice as long each time it is still full: retrying every block
        would cost I/O for nothing, and evicting to make room would empty every process's
        cache for a disk someone else may have filled (only `limit_bytes` evicts)."""
        with self.stats.lock:
            self.stats.write_errors += 1
            n = self.stats.write_errors
        if e is None:
            return
        if e.errno in NO_SPACE:
            first, longest = self.backoff
            self._pause_s = min(longest, self._pause_s * 2 or first)
            self._resume_at, self._pause_errno = self._clock() + self._pause_s, e.errno
            if self._pause_s == first or n % 100 == 0:  # a new pause, or now and then
                log.warning("disk cache: the disk is full (%s); no block writes for %g s, "
                            "serving goes on without them (%d write errors so far)", e,
                            self._pause_s, n)
        elif n == 1 or n % 100 == 0:
            log.warning("disk cache: writing a block failed (%s; %d failures so far); "
                        "serving goes on without it", e, n)

    def _load(self, job: _Load) -> Loaded:
        b = self.block
        blocks: list[list[np.ndarray]] = []
        for i, key in enumerate(job.keys):
            pos0 = (job.j0 + i) * b
            got = self._read(key, pos0, job.tokens[pos0:pos0 + b])
            if got is None:
                break
            blocks.append(got)
        start = job.j0 * b
        with self.stats.lock:
            if blocks:
                self.stats.hits += 1
                self.stats.hit_tokens += len(blocks) * b
            else:
                self.stats.misses += 1
        if not blocks:
            return Loaded(job.ticket, job.ns, job.tokens, start, [], job.epoch)
        rows = []
        for i, spec in enumerate(self.layout):
            arr = np.concatenate([blk[i] for blk in blocks], axis=2)
            rows.append(torch.from_numpy(arr).view(spec.dtype))
        end = start + len(blocks) * b
        return Loaded(job.ticket, job.ns, job.tokens[:end], start, rows, job.epoch)

    def _read(self, key: bytes, pos0: int, tokens: list[int]) -> list[np.ndarray] | None:
        """Block `key`'s rows as uint8 arrays [L, H, block, D * itemsize], or None (absent or
        bad: a bad file is removed)."""
        path = self._path(key)
        if self.fault is not None:
            self.fault("read")
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                # longer than a block of this layout can be: not read at all
                data = b"" if size > self.block_bytes + MAX_HEADER else f.read()
        except OSError:  # absent, or evicted by another process since
            return None
        rows = self._decode(data, key, pos0, tokens)
        if rows is None:
            with self.stats.lock:
                self.stats.bad_files += 1
            log.warning("disk cache: %s is damaged or not this block's; removed", path)
            if _unlink(path) and key in self.known:
                with self.stats.lock:
                    self.stats.bytes = max(0, self.stats.bytes - size)
                    self.stats.blocks = max(0, self.stats.blocks - 1)
            self.known.discard(key)
            return None
        try:
            os.utime(path)  # the LRU signal
        except OSError:
            pass
        if key not in self.known:  # another process wrote it since the last scan
            self.known.add(key)
            with self.stats.lock:
                self.stats.bytes += size
                self.stats.blocks += 1
        return rows

    def _decode(self, data: bytes, key: bytes, pos0: int,
                tokens: list[int]) -> list[np.ndarray] | None:
        """Every check a block must pass; None if any fails."""
        n = len(tokens)
        fixed = len(MAGIC) + 4
        if len(data) < fixed + DIGEST or data[:len(MAGIC)] != MAGIC:
            return None
        if self._mac(data[:-DIGEST]) != data[-DIGEST:]:
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
        at = fixed + hlen
        if len(data) - DIGEST - at != sum(r.nbytes(n) for r in self.layout):
            return None
        out = []
        for r in self.layout:
            size = r.nbytes(n)
            arr = np.frombuffer(data, np.uint8, size, at).reshape(
                r.n_layer, r.n_head_kv, n, r.head_dim * r.dtype.itemsize)
            out.append(arr)
            at += size
        return out

    def _scan(self) -> list[tuple[float, int, str]]:
        """(mtime, size, path) of every block file; removes temporary files of dead writers."""
        out: list[tuple[float, int, str]] = []
        now = time.time()
        try:
            subs = [e for e in os.scandir(self.dir) if e.is_dir() and len(e.name) == 2]
        except OSError:
            return out
        for sub in subs:
            try:
                entries = list(os.scandir(sub.path))
            except OSError:
                continue
            for e in entries:
                try:
                    st = e.stat()
                except OSError:
                    continue  # removed meanwhile
                if e.name.endswith(SUFFIX) and _is_key(e.name[:-len(SUFFIX)]):
                    out.append((st.st_mtime, st.st_size, e.path))
                elif e.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_S:
                    _unlink(e.path)
        return out

    def _enforce(self) -> None:
        """Re-read the directory; remove the least recently used files while over the limit (to
        90% of it, so this does not run on every write)."""
        files = self._scan()
        total = sum(s for _, s, _ in files)
        goal = self.limit_bytes * 0.9 if self.limit_bytes > 0 else float("inf")
        removed = 0
        if total > goal:
            files.sort()
            for _, size, path in files:
                if total <= goal:
                    break
                if _unlink(path):
                    total -= size
                    removed += 1
        keys = set()
        for _, _, path in files:
            if os.path.exists(path):
                keys.add(bytes.fromhex(os.path.basename(path)[:-len(SUFFIX)]))
        self.known = keys
        with self.stats.lock:
            self.stats.evictions += removed
            self.stats.bytes, self.stats.blocks = total, len(keys)

    def _flush(self) -> int:
        removed = sum(_unlink(p) for _, _, p in self._scan())
        with self.stats.lock:
            self.stats.flushed += removed
            self.stats.bytes = self.stats.blocks = 0
        self.known.clear()
        return removed


def _write_private(path: str, parts: Sequence[bytes | memoryview]) -> None:
    """Write a new file `path` readable by its owner only, whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with open(fd, "wb") as f:
        os.fchmod(fd, 0o600)
        for p in parts:
            f.write(p)


def _warn_if_open(directory: str, keyed: bool) -> None:
    """Others who can write the directory can plant KV unless the files are keyed."""
    try:
        mode = os.stat(directory).st_mode
    except OSError:
        return
    if mode & 0o022 and not keyed:
        log.warning("disk cache: %s is writable by other users, who could plant KV in it: "
                    "make it owner-only or give every server on it --cache-disk-key "
                    "(docs/SECURITY.md)", directory)


def _is_key(name: str) -> bool:
    try:
        return len(bytes.fromhex(name)) == DIGEST
    except ValueError:
        return False


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
