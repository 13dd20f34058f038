"""What a model's sequences need kept, as memory/ builds it (memory/layout.py's contract), read
from the hyper-parameters. Temporary: each model family will declare its own layout."""

from __future__ import annotations

from radixserve.memory.layout import CONV, FULL, SLIDING, MemoryLayout
from radixserve.model.hparams import HParams


def memory_layout(hp: HParams) -> MemoryLayout:
    """Each layer's group (a short convolution, a sliding window, or full attention), the K/V
    row shape, the window and the convolution's state (its last l_cache - 1 input rows of
    n_embd)."""
    kinds = tuple(CONV if conv else SLIDING if swa else FULL
                  for conv, swa in zip(hp.conv_layers, hp.swa_layers))
    return MemoryLayout(hp.n_head_kv, hp.head_dim, kinds,
                        n_swa=hp.n_swa if SLIDING in kinds else 0,
                        conv_rows=hp.l_cache - 1 if CONV in kinds else 0,
                        conv_width=hp.n_embd if CONV in kinds else 0)
