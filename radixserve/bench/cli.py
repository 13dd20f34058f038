"""`radixserve bench SCENARIO... [options] [-- server flags]`: run, then write the report.

Server flags the benchmark does not know are passed to every `radixserve serve` it starts
(after the scenario's own `server_args`, before the mode's flags). Put them after `--` when a
flag takes a value, so the value is not mistaken for a scenario name.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from radixserve.bench.modes import DEFAULT_MODES, EXTERNAL, parse_modes
from radixserve.bench.report import write_report
from radixserve.bench.runner import BenchOptions, run_all
from radixserve.bench.scenarios import load_scenario, scenario_names


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="radixserve bench", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="shipped scenarios: " + ", ".join(scenario_names()) + " (or 'all', or a .json path)")
    ap.add_argument("scenarios", nargs="+", metavar="SCENARIO")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help="comma separated: no-cache, slot-only, legacy, radix "
                         "(default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="cold-start runs per mode; tables show medians (default: %(default)s)")
    ap.add_argument("--url", default=None,
                    help="measure this running OpenAI-compatible server instead "
                         "(mode 'external')")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default: bench-results/<UTC time>)")
    ap.add_argument("-m", "--model", default="default", help="model for the servers we start")
    return ap


def main(argv: list[str]) -> int:
    """Entry point of `radixserve bench` and `python -m radixserve.bench`; returns the exit code
    (1 if any run failed, so scripts notice)."""
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
    try:
        scenarios = [load_scenario(n) for n in names]
        modes = [EXTERNAL] if a.url else parse_modes(a.modes)
    except ValueError as e:
        ap.error(str(e))
    out = a.out or Path("bench-results") / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    opt = BenchOptions(out_dir=out, repeats=a.repeats, model=a.model,
                       extra_server_args=unknown + forwarded, url=a.url)
    results = run_all(scenarios, modes, opt)
    paths = write_report(results, out, {s.name: s.description for s in scenarios})
    print(paths["summary.md"].read_text())
    print(f"results in {out}/ ({', '.join(paths)}; runs/*.json; logs/*.log)")
    return 1 if any("error" in r for r in results) else 0
