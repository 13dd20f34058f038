"""`POST /slots/{id}?action=save|restore|erase`: llama-server's slot tasks, on the engine thread.

Responses are llama-server's. Beyond it: file names must stay inside `--slot-save-path`
(tiers/slot_file.py), saves are atomic, a busy slot is refused with 409 instead of waiting, and a
restore checks the whole file (format, checksum, model fingerprint, tokens, positions, free
cells) before it touches the slot, so a failed restore leaves the slot exactly as it was
(llama-server clears it). A file keeps the `cache_salt` of the KV it holds and a restore puts
the KV back in that namespace: tenants never share prompt KV, in this tier either.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from radixserve.memory.tiers.slot_file import (
    SlotFile,
    main_size,
    read_slot_file,
    resolve_in_dir,
    write_slot_file,
)
from radixserve.errors import TaskError, not_supported
from radixserve.memory.pool.pool import KVPool
from radixserve.memory.pool.state import (
    StateError,
    fingerprint_of,
    get_draft_state,
    get_state,
    parse_pool_state,
)

if TYPE_CHECKING:
    from radixserve.config import ServerConfig
    from radixserve.memory.holders import Holder


class SlotFileHost(Protocol):
    """What a slot action reads of the memory manager (which calls these functions)."""

    cfg: ServerConfig
    slots: Sequence[Holder]
    pool: KVPool
    arch: str  # the model's architecture (the state's fingerprint)
    tok: Any  # its tokenizer (`n_vocab`)

    def offer_before_drop(self, slot: Holder) -> None: ...

log = logging.getLogger(__name__)

ACTIONS = ("save", "restore", "erase")
NOT_SUPPORTED = "This server does not support slots action. Start it with `--slot-save-path`"


def _bad(message: str) -> TaskError:
    return TaskError(400, "invalid_request_error", message)


def slot_action(
    mem: SlotFileHost, id_slot: int, action: str, filename: str | None
) -> dict[str, Any]:
    """Run one slot action; raises TaskError (501 no save path, 400 bad request or unusable file,
    409 slot busy, 500 I/O failure while saving)."""
    save_dir = mem.cfg.slot_save_path
    if not save_dir:
        raise not_supported(NOT_SUPPORTED)
    if action not in ACTIONS:
        raise _bad("Invalid action")
    if not 0 <= id_slot < len(mem.slots):
        raise _bad("Invalid slot ID")
    slot = mem.slots[id_slot]
    if action == "erase":
        _check_idle(slot)
        return _erase(mem, slot)
    if not filename:
        raise _bad('"filename" is required')
    try:
        path = resolve_in_dir(save_dir, filename)
    except ValueError as e:
        raise _bad(f"Invalid filename: {e}") from None
    _check_idle(slot)
    if action == "save":
        return _save(mem, slot, filename, str(path))
    return _restore(mem, slot, filename, str(path))


def _check_idle(slot: Holder) -> None:
    if slot.is_processing:
        raise TaskError(409, "invalid_request_error",
                        f"slot {slot.id} is processing a task; retry when it is idle")


def _erase(mem: SlotFileHost, slot: Holder) -> dict[str, Any]:
    n_erased = len(slot.kv)
    slot.kv.drop()
    log.info("slot %d: erased %d tokens", slot.id, n_erased)
    return {"id_slot": slot.id, "n_erased": n_erased}


def _save(mem: SlotFileHost, slot: Holder, filename: str, path: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    pool, n = mem.pool, len(slot.kv.tokens)
    if pool.seq_positions(slot.id) != list(range(n)):  # token i must sit at position i
        raise TaskError(500, "server_error",
                        f"Unable to save slot: its KV does not match its {n} tokens")
    state = get_state(pool, slot.id, fingerprint_of(pool, mem.arch))
    draft = b""
    if pool.draft is not None:  # the SDFT appendix: the draft model's rows, all of them
        slot.kv.complete_draft()
        draft = get_draft_state(pool, slot.id)
    try:
        n_written = write_slot_file(path, SlotFile(list(slot.kv.tokens), state,
                                                   list(slot.kv.checkpoints), draft=draft,
                                                   salt=slot.kv.salt))
    except IsADirectoryError:  # the client named a directory: its error, not the server's
        raise _bad(f"Unable to save slot: {filename!r} is a directory") from None
    except OSError as e:
        log.error("slot %d: saving %r failed: %s", slot.id, filename, e)
        raise TaskError(500, "server_error",
                        f"Unable to save slot: {e.strerror or e}") from None
    ms = (time.perf_counter() - t0) * 1e3
    log.info("slot %d: saved %d tokens to %r (%d bytes, %.1f ms)", slot.id, n, filename,
             n_written, ms)
    return {"id_slot": slot.id, "filename": filename, "n_saved": n, "n_written": n_written,
            "timings": {"save_ms": ms}}


def _restore(mem: SlotFileHost, slot: Holder, filename: str, path: str) -> dict[str, Any]:
    """All checks first, then the slot's KV is replaced. On failure: 400, the slot as it was."""
    t0 = time.perf_counter()
    pool, seq = mem.pool, slot.id

    def fail(reason: str) -> TaskError:
        log.warning("slot %d: restore of %r failed: %s", seq, filename, reason)
        return _bad(f"Unable to restore slot: {reason}")

    try:
        sf, _warnings = read_slot_file(path)  # appendix warnings are logged by the reader
    except FileNotFoundError:
        raise fail(f"file {filename!r} not found") from None
    except OSError as e:
        raise fail(e.strerror or str(e)) from None
    except ValueError as e:
        raise fail(str(e)) from None
    n = len(sf.tokens)
    if n > slot.n_ctx:
        raise fail(f"Restored prompt does not fit in the slot context ({n} > {slot.n_ctx})")
    n_vocab = mem.tok.n_vocab
    if any(not 0 <= t < n_vocab for t in sf.tokens):
        raise fail("Invalid tokens in slot save file")
    fp = fingerprint_of(pool, mem.arch)
    swa = pool.windowed
    try:
        st = parse_pool_state(pool, sf.state, fp)
    except StateError as e:
        raise fail(str(e)) from None
    if st.positions != list(range(n)):
        raise fail(f"the file's {n} tokens do not match its KV state "
                   f"({len(st.positions)} positions)")
    room = KVPool.n_reclaimable(pool, seq)
    if n > room:
        raise fail(f"No available space in KV cache (need {n} cells, {room} available)")
    window = None
    if swa is not None and st.swa is not None:
        w = st.swa.positions
        if w != list(range(n - len(w), n)):
            raise fail("the file's sliding-window KV is not its last tokens'")
        if len(w) > swa.swa.n_reclaimable(seq):
            raise fail(f"No available space in the sliding-window KV (need {len(w)} cells)")
        window = (w, st.swa.k, st.swa.v)
    if (sf.draft or sf.speculative) and pool.draft is None:
        log.info("slot %d: the draft state in %r is not used (no draft model here)", seq,
                 filename)
    if sf.checkpoints and not pool.layout.needs_checkpoints:
        log.info("slot %d: %d checkpoints in %r are not used (the model has no sliding "
                 "window)", seq, len(sf.checkpoints), filename)
    mem.offer_before_drop(slot)  # what the slot held stays reusable from the tree
    # the restored KV is back in the cache namespace it was saved from (the file's
    # `cache_salt`; "" for a version-1 file): it serves requests of that salt and no other
    slot.kv.load_rows(list(sf.tokens), st.k, st.v, window,
                      sf.checkpoints if pool.layout.needs_checkpoints else (), draft=sf.draft,
                      salt=sf.salt)
    n_read = main_size(sf)  # as llama-server: the bytes its state loader consumed
    ms = (time.perf_counter() - t0) * 1e3
    log.info("slot %d: restored %d tokens from %r (%.1f ms)", seq, n, filename, ms)
    return {"id_slot": seq, "filename": filename, "n_restored": n, "n_read": n_read,
            "timings": {"restore_ms": ms}}
