#!/usr/bin/env bash
# Set up .venv/ (with the test extras) and run the tests.
#   scripts/test.sh [pytest args]        the whole suite, model, server, Ray and browser tests
#                                        included (what CI runs)
#   scripts/test.sh fast [pytest args]   the fast tier: no server process, no Ray, no browser, no
#                                        default-model generation loop (tests/tiers.py says which
#                                        tests are left out, and fails one that breaks the rule)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
tier=()
if [ "${1:-}" = "fast" ]; then
  shift
  tier=(-m "not slow")
fi
exec .venv/bin/python -m pytest -q -rs "${tier[@]}" "$@"  # -rs: any skip is named (a skip is a defect)
