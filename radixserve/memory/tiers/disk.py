"""The disk tier under the radix cache (`--cache-disk DIR`): KV blocks as content-addressed files.

Beyond the seeds, whose radix cache lives in one process's memory: a prefix written here
survives a restart and is read by every server process on the same directory (SGLang's HiCache
L3 and LMCache do this for SGLang and vLLM).

- Unit: a block of `block` tokens at positions [j*block, (j+1)*block), every layer's K/V rows
  (a draft model's too), whatever radix edges the tokens lie on. Fixed, aligned blocks make a
  prefix's files findable from the tokens alone, with no index another process must share.
- Names, bytes, checks and the trust model of one block file: disk_block.py (a file that
  does not check out is a miss and is removed: never an error, never wrong KV).
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
import itertools
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from radixserve.memory.tiers.disk_block import (MAX_HEADER, SUFFIX, BlockFormat, RowSpec, is_key,
                                         private_dir, unlink, warn_if_open, write_private)

log = logging.getLogger(__name__)

NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})  # write failures that pause writing
BACKOFF_S = (1.0, 60.0)  # the first pause after a full disk, and the longest (it doubles)
MAX_PENDING_WRITE_BYTES = 256 * 2**20  # queued writes beyond this are dropped (counted)
RESCAN_S = 10.0  # other processes write too: re-read the directory's size this often
STALE_TMP_S = 600.0  # a temporary file this old belongs to a writer that died
IO_NICE = 19  # the I/O thread's nice value: it hashes and copies, it must not slow decoding


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
        self.format = BlockFormat(fingerprint, layout, key)
        self.block_bytes = sum(r.nbytes(block) for r in self.layout)
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
        warn_if_open(self.dir, bool(key))

    # ##### engine thread #####
    def keys(self, ns: str, tokens: Sequence[int], n_blocks: int) -> list[bytes]:
        """The keys of the first `n_blocks` blocks of `tokens` in namespace `ns`."""
        return self.format.keys(ns, tokens, self.block, n_blocks)

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
        parts = self.format.encode(job.key, job.pos0, job.tokens, job.pieces)
        tmp = f"{path}.{secrets.token_hex(8)}.tmp"  # unique across processes and hosts
        try:
            if self.fault is not None:
                self.fault("write")
            private_dir(os.path.dirname(path))
            write_private(tmp, parts)
            os.replace(tmp, path)
        except OSError as e:
            unlink(tmp)
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
        rows = self.format.decode(data, key, pos0, tokens)
        if rows is None:
            with self.stats.lock:
                self.stats.bad_files += 1
            log.warning("disk cache: %s is damaged or not this block's; removed", path)
            if unlink(path) and key in self.known:
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
                if e.name.endswith(SUFFIX) and is_key(e.name[:-len(SUFFIX)]):
                    out.append((st.st_mtime, st.st_size, e.path))
                elif e.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_S:
                    unlink(e.path)
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
                if unlink(path):
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
        removed = sum(unlink(p) for _, _, p in self._scan())
        with self.stats.lock:
            self.stats.flushed += removed
            self.stats.bytes = self.stats.blocks = 0
        self.known.clear()
        return removed


