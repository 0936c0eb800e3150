"""Time the Pallas kernels against their references and XLA, and against the memory limit.

    python scripts/bench_kernels.py                       # DeepSeek-V3 decode shapes, 32k context, K = 3
    python scripts/bench_kernels.py --batch 1 8 64 --context 1024 8192 65536 --k 0 3 \\
        --gmm-tokens 1 8 32 64 128 256 --gmm-weights bf16 fp8 --json kernels.json   # the GPU sweep
    python scripts/bench_kernels.py --small --json out.json      # tiny shapes (CPU smoke run)

Decode is memory-bound, so each result is reported as achieved bandwidth (bytes the operation must
read at least, divided by its time) next to the device's measured copy bandwidth (a jitted copy of
a large buffer: read + write), the physical limit for decode.

- ``mla_decode`` (one case per batch x context x K): absorbed MLA attention of K+1 query tokens per
  row (DeepSeek-V3: 128 heads, latent 512 + rope 64, page size 64, bf16) against a paged latent
  cache; it must read every row's cache up to its context plus the queries, and do
  2·B·(K+1)·128·context·(576 + 512) flops (as many flops as bytes x ~240 at one query token: the
  tensor cores bound it too). Implementations: the Mosaic GPU ``kernel`` (its default schedule),
  ``kernel-shared`` / ``kernel-single`` (one schedule forced, :func:`mla_decode_kernel`) and the
  jnp ``reference`` (what XLA makes of it).
- ``dense`` (one case per DeepSeek-V3 FP8 dense projection x row count): ``materialize``
  (dequantise, then multiply), ``blocked`` (:func:`mtp_jax.fp8.dense_einsum`: the FP8
  values read in place, what the layers run up to 32 rows) and the gmm ``kernel`` with one group.
- ``gmm`` (one case per token count x weight format): one expert projection of DeepSeek-V3's MoE
  layer (256 experts, 7168 -> 2048, top-8 routing of ``tokens`` tokens, so 8 x tokens rows), bf16 or
  FP8 with 128 x 128 block scales; it must read the weights (and scales) of the experts that
  received rows plus the activations. Implementations: the Mosaic GPU ``kernel``, the older
  ``triton`` kernel, ``ragged_dot`` (on FP8 weights that includes dequantising the whole stack, as
  the portable path does) and the jnp ``reference`` (every expert on every row: tiny shapes only).

Every implementation's output is compared with a float32-accumulated baseline (the MLA reference in
float32; ``ragged_dot`` of the bf16 activations and dequantised weights accumulating in float32) and
the relative error ``|out - ref| / |ref|`` (Frobenius norms) is reported beside its time; a non-
finite output is an error, never a timing. Inputs are fresh random numbers. When one case's bytes
fit in a few L2 caches, the MLA inputs are rotated over disjoint copies of the cache (different
pages each call) so the time is that of device memory, not of the L2. Each timing: compile, warm up,
then the median of several rounds of ``--iters`` calls dispatched back to back (launch gaps hidden,
as a decode step has them hidden). Implementations that cannot run here (the native kernels off a
Hopper GPU, Triton off an sm_80+ GPU) are skipped with the reason.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import sys
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.bench import machine_info, write_json
from mtp_jax.fp8 import Fp8Weight, dense_einsum, materialize
from mtp_jax.roofline import copy_bandwidth, device_op_times, timed_back_to_back
from pallas_kernels.mla_decode import IMPLS as MLA_IMPLS
from pallas_kernels.mla_decode import mla_decode, mla_decode_kernel
from pallas_kernels.moe import IMPLS as GMM_IMPLS
from pallas_kernels.moe import gmm

MLA_SCHEDULES = ("kernel-shared", "kernel-single")  # mla_decode_kernel with one schedule forced
ROTATE_BYTES = 256 * 2**20  # rotate MLA inputs until one round reads about this much (5x an H100's L2)
MAX_COPIES = 64


def rel_err(out: jax.Array, ref: jax.Array) -> float:
    """|out - ref| / |ref| in float64 (Frobenius norms); inf for a non-finite output."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(out).all():
        return math.inf
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def mla_case(args: argparse.Namespace, rng: np.random.Generator, batch: int, k: int, context: int) -> dict:
    heads, width, value_dim, page = (4, 40, 32, 16) if args.small else (128, 576, 512, 64)
    tokens = k + 1
    pages_per_row = -(-context // page)
    need = batch * context * width * 2 + batch * tokens * heads * width * 2  # latent cache + queries, bf16
    copies = max(1, min(MAX_COPIES, -(-ROTATE_BYTES // need)))
    # Drawn on the device: at 64 rows x 32k tokens the cache alone is 2.4 GB of bfloat16.
    kq, kc = jax.random.split(jax.random.key(int(rng.integers(2**31))))
    q = jax.random.normal(kq, (batch, tokens, heads, width), jnp.bfloat16)
    cache = jax.random.normal(kc, (copies * batch * pages_per_row, page, width), jnp.bfloat16)
    perm = rng.permutation(copies * batch * pages_per_row).reshape(copies, batch, pages_per_row)
    tables = [jnp.asarray(t, jnp.int32) for t in perm]
    positions = jnp.asarray(context - tokens + np.arange(tokens), jnp.int32)[None].repeat(batch, 0)
    scale = (width - 64) ** -0.5 if not args.small else width**-0.5
    # The float32 reference's scores are [B, T, H, keys]; past a few GB it is not worth computing.
    ref_gb = batch * tokens * heads * pages_per_row * page * 4 * 3 / 1e9
    return {
        "name": f"mla_decode B={batch} K+1={tokens} ctx={context}",
        "shape": {"batch": batch, "k": k, "context": context, "heads": heads, "width": width},
        "need": need,
        "flops": 2 * batch * tokens * heads * context * (width + value_dim),
        "copies": copies,
        "ref_gb": ref_gb,
        "call": functools.partial(_mla_call, scale=scale, value_dim=value_dim),
        "inputs": [(q, cache, t, positions) for t in tables],
        "baseline": lambda q, cache, table, positions: mla_decode(
            q.astype(jnp.float32),
            cache.astype(jnp.float32),
            table,
            positions,
            scale=scale,
            value_dim=value_dim,
            impl="reference",
        ),
    }


def _mla_call(impl: str, q, cache, table, positions, *, scale: float, value_dim: int) -> jax.Array:
    if impl in MLA_SCHEDULES:
        schedule = impl.removeprefix("kernel-")
        return mla_decode_kernel(
            q, cache, table, positions, scale=scale, value_dim=value_dim, schedule=schedule
        )
    return mla_decode(q, cache, table, positions, scale=scale, value_dim=value_dim, impl=impl)


def random_fp8(rng: np.random.Generator, experts: int, d: int, f: int, block=(128, 128)) -> Fp8Weight:
    """FP8 weights of unit-scale e4m3 values with per-block scales around 1/sqrt(d), made on device."""
    key = jax.random.key(int(rng.integers(2**31)))
    w = (jax.random.normal(key, (experts, d, f), jnp.bfloat16) * 16).astype(jnp.float8_e4m3fn)
    blocks = (experts, -(-d // block[0]), -(-f // block[1]))
    scale = jnp.asarray(rng.uniform(0.5, 2.0, blocks) / (16 * math.sqrt(d)), jnp.float32)
    return Fp8Weight(w=w, scale_inv=scale, shape=(d, f), block=block)


# DeepSeek-V3's FP8 dense projections (in, out): q_a, q_b, o, a dense layer's gate (= up) and down,
# a shared expert's gate (= up).
DENSE_SHAPES = [(7168, 1536), (1536, 24576), (16384, 7168), (7168, 18432), (18432, 7168), (7168, 2048)]
DENSE_IMPLS = ("materialize", "blocked", "kernel")


def _dense_call(impl: str, x: jax.Array, w: Fp8Weight) -> jax.Array:
    """x [rows, d] · w (one FP8 expert [1, d, f]) three ways."""
    if impl == "materialize":  # dequantise, then multiply (the layers' path above 32 rows)
        return x @ materialize(w, x.dtype)[0]
    if impl == "blocked":  # the layers' path up to 32 rows: the FP8 values read in place
        return dense_einsum("md,df->mf", x, jax.tree.map(lambda a: a[0], w))
    if impl in ("kernel", "triton"):  # the grouped matmul with one group
        return gmm(x, w, jnp.asarray([x.shape[0]], jnp.int32), impl=impl)
    raise ValueError(f"dense: no implementation {impl!r} (choose from {DENSE_IMPLS})")


def dense_case(args: argparse.Namespace, rng: np.random.Generator, tokens: int, d: int, f: int) -> dict:
    """One FP8 dense projection [d, f] (128 x 128 block scales) of ``tokens`` rows."""
    if args.small:
        d, f = 32 * (1 + d // 4096), 32 * (1 + f // 4096)
    w = random_fp8(rng, 1, d, f, block=(32, 32) if args.small else (128, 128))
    x = jnp.asarray(rng.standard_normal((tokens, d)), jnp.bfloat16)
    return {
        "name": f"dense fp8 {d}x{f} tokens={tokens}",
        "shape": {"tokens": tokens, "d": d, "f": f, "weights": "fp8"},
        "need": w.nbytes + x.nbytes + tokens * f * 2,
        "copies": 1,
        "ref_gb": 0.0,
        "call": _dense_call,
        "inputs": [(x, w)],
        "baseline": lambda x, w: jnp.dot(
            x.astype(jnp.float32), materialize(w, jnp.bfloat16)[0].astype(jnp.float32)
        ),
    }


def gmm_case(args: argparse.Namespace, rng: np.random.Generator, tokens: int, weights: str) -> dict:
    experts, d, f, top_k = (8, 64, 32, 2) if args.small else (256, 7168, 2048, 8)
    rows = tokens * top_k
    # Each token picks top_k distinct experts, uniformly (real routing is skewed; uniform is the worst case).
    choice = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    sizes = np.bincount(choice.ravel(), minlength=experts).astype(np.int32)
    lhs = jnp.asarray(rng.standard_normal((rows, d)), jnp.bfloat16)
    if weights == "fp8":
        rhs = random_fp8(rng, experts, d, f, block=(32, 32) if args.small else (128, 128))
        per_expert = d * f + rhs.scale_inv[0].size * 4
    else:
        key = jax.random.key(int(rng.integers(2**31)))
        rhs = jax.random.normal(key, (experts, d, f), jnp.bfloat16) * (1 / math.sqrt(d))
        per_expert = d * f * 2
    need = int((sizes > 0).sum()) * per_expert + lhs.nbytes
    return {
        "name": f"gmm {weights} tokens={tokens} ({rows} rows, {int((sizes > 0).sum())} experts)",
        "shape": {"tokens": tokens, "rows": rows, "experts": experts, "d": d, "f": f, "weights": weights},
        "need": need,
        "copies": 1,
        "ref_gb": 0.0,
        "call": lambda impl, lhs, rhs, group_sizes: gmm(lhs, rhs, group_sizes, impl=impl),
        "inputs": [(lhs, rhs, jnp.asarray(sizes))],
        # The kernel's math (weights exactly as materialize rounds them) with float32 accumulation, by XLA.
        "baseline": lambda lhs, rhs, group_sizes: jax.lax.ragged_dot(
            lhs,
            materialize(rhs, jnp.bfloat16).astype(jnp.bfloat16),
            group_sizes,
            preferred_element_type=jnp.float32,
        ),
    }


def device_seconds(fns: list[Callable], iters: int) -> float:
    """Seconds per call the device spends in kernels (summed from a :mod:`jax.profiler` trace of
    ``iters`` calls): the time without the host's dispatch gaps, which dominate small cases."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            jax.block_until_ready([fns[i % len(fns)]() for i in range(iters)])
        ops = device_op_times(trace_dir, steps=iters)
    return sum(op["us_per_step"] for op in ops) / 1e6


def run_case(case: dict, op: str, impls: list[str], args: argparse.Namespace, limit: float) -> list[dict]:
    rows = []
    started = time.perf_counter()
    baseline = None
    if case["ref_gb"] <= args.reference_max_gb:
        baseline = jax.block_until_ready(jax.jit(case["baseline"])(*case["inputs"][0]))
    for impl in impls:
        row = {"op": op, "impl": impl, "bytes": case["need"], "copies": case["copies"], **case["shape"]}
        if impl == "reference" and case["ref_gb"] > args.reference_max_gb:
            row["skipped"] = f"the reference's scores need ~{case['ref_gb']:.0f} GB (> --reference-max-gb)"
        elif impl == "reference" and op == "gmm" and not args.small:
            row["skipped"] = "the reference computes every expert on every row (small shapes only)"
        else:
            # One program per implementation, the inputs its arguments (closed over, gigabytes of
            # weights would be compiled into the program as constants); the MLA cases rotate page
            # tables over copies of the cache.
            run = jax.jit(functools.partial(case["call"], impl))
            fns: list[Callable] = [functools.partial(run, *inputs) for inputs in case["inputs"]]
            try:
                out = jax.block_until_ready(fns[0]())
                if baseline is not None:
                    row["rel_err"] = rel_err(out, baseline)
                if not np.isfinite(np.asarray(out, np.float32)).all():
                    raise RuntimeError("non-finite output")
                seconds = timed_back_to_back(fns, args.iters)
                if args.device_time:
                    row["device_seconds"] = device_seconds(fns, args.iters)
            except (ValueError, NotImplementedError, RuntimeError) as e:
                row["skipped"] = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            else:
                best = row.get("device_seconds") or seconds
                row.update(
                    seconds=seconds,
                    gb_per_s=case["need"] / best / 1e9,
                    of_copy=case["need"] / best / limit,
                )
                if "flops" in case:
                    row["tflop_per_s"] = case["flops"] / best / 1e12
        rows.append(row)
        row["wall_s"] = time.perf_counter() - started
        if "skipped" in row:
            print(f"{case['name']:52s} {impl:10s} skipped: {row['skipped']}", file=sys.stderr, flush=True)
        else:
            err = f"  err {row['rel_err']:.1e}" if "rel_err" in row else ""
            dev = f" (device {row['device_seconds'] * 1e6:.1f} us)" if "device_seconds" in row else ""
            dev += f" {row['tflop_per_s']:6.1f} TFLOP/s" if "tflop_per_s" in row else ""
            print(
                f"{case['name']:52s} {impl:10s} {row['seconds'] * 1e6:10.1f} us{dev} {row['gb_per_s']:8.1f} "
                f"GB/s {100 * row['of_copy']:5.1f}% of copy{err} [{row['wall_s']:.0f} s]",
                flush=True,
            )
        started = time.perf_counter()
    return rows


def table(results: list[dict]) -> str:
    """A markdown table: one line per case, each implementation's time (the device's kernel time with
    --device-time) and share of the copy bandwidth."""
    impls = list(dict.fromkeys(r["impl"] for r in results))
    cases: dict[tuple, dict] = {}
    for r in results:
        fields = ("batch", "k", "context", "weights", "tokens") + (("d", "f") if r["op"] == "dense" else ())
        key = (r["op"],) + tuple((k, r[k]) for k in fields if k in r)
        cases.setdefault(key, {})[r["impl"]] = r
    lines = ["| case | MB | " + " | ".join(f"{i} us (% copy, err)" for i in impls) + " |"]
    lines.append("|---" * (len(impls) + 2) + "|")
    for key, by_impl in cases.items():
        any_row = next(iter(by_impl.values()))
        cells = []
        for impl in impls:
            r = by_impl.get(impl)
            if r is None or "skipped" in r:
                cells.append("-")
            else:
                err = f", {r['rel_err']:.0e}" if "rel_err" in r else ""
                cells.append(
                    f"{(r.get('device_seconds') or r['seconds']) * 1e6:.1f} ({100 * r['of_copy']:.0f}%{err})"
                )
        label = " ".join(f"{k}={v}" for k, v in key[1:])
        lines.append(f"| {key[0]} {label} | {any_row['bytes'] / 1e6:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--ops", nargs="+", default=["mla_decode", "gmm"], choices=["mla_decode", "gmm", "dense"]
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1], help="mla_decode: rows")
    parser.add_argument(
        "--k", type=int, nargs="+", default=[3], help="drafts per step: K+1 query tokens per row"
    )
    parser.add_argument(
        "--context", type=int, nargs="+", default=[32768], help="mla_decode: cached tokens per row"
    )
    parser.add_argument(
        "--gmm-tokens", type=int, nargs="+", help="gmm: tokens per step (default: batch x (K+1) of each case)"
    )
    parser.add_argument("--gmm-weights", nargs="+", default=["bf16"], choices=["bf16", "fp8"])
    parser.add_argument(
        "--dense-tokens",
        type=int,
        nargs="+",
        default=[1, 4, 32],
        help="dense: rows of each FP8 dense projection (DeepSeek-V3's shapes; impls materialize, "
        "blocked, kernel)",
    )
    parser.add_argument("--small", action="store_true", help="tiny shapes, for a CPU smoke run")
    parser.add_argument(
        "--impls",
        nargs="+",
        default=["kernel", "triton", "reference", "ragged_dot"],
        help="implementations to time; each op runs those it has (mla_decode: kernel, kernel-shared, "
        "kernel-single, reference; gmm: kernel, triton, reference, ragged_dot; dense: materialize, "
        "blocked, kernel)",
    )
    parser.add_argument("--iters", type=int, default=20, help="calls per timed round")
    parser.add_argument(
        "--device-time",
        action="store_true",
        help="also trace each case with jax.profiler and rate it by the device's kernel time per call "
        "(bandwidths then use that time)",
    )
    parser.add_argument("--copy-mb", type=int, default=1024, help="buffer size of the copy measurement")
    parser.add_argument(
        "--reference-max-gb", type=float, default=12.0, help="skip the MLA reference above this much memory"
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if (
        min(args.batch + args.context + [args.iters] + (args.gmm_tokens or [1])) < 1
        or min(args.k) < 0
        or min(args.context) <= max(args.k)
    ):
        parser.error(
            "--batch, --context, --gmm-tokens and --iters must be >= 1, --k >= 0 and --context > --k"
        )

    rng = np.random.default_rng(0)
    limit = copy_bandwidth(args.copy_mb, args.iters)
    print(f"device {jax.devices()[0]}: copy bandwidth {limit / 1e9:.1f} GB/s", file=sys.stderr, flush=True)
    results = []
    if "mla_decode" in args.ops:
        impls = [i for i in args.impls if i in MLA_IMPLS or i in MLA_SCHEDULES]
        for batch, k, context in itertools.product(args.batch, args.k, args.context):
            results += run_case(mla_case(args, rng, batch, k, context), "mla_decode", impls, args, limit)
    if "gmm" in args.ops:
        tokens = args.gmm_tokens or sorted({b * (k + 1) for b in args.batch for k in args.k})
        for weights, n in itertools.product(args.gmm_weights, tokens):
            impls = [i for i in args.impls if i in GMM_IMPLS]
            results += run_case(gmm_case(args, rng, n, weights), "gmm", impls, args, limit)
    if "dense" in args.ops:
        impls = [i for i in args.impls if i in DENSE_IMPLS] or list(DENSE_IMPLS)
        for (d, f), n in itertools.product(DENSE_SHAPES, args.dense_tokens):
            results += run_case(dense_case(args, rng, n, d, f), "dense", impls, args, limit)
    print(table(results))
    if args.json:
        report = {
            **machine_info(),
            "copy_bandwidth_gb_s": limit / 1e9,
            "args": {k: v for k, v in vars(args).items() if k != "json"},
            "results": results,
        }
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
