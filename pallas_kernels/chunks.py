"""Attention over a paged cache in chunks of query tokens (long prompts without the kernels)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

QUERY_CHUNK = 64
"""Off the kernels, queries are attended in chunks of this many tokens per row (prefill): a
reference's float32 scores are [B, T, H, keys], which for a long prompt against a long page table
is far more than the cache (2k tokens x 128 heads x 32k keys: 34 GB); per chunk it is T/64 of that.
Decode blocks (K+1 tokens) fit in one chunk and take the reference directly."""


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
