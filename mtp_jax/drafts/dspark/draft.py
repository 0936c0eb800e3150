"""DSpark draft (DeepSpec; docs/formats.md, "DSpark drafts"): DFlash's backbone run once per block,
then a tiny sequential head sampled left to right inside the block.

The block anchored at the last emitted token x_0 (position s) is ``[x_0, MASK, ..., MASK]`` at
positions s..s+B-1 over the context of the target's hidden states at positions < s (KV injection,
as DFlash: :func:`mtp_jax.drafts.dflash.draft.paged_block`). Slot k (0-based) predicts the token at
s + k + 1 (the anchor's own slot predicts the next token: B slots give B drafts). With h_k the
block's norm(x) at slot k and U_k = target_head(h_k)::

    z_k = U_k + bias(h_k, x_{k-1}, state)        (:mod:`mtp_jax.drafts.dspark.heads`)
    x_k = argmax z_k, or a draw of q_k = the row's processed softmax of z_k

so the distribution acceptance uses at slot k is exactly the one x_k was drawn from, given the
drafts before it. Rank 0 (no head) is DeepSpec's DFlash: B independent slots, the anchor's first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from mtp_jax.drafts.base import Draft, Rows, StepReads, at_rows, choose, in_target_vocab, no_drafts
from mtp_jax.drafts.dflash.draft import (
    check_block_plan,
    configure_block,
    context_cache_logical,
    init_context_cache,
    paged_block,
    param_logical,
    teacher_forced_blocks,
)
from mtp_jax.drafts.dspark.checkpoint import is_dspark, load_dspark
from mtp_jax.drafts.dspark.config import DSparkConfig, parse_dspark_draft
from mtp_jax.drafts.dspark.heads import confidence_logit, initial_state, markov_step, teacher_forced_heads
from mtp_jax.param_bytes import nbytes
from mtp_jax.targets.base import Hidden, head_logits, lm_head

GROUP = "dspark"


def dspark_features(cfg: DSparkConfig, hidden: Hidden) -> jax.Array:
    """The target's outputs at ``cfg.capture`` (raw decoder-layer outputs; -1 the embedding),
    concatenated in order [b, t, m·d]."""
    return jnp.concatenate([hidden.layers[j] for j in range(len(cfg.capture))], axis=-1)


def _backbone(ctx):
    return dataclasses.replace(ctx, draft_cfg=ctx.draft_cfg.backbone)


def block_outputs(params, ctx, state, page_table, rows: Rows, first_pos):
    """Write the committed rows' context and run the block anchored at the last emitted token.
    Returns (h [b, B, d], the anchors [b], state)."""
    features = dspark_features(ctx.draft_cfg, rows.hidden)
    h, state = paged_block(params, _backbone(ctx), state, page_table, rows, first_pos, features, GROUP)
    return h, at_rows(rows.next_tokens, rows.last), state


def base_logits(params: dict, h: jax.Array) -> jax.Array:
    """The block's unbiased logits from its norm(x) ``h`` [..., d]: the target's head [..., V], or
    with a draft vocabulary its columns for those ids [..., Vd] (float32)."""
    p = params[GROUP]
    return lm_head(params, h) if "draft_to_target" not in p else head_logits(p["lm_head"], h)


def to_target_vocab(params: dict, z: jax.Array) -> jax.Array:
    """Logits over the draft vocabulary placed at their target ids (-inf elsewhere); unchanged
    without one."""
    p = params[GROUP]
    return in_target_vocab(z, p.get("draft_to_target"), params["embed"].shape[0])


def sample_block(params, cfg: DSparkConfig, h, anchors, k: int, sampled: bool, sampling, first_pos):
    """The block's first ``k`` drafts, left to right: each slot's logits biased by the previous
    draft (the anchor for slot 0) and chosen from them (over the draft vocabulary's target ids when
    it has one: -inf elsewhere, so q is zero there). Returns (drafts [b, k], q [b, k, V] or
    [b, k, 0], confidence logits [b, k] or None)."""
    p = params[GROUP]
    base = base_logits(params, h[:, :k])  # [b, k, V or Vd]
    prev, state = anchors, initial_state(cfg, anchors.shape)
    drafts, qs, conf = [], [], []
    for j in range(k):
        if cfg.confidence_head:
            conf.append(confidence_logit(p, cfg, h[:, j], prev, j))
        bias, state = markov_step(p, cfg, h[:, j], prev, state)
        z = to_target_vocab(params, base[:, j] if bias is None else base[:, j] + bias)
        prev, q = choose(z, sampled, sampling, first_pos + j)
        drafts.append(prev)
        qs.append(q)
    return jnp.stack(drafts, 1), jnp.stack(qs, 1), (jnp.stack(conf, 1) if conf else None)


def _extend_and_propose(params, ctx, state, page_table, rows: Rows, active, sampling, first_pos):
    """:func:`block_outputs`, then :func:`sample_block`; with a confidence head also the drafts'
    confidence logits [b, K] (:attr:`mtp_jax.drafts.Draft.confidence`)."""
    cfg = ctx.draft_cfg
    h, anchors, state = block_outputs(params, ctx, state, page_table, rows, first_pos)
    if ctx.k == 0:  # the context is written; the block compiles away
        b = page_table.shape[0]
        out = no_drafts(b) + (state,)
        return out + (jnp.zeros((b, 0), jnp.float32),) if cfg.confidence_head else out
    drafts, q, conf = sample_block(params, cfg, h, anchors, ctx.k, ctx.sampled, sampling, first_pos)
    return (drafts, q, state, conf) if cfg.confidence_head else (drafts, q, state)


def teacher_forced_block(params: dict, cfg: DSparkConfig, tokens: jax.Array, features: jax.Array):
    """Over whole sequences tokens [b, T] with the target's features [b, T, m·d]: the block anchored
    at each token i, its slot k's previous token the sequence's own token i + k (teacher forcing)
    and past the sequence's end the argmax of the slot before (greedy decoding's). Returns (float32
    logits [b, T, B, V], slot k predicting token i + 1 + k; confidence logits [b, T, B] or None)."""
    h = teacher_forced_blocks(params, cfg.backbone, tokens, features, GROUP)  # [b, T, B, d]
    base = base_logits(params, h)
    t, slots = tokens.shape[1], cfg.block_size
    index = jnp.arange(t)[:, None] + jnp.arange(slots)[None, :]  # [T, B]: the previous token's position
    known = index < t
    given = jnp.take(tokens, jnp.minimum(index, t - 1), axis=1)  # [b, T, B]
    ids = params[GROUP].get("draft_to_target")
    logits, conf = teacher_forced_heads(
        params[GROUP], cfg, h, base, given, jnp.broadcast_to(known, given.shape), ids
    )
    return to_target_vocab(params, logits), conf


def _teacher_forced(params, ctx, tokens, hidden):
    cfg = ctx.draft_cfg
    return teacher_forced_block(params, cfg, tokens, dspark_features(cfg, hidden))[0]


# --- the rest of the draft interface (mtp_jax.drafts.base) ----------------------------------------
def _available(params: dict, cfg: object) -> str | None:
    if GROUP not in params:
        return "draft='dspark' needs a DSpark draft loaded beside the target (load(..., draft_model=DIR))"
    return None


def _init_state(ctx, num_pages: int, dtype) -> dict:
    return init_context_cache(_backbone(ctx), num_pages, dtype)


def _step_reads(params, cfg, draft_cfg, k: int, batch: int, positions: int, cache_itemsize: int) -> StepReads:
    """ONE block forward (every backbone weight, every layer's context K/V once, the target's head
    once for the K slots), then per slot the Markov head's W2 (and the RNN / gate weights) and the
    W1 rows of the previous tokens."""
    own = params[GROUP]
    markov = own.get("markov", {})
    per_slot = {name: leaf for name, leaf in markov.items() if name != "w1"}
    weights = float(sum(nbytes(leaf) for name, leaf in own.items() if name != "markov"))
    weights += k * float(sum(nbytes(leaf) for leaf in per_slot.values()))
    if "w1" in markov:
        w1 = markov["w1"]
        weights += 2 * k * batch * w1.shape[-1] * w1.dtype.itemsize  # bias + confidence lookups
    b = draft_cfg.backbone
    kv = b.num_hidden_layers * positions * 2 * b.num_key_value_heads * b.head_dim * cache_itemsize
    return StepReads(weights, 0.0, 0.0, float(kv), (batch + 1,), 1)


def _abstract_params(c: DSparkConfig, shapes) -> dict:
    """``params["dspark"]`` as :func:`mtp_jax.drafts.dspark.checkpoint.load_dspark` builds it."""
    from mtp_jax.drafts.dflash.draft import DRAFT as DFLASH

    tree = DFLASH.abstract_params(dataclasses.replace(c.backbone, capture=c.capture), shapes)
    d, r, v, plain = c.hidden_size, c.markov_rank, c.vocab_size, shapes.plain
    vd = c.draft_vocab_size or v
    if c.draft_vocab_size is not None and c.draft_vocab_size != v:
        tree["lm_head"] = plain(d, vd)
        tree["draft_to_target"] = plain(vd, dtype=jnp.int32)
    if r > 0:
        if v is None:
            raise ValueError("planning a DSpark draft with a Markov head needs vocab_size in its config")
        tree["markov"] = {"w1": plain(v, r), "w2": plain(r, vd)}
        if c.markov_head_type == "rnn":
            tree["markov"].update(joint=plain(2 * r + d, 3 * r), joint_bias=plain(3 * r))
        elif c.markov_head_type == "gated":
            tree["markov"].update(gate=plain(d + r, r), gate_bias=plain(r))
    if c.confidence_head:
        tree["confidence"] = {"w": plain(c.confidence_width), "b": plain()}
    return tree


def _check_plan(c: DSparkConfig, target_cfg, k: int) -> None:
    check_block_plan(c, target_cfg, k, "DSpark", c.block_size)


def _load(reader, raw, target_cfg, target_params, dtype, *, strict=False, mesh=None, **_):
    return load_dspark(reader, raw, target_cfg, dtype, strict=strict, mesh=mesh, target_params=target_params)


def _configure(
    draft_cfg: DSparkConfig, k: int | None, options: Mapping[str, Any]
) -> tuple[DSparkConfig, int | None]:
    """``block_size``: its first slots only (at most that many drafts); K defaults to all."""
    return configure_block(
        draft_cfg, k, options, title="DSpark", anchor_drafts=True, resize=DSparkConfig.resized
    )


DRAFT = Draft(
    name="dspark",
    available=_available,
    capture=lambda ctx: tuple(ctx.draft_cfg.capture),
    init_state=_init_state,
    state_logical=context_cache_logical,
    extend_and_propose=_extend_and_propose,
    teacher_forced=_teacher_forced,
    layer_stacks=((GROUP, "layers"),),
    step_reads=_step_reads,
    abstract_params=_abstract_params,
    title="DSpark",
    params_group=GROUP,
    param_logical=param_logical,
    config_class=DSparkConfig,
    check_plan=_check_plan,
    recognises=is_dspark,
    parse_config=parse_dspark_draft,
    load=_load,
    configure=_configure,
    options=("block_size",),
    block_size=lambda draft_cfg: draft_cfg.block_size,
    default_k=7,
    confidence=lambda draft_cfg: draft_cfg.confidence_head,
)
