"""Training DeepSeek-V3 jointly with its MTP layer, or the MTP layer alone against the frozen model
(``scripts/train_tiny.py`` runs it): the main next-token cross-entropy plus λ times the MTP loss
(DeepSeek-V3 report, section 2.2), the MTP layer chained ``depth`` levels as decoding chains it,
levels learning the text or the main model's own distribution (self-distillation), and the
auxiliary-loss-free expert balancing of the MoE layers and the MTP layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.drafts.mtp.draft import mtp_chain_teacher_forced
from mtp_jax.drafts.teacher import cross_entropy
from mtp_jax.targets.base import lm_head
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
from mtp_jax.targets.deepseek_v3.model import forward

MTP_WEIGHT = 0.3  # λ of the DeepSeek-V3 report for the first 10T tokens
BIAS_RATE = 0.001  # γ of the DeepSeek-V3 report
# Chained MTP level j is weighted REACH^(j-1) (normalised): about the chance that decoding gets as
# far as draft j, so the first draft, which every step uses, keeps most of the layer's capacity.
REACH = 0.6


def losses(
    params: dict, cfg: DeepseekV3Config, window: jax.Array, depth: int = 1, labels: str = "data"
) -> tuple[jax.Array, dict]:
    """Losses on windows [b, s]: main predicts window[:, 1:]; MTP level j (1..depth) predicts
    window[:, j + 1:], level 1 from the target's hidden states and level j > 1 from level j-1's
    state, as decoding chains the layer (:func:`mtp_jax.drafts.mtp.draft.mtp_chain_teacher_forced`).

    ``labels``: what the MTP levels learn: ``"data"``, the text's tokens (DeepSeek-V3's objective),
    or ``"target"``, the main model's own distribution at the same position (self-distillation,
    no gradient into the main model): the draft is then trained on what acceptance measures, the
    target's choices, not the text's. Returns (main + λ · MTP loss, aux), the MTP loss being the
    levels' losses weighted by REACH^(j-1) (normalised; plain MTP CE at depth 1);
    ``aux["draft_loss"]`` is that MTP loss alone (what ``--train mtp`` minimises);
    ``aux["level_loss"]`` is always the CE against the text, comparable across runs."""
    if labels not in ("data", "target"):
        raise ValueError(f"labels must be 'data' or 'target', got {labels!r}")
    inputs = window[:, :-1]
    b, t = inputs.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    hidden, _ = forward(params, cfg, inputs, positions, dispatch="dense")
    logits = lm_head(params, hidden.post_norm)
    main = cross_entropy(logits, window[:, 1:])
    levels = mtp_chain_teacher_forced(params, cfg, window, hidden.post_norm, depth, dispatch="dense")
    n = levels[0].logits.shape[1]
    teacher = jax.nn.softmax(jax.lax.stop_gradient(logits), axis=-1)
    level_loss, level_agree, trained = [], [], []
    for j, level in enumerate(levels, start=1):
        level_loss.append(cross_entropy(level.logits, window[:, j + 1 : j + 1 + n]))
        if labels == "target":  # soft cross-entropy with the target's distribution for t_{i+j+1}
            logp = jax.nn.log_softmax(level.logits, axis=-1)
            trained.append(-(teacher[:, j : j + n] * logp).sum(-1).mean())
        else:
            trained.append(level_loss[-1])
        # Teacher-forced draft agreement: level j's guess for t_{i+j+1} equals the target's greedy
        # choice there (given the true tokens before it); at level 1 this is the K = 1 acceptance
        # rate at temperature 0, at level j the acceptance of draft j given true earlier drafts.
        level_agree.append((jnp.argmax(level.logits, -1) == jnp.argmax(logits[:, j : j + n], -1)).mean())
    weights = REACH ** np.arange(depth) / np.sum(REACH ** np.arange(depth))
    draft_loss = sum(float(w) * loss for w, loss in zip(weights, trained, strict=True))
    aux = {
        "loss": main,
        "mtp_loss": level_loss[0],
        "mtp_agreement": level_agree[0],
        "draft_loss": draft_loss,
        "level_loss": jnp.stack(level_loss),
        "level_agreement": jnp.stack(level_agree),
        "moe_load": hidden.expert_load,
        "mtp_load": sum(level.expert_load for level in levels),
    }
    return main + MTP_WEIGHT * draft_loss, aux


def balance_bias(params: dict, aux: dict, target: bool = True) -> dict:
    """DeepSeek-V3's auxiliary-loss-free balancing: bias += γ · sign(mean load - load), in the MTP
    layer and (``target``) in the main model's MoE layers."""

    def nudge(bias: jax.Array, load: jax.Array) -> jax.Array:
        return bias + BIAS_RATE * jnp.sign(load.mean(-1, keepdims=True) - load)

    params = dict(params)
    if target:
        params["moe"] = _with_bias(params["moe"], nudge(params["moe"]["mlp"]["bias"], aux["moe_load"]))
    mtp_bias = params["mtp"]["layer"]["mlp"]["bias"]
    layer = _with_bias(params["mtp"]["layer"], nudge(mtp_bias, aux["mtp_load"][None]))
    params["mtp"] = {**params["mtp"], "layer": layer}
    return params


def _with_bias(stack: dict, bias: jax.Array) -> dict:
    return {**stack, "mlp": {**stack["mlp"], "bias": bias}}
