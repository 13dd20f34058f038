#!/usr/bin/env bash
# Set up .venv/ and start the server on the default model (extra flags go to `radixserve serve`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/radixserve serve "$@"
