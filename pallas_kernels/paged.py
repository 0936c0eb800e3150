"""Attention over a paged cache without the kernels: each row's pages gathered, and queries in
chunks of tokens (long prompts)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

LIVE_KEYS = 256
"""Off the kernels, a row's keys are read through the page table's first w pages only, w the
narrowest of N, N/2, N/4 ... (not under this many keys) that holds every key a query of the call
sees: a server's page table spans ``max_len`` tokens however short its requests are. Halving (not
quartering) keeps the keys read within twice those needed: at 16 rows of 600 tokens in a
2,048-token table a SmolLM2 step reads 1,024 keys a row, not 2,048 (690 ms a step before)."""

QUERY_CHUNK = 64
"""Off the kernels, queries are attended in chunks of this many tokens per row (prefill): a
reference's float32 scores are [B, T, H, keys], which for a long prompt against a long page table
is far more than the cache (2k tokens x 128 heads x 32k keys: 34 GB); per chunk it is T/64 of that.
Decode blocks (K+1 tokens) fit in one chunk and take the reference directly."""


def gather_pages(
    pages: jax.Array, table: jax.Array, layer: jax.Array | int | None = None, by_head: bool = False
) -> jax.Array:
    """``pages[table]`` (pages [P, S, ...], table [B, N] -> [B, N, S, ...]), or
    ``pages[layer, table]`` for a stack [L, P, S, ...]. 16-bit caches are gathered as their bit
    patterns: XLA:CPU has no bfloat16 gather and would otherwise convert the whole pool, every
    layer's pages of every slot, to float32 on each read (at 8 slots x 4096 tokens of the tiny
    model, 21.7 ms of a step against 0.3 ms). Indices must be in range.

    ``by_head``: pages [P, S, H, d] gathered head-major, [B, H, N * S, d], each head's keys
    contiguous: the layout of a batched matrix product over (row, head), so an attention's products
    need not transpose the gathered blocks (on a CPU that copying, not the arithmetic, was most of
    the attention's time)."""
    bits = pages.dtype.itemsize == 2
    src = jax.lax.bitcast_convert_type(pages, jnp.uint16) if bits else pages
    index = (table,)
    if by_head:
        index = (table[:, None, :], slice(None), jnp.arange(src.shape[-2])[None, :, None])
    out = src[index] if layer is None else src[(layer, *index)]
    if by_head:
        b, h, n, s, d = out.shape  # the advanced indices' dimensions [B, H, N] come first
        out = out.reshape(b, h, n * s, d)
    return jax.lax.bitcast_convert_type(out, pages.dtype) if bits else out


def visible_keys(
    key_pos: jax.Array,
    positions: jax.Array,
    tree: tuple[jax.Array, jax.Array] | None = None,
    window: tuple[jax.Array, jax.Array | None] | None = None,
):
    """[B, T, S] bool: which keys at cache positions ``key_pos`` [S] each query at ``positions``
    [B, T] sees: those at or before its own position, and, with ``tree`` = (base [B], nodes
    [B, T, N]) (a token tree's nodes at cache positions base .. base + N - 1), of those positions
    only the ones ``nodes`` marks (the query's own node and its ancestors: tree attention).

    ``window`` = (size, query positions [B, T] or None): sliding-window attention (Gemma's local
    layers), a query at sequence position p sees only keys at p - size + 1 .. p (``size`` keys,
    itself included; a scalar, data, so one program serves local and global layers: a global
    layer passes a size past any position). The query positions default to ``positions``; with a
    tree they are the nodes' sequence (rotary) positions, and the tree's own nodes are its
    ancestors, inside the window whenever ``size`` exceeds the tree's depth (the caller checks)."""
    visible = key_pos[None, None, :] <= positions[:, :, None]
    inside = None
    if tree is not None:
        base, nodes = tree
        count = nodes.shape[-1]
        rel = key_pos[None, :] - base[:, None]  # [B, S]
        inside = (rel >= 0) & (rel < count)
        index = jnp.broadcast_to(jnp.clip(rel, 0, count - 1)[:, None, :], visible.shape)
        seen = jnp.take_along_axis(nodes, index, axis=2)
        visible = visible & (~inside[:, None, :] | seen)
    if window is not None:
        size, query = window
        query = positions if query is None else query
        near = key_pos[None, None, :] > query[:, :, None] - size
        if inside is not None:
            near = near | inside[:, None, :]
        visible = visible & near
    return visible


def check_tree(tree: tuple[jax.Array, jax.Array] | None, q: jax.Array, chunk: int) -> None:
    """ValueError unless a tree mask fits the queries q [B, T, ...] in one chunk of queries."""
    if tree is None:
        return
    base, nodes = tree
    b, t = q.shape[:2]
    if base.shape != (b,) or nodes.shape[:2] != (b, t):
        raise ValueError(
            f"a tree mask must be base [B={b}] and nodes [B, T={t}, N], got {base.shape}, {nodes.shape}"
        )
    if t > chunk:
        raise ValueError(f"tree attention takes at most {chunk} query tokens per row, got {t}")


def over_live_pages(
    attend: Callable[[jax.Array], jax.Array], page_table: jax.Array, positions: jax.Array, page_size: int
) -> jax.Array:
    """``attend(table)`` with ``table`` the narrowest prefix ``page_table[:, :w]`` (w from N pages
    down by halves, not under :data:`LIVE_KEYS` keys) whose pages hold position
    ``max(positions)``, picked on device (one ``lax.switch`` branch per width, compiled once).
    Exact when ``attend`` ignores keys past each query's position: the keys left out are ones no
    query sees."""
    widths = [page_table.shape[1]]
    while widths[-1] // 2 * page_size >= LIVE_KEYS:
        widths.append(widths[-1] // 2)
    if len(widths) == 1:
        return attend(page_table)
    widths.reverse()  # narrowest first
    needed = jnp.max(positions) // page_size + 1  # pages up to the furthest key any query sees
    index = jnp.sum(jnp.asarray(widths[:-1], needed.dtype) < needed)
    branches = [lambda w=w: attend(page_table[:, :w]) for w in widths]
    return jax.lax.switch(index, branches)


def in_query_chunks(
    attend: Callable[[jax.Array, jax.Array], jax.Array],
    q: jax.Array,
    positions: jax.Array,
    chunk: int = QUERY_CHUNK,
) -> jax.Array:
    """``attend(q, positions)`` for q [B, T, H, C] and positions [B, T] -> [B, T, H, V], applied to
    successive chunks of ``chunk`` query tokens (one ``lax.map`` step each); every query is computed
    exactly as in one call. Padding queries get position -1 (they see nothing) and are cut off."""
    batch, tokens, heads = q.shape[:3]
    if tokens <= chunk:
        return attend(q, positions)
    n = -(-tokens // chunk)
    pad = n * chunk - tokens
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    positions = jnp.pad(positions, ((0, 0), (0, pad)), constant_values=-1)
    qs = jnp.moveaxis(q.reshape(batch, n, chunk, heads, -1), 1, 0)
    ps = jnp.moveaxis(positions.reshape(batch, n, chunk), 1, 0)
    out = jnp.moveaxis(jax.lax.map(lambda a: attend(*a), (qs, ps)), 0, 1)  # [B, n, chunk, H, V]
    return out.reshape(batch, n * chunk, heads, out.shape[-1])[:, :tokens]


def attend_paged(
    reference: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
    q: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
    page_size: int,
    chunk: int = QUERY_CHUNK,
) -> jax.Array:
    """``reference(q, table, positions)`` for q [B, T, H, C] in chunks of ``chunk`` queries
    (:func:`in_query_chunks`), each over the pages its queries can see (:func:`over_live_pages`)."""

    def attend(q: jax.Array, positions: jax.Array) -> jax.Array:
        return over_live_pages(lambda table: reference(q, table, positions), page_table, positions, page_size)

    return in_query_chunks(attend, q, positions, chunk)
