"""The cluster's /metrics: the replicas' Prometheus figures added up, in one server's text.

The first replica's exposition is kept line for line (names, HELP and TYPE exactly as one
server writes them, so dashboards and llama.cpp's tests read the cluster unchanged); each
sample's value is replaced by the replicas' combined value: counters and token, byte and
request gauges are summed (the cluster computed that many prompt tokens, holds that many
bytes); a `_max` gauge takes the largest; `n_busy_slots_per_decode` is averaged weighted by
each replica's `n_decode_total`, the other ratios plainly.
"""

from __future__ import annotations

from prometheus_client.utils import floatToGoString

PER_DECODE, DECODES = "llamacpp:n_busy_slots_per_decode", "llamacpp:n_decode_total"


def _samples(text: str) -> dict[str, float]:
    """`name{labels}` -> value, for every sample line."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def _combine(key: str, values: list[float], weights: list[float]) -> float:
    name = key.split("{", 1)[0]
    if name.endswith("_max"):
        return max(values)
    if name == PER_DECODE and sum(weights) > 0:
        return sum(v * w for v, w in zip(values, weights)) / sum(weights)
    if "ratio" in name or "per_decode" in name:
        return sum(values) / len(values)
    return sum(values)


def aggregate(texts: list[str]) -> str:
    """One exposition from several replicas' (a sample missing on a replica counts there as
    absent, not as 0, for the maximum and the means)."""
    per = [_samples(t) for t in texts]
    weights = [s.get(DECODES, 0.0) for s in per]
    lines = []
    for line in texts[0].splitlines():
        if line and not line.startswith("#"):
            key = line.rpartition(" ")[0]
            got = [(s[key], w) for s, w in zip(per, weights) if key in s]
            value = _combine(key, [v for v, _ in got], [w for _, w in got])
            line = f"{key} {floatToGoString(value)}"  # as prometheus_client writes it
        lines.append(line)
    return "\n".join(lines) + "\n"
