"""Decode throughput, plain and speculative: the same as ``mtp-jax bench`` (see mtp_jax/bench.py).

python scripts/bench.py --k 0 1 2 3 4 --batch 1 8 --json bench.json --plot bench.png
"""

from __future__ import annotations

import sys

from mtp_jax.bench import main

if __name__ == "__main__":
    sys.exit(main(prog="scripts/bench.py"))
