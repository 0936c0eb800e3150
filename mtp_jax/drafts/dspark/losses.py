"""DSpark's training objective (DeepSpec's trainer; ../shared/DSPARK.md section 3): per block slot,
the cross-entropy of the true next token, the L1 distance between the draft's and the target's
distributions, and the confidence head's binary cross-entropy against the analytic acceptance
sum(min(p_draft, p_target)); slots weighted exp(-k / decay) (0-based k; DeepSpec's configs use
decay 4.0), only a contiguous valid prefix of each block counted.

Everything at temperature 1 in float32; the draft's logits are the teacher-forced biased ones
(:func:`mtp_jax.drafts.dspark.draft.teacher_forced_block`: each slot's previous token the true
one). ``L = ce_weight · CE + l1_weight · L1 + confidence_weight · BCE`` (0.1, 0.9, 1.0 in DeepSpec's
DSpark configs; its DFlash configs: 1.0, 0, 0).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LossWeights:
    """The three terms' weights and the slot decay (DeepSpec's DSpark defaults)."""

    ce: float = 0.1
    l1: float = 0.9
    confidence: float = 1.0
    decay: float = 4.0


def valid_slots(labels_valid: jax.Array) -> jax.Array:
    """float32 [..., B]: each block's slots up to its first invalid label (the cumulative product
    over the slots of ``labels_valid`` [..., B] bool: label inside the sequence, a reply token, the
    block kept)."""
    return jnp.cumprod(labels_valid.astype(jnp.float32), axis=-1)


def dspark_losses(
    draft_logits: jax.Array,
    target_logits: jax.Array,
    labels: jax.Array,
    labels_valid: jax.Array,
    confidence_logits: jax.Array | None,
    weights: LossWeights = LossWeights(),
    ce_valid: jax.Array | None = None,
    target_mass: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """The weighted mean losses over every counted slot of blocks [..., B]: ``draft_logits`` and
    ``target_logits`` [..., B, V] (slot k predicting the same token, the target's distribution
    being its next-token one there), ``labels`` [..., B] the true tokens, ``labels_valid`` [..., B].
    Returns {"loss", "ce", "l1", "confidence" (0 without a head), "acceptance": the mean analytic
    acceptance sum(min(p_d, p_t)) over the counted slots}; the targets of the confidence term are
    not differentiated (as DeepSpec detaches them). ``ce_valid`` [..., B]: where False the slot's
    cross-entropy is not counted (a draft vocabulary without the true token: the other terms are).
    ``target_mass`` [..., B]: the target's probability on the draft's vocabulary where it is known
    to be none (0: a cached teacher whose kept tokens all lie outside a draft vocabulary), the
    target's distribution there all zeros (every draft token rejected: an acceptance of 0), else 1
    (an extension: DeepSpec's drafts use the whole vocabulary, where it never happens)."""
    f32 = jnp.float32
    slots = labels.shape[-1]
    w = jnp.exp(-jnp.arange(slots, dtype=f32) / weights.decay) * valid_slots(labels_valid)
    total = jnp.maximum(jnp.sum(w), 1e-9)
    logp_d = jax.nn.log_softmax(draft_logits.astype(f32), axis=-1)
    p_d = jnp.exp(logp_d)
    p_t = jax.nn.softmax(target_logits.astype(f32), axis=-1)
    if target_mass is not None:
        p_t = p_t * target_mass.astype(f32)[..., None]
    ce = -jnp.take_along_axis(logp_d, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    l1 = jnp.sum(jnp.abs(p_d - p_t), axis=-1)
    accept = jax.lax.stop_gradient(jnp.clip(jnp.sum(jnp.minimum(p_d, p_t), axis=-1), 0.0, 1.0))
    w_ce, total_ce = w, total
    if ce_valid is not None:
        w_ce = w * ce_valid.astype(f32)
        total_ce = jnp.maximum(jnp.sum(w_ce), 1e-9)
    out = {
        "ce": jnp.sum(w_ce * ce) / total_ce,
        "l1": jnp.sum(w * l1) / total,
        "acceptance": jnp.sum(w * accept) / total,
        "confidence": jnp.zeros((), f32),
    }
    if confidence_logits is not None:
        z = confidence_logits.astype(f32)
        bce = jnp.maximum(z, 0) - z * accept + jnp.log1p(jnp.exp(-jnp.abs(z)))  # BCE with logits
        out["confidence"] = jnp.sum(w * bce) / total
    out["loss"] = weights.ce * out["ce"] + weights.l1 * out["l1"] + weights.confidence * out["confidence"]
    return out
