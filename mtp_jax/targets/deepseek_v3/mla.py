"""Multi-head latent attention (MLA), DeepSeek-V2/V3 style.

Per token the attention keeps a compressed latent ``c_kv`` [kv_lora] plus one rope key [rope]
shared by all heads; that [kv_lora + rope] row is all the paged cache stores. Two evaluations:

- :func:`mla_dense`: the expanded form (keys/values up-projected per head), causal over a whole
  sequence, no cache. Used for teacher-forced scoring and training (:func:`mla_dense_chain` is its
  variant for training a draft layer's chained uses with the decode-time attention pattern).
- :func:`mla_paged`: the absorbed form. ``q_nope·W_UK`` turns each head's query into latent space,
  attention runs directly against the cached latents, and ``W_UV`` is applied after the weighted
  sum. Writes the new tokens' rows into the paged cache first, then attends over the cache
  through :func:`pallas_kernels.mla_decode.mla_decode` (the Pallas kernel on a Hopper GPU, its jnp
  reference elsewhere).

Parameters of one layer (weights stored [in, out]):
``q_a`` [d, r], ``q_a_norm`` [r], ``q_b`` [r, h, qk] (or ``q`` [d, h, qk] without q-lora),
``kv_a`` [d, kv_lora + rope], ``kv_a_norm`` [kv_lora], ``k_b`` [kv_lora, h, nope],
``v_b`` [kv_lora, h, v], ``o`` [h, v, d]. Projections may be :class:`Fp8Weight` (dequantised on
use); ``k_b``/``v_b`` are always dense.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from mtp_jax.cache import localize, write_rows
from mtp_jax.fp8 import dense_einsum
from mtp_jax.layers import adapted, apply_rope_interleaved, rms_norm
from mtp_jax.sharding import ROW_AXES, axes_spec, shard_index, split_axes
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
from pallas_kernels.mla_decode import mla_decode

# DeepSeek's reference code builds q_a/kv_a norms with RMSNorm's default eps, not rms_norm_eps.
LORA_NORM_EPS = 1e-6

NEG_INF = float("-inf")


def _queries(p: dict, x: jax.Array, cfg: DeepseekV3Config, cos: jax.Array, sin: jax.Array):
    """Per-head queries split into (nope [b,t,h,nope], rope [b,t,h,rope]), rope applied (with the
    rows' LoRA adapters of ``p["lora"]``, when present: :func:`mtp_jax.layers.adapted`)."""
    lora = p.get("lora")
    if cfg.q_lora_rank is None:
        q = adapted(dense_einsum("btd,dhk->bthk", x, p["q"]), x, lora, "q")
    else:
        q_lat = adapted(dense_einsum("btd,dr->btr", x, p["q_a"]), x, lora, "q_a")
        q_lat = rms_norm(q_lat, p["q_a_norm"], LORA_NORM_EPS)
        q = adapted(dense_einsum("btr,rhk->bthk", q_lat, p["q_b"]), q_lat, lora, "q_b")
    q_nope, q_rope = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]
    return q_nope, apply_rope_interleaved(q_rope, cos, sin)


def latent_rows(p: dict, x: jax.Array, cfg: DeepseekV3Config, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """The cache rows [b, t, kv_lora + rope] of x: normed latent, then the rotated shared rope key."""
    ckv = adapted(dense_einsum("btd,dc->btc", x, p["kv_a"]), x, p.get("lora"), "kv_a")
    latent = rms_norm(ckv[..., : cfg.kv_lora_rank], p["kv_a_norm"], LORA_NORM_EPS)
    k_rope = apply_rope_interleaved(ckv[..., cfg.kv_lora_rank :], cos, sin)
    return jnp.concatenate([latent, k_rope], axis=-1)


def _expand(p: dict, rows: jax.Array, cfg: DeepseekV3Config):
    """Per-head keys and values of cache rows [..., c]: (k_nope [..., h, nope], v [..., h, v],
    shared rope key [..., rope])."""
    latent = rows[..., : cfg.kv_lora_rank]
    k_nope = jnp.einsum("...r,rhk->...hk", latent, p["k_b"])
    v = jnp.einsum("...r,rhk->...hk", latent, p["v_b"])
    lora = p.get("lora")
    if lora and "kv_b" in lora:  # rows [b, s, c]: the adapter's kv_b output, split as k_b / v_b
        both = adapted(jnp.concatenate([k_nope, v], axis=-1), latent, lora, "kv_b")
        k_nope, v = both[..., : cfg.qk_nope_head_dim], both[..., cfg.qk_nope_head_dim :]
    return k_nope, v, rows[..., cfg.kv_lora_rank :]


def _softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
    scores = jnp.where(mask, scores, NEG_INF)
    return jax.nn.softmax(scores, axis=-1)


def mla_dense(p: dict, x: jax.Array, cfg: DeepseekV3Config, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Causal self-attention over x [b, t, d] (positions 0..t-1 encoded in cos/sin); returns [b, t, d]."""
    q_nope, q_rope = _queries(p, x, cfg, cos, sin)
    k_nope, v, k_rope = _expand(p, latent_rows(p, x, cfg, cos, sin), cfg)
    f32 = jnp.float32
    scores = jnp.einsum("bthk,bshk->bhts", q_nope, k_nope, preferred_element_type=f32)
    scores += jnp.einsum("bthk,bsk->bhts", q_rope, k_rope, preferred_element_type=f32)
    t = x.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    probs = _softmax(scores * cfg.softmax_scale, causal).astype(x.dtype)
    out = jnp.einsum("bhts,bshk->bthk", probs, v)
    return adapted(dense_einsum("bthk,hkd->btd", out, p["o"]), out, p.get("lora"), "o", 2)


def mla_dense_chain(
    p: dict,
    x: jax.Array,
    cfg: DeepseekV3Config,
    cos: jax.Array,
    sin: jax.Array,
    base_rows: jax.Array,
    chain_rows: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Expanded attention of chained draft rows, as speculative decoding runs them, for training.

    x [b, t, d]: row i of one chained level (its positions encoded in cos/sin). Row i sees the
    first-level cache rows ``base_rows`` [b, t, c] 0..i (in decoding: what the catch-up wrote from
    the target's hidden states), row i of every earlier chained level ``chain_rows`` [n, b, t, c]
    (the rows its own chain wrote before it; n may be 0) and itself. Returns (out [b, t, d], the
    rows of x [b, t, c], to pass on as the next level's ``chain_rows``).
    """
    q_nope, q_rope = _queries(p, x, cfg, cos, sin)
    own = latent_rows(p, x, cfg, cos, sin)
    chain = jnp.concatenate([chain_rows.astype(own.dtype), own[None]], axis=0)  # [n + 1, b, t, c]
    f32 = jnp.float32
    k_base, v_base, rope_base = _expand(p, base_rows, cfg)
    k_chain, v_chain, rope_chain = _expand(p, chain, cfg)
    base = jnp.einsum("bthk,bshk->bhts", q_nope, k_base, preferred_element_type=f32)
    base += jnp.einsum("bthk,bsk->bhts", q_rope, rope_base, preferred_element_type=f32)
    diag = jnp.einsum("bthk,nbthk->bhtn", q_nope, k_chain, preferred_element_type=f32)
    diag += jnp.einsum("bthk,nbtk->bhtn", q_rope, rope_chain, preferred_element_type=f32)
    t, n = x.shape[1], chain.shape[0]
    mask = jnp.concatenate([jnp.tril(jnp.ones((t, t), bool)), jnp.ones((t, n), bool)], axis=-1)
    probs = _softmax(jnp.concatenate([base, diag], axis=-1) * cfg.softmax_scale, mask).astype(x.dtype)
    out = jnp.einsum("bhts,bshk->bthk", probs[..., :t], v_base)
    out += jnp.einsum("bhtn,nbthk->bthk", probs[..., t:], v_chain)
    return dense_einsum("bthk,hkd->btd", out, p["o"]), own


def mla_paged(
    p: dict,
    x: jax.Array,
    cfg: DeepseekV3Config,
    cos: jax.Array,
    sin: jax.Array,
    positions: jax.Array,
    slots: jax.Array,
    pages: jax.Array,
    page_table: jax.Array,
    layer: jax.Array | int | None = None,
    mesh: Mesh | None = None,
    tree: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Absorbed attention for x [b, t, d] at absolute positions [b, t] against the paged cache
    ``pages`` [P, page, c] (or layer ``layer`` of a stack [L, P, page, c], see :func:`write_rows`).

    Writes the new rows at ``slots`` first, so a token sees itself and every earlier position of
    its row; cache entries at later positions (stale drafts, unused pages) are masked out. With
    ``tree`` = (base [b], nodes [b, t, N]) a token tree's node positions are seen only where
    ``nodes`` marks them (tree attention, :func:`pallas_kernels.paged.visible_keys`).
    Returns (out [b, t, d], updated pages).

    With ``mesh`` the rows and the pages are split over the row axes
    (:data:`mtp_jax.sharding.ROW_AXES`, or the prefix of them that divides both) and every device
    attends for its rows against its own pages under ``shard_map``: the pages of a row must lie in
    its shard's range of page ids (:class:`mtp_jax.cache.ShardedPageAllocator` hands them out so).
    """
    page_dim = 0 if layer is None else 1
    axes = () if mesh is None else split_axes(mesh, ROW_AXES, x.shape[0], pages.shape[page_dim])
    if not axes:  # one device, or rows / pages that no row axis divides
        return _mla_paged_local(p, x, cfg, cos, sin, positions, slots, pages, page_table, layer, tree)
    page_size = pages.shape[page_dim + 1]
    layer_arg = jnp.int32(0) if layer is None else jnp.asarray(layer, jnp.int32)

    def local(p, lora, x, cos, sin, positions, slots, pages, table, layer_arg, tree):
        p = {**p, "lora": lora} if lora else p
        # global page ids -> this shard's: its pages are [base, base + n) of the global range
        n = pages.shape[page_dim]
        table, slots = localize(table, slots, shard_index(mesh, axes) * n, n, page_size)
        idx = None if layer is None else layer_arg
        return _mla_paged_local(p, x, cfg, cos, sin, positions, slots, pages, table, idx, tree)

    rows, page_spec = axes_spec(axes), axes_spec(axes, page_dim)
    weights = {k: v for k, v in p.items() if k != "lora"}
    lora = p.get("lora") or {}  # the adapters' slots replicated, the rows' one-hot split with the rows
    lora_spec = {k: rows if k == "rows" else PartitionSpec() for k in lora}
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(
            PartitionSpec(),
            lora_spec,
            rows,
            rows,
            rows,
            rows,
            rows,
            page_spec,
            rows,
            PartitionSpec(),
            None if tree is None else (rows, rows),
        ),
        out_specs=(rows, page_spec),
    )(weights, lora, x, cos, sin, positions, slots, pages, page_table, layer_arg, tree)


def _mla_paged_local(p, x, cfg, cos, sin, positions, slots, pages, page_table, layer, tree=None):
    q_nope, q_rope = _queries(p, x, cfg, cos, sin)
    pages = write_rows(pages, latent_rows(p, x, cfg, cos, sin), slots, layer)
    # absorbed query [b, t, h, kv_lora + rope] against the cached rows, through the kernel dispatcher
    # (the Mosaic GPU kernel on Hopper, the jnp reference elsewhere; MTP_JAX_KERNELS forces one)
    q_latent = jnp.einsum("bthk,rhk->bthr", q_nope, p["k_b"])
    kv_b = (p.get("lora") or {}).get("kv_b")
    if kv_b is not None:  # absorbed through the adapter too: q · (k_b + a b_k)^T = q k_b^T + (q b_k^T) a^T
        a, b = kv_b["a"].astype(x.dtype), kv_b["b"].astype(x.dtype)  # [r, S, R], [S, R, h, nope + v]
        b_k, b_v = b[..., : cfg.qk_nope_head_dim], b[..., cfg.qk_nope_head_dim :]
        one_hot = p["lora"]["rows"].astype(x.dtype)[:, None, None, :, None]  # the rows' slots [b, 1, 1, S, 1]
        q_b = jnp.einsum("bthk,szhk->bthsz", q_nope, b_k) * one_hot
        q_latent = q_latent + jnp.einsum("bthsz,rsz->bthr", q_b, a)
    q = jnp.concatenate([q_latent, q_rope], axis=-1)
    out_latent = mla_decode(
        q.astype(pages.dtype),
        pages,
        page_table,
        positions,
        scale=cfg.softmax_scale,
        value_dim=cfg.kv_lora_rank,
        layer=layer,
        tree=tree,
    ).astype(x.dtype)
    out = jnp.einsum("bthr,rhk->bthk", out_latent, p["v_b"])
    if kv_b is not None:  # (o_latent · a) · b_v: the adapter's part of the values
        out = out + jnp.einsum(
            "bthsz,szhk->bthk", jnp.einsum("bthr,rsz->bthsz", out_latent, a) * one_hot, b_v
        )
    lora = p.get("lora")
    return adapted(dense_einsum("bthk,hkd->btd", out, p["o"]), out, lora, "o", 2), pages
