"""Mode names map to the flags that define them, and the mode's flags come last."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixserve.bench.modes import MODES, parse_modes
from radixserve.bench.runner import BenchOptions, server_args
from radixserve.bench.scenarios import load_scenario


def test_parse_modes() -> None:
    assert [m.name for m in parse_modes("no-cache, legacy,radix")] == ["no-cache", "legacy",
                                                                         "radix"]
    with pytest.raises(ValueError, match="unknown mode"):
        parse_modes("radix,fast")


def test_mode_flags_override_the_scenario() -> None:
    s = load_scenario("capacity-lru-512")  # carries --cache-ram 512
    opt = BenchOptions(out_dir=Path("."), extra_server_args=["--cache-ram", "64"])
    args = server_args(s, MODES["no-cache"], opt)
    assert args[-2:] == ["--cache-ram", "0"]  # argparse: the last occurrence wins
    assert args[:2] == ["-m", "default"] and "--metrics" in args
    assert server_args(s, MODES["legacy"], opt)[-2:] == ["--cache-radix-prompt", "off"]
    assert MODES["no-cache"].cache_prompt is False and MODES["slot-only"].cache_prompt is True
