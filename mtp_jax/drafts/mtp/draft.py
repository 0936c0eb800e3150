"""DeepSeek MTP / NextN draft: the checkpoint's extra layer ``model.layers.{N}``, reused K times.

Row i of the MTP layer combines the target's post-final-norm hidden state h_i with the embedding
of the next token t_{i+1} (embedding FIRST in the concat)::

    x_i = eh_proj(concat[enorm(embed(t_{i+1})), hnorm(h_i)])
    y_i = decoder_layer(x_i)            # MoE layer with its own paged latent cache, rope position i
    g_i = shared_head.norm(y_i)         # recycled as "h" for the next chained draft step
    logits_i = shared_head.head(g_i)    # predicts t_{i+2}

The embedding and head are the target's unless the checkpoint's MTP copies differ from them.
Attention is causal over the MTP layer's own rows. Only the first MTP layer is used (checkpoints
with several, e.g. ``num_nextn_predict_layers: 2``, could chain them; none is published).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from mtp_jax.drafts.base import Draft, Rows, StepReads, at_rows, chain_drafts, chained_passes
from mtp_jax.layers import rms_norm, rope_cos_sin, rope_frequencies
from mtp_jax.param_bytes import expected_experts, is_routed_expert, nbytes, path_names
from mtp_jax.targets.base import head_logits
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
from mtp_jax.targets.deepseek_v3.mla import latent_rows, mla_dense, mla_dense_chain
from mtp_jax.targets.deepseek_v3.model import PagedAttention, attention_fn, decoder_layer, latent_width


def has_mtp(params: dict) -> bool:
    return "mtp" in params


class MtpOutput(NamedTuple):
    state: jax.Array
    """Recycled state g [b, t, d] (post shared_head.norm), the "hidden" of the next chained step."""
    logits: jax.Array | None
    """Float32 logits [b, t, V] for t_{i+2} (None when not asked for: see :func:`mtp_logits`)."""
    pages: jax.Array | None
    """The MTP layer's updated pages (None without a cache)."""
    expert_load: jax.Array
    """Tokens routed to each of the layer's experts [e]."""


def mtp_forward(
    params: dict,
    cfg: DeepseekV3Config,
    next_tokens: jax.Array,
    hidden: jax.Array,
    positions: jax.Array,
    paged: PagedAttention | None = None,
    dispatch: str = "auto",
    mesh: Mesh | None = None,
    logits: bool = True,
) -> MtpOutput:
    """MTP rows for next_tokens [b, t] (t_{i+1}) and hidden [b, t, d] (h_i) at positions [b, t] (i).

    Without ``paged`` the rows attend causally among themselves (teacher-forced, positions
    0..t-1); with it they are written to and attend over the MTP layer's paged cache
    (``paged.pages`` is its [P, page, c] pages). ``dispatch`` and ``mesh`` as in
    :func:`mtp_jax.targets.deepseek_v3.model.forward`. ``logits=False`` skips the output head: a caller
    that needs one row per sequence (the prompt's last, the last accepted) picks those states and
    applies :func:`mtp_logits` to them alone.
    """
    attention = attention_fn(cfg, positions, paged, mesh)
    pages_in = None if paged is None else paged.pages
    return _mtp_layer(params, cfg, next_tokens, hidden, attention, pages_in, dispatch, mesh, logits)


def mtp_logits(params: dict, g: jax.Array) -> jax.Array:
    """Float32 logits [..., V] for t_{i+2} from MTP states g [..., d]: the layer's shared head (the
    target's output head unless the checkpoint's MTP copy differs)."""
    head = params["mtp"]["head"][0] if "head" in params["mtp"] else params["lm_head"]
    return head_logits(head, g)


def _mtp_layer(params, cfg, next_tokens, hidden, attention, pages, dispatch, mesh, logits=True) -> MtpOutput:
    mp = jax.tree.map(lambda x: x[0], params["mtp"])
    eps = cfg.rms_norm_eps
    embed = mp.get("embed", params["embed"])
    e = rms_norm(embed[next_tokens], mp["enorm"], eps)
    h = rms_norm(hidden.astype(e.dtype), mp["hnorm"], eps)
    x = jnp.einsum("btc,cd->btd", jnp.concatenate([e, h], axis=-1), mp["eh_proj"])
    y, pages, load = decoder_layer(mp["layer"], x, cfg, True, attention, pages, dispatch, mesh)
    g = rms_norm(y, mp["head_norm"], eps)
    return MtpOutput(g, mtp_logits(params, g) if logits else None, pages, load)


def mtp_chain_teacher_forced(
    params: dict,
    cfg: DeepseekV3Config,
    tokens: jax.Array,
    hidden: jax.Array,
    depth: int,
    dispatch: str = "auto",
) -> list[MtpOutput]:
    """The MTP layer chained ``depth`` times over whole sequences, as speculative decoding chains
    it, with true tokens in place of drafts (teacher forcing), for training the later draft positions.

    tokens [b, s]; hidden [b, >= n, d]: the target's post-norm hidden states, h_i from tokens[:, :i + 1].
    Rows i = 0..n-1, n = s - 1 - depth. Level 1 is :func:`mtp_forward` (h_i with t_{i+1}, predicts
    t_{i+2}); level j > 1 feeds level j-1's state g back with t_{i+j}, at position i + j - 1, and
    predicts t_{i+j+1}. Attention follows the decode-time cache exactly: a level-j row sees the
    level-1 rows 0..i, the rows of its own chain at levels 2..j-1, and itself
    (:func:`mtp_jax.targets.deepseek_v3.mla.mla_dense_chain`). Returns one :class:`MtpOutput` per level (rows
    [b, n],
    ``pages`` None); level j's logits are for tokens[:, j + 1 : j + 1 + n].
    """
    b, s = tokens.shape
    n = s - 1 - depth
    if depth < 1 or n < 1:
        raise ValueError(f"depth {depth} needs sequences longer than {depth + 1} tokens, got {s}")
    inv_freq, magnitude = rope_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    rows = jnp.arange(n, dtype=jnp.int32)

    def rope_at(level: int):  # level j's rows sit at positions i + j - 1
        return rope_cos_sin((rows + level - 1)[None], jnp.asarray(inv_freq), magnitude)

    first_level: list[jax.Array] = []

    def level_one(p, x, pages, layer=None):
        cos, sin = rope_at(1)
        first_level.append(latent_rows(p, x, cfg, cos, sin))
        return mla_dense(p, x, cfg, cos, sin), pages

    outs = [_mtp_layer(params, cfg, tokens[:, 1 : 1 + n], hidden[:, :n], level_one, None, dispatch, None)]
    chain = jnp.zeros((0, b, n, first_level[0].shape[-1]), first_level[0].dtype)
    for j in range(2, depth + 1):
        own: list[jax.Array] = []

        def chained(p, x, pages, layer=None, j=j, chain=chain, own=own):
            cos, sin = rope_at(j)
            out, rows_j = mla_dense_chain(p, x, cfg, cos, sin, first_level[0], chain)
            own.append(rows_j)
            return out, pages

        state = outs[-1].state
        outs.append(_mtp_layer(params, cfg, tokens[:, j : j + n], state, chained, None, dispatch, None))
        chain = jnp.concatenate([chain, own[0][None]], axis=0)
    return outs


# --- the draft interface (mtp_jax.drafts.base) ---------------------------------------------------
def _available(params: dict, cfg: object) -> str | None:
    if not isinstance(cfg, DeepseekV3Config):
        return f"the MTP draft is DeepSeek-V3's NextN layer; this model is {type(cfg).__name__}"
    if not has_mtp(params):
        return (
            "draft='mtp' needs a checkpoint with an MTP layer (num_nextn_predict_layers > 0, loaded with "
            "mtp=True)"
        )
    return None


def _init_state(ctx, num_pages: int, dtype) -> jax.Array:
    """The MTP layer's own paged latent cache [P, page, c], on the target's page ids."""
    return jnp.zeros((num_pages, ctx.page_size, latent_width(ctx.cfg)), dtype)


def _state_logical(names: list[str], rank: int) -> tuple[str | None, ...]:
    return ("pages",) + (None,) * (rank - 1)


def _layer_rows(params, ctx, pages, page_table, next_tokens, hidden, positions, valid, tree=None):
    """The MTP layer over rows written to its paged cache (``tree``: a token tree's nodes,
    :meth:`~mtp_jax.targets.base.PagedAttention.at`): (states g [b, t, d], pages). No head: drafts read it
    at one state per row (:func:`_propose`)."""
    paged = PagedAttention.at(pages, page_table, positions, valid, ctx.page_size, tree)
    out = mtp_forward(params, ctx.cfg, next_tokens, hidden, positions, paged, mesh=ctx.mesh, logits=False)
    return out.state, out.pages


def _extend_and_propose(params, ctx, pages, page_table, rows: Rows, active, sampling, first_pos):
    """MTP row i pairs the target's post-norm h_i with token i+1 (``rows.next_tokens``): write the
    committed rows to the MTP cache, then chain K drafts from the last one's state (the head runs
    there alone)."""
    g, pages = _layer_rows(
        params, ctx, pages, page_table, rows.next_tokens, rows.hidden.post_norm, rows.positions, rows.valid
    )
    g = at_rows(g, rows.last)

    def advance(d, g, pages, position, tree):
        valid = jnp.broadcast_to(active[:, None], d.shape)
        g, pages = _layer_rows(params, ctx, pages, page_table, d, g, position, valid, tree)
        return mtp_logits(params, g), g, pages

    return chain_drafts(ctx, sampling, first_pos, mtp_logits(params, g), g, pages, advance)


def teacher_forced_logits(params: dict, cfg: DeepseekV3Config, tokens: jax.Array, hidden) -> jax.Array:
    """First-step MTP logits [b, T-1, V]: row i pairs the target's post-norm h_i with token i+1."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t - 1, dtype=jnp.int32), (b, t - 1))
    return mtp_forward(params, cfg, tokens[:, 1:], hidden.post_norm[:, : t - 1], positions).logits


def _step_reads(params, cfg, draft_cfg, k: int, batch: int, positions: int, cache_itemsize: int) -> StepReads:
    """K passes of the MTP layer (each with the experts of its own tokens), its head once per
    draft (the target's when it has none), its latent cache read by every pass."""
    passes = chained_passes(k, batch)
    e, top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
    weights = experts = heads = 0.0
    own_head = False
    for path, leaf in jax.tree_util.tree_flatten_with_path(params["mtp"])[0]:
        names = ["mtp", *path_names(path)]
        size = nbytes(leaf)
        if names[1] == "head":
            own_head = True
            heads += k * size
        elif names[1] == "embed":
            weights += size / leaf.shape[1] * sum(min(n, leaf.shape[1]) for n in passes)
        elif is_routed_expert(names):
            experts += sum(size * expected_experts(n, e, top_k) / e for n in passes)
        else:
            weights += k * size
    kv = k * positions * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cache_itemsize
    return StepReads(weights, experts, heads, float(kv), tuple(passes), 0 if own_head else k)


DRAFT = Draft(
    name="mtp",
    cache_lookahead=1,
    trees=True,
    title="MTP",
    available=_available,
    capture=lambda ctx: (),
    init_state=_init_state,
    state_logical=_state_logical,
    extend_and_propose=_extend_and_propose,
    teacher_forced=lambda params, ctx, tokens, hidden: teacher_forced_logits(params, ctx.cfg, tokens, hidden),
    step_reads=_step_reads,
    params_group="mtp",
)
