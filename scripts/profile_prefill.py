"""Profile (jax.profiler) one admission of 8 requests that share a long system prompt, without and
with prefix caching: the XLA operation time of the prefill (mtp_jax.roofline.device_op_times over
the Perfetto trace) and its costliest operations. The embedded model, MTP K = 3; each scheduler
runs two untimed admissions first (compiling; with caching, caching the system prompt).

    python scripts/profile_prefill.py --system-len 1024 --trace-dir /tmp/prefill-profile

With ``--reply-len N`` the profiled admission is each conversation's second turn instead: the
first turn (a system prompt of its own, a question) decodes N tokens, then the conversation so far
plus a new question is admitted (with prefix caching its first turn's pages are cached: the
prompt's, and the reply's where the engine names them).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mtp_jax  # noqa: E402
from mtp_jax.bench import model_path  # noqa: E402
from mtp_jax.request import SpeculativeConfig, step_config  # noqa: E402
from mtp_jax.roofline import device_op_times  # noqa: E402
from mtp_jax.sampling import RowSampling  # noqa: E402
from mtp_jax.scheduler import Request, Scheduler, pages_needed  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: the embedded model)")
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--trace-dir", default="/tmp/prefill-profile")
    p.add_argument("--reply-len", type=int, default=0, help="profile second turns after replies this long")
    args = p.parse_args(argv)
    model = mtp_jax.load(model_path(args.model), "float32")
    sc = step_config(model, SpeculativeConfig(draft="mtp", num_speculative_tokens=3))
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    system = rng.integers(2, vocab, args.system_len).tolist()
    total = args.system_len + args.question_len
    if args.reply_len:
        total += args.reply_len + args.question_len
    for caching in (False, True):
        sched = Scheduler(
            model.params, sc, slots=8, width=pages_needed(total + 64, 0, sc), eos_token_ids=(),
            cache_dtype=jnp.float32, prefix_caching=caching,
        )  # fmt: skip

        def question() -> list[int]:
            return rng.integers(2, vocab, args.question_len).tolist()

        def prompts(sched=sched) -> list[list[int]]:
            """The 8 prompts of the next admission; with --reply-len, their first turns run first."""
            if not args.reply_len:
                return [system + question() for _ in range(8)]
            first = [rng.integers(2, vocab, args.system_len).tolist() + question() for _ in range(8)]
            turns = [sched.submit(Request(p, args.reply_len, RowSampling.build(1))) for p in first]
            while sched.advance():
                pass
            return [r.prompt + r.tokens + question() for r in turns]

        def admit(batch: list[list[int]], sched=sched) -> None:
            for prompt in batch:
                sched.submit(Request(prompt, 1, RowSampling.build(1)))
            sched.admissions.admit()
            jax.block_until_ready(sched.state.seq_len)

        for _ in range(2):
            admit(prompts())
            while sched.advance():
                pass
        where = os.path.join(args.trace_dir, f"prefix-caching-{'on' if caching else 'off'}")
        batch = prompts()
        t0 = time.perf_counter()
        with jax.profiler.trace(where, create_perfetto_trace=True):
            admit(batch)
        wall = time.perf_counter() - t0
        ops = device_op_times(where, 1)
        top = ", ".join(f"{o['name']} {o['us_per_step'] / 1000:.1f} ms" for o in ops[:3])
        what = f"8 x {len(batch[0])} tokens" + (" (second turns)" if args.reply_len else "")
        print(
            f"prefix caching {'on ' if caching else 'off'}: {what} admitted: XLA op time "
            f"{sum(o['us_per_step'] for o in ops) / 1000:.1f} ms (wall {wall * 1000:.0f} ms, tracing "
            f"included); costliest: {top}",
            flush=True,
        )
        while sched.advance():
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
