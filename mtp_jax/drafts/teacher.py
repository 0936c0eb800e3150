"""The teacher distribution a draft trains on, shared by every draft's training objective: the
frozen target's next-token distribution restricted to the draft's vocabulary, from the target's
full logits (:func:`dense_teacher`) or from its top-k kept in a target cache
(:func:`top_k_teacher`, :mod:`mtp_jax.train.target_cache`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def top_k_teacher(
    top_ids: jax.Array, top_logp: jax.Array, vocab_ids: jax.Array | None, vocab_size: int
) -> dict:
    """The teacher a draft trains on, from the target's top-k: ``probs`` [..., vocab] over the
    draft's vocabulary (``vocab_ids``: its target ids, ascending; None: the target's whole
    vocabulary of ``vocab_size``), renormalised over the kept tokens it contains; ``greedy`` the
    target's most likely token; ``covered`` the target's probability mass on the kept tokens inside
    the draft vocabulary (a lower bound of the draft vocabulary's coverage)."""
    if vocab_ids is None:
        index, size = top_ids, vocab_size
    else:
        size = vocab_ids.shape[0]
        to_draft = jnp.full((vocab_size,), -1, jnp.int32).at[vocab_ids].set(jnp.arange(size, dtype=jnp.int32))
        index = to_draft[top_ids]
    inside = index >= 0
    p = jnp.where(inside, jnp.exp(top_logp), 0.0)
    lead = top_ids.shape[:-1]
    flat_p = p.reshape(-1, p.shape[-1])
    rows = jnp.broadcast_to(jnp.arange(flat_p.shape[0])[:, None], flat_p.shape)
    dense = (
        jnp.zeros((flat_p.shape[0], size), jnp.float32)
        .at[rows, jnp.where(inside, index, 0).reshape(flat_p.shape)]
        .add(flat_p)
    )
    covered = p.sum(-1)
    probs = dense.reshape(*lead, size) / jnp.maximum(covered, 1e-30)[..., None]
    return {"probs": probs, "greedy": top_ids[..., 0], "covered": covered}


def dense_teacher(logits: jax.Array, vocab_ids: jax.Array | None) -> dict:
    """:func:`top_k_teacher`'s triple from the target's full logits [..., V]."""
    full = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if vocab_ids is None:
        return {
            "probs": full,
            "greedy": jnp.argmax(logits, -1),
            "covered": jnp.ones(logits.shape[:-1], jnp.float32),
        }
    return {
        "probs": jax.nn.softmax(logits[..., vocab_ids].astype(jnp.float32), axis=-1),
        "greedy": jnp.argmax(logits, -1),
        "covered": full[..., vocab_ids].sum(-1),
    }


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy of ``logits`` [..., V] against hard labels ``targets`` [...] (the text's
    tokens, where a draft or a target learns the data rather than a teacher)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0].mean()
