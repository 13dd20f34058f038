"""llama-server's command line (spec.py: how it is parsed; table.py: every flag's outcome)."""

import re

from radixserve.flags.spec import FlagError, FlagExit, Parsed
from radixserve.flags.table import ALL_FLAGS, SERVE_FLAGS


def parse_serve(argv: list[str], environ: dict[str, str] | None = None) -> Parsed:
    """`radixserve serve ARGS` -> config and the not-applicable notes to log once."""
    import os

    from radixserve.flags import spec, table

    env = os.environ if environ is None else environ
    p = spec.parse(ALL_FLAGS, argv, env)
    table.finish(p)
    p.cfg.slots_debug = _atoi(env.get("LLAMA_SERVER_SLOTS_DEBUG", "0")) != 0
    return p


def _atoi(text: str) -> int:
    """C's atoi, as llama-server reads LLAMA_SERVER_SLOTS_DEBUG: leading digits, else 0."""
    m = re.match(r"\s*([+-]?\d+)", text)
    return int(m.group(1)) if m else 0


__all__ = ["ALL_FLAGS", "SERVE_FLAGS", "FlagError", "FlagExit", "Parsed", "parse_serve"]
