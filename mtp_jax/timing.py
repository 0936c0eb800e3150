"""Timing the step: calls dispatched back to back as a decode loop does, the state a timed step
starts from, and the steps/s of the confidence-scheduled step at each width
(:class:`mtp_jax.schedule.SpsTable`). Below :mod:`mtp_jax.roofline` (which also counts bytes) so
that ``generate`` can measure speeds without the tools above it."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def timed_back_to_back(fns: Sequence[Callable[[], Any]], iters: int, rounds: int = 5) -> float:
    """Median over ``rounds`` of the seconds per call when ``iters`` calls are dispatched back to back
    (cycling through ``fns``, e.g. the same operation on different input copies) and waited for once:
    the device's time per call with the host's dispatch gaps hidden, as in a decode loop. Each
    function is called twice untimed first (compile, warm-up)."""
    for fn in fns:
        jax.block_until_ready(fn())
        jax.block_until_ready(fn())
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        outs = [fns[i % len(fns)]() for i in range(iters)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def sps_table(
    params: dict,
    cfg: Any,
    *,
    k: int,
    batches: Sequence[int],
    context: int,
    page_size: int,
    dtype: Any,
    iters: int,
    draft: str,
    draft_cfg: Any = None,
    progress: Callable[[str], None] | None = None,
):
    """The :class:`mtp_jax.schedule.SpsTable` of the confidence-scheduled step of this model and
    draft: for each batch size, steps/s of the very program that schedules (one compile per batch)
    run at each width 1..K+1 in turn (``step(width=...)``), and of plain decoding's step, ``batch``
    active rows at committed length ``context``, dispatched back to back
    (:func:`timed_back_to_back`: the median of ``iters`` calls a round)."""
    from mtp_jax.schedule import SpsTable
    from mtp_jax.step import StepConfig, step

    sc = StepConfig(cfg, page_size, k, draft, draft_cfg=draft_cfg, schedule=(1.0,) * (k + 1))
    tables, plain = {}, {}
    for batch in batches:
        state = _timed_state(sc, batch, context, dtype, None)
        compiled = step.lower(params, state, sc, width=jnp.int32(1)).compile()
        tables[batch] = _width_speeds(compiled, params, state, k, context, iters, progress)
        plain[batch] = _plain_speed(
            params, StepConfig(cfg, page_size), batch, context, dtype, iters, progress
        )
    meta = {"context": context, "iters": iters, "draft": draft, "backend": jax.default_backend()}
    return SpsTable(k, tables, meta, plain)


def _plain_speed(params, sc, batch: int, context: int, dtype, iters: int, progress) -> float:
    """Steps/s of plain decoding's step (``sc``: K = 0) at ``batch`` rows of ``context`` tokens."""
    from mtp_jax.step import step

    holder = [_timed_state(sc, batch, context, dtype, None)]
    length = jnp.full((batch,), context, jnp.int32)

    def one() -> jax.Array:
        s = timed_call_state(holder[0], seq_len=length + 0, num_drafts=length * 0)
        _, n_emit, holder[0], _ = step(params, s, sc)
        return n_emit

    seconds = timed_back_to_back([one], iters, rounds=3)
    if progress is not None:
        progress(f"SPS: batch {batch}, plain decoding: {1e3 * seconds:.2f} ms a step")
    return 1.0 / seconds


def _width_speeds(compiled, params, state, k: int, context: int, iters: int, progress) -> tuple[float, ...]:
    """Steps/s of a compiled scheduling step forced to each width 1..k+1 in turn."""
    holder, batch, speeds = [state], state.seq_len.shape[0], []
    for w in range(1, k + 2):
        forced = jnp.int32(w)
        length, count = jnp.full((batch,), context, jnp.int32), jnp.full((batch,), k, jnp.int32)

        def one(forced=forced, length=length, count=count) -> jax.Array:
            s = timed_call_state(holder[0], seq_len=length + 0, num_drafts=count + 0)
            _, n_emit, holder[0], _ = compiled(params, s, width=forced)
            return n_emit

        seconds = timed_back_to_back([one], iters, rounds=3)
        speeds.append(1.0 / seconds)
        if progress is not None:
            progress(f"SPS: batch {batch}, width {w}: {1e3 * seconds:.2f} ms a step")
    return tuple(speeds)


def _timed_state(sc: Any, batch: int, context: int, dtype: Any, lora_slots: Any) -> Any:
    """The state :func:`time_step` starts from: ``batch`` active rows with pages for ``context``
    tokens and the step's K + 1 more, random next tokens and drafts, the rows' LoRA slots."""
    from mtp_jax.step import init_state
    from mtp_jax.tree import TokenTree

    k, page_size = sc.k, sc.page_size
    width = -(-(context + 2 * (sc.overshoot + 1)) // page_size)  # the step writes up to K+1 rows past context
    state = init_state(sc, batch, batch * width, width, dtype)
    rng = np.random.default_rng(0)
    ids = rng.integers(2, sc.cfg.vocab_size, (batch, k + 1)).astype(np.int32)
    state = dataclasses.replace(
        state,
        page_table=jnp.arange(batch * width, dtype=jnp.int32).reshape(batch, width),
        next_token=jnp.asarray(ids[:, 0]),
        drafts=jnp.asarray(ids[:, 1:]),
        active=jnp.ones((batch,), bool),
    )
    if state.tree_parent.shape[1]:  # a dynamic tree: the static tree of its budget in every row
        shape = TokenTree.build(sc.tree.depth, sc.tree.topk, sc.tree.nodes)
        parent = jnp.broadcast_to(jnp.asarray(shape.parent, jnp.int32), state.tree_parent.shape)
        state = dataclasses.replace(state, tree_parent=parent)
    if lora_slots is not None:
        slots = jnp.asarray(lora_slots, jnp.int32)
        state = dataclasses.replace(state, sampling=dataclasses.replace(state.sampling, lora_slot=slots))
    return state


def timed_call_state(state: Any, *, seq_len: jax.Array, num_drafts: jax.Array) -> Any:
    """The state a timed step starts from: the previous call's, its committed length reset to
    ``seq_len`` [b] and every row holding ``num_drafts`` [b] (K) drafts to verify. Without the
    second, a draft that proposes per row (:attr:`mtp_jax.drafts.base.Draft.proposes_per_row`:
    the n-gram lookup, which proposes nothing where the text so far has no match, as with random
    weights and an empty history) would leave every timed step on the branch that verifies one
    token per row, timing plain decoding under the draft's name. So the step is timed as one whose
    drafts were proposed (verifying K + 1 tokens, the lookup included); ``bench_step.py`` times the
    step without a match beside it (``no_match_step_ms``: one token per row, plus the lookup)."""
    return dataclasses.replace(state, seq_len=seq_len, num_drafts=num_drafts)
