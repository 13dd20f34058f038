"""The composition root: a loaded model and the settings become a scheduler over its memory.

Everything the engine runs is built here, once, in dependency order: the slot layout
(llama-server's rules), the KV pool the model needs, one KV owner per slot, the draft model and
its speculator, the host cache with its disk tier, and the memory manager over all of them;
the scheduler receives them and builds nothing.
"""

from __future__ import annotations

import logging

from radixserve.config import POOLINGS, ServerConfig
from radixserve.engine.counters import ServerMetrics
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.slot import Slot
from radixserve.engine.speculative import Speculator, check_draft, load_draft
from radixserve.memory.host_tier import HostTier
from radixserve.memory.front import KVTypes, Pool, build_pool, fingerprint_of, resolve_kv_types
from radixserve.memory.manager import MemoryManager
from radixserve.memory.seq_kv import SlotKV
from radixserve.memory.tiers.base import PromptCache
from radixserve.model.loader import Model

log = logging.getLogger(__name__)


def slot_layout(cfg: ServerConfig, n_ctx_train: int) -> tuple[int, int, bool, int]:
    """(n_slots, pool cells, unified, n_ctx per slot) as llama-server derives them."""
    n_slots = cfg.n_parallel if cfg.n_parallel > 0 else 4
    unified = cfg.kv_unified or cfg.n_parallel <= 0  # -np auto: 4 slots, unified KV
    n_ctx = cfg.ctx_size or n_ctx_train
    if unified:
        n_slot = n_ctx
        if cfg.kv_unified_per_slot > 0:
            n_slot = min(n_slot, cfg.kv_unified_per_slot)
    else:
        n_slot = n_ctx // n_slots
        n_ctx = n_slot * n_slots
    if n_slot > n_ctx_train:
        log.warning("the slot context (%d) exceeds the training context (%d) - capping",
                    n_slot, n_ctx_train)
        n_slot = n_ctx_train
    return n_slots, n_ctx, unified, n_slot


def model_pool(model: Model, n_cells: int, n_seq: int, unified: bool, n_step: int,
               swa_full: bool = False, types: KVTypes | None = None) -> Pool:
    """The pool a loaded model needs, built from its declared layout; `n_step`: the most new
    tokens one forward holds; `types`: the K and V cache types (`-ctk` / `-ctv`; None: the
    compute dtype)."""
    return build_pool(model.layout, n_cells, n_seq, unified, model.dtype, model.rope.rotate,
                      model.rope_swa.rotate, n_step, model.device, types, swa_full)


def build_scheduler(model: Model, cfg: ServerConfig, metrics: ServerMetrics,
                    cache: PromptCache | None = None, draft: Model | None = None) -> Scheduler:
    """`cache`: a host cache to use instead of the one `cfg` describes (tests inject faults
    this way); `draft`: the draft model instead of loading `cfg.spec.draft_model`."""
    hp = model.hp
    pooling = cfg.embedding_pooling(hp.pooling)
    if cfg.embeddings and pooling not in POOLINGS:
        raise ValueError(f"this model's embedding pooling ({pooling}) is not computed "
                         "here (rank needs a reranker's classification head): give "
                         "--pooling none|mean|cls|last")
    n_slots, n_cells, unified, n_ctx_slot = slot_layout(cfg, hp.n_ctx_train)
    n_budget = max(1, min(cfg.batch_size, cfg.ubatch_size))
    pool = model_pool(model, n_cells, n_slots, unified, n_budget, cfg.swa_full,
                      resolve_kv_types(cfg.cache_type_k, cfg.cache_type_v, model.dtype))
    layout = pool.layout  # as held (--swa-full: no window)
    fp = fingerprint_of(pool, hp.arch)
    n_ckpt = cfg.ctx_checkpoints if layout.needs_checkpoints else 0
    if not layout.can_shift and cfg.context_shift:  # llama-server's words where it cannot shift
        log.warning("context shift is not supported by this model (%d recurrent layers: a "
                    "state exists only at the positions it was computed at), disabling",
                    layout.n_state)
    slots = [Slot(SlotKV(pool, i, fp, n_ckpt, cfg.checkpoint_min_step), n_ctx_slot,
                  cfg.context_shift and layout.can_shift) for i in range(n_slots)]
    spec = None
    if "draft-simple" in cfg.spec.types and layout.rollback_recomputes:
        raise ValueError("draft-simple is not supported for models with Gated DeltaNet or "
                         "Mamba2 layers: the draft model's KV rides in the target's cells, "
                         "which a rejected draft rolls back and recomputes (a recurrent draft "
                         "would need its own state handling); use ngram-simple or ngram-mod")
    if cfg.spec.enabled:
        if draft is None:
            draft = load_draft(cfg, model)
        else:
            check_draft(model, draft)
        spec = Speculator(cfg.spec, pool, n_slots, n_budget, draft)
        log.info("speculative decoding: %s", ", ".join(cfg.spec.types))
    for s in slots:
        s.server_spec, s.can_speculate = cfg.spec, spec is not None
        if spec is not None and draft is not None:
            s.kv.sync_draft = spec.sync
    models = (model,) if draft is None else (model, draft)
    host = HostTier(cfg, pool, hp.arch, cache, models)
    no_shift = not layout.shifts_chunks or model.deterministic
    if no_shift and cfg.cache_reuse > 0:
        why = ("the model's recurrent layers keep no state to shift" if not layout.can_shift
               else "the sliding window keeps no KV to shift" if layout.window else
               "shifted chunks keep KV computed for other text, so deterministic mode never "
               "shifts them (--deterministic off to allow it)")
        log.warning("--cache-reuse %d: %s", cfg.cache_reuse, why)
    mem = MemoryManager(cfg, pool, slots, host, model.tokenizer, hp.arch, no_shift=no_shift)
    log.info("initializing, n_slots = %d, n_ctx_slot = %d, kv_unified = %s",
             n_slots, n_ctx_slot, unified)
    if layout.n_recurrent:
        log.info("recurrent layers: %d Gated DeltaNet or Mamba2 (state: %.2f MiB a sequence, "
                 "kept after its last token), snapshots as context checkpoints, max = %d, "
                 "min spacing = %d",
                 layout.n_recurrent, layout.state_bytes / 2**20, n_ckpt,
                 cfg.checkpoint_min_step)
    elif not layout.can_shift:
        log.info("recurrent layers: %d short convolutions (state: the last %d input rows, "
                 "%d window cells), snapshots as context checkpoints, max = %d, min spacing = %d",
                 layout.n_conv, layout.state_per_sequence, pool.window_cells, n_ckpt,
                 cfg.checkpoint_min_step)
    elif layout.window:
        log.info("sliding window %d: %d sliding-layer cells, context checkpoints enabled, "
                 "max = %d, min spacing = %d", layout.window, pool.window_cells, n_ckpt,
                 cfg.checkpoint_min_step)
    return Scheduler(model, cfg, metrics, mem, slots, spec, n_ctx_slot, n_budget)
