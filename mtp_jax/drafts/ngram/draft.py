"""N-gram prompt lookup: drafts copied from earlier in the row's own text, no weights.

As vLLM's ``ngram``, SGLang's and TensorRT-LLM's prompt lookup: when the text so far ends with n
tokens that occurred before, the tokens that followed that earlier occurrence are proposed. Code
edits, quoting, summaries and structured output repeat their input, so many drafts are accepted
there; elsewhere little is.

Per row, inside the unified step, on device:

* the row's tokens are kept in a paged int32 buffer on the target's page ids (``[P, page]``), written
  as rows are committed (prompt, accepted tokens, and the committed next token);
* the lookup takes the longest suffix length n in ``[MIN_N, MAX_N]`` (3..4) whose last n tokens
  occurred earlier, and of those occurrences the latest; draft j is the token j + 1 after its end. Where the
  occurrence is within K tokens of the present the earlier text runs out: the repetition is
  continued periodically (period = the distance between the occurrence and the present), which is
  exactly what the text would be if it kept repeating;
* without any match the row proposes nothing (its drafts are marked -1 and it verifies no draft);
  a step in which no row has a match verifies one token per row, as plain decoding does, instead
  of K + 1 (:attr:`mtp_jax.drafts.base.Draft.proposes_per_row`).

Drafts are deterministic, so acceptance is lossless in greedy and argmax modes and exact in sampled
mode (q is one-hot at the draft). The history scan reads the row's whole page list once per step
(4 bytes a token): small beside the target's weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from mtp_jax.cache import localize, slots_for
from mtp_jax.drafts.base import Draft, Rows, StepReads, at_rows, fixed_draft_logits, no_drafts
from mtp_jax.sharding import ROW_AXES, shard_index, spec_entry, split_axes

MAX_N = 4
"""Longest suffix matched (as ``prompt_lookup_max`` 4 in vLLM's documented n-gram example)."""
MIN_N = 3
"""Shortest suffix matched. A step that verifies drafts costs about 1.9x a plain step on a CPU
(SmolLM2-135M: any width above one token leaves the matrix-vector kernels), and the tokens after a
one- or two-token suffix are seldom what the target says: replayed over SmolLM2's greedy replies
(edit, chat and code prompts), matching 3..4 tokens instead of 1..4 proposes in ~40% fewer steps
and loses almost no accepted tokens (BENCHMARKS.md, "N-gram: three-token matches")."""


def lookup(
    history: jax.Array,
    n: jax.Array,
    k: int,
    max_n: int | None = None,
    min_n: int | None = None,
    none: int | None = None,
) -> jax.Array:
    """Drafts [b, k] (token ids) for rows whose first ``n`` [b] tokens of ``history`` [b, L] are
    known: the tokens after the latest earlier occurrence of the longest matching suffix of length
    ``min_n..max_n`` (None: :data:`MIN_N` / :data:`MAX_N` when traced; continued periodically past
    the present); without a match, ``none`` (None: the newest token repeated)."""
    max_n = MAX_N if max_n is None else max_n
    min_n = MIN_N if min_n is None else min_n
    b, length = history.shape
    idx = jnp.arange(length, dtype=jnp.int32)[None, :]
    last = n - 1
    match = idx <= (n - 2)[:, None]  # an occurrence ends before the newest token
    best = jnp.full((b,), -1, jnp.int32)
    for r in range(max_n):  # the suffix's r-th token from the end
        want = at_rows(history, jnp.maximum(last - r, 0))
        earlier = jnp.pad(history, ((0, 0), (r, 0)))[:, :length]  # earlier[:, i] = history[:, i - r]
        match = match & (earlier == want[:, None]) & (idx >= r) & (last - r >= 0)[:, None]
        if r + 1 >= min_n:  # longer suffixes come later and win
            latest = jnp.max(jnp.where(match, idx, -1), axis=1)
            best = jnp.where(latest >= 0, latest, best)
    period = jnp.maximum(last - best, 1)
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    pos = jnp.where((best >= 0)[:, None], best[:, None] + 1 + j % period[:, None], last[:, None])
    drafts = jnp.take_along_axis(history, pos, axis=1)
    return drafts if none is None else jnp.where((best >= 0)[:, None], drafts, none)


def _init_state(ctx, num_pages: int, dtype) -> jax.Array:
    """The rows' tokens, paged on the target's page ids: [P, page] int32."""
    return jnp.zeros((num_pages, ctx.page_size), jnp.int32)


def _history(tokens: jax.Array, page_table: jax.Array) -> jax.Array:
    """Each row's tokens in position order [b, W * page]."""
    return tokens[page_table].reshape(page_table.shape[0], -1)


def write_and_look_up(
    tokens, table, slots, next_slots, values, next_values, first_pos, *extra, look, page: int, mesh, rows
):
    """Write the committed tokens (values [b, t] at slots [b, t], next_values [b] at next_slots
    [b]) into the buffer [P, page] and ``look(history [b, W * page], first_pos [b], *extra)`` up (a
    tuple of per-row arrays). With ``rows`` (mesh axes), inside ``shard_map``: this shard's pages
    and rows, global page ids made local."""
    if rows:
        n = tokens.shape[0]
        first = shard_index(mesh, rows) * n
        table, slots = localize(table, slots, first, n, page)
        _, next_slots = localize(table, next_slots, first, n, page)
    flat = tokens.reshape(-1)
    flat = flat.at[slots.reshape(-1)].set(values.reshape(-1), mode="drop")
    flat = flat.at[next_slots].set(next_values, mode="drop")
    tokens = flat.reshape(tokens.shape)
    return look(_history(tokens, table), first_pos, *extra), tokens


def buffer_and_look_up(
    ctx, tokens, page_table, rows: Rows, first_pos, look, outputs: int, by_row=(), shared=()
):
    """Write the committed rows' tokens and the committed next token into the paged buffer
    ``tokens`` [P, page], then ``look(history, first_pos, *by_row, *shared)`` up per row
    (``outputs`` arrays [b, ...]; on a mesh split over rows like the buffer's pages, with the
    ``by_row`` arrays [b, ...] split the same way and the ``shared`` ones whole on every shard).
    Returns (the outputs, the new buffer)."""
    page, b = ctx.page_size, page_table.shape[0]
    slots = slots_for(page_table, rows.positions, rows.valid, page)
    last_pos = at_rows(rows.positions, rows.last) + 1
    next_slots = slots_for(page_table, last_pos[:, None], at_rows(rows.valid, rows.last)[:, None], page)[:, 0]
    args = (
        tokens,
        page_table,
        slots,
        next_slots,
        rows.tokens,
        at_rows(rows.next_tokens, rows.last),
        first_pos,
        *by_row,
        *shared,
    )
    split = () if ctx.mesh is None else split_axes(ctx.mesh, ROW_AXES, b, tokens.shape[0])
    if not split:
        return write_and_look_up(*args, look=look, page=page, mesh=None, rows=())
    r = spec_entry(split)
    rowwise, one = PartitionSpec(r, None), PartitionSpec(r)
    whole = jax.tree.map(lambda _: PartitionSpec(), tuple(shared))
    return jax.shard_map(
        lambda *a: write_and_look_up(*a, look=look, page=page, mesh=ctx.mesh, rows=split),
        mesh=ctx.mesh,
        in_specs=(rowwise, rowwise, rowwise, one, rowwise, one, one, *(one,) * len(by_row), *whole),
        out_specs=((one,) * outputs, rowwise),
    )(*args)


def _extend_and_propose(params, ctx, tokens, page_table, rows: Rows, active, sampling, first_pos):
    """Write the committed rows' tokens and the committed next token, then look the drafts up."""
    b = page_table.shape[0]
    if ctx.k == 0:
        look = lambda history, n: (jnp.zeros((history.shape[0], 0), jnp.int32),)  # noqa: E731
    else:
        look = lambda history, n: (lookup(history, n, ctx.k, none=-1),)  # noqa: E731
    (drafts,), tokens = buffer_and_look_up(ctx, tokens, page_table, rows, first_pos, look, 1)
    if ctx.k == 0:
        return no_drafts(b) + (tokens,)
    if ctx.sampled:  # deterministic drafts: q is one-hot (acceptance min(1, p(d)), exact residual)
        q = jax.nn.one_hot(drafts, ctx.cfg.vocab_size, dtype=jnp.float32)  # unproposed rows: capped at 0
    else:
        q = jnp.zeros((b, ctx.k, 0), jnp.float32)
    return drafts, q, tokens


def _teacher_forced(params, ctx, tokens: jax.Array, hidden) -> jax.Array:
    """[b, T-1, V]: row i proposes token i+2 from tokens 0..i+1 (0 at the draft, -inf elsewhere)."""
    t = tokens.shape[1]
    drafts = jax.vmap(lambda n: lookup(tokens, jnp.full((tokens.shape[0],), n, jnp.int32), 1)[:, 0])(
        jnp.arange(2, t + 1, dtype=jnp.int32)
    )  # [T-1, b]
    return fixed_draft_logits(drafts.T, ctx.cfg.vocab_size)


def token_buffer_reads(
    params, cfg, draft_cfg, k: int, batch: int, positions: int, cache_itemsize: int
) -> StepReads:
    """The rows' token buffers (int32), scanned once (n-gram's and suffix decoding's reads)."""
    return StepReads(kv=float(positions * 4))


DRAFT = Draft(
    name="ngram",
    available=lambda params, cfg: None,
    capture=lambda ctx: (),
    init_state=_init_state,
    state_logical=lambda names, rank: ("pages",) + (None,) * (rank - 1),
    extend_and_propose=_extend_and_propose,
    teacher_forced=_teacher_forced,
    step_reads=token_buffer_reads,
    proposes_per_row=True,
    title="n-gram",
    weights=False,
)
