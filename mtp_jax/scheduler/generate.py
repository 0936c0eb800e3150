"""Offline decoding: every request known up front, decoded to the end by a :class:`Scheduler` sized
for them (:func:`generate`, what ``Model.generate`` runs), with the run's statistics."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.grammar import Constraints
from mtp_jax.request import CheckedRequest, row_sampling
from mtp_jax.scheduler.core import Scheduler, steps_per_width
from mtp_jax.scheduler.programs import next_power_of_two
from mtp_jax.scheduler.requests import (
    TIMINGS,
    GenerateResult,
    Request,
    TokenCallback,
    VerifiedCallback,
    pages_needed,
)
from mtp_jax.sharding import row_shards
from mtp_jax.step import StepConfig


def generate(
    params: dict,
    sc: StepConfig,
    *,
    checked: Sequence[CheckedRequest],
    eos_token_ids: Sequence[int],
    cache_dtype: jnp.dtype,
    max_batch: int = 32,
    on_token: TokenCallback | None = None,
    fused: bool = True,
    per_batch: Callable[[int, StepConfig], StepConfig] | None = None,
    constraints: Constraints | None = None,
    pipelined: bool = True,
    grammar_masks: str = "host",
    stop_checks: Sequence[Callable[[int], bool]] | None = None,
    on_verified: VerifiedCallback | None = None,
) -> GenerateResult:
    """Decode checked requests (:func:`mtp_jax.request.check_request`) to the end with a
    :class:`Scheduler` sized for them (up to K = sc.k drafts per step, 0 = plain): ``max_batch``
    slots at most (a power of two, a multiple of the mesh's row devices), pages for the longest
    request. ``per_batch(batch, sc)`` adjusts the step to the batch size (slots a step computes):
    :func:`mtp_jax.autok.batch_controls`. ``stop_checks[i](token)`` True stops request i (finish
    reason "stop"). The other arguments are the scheduler's."""
    t_start = time.perf_counter()
    n = len(checked)
    batch = math.lcm(next_power_of_two(min(n, max_batch)), row_shards(sc.mesh))  # whole rows per shard
    host_sampling = jax.tree.map(np.asarray, row_sampling(checked))
    if per_batch is not None and sc.k > 0:
        sc = per_batch(batch, sc)
    if sc.k == 0 or not np.minimum(host_sampling.num_speculative_tokens, sc.k).any():
        sc = sc.variant(0, draft=None, tree=None)  # plain decoding: no draft state at all
    if not np.any(host_sampling.temperature > 0):  # every row greedy: smaller programs, same tokens
        sc = dataclasses.replace(sc, greedy=True)
    width = next_power_of_two(max(pages_needed(len(c.prompt), c.params.max_new_tokens, sc) for c in checked))
    sched = Scheduler(
        params,
        sc,
        slots=batch,
        width=width,
        eos_token_ids=eos_token_ids,
        cache_dtype=cache_dtype,
        fused=fused,
        constraints=constraints,
        pipelined=pipelined,
        grammar_masks=grammar_masks,
        on_verified=on_verified if sc.confident else None,  # none: plain decoding, no drafts
    )
    requests = []
    for i, c in enumerate(checked):
        row = jax.tree.map(lambda x, i=i: x[i : i + 1], host_sampling)
        hook = _token_hook(i, on_token, None if stop_checks is None else stop_checks[i])
        requests.append(sched.submit(Request.from_checked(c, i, row, on_token=hook)))
    while sched.advance():
        pass
    t_end = time.perf_counter()
    out = [req.tokens for req in requests]
    timings = [req.timings() for req in requests]
    stats = _run_stats(sched, sc, checked, timings, sum(len(o) for o in out), (t_start, t_end), batch, fused)
    if constraints is not None:  # host time spent in the grammars (masks, advancing the matchers)
        stats["grammar_seconds"] = constraints.seconds
    return GenerateResult(
        tokens=out,
        finish_reasons=[req.finish for req in requests],
        stats=stats,
        request_stats=[{**req.counters.as_dict(), **t} for req, t in zip(requests, timings, strict=True)],
        logprobs=None
        if all(req.logprobs is None for req in requests)
        else [None if req.logprobs is None else req.token_logprobs for req in requests],
    )


def _run_stats(
    sched: Scheduler,
    sc: StepConfig,
    checked: Sequence[CheckedRequest],
    timings: list[dict],
    new_tokens: int,
    span: tuple[float, float],
    batch: int,
    fused: bool,
) -> dict:
    """A :func:`generate` call's statistics: sizes, programs, speculation counters and times, from
    the call's start (``span[0]``) to the first admission and decoding from there to ``span[1]``."""
    t_start, t_end = span
    t_first = sched.first_admitted or t_end
    decode_time = t_end - t_first
    run, spec = sched.counters, sched.counters.as_dict()
    first_step = sched.first_step_seconds
    return {
        "prompts": len(checked),
        "batch": batch,
        "num_speculative_tokens": sc.k,
        "fused": fused,
        "draft": sc.draft,
        "prompt_tokens": sum(len(c.prompt) for c in checked),
        "new_tokens": new_tokens,
        "steps": sched.counts["steps"],
        "step_programs": len(sched.programs),
        "steps_per_width": steps_per_width(sched),
        "step_num_speculative_tokens": sorted({k for k, _ in sched.variants}),
        "prefill_calls": sched.counts["prefills"],
        "acceptance_length": spec.pop("acceptance_length"),
        "first_prefill_seconds": t_first - t_start,
        "decode_seconds": decode_time,
        "tokens_per_second": new_tokens / max(t_end - t_start, 1e-9),
        "decode_tokens_per_second": run.emitted / max(decode_time, 1e-9),
        # the first step call's wall time: its compilation when the step is not compiled yet
        "first_step_call_seconds": first_step,
        "decode_tokens_per_second_after_first_call": run.emitted / max(decode_time - first_step, 1e-9),
        **{f"mean_{key}": _mean(t[key] for t in timings) for key in TIMINGS},
        **{k: v for k, v in spec.items() if k != "steps"},
    }


def _mean(values: Iterable[float | None]) -> float | None:
    """The mean of the values that are not None (None if none is)."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _token_hook(i: int, on_token: TokenCallback | None, stop: Callable[[int], bool] | None):
    """Request i's token hook: the caller's streaming callback, then its stop check."""
    if on_token is None and stop is None:
        return None

    def hook(token: int) -> bool:
        if on_token is not None:
            on_token(i, token)
        return stop is not None and stop(token)

    return hook
