"""llama-server's command line (spec.py: how it is parsed; table.py: every flag's outcome)."""

from radixserve.flags.spec import FlagError, FlagExit, Parsed
from radixserve.flags.table import ALL_FLAGS, SERVE_FLAGS


def parse_serve(argv: list[str], environ: dict[str, str] | None = None) -> Parsed:
    """`radixserve serve ARGS` -> config and the not-applicable notes to log once."""
    import os

    from radixserve.flags import spec, table

    p = spec.parse(ALL_FLAGS, argv, os.environ if environ is None else environ)
    table.finish(p)
    return p


__all__ = ["ALL_FLAGS", "SERVE_FLAGS", "FlagError", "FlagExit", "Parsed", "parse_serve"]
