"""A context checkpoint (llama.cpp's `common_prompt_checkpoint`).

With sliding-window attention a sequence's sliding layers keep only the last n_swa positions,
so a prompt that diverges from the slot's tokens before that window cannot reuse the slot's
KV as it stands. A checkpoint is a copy of the sliding layers' KV taken while the window still
covered an earlier point; restoring it (with the global layers' KV, which is never dropped)
makes the slot hold a usable prefix again. It travels with the sequence: in the slot, in legacy
host-cache entries (counted in their size) and in slot files (the SCKP appendix).
"""

from __future__ import annotations

import itertools
import struct
import zlib
from dataclasses import dataclass, field


_BORN = itertools.count()  # the order checkpoints were made in: the oldest go first


class CheckpointError(ValueError):
    """A checkpoint whose bytes are not what was written (a flipped byte, a short buffer)."""


def seal(state: bytes) -> bytes:
    """A checkpoint's target buffer: the sliding part's state plus its CRC-32. The SCKP
    appendix (as the seed defines it) has no checksum of its own, and a flipped byte in a K/V
    row would otherwise load silently and change the tokens that follow."""
    return state + struct.pack("<I", zlib.crc32(state))


def unseal(target: bytes) -> bytes:
    """The state inside a sealed buffer; CheckpointError if the checksum does not match."""
    if len(target) < 4 or zlib.crc32(target[:-4]) != struct.unpack("<I", target[-4:])[0]:
        raise CheckpointError("checkpoint checksum mismatch")
    return target[:-4]


@dataclass(slots=True)
class Checkpoint:
    n_tokens: int  # tokens held when it was taken: it restores the prefix of that many
    pos_min: int  # positions its sliding-layer KV covers
    pos_max: int
    target: bytes  # `seal`ed memory/pool/state.py state of the sliding layers only
    draft: bytes = b""  # a draft model's (none yet; carried through the formats)
    speculative: bytes = b""
    id_task: int = -1  # the task that made it; -1: restored from a cache or a file
    born: int = field(default_factory=lambda: next(_BORN), compare=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.target) + len(self.draft) + len(self.speculative)
