"""Time the Pallas kernels against their references and XLA, and against the memory limit.

    python scripts/bench_kernels.py                       # DeepSeek-V3 decode shapes, 32k context
    python scripts/bench_kernels.py --context 4096 --batch 4 --impls reference ragged_dot
    python scripts/bench_kernels.py --small --json out.json      # tiny shapes (CPU smoke run)

Decode is memory-bound, so each result is reported as achieved bandwidth (bytes the operation must
read at least, divided by its time) next to the device's measured copy bandwidth (a jitted copy of
a large buffer: read + write), the physical limit for decode. MLA decode reads the latent cache of
every row up to its context plus the queries; the grouped matmul reads the weights of the experts
that received tokens plus the activations. ``kernel`` is each op's Mosaic GPU kernel; ``triton`` is
the grouped matmul's older Triton-backend kernel (gmm only), for comparison. Implementations that
cannot run here (the native kernels off a Hopper GPU, Triton off an sm_80+ GPU) are skipped with the
reason. Each timing: compile, warm up, then the median of ``--iters`` calls.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.bench import write_json
from mtp_jax.roofline import copy_bandwidth, timed
from pallas_kernels.mla_decode import IMPLS as MLA_IMPLS
from pallas_kernels.mla_decode import mla_decode
from pallas_kernels.moe import gmm


def mla_case(args: argparse.Namespace, rng: np.random.Generator) -> tuple[dict, int]:
    heads, width, value_dim, page = (4, 40, 32, 16) if args.small else (128, 576, 512, 64)
    tokens, batch, context = args.k + 1, args.batch, args.context
    pages_per_row = -(-context // page)
    dtype = jnp.bfloat16
    q = jnp.asarray(rng.standard_normal((batch, tokens, heads, width)), dtype)
    cache = jnp.asarray(rng.standard_normal((batch * pages_per_row, page, width)), dtype)
    table = jnp.asarray(rng.permutation(batch * pages_per_row).reshape(batch, pages_per_row), jnp.int32)
    positions = jnp.asarray(context - tokens + np.arange(tokens), jnp.int32)[None].repeat(batch, 0)
    inputs = {"q": q, "pages": cache, "page_table": table, "positions": positions}
    need = batch * context * width * 2 + q.nbytes  # every row's latent cache up to its context, bf16
    return {"inputs": inputs, "scale": width**-0.5, "value_dim": value_dim}, need


def gmm_case(args: argparse.Namespace, rng: np.random.Generator) -> tuple[dict, int]:
    experts, d, f = (8, 64, 32) if args.small else (256, 7168, 2048)
    rows = args.batch * (args.k + 1) * 8  # token copies of a decode step (top-8 routing)
    sizes = np.bincount(rng.integers(0, experts, rows), minlength=experts).astype(np.int32)
    lhs = jnp.asarray(rng.standard_normal((rows, d)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((experts, d, f)) * 0.02, jnp.bfloat16)
    need = int((sizes > 0).sum()) * d * f * 2 + lhs.nbytes
    return {"lhs": lhs, "rhs": rhs, "group_sizes": jnp.asarray(sizes)}, need


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--k", type=int, default=3, help="drafts per step: K+1 query tokens per row")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--small", action="store_true", help="tiny shapes, for a CPU smoke run")
    parser.add_argument(
        "--impls",
        nargs="+",
        default=["kernel", "triton", "reference", "ragged_dot"],
        help="implementations to time (mla_decode runs those it has: not triton / ragged_dot)",
    )
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--copy-mb", type=int, default=1024, help="buffer size of the copy measurement")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if min(args.batch, args.context, args.iters) < 1 or args.k < 0 or args.context <= args.k:
        parser.error("--batch, --context and --iters must be >= 1, --k >= 0 and --context > --k")

    rng = np.random.default_rng(0)
    limit = copy_bandwidth(args.copy_mb, args.iters)
    print(f"device {jax.devices()[0]}: copy bandwidth {limit / 1e9:.1f} GB/s", file=sys.stderr)
    results = []
    mla, mla_bytes = mla_case(args, rng)
    moe, moe_bytes = gmm_case(args, rng)
    for impl in args.impls:
        runs = []
        if impl in MLA_IMPLS:
            runs.append(
                (
                    "mla_decode",
                    mla_bytes,
                    lambda i=impl: mla_decode(
                        **mla["inputs"], scale=mla["scale"], value_dim=mla["value_dim"], impl=i
                    ),
                )
            )
        runs.append(("gmm", moe_bytes, lambda i=impl: gmm(**moe, impl=i)))
        for name, need, fn in runs:
            row = {"op": name, "impl": impl, "bytes": need}
            try:
                seconds = timed(jax.jit(fn), args.iters)
            except (ValueError, NotImplementedError, RuntimeError) as e:
                row["skipped"] = str(e).splitlines()[0]
                print(f"{name:10s} {impl:10s} skipped: {row['skipped']}", file=sys.stderr)
            else:
                row.update(seconds=seconds, gb_per_s=need / seconds / 1e9, of_copy=need / seconds / limit)
                print(
                    f"{name:10s} {impl:10s} {seconds * 1e6:10.1f} us  {row['gb_per_s']:8.1f} GB/s  "
                    f"{100 * row['of_copy']:5.1f}% of copy bandwidth"
                )
            results.append(row)
    if args.json:
        report = {
            "device": str(jax.devices()[0]),
            "jax": jax.__version__,
            "copy_bandwidth_gb_s": limit / 1e9,
            "shapes": {"batch": args.batch, "k": args.k, "context": args.context, "small": args.small},
            "results": results,
        }
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
