"""EAGLE-3 draft: one Llama-style decoder layer over three fused target hidden states.

Row i pairs the target's features at position i (the residual stream of three captured layers,
concatenated low, mid, high) with the token at i+1, sits at rope position i, and predicts token
i+2 (docs/formats.md, "EAGLE-3 drafts")::

    g   = fc(cat(f_low, f_mid, f_high))            # [H]; a recycled draft state skips fc
    u   = cat(input_norm(embed(x_{i+1})), hidden_norm(g))   # [2H], EMBEDDING FIRST
    h1  = g + o(attn(q/k/v(u)))                    # residual g raw (hidden_norm(g) with
                                                   #   norm_before_residual); causal over the
                                                   #   draft's own paged K/V, its own rope
    h2  = h1 + mlp(post_attn_norm(h1))
    logits = lm_head(norm(h2))                     # over the draft vocabulary Vd

A chained step recycles the pre-norm ``h2`` (``norm(h2)`` with ``norm_output``) as the next
row's ``g``. Draft id j is target id ``draft_to_target[j]`` (the checkpoint's ``j + d2t[j]``);
everything the step sees is in target ids: logits over the target vocabulary with -inf outside
the draft's, so the draft distribution is exactly zero there.

The attention is Llama-style GQA with the draft's own rope, or DeepSeek's MLA (drafts for
DeepSeek-V3 / Kimi targets, told by their ``q_a_proj`` / ``kv_a_proj_with_mqa`` keys) with its own
YaRN rope and a paged latent cache, exactly the target's MLA (:mod:`mtp_jax.targets.deepseek_v3.mla`) on a 2H
input.

Parameters (``params["eagle3"]``; weights [in, out], head axes split out)::

    fc [n·Ht, H], hidden_norm [H], input_norm [H],
    attn: {q [2H, nh, hd], k [2H, nkv, hd], v [2H, nkv, hd], o [nh, hd, H]}
          (MLA: q_a [2H, r], q_a_norm, q_b, kv_a [2H, kv_lora + rope], kv_a_norm, k_b, v_b, o),
    post_attn_norm [H], mlp: {gate [H, f], up [H, f], down [f, H]}, norm [H], lm_head [H, Vd],
    draft_to_target int32 [Vd]   (absent: draft ids are target ids)
    embed [V, H]                 (absent: the target's embedding)

After each verification the draft re-runs over the accepted rows with the TARGET's features (not
its own recycled states), overwriting its cache there, then chains K drafts.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from mtp_jax.drafts.base import (
    Draft,
    Rows,
    StepReads,
    at_rows,
    chain_drafts,
    chained_passes,
    in_target_vocab,
)
from mtp_jax.drafts.eagle3.config import Eagle3Config, check_load_options, parse_eagle3_draft
from mtp_jax.gqa import gqa_dense, gqa_dense_chain
from mtp_jax.layers import rms_norm, rope_cos_sin, rope_frequencies, swiglu
from mtp_jax.param_bytes import nbytes, path_names
from mtp_jax.targets.base import Hidden, PagedAttention, head_logits
from mtp_jax.targets.deepseek_v3.mla import latent_rows, mla_dense, mla_dense_chain
from mtp_jax.targets.deepseek_v3.model import abstract_tree, attention_fn, attention_leaves, latent_width
from mtp_jax.targets.llama.model import attention, layer_logical, qkv, rope_tables


def fused_features(layers: jax.Array) -> jax.Array:
    """[n, b, t, Ht] captured layers -> [b, t, n·Ht], concatenated in capture order (low first)."""
    return jnp.concatenate(list(layers), axis=-1)


def eagle3_layer(
    params: dict,
    cfg: Eagle3Config,
    next_tokens: jax.Array,
    state: jax.Array,
    positions: jax.Array,
    *,
    features: bool,
    paged: PagedAttention | None = None,
    mesh: Mesh | None = None,
    attend: Callable[[dict, jax.Array], jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array, dict | None]:
    """The draft layer over rows (next_tokens [b, t], state [b, t, ·]) at rope ``positions`` [b, t].

    ``features``: ``state`` is fused target features [b, t, n·Ht] (fc applies) rather than a
    recycled draft state [b, t, H]. Without ``paged`` the rows attend causally among themselves
    (positions 0..t-1); with it they are written to and attend over the draft's paged K/V
    (``paged.pages`` {"k", "v"} [P, page, nkv, hd]). ``attend(attn params, u) -> out`` replaces
    the attention (training's chained levels, :func:`eagle3_chain_teacher_forced`).
    Returns (h2 [b, t, H] pre-norm, normed [b, t, H] = norm(h2), pages)."""
    p = params["eagle3"]
    eps = cfg.rms_norm_eps
    embed = p.get("embed", params["embed"])
    g = jnp.einsum("btc,cd->btd", state.astype(p["fc"].dtype), p["fc"]) if features else state
    e = rms_norm(embed[next_tokens], p["input_norm"], eps)
    hn = rms_norm(g.astype(e.dtype), p["hidden_norm"], eps)
    u = jnp.concatenate([e, hn], axis=-1)
    pages = None if paged is None else paged.pages
    if attend is not None:
        out = attend(p["attn"], u)
    elif cfg.mla is None:
        cos, sin = rope_tables(cfg, positions)
        out, pages = attention(p["attn"], u, cfg, cos, sin, positions, paged, pages, None, mesh)
    else:
        out, pages = attention_fn(cfg.mla, positions, paged, mesh)(p["attn"], u, pages)
    h1 = (hn if cfg.norm_before_residual else g.astype(e.dtype)) + out
    h2 = h1 + swiglu(rms_norm(h1, p["post_attn_norm"], eps), **p["mlp"])
    return h2, rms_norm(h2, p["norm"], eps), pages


def eagle3_logits(params: dict, cfg: Eagle3Config, normed: jax.Array) -> jax.Array:
    """Float32 logits [..., V] over the TARGET vocabulary from norm(h2) [..., H]: the draft head's
    Vd logits placed at their target ids, -inf at ids the draft cannot propose."""
    ids = params["eagle3"].get("draft_to_target")
    return in_target_vocab(draft_vocab_logits(params, normed), ids, cfg.vocab_size)


def draft_vocab_logits(params: dict, normed: jax.Array) -> jax.Array:
    """Float32 logits [..., Vd] of the draft head over the draft vocabulary (draft ids)."""
    return head_logits(params["eagle3"]["lm_head"], normed)


def recycled(cfg: Eagle3Config, h2: jax.Array, normed: jax.Array) -> jax.Array:
    """The state a chained step feeds back: pre-norm h2, or norm(h2) with ``norm_output``."""
    return normed if cfg.norm_output else h2


def teacher_forced_logits(params: dict, cfg: Eagle3Config, tokens: jax.Array, hidden: Hidden) -> jax.Array:
    """First-step draft logits [b, T-1, V] for whole sequences tokens [b, T]: row i reads the target
    features at i with token i+1 and predicts token i+2 (causal over rows, no cache)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t - 1, dtype=jnp.int32), (b, t - 1))
    feats = fused_features(hidden.layers)[:, : t - 1]
    _, normed, _ = eagle3_layer(params, cfg, tokens[:, 1:], feats, positions, features=True)
    return eagle3_logits(params, cfg, normed)


def eagle3_chain_teacher_forced(
    params: dict, cfg: Eagle3Config, tokens: jax.Array, features: jax.Array, depth: int
) -> list[jax.Array]:
    """The draft chained ``depth`` times over whole sequences as speculative decoding chains it,
    true tokens standing in for the drafts: EAGLE-3's training-time test.

    tokens [b, s]; features [b, >= n, n_feat·Ht]: the fused target features (row i from tokens
    0..i). Rows i = 0..n-1, n = s - 1 - depth. Level 1 is the first draft step (features at i with
    token i+1, position i, predicts token i+2); level j > 1 feeds level j-1's recycled state back
    with token i+j at position i+j-1 and predicts token i+j+1. Attention follows the decode-time
    cache exactly: a level-j row sees the level-1 rows 0..i (what the catch-up wrote from target
    features), its own chain's rows at levels 2..j-1, and itself. Returns norm(h2) [b, n, H] per
    level (:func:`draft_vocab_logits` / :func:`eagle3_logits` turn them into logits); level j's
    predict tokens[:, j + 1 : j + 1 + n]."""
    b, s = tokens.shape
    n = s - 1 - depth
    if depth < 1 or n < 1:
        raise ValueError(f"depth {depth} needs sequences longer than {depth + 1} tokens, got {s}")
    rows = jnp.arange(n, dtype=jnp.int32)
    first: list = []  # level 1's keys and values (GQA) or latent rows (MLA)
    chain: list = []  # the same for each chained level so far

    def at(level: int) -> jax.Array:  # level j's rows sit at positions i + j - 1
        return jnp.broadcast_to(rows + level - 1, (b, n))

    def attend_at(level: int) -> Callable[[dict, jax.Array], jax.Array]:
        positions = at(level)
        if cfg.mla is None:
            cos, sin = rope_tables(cfg, positions)

            def gqa(p: dict, u: jax.Array) -> jax.Array:
                q, k, v = qkv(p, u, cos, sin)
                if level == 1:
                    first.append((k, v))
                    out = gqa_dense(q, k, v, cfg.softmax_scale)
                else:
                    chain.append((k, v))
                    ks, vs = (jnp.stack([c[i] for c in chain]) for i in (0, 1))
                    out = gqa_dense_chain(q, *first[0], ks, vs, cfg.softmax_scale)
                return jnp.einsum("bthk,hkd->btd", out, p["o"])

            return gqa
        m = cfg.mla
        inv_freq, magnitude = rope_frequencies(m.qk_rope_head_dim, m.rope_theta, m.rope_scaling)
        cos, sin = rope_cos_sin(positions, jnp.asarray(inv_freq), magnitude)

        def mla(p: dict, u: jax.Array) -> jax.Array:
            if level == 1:
                first.append(latent_rows(p, u, m, cos, sin))
                return mla_dense(p, u, m, cos, sin)
            earlier = jnp.stack(chain) if chain else jnp.zeros((0, *first[0].shape), first[0].dtype)
            out, own = mla_dense_chain(p, u, m, cos, sin, first[0], earlier)
            chain.append(own)
            return out

        return mla

    h2, normed, _ = eagle3_layer(
        params, cfg, tokens[:, 1 : 1 + n], features[:, :n], at(1), features=True, attend=attend_at(1)
    )
    levels = [normed]
    for j in range(2, depth + 1):
        state = recycled(cfg, h2, normed)
        h2, normed, _ = eagle3_layer(
            params, cfg, tokens[:, j : j + n], state, at(j), features=False, attend=attend_at(j)
        )
        levels.append(normed)
    return levels


# --- the draft interface (mtp_jax.drafts.base) ---------------------------------------------------
def _available(params: dict, cfg: object) -> str | None:
    if "eagle3" not in params:
        return "draft='eagle3' needs an EAGLE-3 draft loaded beside the target (load(..., draft_model=DIR))"
    return None


def _init_state(ctx, num_pages: int, dtype) -> dict | jax.Array:
    """The draft layer's paged cache on the target's page ids: K and V [P, page, nkv, hd] (GQA) or
    latent rows [P, page, kv_lora + rope] (MLA)."""
    c = ctx.draft_cfg
    if c.mla is not None:
        return jnp.zeros((num_pages, ctx.page_size, latent_width(c.mla)), dtype)
    shape = (num_pages, ctx.page_size, c.num_key_value_heads, c.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def _state_logical(names: list[str], rank: int) -> tuple[str | None, ...]:
    if names in (["k"], ["v"]):
        return ("pages", None, "kv_heads", None)
    return ("pages",) + (None,) * (rank - 1)  # MLA latent rows


def _rows(params, ctx, pages, page_table, next_tokens, state, positions, valid, features, tree=None):
    paged = PagedAttention.at(pages, page_table, positions, valid, ctx.page_size, tree)
    return eagle3_layer(
        params, ctx.draft_cfg, next_tokens, state, positions, features=features, paged=paged, mesh=ctx.mesh
    )


def _extend_and_propose(params, ctx, pages, page_table, rows: Rows, active, sampling, first_pos):
    """Write the committed rows (target features with the token after each) to the draft cache,
    then chain K drafts from the last one's output."""
    cfg = ctx.draft_cfg
    feats = fused_features(rows.hidden.layers)
    h2, normed, pages = _rows(
        params, ctx, pages, page_table, rows.next_tokens, feats, rows.positions, rows.valid, True
    )
    last_h2, last_normed = at_rows(h2, rows.last), at_rows(normed, rows.last)

    def advance(d, state, pages, position, tree):
        valid = jnp.broadcast_to(active[:, None], d.shape)
        h2, normed, pages = _rows(params, ctx, pages, page_table, d, state, position, valid, False, tree)
        return eagle3_logits(params, cfg, normed), recycled(cfg, h2, normed), pages

    first = eagle3_logits(params, cfg, last_normed)
    return chain_drafts(ctx, sampling, first_pos, first, recycled(cfg, last_h2, last_normed), pages, advance)


def _step_reads(params, cfg, draft_cfg, k: int, batch: int, positions: int, cache_itemsize: int) -> StepReads:
    """The layer once per pass, ``fc`` once (only the catch-up reads target features), its own head
    over the draft vocabulary once per draft, its paged K/V (or latent) cache read by every pass."""
    passes = chained_passes(k, batch)
    weights = heads = 0.0
    tree = params["eagle3"]
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = path_names(path)[0]
        size = nbytes(leaf)
        if name in ("lm_head", "draft_to_target"):
            heads += k * size
        elif name == "embed":
            weights += size / leaf.shape[0] * sum(min(n, leaf.shape[0]) for n in passes)
        elif name == "fc":
            weights += size
        else:
            weights += k * size
    c = draft_cfg
    per_token = 2 * c.num_key_value_heads * c.head_dim if c.mla is None else latent_width(c.mla)
    kv = k * positions * per_token * cache_itemsize
    return StepReads(weights, 0.0, heads, float(kv), () if "embed" in tree else tuple(passes), 0)


def _abstract_params(c: Eagle3Config, shapes) -> dict:
    """``params["eagle3"]`` as :func:`mtp_jax.drafts.eagle3.checkpoint.load_eagle3` builds it (dense: drafts
    are published in bf16): the target's embedding, or its own when the draft is narrower or wider
    than the target, and a ``draft_to_target`` map when the draft vocabulary is smaller than the
    target's."""
    h, f, plain = c.hidden_size, c.intermediate_size, shapes.plain
    if c.mla is None:
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        attn = {"q": plain(2 * h, nh, hd), "k": plain(2 * h, nkv, hd), "v": plain(2 * h, nkv, hd)}
        attn["o"] = plain(nh, hd, h)
    else:
        attn = abstract_tree(c.mla, attention_leaves(c.mla, 2 * h), shapes.dense(c.mla))["attn"]
    tree = {
        "fc": plain(len(c.capture) * c.target_hidden_size, h),
        "hidden_norm": plain(h),
        "input_norm": plain(h),
        "post_attn_norm": plain(h),
        "attn": attn,
        "mlp": {"gate": plain(h, f), "up": plain(h, f), "down": plain(f, h)},
        "norm": plain(h),
        "lm_head": plain(h, c.draft_vocab_size),
    }
    if c.hidden_size != c.target_hidden_size:  # an embedding of its own width (one of the target's
        # width is kept only when its values differ from the target's: not known from the config)
        tree["embed"] = plain(c.vocab_size, h)
    if c.draft_vocab_size < c.vocab_size:
        tree["draft_to_target"] = plain(c.draft_vocab_size, dtype=jnp.int32)
    return tree


def _check_plan(c: Eagle3Config, target_cfg, k: int) -> None:
    if c.target_hidden_size != target_cfg.hidden_size or c.vocab_size != target_cfg.vocab_size:
        raise ValueError(
            f"the EAGLE-3 draft reads hidden states of width {c.target_hidden_size} over a vocabulary of "
            f"{c.vocab_size}; the target has {target_cfg.hidden_size} and {target_cfg.vocab_size}"
        )
    if not c.capture:
        raise ValueError("the draft config has no captured layers resolved (eagle3_capture)")


def _recognises(raw: dict, reader) -> bool:
    from mtp_jax.drafts.dflash.checkpoint import is_dflash
    from mtp_jax.drafts.eagle3.checkpoint import is_eagle3

    return is_eagle3(raw, reader) and not is_dflash(raw, reader)  # a DFlash draft has an fc too


def _load(reader, raw, target_cfg, target_params, dtype, *, options, strict=False, mesh=None, **_):
    from mtp_jax.drafts.eagle3.checkpoint import load_eagle3

    layer_ids = check_load_options(options)
    return load_eagle3(
        reader, raw, target_cfg, target_params, dtype, layer_ids=layer_ids, strict=strict, mesh=mesh
    )


def _param_logical(names: list[str], rank: int) -> tuple[str | None, ...]:
    """Its decoder layer split as a target layer; its own head vocabulary-parallel."""
    if rank == 2 and names == ["lm_head"]:
        return (None, "vocab")
    return layer_logical(names, rank)


DRAFT = Draft(
    name="eagle3",
    cache_lookahead=1,
    trees=True,
    available=_available,
    capture=lambda ctx: tuple(ctx.draft_cfg.capture),
    init_state=_init_state,
    state_logical=_state_logical,
    extend_and_propose=_extend_and_propose,
    teacher_forced=lambda params, ctx, tokens, hidden: teacher_forced_logits(
        params, ctx.draft_cfg, tokens, hidden
    ),
    step_reads=_step_reads,
    abstract_params=_abstract_params,
    title="EAGLE-3",
    params_group="eagle3",
    param_logical=_param_logical,
    config_class=Eagle3Config,
    check_plan=_check_plan,
    recognises=_recognises,
    parse_config=parse_eagle3_draft,
    load=_load,
    load_options=("layer_ids",),
)
