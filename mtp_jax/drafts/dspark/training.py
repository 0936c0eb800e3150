"""Training a DSpark draft against a frozen target (``scripts/train_dspark.py`` runs it): its
config.json as DeepSpec writes it (DFlash's backbone for the target plus the DSpark fields), its
initial weights, and the objective: DFlash's anchored blocks through the backbone, the heads
teacher-forced, DeepSpec's three losses (:mod:`mtp_jax.drafts.dspark.losses`) against the target's
own distributions."""

from __future__ import annotations

import math
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.checkpoint.safetensors_io import CheckpointReader, write_hub_checkpoint
from mtp_jax.config import ModelConfig
from mtp_jax.drafts.dflash.config import parse_dflash_config
from mtp_jax.drafts.dflash.draft import block_forward, context_rows
from mtp_jax.drafts.dflash.training import draft_config as dflash_draft_config
from mtp_jax.drafts.dflash.training import held_out_means
from mtp_jax.drafts.dspark.checkpoint import dspark_config_dict, load_dspark
from mtp_jax.drafts.dspark.config import DSparkConfig
from mtp_jax.drafts.dspark.draft import GROUP, dspark_features
from mtp_jax.drafts.dspark.heads import teacher_forced_heads
from mtp_jax.drafts.dspark.losses import LossWeights, dspark_losses
from mtp_jax.drafts.dspark.synthetic import dspark_hub_tensors
from mtp_jax.drafts.teacher import top_k_teacher
from mtp_jax.targets import target_for
from mtp_jax.targets.base import head_columns, head_logits, lm_head


def draft_config(
    target: dict,
    cfg: ModelConfig,
    layers: int,
    layer_ids: list[int],
    block: int,
    mask: int,
    rank: int,
    head: str,
    confidence: bool,
    draft_vocab: int | None = None,
) -> dict:
    """config.json as DeepSpec writes it: DFlash's backbone for this target
    (:func:`mtp_jax.drafts.dflash.training.draft_config`) with the DSpark fields; ``draft_vocab``:
    mtp-jax's draft vocabulary of that many target ids (``draft_vocab_size``)."""
    backbone = parse_dflash_config(dflash_draft_config(target, cfg, layers, [0], block, mask))
    dcfg = DSparkConfig(
        backbone=backbone,
        target_layer_ids=tuple(layer_ids),
        num_target_layers=cfg.num_hidden_layers,
        markov_rank=rank,
        markov_head_type=head,
        confidence_head=confidence,
    )
    raw = {**dspark_config_dict(dcfg, target), "model_type": "qwen3"}
    if draft_vocab is not None and draft_vocab != cfg.vocab_size:
        raw["draft_vocab_size"] = draft_vocab
    return raw


def target_arrays(params: dict, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The target's embedding and head, [V, d] each (what a DeepSpec checkpoint copies)."""
    embed = np.asarray(jax.device_get(params["embed"]), np.float32)
    head = np.asarray(jax.device_get(head_columns(params, np.arange(vocab))), np.float32).T
    return embed, head


def init_draft(
    raw: dict, cfg: ModelConfig, params: dict, seed: int, ids: np.ndarray | None = None
) -> tuple[DSparkConfig, dict]:
    """HF's default initialisation (DeepSpec's): N(0, 0.02) weights (output projections / sqrt(2 n),
    as the other drafts here), unit norms, zero biases; built in DeepSpec's layout and read back by
    the loader. ``ids``: the draft vocabulary's target ids (the config's ``draft_vocab_size`` of
    them); the tree then holds ``draft_to_target`` and the head's columns (:data:`FIXED`)."""
    dcfg = DSparkConfig.from_dict(raw)
    embed, head = target_arrays(params, cfg.vocab_size)
    tensors = dspark_hub_tensors(dcfg, embed, head, seed, std=0.02, draft_ids=ids)
    rng = np.random.default_rng([seed, 3])
    for name in sorted(tensors):
        if name.endswith("norm.weight"):
            tensors[name] = np.ones_like(tensors[name])
        elif name.endswith(".bias"):
            tensors[name] = np.zeros_like(tensors[name])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = tensors[name] / math.sqrt(2.0 * dcfg.num_hidden_layers)
        elif name.startswith(("markov_head.", "confidence_head.")):
            tensors[name] = (rng.standard_normal(tensors[name].shape) * 0.02).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "init")
        write_hub_checkpoint(path, raw, tensors)
        reader = CheckpointReader(path)
        return load_dspark(reader, raw, cfg, jnp.float32, strict=True, verbose=False, target_params=params)


FIXED = ("draft_to_target", "lm_head")
"""A draft vocabulary's ids and the target head's columns for them: in the tree, not trained."""


def _draft_labels(ids: jax.Array | None, vocab_size: int, labels: jax.Array):
    """With a draft vocabulary (``ids`` [Vd]): the labels as draft ids (0 where outside), a mask of
    those inside, and a function mapping draft ids back to target ids; without one, as given."""
    if ids is None:
        return labels, None, lambda x: x
    to_draft = jnp.full((vocab_size,), -1, jnp.int32).at[ids].set(jnp.arange(ids.shape[0], dtype=jnp.int32))
    d = to_draft[labels]
    return jnp.maximum(d, 0), d >= 0, lambda x: ids[x]


def draft_losses(
    tree: dict,
    params: dict,
    cfg: ModelConfig,
    dcfg: DSparkConfig,
    window: jax.Array,
    anchors: jax.Array,
    weights: LossWeights,
    cached: dict | None = None,
) -> tuple[jax.Array, dict]:
    """Windows [b, s + 1] with anchors [b, n] (each <= s - B): the frozen target's features and
    distributions over the first s tokens, then the n blocks per window in one backbone forward
    (each over the context before its anchor), the heads teacher-forced. Slot k of the block at a
    predicts token a + 1 + k against the target's distribution there (row a + k).

    ``cached``: the target's rows from a target cache (features [b, s, F], top_ids / top_logp
    [b, s, k]) instead of running the target. Returns (loss, aux: the three terms, the mean
    analytic acceptance, and per slot that acceptance and the agreement with the target's greedy
    token)."""
    inputs = window[:, :-1]
    b, t = inputs.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if cached is None:
        hidden, _ = target_for(cfg).forward(params, cfg, inputs, positions, capture=dcfg.capture)
        features = jax.lax.stop_gradient(dspark_features(dcfg, hidden))
        logits = jax.lax.stop_gradient(lm_head(params, hidden.post_norm))  # row r predicts token r + 1
    else:
        features = cached["features"]
    full = {**params, GROUP: tree}
    bb = dcfg.backbone
    block_pos = anchors[:, :, None] + jnp.arange(bb.block_size, dtype=jnp.int32)  # [b, n, B]
    blocks = jnp.full(block_pos.shape, bb.mask_token_id, window.dtype)
    blocks = blocks.at[:, :, 0].set(jnp.take_along_axis(inputs, anchors, axis=1))
    visible = positions[:, None, :] < anchors[:, :, None]  # [b, n, t]: the context strictly before
    h = block_forward(
        full, bb, blocks, block_pos, context_rows(full, bb, features, GROUP), positions, visible, GROUP
    )
    flat = block_pos.reshape(b, -1)
    prev = jnp.take_along_axis(window, flat, axis=1).reshape(block_pos.shape)  # slot k reads token a + k
    labels = jnp.take_along_axis(window, flat + 1, axis=1).reshape(block_pos.shape)
    ids = tree.get("draft_to_target")
    base = lm_head(params, h) if ids is None else head_logits(tree["lm_head"], h)
    draft_logits, conf = teacher_forced_heads(tree, dcfg, h, base, prev, None, ids)  # over V or Vd
    mass = None  # the teacher's mass on the draft vocabulary where it has none (a cached top-k)
    if cached is None:  # the target's distribution, over the draft vocabulary renormalised
        teacher = jnp.take_along_axis(logits, flat[..., None], axis=1).reshape(*block_pos.shape, -1)
        greedy = jnp.argmax(teacher, -1)
        teacher = teacher if ids is None else jnp.take(teacher, ids, axis=-1)
        target_logp = jax.nn.log_softmax(teacher.astype(jnp.float32), axis=-1)
    else:
        top = [jnp.take_along_axis(cached[k], flat[..., None], axis=1) for k in ("top_ids", "top_logp")]
        teacher = top_k_teacher(*(x.reshape(*block_pos.shape, -1) for x in top), ids, cfg.vocab_size)
        # every kept token outside the draft vocabulary: no distribution to renormalise (log 0
        # everywhere would make the loss NaN); the target's there is taken as none at all
        mass = teacher["covered"] > 0
        target_logp = jnp.where(mass[..., None], jnp.log(teacher["probs"]), 0.0)
        greedy = teacher["greedy"]
    labels, inside, to_target = _draft_labels(ids, cfg.vocab_size, labels)
    out = dspark_losses(
        draft_logits, target_logp, labels, jnp.ones(labels.shape, bool), conf, weights, inside, mass
    )
    p_d, p_t = jax.nn.softmax(draft_logits, -1), jnp.exp(target_logp)
    if mass is not None:
        p_t = p_t * mass[..., None]
    out["level_acceptance"] = jnp.minimum(p_d, p_t).sum(-1).mean((0, 1))
    out["level_agreement"] = (to_target(jnp.argmax(draft_logits, -1)) == greedy).mean((0, 1))
    return out["loss"], out


def evaluate(
    tree, params, cfg, dcfg, stream: np.ndarray, length: int, count: int, anchors: int, weights
) -> dict:
    """Mean held-out numbers over ``count`` fixed, evenly spaced windows with fixed anchors."""
    fn = jax.jit(lambda t, w, a, p: draft_losses(t, p, cfg, dcfg, w, a, weights)[1])
    block = dcfg.block_size
    return held_out_means(lambda w, a: fn(tree, w, a, params), stream, length, count, anchors, block)
