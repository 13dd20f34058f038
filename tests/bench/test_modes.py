"""Mode names map to the flags that define them, and the mode's flags come last; speculation
types multiply the cache modes; external servers are labelled URLs."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixserve.bench import runner
from radixserve.bench.cli import select_modes
from radixserve.bench.modes import MODES, external_modes, parse_modes, parse_specs
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


def test_spec_modes_cross_every_cache_mode_with_the_flag_last() -> None:
    modes = parse_modes("no-cache,radix", "none,ngram-simple,ngram-mod")
    assert [m.name for m in modes] == ["no-cache", "no-cache+ngram-simple", "no-cache+ngram-mod",
                                       "radix", "radix+ngram-simple", "radix+ngram-mod"]
    assert modes[0] == MODES["no-cache"] and modes[3] == MODES["radix"]  # none: no flag at all
    assert modes[4].server_flags == ("--cache-radix-prompt", "on", "--spec-type", "ngram-simple")
    assert modes[1].cache_prompt is False and modes[4].cache_prompt is True  # cache mode kept
    assert [m.spec for m in modes[3:]] == ["none", "ngram-simple", "ngram-mod"]
    s = load_scenario("rag-quote")
    args = server_args(s, modes[5], BenchOptions(out_dir=Path("."),
                                                 extra_server_args=["--spec-draft-n-max", "8"]))
    assert args[-2:] == ["--spec-type", "ngram-mod"] and "--spec-draft-n-max" in args
    assert "--spec-type" not in server_args(s, modes[3], BenchOptions(out_dir=Path(".")))
    # the default: no speculation, the plain cache modes
    assert parse_modes("radix") == [MODES["radix"]]
    with pytest.raises(ValueError, match="unknown speculation type"):
        parse_modes("radix", "none,ngram-fast")
    assert parse_specs("ngram-mod, ngram-mod,none") == ["ngram-mod", "none"]


def test_external_modes_take_their_labels() -> None:
    one = external_modes(["http://127.0.0.1:8080/"])
    assert [(m.name, m.url, m.server_flags) for m in one] == [
        ("external", "http://127.0.0.1:8080", ())]
    two = external_modes(["http://a:1", "http://b:2"], ["llama-server", "llama-server+ngram-mod"])
    assert [(m.name, m.url) for m in two] == [("llama-server", "http://a:1"),
                                              ("llama-server+ngram-mod", "http://b:2")]
    assert [m.name for m in external_modes(["http://a:1", "http://b:2"])] == ["external1",
                                                                              "external2"]
    with pytest.raises(ValueError, match="one label per URL"):
        external_modes(["http://a:1", "http://b:2"], ["only-one"])
    with pytest.raises(ValueError, match="distinct"):
        external_modes(["http://a:1", "http://b:2"], ["x", "x"])
    with pytest.raises(ValueError, match="without '/'"):
        external_modes(["http://a:1"], ["llama/server"])


def test_cli_mode_selection() -> None:
    # only --url: the external servers alone (the default cache modes are not started)
    assert [m.name for m in select_modes(None, None, ["http://a:1"], ["llama-server"])] == [
        "llama-server"]
    # --modes/--spec given as well: started modes first, then the external ones
    mixed = select_modes("radix", "none,ngram-simple", ["http://a:1"], ["llama-server"])
    assert [m.name for m in mixed] == ["radix", "radix+ngram-simple", "llama-server"]
    assert mixed[-1].url == "http://a:1" and mixed[0].url is None
    assert [m.name for m in select_modes(None, "ngram-mod", None, None)] == [
        "no-cache+ngram-mod", "legacy+ngram-mod", "radix+ngram-mod"]
    with pytest.raises(ValueError, match="given twice"):
        select_modes("radix", None, ["http://a:1"], ["radix"])
    with pytest.raises(ValueError, match="names a --url"):
        select_modes(None, None, None, ["llama-server"])


def test_runs_of_an_external_mode_go_to_its_url(tmp_path: Path, monkeypatch) -> None:
    seen = []

    async def fake_phases(url, s, mode, pid, on_done):
        seen.append((url, mode.name, pid))
        return {"figures": {}, "requests": []}

    monkeypatch.setattr(runner, "_phases", fake_phases)
    mode = external_modes(["http://h:9/"], ["llama-server+ngram-simple"])[0]
    r = runner.run_one(load_scenario("rag-quote"), mode, 0, BenchOptions(out_dir=tmp_path),
                       lambda _: None)
    assert seen == [("http://h:9", "llama-server+ngram-simple", None)]
    assert r["url"] == "http://h:9" and r["mode"] == "llama-server+ngram-simple"
    assert r["spec"] is None  # an external server's flags are its own
    assert (tmp_path / "runs" / "rag-quote__llama-server+ngram-simple__r0.json").is_file()
