"""llama-server's command line, parsed llama.cpp's way (common/arg.cpp), not argparse's.

argparse expands unambiguous prefixes and groups short options, so `-ngl 99` next to `-n` became
`-n gl`; llama.cpp matches whole tokens only. Its other rules, kept here: `--a_b` is `--a-b`;
each flag's environment variable is read first and the command line overrides it
(`LLAMA_ARG_NO_X` sets a negatable flag off); a repeated flag warns and the last value wins
(except list flags such as `--logit-bias`, whose handlers append).

Every flag of llama-server has one of three outcomes here (`Flag.outcome`): honored with its
meaning, accepted and logged once as not applicable (placement and hardware flags), or refused
at start-up naming the missing feature. A handler may refine that per value (`-ctk q8_0` is
refused, `-ctk f16` is not applicable).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixserve.config import ServerConfig

log = logging.getLogger(__name__)

HONORED, NOT_APPLICABLE, REFUSED, ACTION = "honored", "not applicable", "refused", "action"
TRUTHY = ("on", "enabled", "true", "1")
FALSEY = ("off", "disabled", "false", "0")


class FlagError(ValueError):
    """A value that cannot be used, or a flag naming a feature this server lacks: exit 1."""


class FlagExit(Exception):
    """`--help`, `--version`, `--list-devices`...: print `text` and exit 0."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


@dataclass
class Parsed:
    """A config built from flags and environment, and the not-applicable notes to log once."""

    cfg: ServerConfig
    notes: list[str] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    once: set[str] = field(default_factory=set)  # handler state (first --dry-sequence-breaker)

    def note(self, msg: str) -> None:
        if msg not in self.notes:
            self.notes.append(msg)


# A handler gets the result being built and the flag's value: the string after the flag, or a
# bool for flags without a value (False from a negative spelling such as --no-slots).
Handler = Callable[[Parsed, Any], None]


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # positive spellings, exactly as llama-server's --help lists them
    neg: tuple[str, ...]  # spellings that turn the flag off
    hint: str | None  # the value's placeholder; None: no value
    env: str | None
    outcome: str
    help: str  # what it does here (honored), or why not (not applicable / refused)
    handler: Handler | None = None
    n_values: int = 1

    @property
    def spellings(self) -> tuple[str, ...]:
        return self.names + self.neg

    def apply(self, p: Parsed, value: Any, via: str) -> None:
        if self.outcome == NOT_APPLICABLE:
            p.note(f"{via}: not applicable here ({self.help}); ignored")
        elif self.outcome == REFUSED and value is not False:  # --no-agent refuses nothing
            raise FlagError(f"{via}: {self.help}")
        if self.handler is not None:
            try:
                self.handler(p, value)
            except FlagError as e:
                raise FlagError(f"{via}: {e}") from None
            except ValueError as e:
                raise FlagError(f"{via}: invalid value {value!r}: {e}") from None


def parse_bool(value: str) -> bool:
    v = value.strip().lower()
    if v in TRUTHY:
        return True
    if v in FALSEY:
        return False
    raise FlagError(f"expected one of {'|'.join(TRUTHY + FALSEY)}, got {value!r}")


def _normalize(arg: str) -> str:
    return arg.replace("_", "-") if arg.startswith("--") else arg


def index(flags: Sequence[Flag]) -> dict[str, tuple[Flag, bool]]:
    out: dict[str, tuple[Flag, bool]] = {}
    for f in flags:
        for n in f.names:
            assert n not in out, f"flag {n} listed twice"
            out[n] = (f, True)
        for n in f.neg:
            assert n not in out, f"flag {n} listed twice"
            out[n] = (f, False)
    return out


def _from_env(flags: Sequence[Flag], environ: Mapping[str, str], p: Parsed) -> None:
    """llama.cpp reads every flag's variable before the command line (get_value_from_env)."""
    for f in flags:
        if f.env is None:
            continue
        value: str | None = None
        neg_env = f.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1)
        if f.neg and neg_env != f.env and neg_env in environ:
            value = "0"
        elif f.env in environ:
            value = environ[f.env]
        if value is None:
            continue
        via = f"environment variable {f.env}"
        if f.hint is None:
            if f.neg:  # a boolean flag: the variable must say which way
                f.apply(p, parse_bool(value), via)
            elif value.strip().lower() in TRUTHY:  # llama.cpp: a switch acts only when truthy
                f.apply(p, True, via)
        else:
            f.apply(p, value, via)


def parse(flags: Sequence[Flag], argv: Sequence[str], environ: Mapping[str, str],
          cfg: ServerConfig | None = None) -> Parsed:
    """The config `argv` and `environ` describe. Raises FlagError (exit 1) or FlagExit (exit 0)."""
    p = Parsed(cfg or ServerConfig())
    table = index(flags)
    _from_env(flags, environ, p)
    i = 0
    while i < len(argv):
        arg = _normalize(argv[i])
        if arg not in table:
            raise FlagError(f"invalid argument: {argv[i]}")
        f, positive = table[arg]
        if arg in p.seen and f.n_values == 1 and f.hint is not None and not _appends(f):
            log.warning("argument '%s' specified multiple times, only the last value is used", arg)
        p.seen.add(arg)
        if f.env is not None and f.env in environ:
            log.warning("%s is set, but the command line argument %s overrides it", f.env, arg)
        if f.hint is None:
            f.apply(p, positive, arg)
            i += 1
            continue
        if i + f.n_values >= len(argv):
            raise FlagError(f"{arg}: expected {f.n_values} value(s) after it")
        values = argv[i + 1 : i + 1 + f.n_values]
        f.apply(p, values[0] if f.n_values == 1 else tuple(values), arg)
        i += 1 + f.n_values
    return p


def _appends(f: Flag) -> bool:
    return f.names[0] in ("-l", "--dry-sequence-breaker", "-r", "--lora", "--control-vector",
                          "--spec-type")


def render_help(flags: Sequence[Flag], prog: str) -> str:
    """`serve --help`: every llama-server flag with its outcome here, then our own."""
    lines = [f"usage: {prog} [flags]", "",
             "llama-server's flags, each honored, accepted as not applicable here (logged once), "
             "or refused naming the missing feature; radixserve's own flags at the end.", ""]
    defaults = ServerConfig()
    for f in flags:
        head = ", ".join(f.spellings) + (f" {f.hint}" if f.hint else "")
        tag = "" if f.outcome in (HONORED, ACTION) else f"[{f.outcome}] "
        text = tag + f.help
        attr = getattr(f.handler, "attr", None)
        if attr is not None and f.hint is not None:
            obj_name, _, name = attr.rpartition(".")
            value = getattr(getattr(defaults, obj_name) if obj_name else defaults, name, None)
            text += f" (default: {value})"
        text += f" (env: {f.env})" if f.env else ""
        if len(head) < 38:
            lines.append(f"{head:<40}{text}")
        else:
            lines += [head, f"{'':<40}{text}"]
    lines += ["", "Environment only (settled once at start-up: radixserve/model/kernel_config.py):"]
    for head, text in _env_only():
        lines.append(f"{head:<40}{text}")
    return "\n".join(lines) + "\n"


def _env_only() -> list[tuple[str, str]]:
    """The settings with no flag, as `serve --help` lists them after the flags: our C kernels'
    (docs/FLAGS.md says more)."""
    from radixserve.model.kernel_build import ENV, VARIANTS
    from radixserve.model.kernel_config import CHECKS_ENV

    names = ", ".join(VARIANTS)
    return [(f"{ENV}=auto|VARIANT|0",
             f"the build of radixserve's C kernels: auto (unset, or 1) the best this CPU runs, "
             f"a variant ({names}) forces one, 0 runs torch's ops instead; a value this CPU "
             f"cannot run stops start-up (default: auto)"),
            (f"{CHECKS_ENV}=1", "range-check every index a kernel reads through before the "
                                "call (the test suite's mode; default: off)"),
            ("CC, XDG_CACHE_HOME", "the C compiler the kernels are built with (default: cc, "
                                   "then gcc) and the base of their build cache (default: "
                                   "~/.cache; builds in radixserve/kernels under it)")]
