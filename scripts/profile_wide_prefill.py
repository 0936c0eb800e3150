"""Time one wide admission (8,192 rows of a 3-token prompt, one new token each) on the suite's 8-token
DeepSeek-V3 test model, with prompt buckets of at least 16 tokens (the old rule) and with
``mtp_jax.scheduler.shortest_prompt_bucket`` (the rule admission uses), each after an untimed
compiling run, under ``jax.profiler`` (traces in ``--trace-dir``).

    PYTHONPATH=. python scripts/profile_wide_prefill.py [--rows 8192]
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time

import jax

import mtp_jax
import mtp_jax.scheduler.admission as admission  # where the prefill looks the rule up
from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint
from tests.conftest import TINY_CONFIG, oracle_tensors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--trace-dir", default="/tmp/wide-prefill")
    args = p.parse_args(argv)
    cfg = copy.deepcopy(TINY_CONFIG)
    cfg.update(vocab_size=8, eos_token_id=1)
    path = os.path.join(tempfile.mkdtemp(), "ckpt")
    write_hub_checkpoint(path, cfg, oracle_tensors(cfg, alpha=2.0))
    model = mtp_jax.load(path, dtype="float32", page_size=4)
    rows = args.rows

    def admit() -> None:
        model.generate(
            [[0, 6, 4]] * rows,
            max_new_tokens=1,
            seed=list(range(rows)),
            ignore_eos=True,
            max_batch=rows,
            temperature=1.0,
        )

    shortest = admission.shortest_prompt_bucket
    try:
        for label, rule in (("at least 16", lambda r: 16), ("shortest_prompt_bucket", shortest)):
            admission.shortest_prompt_bucket = rule
            admit()  # compiling
            t = time.perf_counter()
            with jax.profiler.trace(os.path.join(args.trace_dir, label.replace(" ", "-"))):
                admit()
            print(f"{label}: {time.perf_counter() - t:.2f} s", flush=True)
    finally:
        admission.shortest_prompt_bucket = shortest
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
