"""Longest common prefix of token lists: the measure every reuse decision starts from.

Kept free of torch so the benchmark client (which never loads a model) can use it too.
"""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix (LCP) of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared at C speed
        return n
    return next(i for i in range(n) if a[i] != b[i])
