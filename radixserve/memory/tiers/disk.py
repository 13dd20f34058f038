"""The disk tier under the radix cache (`--cache-disk DIR`): KV blocks as content-addressed files.

Beyond the seeds, whose radix cache lives in one process's memory: a prefix written here
survives a restart and is read by every server process on the same directory (SGLang's HiCache
L3 and LMCache do this for SGLang and vLLM).

- Unit: a block of `block` tokens at positions [j*block, (j+1)*block), every layer's K/V rows
  (a draft model's too), whatever radix edges the tokens lie on. Fixed, aligned blocks make a
  prefix's files findable from the tokens alone, with no index another process must share.
- Names, bytes, checks and the trust model of one block file: disk_block.py (a file that
  does not check out is a miss and is removed: never an error, never wrong KV).
- A layout whose recurrent state has no rows a token (Gated DeltaNet, Mamba2:
  memory/pool/recurrent.py; `max_blob` > 0) keeps, beside the blocks of its attention rows,
  *snapshot files* (disk_block.py): the state after a prefix of n tokens, with the rows of
  the tail past its whole blocks. Such a prefix is usable only up to a state, so a load
  (`load_snapshot`) picks, on the I/O thread, the deepest snapshot indexed for the prompt
  (the last scan's names plus this process's writes; its tail's hash must match the prompt's)
  whose blocks it can read, deepest first, and reads those blocks then the file: a prompt
  with no snapshot on its path reads nothing, and a snapshot whose blocks went (evicted, bad)
  gives way to a shallower one. Snapshot files count in the byte limit and the LRU as blocks
  do, and leave the same way; the state's own seal (checkpoint.py) is checked on reading too.
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

from radixserve.memory.checkpoint import CheckpointError, unseal
from radixserve.memory.tiers.disk_block import (MAX_HEADER, SNAP_SUFFIX, SUFFIX, BlockFormat,
                                                RowSpec, is_key, private_dir, snap_name, unlink,
                                                warn_if_open, write_private)

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
    (`rows` empty: nothing found); a snapshot load's `snapshot`: the state after the last of
    `tokens` (sealed, as the tree keeps it)."""

    ticket: int
    ns: str
    tokens: list[int]
    start: int
    rows: list[torch.Tensor]
    epoch: int
    snapshot: bytes = b""


@dataclass(slots=True)
class _Write:
    key: bytes
    pos0: int
    tokens: list[int]
    pieces: list[list[np.ndarray]]  # per row tensor, uint8 views [L, H, t, D * itemsize]
    nbytes: int
    epoch: int
    snap: tuple[bytes, int] | None = None  # a snapshot file's (P, n); `key` is its S
    blob: bytes = b""  # a snapshot file's state


@dataclass(slots=True)
class _Load:
    ticket: int
    ns: str
    tokens: list[int]  # the prompt up to the last block's end
    j0: int
    keys: list[bytes]  # of blocks j0..
    epoch: int
    # a snapshot load: P of j = 0, 1, ... (the root key, then every block's), the depth a
    # snapshot must pass to be worth reading, and the deepest j whose blocks may be read
    prefixes: list[bytes] | None = None
    floor: int = 0
    j_max: int = 0


@dataclass(slots=True)
class DiskStats:
    """Figures of this process's view of the directory (bytes and blocks: the whole directory
    as last scanned, at most RESCAN_S ago when idle, plus what this process wrote, read or
    removed since)."""

    bytes: int = 0
    blocks: int = 0
    snapshots: int = 0  # snapshot files (a recurrent state's)
    hits: int = 0  # loads that found at least one block
    misses: int = 0  # loads that found none
    hit_tokens: int = 0
    writes: int = 0  # blocks written
    snapshot_writes: int = 0  # snapshot files written
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
                 clock: Callable[[], float] = time.monotonic, max_blob: int = 0) -> None:
        """`limit_bytes` <= 0: no bound. `key` (`load_key`; b"": none) keys names and
        checksums. `max_blob` > 0: the layout's state lives in snapshot files (a recurrent
        layout's), a state at most that many bytes. After a full disk, writes pause for
        `backoff[0]` seconds, doubling up to
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
        self.max_blob = max_blob
        self.snapshots = max_blob > 0  # loads serve a prefix only up to a snapshot
        self.snap_known: set[bytes] = set()  # snapshot files' S on disk (as `known`)
        # the index of snapshot files, P -> {(n, S)}: kept by the I/O thread (an entry is
        # replaced, never changed in place), read by the engine's `may_have_snapshot`
        self._snap_index: dict[bytes, frozenset[tuple[int, bytes]]] = {}
        self.scanned = False  # the directory was read once: the index holds its files
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

    def root(self, ns: str) -> bytes:
        """P of the snapshots within block 0 of namespace `ns`."""
        return self.format.root(ns)

    def snap_key(self, prefix: bytes, tail: Sequence[int]) -> bytes:
        """S of the snapshot after `tail` past the whole blocks whose chain key is `prefix`."""
        return self.format.snap_key(prefix, tail)

    def write(self, key: bytes, pos0: int, tokens: list[int],
              pieces: list[list[torch.Tensor]]) -> bool:
        """Queue block `key` (its tokens at pos0.., the rows as pieces along the token axis);
        False when it was known already or the queue is full."""
        if key in self.known or key in self.queued:
            return False
        return self._queue(_Write(key, pos0, tokens, [], self.block_bytes, self.epoch), pieces)

    def write_snapshot(self, prefix: bytes, key: bytes, pos0: int, tokens: list[int],
                       pieces: list[list[torch.Tensor]], blob: bytes) -> bool:
        """Queue the snapshot file S = `key` of the prefix ending after `tokens` (at pos0 = j *
        block, the tail past the blocks whose chain key is `prefix`; its rows as pieces, the
        state `blob`); False when it was known already or the queue is full."""
        if key in self.snap_known or key in self.queued:
            return False
        nbytes = sum(r.nbytes(len(tokens)) for r in self.layout) + len(blob)
        return self._queue(_Write(key, pos0, tokens, [], nbytes, self.epoch,
                                  (prefix, pos0 + len(tokens)), blob), pieces)

    def _queue(self, job: _Write, pieces: list[list[torch.Tensor]]) -> bool:
        if self._pending_bytes + job.nbytes > MAX_PENDING_WRITE_BYTES:
            with self.stats.lock:
                self.stats.dropped += 1
            return False
        job.pieces = [[t.view(torch.uint8).numpy() for t in row] for row in pieces]
        self.queued.add(job.key)
        with self.stats.lock:
            self._pending_bytes += job.nbytes
        self._put(2, job)
        return True

    def load(self, ns: str, tokens: list[int], j0: int, keys: list[bytes]) -> int:
        """Queue reading blocks j0.. (stopping at the first missing or bad one); returns the
        ticket its `Loaded` will carry."""
        ticket = next(self._tickets)
        self._put(0, _Load(ticket, ns, tokens, j0, keys, self.epoch))
        return ticket

    def may_have_snapshot(self, tokens: list[int], prefixes: list[bytes], floor: int,
                          j_max: int) -> bool:
        """Whether the index holds a snapshot of a prefix of `tokens` deeper than `floor`
        within j_max whole blocks (True until the first scan is done): a load that could find
        nothing is not worth its round trip. Another process's files join the index at this
        process's next scan (at most RESCAN_S apart)."""
        if not self.scanned:
            return True
        b, index = self.block, self._snap_index
        for j in range(floor // b, min(j_max, len(prefixes) - 1) + 1):
            for n, key in index.get(prefixes[j], ()):
                if (n // b == j and floor < n <= len(tokens)
                        and key == self.snap_key(prefixes[j], tokens[j * b:n])):
                    return True
        return False

    def load_snapshot(self, ns: str, tokens: list[int], j0: int, prefixes: list[bytes],
                      floor: int, j_max: int) -> int:
        """Queue reading the deepest snapshot of a prefix of `tokens` (the prompt but its last
        token) deeper than `floor` with its whole blocks up to j_max, P of each j in
        `prefixes`, and the blocks j0.. below it; returns the ticket its `Loaded` will carry
        (rows of tokens[j0 * block:n] and the state after n; nothing found: no rows)."""
        ticket = next(self._tickets)
        self._put(0, _Load(ticket, ns, tokens, j0, prefixes[j0 + 1:], self.epoch, prefixes,
                           floor, j_max))
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
        """Drop queued writes and reads and remove every block and snapshot file in the
        directory (every model's, every process's); the future gives the number of files
        removed. The removal
        goes before any job queued after it (loads included), and a read already running
        belongs to the old epoch: nothing read before the flush reaches the tree after it."""
        self.epoch += 1
        self.known.clear()
        self.snap_known.clear()
        self.queued.clear()
        fut: Future[int] = Future()
        self._put(-1, ("flush", fut))
        return fut

    def figures(self) -> dict[str, float]:
        s = self.stats
        with s.lock:
            return {"bytes": s.bytes, "tokens": s.blocks * self.block, "hits": s.hits,
                    "misses": s.misses, "hit_tokens": s.hit_tokens, "writes": s.writes,
                    "snapshots": s.snapshots, "snapshot_writes": s.snapshot_writes,
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
            self._done.put(self._load(job) if job.prefixes is None else self._load_snapshot(job))
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

    def _snap_path(self, prefix: bytes, n: int, key: bytes) -> str:
        p = prefix.hex()
        return os.path.join(self.dir, p[:2], f"{p}-{n}-{key.hex()}{SNAP_SUFFIX}")

    def _snap_known(self, prefix: bytes, n: int, key: bytes, known: bool) -> None:
        """Index (or forget) a snapshot file (I/O thread)."""
        entries = self._snap_index.get(prefix, frozenset())
        entries = entries | {(n, key)} if known else entries - {(n, key)}
        if entries:
            self._snap_index[prefix] = entries
        else:
            self._snap_index.pop(prefix, None)
        if known:
            self.snap_known.add(key)
        else:
            self.snap_known.discard(key)

    def _write(self, job: _Write) -> None:
        snap = job.snap
        path = self._path(job.key) if snap is None else self._snap_path(*snap, job.key)
        if os.path.exists(path):  # another process wrote it
            if snap is None:
                self.known.add(job.key)
            else:
                self._snap_known(*snap, job.key, True)
            return
        if self._paused():
            self._write_failed(None)
            return
        parts = self.format.encode(job.key, job.pos0, job.tokens, job.pieces, job.blob)
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
        with self.stats.lock:
            self.stats.bytes += size
            if snap is None:
                self.stats.writes += 1
                self.stats.blocks += 1
            else:
                self.stats.snapshot_writes += 1
                self.stats.snapshots += 1
        if snap is None:
            self.known.add(job.key)
        else:
            self._snap_known(*snap, job.key, True)
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

    def _load_snapshot(self, job: _Load) -> Loaded:
        """The deepest indexed snapshot of a prefix of job.tokens past job.floor whose blocks
        j0.. and file read and check out (deepest first: a missing block or a bad file gives
        way to a shallower one), with those blocks' and the tail's rows."""
        b, j0, prefixes = self.block, job.j0, job.prefixes
        assert prefixes is not None
        tokens = job.tokens
        cands = sorted(((n, j, key) for j, p in enumerate(prefixes[:job.j_max + 1])
                        for n, key in self._snap_index.get(p, ())
                        if n // b == j and job.floor < n <= len(tokens)), reverse=True)
        blocks: list[list[np.ndarray]] = []  # blocks j0.. read so far, in order
        broken = False  # a block past them is missing or bad: no deeper j is reachable
        found = None
        for n, j, key in cands:
            if key != self.format.snap_key(prefixes[j], tokens[j * b:n]):
                continue  # another tail of the same length
            while j0 + len(blocks) < j and not broken:
                jb = j0 + len(blocks)
                got = self._read(prefixes[jb + 1], jb * b, tokens[jb * b:(jb + 1) * b])
                if got is None:
                    broken = True
                else:
                    blocks.append(got)
            if j0 + len(blocks) < j:
                continue
            snap = self._read_snapshot(prefixes[j], n, key, j * b, tokens[j * b:n])
            if snap is not None:
                found = n, j, snap
                break
        start = j0 * b
        if found is None:
            with self.stats.lock:
                self.stats.misses += 1
            return Loaded(job.ticket, job.ns, tokens, start, [], job.epoch)
        n, j, (tail, blob) = found
        start = min(j0, j) * b
        used = blocks[:max(0, j - j0)]
        with self.stats.lock:
            self.stats.hits += 1
            self.stats.hit_tokens += n - start
        rows = []
        for i, spec in enumerate(self.layout):
            arr = np.concatenate([blk[i] for blk in used] + [tail[i]], axis=2)
            rows.append(torch.from_numpy(arr).view(spec.dtype))
        return Loaded(job.ticket, job.ns, tokens[:n], start, rows, job.epoch, blob)

    def _read_snapshot(self, prefix: bytes, n: int, key: bytes, pos0: int, tokens: list[int]
                       ) -> tuple[list[np.ndarray], bytes] | None:
        """A snapshot file's tail rows and its (sealed) state, or None (absent or bad: a bad
        file is removed and forgotten)."""
        path = self._snap_path(prefix, n, key)
        if self.fault is not None:
            self.fault("read")
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                bound = self.block_bytes + MAX_HEADER + self.max_blob
                data = b"" if size > bound else f.read()
        except OSError:  # absent, or evicted by another process since
            if key in self.snap_known:
                self._snap_known(prefix, n, key, False)
            return None
        got = self.format.decode_snapshot(data, key, pos0, tokens)
        if got is not None:
            try:
                unseal(got[1])  # the state's own seal, as a restore checks it
            except CheckpointError:
                got = None
        if got is None:
            with self.stats.lock:
                self.stats.bad_files += 1
            log.warning("disk cache: %s is damaged or not this snapshot's; removed", path)
            if unlink(path) and key in self.snap_known:
                with self.stats.lock:
                    self.stats.bytes = max(0, self.stats.bytes - size)
                    self.stats.snapshots = max(0, self.stats.snapshots - 1)
            if key in self.snap_known:
                self._snap_known(prefix, n, key, False)
            return None
        try:
            os.utime(path)  # the LRU signal
        except OSError:
            pass
        if key not in self.snap_known:
            self._snap_known(prefix, n, key, True)
            with self.stats.lock:
                self.stats.bytes += size
                self.stats.snapshots += 1
        return got

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
        """(mtime, size, path) of every block and snapshot file; removes temporary files of
        dead writers."""
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
                if ((e.name.endswith(SUFFIX) and is_key(e.name[:-len(SUFFIX)]))
                        or (e.name.endswith(SNAP_SUFFIX)
                            and snap_name(e.name[:-len(SNAP_SUFFIX)]) is not None)):
                    out.append((st.st_mtime, st.st_size, e.path))
                elif e.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_S:
                    unlink(e.path)
        return out

    def _enforce(self) -> None:
        """Re-read the directory; remove the least recently used files (blocks and snapshots
        alike) while over the limit (to 90% of it, so this does not run on every write)."""
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
        keys, snaps = set(), {}
        index: dict[bytes, set[tuple[int, bytes]]] = {}
        for _, _, path in files:
            if os.path.exists(path):
                name = os.path.basename(path)
                if name.endswith(SUFFIX):
                    keys.add(bytes.fromhex(name[:-len(SUFFIX)]))
                elif (got := snap_name(name[:-len(SNAP_SUFFIX)])) is not None:
                    index.setdefault(got[0], set()).add((got[1], got[2]))
                    snaps[got[2]] = None
        self.known, self.snap_known = keys, set(snaps)
        self._snap_index = {p: frozenset(e) for p, e in index.items()}
        self.scanned = True
        with self.stats.lock:
            self.stats.evictions += removed
            self.stats.bytes, self.stats.blocks = total, len(keys)
            self.stats.snapshots = len(snaps)

    def _flush(self) -> int:
        removed = sum(unlink(p) for _, _, p in self._scan())
        with self.stats.lock:
            self.stats.flushed += removed
            self.stats.bytes = self.stats.blocks = self.stats.snapshots = 0
        self.known.clear()
        self.snap_known.clear()
        self._snap_index = {}
        return removed


