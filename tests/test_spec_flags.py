"""llama-server's speculative decoding flags (--spec-type, -md, --spec-draft-*, --spec-ngram-*)
reach `ServerConfig.spec`; bad values and the drafters this server lacks are refused naming
the flag."""

from __future__ import annotations

import re
from typing import Any

import pytest

from radixserve.config import SPEC_TYPES, ServerConfig, SpecConfig
from radixserve.flags import SERVE_FLAGS, FlagError, FlagExit, parse_serve
from radixserve.flags.spec import HONORED, NOT_APPLICABLE, REFUSED

LLAMA_ONLY_TYPES = ("draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark", "ngram-map-k",
                    "ngram-map-k4v", "ngram-cache")


def spec_of(argv: list[str], env: dict[str, str] | None = None) -> SpecConfig:
    return parse_serve(argv, env or {}).cfg.spec


@pytest.mark.parametrize("argv, attr, value", [
    (["--spec-draft-n-max", "7"], "n_max", 7),
    (["--spec-draft-n-max", "0"], "n_max", 0),
    (["--spec-draft-n-min", "2"], "n_min", 2),
    (["--spec-draft-p-min", "0.75"], "p_min", 0.75),
    (["--draft-p-min", "0.25"], "p_min", 0.25),
    (["--spec-ngram-simple-size-n", "4"], "ngram_simple_size_n", 4),
    (["--spec-ngram-simple-size-m", "16"], "ngram_simple_size_m", 16),
    (["--spec-ngram-simple-min-hits", "3"], "ngram_simple_min_hits", 3),
    (["--spec-ngram-mod-n-min", "8"], "ngram_mod_n_min", 8),
    (["--spec-ngram-mod-n-max", "1024"], "ngram_mod_n_max", 1024),
    (["--spec-ngram-mod-n-match", "12"], "ngram_mod_n_match", 12),
    (["-md", "draft.gguf"], "draft_model", "draft.gguf"),
    (["--model-draft", "default"], "draft_model", "default"),
    (["--spec-draft-model", "/models/d.gguf"], "draft_model", "/models/d.gguf"),
    (["--spec_draft_n_max", "9"], "n_max", 9),  # llama.cpp's `_` -> `-`
])
def test_each_flag_sets_its_field(argv: list[str], attr: str, value: Any) -> None:
    spec = spec_of(argv)
    assert getattr(spec, attr) == value
    assert getattr(SpecConfig(), attr) != value  # not just the default
    others = {k: v for k, v in vars_of(spec).items() if k != attr}
    assert others == {k: v for k, v in vars_of(SpecConfig()).items() if k != attr}


def vars_of(spec: SpecConfig) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in SpecConfig.__dataclass_fields__}


@pytest.mark.parametrize("value, types", [
    ("none", []),
    ("ngram-simple", ["ngram-simple"]),
    ("ngram-mod,ngram-simple", ["ngram-mod", "ngram-simple"]),  # order kept
    ("ngram-simple,ngram-mod,ngram-simple", ["ngram-simple", "ngram-mod"]),  # once each
    (" ngram-mod , draft-simple ", ["ngram-mod", "draft-simple"]),
    ("draft-simple,none", []),  # llama.cpp: none anywhere in the list = none
    (",".join(SPEC_TYPES), list(SPEC_TYPES)),
])
def test_spec_type_list(value: str, types: list[str]) -> None:
    assert spec_of(["--spec-type", value]).types == types


def test_repeated_spec_type_appends_and_the_command_line_replaces_the_environment() -> None:
    argv = ["--spec-type", "ngram-mod", "--spec-type", "ngram-simple,ngram-mod"]
    assert spec_of(argv).types == ["ngram-mod", "ngram-simple"]
    env = {"LLAMA_ARG_SPEC_TYPE": "ngram-simple"}
    assert spec_of([], env).types == ["ngram-simple"]
    assert spec_of(["--spec-type", "ngram-mod"], env).types == ["ngram-mod"]
    assert spec_of(["--spec-type", "none"], env).types == []


def test_repeated_spec_type_does_not_warn_that_only_the_last_counts(
        caplog: pytest.LogCaptureFixture) -> None:
    parse_serve(["--spec-type", "ngram-mod", "--spec-type", "ngram-simple"], {})
    assert "specified multiple times" not in caplog.text
    parse_serve(["--spec-draft-n-max", "4", "--spec-draft-n-max", "5"], {})
    assert "specified multiple times" in caplog.text


@pytest.mark.parametrize("env, attr, value", [
    ({"LLAMA_ARG_SPEC_TYPE": "ngram-mod,ngram-simple"}, "types", ["ngram-mod", "ngram-simple"]),
    ({"LLAMA_ARG_SPEC_TYPE": "none"}, "types", []),
    ({"LLAMA_ARG_SPEC_DRAFT_N_MAX": "6"}, "n_max", 6),
    ({"LLAMA_ARG_SPEC_DRAFT_N_MIN": "2"}, "n_min", 2),
    ({"LLAMA_ARG_SPEC_DRAFT_P_MIN": "0.5"}, "p_min", 0.5),
    ({"LLAMA_ARG_SPEC_DRAFT_MODEL": "draft.gguf"}, "draft_model", "draft.gguf"),
])
def test_environment_variables(env: dict[str, str], attr: str, value: Any) -> None:
    assert getattr(spec_of([], env), attr) == value


def test_command_line_overrides_the_environment_for_numbers() -> None:
    env = {"LLAMA_ARG_SPEC_DRAFT_N_MAX": "6", "LLAMA_ARG_SPEC_DRAFT_P_MIN": "0.5"}
    spec = spec_of(["--spec-draft-n-max", "8", "--spec-draft-p-min", "0.1"], env)
    assert (spec.n_max, spec.p_min) == (8, 0.1)


@pytest.mark.parametrize("name", LLAMA_ONLY_TYPES)
def test_drafters_this_server_lacks_are_refused_naming_the_supported_ones(name: str) -> None:
    with pytest.raises(FlagError) as e:
        parse_serve(["--spec-type", f"ngram-simple,{name}"], {})
    msg = str(e.value)
    assert msg.startswith("--spec-type:") and name in msg and "not supported" in msg
    assert all(t in msg for t in SPEC_TYPES)
    with pytest.raises(FlagError, match="LLAMA_ARG_SPEC_TYPE.*not supported"):
        parse_serve([], {"LLAMA_ARG_SPEC_TYPE": name})


@pytest.mark.parametrize("value", ["ngram", "draft", "", ",", "NGRAM-SIMPLE"])
def test_unknown_spec_types_are_refused(value: str) -> None:
    with pytest.raises(FlagError, match=r"^--spec-type: .*(unknown|expected)"):
        parse_serve(["--spec-type", value], {})


@pytest.mark.parametrize("argv, why", [
    (["--spec-draft-n-max", "-1"], "must be >= 0"),
    (["--spec-draft-n-max", "four"], "expected an integer"),
    (["--spec-draft-n-min", "-3"], "must be >= 0"),
    (["--spec-draft-n-min", "1.5"], "expected an integer"),
    (["--spec-draft-p-min", "-0.1"], "within [0, 1]"),
    (["--spec-draft-p-min", "1.5"], "within [0, 1]"),
    (["--draft-p-min", "high"], "expected a number"),
    (["--spec-ngram-simple-size-n", "0"], "between 1 and 1024"),
    (["--spec-ngram-simple-size-n", "-2"], "between 1 and 1024"),
    (["--spec-ngram-simple-size-m", "0"], "between 1 and 1024"),
    (["--spec-ngram-simple-size-m", "1025"], "between 1 and 1024"),
    (["--spec-ngram-simple-min-hits", "0"], "must be >= 1"),
    (["--spec-ngram-mod-n-min", "-1"], "between 0 and 1024"),
    (["--spec-ngram-mod-n-max", "-1"], "between 0 and 1024"),
    (["--spec-ngram-mod-n-match", "0"], "between 1 and 1024"),
    (["--spec-ngram-mod-n-match", "x"], "expected an integer"),
])
def test_bad_values_are_refused_naming_the_flag(argv: list[str], why: str) -> None:
    with pytest.raises(FlagError, match="^" + re.escape(argv[0]) + ": .*" + re.escape(why)):
        parse_serve(argv, {})


@pytest.mark.parametrize("env, flag", [
    ({"LLAMA_ARG_SPEC_DRAFT_N_MAX": "-1"}, "LLAMA_ARG_SPEC_DRAFT_N_MAX"),
    ({"LLAMA_ARG_SPEC_DRAFT_P_MIN": "2"}, "LLAMA_ARG_SPEC_DRAFT_P_MIN"),
])
def test_bad_environment_values_are_refused_naming_the_variable(env: dict[str, str],
                                                                flag: str) -> None:
    with pytest.raises(FlagError, match=flag):
        parse_serve([], env)


@pytest.mark.parametrize("argv, use", [
    (["--draft", "4"], "--spec-draft-n-max"),
    (["--draft-max", "4"], "--spec-draft-n-max"),
    (["--draft-min", "1"], "--spec-draft-n-min"),
    (["--spec-ngram-size-n", "3"], "--spec-ngram-*-size-n"),
    (["--spec-ngram-size-m", "3"], "--spec-ngram-*-size-m"),
    (["--spec-ngram-min-hits", "3"], "--spec-ngram-*-min-hits"),
])
def test_removed_flags_keep_llama_servers_message(argv: list[str], use: str) -> None:
    with pytest.raises(FlagError, match=re.escape(argv[0]) + ": the argument has been removed"
                       ".*" + re.escape(use)):
        parse_serve(argv, {})


def test_spec_default_adds_ngram_mod_with_its_sizes() -> None:
    spec = spec_of(["--spec-ngram-mod-n-max", "8", "--spec-type", "ngram-simple",
                    "--spec-default"])
    assert spec.types == ["ngram-simple", "ngram-mod"]
    assert (spec.ngram_mod_n_match, spec.ngram_mod_n_min, spec.ngram_mod_n_max) == (24, 48, 64)


def test_draft_model_alone_turns_draft_simple_on_and_draft_simple_needs_one() -> None:
    cfg = parse_serve(["-md", "default", "--spec-type", "ngram-simple"], {}).cfg
    cfg.spec.validate()
    assert cfg.spec.types == ["draft-simple", "ngram-simple"]
    cfg = parse_serve(["--spec-type", "draft-simple"], {}).cfg
    with pytest.raises(ValueError, match="draft model"):
        cfg.spec.validate()


def test_draft_placement_flags_are_noted_not_applied() -> None:
    p = parse_serve(["-td", "4", "-ngld", "99", "-devd", "none"], {})
    assert p.cfg == ServerConfig()
    assert len(p.notes) == 3
    assert any("draft model runs on the target's threads" in n for n in p.notes)


SPEC_FLAGS = [f for f in SERVE_FLAGS if any(n.startswith(("--spec", "--draft")) for n in f.names)]


def test_no_spec_flag_claims_speculative_decoding_is_missing() -> None:
    assert len(SPEC_FLAGS) > 40
    for f in SPEC_FLAGS:
        assert "speculative decoding is not implemented" not in f.help, f.names
        assert "speculative decoding is off" not in f.help, f.names


def test_spec_flags_outcomes() -> None:
    by_name = {f.names[0]: f for f in SPEC_FLAGS}
    honored = ["--spec-draft-n-max", "--spec-draft-n-min", "--spec-draft-p-min",
               "--spec-draft-model", "--spec-type", "--spec-ngram-mod-n-min",
               "--spec-ngram-mod-n-max", "--spec-ngram-mod-n-match", "--spec-ngram-simple-size-n",
               "--spec-ngram-simple-size-m", "--spec-ngram-simple-min-hits", "--spec-default"]
    for name in honored:
        assert by_name[name].outcome == HONORED, name
    for name in ("--spec-draft-threads", "--spec-draft-cpu-mask", "--spec-draft-ngl",
                 "--spec-ngram-map-k-size-n"):
        assert by_name[name].outcome == NOT_APPLICABLE, name
    for name in ("--spec-draft-hf", "--spec-synth-len", "--draft", "--spec-ngram-size-n"):
        assert by_name[name].outcome == REFUSED, name


def test_help_describes_the_spec_flags() -> None:
    with pytest.raises(FlagExit) as e:
        parse_serve(["--help"], {})
    text = e.value.text
    lines = {line.split()[0].rstrip(","): line for line in text.splitlines()
             if line.startswith("--spec")}
    assert "draft-simple (needs -md), ngram-simple, ngram-mod" in text
    assert "(default: 3)" in lines["--spec-draft-n-max"]
    assert "[not applicable] the draft model runs on the target's threads" in text
    assert "[refused]" not in lines["--spec-draft-n-max"]
