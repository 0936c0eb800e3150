"""Gemma 3 text decoder forward pass over a parameter pytree.

Parameters (weights [in, out], per-head axes split out; a leading L axis on the layer stack)::

    embed [V, d]
    layers: {input_norm, post_attn_norm, pre_ffn_norm, post_ffn_norm [L, d],
             attn: {q [L, d, H, hd], k [L, d, Hkv, hd], v [L, d, Hkv, hd], o [L, H, hd, d],
                    q_norm [L, hd], k_norm [L, hd]},
             mlp: {gate [L, d, f], up [L, d, f], down [L, f, d]}}
    final_norm [d]
    lm_head [d, V]           (absent when the embedding is tied, as in every published Gemma 3)

Norm weights are kept as the hub stores them (w): every RMSNorm multiplies by ``1 + w`` in float32
before casting back (transformers' ``Gemma3RMSNorm``; llama.cpp's GGUF files store 1 + w, which its
reader turns back into w). The embedding output is scaled by sqrt(d) in the embedding's dtype.

Each decoder layer (a sandwich of norms around both blocks)::

    h += post_attn_norm(attn(input_norm(h)))
    h += post_ffn_norm(down(gelu_tanh(gate(x)) * up(x)))     x = pre_ffn_norm(h)

Attention: q/k RMSNorm'd per head, then rotate-half rope (base ``rope_local_base_freq`` on local
layers, ``rope_theta`` with optional linear scaling on global ones), scores scaled by
``query_pre_attn_scalar ** -0.5``, GQA. A local layer's query at position p sees keys at
p - window + 1 .. p (:func:`pallas_kernels.paged.visible_keys`); the per-layer window and rope
choice ride in the layer scan as data, so one compiled layer serves both kinds. The paged cache is
Llama's (``{"k", "v"}`` [L, P, page, Hkv, hd]) and keeps every page of every layer: a local layer
reads only its window of it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from mtp_jax.cache import slots_for
from mtp_jax.gqa import gqa_dense, gqa_paged
from mtp_jax.layers import apply_rope_half, llama3_frequencies, rope_cos_sin
from mtp_jax.sharding import ACTIVATION, constrain
from mtp_jax.targets.base import CapturePlan, Hidden, HubTensor, PagedAttention, scan_layers
from mtp_jax.targets.gemma3.config import Gemma3Config
from mtp_jax.targets.llama import model as llama
from mtp_jax.targets.llama.model import LayerLeaf, layer_leaves, leaves_tree
from pallas_kernels.paged import QUERY_CHUNK

__all__ = ["TARGET", "forward", "gemma_norm", "target_layer_leaves"]

GLOBAL_WINDOW = 1 << 30
"""The window size a global layer passes (past any position: it masks nothing)."""


def target_layer_leaves(cfg: Gemma3Config) -> tuple[LayerLeaf, ...]:
    """The tensors of one Gemma 3 decoder layer: Llama's with q/k norms, plus the norms after
    attention and around the MLP (transformers' ``pre_feedforward_layernorm`` and
    ``post_feedforward_layernorm``; its ``post_attention_layernorm`` is a true post-attention norm
    here, applied to the attention's output before the residual add)."""
    base = layer_leaves(
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        qk_norm=True,
    )
    d = cfg.hidden_size

    def norm(path: str, hub: str) -> LayerLeaf:
        return LayerLeaf((path,), f"{hub}.weight", (d,), (d,), "norm", (None,), "norms")

    return base + (
        norm("pre_ffn_norm", "pre_feedforward_layernorm"),
        norm("post_ffn_norm", "post_feedforward_layernorm"),
    )


def norm_factor(weight: Any) -> Any:
    """The per-channel factor of a stored Gemma norm weight w: 1 + w (``Target.norm_scale``)."""
    return 1.0 + weight


def gemma_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: ``x / rms(x) * (1 + weight)`` in float32, cast back to x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * norm_factor(weight.astype(jnp.float32))).astype(x.dtype)


def _rope_tables(cfg: Gemma3Config, positions: jax.Array) -> tuple[tuple[jax.Array, jax.Array], ...]:
    """((cos, sin) of the local layers, (cos, sin) of the global layers), each [b, t, hd/2]."""
    local = llama3_frequencies(cfg.head_dim, cfg.rope_local_base_freq, None)
    full = llama3_frequencies(cfg.head_dim, cfg.rope_theta, None) / cfg.rope_linear_factor
    return (
        rope_cos_sin(positions, jnp.asarray(local, jnp.float32), 1.0),
        rope_cos_sin(positions, jnp.asarray(full, jnp.float32), 1.0),
    )


def _windows(cfg: Gemma3Config) -> tuple[np.ndarray, np.ndarray]:
    """Per layer: whether it slides [L] bool, and its window size [L] int32."""
    sliding = np.asarray(cfg.sliding, bool)
    return sliding, np.where(sliding, cfg.sliding_window, GLOBAL_WINDOW).astype(np.int32)


def _attention(
    p: dict,
    x: jax.Array,
    cfg: Gemma3Config,
    cos: jax.Array,
    sin: jax.Array,
    window: jax.Array | int | None,
    positions: jax.Array,
    paged: PagedAttention | None,
    attend: Callable | None,
) -> tuple[jax.Array, dict | None]:
    """The layer's attention over ``x``: dense and causal without ``paged``, else
    ``attend(q, k, v, window)`` -> (out, pages) over the paged cache."""
    eps = cfg.rms_norm_eps

    def project(name: str) -> jax.Array:
        return jnp.einsum("btd,dhk->bthk", x, p[name])

    q = apply_rope_half(gemma_norm(project("q"), p["q_norm"], eps), cos, sin)
    k = apply_rope_half(gemma_norm(project("k"), p["k_norm"], eps), cos, sin)
    v = project("v")
    pages = None
    if paged is None:
        out = gqa_dense(q, k, v, cfg.softmax_scale, window)
    else:
        out, pages = attend(q, k, v, window)
    return jnp.einsum("bthk,hkd->btd", out, p["o"]), pages


def _paged(cfg, positions, paged, pages, layer, mesh) -> Callable:
    """Attention over the layer's pages of the cache stacks ``pages`` (every page of every layer)."""

    def attend(q, k, v, window):
        seen, tree = paged.attention(positions)
        # with a tree the window is measured from each node's sequence (rotary) position
        win = None if window is None else (window, None if tree is None else positions)
        return gqa_paged(
            q, k, v, pages, paged.slots, paged.page_table, seen, cfg.softmax_scale, layer, mesh, tree, win
        )

    return attend


def _ring(cfg, positions, paged, rings, layer, mesh) -> Callable:
    """Attention of a sliding-window layer over its ring (layer ``layer`` of the ring stacks
    ``rings`` {"k", "v"}, read through ``paged.ring_table``), a chunk of at most ``QUERY_CHUNK``
    tokens at a time, each chunk's keys written before its queries read: a ring holds the window
    and one chunk (:func:`mtp_jax.step.ring_span`), so a long prompt's later chunks may overwrite
    what its earlier ones no longer need, never what they do. A chunk reads only the pages its
    queries' windows span (:func:`_window_pages`), not the row's whole table. With ``mesh``: rows
    and rings split over the row axes (a slot's ring lies in its shard's range of ring pages:
    :func:`mtp_jax.cache.ring_table` numbers them by slot, and the slots are split in blocks)."""
    page = rings["k"].shape[2]
    seen, tree = paged.attention(positions)
    written, valid, table = paged.written(positions), paged.valid, paged.ring_table

    def attend(q, k, v, window):
        def one(rings, q, k, v, seen, written, valid):
            slots = slots_for(table, written, valid, page)
            near, off = _window_pages(table, seen, valid, window + q.shape[1], page)
            # every mask compares positions: moved by the same offset, queries and keys see the same
            shifted = jnp.where(seen >= 0, seen - off[:, None], -1)
            moved = None if tree is None else (tree[0] - off, tree[1])
            win = (window, None if tree is None else positions - off[:, None])
            out, rings = gqa_paged(
                q, k, v, rings, slots, near, shifted, cfg.softmax_scale, layer, mesh, moved, win
            )
            return out, rings

        t = q.shape[1]
        if t <= QUERY_CHUNK:
            return one(rings, q, k, v, seen, written, valid)
        n = -(-t // QUERY_CHUNK)
        pad = n * QUERY_CHUNK - t

        def chunks(x, fill=0):
            x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
            return jnp.moveaxis(x.reshape(x.shape[0], n, QUERY_CHUNK, *x.shape[2:]), 1, 0)

        def body(rings, xs):
            out, rings = one(rings, *xs)
            return rings, out

        xs = (chunks(q), chunks(k), chunks(v), chunks(seen, -1), chunks(written), chunks(valid, False))
        after, out = jax.lax.scan(body, rings, xs)
        out = jnp.moveaxis(out, 0, 1)
        return out.reshape(out.shape[0], n * QUERY_CHUNK, *out.shape[3:])[:, :t], after

    return attend


def _window_pages(table: jax.Array, seen: jax.Array, valid: jax.Array, span: int, page: int):
    """(the pages [b, n] of ``table`` [b, W] holding the last ``span`` positions up to each row's
    furthest valid query in ``seen`` [b, t], n = ceil(span / page) + 1 (at most W), and the
    position [b] of the first of them): the keys a chunk of queries within ``span - window`` of each
    other reads through a window."""
    width = table.shape[1]
    n = min(width, -(-span // page) + 1)
    top = jnp.max(jnp.where(valid, seen, 0), axis=1) // page
    first = jnp.clip(top - n + 1, 0, width - n)
    index = first[:, None] + jnp.arange(n, dtype=first.dtype)[None, :]
    return jnp.take_along_axis(table, index, axis=1), first * page


def _decoder_layer(p, h, cfg, cos, sin, window, positions, paged, attend):
    eps = cfg.rms_norm_eps
    x = gemma_norm(h, p["input_norm"], eps)
    out, pages = _attention(p["attn"], x, cfg, cos, sin, window, positions, paged, attend)
    h = h + gemma_norm(out, p["post_attn_norm"], eps)
    x = gemma_norm(h, p["pre_ffn_norm"], eps)
    m = p["mlp"]
    g = jnp.einsum("btd,df->btf", x, m["gate"])
    u = jnp.einsum("btd,df->btf", x, m["up"])
    f = jnp.einsum("btf,fd->btd", jax.nn.gelu(g, approximate=True) * u, m["down"])
    return h + gemma_norm(f, p["post_ffn_norm"], eps), pages


def check_tree_window(cfg: Gemma3Config, paged: PagedAttention | None) -> None:
    """ValueError unless a token tree (its root and drafted nodes, N in all) fits every local
    layer's window: a node's ancestors are then never further than N - 1 positions back, inside
    the window (:func:`pallas_kernels.paged.visible_keys` lets a node see them without measuring)."""
    if paged is None or paged.tree is None or not any(cfg.sliding):
        return
    size = paged.tree.nodes.shape[-1]
    if size > cfg.sliding_window:
        raise ValueError(
            f"a token tree of {size - 1} drafted nodes (and its root) does not fit Gemma 3's sliding window "
            f"of {cfg.sliding_window} positions: use at most {cfg.sliding_window - 1} nodes"
        )


def forward(
    params: dict,
    cfg: Gemma3Config,
    tokens: jax.Array,
    positions: jax.Array,
    paged: PagedAttention | None = None,
    capture: tuple[int, ...] = (),
    mesh: Mesh | None = None,
    lora_slots: jax.Array | None = None,
) -> tuple[Hidden, dict | None]:
    """Run the decoder on tokens [b, t] at absolute positions [b, t], as the Llama family's
    :func:`mtp_jax.targets.llama.model.forward` does (teacher-forced without ``paged``; over the
    paged cache with it; ``capture``, ``mesh`` alike). Gemma 3 takes no LoRA adapters yet."""
    if lora_slots is not None and "lora" in params:
        raise ValueError("Gemma 3 takes no LoRA adapters yet")
    check_tree_window(cfg, paged)
    plan = CapturePlan(cfg.num_hidden_layers, capture)
    rope = _rope_tables(cfg, positions)
    embed = params["embed"]
    h = embed[tokens] * jnp.asarray(math.sqrt(cfg.hidden_size), embed.dtype)
    h = constrain(h, mesh, ACTIVATION)
    captured = plan.start(h)

    (cos_l, sin_l), (cos_g, sin_g) = rope

    def layer(carry, xs):
        h, captured, pages = carry
        p, slot, index, is_local, window = xs
        cos, sin = jnp.where(is_local, cos_l, cos_g), jnp.where(is_local, sin_l, sin_g)
        attend = None if paged is None else _paged(cfg, positions, paged, pages, index, mesh)
        h, pages = _decoder_layer(p, h, cfg, cos, sin, window, positions, paged, attend)
        h = constrain(h, mesh, ACTIVATION)
        if captured is not None:
            captured = jax.lax.dynamic_update_index_in_dim(captured, h, slot, 0)
        return (h, captured, pages), None

    sliding, windows = _windows(cfg)
    n = cfg.num_hidden_layers
    if paged is not None and paged.ring_table is not None:
        h, captured, pages = _ring_layers(params, cfg, h, captured, plan, rope, positions, paged, mesh)
    else:
        carry = (h, captured, None if paged is None else paged.pages)
        (h, captured, pages), _ = scan_layers(
            layer, carry, params["layers"], plan.slot_of, np.arange(n, dtype=np.int32), sliding, windows
        )
    hidden = Hidden(
        post_norm=gemma_norm(h, params["final_norm"], cfg.rms_norm_eps),
        pre_norm=h,
        layers=plan.finish(captured),
    )
    return hidden, pages


def _ring_layers(params, cfg, h, captured, plan, rope, positions, paged, mesh):
    """The layers over a ring cache (:func:`init_ring_cache`), unrolled: each layer's kind is
    static, its pages those of its own stack (the rings' or the global layers')."""
    stack = params["layers"]
    layers = stack if isinstance(stack, tuple) else None
    pages = dict(paged.pages)
    rings = {"k": pages.pop("ring_k"), "v": pages.pop("ring_v")}
    ordinal = {True: 0, False: 0}  # each kind's layers so far: the layer's index in its stack
    for i, local in enumerate(cfg.sliding):
        p = layers[i] if layers is not None else jax.tree.map(lambda x, i=i: x[i], stack)
        index = ordinal[local]
        ordinal[local] += 1
        if local:
            attend = _ring(cfg, positions, paged, rings, index, mesh)
        else:
            attend = _paged(cfg, positions, paged, pages, index, mesh)
        cos, sin = rope[0] if local else rope[1]
        window = cfg.sliding_window if local else None
        h, updated = _decoder_layer(p, h, cfg, cos, sin, window, positions, paged, attend)
        h = constrain(h, mesh, ACTIVATION)
        if local:
            rings = updated
        else:
            pages = updated
        if captured is not None:
            captured = captured.at[int(plan.slot_of[i])].set(h)
    return h, captured, {**pages, "ring_k": rings["k"], "ring_v": rings["v"]}


def init_ring_cache(cfg: Gemma3Config, num_pages: int, ring_pages: int, page_size: int, dtype) -> dict:
    """Zeroed pages: the global layers' K and V, each [Lg, num_pages, page, Hkv, hd] (``k``,
    ``v``), and the sliding-window layers' rings, each [Ll, ring_pages, page, Hkv, hd]
    (``ring_k``, ``ring_v``)."""
    local = sum(cfg.sliding)
    item = (page_size, cfg.num_key_value_heads, cfg.head_dim)
    full = (cfg.num_hidden_layers - local, num_pages, *item)
    ring = (local, ring_pages, *item)
    return {
        "k": jnp.zeros(full, dtype),
        "v": jnp.zeros(full, dtype),
        "ring_k": jnp.zeros(ring, dtype),
        "ring_v": jnp.zeros(ring, dtype),
    }


def hub_tensors(cfg: Gemma3Config) -> Iterator[HubTensor]:
    """Every tensor of a Gemma 3 hub checkpoint, with its tensor-parallel split."""
    d, v, n = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    yield HubTensor("embedding", (v, d), 1, "plain")
    yield HubTensor("norms", (d,), 1, "plain")  # model.norm
    splits = {"heads": "tensor", "ffn": "tensor", "kv_heads": "kv_heads"}
    for leaf in target_layer_leaves(cfg):
        split = next((splits[a] for a in leaf.logical if a), None)
        yield HubTensor(
            leaf.component, leaf.hub_shape, n, "linear" if leaf.kind == "linear" else "plain", split
        )
    if not cfg.tie_word_embeddings:
        yield HubTensor("lm_head", (v, d), 1, "plain", split="tensor")


def abstract_groups(cfg: Gemma3Config, shapes: Any, own_draft: bool = False) -> dict:
    """The parameter groups (one layer of the stack) built with ``shapes`` (:mod:`mtp_jax.plan`)."""
    d = cfg.hidden_size
    out = {
        "embed": shapes.plain(cfg.vocab_size, d),
        "layers": leaves_tree(target_layer_leaves(cfg), lambda leaf: shapes.plain(*leaf.shape)),
        "final_norm": shapes.plain(d),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head"] = shapes.plain(d, cfg.vocab_size)
    return out


def _describe(cfg: Gemma3Config) -> list[str]:
    local = sum(cfg.sliding)
    rope = f"rope_theta {cfg.rope_theta:g} (global), {cfg.rope_local_base_freq:g} (local)"
    if cfg.rope_linear_factor != 1.0:
        rope += f", linear scaling x{cfg.rope_linear_factor:g} (global)"
    cap = (
        ""
        if cfg.final_logit_softcapping is None
        else f", logits soft-capped at {cfg.final_logit_softcapping:g}"
    )
    return [
        f"Model: {cfg.model_type} (Gemma 3)",
        f"  layers      {cfg.num_hidden_layers}: {local} local (sliding window {cfg.sliding_window}), "
        f"{cfg.num_hidden_layers - local} global",
        f"  attention   {cfg.num_attention_heads} heads, {cfg.num_key_value_heads} KV heads (GQA), "
        f"head_dim {cfg.head_dim}, {rope}",
        f"  hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, vocab {cfg.vocab_size}"
        + (", tied embeddings" if cfg.tie_word_embeddings else "")
        + cap,
    ]


TARGET = dataclasses.replace(
    llama.family_target("gemma3", Gemma3Config, title="Gemma 3"),
    forward=forward,
    layer_leaves=target_layer_leaves,
    hub_tensors=hub_tensors,
    abstract_groups=abstract_groups,
    lora_sites=lambda cfg: (),
    describe=_describe,
    norm_scale=norm_factor,
    logit_softcap=lambda cfg: cfg.final_logit_softcapping,
    sliding_window=lambda cfg: cfg.sliding_window if any(cfg.sliding) else None,
    init_ring_cache=init_ring_cache,
)
"""Llama's cache, mesh checks and tensor-parallel layout (the same projections split the same way);
Gemma's forward, layers and head."""
