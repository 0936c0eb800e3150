"""Suffix decoding's device side: matching the text's latest suffix, and the speculation tree of a
set of continuations scored by their empirical probabilities (the paper's greedy tree, computed
for all rows at once inside the step).

A node is a prefix of one or more continuations; its score is the weight of the continuations
through it over the weight of all of them (each occurrence in the row's own text weighs 1; an
entry of the engine-wide index weighs how often its continuation followed the context). The tree
is the ``nodes`` best-scoring prefixes with at most ``width`` children per node, none under
``min_prob``, at most ``budget`` per row; a node's parent scores at least as much and sits in an
earlier level, so it is always chosen before it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.drafts.base import at_rows

HASH_PRIME = np.uint32(16777619)
HASH_BASIS = np.uint32(2166136261)
TENANT_MIX = np.uint32(0x9E3779B1)


def latest_occurrences(history: jax.Array, n: jax.Array, max_m: int, min_m: int, count: int):
    """(ends [b, count]: where the latest earlier occurrences of the longest suffix of length
    ``min_m..max_m`` that occurred before end, newest first, -1 past the last; m [b]: its length,
    0 without a match) for rows whose first ``n`` [b] tokens of ``history`` [b, L] are known."""
    b, length = history.shape
    idx = jnp.arange(length, dtype=jnp.int32)[None, :]
    last = n - 1
    match = idx <= (n - 2)[:, None]  # an occurrence ends before the newest token
    best = jnp.zeros((b, length), bool)
    m = jnp.zeros((b,), jnp.int32)
    for r in range(max_m):  # the suffix's r-th token from the end
        want = at_rows(history, jnp.maximum(last - r, 0))
        earlier = jnp.pad(history, ((0, 0), (r, 0)))[:, :length]  # earlier[:, i] = history[:, i - r]
        match = match & (earlier == want[:, None]) & (idx >= r) & (last - r >= 0)[:, None]
        if r + 1 >= min_m:  # a longer match replaces a shorter one
            hit = jnp.any(match, axis=1)
            best = jnp.where(hit[:, None], match, best)
            m = jnp.where(hit, r + 1, m)
    ends = jax.lax.top_k(jnp.where(best, idx, -1), min(count, length))[0]
    return ends, m


def continuations(history: jax.Array, ends: jax.Array, n: jax.Array, depth: int) -> jax.Array:
    """[b, P, depth]: the tokens after each occurrence ending at ``ends`` [b, P] (-1 for none).
    Where the text runs out (an occurrence within ``depth`` tokens of the present) it is continued
    periodically, which is what the text would be if it kept repeating."""
    b, length = history.shape
    period = jnp.maximum((n - 1)[:, None] - ends, 1)
    pos = ends[..., None] + 1 + jnp.arange(depth, dtype=jnp.int32) % period[..., None]
    tokens = jnp.take_along_axis(history, jnp.clip(pos, 0, length - 1).reshape(b, -1), axis=1)
    return jnp.where(ends[..., None] >= 0, tokens.reshape(pos.shape), -1)


def frequency_tree(
    cont: jax.Array, weight: jax.Array, nodes: int, width: int, budget: jax.Array, min_prob: float
):
    """The speculation tree of continuations ``cont`` [b, P, D] (-1: none) of weights ``weight``
    [b, P] (0: none): (tokens [b, nodes], -1 where a row has fewer; parent [b, nodes], 0 the root,
    i the i-th node (1-based), every node after its parent; score [b], the sum of the nodes'
    probabilities: the expected number accepted of a draft that follows them). ``budget`` [b]:
    the most nodes a row proposes."""
    b, p, d = cont.shape
    own = jnp.arange(p, dtype=jnp.int32)
    ok = jnp.cumprod((cont >= 0) & (weight > 0)[..., None], axis=2).astype(bool)
    equal = (cont[:, :, None, :] == cont[:, None, :, :]) & ok[:, :, None, :] & ok[:, None, :, :]
    same = jnp.cumprod(equal, axis=3).astype(bool)  # [b, p, q, d]: p and q share d + 1 tokens
    count = jnp.sum(jnp.where(same, weight[:, None, :, None], 0.0), axis=2)  # [b, p, d]
    total = jnp.maximum(jnp.sum(jnp.maximum(weight, 0.0), axis=1), 1e-30)
    prob = count / total[:, None, None]
    first = jnp.argmax(same, axis=2).astype(jnp.int32)  # the first continuation through the node
    rep = ok & (first == own[None, :, None])
    up = jnp.concatenate([jnp.full((b, p, 1), -1, jnp.int32), first[:, :, :-1]], axis=2)
    sibling = rep[:, None, :, :] & (up[:, None, :, :] == up[:, :, None, :])  # [b, p, q, d]
    q_prob, p_prob = prob[:, None, :, :], prob[:, :, None, :]
    earlier = (own[None, None, :, None] < own[None, :, None, None]) & (q_prob == p_prob)
    rank = jnp.sum(sibling & ((q_prob > p_prob) | earlier), axis=2)
    keep = rep & (rank < width) & (prob >= min_prob)
    for level in range(1, d):  # a node whose parent is not kept is not kept
        kept = jnp.take_along_axis(keep[:, :, level - 1], jnp.maximum(up[:, :, level], 0), axis=1)
        keep = keep.at[:, :, level].set(keep[:, :, level] & kept)
    score = jnp.where(keep, prob, -1.0).transpose(0, 2, 1).reshape(b, d * p)  # level by level
    top, chosen = jax.lax.top_k(score, min(nodes, d * p))  # equal scores: the shallower first
    if nodes > d * p:
        top = jnp.pad(top, ((0, 0), (0, nodes - d * p)), constant_values=-1.0)
        chosen = jnp.pad(chosen, ((0, 0), (0, nodes - d * p)))
    alive = (top >= 0) & (jnp.arange(nodes)[None, :] < budget[:, None])
    level, occ = chosen // p, chosen % p
    rows = jnp.arange(b)[:, None]
    tokens = cont[rows, occ, level]
    parent_id = jnp.where(level > 0, (level - 1) * p + up[rows, occ, level], -1)
    found = chosen[:, None, :] == parent_id[:, :, None]  # [b, node, node]
    parent = jnp.where(level > 0, 1 + jnp.argmax(found, axis=2), 0).astype(jnp.int32)
    tokens = jnp.where(alive, tokens, -1)
    parent = jnp.where(alive, parent, 0)
    return tokens, parent, jnp.sum(jnp.where(alive, top, 0.0), axis=1)


def budget(m: jax.Array, factor: float, offset: float, nodes: int) -> jax.Array:
    """The most nodes a row whose match is ``m`` [b] tokens long proposes: factor x m + offset,
    at most ``nodes``; none without a match."""
    most = jnp.floor(factor * m.astype(jnp.float32) + offset).astype(jnp.int32)
    return jnp.where(m > 0, jnp.clip(most, 0, nodes), 0)


def context_keys(recent: jax.Array, tenant: jax.Array, depth: int) -> jax.Array:
    """[b, depth] uint32 hash keys of each row's newest 1..depth tokens (``recent`` [b, depth],
    newest first) under its ``tenant`` [b]: :func:`host_keys`'s, on the device."""
    h = jnp.full(tenant.shape, HASH_BASIS, jnp.uint32) ^ (tenant.astype(jnp.uint32) * TENANT_MIX)
    keys = []
    for j in range(depth):
        h = (h ^ recent[:, j].astype(jnp.uint32)) * HASH_PRIME
        keys.append((h ^ jnp.uint32(j + 1)) * HASH_PRIME)
    return jnp.stack(keys, axis=1)


def host_key(context_newest_first: list[int] | tuple[int, ...], tenant: int) -> int:
    """The hash key of one context (newest token first) under ``tenant``, as the device computes it
    (:func:`context_keys`), in plain integers (a host index hashes thousands per finished request)."""
    mask, prime = 0xFFFFFFFF, int(HASH_PRIME)
    h = int(HASH_BASIS) ^ ((tenant * int(TENANT_MIX)) & mask)
    for token in context_newest_first:
        h = ((h ^ (token & mask)) * prime) & mask
    return ((h ^ len(context_newest_first)) * prime) & mask
