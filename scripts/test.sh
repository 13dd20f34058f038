#!/usr/bin/env bash
# Set up .venv/ (with the test extras) and run the tests.
#   scripts/test.sh [pytest args]        the whole suite, model, server, Ray and browser tests
#                                        included (what CI runs), on every core: one pytest-xdist
#                                        worker a core, a file to a worker (tests/workers.py)
#   scripts/test.sh fast [pytest args]   the fast tier: no server process, no Ray, no browser, no
#                                        default-model generation loop (tests/tiers.py says which
#                                        tests are left out, and fails one that breaks the rule)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
pytest=(.venv/bin/python -m pytest -q -rs)  # -rs: any skip is named (a skip is a defect)
# several processes compute at once: OpenMP threads that spin while they wait for work take the
# cores from the other worker and the servers (measured on 2 cores: with spinning threads two
# workers took twice as long as one process, without them 0.88x)
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
if [ "${1:-}" = "fast" ]; then
  shift
  # one worker a core here too (2 cores: 3 min 17 s, where one process took 4 min 25 s)
  exec "${pytest[@]}" -n auto -m "not slow" "$@"
fi
exec "${pytest[@]}" -n auto --dist loadgroup --no-loadscope-reorder "$@"
