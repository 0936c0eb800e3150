"""A sliding-window model's prefill and decoding with its local layers' keys on every page against
in each slot's ring (``mtp_jax.load(..., window_cache=...)``), at a few context lengths.

    python scripts/bench_window_cache.py --model gemma-3-270m --context 1000 4000 \\
        --json benchmarks/gemma3/window-cache.json

One prompt of ``--context`` random tokens (BOS first), greedy, batch 1, float32, through
``Model.generate``: the prefill's time is a 1-token generation's, decoding's the difference with a
``1 + --new-tokens`` one divided by ``--new-tokens`` (each the best of ``--repeats`` after an untimed
run of both, which compiles them). Both modes' tokens must be equal (checked). The KV bytes are
the target cache's for one slot of the context, from the shapes the step allocates.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mtp_jax  # noqa: E402
from mtp_jax.request import SpeculativeConfig, step_config  # noqa: E402
from mtp_jax.step import init_state  # noqa: E402


def kv_bytes(model, context: int) -> int:
    """The target cache's bytes for one slot of ``context`` tokens (shapes only, nothing allocated)."""
    sc = step_config(model, SpeculativeConfig())
    width = -(-context // sc.page_size)
    dtype = jnp.float32 if model.dtype == "float32" else jnp.bfloat16
    pages = jax.eval_shape(lambda: init_state(sc, 1, width, width, dtype).target_pages)
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pages))


def timed(model, prompt: list[int], new_tokens: int, repeats: int) -> tuple[float, float, list[int]]:
    """(prefill seconds, decoding seconds per token, the tokens) of one greedy generation."""
    run = {
        n: (lambda n=n: model.generate([prompt], max_new_tokens=n, ignore_eos=True))
        for n in (1, 1 + new_tokens)
    }
    tokens = [run[n]().tokens[0] for n in run][-1]  # compiles both
    best = {}
    for n, fn in run.items():
        best[n] = min(_seconds(fn) for _ in range(repeats))
    return best[1], (best[1 + new_tokens] - best[1]) / new_tokens, tokens


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--context", type=int, nargs="+", default=[1000, 4000])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    model = mtp_jax.load(args.model, args.dtype, page_size=args.page_size)
    rng = np.random.default_rng(0)
    rows = []
    for context in args.context:
        prompt = [int(model.config.bos_token_id or 0)] + [
            int(x) for x in rng.integers(1, model.config.vocab_size, context - 1)
        ]
        outs = {}
        for mode in ("pages", "ring"):
            m = model.with_window_cache(mode)
            prefill, per_token, outs[mode] = timed(m, prompt, args.new_tokens, args.repeats)
            row = {
                "context": context,
                "window_cache": mode,
                "prefill_s": round(prefill, 3),
                "decode_ms_per_token": round(per_token * 1e3, 2),
                "kv_bytes": kv_bytes(m, context),
            }
            rows.append(row)
            print(
                f"context {context:6d} {mode:5s}: prefill {prefill:7.2f} s, decoding "
                f"{per_token * 1e3:7.1f} ms/token, KV {row['kv_bytes'] / 2**20:8.1f} MiB",
                flush=True,
            )
        if outs["pages"] != outs["ring"]:
            print(f"context {context}: the ring's tokens differ from every page's", file=sys.stderr)
            return 1
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"command": " ".join(sys.argv), "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
