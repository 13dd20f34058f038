"""`radixserve bench SCENARIO... [options] [-- server flags]`: run, then write the report.

Server flags the benchmark does not know are passed to every `radixserve serve` it starts
(after the scenario's own `server_args`, before the mode's flags). Put them after `--` when a
flag takes a value, so the value is not mistaken for a scenario name.

Speculative decoding: `--spec none,ngram-simple,ngram-mod` runs each cache mode once per type
(`radix`, `radix+ngram-simple`, ...; see radixserve.bench.modes). Servers started by hand
(llama-server with the same flags): `--url URL --label NAME`, repeatable, alone or next to
started modes, so one report compares them all (outputs identical across modes included).

Scenarios that restart the server halfway (`restart-shared-prefix`, `restart_after` in the
JSON) need servers the benchmark starts: with `--url` they are refused. The disk tier's mode
`radix-disk` is not in the default set: `--modes no-cache,radix,radix-disk`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from pathlib import Path

from radixserve.bench.modes import DEFAULT_MODES, MODES, Mode, external_modes, parse_modes
from radixserve.bench.report import write_report
from radixserve.bench.runner import BenchOptions, check_restart, run_all
from radixserve.bench.scenarios import APIS, load_scenario, scenario_names

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="radixserve bench", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="shipped scenarios: " + ", ".join(scenario_names()) + " (or 'all', or a .json "
               "path). `radixserve bench soak --help`: the reliability soak of one server; "
               "`radixserve bench embed --help`: embeddings throughput of running servers")
    ap.add_argument("scenarios", nargs="+", metavar="SCENARIO")
    ap.add_argument("--modes", default=None,
                    help=f"comma separated: {', '.join(MODES)} "
                         f"(default: {','.join(DEFAULT_MODES)})")
    ap.add_argument("--spec", default=None,
                    help="comma separated speculation types, each cache mode runs once per "
                         "type with --spec-type TYPE (none = no flag): e.g. "
                         "none,ngram-simple,ngram-mod (default: none)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="cold-start runs per mode; tables show medians (default: %(default)s)")
    ap.add_argument("--url", action="append", default=None,
                    help="measure this running OpenAI-compatible server (repeatable: one mode "
                         "per URL) instead of starting servers; with --modes or --spec given "
                         "too, both")
    ap.add_argument("--label", action="append", default=None,
                    help="the mode name of each --url in the report, in order (e.g. "
                         "llama-server+ngram-simple; default: external)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default: bench-results/<UTC time>)")
    ap.add_argument("-m", "--model", default="default", help="model for the servers we start")
    ap.add_argument("--reply-ids", action="store_true",
                    help="ask every request for `logprobs`, whose entries carry each generated "
                         "token's id, so the unshared minimum counts the ids the server "
                         "generated rather than the reply re-tokenized (they differ for "
                         "random-weight models); a counting run: the whole distribution each "
                         "token costs decode time")
    ap.add_argument("--api", choices=APIS, default=None,
                    help="send every request through this API: chat (OpenAI chat "
                         "completions, the default), messages (Anthropic's /v1/messages) or "
                         "responses (OpenAI's /v1/responses, later turns chained by "
                         "previous_response_id)")
    return ap


def select_modes(modes: str | None, spec: str | None, urls: list[str] | None,
                 labels: list[str] | None) -> list[Mode]:
    """The modes to run: started servers (`--modes` x `--spec`) unless only `--url`s are given,
    then one external mode per URL. Names must be distinct (they name the result files)."""
    if labels and not urls:
        raise ValueError("--label names a --url; give the URL(s) too")
    out = [] if urls and modes is None and spec is None else parse_modes(
        modes or ",".join(DEFAULT_MODES), spec or "none")
    out += external_modes(urls, labels) if urls else []
    names = [m.name for m in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"mode name(s) {', '.join(dup)} given twice")
    return out


def main(argv: list[str]) -> int:
    """Entry point of `radixserve bench` and `python -m radixserve.bench`; returns the exit code
    (1 if any run failed, so scripts notice). `soak` first: the soak's own parser."""
    if argv[:1] == ["soak"]:
        from radixserve.bench.soak import main as soak_main

        return soak_main(argv[1:])
    if argv[:1] == ["embed"]:
        from radixserve.bench.embed import main as embed_main

        return embed_main(argv[1:])
    if "--" in argv:
        i = argv.index("--")
        argv, forwarded = argv[:i], argv[i + 1:]
    else:
        forwarded = []
    ap = build_parser()
    a, unknown = ap.parse_known_args(argv)
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    names = scenario_names() if a.scenarios == ["all"] else a.scenarios
    out = a.out or Path("bench-results") / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    opt = BenchOptions(out_dir=out, repeats=a.repeats, model=a.model,
                       extra_server_args=unknown + forwarded)
    try:
        scenarios = [load_scenario(n) for n in names]
        if a.api is not None:
            scenarios = [dataclasses.replace(s, api=a.api) for s in scenarios]
        if a.reply_ids:
            scenarios = [dataclasses.replace(s, request_fields={**s.request_fields,
                                                                "logprobs": True})
                         for s in scenarios]
        modes = select_modes(a.modes, a.spec, a.url, a.label)
        if a.scenarios == ["all"] and any(m.url for m in modes):
            # `all` means every scenario that can run here; naming one still gets the error
            skipped = [s.name for s in scenarios if s.restart_after is not None]
            scenarios = [s for s in scenarios if s.restart_after is None]
            if skipped:
                log.warning("skipping %s: a restart needs servers the benchmark starts "
                            "(not --url)", ", ".join(skipped))
        check_restart(scenarios, modes, opt)  # before any server starts or any file is written
    except ValueError as e:
        ap.error(str(e))
    results = run_all(scenarios, modes, opt)
    paths = write_report(results, out, {s.name: s.description for s in scenarios})
    print(paths["summary.md"].read_text())
    print(f"results in {out}/ ({', '.join(paths)}; runs/*.json; logs/*.log)")
    return 1 if any("error" in r for r in results) else 0
