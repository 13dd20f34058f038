"""KV cache types (`-ctk` / `-ctv`): how the pool stores one head's K or V row of one token.

Why llama.cpp's block layouts: a q8_0 row is head_dim / 32 blocks of (f16 scale, 32 int8), a
q4_0 row blocks of (f16 scale, 16 bytes of nibble pairs), byte for byte ggml's `block_q8_0` /
`block_q4_0`, quantized by ggml's reference rounding (gguf-py's `quants` module computes the
same bytes; tests/model/test_kv_types.py checks ours against it). A quantized pool is a uint8
tensor [layers, heads, cells, row bytes], so every tier that copies rows (seq_cp, the radix
tree, the legacy cache, disk blocks, slot files) copies these bytes as they are: a restore is a
copy and restored KV equals recomputed KV bit for bit.

A row is quantized from that row alone (its own blocks' maxima), so a token's stored K/V does
not depend on what else shares the step: the deterministic mode holds. Attention reads every
type at the compute dtype's precision: the kernel (csrc/decode_attn.c) converts each row to bf16
as a decode step reads it, or once a call for a prefill chunk; torch's attention (SDPA) reads
`dequantize`d rows. csrc/kv_rows.c quantizes with these roundings, bit for bit (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK = 32  # values per block of the block types (ggml's QK8_0 / QK4_0)


@dataclass(frozen=True)
class KVType:
    """One of llama.cpp's cache types. `code`: decode_attn.c's KV_* number; `storage`: the
    pool tensor's element type; `block` values per block of `block_bytes` bytes (1 and the
    element size for the float types)."""

    name: str
    code: int
    storage: torch.dtype
    block: int
    block_bytes: int

    @property
    def quantized(self) -> bool:
        return self.block > 1

    def width(self, head_dim: int) -> int:
        """Elements of `storage` a row of head_dim values takes."""
        if not self.quantized:
            return head_dim
        return head_dim // self.block * self.block_bytes

    def row_bytes(self, head_dim: int) -> int:
        return self.width(head_dim) * self.storage.itemsize

    def check(self, head_dim: int) -> None:
        if head_dim % self.block:
            raise ValueError(f"KV type {self.name} needs a head size that is a multiple of "
                             f"{self.block}, the model's is {head_dim}")

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Rows x [..., head_dim] (any float dtype; bf16 values are quantized as they are)
        -> their stored form [..., width]."""
        if not self.quantized:
            return x.to(self.storage)
        lead, d = x.shape[:-1], x.shape[-1]
        b = x.float().reshape(*lead, d // QK, QK)
        out = _q8_0(b) if self.name == "q8_0" else _q4_0(b)
        return out.reshape(*lead, self.width(d))

    def dequantize(self, r: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows [..., width] -> values [..., head_dim] in `dtype` (through f32)."""
        if not self.quantized:
            return r.to(dtype)
        lead = r.shape[:-1]
        b = r.reshape(*lead, -1, self.block_bytes)
        scale = b[..., :2].contiguous().view(torch.float16).float()  # [..., nb, 1]
        if self.name == "q8_0":
            q = b[..., 2:].contiguous().view(torch.int8).float()
        else:
            qs = b[..., 2:].to(torch.int16)
            q = (torch.cat([qs & 0xF, qs >> 4], -1) - 8).float()
        return (q * scale).reshape(*lead, -1).to(dtype)


def _roundf(t: torch.Tensor) -> torch.Tensor:
    """C's roundf (halves away from zero), exactly: t - trunc(t) is exact in f32."""
    r = torch.trunc(t)
    return r + torch.sign(t) * ((t - r).abs() >= 0.5)


def _scale_bytes(d: torch.Tensor) -> torch.Tensor:
    return d.to(torch.float16).view(torch.uint8)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    """ggml's quantize_row_q8_0_ref on blocks b [..., 32] f32 -> [..., 34] bytes."""
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = _roundf(b * inv).to(torch.int8).view(torch.uint8)
    return torch.cat([_scale_bytes(d), q], -1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    """ggml's quantize_row_q4_0_ref on blocks b [..., 32] f32 -> [..., 18] bytes: the value of
    largest magnitude (the first such) is -8 d; nibble j holds value j, its high half j + 16."""
    m = b.gather(-1, b.abs().argmax(-1, keepdim=True))
    d = m / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    t = b * inv + 8.5  # two roundings (mul, then add), as ggml's reference and gguf-py
    q = torch.trunc(t).clamp(0, 15).to(torch.uint8)
    return torch.cat([_scale_bytes(d), q[..., :16] | (q[..., 16:] << 4)], -1)


TYPES = {t.name: t for t in (
    KVType("bf16", 0, torch.bfloat16, 1, 2),
    KVType("f16", 1, torch.float16, 1, 2),
    KVType("f32", 2, torch.float32, 1, 4),
    KVType("q8_0", 3, torch.uint8, QK, 2 + QK),
    KVType("q4_0", 4, torch.uint8, QK, 2 + QK // 2),
)}
# llama.cpp's other cache types: refused by name (flags/table.py)
NOT_BUILT = ("q4_1", "iq4_nl", "q5_0", "q5_1")
_FLOAT = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


def of_dtype(dtype: torch.dtype) -> KVType:
    """The float type that stores `dtype` as it is (the default: the compute dtype)."""
    return TYPES[_FLOAT[dtype]]


def types_name(kt: KVType, vt: KVType) -> str:
    """The pair as a fingerprint names it: one name when K and V agree (so a bf16 state keeps
    the name it had before typed caches), else "k/v"."""
    return kt.name if kt == vt else f"{kt.name}/{vt.name}"


def resolve(k: str, v: str, dtype: torch.dtype) -> tuple[KVType, KVType]:
    """The K and V types named by `-ctk` / `-ctv` ("" : the compute dtype `dtype`)."""
    return tuple(TYPES[n] if n else of_dtype(dtype) for n in (k, v))  # type: ignore[return-value]
