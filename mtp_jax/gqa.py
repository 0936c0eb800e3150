"""Grouped-query attention (Llama 3): H query heads share Hkv key/value heads, query head h reading
KV head ``h // (H / Hkv)``.

- :func:`gqa_dense`: causal attention over a whole sequence, no cache (teacher-forced scoring,
  training).
- :func:`gqa_dense_chain`: chained draft rows over a first level's keys and their own chain, the
  decode-time cache pattern of a chained draft, all rows at once (training).
- :func:`gqa_paged`: writes the new tokens' keys and values into the paged cache, then attends over
  each row's cache up to each query's position (decode, verification, prefill). The cache holds
  K and V per layer as pages [P, page, Hkv, d] (a stack [L, P, page, Hkv, d] with a layer index).

Scores and softmax in float32; probabilities cast to the activation dtype for the value product,
as transformers does.

On a mesh (:func:`gqa_paged` with ``mesh``) the paged attention runs under ``shard_map``: rows and
their pages over the row axes (every device attends for its own rows against its own pages, no
page crosses devices), query heads over ``tensor``, and KV heads over ``tensor`` too when they
divide it; otherwise every device keeps all KV heads and reads the one its query heads share.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from mtp_jax.cache import localize, write_rows
from mtp_jax.sharding import ROW_AXES, shard_index, spec_entry, split_axes
from pallas_kernels.paged import QUERY_CHUNK, attend_paged, check_tree, gather_pages, visible_keys

NEG_INF = float("-inf")


def _grouped(q: jax.Array, kv_heads: int) -> jax.Array:
    """[b, t, H, d] -> [b, t, Hkv, H/Hkv, d]: query heads grouped by the KV head they read."""
    b, t, h, d = q.shape
    return q.reshape(b, t, kv_heads, h // kv_heads, d)


def _softmax(scores: jax.Array, visible: jax.Array, dtype, axis: int = -1) -> jax.Array:
    """softmax over the key axis ``axis`` of float32 ``scores`` where ``visible`` (broadcastable),
    cast to ``dtype``; rows that see no key get all-zero probabilities (no NaN)."""
    scores = jnp.where(visible, scores, NEG_INF)
    m = jnp.max(scores, axis=axis, keepdims=True)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = jnp.sum(p, axis=axis, keepdims=True)
    return (p / jnp.where(denom > 0, denom, 1.0)).astype(dtype)


def _softmax_values(scores: jax.Array, visible: jax.Array, values: jax.Array, dtype) -> jax.Array:
    """softmax(scores) @ values over the key axis; scores [b, t, k, g, s] float32, visible
    broadcastable to it, values [b, s, k, d]. Rows that see no key output zeros."""
    probs = _softmax(scores, visible, dtype)
    out = jnp.einsum("btkgs,bskd->btkgd", probs, values.astype(dtype), preferred_element_type=jnp.float32)
    b, t, k, g, d = out.shape
    return out.reshape(b, t, k * g, d).astype(dtype)


def gqa_dense(
    q: jax.Array, k: jax.Array, v: jax.Array, scale: float, window: jax.Array | int | None = None
) -> jax.Array:
    """Causal attention: q [b, t, H, d], k/v [b, t, Hkv, d] (positions 0..t-1) -> [b, t, H, d].
    ``window``: each query sees only the last ``window`` positions, itself included (sliding-window
    attention; data, so a global layer of the same program passes a size past any position)."""
    t = q.shape[1]
    qg = _grouped(q, k.shape[2])
    scores = jnp.einsum("btkgd,bskd->btkgs", qg, k, preferred_element_type=jnp.float32) * scale
    i = jnp.arange(t)[:, None]
    j = jnp.arange(t)[None, :]
    mask = j <= i
    if window is not None:
        mask = mask & (j > i - window)
    return _softmax_values(scores, mask[None, :, None, None, :], v, q.dtype)


def gqa_dense_chain(
    q: jax.Array,
    k_base: jax.Array,
    v_base: jax.Array,
    k_chain: jax.Array,
    v_chain: jax.Array,
    scale: float,
) -> jax.Array:
    """Attention of one chained level's rows as a chained draft runs them, for training.

    q [b, t, H, d]: row i of the level. Row i sees the first level's keys/values ``k_base`` /
    ``v_base`` [b, t, Hkv, d] at rows 0..i (in decoding: the cache rows the catch-up wrote) and
    row i of every chained level up to and including its own, ``k_chain`` / ``v_chain``
    [n, b, t, Hkv, d] (the rows its own chain wrote; the last is the level itself).
    Returns [b, t, H, d]."""
    t = q.shape[1]
    qg = _grouped(q, k_base.shape[2])  # [b, t, k, g, d]
    f32 = jnp.float32
    base = jnp.einsum("btkgd,bskd->btkgs", qg, k_base, preferred_element_type=f32) * scale
    base = jnp.where(jnp.tril(jnp.ones((t, t), bool))[None, :, None, None, :], base, NEG_INF)
    diag = jnp.einsum("btkgd,nbtkd->btkgn", qg, k_chain, preferred_element_type=f32) * scale
    probs = jax.nn.softmax(jnp.concatenate([base, diag], axis=-1), axis=-1).astype(q.dtype)
    v_base, v_chain = v_base.astype(q.dtype), v_chain.astype(q.dtype)
    out = jnp.einsum("btkgs,bskd->btkgd", probs[..., :t], v_base, preferred_element_type=f32)
    out += jnp.einsum("btkgn,nbtkd->btkgd", probs[..., t:], v_chain, preferred_element_type=f32)
    b, _, k, g, d = out.shape
    return out.reshape(b, t, k * g, d).astype(q.dtype)


def gqa_paged_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
    scale: float,
    layer: jax.Array | int | None = None,
    tree: tuple[jax.Array, jax.Array] | None = None,
    window: tuple[jax.Array, jax.Array | None] | None = None,
) -> jax.Array:
    """Attention of queries q [b, t, H, d] at absolute ``positions`` [b, t] against each row's
    paged keys and values (pages [P, page, Hkv, d], or layer ``layer`` of a stack): query (b, t)
    sees positions ``s <= positions[b, t]``; a negative position sees nothing and yields zeros.
    ``tree``: (base [b], nodes [b, t, N]), a token tree's tree attention
    (:func:`pallas_kernels.paged.visible_keys`). ``window``: (size, the queries' sequence positions
    or None), sliding-window attention (:func:`~pallas_kernels.paged.visible_keys`).

    Table entries past a row's needed pages may be garbage: they are clamped into range, the keys
    they point at are masked (a select, so a NaN score there becomes -inf) and their values zeroed
    (so a NaN there never reaches the output through a zero probability)."""
    num_pages = k_pages.shape[-4]
    table = jnp.clip(page_table, 0, num_pages - 1)
    # Head-major blocks [b, Hkv, s, d]: both products are plain batched matrix products over
    # (row, KV head), each KV head's t x g queries against its keys, with no transpose of the
    # gathered blocks (on a CPU 1.37x a 16-slot SmolLM2 step: docs/serving.md, "On a CPU").
    keys = gather_pages(k_pages, table, layer, by_head=True)
    values = gather_pages(v_pages, table, layer, by_head=True)
    b, t, h, d = q.shape
    kv_heads = keys.shape[1]
    g = h // kv_heads
    key_pos = jnp.arange(keys.shape[2], dtype=positions.dtype)
    visible = visible_keys(key_pos, positions, tree, window)  # [b, t, s]
    values = jnp.where(jnp.any(visible, axis=1)[:, None, :, None], values, 0)
    qh = q.reshape(b, t, kv_heads, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, t * g, d)
    # Keys on the left (their rows are the product's long side) and scores [b, Hkv, s, t * g].
    scores = jnp.einsum("bksd,bkqd->bksq", keys.astype(q.dtype), qh, preferred_element_type=jnp.float32)
    seen = jnp.repeat(visible, g, axis=1).transpose(0, 2, 1)[:, None]  # [b, 1, s, t * g]
    probs = _softmax(scores * scale, seen, q.dtype, axis=2)
    out = jnp.einsum("bksq,bksd->bkqd", probs, values.astype(q.dtype), preferred_element_type=jnp.float32)
    return out.reshape(b, kv_heads, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d).astype(q.dtype)


def _paged_local(q, k, v, pages, slots, page_table, positions, scale, layer, tree=None, window=None):
    pages = {
        "k": write_rows(pages["k"], k, slots, layer),
        "v": write_rows(pages["v"], v, slots, layer),
    }
    return _attend(q, positions, pages["k"], pages["v"], page_table, scale, layer, tree, window), pages


def _attend(q, positions, k_pages, v_pages, page_table, scale, layer, tree=None, window=None) -> jax.Array:
    """:func:`gqa_paged_reference` in chunks of queries (long prompts), each over the pages its
    queries can see (:func:`pallas_kernels.paged.attend_paged`); a tree's queries in one chunk
    (so a window's own query positions, given only with a tree, are never chunked)."""
    check_tree(tree, q, QUERY_CHUNK)

    def reference(q: jax.Array, table: jax.Array, positions: jax.Array) -> jax.Array:
        return gqa_paged_reference(q, k_pages, v_pages, table, positions, scale, layer, tree, window)

    return attend_paged(reference, q, page_table, positions, k_pages.shape[-3])


def check_tensor_split(heads: int, kv_heads: int, tensor: int) -> None:
    """ValueError unless query heads split evenly over ``tensor`` devices and each device's query
    heads read either its own KV heads (KV heads split too) or one shared KV head."""
    if heads % tensor:
        raise ValueError(f"mesh axis 'tensor'={tensor} does not divide the {heads} attention heads")
    if kv_heads % tensor and tensor % kv_heads:
        raise ValueError(
            f"mesh axis 'tensor'={tensor} and the {kv_heads} KV heads: one must divide the other (KV heads "
            "are split when the axis divides them, else replicated with each device reading one)"
        )


def gqa_paged(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pages: dict[str, jax.Array],
    slots: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
    scale: float,
    layer: jax.Array | int | None = None,
    mesh: Mesh | None = None,
    tree: tuple[jax.Array, jax.Array] | None = None,
    window: tuple[jax.Array, jax.Array | None] | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Write k/v [b, t, Hkv, d] at flat ``slots`` [b, t] of ``pages`` {"k", "v"} (layer ``layer`` of
    stacks [L, P, page, Hkv, d]; slots >= P·page are not written), then attend q [b, t, H, d] over
    the cache (:func:`gqa_paged_reference`, in chunks of queries for long prompts): every query sees
    itself and every earlier position of its row (with ``tree`` = (base [b], nodes [b, t, N]): of a
    token tree's node positions only those ``nodes`` marks, :func:`pallas_kernels.paged.visible_keys`;
    with ``window`` = (size, sequence positions [b, t] or None), only the last ``size`` positions).
    Returns (out [b, t, H, d], updated pages).

    With ``mesh``: split as the module docstring says; a row's pages must lie in its shard's range
    of page ids (:class:`mtp_jax.cache.ShardedPageAllocator` hands them out so)."""
    page_dim = 0 if layer is None else 1
    heads, kv_heads = q.shape[2], k.shape[2]
    rows = () if mesh is None else split_axes(mesh, ROW_AXES, q.shape[0], pages["k"].shape[page_dim])
    tensor = () if mesh is None else split_axes(mesh, ("tensor",), heads)
    if not rows and not tensor:
        return _paged_local(q, k, v, pages, slots, page_table, positions, scale, layer, tree, window)
    t_size = mesh.shape["tensor"] if tensor else 1
    check_tensor_split(heads, kv_heads, t_size)
    kv_split = tensor if kv_heads % t_size == 0 else ()
    page_size = pages["k"].shape[page_dim + 1]
    layer_arg = jnp.int32(0) if layer is None else jnp.asarray(layer, jnp.int32)

    def local(q, k, v, pages, slots, table, positions, layer_arg, tree, window):
        idx = None if layer is None else layer_arg
        if rows:
            n = pages["k"].shape[page_dim]
            table, slots = localize(table, slots, shard_index(mesh, rows) * n, n, page_size)
        if not tensor or kv_split:
            return _paged_local(q, k, v, pages, slots, table, positions, scale, idx, tree, window)
        # KV heads replicated: write them all, attend with the one this device's query heads share
        pages = {
            "k": write_rows(pages["k"], k, slots, idx),
            "v": write_rows(pages["v"], v, slots, idx),
        }
        shared = jax.lax.axis_index("tensor") * q.shape[2] // (heads // kv_heads)
        one = {name: jax.lax.dynamic_slice_in_dim(x, shared, 1, axis=x.ndim - 2) for name, x in pages.items()}
        return _attend(q, positions, one["k"], one["v"], table, scale, idx, tree, window), pages

    r, h, kv = spec_entry(rows), spec_entry(tensor), spec_entry(kv_split)
    act, kv_act = PartitionSpec(r, None, h, None), PartitionSpec(r, None, kv, None)
    cache = PartitionSpec(*([None] * page_dim), r, None, kv, None)
    row_spec = PartitionSpec(r, None)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(
            act,
            kv_act,
            kv_act,
            {"k": cache, "v": cache},
            row_spec,
            row_spec,
            row_spec,
            PartitionSpec(),
            None if tree is None else (PartitionSpec(r), PartitionSpec(r, None, None)),
            None if window is None else (PartitionSpec(), None if window[1] is None else row_spec),
        ),
        out_specs=(act, {"k": cache, "v": cache}),
    )(q, k, v, pages, slots, page_table, positions, layer_arg, tree, window)
