"""Mode names map to the flags that define them, and the mode's flags come last; speculation
types multiply the cache modes; external servers are labelled URLs. radix-disk runs get their
own --cache-disk directory, kept across a scenario's restart and removed afterwards; a restart
is refused for servers we did not start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve.bench import cli, runner
from radixserve.bench.cli import main, select_modes
from radixserve.bench.modes import DEFAULT_MODES, MODES, external_modes, parse_modes, parse_specs
from radixserve.bench.runner import BenchOptions, check_restart, server_args
from radixserve.bench.scenarios import load_scenario
from radixserve.bench.stats import RequestRecord


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


def test_radix_disk_mode_is_radix_plus_a_per_run_disk_dir(tmp_path: Path) -> None:
    disk = MODES["radix-disk"]
    assert disk.server_flags == MODES["radix"].server_flags and disk.cache_prompt
    assert disk.cache_disk and not MODES["radix"].cache_disk
    assert "radix-disk" not in DEFAULT_MODES  # servers without the disk tier reject the flag
    s = load_scenario("restart-shared-prefix")
    opt = BenchOptions(out_dir=tmp_path, extra_server_args=["-t", "2"])
    args = server_args(s, disk, opt, tmp_path / "d")
    assert args[-4:] == ["--cache-radix-prompt", "on", "--cache-disk", str(tmp_path / "d")]
    assert "--cache-disk" not in server_args(s, MODES["radix"], opt, tmp_path / "d")
    with pytest.raises(ValueError, match="needs a directory"):
        server_args(s, disk, opt)
    # speculation keeps the disk: the directory still comes last
    spec = parse_modes("radix-disk", "ngram-mod")[0]
    assert spec.name == "radix-disk+ngram-mod" and spec.cache_disk
    assert server_args(s, spec, opt, tmp_path)[-4:] == ["--spec-type", "ngram-mod",
                                                        "--cache-disk", str(tmp_path)]


class FakeServer:
    """Stands in for ServerProcess: records its flags, whether the --cache-disk directory
    existed when it started, and how it was stopped."""

    started: list[FakeServer] = []

    def __init__(self, args: list[str], log_path: Path, *a: object, **k: object) -> None:
        self.args, self.log_path = args, log_path
        self.url, self.pid = f"http://fake{len(FakeServer.started)}", 1
        self.stops: list[float] = []
        self.disk: Path | None = None
        if "--cache-disk" in args:
            self.disk = Path(args[args.index("--cache-disk") + 1])

    def __enter__(self) -> FakeServer:
        self.disk_existed = self.disk is not None and self.disk.is_dir()
        FakeServer.started.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout_s: float = 15.0) -> bool:
        self.stops.append(timeout_s)
        return True


async def fake_measure(url, s, mode, pid, on_done, sessions) -> runner.Part:
    """One request per session, 100 ms apart; writes a 'block file' into the server's disk
    directory, so the test sees the directory measured and removed afterwards."""
    srv = FakeServer.started[-1]
    phase = int(len(FakeServer.started) % 2 == 0)  # a run's second server: after the restart
    if srv.disk is not None:
        (srv.disk / f"block{phase}").write_bytes(b"x" * 1000)
    recs = [RequestRecord(x.id, x.group, 0, 0.1 * i, 0.5, ttft_s=0.2, prompt_n=10, cache_n=90,
                          prompt_ms=5.0, reply="same") for i, x in enumerate(sessions)]
    for r in recs:
        on_done(r)
    after = {"radixserve:saves": 2.0 + phase,
             'radixserve:cache_tier_bytes{tier="disk"}': 2000.0 * (phase + 1),
             'radixserve:cache_tier_tokens{tier="disk"}': 100.0 * (phase + 1)}
    return runner.Part(recs, 1.0 + phase, [], {}, after, 100.0, 200.0 + phase, float(phase))


def test_radix_disk_runs_get_a_fresh_dir_that_survives_the_restart(tmp_path: Path,
                                                                    monkeypatch) -> None:
    FakeServer.started = []
    monkeypatch.setattr(runner, "ServerProcess", FakeServer)
    monkeypatch.setattr(runner, "_measure", fake_measure)

    async def no_tokenizer(url, sent):
        return None

    monkeypatch.setattr(runner, "sent_token_ids", no_tokenizer)
    s = load_scenario("restart-shared-prefix")
    opt = BenchOptions(out_dir=tmp_path)
    done: list[RequestRecord] = []
    results = [runner.run_one(s, MODES["radix-disk"], k, opt, done.append) for k in range(2)]
    assert len(done) == 24 and all("error" not in r for r in results)
    # two servers per run (before and after the restart), with the same flags and directory
    assert len(FakeServer.started) == 4
    first, second, third, _ = FakeServer.started
    assert first.args == second.args and first.disk == second.disk
    assert first.disk != third.disk  # each run starts cold on disk
    assert all(srv.disk_existed for srv in FakeServer.started)
    assert first.stops[0] == runner.RESTART_STOP_TIMEOUT_S  # the restart's stop
    assert second.log_path.name == "restart-shared-prefix__radix-disk__r0__restarted.log"
    # the directories are gone, their contents were recorded first
    assert not first.disk.exists() and not third.disk.exists()
    r = results[0]
    assert r["disk_dir"] == str(first.disk) and r["server_args"] == first.args
    f = r["figures"]
    assert (f["disk_dir_files"], f["disk_dir_bytes"]) == (2, 2000)
    # the second server's tier figures; counters summed over both servers; rss: the peak
    assert (f["disk_bytes"], f["disk_tokens"], f["disk_bytes_per_token"]) == (4000, 200, 20)
    assert f["host_saves"] == 5 and f["rss_peak_mib"] == 201.0 and f["wall_s"] == 3.0
    assert r["restart"]["after_requests"] == 6 and r["restart"]["stopped_on_sigint"]
    assert r["figures"]["after_restart"]["n_requests"] == 6
    assert [q["phase"] for q in r["requests"]] == [0] * 6 + [1] * 6
    # the second half's start times follow the first's (its phase began 1 s later)
    assert r["requests"][6]["t_start"] == pytest.approx(1.0)
    assert json.loads((tmp_path / "runs" / "restart-shared-prefix__radix-disk__r0.json")
                      .read_text())["figures"]["disk_dir_bytes"] == 2000


def test_radix_disk_dir_is_removed_when_the_run_fails(tmp_path: Path, monkeypatch) -> None:
    made: list[Path] = []

    class Broken(FakeServer):
        def __enter__(self) -> FakeServer:
            assert self.disk is not None and self.disk.is_dir()
            made.append(self.disk)
            raise RuntimeError("server exited with 2")

    monkeypatch.setattr(runner, "ServerProcess", Broken)
    r = runner.run_one(load_scenario("prefix-512"), MODES["radix-disk"], 0,
                       BenchOptions(out_dir=tmp_path), lambda _: None)
    assert "server exited with 2" in r["error"] and "figures" not in r
    assert made and not made[0].exists()


def test_restart_is_refused_for_external_servers(tmp_path: Path, monkeypatch, capsys) -> None:
    s = load_scenario("restart-shared-prefix")
    ext = external_modes(["http://h:9"], ["llama-server"])
    opt = BenchOptions(out_dir=tmp_path)
    with pytest.raises(ValueError, match="can only do with servers it starts.*http://h:9"):
        check_restart([s], [MODES["radix"], *ext], opt)
    with pytest.raises(ValueError, match="without --url"):
        check_restart([s], [MODES["radix"]], BenchOptions(out_dir=tmp_path, url="http://h:9"))
    check_restart([s], [MODES["radix"], MODES["radix-disk"]], opt)  # started servers: fine
    check_restart([load_scenario("prefix-512")], ext, opt)  # no restart: fine
    # the CLI refuses before any run (nothing is written)
    with pytest.raises(SystemExit) as e:
        main(["restart-shared-prefix", "--url", "http://h:9", "--out", str(tmp_path / "o")])
    assert e.value.code == 2 and "restarts the server" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    # a direct run_one records the refusal and never contacts the server
    seen = []

    async def fake_phases(*a):
        seen.append(a)
        return {}

    monkeypatch.setattr(runner, "_phases", fake_phases)
    r = runner.run_one(s, ext[0], 0, opt, lambda _: None)
    assert "restarts the server" in r["error"] and not seen


def test_all_with_url_skips_restart_scenarios(tmp_path: Path, monkeypatch) -> None:
    ran = []

    def fake_run_all(scenarios, modes, opt):
        ran.extend(s.name for s in scenarios)
        return []

    monkeypatch.setattr(cli, "run_all", fake_run_all)
    md = tmp_path / "summary.md"
    md.write_text("")
    monkeypatch.setattr(cli, "write_report", lambda *a: {"summary.md": md})
    assert cli.main(["all", "--url", "http://h:9", "--out", str(tmp_path)]) == 0
    assert "prefix-512" in ran and "restart-shared-prefix" not in ran


def test_reply_ids_asks_every_scenario_for_logprobs(tmp_path: Path, monkeypatch) -> None:
    fields = {}

    def fake_run_all(scenarios, modes, opt):
        fields.update({s.name: s.request_fields for s in scenarios})
        return []

    monkeypatch.setattr(cli, "run_all", fake_run_all)
    md = tmp_path / "summary.md"
    md.write_text("")
    monkeypatch.setattr(cli, "write_report", lambda *a: {"summary.md": md})
    argv = ["multi-turn-chat", "decode-4-json", "--url", "http://h:9", "--out", str(tmp_path)]
    assert cli.main(argv + ["--reply-ids"]) == 0
    assert fields["multi-turn-chat"] == {"logprobs": True}
    assert fields["decode-4-json"]["logprobs"] is True and "json_schema" in fields["decode-4-json"]
    assert cli.main(argv) == 0
    assert fields["multi-turn-chat"] == {}
