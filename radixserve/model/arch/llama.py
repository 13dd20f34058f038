"""Llama and the Qwen families that differ from it in one thing each.

llama: pre-norm blocks of global attention and a SwiGLU FFN; llama.cpp's converter stores its
Q/K rows permuted for the interleaved rotation, which the loader undoes. qwen2: the same with
q/k/v biases (loaded wherever the file has all three) and Q/K rows as HF has them. qwen3: qwen2
without the biases and with per-head q/k RMS norms before RoPE.
"""

from __future__ import annotations

from radixserve.model.arch.base import Family


class Llama(Family):
    archs = ("llama",)
    permuted_qk = True


class Qwen2(Family):
    archs = ("qwen2",)


class Qwen3(Family):
    archs = ("qwen3",)
    qk_norm = True


FAMILIES = [Llama(), Qwen2(), Qwen3()]
