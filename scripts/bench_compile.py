"""What it costs to compile the step and prefill: tracing, lowering and XLA's backend compile of each,
for the general program (greedy and sampled rows alike) and the greedy-only one that
``engine.generate`` runs when every request is greedy (``StepConfig.greedy``).

python scripts/bench_compile.py --draft mtp --k 1 3 --repeat 3

Each program is traced, lowered and compiled from scratch ``--repeat`` times (the in-memory caches
cleared in between, no persistent cache): the median of each phase is printed, one row per
(program, K, mode), then the greedy-only program's total against the general one's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _phases(fn, args: tuple) -> dict[str, float]:
    """Seconds to trace, lower and compile ``fn(*args)`` once, from empty caches."""
    import jax

    jax.clear_caches()
    t0 = time.perf_counter()
    traced = fn.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    lowered.compile()
    t3 = time.perf_counter()
    return {"trace": t1 - t0, "lower": t2 - t1, "compile": t3 - t2}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=os.path.join(REPO, "checkpoints", "tiny-deepseek-v3-stdlib"))
    parser.add_argument("--draft", default="mtp", help="a draft the model has (none: plain decoding only)")
    parser.add_argument("--draft-model", default=None, help="a separately stored draft's directory")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--batch", type=int, default=4, help="decode slots")
    parser.add_argument("--prompt-bucket", type=int, default=16, help="prefill's padded prompt length")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.batch < 1 or args.prompt_bucket < 1 or min(args.k) < 0:
        parser.error("--repeat, --batch and --prompt-bucket must be >= 1, --k >= 0")
    import jax
    import jax.numpy as jnp
    import numpy as np

    import mtp_jax
    from mtp_jax.request import SpeculativeConfig, step_config
    from mtp_jax.sampling import RowSampling
    from mtp_jax.step import init_state, prefill, step

    jax.config.update("jax_enable_compilation_cache", False)  # every compile a real one
    model = mtp_jax.load(args.model, "float32", draft_model=args.draft_model)
    rows = []
    for k in args.k:
        plain = args.draft == "none" or k == 0
        spec = SpeculativeConfig() if plain else SpeculativeConfig(draft=args.draft, num_speculative_tokens=k)
        general = step_config(model, spec)
        b, width = args.batch, 8
        for mode, sc in (("general", general), ("greedy-only", dataclasses.replace(general, greedy=True))):
            state = init_state(sc, b, b * width, width, jnp.float32)
            prefill_args = (
                model.params,
                state,
                sc,
                jnp.arange(b, dtype=jnp.int32),
                np.ones((b, args.prompt_bucket), np.int32),
                jnp.full((b,), args.prompt_bucket, jnp.int32),
                jnp.arange(b * width, dtype=jnp.int32).reshape(b, width),
                RowSampling.build(b),
            )
            programs = (("prefill", prefill, prefill_args), ("step", step, (model.params, state, sc)))
            for name, fn, fargs in programs:
                runs = [_phases(fn, fargs) for _ in range(args.repeat)]
                row = {"program": name, "k": sc.k, "mode": mode}
                row.update({p: statistics.median(r[p] for r in runs) for p in ("trace", "lower", "compile")})
                row["total"] = row["trace"] + row["lower"] + row["compile"]
                rows.append(row)
                print(
                    f"{name:8s} K={sc.k} {mode:12s} "
                    + "  ".join(f"{p} {row[p]:5.2f} s" for p in ("trace", "lower", "compile", "total")),
                    flush=True,
                )
    general_total = sum(r["total"] for r in rows if r["mode"] == "general")
    greedy_total = sum(r["total"] for r in rows if r["mode"] == "greedy-only")
    ratio = greedy_total / general_total
    print(f"greedy-only / general, all programs: {greedy_total:.2f} / {general_total:.2f} s = {ratio:.2f}")
    if args.json:
        with open(f"{args.json}.tmp", "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
        os.replace(f"{args.json}.tmp", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
