"""N-gram prompt lookup with two shortest-match settings, alternated in one process (A/B).

    python scripts/bench_ngram_ab.py --kinds edit --json benchmarks/smollm2/ngram-min3-ab-edit.json

Runs of separate processes on these shared machines move +-10% between each other, more than the
difference being measured, so this script times plain decoding and the n-gram draft at each K with
``--min-n`` A and B in one process, in the order A B then B A (each after a compiling warm-up over
the same prompts), on SmolLM2-135M-Instruct (float32) and the held-out prompts of
``scripts/bench_real.py`` (``--kinds``), greedy, batch 1, end to end, and the time per output
token (decoding alone: a request's first token to its last).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kinds", nargs="+", default=["edit"], choices=["chat", "code", "edit"])
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts per kind")
    parser.add_argument("--k", type=int, nargs="+", default=[5, 8])
    parser.add_argument("--min-n", type=int, nargs=2, default=[1, 3], metavar=("A", "B"))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()

    import bench_real
    import jax

    import mtp_jax
    from mtp_jax.bench import machine_info, write_json
    from mtp_jax.drafts.ngram import draft as ngram
    from mtp_jax.embedded import resolve_model_path
    from mtp_jax.text import TextCodec

    codec = TextCodec.for_path(resolve_model_path("smollm2-135m-instruct"))
    by_kind = bench_real.prompt_ids(codec, args.prompts, tuple(args.kinds))
    prompts = [p for kind in args.kinds for p in by_kind[kind]]
    model = mtp_jax.load("smollm2-135m-instruct", "float32")

    def run(k: int, min_n: int) -> dict:
        kw = {}
        if k:
            ngram.MIN_N = min_n
            jax.clear_caches()  # the lookup reads MIN_N when traced
            kw = {"draft": "ngram", "num_speculative_tokens": k}
        model.generate(prompts, max_new_tokens=4, ignore_eos=True, max_batch=1, **kw)  # every program
        t0 = time.perf_counter()
        r = model.generate(prompts, max_new_tokens=args.new_tokens, ignore_eos=True, max_batch=1, **kw)
        seconds = time.perf_counter() - t0
        row = {"k": k, "min_n": min_n if k else None, "tok_s": len(prompts) * args.new_tokens / seconds}
        row["acceptance_length"] = r.stats["acceptance_length"]
        row["tpot_ms"] = r.stats["mean_time_per_output_token_seconds"] * 1e3  # decoding alone
        print(row, file=sys.stderr, flush=True)
        return row

    a, b = args.min_n
    rows = []
    for order in ((a, b), (b, a)):
        rows.append(run(0, 0))
        rows += [run(k, m) for k in args.k for m in order]
    write_json(args.json, {"command": " ".join(sys.argv), **machine_info(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
