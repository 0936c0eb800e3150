"""Profile (jax.profiler) a serving engine's steps at a given slot count and context length: where
a step's time goes, by XLA operation, named by the JAX operation it came from and its shape.

The serving engine (:class:`mtp_jax.Engine`) over ``--slots`` slots of ``--max-len`` tokens gets
``--slots`` requests of ``--prompt-len`` random tokens at once (a corpus or chat workload's long
contexts; submitted while :attr:`mtp_jax.Engine.step_gate` holds the engine, so that each run
admits them in one prefill of the same shape), after one untimed run of the same shapes
(compiling). Then, under the profiler, the
same again for ``--new-tokens`` tokens each: the prefill's wall time, each step's wall time (the
scheduler's step calls, waited for), and the step's XLA operations summed over the traced steps
and divided by their count, each named from the compiled program's HLO (``op_name`` metadata and
result shape; XLA's own names such as ``ynn_fusion.253`` say nothing).

    python scripts/profile_engine_step.py --model smollm2-135m-instruct --slots 16 --max-len 2048 \\
        --prompt-len 600 --new-tokens 12 --json /tmp/step-profile.json

Run it from a checkout of another commit (``PYTHONPATH=<that checkout>``) for a before/after.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

DUMP = tempfile.mkdtemp(prefix="mtp-jax-step-hlo-")
os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={DUMP} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$"
).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mtp_jax  # noqa: E402

PREFIX = re.compile(r"^jit\(step\)/")
OP = re.compile(r"^\s*%?([\w.\-]+) = (\S+) .*?op_name=\"([^\"]*)\"", re.M)


def hlo_names(slots: int, seen: set[str]) -> dict[str, str]:
    """XLA op name -> "jax op shape" from the dumped step program that ran at ``slots`` rows (the
    dump holds one per row bucket; the one naming most of ``seen`` at that row count)."""
    best: dict[str, str] = {}
    score = -1
    for path in glob.glob(os.path.join(DUMP, "*jit_step*after_optimizations.txt")):
        with open(path, encoding="utf-8") as f:
            ops = {m[1]: (m[2], m[3]) for m in OP.finditer(f.read())}
        hits = sum(1 for n in seen if n in ops and ops[n][0].split("[")[-1].startswith(f"{slots},"))
        if hits > score:
            score = hits
            best = {n: f"{PREFIX.sub('', name)} {shape}" for n, (shape, name) in ops.items()}
    return best


def step_ops(trace_dir: str) -> tuple[int, collections.Counter]:
    """(traced step runs, microseconds by XLA op name summed over them), leaf operations only."""
    path = max(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))
    with gzip.open(path, "rt", encoding="utf-8") as f:
        events = json.load(f)
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    totals: collections.Counter = collections.Counter()
    runs = set()
    for e in events:
        args = e.get("args", {})
        if e.get("ph") != "X" or args.get("hlo_module") != "jit_step":
            continue
        runs.add(args.get("run_id"))
        if not e["name"].startswith(("cond", "while", "call")):  # containers: their ops are counted
            totals[e["name"]] += float(e.get("dur", 0))
    return len(runs), totals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a model name or checkpoint directory")
    p.add_argument("--draft-model", help="a draft checkpoint (with --draft)")
    p.add_argument("--draft", help="speculate with this draft (default: plain decoding)")
    p.add_argument("-k", type=int, default=3, help="drafts per step with --draft")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, default=600)
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--temperature", type=float, default=0.2)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--top", type=int, default=15, help="operations listed")
    p.add_argument("--trace-dir", default=None, help="where the trace goes (default: a temporary folder)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    extra = {"draft_model": args.draft_model} if args.draft_model else {}
    model = mtp_jax.load(args.model, "float32", **extra)
    spec = {"draft": args.draft, "num_speculative_tokens": args.k} if args.draft else {}
    engine = mtp_jax.Engine(model, slots=args.slots, max_len=args.max_len, **spec)
    inner, step_seconds = engine.scheduler.step_fn, []

    def timed(*a, **kw):
        t = time.perf_counter()
        out = jax.block_until_ready(inner(*a, **kw))
        step_seconds.append(time.perf_counter() - t)
        return out

    engine.scheduler.step_fn = timed
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size

    def run(new_tokens: int) -> tuple[float, float]:
        engine.step_gate = lambda: False  # every request in before the first admission: one prefill
        handles = [
            engine.submit(
                rng.integers(3, vocab, args.prompt_len).tolist(),
                mtp_jax.SamplingParams(
                    max_new_tokens=new_tokens, temperature=args.temperature, top_p=args.top_p, seed=i
                ),
            )
            for i in range(args.slots)
        ]
        t0 = time.perf_counter()
        engine.step_gate = None
        for h in handles:
            next(iter(h))
        first = time.perf_counter() - t0
        for h in handles:
            h.result()
        return first, time.perf_counter() - t0

    run(args.new_tokens)  # compiles the prefill and the step at these shapes
    step_seconds.clear()
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="mtp-jax-step-trace-")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        prefill, wall = run(args.new_tokens)
    engine.close()
    runs, totals = step_ops(trace_dir)
    names = hlo_names(args.slots, set(totals))
    by_op: collections.Counter = collections.Counter()
    for name, us in totals.items():
        by_op[names.get(name, name)] += us / max(runs, 1) / 1e3
    steps = sorted(step_seconds)
    result = {
        "settings": vars(args),
        "first_tokens_seconds": round(prefill, 2),
        "wall_seconds": round(wall, 2),
        "steps": len(steps),
        "step_ms_median": round(1e3 * steps[len(steps) // 2], 1) if steps else None,
        "step_op_ms": round(sum(by_op.values()), 1),
        "ops": [{"op": op, "ms": round(ms, 2)} for op, ms in by_op.most_common(args.top)],
    }
    print(
        f"{args.slots} slots x {args.prompt_len}-token prompts ({args.max_len}-token slots): every first "
        f"token after {prefill:.1f} s; step median {result['step_ms_median']} ms over {len(steps)} steps, "
        f"{result['step_op_ms']} ms of XLA operations a step (profiled {runs})"
    )
    for row in result["ops"]:
        print(f"{row['ms']:9.2f} ms  {row['op'][:130]}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
