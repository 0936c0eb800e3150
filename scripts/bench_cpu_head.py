"""Why a step that verifies drafts costs more on XLA:CPU: the output head's product for T rows.

Times SmolLM2-135M's tied head (its embedding E [49152, 576], float32) multiplied by T = 1, 2, 4, 8
rows, written several ways a JAX program can write it, each in its own process under each of a few
XLA:CPU flag sets (XLA_FLAGS is read once, when JAX starts). A verifying step runs the head over
K + 1 rows per request; one row is a matrix-vector product that streams E once.

    python scripts/bench_cpu_head.py [--rows 1 2 4 8] [--iters 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

D, V = 576, 49152
FLAG_SETS = {
    "default": "",
    "no XNNPACK": "--xla_cpu_use_xnnpack=false --xla_cpu_experimental_xnn_fusion_type=",
    "oneDNN": "--xla_cpu_use_onednn=true",
    "YNNPACK dots": "--xla_cpu_experimental_ynn_fusion_type=dot",
}


def _child(rows: list[int], iters: int) -> dict[str, float]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    e = jnp.asarray(rng.standard_normal((V, D), np.float32))
    w = jnp.asarray(np.ascontiguousarray(np.asarray(e).T))  # the same head stored [d, V]

    def blocks(x, e, n=1024):  # a scan over 1024-token slices of the head (each fits in L2 / L3)
        _, out = jax.lax.scan(lambda c, b: (c, x @ b.T), None, e.reshape(V // n, n, D))
        return out.transpose(1, 0, 2).reshape(x.shape[0], V)

    ways = {
        "x @ E.T": (lambda x, e, w: x @ e.T),
        "(E @ x.T).T": (lambda x, e, w: (e @ x.T).T),
        "x @ W": (lambda x, e, w: x @ w),
        "one matvec per row": (lambda x, e, w: jnp.stack([e @ x[i] for i in range(x.shape[0])])),
        "1024-token blocks": (lambda x, e, w: blocks(x, e)),
        # no dot: a multiply and a reduction over d, E's rows outermost (each read once, in cache for T rows)
        "multiply-reduce": (lambda x, e, w: jnp.sum(e[:, None, :] * x[None, :, :], axis=-1).T),
    }
    out = {}
    for t in rows:
        x = jnp.asarray(rng.standard_normal((t, D), np.float32))
        for name, fn in ways.items():
            f = jax.jit(fn)
            f(x, e, w).block_until_ready()
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                f(x, e, w).block_until_ready()
                times.append(time.perf_counter() - t0)
            out[f"{name}, T={t}"] = round(1e3 * sorted(times)[len(times) // 4], 2)  # lower quartile, ms
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.rows, args.iters)))
        return
    results = {}
    for label, flags in FLAG_SETS.items():
        argv = [
            sys.executable,
            __file__,
            "--child",
            "--iters",
            str(args.iters),
            "--rows",
            *map(str, args.rows),
        ]
        run = subprocess.run(argv, env=dict(os.environ, XLA_FLAGS=flags), capture_output=True, text=True)
        if run.returncode:
            print(f"{label}: failed\n{run.stderr[-2000:]}", file=sys.stderr)
            continue
        results[label] = json.loads(run.stdout)
        print(f"{label} ({flags or 'no flags'}):")
        for key, ms in results[label].items():
            print(f"  {key:28s} {ms:7.2f} ms")
    if args.json:
        tmp = args.json + ".partial"
        with open(tmp, "w") as f:
            json.dump({"d": D, "vocab": V, "flags": FLAG_SETS, "ms": results}, f, indent=1)
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
