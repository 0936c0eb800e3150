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

from mtp_jax.config import DeepseekV3Config
from mtp_jax.layers import rms_norm
from mtp_jax.models.deepseek_v3 import PagedAttention, attention_fn, decoder_layer


def has_mtp(params: dict) -> bool:
    return "mtp" in params


class MtpOutput(NamedTuple):
    state: jax.Array
    """Recycled state g [b, t, d] (post shared_head.norm), the "hidden" of the next chained step."""
    logits: jax.Array
    """Float32 logits [b, t, V] for t_{i+2}."""
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
) -> MtpOutput:
    """MTP rows for next_tokens [b, t] (t_{i+1}) and hidden [b, t, d] (h_i) at positions [b, t] (i).

    Without ``paged`` the rows attend causally among themselves (teacher-forced, positions
    0..t-1); with it they are written to and attend over the MTP layer's paged cache
    (``paged.pages`` is its [P, page, c] pages). ``dispatch`` and ``mesh`` as in
    :func:`mtp_jax.models.deepseek_v3.forward`.
    """
    mp = jax.tree.map(lambda x: x[0], params["mtp"])
    eps = cfg.rms_norm_eps
    embed = mp.get("embed", params["embed"])
    head = mp.get("head", params["lm_head"])
    e = rms_norm(embed[next_tokens], mp["enorm"], eps)
    h = rms_norm(hidden.astype(e.dtype), mp["hnorm"], eps)
    x = jnp.einsum("btc,cd->btd", jnp.concatenate([e, h], axis=-1), mp["eh_proj"])
    attention = attention_fn(cfg, positions, paged, mesh)
    pages_in = None if paged is None else paged.pages
    y, pages, load = decoder_layer(mp["layer"], x, cfg, True, attention, pages_in, dispatch, mesh)
    g = rms_norm(y, mp["head_norm"], eps)
    logits = jnp.einsum("btd,dv->btv", g, head, preferred_element_type=jnp.float32)
    return MtpOutput(g, logits, pages, load)
