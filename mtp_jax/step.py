"""Jitted entry points over (params, cache): prefill and the plain decode step.

Shapes are static per call site: the batch B, the prompt bucket T and the page-table width are
fixed for a whole generation, so decoding compiles once and each step reuses the executable. The
pages are donated, so XLA updates the cache in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mtp_jax.cache import slots_for
from mtp_jax.config import DeepseekV3Config
from mtp_jax.models.deepseek_v3 import PagedAttention, forward, lm_head
from mtp_jax.sampling import SamplingParams, sample


def _paged_forward(params, pages, cfg, page_size, tokens, positions, valid, page_table):
    """Write tokens [b, t] at positions [b, t] (only where valid) and run the model over the cache."""
    paged = PagedAttention(pages, slots_for(page_table, positions, valid, page_size), page_table)
    return forward(params, cfg, tokens, positions, paged)


@functools.partial(jax.jit, static_argnames=("cfg", "page_size"), donate_argnames=("pages",))
def prefill(
    params: dict,
    pages: dict[str, jax.Array],
    cfg: DeepseekV3Config,
    page_size: int,
    tokens: jax.Array,
    lengths: jax.Array,
    page_table: jax.Array,
    sampling: SamplingParams,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Fill the cache with right-padded prompts tokens [B, T] of ``lengths`` [B].

    Returns (first new token [B], its logits [B, V] float32, pages).
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    hidden, pages = _paged_forward(
        params, pages, cfg, page_size, tokens, positions, positions < lengths[:, None], page_table
    )
    last = jnp.take_along_axis(hidden.post_norm, (lengths - 1)[:, None, None], axis=1)[:, 0]
    logits = lm_head(params, last)
    return sample(logits, sampling, lengths), logits, pages


@functools.partial(jax.jit, static_argnames=("cfg", "page_size"), donate_argnames=("pages",))
def decode_step(
    params: dict,
    pages: dict[str, jax.Array],
    cfg: DeepseekV3Config,
    page_size: int,
    tokens: jax.Array,
    seq_lens: jax.Array,
    page_table: jax.Array,
    sampling: SamplingParams,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """One token per row: write ``tokens`` [B] at position ``seq_lens`` [B], sample the next.

    Returns (next token [B], logits [B, V] float32 of the written position, pages).
    """
    positions = seq_lens[:, None]
    valid = jnp.ones_like(positions, dtype=bool)
    hidden, pages = _paged_forward(
        params, pages, cfg, page_size, tokens[:, None], positions, valid, page_table
    )
    logits = lm_head(params, hidden.post_norm[:, 0])
    return sample(logits, sampling, seq_lens + 1), logits, pages
