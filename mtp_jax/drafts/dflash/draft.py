"""DFlash draft: a whole block of drafts from ONE non-causal forward (docs/formats.md, "DFlash drafts").

The draft has ``n`` Qwen3-style decoder layers and no embedding or head of its own (the target's).
Its context is the target: for every committed position p, ``c_p = hidden_norm(fc(cat(features_p)))``
(the captured target layer outputs, concatenated in order; :func:`dflash_features`), whose keys
``rope(k_norm(k_proj(c_p)), p)`` and values ``v_proj(c_p)`` each layer attends to (no input norm
on c). A block anchored at position
s is ``[x_s, MASK, ..., MASK]`` (``block_size`` tokens, embedded by the target, at positions
s..s+block_size-1); per layer::

    h = input_norm(x);  q = rope(q_norm(q_proj(h)));  k, v of the block as for the context
    x += o(attn(q, [context keys ; block keys]))     # no mask inside the block (bidirectional)
    x += mlp(post_attn_norm(x))

and ``target_lm_head(norm(x))`` at block row j (1..block_size-1) predicts the token at s + j (with
a draft vocabulary: the target head's columns for those ids only, -inf elsewhere). The block's keys
and values are never stored; only the context's are (in decoding, once per committed token).

Parameters (``params["dflash"]``; weights [in, out], head axes split out, layers stacked [n, ...])::

    fc [C·H, H], hidden_norm [H], norm [H],
    layers: {input_norm, post_attn_norm [n, H],
             attn: {q [n, H, nh, hd], k/v [n, H, nkv, hd], o [n, nh, hd, H], q_norm/k_norm [n, hd]},
             mlp: {gate, up [n, H, f], down [n, f, H]}},
    draft_to_target int32 [Vd], lm_head [H, Vd]   (a draft vocabulary only: the target head's
                                                   columns for those ids, copied at load)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.cache import slots_for, write_rows
from mtp_jax.drafts.base import (
    Draft,
    Rows,
    StepReads,
    at_rows,
    choose,
    in_target_vocab,
    no_drafts,
)
from mtp_jax.drafts.dflash.config import DFlashConfig, parse_dflash_draft
from mtp_jax.errors import InvalidRequestError
from mtp_jax.gqa import NEG_INF
from mtp_jax.layers import apply_rope_half, rms_norm, swiglu
from mtp_jax.param_bytes import nbytes
from mtp_jax.targets.base import Hidden, head_logits, lm_head, scan_layers
from mtp_jax.targets.llama.model import layer_logical, rope_tables
from pallas_kernels.paged import gather_pages


def dflash_features(cfg: DFlashConfig, num_target_layers: int, hidden: Hidden) -> jax.Array:
    """Fused target features [b, t, C·H] in ``cfg.capture`` order: transformers'
    ``hidden_states[i + 1]``, the residual stream after layer i, except that after the LAST layer
    transformers returns the final-normed state, which a draft trained on it reads."""
    parts = [
        hidden.post_norm if i == num_target_layers - 1 else hidden.layers[j]
        for j, i in enumerate(cfg.capture)
    ]
    return jnp.concatenate(parts, axis=-1)


def context_rows(params: dict, cfg: DFlashConfig, features: jax.Array, group: str = "dflash") -> jax.Array:
    """The draft's context c [b, t, H] from fused target features [b, t, C·H] (the draft's weights
    at ``params[group]``)."""
    p = params[group]
    c = jnp.einsum("btc,cd->btd", features.astype(p["fc"].dtype), p["fc"])
    return rms_norm(c, p["hidden_norm"], cfg.rms_norm_eps)


def _keys_values(p: dict, cfg: DFlashConfig, x: jax.Array, cos: jax.Array, sin: jax.Array):
    """Keys [b, t, nkv, hd] (k_norm, then rope) and values of rows x [b, t, H] of one layer."""
    k = rms_norm(jnp.einsum("btd,dhk->bthk", x, p["k"]), p["k_norm"], cfg.rms_norm_eps)
    return apply_rope_half(k, cos, sin), jnp.einsum("btd,dhk->bthk", x, p["v"])


def _queries(p: dict, cfg: DFlashConfig, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    q = rms_norm(jnp.einsum("btd,dhk->bthk", x, p["q"]), p["q_norm"], cfg.rms_norm_eps)
    return apply_rope_half(q, cos, sin)


def block_attention(
    q: jax.Array,
    k_block: jax.Array,
    v_block: jax.Array,
    k_ctx: jax.Array,
    v_ctx: jax.Array,
    ctx_visible: jax.Array,
    scale: float,
) -> jax.Array:
    """Attention of blocks over [context ; their own block], no mask inside a block.

    q [b, n, B, H, d] (n blocks of B rows), k_block/v_block [b, n, B, Hkv, d], k_ctx/v_ctx
    [b, S, Hkv, d], ctx_visible [b, n, S] bool (context rows block i may see). Returns [b, n, B, H, d].
    """
    b, n, bs, h, d = q.shape
    kv = k_block.shape[3]
    qg = q.reshape(b, n, bs, kv, h // kv, d)
    f32 = jnp.float32
    ctx = jnp.einsum("bnjkgd,bskd->bnjkgs", qg, k_ctx, preferred_element_type=f32) * scale
    ctx = jnp.where(ctx_visible[:, :, None, None, None, :], ctx, NEG_INF)
    own = jnp.einsum("bnjkgd,bnlkd->bnjkgl", qg, k_block, preferred_element_type=f32) * scale
    probs = jax.nn.softmax(jnp.concatenate([ctx, own], axis=-1), axis=-1).astype(q.dtype)
    s = k_ctx.shape[1]
    out = jnp.einsum("bnjkgs,bskd->bnjkgd", probs[..., :s], v_ctx.astype(q.dtype), preferred_element_type=f32)
    out += jnp.einsum(
        "bnjkgl,bnlkd->bnjkgd", probs[..., s:], v_block.astype(q.dtype), preferred_element_type=f32
    )
    return out.reshape(b, n, bs, h, d).astype(q.dtype)


def block_layers(
    params, cfg: DFlashConfig, blocks, block_positions, ctx_visible, context_kv, carry, group: str = "dflash"
):
    """The draft's layers (``params[group]``) over blocks [b, n, B] at ``block_positions``; each
    layer's context keys and values come from ``context_kv(layer params, layer index, carry) -> (k,
    v, carry)``. Returns (norm(x) [b, n, B, H], carry)."""
    p = params[group]
    b, n, bs = blocks.shape
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x = params["embed"][blocks].reshape(b, n * bs, -1)
    cos, sin = rope_tables(cfg, block_positions.reshape(b, n * bs))

    def layer(state, xs):
        x, carry = state
        lp, index = xs
        h = rms_norm(x, lp["input_norm"], cfg.rms_norm_eps)
        q = _queries(lp["attn"], cfg, h, cos, sin).reshape(b, n, bs, nh, hd)
        k, v = _keys_values(lp["attn"], cfg, h, cos, sin)
        k_ctx, v_ctx, carry = context_kv(lp["attn"], index, carry)
        shape = (b, n, bs, nkv, hd)
        out = block_attention(
            q, k.reshape(shape), v.reshape(shape), k_ctx, v_ctx, ctx_visible, cfg.softmax_scale
        )
        x = x + jnp.einsum("bthk,hkd->btd", out.reshape(b, n * bs, nh, hd), lp["attn"]["o"])
        x = x + swiglu(rms_norm(x, lp["post_attn_norm"], cfg.rms_norm_eps), **lp["mlp"])
        return (x, carry), None

    index = np.arange(cfg.num_hidden_layers, dtype=np.int32)
    (x, carry), _ = scan_layers(layer, (x, carry), p["layers"], index)
    return rms_norm(x, p["norm"], cfg.rms_norm_eps).reshape(b, n, bs, -1), carry


def block_forward(
    params: dict,
    cfg: DFlashConfig,
    blocks: jax.Array,
    block_positions: jax.Array,
    context: jax.Array,
    context_positions: jax.Array,
    ctx_visible: jax.Array,
    group: str = "dflash",
) -> jax.Array:
    """norm(x) [b, n, B, H] of n blocks per row: ``blocks`` [b, n, B] token ids (anchor then MASKs)
    at ``block_positions`` [b, n, B], over the context rows ``context`` [b, S, H] (c, see
    :func:`context_rows`) at ``context_positions`` [b, S], block i seeing the rows ``ctx_visible``
    [b, n, S]. Every layer computes the context's keys and values from c (training, scoring)."""
    cos, sin = rope_tables(cfg, context_positions)

    def context_kv(lp, index, carry):
        return (*_keys_values(lp, cfg, context.astype(lp["k"].dtype), cos, sin), carry)

    return block_layers(params, cfg, blocks, block_positions, ctx_visible, context_kv, None, group)[0]


def block_logits(params: dict, normed: jax.Array) -> jax.Array:
    """Float32 logits [..., V] over the target vocabulary from the block's norm(x) [..., H]: the
    target's head, or with a draft vocabulary its columns for those ids (-inf at the others)."""
    p = params["dflash"]
    if "draft_to_target" not in p:
        return lm_head(params, normed)
    return in_target_vocab(head_logits(p["lm_head"], normed), p["draft_to_target"], params["embed"].shape[0])


def anchored_blocks(cfg: DFlashConfig, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One block per position of tokens [b, T]: [x_i, MASK, ...] at positions i..i+B-1.
    Returns (blocks [b, T, B], positions [b, T, B])."""
    b, t = tokens.shape
    bs = cfg.block_size
    blocks = jnp.full((b, t, bs), cfg.mask_token_id, tokens.dtype).at[:, :, 0].set(tokens)
    positions = jnp.arange(t, dtype=jnp.int32)[:, None] + jnp.arange(bs, dtype=jnp.int32)[None]
    return blocks, jnp.broadcast_to(positions, (b, t, bs))


def teacher_forced_blocks(
    params: dict, cfg: DFlashConfig, tokens: jax.Array, features: jax.Array, group: str = "dflash"
) -> jax.Array:
    """norm(x) [b, T, B, H] over whole sequences tokens [b, T] with fused target features
    [b, T, C·H]: row i is the block anchored at token i (at position i) with the context of
    positions 0..i-1."""
    b, t = tokens.shape
    blocks, positions = anchored_blocks(cfg, tokens)
    context = context_rows(params, cfg, features[:, :t], group)
    ctx_positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    visible = jnp.arange(t)[None, :] < jnp.arange(t)[:, None]  # block i sees context rows s < i
    return block_forward(
        params, cfg, blocks, positions, context, ctx_positions, jnp.broadcast_to(visible, (b, t, t)), group
    )


def teacher_forced_block_logits(
    params: dict, cfg: DFlashConfig, tokens: jax.Array, features: jax.Array
) -> jax.Array:
    """float32 [b, T, B-1, V] over whole sequences tokens [b, T] with fused target features
    [b, T, C·H]: row i anchors a block at token i with the context of positions 0..i-1; its entry
    j predicts token i + 1 + j."""
    return block_logits(params, teacher_forced_blocks(params, cfg, tokens, features)[:, :, 1:])


# --- the draft interface (mtp_jax.drafts.base) ---------------------------------------------------
def _available(params: dict, cfg: object) -> str | None:
    if "dflash" not in params:
        return "draft='dflash' needs a DFlash draft loaded beside the target (load(..., draft_model=DIR))"
    return None


def init_context_cache(ctx, num_pages: int, dtype) -> dict:
    """Each draft layer's context keys and values, paged on the target's page ids:
    {"k", "v"} [n_layers, P, page, nkv, hd]."""
    c = ctx.draft_cfg
    shape = (c.num_hidden_layers, num_pages, ctx.page_size, c.num_key_value_heads, c.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def context_cache_logical(names: list[str], rank: int) -> tuple[str | None, ...]:
    return (None, "pages", None, "kv_heads", None)


def paged_block(params, ctx, state, page_table, rows: Rows, first_pos, features, group: str = "dflash"):
    """Write the committed rows' context keys and values (every layer of the draft at
    ``params[group]``, from fused target ``features`` [b, t, C·H] at the rows), then one block
    forward anchored at the last emitted token (position first_pos - 1) over each row's paged
    context. Returns (norm(x) [b, B, H], state)."""
    cfg = ctx.draft_cfg
    b = page_table.shape[0]
    context = context_rows(params, cfg, features, group)
    slots = slots_for(page_table, rows.positions, rows.valid, ctx.page_size)
    cos_c, sin_c = rope_tables(cfg, rows.positions)
    anchor_pos = first_pos - 1
    anchors = at_rows(rows.next_tokens, rows.last)
    blocks, positions = anchored_blocks(cfg, anchors[:, None])
    positions = positions + anchor_pos[:, None, None]
    width = page_table.shape[1] * ctx.page_size
    ctx_positions = jnp.arange(width, dtype=jnp.int32)
    visible = (ctx_positions[None, :] < anchor_pos[:, None])[:, None, :]  # [b, 1, S]
    table = jnp.clip(page_table, 0, state["k"].shape[1] - 1)

    def context_kv(lp, index, pages):
        k_new, v_new = _keys_values(lp, cfg, context.astype(pages["k"].dtype), cos_c, sin_c)
        pages = {
            "k": write_rows(pages["k"], k_new, slots, index),
            "v": write_rows(pages["v"], v_new, slots, index),
        }
        k_ctx, v_ctx = (
            gather_pages(pages[n], table, index).reshape(b, width, *pages[n].shape[3:]) for n in ("k", "v")
        )
        return k_ctx, v_ctx, pages

    normed, state = block_layers(params, cfg, blocks, positions, visible, context_kv, state, group)
    return normed[:, 0], state


def _extend_and_propose(params, ctx, state, page_table, rows: Rows, active, sampling, first_pos):
    """:func:`paged_block`; the block's rows 1..K are the K drafts, each chosen independently given
    the context."""
    features = dflash_features(ctx.draft_cfg, ctx.cfg.num_hidden_layers, rows.hidden)
    normed, state = paged_block(params, ctx, state, page_table, rows, first_pos, features)
    b = page_table.shape[0]
    if ctx.k == 0:  # the context is written; the block's outputs are unused and compile away
        return no_drafts(b) + (state,)
    logits = block_logits(params, normed[:, 1 : ctx.k + 1])  # [b, K, V]
    picks = [choose(logits[:, j], ctx.sampled, sampling, first_pos + j) for j in range(ctx.k)]
    drafts = jnp.stack([d for d, _ in picks], axis=1)
    return drafts, jnp.stack([q for _, q in picks], axis=1), state


def _teacher_forced(params, ctx, tokens, hidden):
    features = dflash_features(ctx.draft_cfg, ctx.cfg.num_hidden_layers, hidden)
    return teacher_forced_block_logits(params, ctx.draft_cfg, tokens, features)


def _step_reads(params, cfg, draft_cfg, k: int, batch: int, positions: int, cache_itemsize: int) -> StepReads:
    """ONE block forward: every draft weight (fc included: the new rows' context in the same
    forward), the head once for all K rows (the target's, or the draft vocabulary's columns of it),
    every layer's context K/V once; the embedding rows of the anchors and the mask token."""
    own = {name: tree for name, tree in params["dflash"].items() if name != "lm_head"}
    weights = float(sum(nbytes(leaf) for leaf in jax.tree.leaves(own)))
    head = params["dflash"].get("lm_head")
    c = draft_cfg
    kv = c.num_hidden_layers * positions * 2 * c.num_key_value_heads * c.head_dim * cache_itemsize
    if head is not None:  # its own (smaller) head; the target's is not read
        return StepReads(weights, 0.0, float(nbytes(head)), float(kv), (batch + 1,), 0)
    return StepReads(weights, 0.0, 0.0, float(kv), (batch + 1,), 1)


def _abstract_params(c: DFlashConfig, shapes) -> dict:
    """``params["dflash"]`` as :func:`mtp_jax.drafts.dflash.checkpoint.load_dflash` builds it: fc, the norms
    and the draft's own layer stack [n, ...] (dense; the embedding and head are the target's)."""
    h, f, plain = c.hidden_size, c.intermediate_size, shapes.plain
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    layer = {
        "input_norm": plain(h),
        "post_attn_norm": plain(h),
        "attn": {
            "q": plain(h, nh, hd),
            "k": plain(h, nkv, hd),
            "v": plain(h, nkv, hd),
            "o": plain(nh, hd, h),
            "q_norm": plain(hd),
            "k_norm": plain(hd),
        },
        "mlp": {"gate": plain(h, f), "up": plain(h, f), "down": plain(f, h)},
    }
    tree = {
        "fc": plain(len(c.capture) * h, h),
        "hidden_norm": plain(h),
        "norm": plain(h),
        "layers": shapes.stacked(layer, c.num_hidden_layers),
    }
    if c.draft_vocab_size is not None and c.draft_vocab_size != c.vocab_size:
        tree["lm_head"] = plain(h, c.draft_vocab_size)
        tree["draft_to_target"] = plain(c.draft_vocab_size, dtype=jnp.int32)
    return tree


def check_block_plan(c: Any, target_cfg: Any, k: int, title: str, most: int) -> None:
    """A block draft's ``check_plan``: its width and mask id against the target's, K against the
    ``most`` drafts its block proposes, its captured layers resolved."""
    if c.hidden_size != target_cfg.hidden_size or c.mask_token_id >= target_cfg.vocab_size:
        raise ValueError(
            f"the {title} draft has hidden_size {c.hidden_size} and mask id {c.mask_token_id}; the target "
            f"has hidden_size {target_cfg.hidden_size} and {target_cfg.vocab_size} tokens"
        )
    if k > most:
        raise ValueError(f"k {k}: a {title} block of {c.block_size} proposes at most {most}")
    if not c.capture:
        raise ValueError(f"the {title} draft config has no captured layers resolved")


def _check_plan(c: DFlashConfig, target_cfg, k: int) -> None:
    check_block_plan(c, target_cfg, k, "DFlash", c.block_size - 1)


def _recognises(raw: dict, reader) -> bool:
    from mtp_jax.drafts.dflash.checkpoint import is_dflash

    return is_dflash(raw, reader)


def _load(reader, raw, target_cfg, target_params, dtype, *, strict=False, mesh=None, **_):
    from mtp_jax.drafts.dflash.checkpoint import load_dflash

    return load_dflash(reader, raw, target_cfg, dtype, strict=strict, mesh=mesh, target_params=target_params)


def configure_block(
    draft_cfg: Any,
    k: int | None,
    options: Mapping[str, Any],
    *,
    title: str,
    anchor_drafts: bool,
    resize: Callable[[Any, int], Any],
) -> tuple[Any, int | None]:
    """A block draft's ``configure`` hook: ``block_size`` (a smaller block than the trained one,
    ``resize(draft_cfg, block)``, cheaper) and K, by default all the block proposes: block - 1
    drafts, or block when the anchor's own row proposes one too (``anchor_drafts``)."""
    block = options.get("block_size")
    trained = draft_cfg.block_size
    least = 1 if anchor_drafts else 2
    if block is not None:
        if isinstance(block, bool) or not isinstance(block, int) or not least <= block <= trained:
            raise InvalidRequestError(
                f"draft_block_size must be an integer in [{least}, {trained}] (the {title} draft was "
                f"trained on blocks of {trained}), got {block!r}"
            )
        draft_cfg = resize(draft_cfg, block)
    block = draft_cfg.block_size
    most = block if anchor_drafts else block - 1
    if k is None:
        return draft_cfg, most
    if isinstance(k, int) and not isinstance(k, bool) and k > most:
        raise InvalidRequestError(
            f"num_speculative_tokens={k}: a {title} block of {block} tokens proposes at most {most} drafts"
        )
    return draft_cfg, k


def _configure(
    draft_cfg: DFlashConfig, k: int | None, options: Mapping[str, Any]
) -> tuple[DFlashConfig, int | None]:
    return configure_block(
        draft_cfg,
        k,
        options,
        title="DFlash",
        anchor_drafts=False,
        resize=lambda cfg, block: dataclasses.replace(cfg, block_size=block),
    )


def param_logical(names: list[str], rank: int) -> tuple[str | None, ...]:
    """Its decoder layers sit in one stack [n, ...] (never split) inside the group; the rest
    (fc, norms) replicated."""
    if names[:1] == ["layers"]:
        return (None,) + layer_logical(names, rank - 1)
    return (None,) * rank


DRAFT = Draft(
    name="dflash",
    available=_available,
    capture=lambda ctx: tuple(ctx.draft_cfg.capture),
    init_state=init_context_cache,
    state_logical=context_cache_logical,
    extend_and_propose=_extend_and_propose,
    teacher_forced=_teacher_forced,
    layer_stacks=(("dflash", "layers"),),
    step_reads=_step_reads,
    abstract_params=_abstract_params,
    title="DFlash",
    params_group="dflash",
    param_logical=param_logical,
    config_class=DFlashConfig,
    check_plan=_check_plan,
    recognises=_recognises,
    parse_config=parse_dflash_draft,
    load=_load,
    configure=_configure,
    options=("block_size",),
    block_size=lambda draft_cfg: draft_cfg.block_size,
)
