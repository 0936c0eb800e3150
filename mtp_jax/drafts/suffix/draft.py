"""Suffix decoding as a draft (Snowflake's Arctic Inference; Oliaro et al., arXiv 2411.04975).

Per row, inside the unified step, on the device:

* the row's own text (prompt and output) is kept in a paged int32 buffer, as n-gram's is
  (:func:`mtp_jax.drafts.ngram.draft.buffer_and_look_up`);
* the longest suffix of it (``min_match..max_match`` tokens) that occurred before selects the
  continuations that followed its latest ``occurrences`` occurrences; the engine-wide index of
  finished outputs (:mod:`mtp_jax.drafts.suffix.index`, updated on the host between steps) is looked
  up with the newest ``1..index_match`` tokens under the row's tenant, and its longest matching
  context selects the continuations that followed it in earlier outputs, with their counts;
* each source makes a tree of its continuations' likeliest prefixes
  (:func:`mtp_jax.drafts.suffix.tree.frequency_tree`: empirical probabilities, ``min_prob``, at
  most ``spec_factor`` x the match length + ``spec_offset`` nodes) and the row proposes the one
  whose probabilities sum to more (the expected number of accepted tokens), as the paper does.

With a dynamic ``speculative_tree`` (``{"depth", "topk", "nodes", "dynamic": True}``) the tree is
verified whole (at most ``topk`` children a node); without one the row proposes the tree's likeliest
path as a chain of K (a tree of width 1), and no proposal where there is no match (-1: a step in
which no row has one verifies one token per row). Drafts are fixed candidates, so acceptance is
lossless in greedy mode and exact for sampled rows (one-hot laws).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from mtp_jax.drafts.base import Draft, Rows, TreeDrafts, at_rows, fixed_draft_logits, no_drafts
from mtp_jax.drafts.ngram.draft import buffer_and_look_up, token_buffer_reads
from mtp_jax.drafts.suffix.config import OPTIONS, SuffixConfig, suffix_config
from mtp_jax.drafts.suffix.index import INDEX_DEPTH, Learner, empty_index
from mtp_jax.drafts.suffix.tree import budget, context_keys, continuations, frequency_tree, latest_occurrences
from mtp_jax.errors import InvalidRequestError

SOURCES = ("text", "index")
"""Where a row's suffix proposal came from: its own prompt and output, or the engine-wide index of
earlier requests' outputs (:attr:`mtp_jax.drafts.Draft.sources`)."""


def _config(ctx) -> SuffixConfig:
    return ctx.draft_cfg if isinstance(ctx.draft_cfg, SuffixConfig) else SuffixConfig()


def _init_state(ctx, num_pages: int, dtype) -> dict:
    """The rows' tokens, paged on the target's page ids ([P, page] int32), and the engine-wide
    index of finished outputs (:func:`mtp_jax.drafts.suffix.index.empty_index`)."""
    return {"tokens": jnp.zeros((num_pages, ctx.page_size), jnp.int32), "index": empty_index(_config(ctx))}


def _state_logical(names: list[str], rank: int) -> tuple[str | None, ...]:
    if names[:1] == ["tokens"]:
        return ("pages",) + (None,) * (rank - 1)
    return (None,) * rank  # the index: whole on every device


def _shape(ctx) -> tuple[int, int, int]:
    """(nodes, children per node, depth) of what a row proposes."""
    if ctx.tree is None:
        return ctx.k, 1, ctx.k
    if not ctx.tree.dynamic:
        raise InvalidRequestError(
            "the suffix draft chooses each row's tree from its matches: give speculative_tree "
            "{'depth': d, 'topk': k, 'nodes': n, 'dynamic': True}, or no tree for a chain"
        )
    return ctx.tree.nodes, ctx.tree.topk, ctx.tree.depth


def index_match(index: dict, recent: jax.Array, tenant: jax.Array, cfg: SuffixConfig):
    """(slot [b], m [b]): the index entry of each row's longest context of ``min_match..index_match``
    tokens (``recent`` [b, index_match], newest first) stored for its ``tenant`` [b], compared token
    by token (a hash collision never proposes another context's, or another tenant's, text); m = 0
    where none is stored."""
    depth = cfg.index_match
    keys = context_keys(recent, tenant, depth)  # [b, depth]
    slots = (keys & jnp.uint32(cfg.index_slots - 1)).astype(jnp.int32)
    stored = index["context"][slots]  # [b, depth, depth]
    j = jnp.arange(depth)
    agree = jnp.all((stored == recent[:, None, :]) | (j[None, None, :] > j[None, :, None]), axis=2)
    hit = agree & (index["length"][slots] == j + 1) & (index["tenant"][slots] == tenant[:, None])
    hit &= j[None, :] + 1 >= cfg.min_match
    m = jnp.max(jnp.where(hit, j + 1, 0), axis=1)
    slot = at_rows(slots, jnp.maximum(m - 1, 0))
    return slot, m


def propose_rows(history, n, tenant, index, cfg: SuffixConfig, nodes: int, width: int, depth: int):
    """Each row's proposal from its own text ``history`` [b, L] (first ``n`` [b] known) and, with
    the index on, the engine-wide ``index``: (tokens [b, nodes], -1 where none; parent [b, nodes];
    score [b]: the chosen tree's, the expected number of its tokens accepted; source [b]: 0 its
    own text, 1 the index, -1 no proposal, as :data:`SOURCES` names them)."""
    ends, m = latest_occurrences(history, n, cfg.max_match, cfg.min_match, cfg.occurrences)
    cont = continuations(history, ends, n, depth)
    own = budget(m, cfg.spec_factor, cfg.spec_offset, nodes)
    tokens, parent, score = frequency_tree(
        cont, (ends >= 0).astype(jnp.float32), nodes, width, own, cfg.min_prob
    )
    if not cfg.indexed:
        return tokens, parent, score, jnp.where(tokens[:, 0] >= 0, 0, -1)
    b, length = history.shape
    back = (n - 1)[:, None] - jnp.arange(cfg.index_match)[None, :]
    recent = jnp.where(back >= 0, jnp.take_along_axis(history, jnp.clip(back, 0, length - 1), axis=1), -2)
    slot, mg = index_match(index, recent, tenant, cfg)
    g_cont = index["continuation"][slot][:, :, : min(depth, INDEX_DEPTH)]
    if depth > INDEX_DEPTH:
        g_cont = jnp.pad(g_cont, ((0, 0), (0, 0), (0, depth - INDEX_DEPTH)), constant_values=-1)
    g_weight = jnp.where((mg > 0)[:, None], index["count"][slot], 0.0)
    g_budget = budget(mg, cfg.spec_factor, cfg.spec_offset, nodes)
    g_tokens, g_parent, g_score = frequency_tree(g_cont, g_weight, nodes, width, g_budget, cfg.min_prob)
    pick = (g_score > score) & (g_tokens[:, 0] >= 0)
    tokens = jnp.where(pick[:, None], g_tokens, tokens)
    parent = jnp.where(pick[:, None], g_parent, parent)
    source = jnp.where(tokens[:, 0] >= 0, pick.astype(jnp.int32), -1)  # 1: the index, 0: its text
    return tokens, parent, jnp.where(pick, g_score, score), source


def look_up(ctx, cfg: SuffixConfig, state: dict, page_table, rows: Rows, first_pos, tenant):
    """Write the committed tokens into the rows' buffer (``state["tokens"]``), then look each row's
    proposal up in its text and the index (``state["index"]``). Returns ((tokens [b, nodes], -1
    past the row's own; parent [b, nodes]; score [b]; source [b], -1 where the row has no
    proposal), the new buffer). The step puts the row's newest token in a -1 node's place (a tree
    is verified whole) and counts only the nodes before it."""
    nodes, width, depth = _shape(ctx) if ctx.k else (0, 1, 0)

    def look(history, n, tenant, index):
        b = history.shape[0]
        if ctx.k == 0:
            empty = jnp.zeros((b, 0), jnp.int32)
            return empty, empty, jnp.zeros((b,)), jnp.full((b,), -1, jnp.int32)
        return propose_rows(history, n, tenant, index, cfg, nodes, width, depth)

    return buffer_and_look_up(
        ctx, state["tokens"], page_table, rows, first_pos, look, 4, by_row=(tenant,), shared=(state["index"],)
    )


def tree_drafts(tokens: jax.Array, parent: jax.Array) -> TreeDrafts:
    """A proposal of ``tokens`` [b, nodes] whose ``parent`` [b, nodes] counts from the root (0)."""
    root = jnp.full((tokens.shape[0], 1), -1, jnp.int32)
    return TreeDrafts(tokens, jnp.concatenate([root, parent], axis=1))


def _extend_and_propose(params, ctx, state, page_table, rows: Rows, active, sampling, first_pos):
    """Write the committed tokens into the row's buffer, then propose from its text and the index."""
    b = page_table.shape[0]
    (tokens, parent, _, source), buffer = look_up(
        ctx, _config(ctx), state, page_table, rows, first_pos, sampling.tenant
    )
    state = {**state, "tokens": buffer}
    if ctx.k == 0:
        return no_drafts(b) + (state, source)
    if ctx.tree is not None:
        return tree_drafts(tokens, parent), jnp.zeros((b, tokens.shape[1], 0)), state, source
    if ctx.sampled:  # fixed drafts: q is one-hot (acceptance min(1, p(d)), exact residual)
        return tokens, jax.nn.one_hot(tokens, ctx.cfg.vocab_size, dtype=jnp.float32), state, source
    return tokens, jnp.zeros((b, ctx.k, 0), jnp.float32), state, source


def _teacher_forced(params, ctx, tokens: jax.Array, hidden) -> jax.Array:
    """[b, T-1, V]: row i proposes token i+2 from tokens 0..i+1 and its own text alone (0 at the
    draft, -inf elsewhere)."""
    cfg, (b, t) = dataclasses.replace(_config(ctx), index_slots=0), tokens.shape

    def first(n):
        known = jnp.full((b,), n, jnp.int32)
        return propose_rows(tokens, known, jnp.zeros((b,), jnp.int32), {}, cfg, 1, 1, 1)[0][:, 0]

    drafts = jax.vmap(first)(jnp.arange(2, t + 1, dtype=jnp.int32))  # [T-1, b]
    return fixed_draft_logits(drafts.T, ctx.cfg.vocab_size)


def _configure(draft_cfg: Any, k: int | None, options: Mapping[str, Any]) -> tuple[SuffixConfig, int | None]:
    return suffix_config(options), k


DRAFT = Draft(
    name="suffix",
    available=lambda params, cfg: None,
    capture=lambda ctx: (),
    init_state=_init_state,
    state_logical=_state_logical,
    extend_and_propose=_extend_and_propose,
    teacher_forced=_teacher_forced,
    step_reads=token_buffer_reads,
    proposes_per_row=True,
    sources=SOURCES,
    verify_widths=lambda cfg, k: getattr(cfg, "widths", ()),
    title="suffix decoding",
    weights=False,
    trees=True,
    configure=_configure,
    options=OPTIONS,
    default_k=4,
    learner=lambda draft_cfg: (
        Learner(draft_cfg) if isinstance(draft_cfg, SuffixConfig) and draft_cfg.indexed else None
    ),
)
