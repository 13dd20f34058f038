"""Modes under comparison: the server flags and request field that define each one.

Cache modes (`--modes`):

- `no-cache`: `--cache-ram 0` and every request sends `cache_prompt: false`, so nothing is reused
  at all, not even the slot's own KV. This is the seeds' strict baseline (their benchmark sets
  `cache_prompt: false` itself for the same reason): with `--cache-ram 0` alone a slot still
  reuses the prefix it happens to hold, which mixes luck of slot assignment into the baseline.
- `slot-only`: `--cache-ram 0` with `cache_prompt: true`: llama-server without a host cache
  (reuse only from whatever a slot still holds). Not in the default set; useful to show what
  the host tier adds on top of slot reuse.
- `legacy`: llama.cpp's server_prompt_cache (`--cache-radix-prompt off`).
- `radix`: the radix-tree host cache (`--cache-radix-prompt on`, the default).
- `radix-disk`: `radix` plus the disk tier under the radix host cache (`--cache-disk DIR`):
  KV blocks written as content-addressed files that a later server on the same DIR and model
  reads back. Every run of the mode gets a fresh DIR (`tempfile.mkdtemp`, made and removed by
  the runner), so each run starts cold on disk as on RAM, and nothing is left in /tmp; the same
  DIR is kept across a scenario's server restart (`restart_after`), which is what the mode is
  for: a restarted `radix` server has lost its cache, a restarted `radix-disk` one has not.
  Not in the default set (servers without the disk tier reject the flag).

Speculation (`--spec`, default `none`): every cache mode runs once per listed speculative
decoding type, with llama-server's `--spec-type TYPE` appended to its flags and `+TYPE` to its
label (`radix+ngram-simple`); `none` adds no flag and keeps the plain label (`radix`), so
`--modes radix --spec none,ngram-simple,ngram-mod` measures `radix`, `radix+ngram-simple` and
`radix+ngram-mod`. The drafter's own settings (`--spec-draft-n-max N`,
`--spec-ngram-simple-size-n N`, ...) are ordinary server flags: give them after `--`; they go to
every server started, and llama-server ignores them when no `--spec-type` is set.

External servers (`--url URL`, repeatable): a server we did not start, so flags do not apply and
the mode is only a label: `external` by default, or the matching `--label` (`--url A --label
llama-server --url B --label llama-server+ngram-simple`: one mode per URL, in that order).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Mode:
    """A label in the report and what makes it differ from the other modes: the server flags
    (appended last) and the request's `cache_prompt`."""

    name: str
    server_flags: tuple[str, ...]
    cache_prompt: bool
    spec: str = "none"  # the --spec-type this mode adds ("none": no speculation flag)
    url: str | None = None  # an external server (flags do not apply)
    # a fresh `--cache-disk DIR` per run, appended after `server_flags` (the directory only
    # exists once the runner makes it, so it cannot be a constant flag)
    cache_disk: bool = False
    # the radixserve command that serves the mode, before --host/--port and the flags:
    # `serve`, or `cluster` with its own flags (Ray Serve replicas, radixserve/cluster/)
    command: tuple[str, ...] = ("serve",)


RADIX = ("--cache-radix-prompt", "on")
MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("no-cache", ("--cache-ram", "0"), cache_prompt=False),
        Mode("slot-only", ("--cache-ram", "0"), cache_prompt=True),
        Mode("legacy", ("--cache-radix-prompt", "off"), cache_prompt=True),
        Mode("radix", RADIX, cache_prompt=True),
        Mode("radix-disk", RADIX, cache_prompt=True, cache_disk=True),
        # `radixserve cluster`: the scenario's flags go to every replica
        Mode("cluster-1", RADIX, cache_prompt=True, command=("cluster", "--replicas", "1")),
        Mode("cluster-prefix", RADIX, cache_prompt=True,
             command=("cluster", "--replicas", "2", "--router", "prefix")),
        Mode("cluster-pow2", RADIX, cache_prompt=True,
             command=("cluster", "--replicas", "2", "--router", "pow2")),
    )
}
DEFAULT_MODES = ("no-cache", "legacy", "radix")
EXTERNAL = Mode("external", (), cache_prompt=True)
# llama-server's --spec-type names (common/speculative.cpp); radixserve serves a subset
# (draft-simple, ngram-simple, ngram-mod) and rejects the others at start-up
SPEC_TYPES = ("none", "draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash",
              "draft-dspark", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod",
              "ngram-cache")


def _names(spec: str) -> list[str]:
    return [n.strip() for n in spec.split(",") if n.strip()]


def parse_specs(spec: str) -> list[str]:
    """`none,ngram-simple` -> speculation types, in the given order, without repeats."""
    names = list(dict.fromkeys(_names(spec)))
    unknown = [n for n in names if n not in SPEC_TYPES]
    if unknown or not names:
        raise ValueError(f"unknown speculation type(s) {', '.join(unknown) or '(none)'}; "
                         f"choose from {', '.join(SPEC_TYPES)}")
    return names


def with_spec(mode: Mode, spec: str) -> Mode:
    """`mode` with `--spec-type spec` appended (after the cache flags) and `+spec` in its name;
    `mode` itself for `none`."""
    if spec == "none":
        return mode
    return dataclasses.replace(mode, name=f"{mode.name}+{spec}", spec=spec,
                               server_flags=(*mode.server_flags, "--spec-type", spec))


def parse_modes(spec: str, specs: str = "none") -> list[Mode]:
    """`no-cache,legacy,radix` -> Modes, in the given order; unknown names are an error.
    `specs` (`none,ngram-mod`): each cache mode once per speculation type, cache mode major
    (`radix`, `radix+ngram-mod`, ...), so one cache mode's variants run side by side."""
    names = _names(spec)
    unknown = [n for n in names if n not in MODES]
    if unknown or not names:
        raise ValueError(f"unknown mode(s) {', '.join(unknown) or '(none)'}; "
                         f"choose from {', '.join(MODES)}")
    types = parse_specs(specs)
    return [with_spec(MODES[n], t) for n in names for t in types]


def external_modes(urls: list[str], labels: list[str] | None = None) -> list[Mode]:
    """One mode per external server. Labels name them in the report (`llama-server+ngram-mod`);
    without labels one URL is `external`, several are `external1`, `external2`, ..."""
    labels = labels or []
    if labels and len(labels) != len(urls):
        raise ValueError(f"--label: {len(labels)} label(s) for {len(urls)} --url(s); give one "
                         "label per URL, in the same order")
    if not labels:
        labels = ["external"] if len(urls) == 1 else [f"external{i + 1}"
                                                     for i in range(len(urls))]
    bad = [x for x in labels if not x or "/" in x or x.strip() != x]
    if bad or len(set(labels)) != len(labels):
        raise ValueError(f"--label: labels must be distinct, non-empty, without '/' or "
                         f"surrounding blanks; got {labels}")
    return [dataclasses.replace(EXTERNAL, name=label, url=url.rstrip("/"))
            for url, label in zip(urls, labels)]
