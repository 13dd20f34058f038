"""`python -m radixserve.bench SCENARIO...` (same as `radixserve bench`)."""

import sys

from radixserve.bench.cli import main

sys.exit(main(sys.argv[1:]))
