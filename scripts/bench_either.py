"""The n-gram step's two widths chosen by ``lax.cond`` or by ``step.one_of``'s loops, alternated in a process.

    python scripts/bench_either.py --model smollm2-135m-instruct --k 8 --context 300 --rounds 8 \
        --json benchmarks/smollm2/either-vs-cond-k8.json

A draft that proposes per row (n-gram) runs a step that verifies K + 1 tokens per row when some row
has drafts and one token per row when none has. ``step.one_of`` makes that choice with two
``while_loop``s of zero or one trip; ``lax.cond`` made it before, and XLA copies a buffer that a
conditional's branch updates in place: the KV page pools, twice a step. On a GPU each loop test
reads its predicate back to the host (a conditional reads one), so the trade may differ there:
this script times plain decoding and both forms of the step, with and without drafts, compiled
side by side and alternated round by round (A B ..., then reversed), each call from a state with
the committed length reset (``roofline.timed_call_state``); it prints each one's median over the
rounds, its paired ratio to plain decoding, and how many copies of a KV pool its compiled program
holds (XLA:CPU's default flags: six with ``lax.cond``, none with ``either``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    parser.add_argument(
        "--config", default=None, help="a config.json instead: random dense weights in --dtype (a GPU run)"
    )
    parser.add_argument("--dtype", default=None, help="default: float32 for --model, bfloat16 for --config")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument(
        "--pool-rows",
        type=int,
        default=4,
        help="the KV page pool holds this many rows' pages (a server's holds many; lax.cond copies all)",
    )
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--iters", type=int, default=15, help="calls per program per round (median)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if min(args.k, args.context, args.rounds, args.iters) < 1 or args.pool_rows < 2:
        parser.error("--k, --context, --rounds and --iters must be >= 1, --pool-rows >= 2")

    import jax
    import jax.numpy as jnp
    import numpy as np

    import mtp_jax
    import mtp_jax.step as step_module
    from mtp_jax.bench import machine_info, model_path, write_json
    from mtp_jax.model import DTYPES
    from mtp_jax.roofline import timed_call_state
    from mtp_jax.step import StepConfig, init_state, step

    if args.config:
        from mtp_jax.model import resolve_layer_buffers, with_layer_buffers
        from mtp_jax.roofline import _load_config, random_params

        dtype, source = args.dtype or "bfloat16", os.path.basename(args.config)
        cfg = _load_config(args.config, [])
        params = random_params(cfg, DTYPES[dtype], "dense")
        if resolve_layer_buffers(params, cfg, None, None):
            params = with_layer_buffers(params, cfg, consume=True)
    else:
        dtype = args.dtype or "float32"
        model = mtp_jax.load(model_path(args.model), dtype=dtype)
        cfg, params, source = model.config, model.params, os.path.basename(model.path)
    page = args.page_size
    loops = step_module.one_of  # the step's choice among its widths (n-gram: 1 and K + 1)

    def cond(index, branches, params, state, blank):  # the conditional it replaced
        return jax.lax.switch(index, branches, params, state)

    def build(k: int, either) -> tuple:
        sc = StepConfig(cfg, page, k, "ngram" if k else None)
        width = -(-(args.context + 2 * (k + 1)) // page)
        # the pool's shape differs from one row's gathered pages, which the copy count must not see
        state = init_state(sc, 1, args.pool_rows * width, width, DTYPES[dtype])
        ids = np.random.default_rng(0).integers(2, cfg.vocab_size, (1, k + 1)).astype(np.int32)
        state = dataclasses.replace(
            state,
            page_table=jnp.arange(width, dtype=jnp.int32)[None],
            next_token=jnp.asarray(ids[:, 0]),
            drafts=jnp.asarray(ids[:, 1:]),
            active=jnp.ones((1,), bool),
        )
        step_module.one_of = either
        step.clear_cache()  # the traced program depends on the patched global, not on the arguments
        try:
            compiled = step.lower(params, state, sc).compile()
        finally:
            step_module.one_of = loops
        pool = jax.tree.leaves(state.target_pages)[0]
        shape = f"[{','.join(map(str, pool.shape))}]"
        copies = sum(1 for line in compiled.as_text().splitlines() if " copy(" in line and shape in line)
        if k and copies and either is loops:
            print(
                f"note: the step.one_of program copies a KV pool {copies} times", file=sys.stderr, flush=True
            )
        return compiled, [state], copies

    print(
        f"compiling plain decoding and the n-gram K = {args.k} step both ways ...",
        file=sys.stderr,
        flush=True,
    )
    programs = {
        "plain": (build(0, loops), 0),
        "no drafts, lax.cond": (build(args.k, cond), 0),
        "no drafts, either": (build(args.k, loops), 0),
        "drafts, lax.cond": (build(args.k, cond), args.k),
        "drafts, either": (build(args.k, loops), args.k),
    }

    def timed(name: str) -> float:
        (compiled, holder, _), drafts = programs[name]
        times = []
        for _ in range(args.iters + 2):
            state = timed_call_state(
                holder[0],
                seq_len=jnp.full((1,), args.context, jnp.int32),
                num_drafts=jnp.full((1,), drafts, jnp.int32),
            )
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            _, n_emit, holder[0], _ = compiled(params, state)
            jax.block_until_ready(n_emit)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[2:]) * 1e3

    rounds: dict[str, list[float]] = {name: [] for name in programs}
    for r in range(args.rounds):
        for name in list(programs) if r % 2 == 0 else list(programs)[::-1]:
            rounds[name].append(timed(name))
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    results = {}
    title = f"{source}, K = {args.k}, context {args.context}"
    print(f"| {title} | median ms | paired vs plain | KV pool copies |\n|---|---|---|---|")
    for name, times in rounds.items():
        paired = statistics.median(t / p for t, p in zip(times, rounds["plain"], strict=True))
        results[name] = {"rounds_ms": times, "median_ms": statistics.median(times), "paired_vs_plain": paired}
        results[name]["pool_copies"] = programs[name][0][2]
        print(f"| {name} | {statistics.median(times):.2f} | {paired:.3f}x | {programs[name][0][2]} |")
    if args.json:
        report = dict(model=source, k=args.k, context=args.context, dtype=dtype, rounds=args.rounds)
        report["pool_pages"] = args.pool_rows * -(-(args.context + 2 * (args.k + 1)) // page)
        write_json(args.json, {**report, **machine_info(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
