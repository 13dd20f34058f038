"""llama-server's command line, table-driven from its real --help (tests/fixtures/
llama-server-help.txt, the help of the llama-server built from llama-cpp-python 0.3.36's
llama.cpp): every flag and alias parses with exact tokens; honored flags reach the config,
not-applicable ones are noted for the log, refused ones raise naming the missing feature; each
LLAMA_ARG_* variable sets what its flag sets."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from radixserve.config import ServerConfig
from radixserve.flags import SERVE_FLAGS, FlagError, FlagExit, parse_serve
from radixserve.flags.spec import ACTION, HONORED, NOT_APPLICABLE, REFUSED, Flag

HELP = Path(__file__).parent / "fixtures" / "llama-server-help.txt"


@dataclass
class HelpEntry:
    spellings: tuple[str, ...]
    hint: str | None
    env: str | None


def help_entries() -> list[HelpEntry]:
    """Each flag of the help: its spellings, value placeholder and environment variable.
    Flag lines start at column 0; descriptions start at column 40 (or on the next line)."""
    out: list[HelpEntry] = []
    for line in HELP.read_text().splitlines():
        if line.startswith("-") and not line.startswith("-----"):
            head = line[:40] if len(line) > 40 and line[38:40] == "  " else line
            names: list[str] = []
            rest = head.strip()
            while rest.startswith("-"):
                m = re.match(r"(-[^\s,]+)(,\s*|\s+|$)", rest)
                assert m is not None
                names.append(m.group(1))
                rest = rest[m.end():]
                if not m.group(2).startswith(","):
                    break
            out.append(HelpEntry(tuple(names), rest.strip() or None, None))
        elif out and "(env: " in line:
            out[-1].env = re.search(r"\(env: (\S+)\)", line).group(1)  # type: ignore[union-attr]
    return out


ENTRIES = help_entries()
BY_NAME = {f.spellings[0]: f for f in SERVE_FLAGS}


def flag_for(entry: HelpEntry) -> Flag:
    for f in SERVE_FLAGS:
        if set(entry.spellings) <= set(f.spellings):
            return f
    raise AssertionError(f"no flag in the table for {entry.spellings}")


def test_the_help_fixture_is_read_whole() -> None:
    assert len(ENTRIES) > 240
    assert any(e.spellings == ("-ngl", "--gpu-layers", "--n-gpu-layers") for e in ENTRIES)


def test_the_table_has_exactly_llama_servers_flags_with_their_env_and_arity() -> None:
    table = {n for f in SERVE_FLAGS for n in f.spellings}
    helped = {n for e in ENTRIES for n in e.spellings}
    assert table == helped, (table - helped, helped - table)
    for e in ENTRIES:
        f = flag_for(e)
        assert f.env == e.env, e.spellings
        if f.neg:  # "--slots, --no-slots": one help line lists both ways of a boolean flag
            assert e.hint is None, e.spellings
        else:
            assert (f.hint is None) == (e.hint is None), e.spellings


def sample(f: Flag, tmp: Path) -> list[str]:
    """A value that exercises the flag (non-default where the flag is honored)."""
    file = tmp / "file.txt"
    file.write_text("k1\n# comment\n\nk2\n")
    tmpl = tmp / "tmpl.jinja"
    tmpl.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (tmp / "g.gbnf").write_text('root ::= "yes" | "no"\n')
    (tmp / "s.json").write_text('{"type": "object", "properties": {"a": {"type": "integer"}}}')
    special = {
        "-ctk": "q8_0", "-ctv": "q4_0", "--spec-draft-type-k": "q8_0",
        "--spec-draft-type-v": "f16", "-fa": "on", "-lm": "mmap", "-lzm": "on",
        "--numa": "distribute", "-sm": "row", "-fit": "off", "--log-colors": "off",
        "-ngl": "99", "--spec-draft-ngl": "all", "-rea": "off", "--reasoning-format": "none",
        "--reasoning-budget": "-1", "--reasoning-effort": "high", "--spec-type": "ngram-simple",
        "--spec-draft-n-max": "5", "--spec-draft-p-min": "0.5", "--spec-draft-model": "d.gguf",
        "--samplers": "top_k;temperature", "--sampler-seq": "kt", "-l": "15043+1",
        "--chat-template": "chatml", "--chat-template-file": str(tmpl),
        "--chat-template-kwargs": '{"a": 1}', "--api-key-file": str(file),
        "--host": "0.0.0.0", "-m": "x.gguf", "--tags": "a,b", "-a": "y,x",
        "--api-prefix": "/api", "--path": str(tmp), "--ssl-key-file": str(file),
        "--ssl-cert-file": str(file), "--cors-origins": "localhost", "--cors-methods": "GET",
        "--cors-headers": "X-A", "-r": "STOP", "--dry-sequence-breaker": "x", "-s": "7",
        "--slot-save-path": str(tmp), "--log-file": str(tmp / "log.txt"), "--temp": "0.5",
        "-C": "ff", "-Cb": "ff", "--spec-draft-cpu-mask": "ff", "--spec-draft-cpu-mask-batch": "ff",
        "-Cr": "0-1", "-Crb": "0-1", "--spec-draft-cpu-range": "0-1", "-dev": "none",
        "--spec-draft-device": "none", "--api-key": "k", "-c": "512", "--port": "9000", "-lv": "4",
        "--grammar": 'root ::= "a" | "b"', "--grammar-file": str(tmp / "g.gbnf"),
        "-j": '{"type": "array"}', "-jf": str(tmp / "s.json"),
        "--ui-config": '{"temperature": 0.1}', "--ui-config-file": str(tmp / "ui.json"),
        "--pooling": "mean",
    }
    (tmp / "ui.json").write_text('{"systemMessage": "Be brief."}')
    name = f.spellings[0]
    if f.hint is None:
        return [name]
    if f.n_values == 2:
        return [name, "1", "2"]
    return [name, special.get(name, "3")]


# honored flags whose meaning is what radixserve always does: the config cannot change
ALWAYS_SO = {
    "--offline": "radixserve never downloads",
    "--jinja": "templates are always Jinja",
    "-cb": "batching is always continuous",
    "-rea": "'off'/'auto': no reasoning control",
    "--reasoning-budget": "-1: no budget",
}


@pytest.mark.parametrize("f", SERVE_FLAGS, ids=lambda f: f.spellings[0])
def test_every_flag_has_its_outcome(f: Flag, tmp_path: Path) -> None:
    argv = sample(f, tmp_path)
    default = ServerConfig()
    if f.outcome == ACTION:
        with pytest.raises(FlagExit):
            parse_serve(argv, {})
    elif f.outcome == REFUSED:
        with pytest.raises(FlagError) as e:
            parse_serve(argv, {})
        assert argv[0] in str(e.value) and f.help in str(e.value)
    elif f.outcome == NOT_APPLICABLE:
        p = parse_serve(argv, {})
        assert p.cfg == default
        assert any(n.startswith(f"{argv[0]}: not applicable") for n in p.notes), p.notes
    else:
        assert f.outcome == HONORED
        p = parse_serve(argv, {})
        if f.neg:  # both ways of a boolean flag parse, and they mean different things
            q = parse_serve([f.neg[-1]], {})
            changed = p.cfg != q.cfg or bool(q.notes)
        else:
            changed = p.cfg != default or bool(p.notes)
        assert changed or f.spellings[0] in ALWAYS_SO, "the flag does not reach the config"
        if f.spellings[0] in ALWAYS_SO:
            assert p.cfg == default


@pytest.mark.parametrize("f", [f for f in SERVE_FLAGS if f.env and f.outcome != ACTION],
                         ids=lambda f: f.env)
def test_each_environment_variable_sets_what_its_flag_sets(f: Flag, tmp_path: Path) -> None:
    argv = sample(f, tmp_path)
    value = "1" if f.hint is None else argv[1]
    env = {f.env: value}
    assert f.env is not None
    if f.outcome == REFUSED:
        with pytest.raises(FlagError, match=f.env):
            parse_serve([], env)
        return
    by_env, by_flag = parse_serve([], env), parse_serve(argv, {})
    assert by_env.cfg == by_flag.cfg
    assert bool(by_env.notes) == bool(by_flag.notes)
    if f.neg:  # "0", or LLAMA_ARG_NO_X set to anything, is the negative spelling
        off_flag = parse_serve([f.neg[-1]], {})
        assert parse_serve([], {f.env: "0"}).cfg == off_flag.cfg
        no_env = f.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_")
        assert parse_serve([], {no_env: "1"}).cfg == off_flag.cfg


def test_exact_tokens_never_prefixes() -> None:
    p = parse_serve(["-m", "model.gguf", "-ngl", "99", "-n", "5", "--jinja", "-fa", "on"], {})
    assert (p.cfg.model, p.cfg.n_predict, p.cfg.gpu_layers) == ("model.gguf", 5, "99")
    assert len(p.notes) == 1  # -fa: not applicable, logged (-ngl is honored: --device's layers)
    with pytest.raises(FlagError, match="invalid argument: --ctx"):
        parse_serve(["--ctx", "512"], {})  # argparse would have taken it for --ctx-size
    with pytest.raises(FlagError, match="expected an integer"):
        parse_serve(["-n", "gl"], {})
    assert parse_serve(["--ctx_size", "512"], {}).cfg.ctx_size == 512  # llama.cpp's _ -> -


def test_command_line_overrides_environment_and_last_value_wins() -> None:
    p = parse_serve(["-c", "256", "-c", "384"], {"LLAMA_ARG_CTX_SIZE": "128"})
    assert p.cfg.ctx_size == 384
    assert parse_serve([], {"LLAMA_ARG_CTX_SIZE": "128"}).cfg.ctx_size == 128


def test_list_flags_append_and_values_are_converted(tmp_path: Path) -> None:
    p = parse_serve(["-l", "15043+1", "-l", "12-2.5", "-r", "a\\nb", "-r", "END",
                     "--dry-sequence-breaker", "x", "--dry-sequence-breaker", "y",
                     "-a", "zeta,alpha", "--api-key", "k1,k2"],
                    {"LLAMA_API_KEY": "ignored-by-cli-order"})
    s = p.cfg.sampling
    assert s.logit_bias == [(15043, 1.0), (12, -2.5)]
    assert p.cfg.stop == ["a\nb", "END"]  # -e (on by default) processes escapes
    assert s.dry_sequence_breakers == ["x", "y"]  # the first clears llama.cpp's defaults
    assert (p.cfg.alias, p.cfg.aliases) == ("alpha", ["alpha", "zeta"])
    assert p.cfg.api_key == ["ignored-by-cli-order", "k1", "k2"]  # env first, then flags add
    assert parse_serve(["--no-escape", "-r", "a\\nb"], {}).cfg.stop == ["a\\nb"]
    assert parse_serve(["--dry-sequence-breaker", "none"], {}).cfg.sampling \
        .dry_sequence_breakers == []


def test_cache_types_parse_as_llama_cpp_parses_them() -> None:
    """Every spelling and environment variable of -ctk / -ctv / -ctkd / -ctvd sets its type,
    the names exactly as ggml's (llama.cpp's kv_cache_type_from_str); unset: "" (the compute
    dtype); the last of a repeated flag wins."""
    cfg = parse_serve(["-ctk", "q8_0", "--cache-type-v", "q4_0", "-ctkd", "f16",
                       "--cache-type-v-draft", "f32"], {}).cfg
    assert (cfg.cache_type_k, cfg.cache_type_v) == ("q8_0", "q4_0")
    assert (cfg.spec.cache_type_k, cfg.spec.cache_type_v) == ("f16", "f32")
    cfg = parse_serve([], {"LLAMA_ARG_CACHE_TYPE_K": "bf16", "LLAMA_ARG_CACHE_TYPE_V": "q8_0"}).cfg
    assert (cfg.cache_type_k, cfg.cache_type_v) == ("bf16", "q8_0")
    cfg = parse_serve(["-ctk", "q4_0", "-ctk", "q8_0"], {}).cfg
    assert (cfg.cache_type_k, cfg.cache_type_v) == ("q8_0", "")


def test_api_key_sources(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# operators\nalpha\n\nbeta\n")
    assert parse_serve(["--api-key-file", str(keys)], {}).cfg.api_key == ["alpha", "beta"]
    assert parse_serve([], {"LLAMA_API_KEY": "a,b"}).cfg.api_key == ["a", "b"]
    with pytest.raises(FlagError, match="failed to open"):
        parse_serve(["--api-key-file", str(tmp_path / "missing")], {})


@pytest.mark.parametrize("argv, feature", [
    (["-ctk", "q5_1"], "q5_1 is not implemented in radixserve (it stores bf16, f16, f32, "
                       "q8_0, q4_0"),
    (["-ctv", "iq4_nl"], "iq4_nl is not implemented"),
    (["-ctkd", "q4_1"], "q4_1 is not implemented"),
    (["-ctv", "q9"], "Unsupported cache type"),
    (["-ctk", "Q8_0"], "Unsupported cache type"),
    (["--spec-type", "ngram-cache"], "not supported"),
    (["-rea", "on"], "reasoning"),
    (["--reasoning-format", "deepseek-new"], "expected one of"),
    (["--chat-template", "llama5"], "the supplied chat template is not supported: llama5"),
    (["--chat-template", "{% for %}"], "chat template"),
    (["--sleep-idle-seconds", "0"], "invalid value: cannot be 0 or less than -1"),
    (["--sleep-idle-seconds", "-2"], "invalid value: cannot be 0 or less than -1"),
    (["--chat-template-kwargs", "[1]"], "JSON object"),
    (["--ui-config", "[1]"], "JSON object"),
    (["--ui-config", "{temperature: 1}"], "not valid JSON"),
    (["--ui-config-file", "/nonexistent/ui.json"], "failed to open"),
    (["--mmproj", "x.gguf"], "multimodal"),
    (["-fa", "maybe"], "expected one of"),
    (["-ngl"], "expected 1 value"),
    (["--draft-max", "4"], "has been removed"),
])
def test_refused_values_name_the_feature(argv: list[str], feature: str) -> None:
    with pytest.raises(FlagError, match=re.escape(argv[0]) + ".*" + re.escape(feature)):
        parse_serve(argv, {})


def test_negative_spelling_of_a_refused_feature_is_fine() -> None:
    assert parse_serve(["--no-agent", "-no-ag", "--no-ui-mcp-proxy"], {}).cfg == ServerConfig()


def test_ui_flags(tmp_path: Path) -> None:
    """--ui-config(-file) become /props ui_settings (the page's defaults); --no-ui turns the
    page off (tests/http/test_webui.py checks what is served)."""
    f = tmp_path / "ui.json"
    f.write_text('{"systemMessage": "Be brief.", "temperature": 0.2}')
    want = {"systemMessage": "Be brief.", "temperature": 0.2}
    assert parse_serve(["--ui-config-file", str(f)], {}).cfg.ui_settings == want
    assert parse_serve(["--webui-config", f.read_text()], {}).cfg.ui_settings == want
    assert parse_serve([], {"LLAMA_ARG_UI_CONFIG_FILE": str(f)}).cfg.ui_settings == want
    assert ServerConfig().webui and not parse_serve(["--no-webui"], {}).cfg.webui
    assert not parse_serve([], {"LLAMA_ARG_UI": "0"}).cfg.webui


def test_sampling_defaults_reach_the_config() -> None:
    p = parse_serve(["--temp", "0", "--top-k", "5", "--top-p", "0.5", "--min-p", "0.1",
                     "--mirostat", "2", "--mirostat-ent", "3", "--mirostat-lr", "0.2",
                     "--samplers", "min_p;temperature", "--ignore-eos", "-s", "42"], {})
    s = p.cfg.sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p) == (0.0, 5, 0.5, 0.1)
    assert (s.mirostat, s.mirostat_tau, s.mirostat_eta) == (2, 3.0, 0.2)
    assert s.samplers == ["min_p", "temperature"]
    assert p.cfg.ignore_eos and p.cfg.seed == 42
    assert parse_serve(["--temp", "-1"], {}).cfg.sampling.temperature == 0.0  # clamped


def test_help_lists_every_flag_with_its_outcome() -> None:
    with pytest.raises(FlagExit) as e:
        parse_serve(["--help"], {})
    text = e.value.text
    for f in SERVE_FLAGS:
        assert f.spellings[0] in text
    assert "[refused] multimodal projectors" in text
    assert "[not applicable] the whole model and its KV pool sit on one device" in text
    assert "] the one device the model and its KV pool use" not in text  # honored: no tag
    assert "--device <dev1,dev2,..>           the one device the model" in text
    # the settings with no flag, after the flags: our kernels' (model/kernel_config.py)
    assert "RADIXSERVE_KERNELS=auto|VARIANT|0" in text and "RADIXSERVE_KERNEL_CHECKS=1" in text


def test_disk_tier_flags_reach_the_config_and_bad_combinations_are_refused() -> None:
    cfg = parse_serve(["--cache-disk", "/tmp/kv", "--cache-disk-mib", "512",
                       "--cache-disk-block", "16"], {}).cfg
    assert (cfg.cache_disk, cfg.cache_disk_mib, cfg.cache_disk_block) == ("/tmp/kv", 512, 16)
    cfg.validate()
    defaults = ServerConfig()
    assert (defaults.cache_disk, defaults.cache_disk_mib, defaults.cache_disk_block) == \
        ("", 10240, 64)
    for bad, words in ((dict(cache_radix_prompt=False), "radix"), (dict(cache_ram_mib=0), "radix"),
                       (dict(cache_disk_mib=0), "--cache-disk-mib"),
                       (dict(cache_disk_mib=-2), "--cache-disk-mib"),
                       (dict(cache_disk_block=0), "--cache-disk-block")):
        with pytest.raises(ValueError, match=words):
            ServerConfig(cache_disk="/tmp/kv", **bad).validate()
    ServerConfig(cache_disk="/tmp/kv", cache_disk_mib=-1).validate()  # no bound


@pytest.mark.parametrize("value,on", [(None, False), ("0", False), ("1", True), ("2", True),
                                      ("yes", False), (" 1x", True), ("", False)])
def test_slots_debug_is_read_as_llama_server_reads_it(value: str | None, on: bool) -> None:
    """LLAMA_SERVER_SLOTS_DEBUG (atoi != 0) turns the cache view's prompt text on."""
    env = {} if value is None else {"LLAMA_SERVER_SLOTS_DEBUG": value}
    assert parse_serve([], env).cfg.slots_debug is on


def test_cache_disk_key_names_a_readable_secret_file(tmp_path: Path) -> None:
    """The file is read at parse time: a bad one stops start-up before the model loads."""
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    cfg = parse_serve(["--cache-disk", "/tmp/kv", "--cache-disk-key", str(key)], {}).cfg
    assert cfg.cache_disk_key == str(key) and ServerConfig().cache_disk_key == ""
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(FlagError, match=r"--cache-disk-key: the disk cache key file .* empty"):
        parse_serve(["--cache-disk-key", str(tmp_path / "empty")], {})
    with pytest.raises(FlagError, match=r"--cache-disk-key: cannot read .*missing"):
        parse_serve(["--cache-disk-key", str(tmp_path / "missing")], {})
    with pytest.raises(ValueError, match="--cache-disk-key .* needs --cache-disk"):
        parse_serve(["--cache-disk-key", str(key)], {}).cfg.validate()


@pytest.mark.parametrize("argv,env", [(["--cpu-moe"], {}), (["-ncmoe", "4"], {}),
                                      (["-ot", "exps=CPU"], {}),
                                      ([], {"LLAMA_ARG_CPU_MOE": "1"}),
                                      ([], {"LLAMA_ARG_N_CPU_MOE": "8"})])
def test_the_moe_placement_flags_are_accepted_and_say_why_nothing_changes(argv, env):
    """llama-server's flags that keep expert tensors in host memory: accepted (a user's
    command line for a MoE model starts), the server's config unchanged, and one note saying
    the CPU holds them there already."""
    p = parse_serve(argv, env)
    assert p.cfg == parse_serve([], {}).cfg
    assert len(p.notes) == 1 and "in host memory already" in p.notes[0], p.notes
