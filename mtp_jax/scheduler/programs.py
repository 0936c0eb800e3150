"""The programs a scheduler compiles: the power-of-two shapes its prefills, steps and releases are
padded to (a few programs cover every batch), and its warm-up, which compiles each of them before a
request needs it."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.sampling import RowSampling
from mtp_jax.step import deactivate, prefill, prefill_chunk

if TYPE_CHECKING:
    from mtp_jax.scheduler.core import Scheduler


def next_power_of_two(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def shortest_prompt_bucket(rows: int) -> int:
    """The shortest prompt bucket of a prefill of ``rows`` rows (a power of two): 16 tokens, so that
    few programs cover short prompts, down to 1 for prefills so wide that padding every row to 16
    costs more than a program (at most 4,096 padded tokens; 16,384 rows of 3-token prompts
    prefilled 2.9x faster)."""
    return max(1, min(16, 4096 // max(rows, 1)))


def warmup_jobs(sched: Scheduler, max_prompt_len: int, ks: Sequence[int]) -> list[tuple[str, int, int]]:
    """Every program requests without a grammar can make the scheduler run, smallest first:
    admissions ("prefill", rows per shard, prompt bucket) of 1, 2, 4 ... rows per shard with
    prompts padded to 16, 32 ... up to ``max_prompt_len`` tokens (from fewer than 16 for very
    wide admissions: :func:`shortest_prompt_bucket`); steps ("step", K, rows) for
    each K in ``ks`` over each row bucket; slot releases ("release", n, 0); with chunked prefill
    prompt buckets up to the chunk only, and the chunk's own program ("chunk", 1, chunk)."""
    per_shard = next_power_of_two(sched.slots // sched.shards)
    pers = [1 << i for i in range(per_shard.bit_length()) if 1 << i <= per_shard]
    chunked = sched.chunk is not None and max_prompt_len > sched.chunk
    if chunked:  # longer prompts arrive in chunks: their rest fits one
        max_prompt_len = sched.chunk

    def buckets(per: int) -> list[int]:
        low = shortest_prompt_bucket(per * sched.shards)
        top = next_power_of_two(max_prompt_len, minimum=low)
        return [low << i for i in range(top.bit_length()) if low << i <= top]

    powers = [1 << i for i in range(sched.slots.bit_length() + 1)]
    rows = [r for r in powers if r < sched.slots] if sched.row_buckets else []
    releases = [r for r in powers if r <= next_power_of_two(sched.slots)]
    ks = {sched._variant(k).k for k in ks}  # the programs those K run (a token tree: whole or none)
    jobs = [("prefill", per, t) for per in pers for t in buckets(per)]
    jobs += [("step", k, r) for k in sorted(ks, reverse=True) for r in [*rows, sched.slots]]
    jobs += [("release", n, 0) for n in releases]
    if chunked:
        jobs.append(("chunk", 1, sched.chunk))
    return smallest_first(jobs)


def warmup_job(sched: Scheduler, kind: str, a: int, b: int) -> None:
    """Run one of :meth:`warmup_jobs`' programs on no request (padding rows and inactive
    slots: nothing changes), compiling it. Only while no request runs."""
    if sched.pending is not None or any(o is not None for o in sched.owner):
        raise ValueError("warm up before requests run (some are running now)")
    if kind == "prefill":  # host arrays, as _prefill passes them: the same compiled program
        r = a * sched.shards
        first, sched.state, _ = prefill(
            sched.params,
            sched.state,
            sched.sc,
            np.full(r, sched.slots, np.int32),
            np.zeros((r, b), np.int32),
            np.ones(r, np.int32),
            np.zeros((r, sched.width), np.int32),
            jax.tree.map(np.asarray, RowSampling.build(r)),
            None,
            np.zeros(r, np.int32),
            np.zeros(r, bool),
            **({"fresh": np.zeros(r, np.int32)} if sched.sc.local_ring else {}),
        )
        np.asarray(first)
    elif kind == "step":
        extra = {"rows": b} if b < sched.slots else {}
        sc = sched._variant(a)
        emitted, n_emit, sched.state, _ = sched.step_fn(sched.params, sched.state, sc, None, **extra)
        np.asarray(n_emit)
    elif kind == "chunk":
        r, zeros = sched.shards, jnp.asarray(np.zeros(sched.shards, np.int32))
        sched.state = prefill_chunk(
            sched.params,
            sched.state,
            sched.sc,
            jnp.asarray(np.zeros((r, b), np.int32)),
            zeros,
            zeros,
            zeros,
            jnp.asarray(np.zeros((r, sched.width), np.int32)),
            zeros,
            zeros,
            **({"fresh": zeros} if sched.sc.local_ring else {}),
        )
    elif kind == "release":
        sched.state = deactivate(sched.state, np.full(a, sched.slots, np.int32))
    else:
        raise ValueError(f"unknown warm-up job {kind!r}")


def warmup(
    sched: Scheduler,
    max_prompt_len: int,
    ks: Sequence[int],
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Compile every program of :meth:`warmup_jobs` now. Call it while no request runs.
    ``progress(done, total)`` after each; returns how many programs ran."""
    jobs = warmup_jobs(sched, max_prompt_len, ks)
    for i, job in enumerate(jobs):
        warmup_job(sched, *job)
        if progress is not None:
            progress(i + 1, len(jobs))
    return len(jobs)


_JOB_SIZES = {
    "prefill": lambda a, b: a * b // 16,
    "chunk": lambda a, b: b // 16,
    "step": lambda a, b: b,
    "release": lambda a, b: a,
}


def smallest_first(jobs: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Warm-up jobs (:meth:`Scheduler.warmup_jobs`) by the work each program does, smallest first."""
    kinds = list(_JOB_SIZES)
    return sorted(jobs, key=lambda j: (_JOB_SIZES[j[0]](j[1], j[2]), kinds.index(j[0])))
