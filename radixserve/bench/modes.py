"""Cache modes under comparison: the server flags and request field that define each one.

- `no-cache`: `--cache-ram 0` and every request sends `cache_prompt: false`, so nothing is reused
  at all, not even the slot's own KV. This is the seeds' strict baseline (their benchmark sets
  `cache_prompt: false` itself for the same reason): with `--cache-ram 0` alone a slot still
  reuses the prefix it happens to hold, which mixes luck of slot assignment into the baseline.
- `slot-only`: `--cache-ram 0` with `cache_prompt: true`: llama-server without a host cache
  (reuse only from whatever a slot still holds). Not in the default set; useful to show what
  the host tier adds on top of slot reuse.
- `legacy`: llama.cpp's server_prompt_cache (`--cache-radix-prompt off`).
- `radix`: the radix-tree host cache (`--cache-radix-prompt on`, the default).
- `external`: a server we did not start (`--url`); flags do not apply.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Mode:
    name: str
    server_flags: tuple[str, ...]
    cache_prompt: bool


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("no-cache", ("--cache-ram", "0"), cache_prompt=False),
        Mode("slot-only", ("--cache-ram", "0"), cache_prompt=True),
        Mode("legacy", ("--cache-radix-prompt", "off"), cache_prompt=True),
        Mode("radix", ("--cache-radix-prompt", "on"), cache_prompt=True),
    )
}
DEFAULT_MODES = ("no-cache", "legacy", "radix")
EXTERNAL = Mode("external", (), cache_prompt=True)


def parse_modes(spec: str) -> list[Mode]:
    """`no-cache,legacy,radix` -> Modes, in the given order; unknown names are an error."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODES]
    if unknown or not names:
        raise ValueError(f"unknown mode(s) {', '.join(unknown) or '(none)'}; "
                         f"choose from {', '.join(MODES)}")
    return [MODES[n] for n in names]
