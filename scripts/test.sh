#!/usr/bin/env bash
# Set up .venv/ (with the test extras) and run the whole test suite, model tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
exec .venv/bin/python -m pytest -q -rs "$@"  # -rs: any skip is named (a skip is a defect)
