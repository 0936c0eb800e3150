"""The unified step against its memory roofline: the same as ``mtp_jax/roofline.py`` describes.

python scripts/bench_step.py --k 0 1 3 --context 1024 --json step.json
"""

from __future__ import annotations

import sys

from mtp_jax.roofline import main

if __name__ == "__main__":
    sys.exit(main(prog="scripts/bench_step.py"))
