"""Pure-jnp reference for MLA decode attention over a paged latent cache.

The absorbed form of :func:`mtp_jax.targets.deepseek_v3.mla.mla_paged` with the projections taken out:
queries are
already in latent space, keys are the cache rows, values are their first ``value_dim`` channels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged import gather_pages, visible_keys


def mla_decode_reference(
    q: jax.Array,
    pages: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
    *,
    scale: float,
    value_dim: int,
    layer: jax.Array | int | None = None,
    tree: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Attention of K+1 query tokens per row against that row's paged cache.

    Args:
      q: [B, T, H, C] absorbed queries (C = kv_lora + rope), bfloat16 or float32.
      pages: [P, S, C] the latent cache; the key at absolute position s of row b is
        ``pages[page_table[b, s // S], s % S]``. Or a stack [L, P, S, C] of layers' caches, of
        which layer ``layer`` is read.
      page_table: [B, N] int32 page ids of each row in position order.
      positions: [B, T] int32 absolute position of each query; query (b, t) sees the keys at
        positions ``s <= positions[b, t]`` (the block's own tokens are already in the cache, so
        this is causal inside the block). A query with a negative position sees nothing.
      scale: softmax scale applied to q·k.
      value_dim: values are ``key[..., :value_dim]`` (the latent part, without the rope key).
      layer: which layer of a stacked ``pages`` to read (a traced scalar is fine); None for [P, S, C].
      tree: (base [B], nodes [B, T, N]): of a token tree's node positions base .. base + N - 1,
        each query sees only those ``nodes`` marks (tree attention,
        :func:`pallas_kernels.paged.visible_keys`); None: causal.

    Returns:
      [B, T, H, value_dim] in q.dtype; zeros for queries that see no key. Scores and softmax in
      float32, probabilities cast to q.dtype for the value product, accumulated in float32.
    """
    num_pages, page_size, _ = pages.shape[-3:]
    f32 = jnp.float32
    # Entries past a row's last needed page may be garbage: clamp so the gather stays in bounds,
    # and the mask below keeps those keys (and anything non-finite in them) out of the result.
    table = jnp.clip(page_table, 0, num_pages - 1)
    seq = gather_pages(pages, table, None if pages.ndim == 3 else layer).astype(q.dtype)
    keys = seq.reshape(seq.shape[0], -1, seq.shape[-1])  # [B, N·S, C]
    key_pos = jnp.arange(keys.shape[1], dtype=positions.dtype)
    visible = visible_keys(key_pos, positions, tree)  # [B, T, N·S]
    keys = jnp.where(jnp.any(visible, axis=1)[..., None], keys, 0)
    scores = jnp.einsum("bthc,bsc->bths", q, keys, preferred_element_type=f32) * scale
    scores = jnp.where(visible[:, :, None, :], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    probs = (p / jnp.where(denom > 0, denom, 1.0)).astype(q.dtype)
    out = jnp.einsum("bths,bsv->bthv", probs, keys[..., :value_dim], preferred_element_type=f32)
    return out.astype(q.dtype)
