"""Llama 3 (3, 3.1, 3.2, 3.3) forward pass over a parameter pytree.

Parameters (weights [in, out], per-head axes split out; a leading L axis on the layer stack)::

    embed [V, d]
    layers: {input_norm [L, d], post_attn_norm [L, d],
             attn: {q [L, d, H, hd], k [L, d, Hkv, hd], v [L, d, Hkv, hd], o [L, H, hd, d]},
             mlp: {gate [L, d, f], up [L, d, f], down [L, f, d]}}
    final_norm [d]
    lm_head [d, V]           (absent when the embedding is tied: Llama 3.2 1B / 3B)

Each decoder layer: ``h += o(attn(rope(q), rope(k), v))`` on ``input_norm(h)``, then
``h += swiglu(post_attn_norm(h))``; rotate-half rope on the whole head with Llama's own
frequencies (:func:`mtp_jax.layers.llama3_frequencies`), GQA (:mod:`mtp_jax.gqa`), RMSNorm in
float32. The layers run under ``lax.scan``. The paged cache is ``{"k", "v"}``, each
[L, P, page, Hkv, hd].

Layer numbering for captured hidden states: layer i means the output of decoder layer i
(transformers' ``hidden_states[i + 1]``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from mtp_jax.gqa import check_tensor_split, gqa_dense, gqa_paged
from mtp_jax.layers import adapted, apply_rope_half, llama3_frequencies, rms_norm, rope_cos_sin, swiglu
from mtp_jax.lora import LoraSite, split_leaf
from mtp_jax.sharding import ACTIVATION, MESH_AXES, constrain, register_group_layout
from mtp_jax.targets.base import (
    CapturePlan,
    Hidden,
    HubTensor,
    PagedAttention,
    Target,
    lora_stack,
    scan_layers,
    with_lora,
)
from mtp_jax.targets.llama.config import Llama3Config

__all__ = [
    "TARGET",
    "LayerLeaf",
    "attention",
    "decoder_layer",
    "family_target",
    "forward",
    "init_cache",
    "layer_leaves",
    "leaves_tree",
    "qkv",
]


@dataclasses.dataclass(frozen=True)
class LayerLeaf:
    """One tensor of a Llama-family decoder layer, declared once: the loader, the exporter, the
    synthetic checkpoints, ``plan``'s abstract parameters, the size estimate and the shardings are
    all read off :func:`layer_leaves`.

    ``path``: where it sits in our layer tree; ``hub``: its key under the layer's prefix
    (``model.layers.{i}.``); ``shape``: ours (one layer); ``hub_shape``: as stored ([out, in] for a
    projection, whose ours is its transpose reshaped: ``hub.T.reshape(shape)``); ``kind``:
    ``linear``, ``norm`` (a norm's weight, near 1) or ``bias``; ``logical``: our axes' logical names
    (:mod:`mtp_jax.sharding`); ``component``: its part of the model in the size estimate."""

    path: tuple[str, ...]
    hub: str
    shape: tuple[int, ...]
    hub_shape: tuple[int, ...]
    kind: str
    logical: tuple[str | None, ...]
    component: str


def layer_leaves(
    d: int,
    h: int,
    kv: int,
    hd: int,
    f: int,
    *,
    d_in: int | None = None,
    qkv_bias: bool = False,
    qk_norm: bool = False,
) -> tuple[LayerLeaf, ...]:
    """The tensors of one Llama-family decoder layer (width ``d``, ``h`` query and ``kv`` key/value
    heads of ``hd``, MLP width ``f``; attention inputs of width ``d_in``, default ``d``: an
    EAGLE-3 draft's read 2d), in hub order. ``qkv_bias``: q/k/v biases (Qwen2); ``qk_norm``: an
    RMSNorm over each query and key head before rope (Qwen3)."""
    d_in = d if d_in is None else d_in
    a = "self_attn."

    def proj(name: str, shape: tuple[int, ...], out: int, inp: int, logical: tuple) -> LayerLeaf:
        component = "attention" if name in "qkvo" else "dense_mlp"
        hub = f"{a}{name}_proj.weight" if component == "attention" else f"mlp.{name}_proj.weight"
        path = ("attn", name) if component == "attention" else ("mlp", name)
        return LayerLeaf(path, hub, shape, (out, inp), "linear", logical, component)

    leaves = [
        LayerLeaf(("input_norm",), "input_layernorm.weight", (d,), (d,), "norm", (None,), "norms"),
        proj("q", (d_in, h, hd), h * hd, d_in, (None, "heads", None)),
        proj("k", (d_in, kv, hd), kv * hd, d_in, (None, "kv_heads", None)),
        proj("v", (d_in, kv, hd), kv * hd, d_in, (None, "kv_heads", None)),
        proj("o", (h, hd, d), d, h * hd, ("heads", None, None)),
        LayerLeaf(
            ("post_attn_norm",), "post_attention_layernorm.weight", (d,), (d,), "norm", (None,), "norms"
        ),
        proj("gate", (d, f), f, d, (None, "ffn")),
        proj("up", (d, f), f, d, (None, "ffn")),
        proj("down", (f, d), d, f, ("ffn", None)),
    ]
    if qkv_bias:
        for name, heads, axis in (("q", h, "heads"), ("k", kv, "kv_heads"), ("v", kv, "kv_heads")):
            leaves.append(
                LayerLeaf(
                    ("attn", f"{name}_bias"),
                    f"{a}{name}_proj.bias",
                    (heads, hd),
                    (heads * hd,),
                    "bias",
                    (axis, None),
                    "attention",
                )
            )
    if qk_norm:
        for name in ("q", "k"):
            hub = f"{a}{name}_norm.weight"
            leaves.append(LayerLeaf(("attn", f"{name}_norm"), hub, (hd,), (hd,), "norm", (None,), "norms"))
    return tuple(leaves)


def leaves_tree(leaves: tuple[LayerLeaf, ...], value: Callable[[LayerLeaf], Any]) -> dict:
    """The layer tree with ``value(leaf)`` at each declared leaf's path."""
    out: dict = {}
    for leaf in leaves:
        node = out
        for name in leaf.path[:-1]:
            node = node.setdefault(name, {})
        node[leaf.path[-1]] = value(leaf)
    return out


def target_layer_leaves(cfg: Llama3Config) -> tuple[LayerLeaf, ...]:
    """:func:`layer_leaves` of a Llama-family target's decoder layers."""
    return layer_leaves(
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        qkv_bias=cfg.qkv_bias,
        qk_norm=cfg.qk_norm,
    )


_LOGICAL = {leaf.path: leaf.logical for leaf in layer_leaves(1, 1, 1, 1, 1, qkv_bias=True, qk_norm=True)}


def layer_logical(names: list[str], rank: int) -> tuple[str | None, ...]:
    """Logical axes of the leaf at path ``names`` of one Llama-family decoder layer, as
    :func:`layer_leaves` declares them (heads and MLP columns over ``tensor``); replicated when
    undeclared."""
    return _LOGICAL.get(tuple(names[-2:]), _LOGICAL.get(tuple(names[-1:]), (None,) * rank))


def qkv(
    p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, eps: float = 1e-6
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries [b, t, H, hd] and keys [b, t, Hkv, hd] with rope applied, values [b, t, Hkv, hd].
    The layer's tree decides the family's extras: ``{q,k,v}_bias`` added after the projection
    (Qwen2), ``{q,k}_norm`` an RMSNorm (epsilon ``eps``) over each head before rope (Qwen3)."""

    def project(name: str) -> jax.Array:
        y = adapted(jnp.einsum("btd,dhk->bthk", x, p[name]), x, p.get("lora"), name)
        if f"{name}_bias" in p:
            y = y + p[f"{name}_bias"].astype(y.dtype)
        if f"{name}_norm" in p:
            y = rms_norm(y, p[f"{name}_norm"], eps)
        return y

    return apply_rope_half(project("q"), cos, sin), apply_rope_half(project("k"), cos, sin), project("v")


def attention(
    p: dict,
    x: jax.Array,
    cfg: Llama3Config,
    cos: jax.Array,
    sin: jax.Array,
    positions: jax.Array,
    paged: PagedAttention | None,
    pages: dict | None,
    layer: jax.Array | int | None,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, dict | None]:
    """Self-attention of x [b, t, d]: causal over the sequence without ``paged``; with it, the new
    keys and values are written to ``pages`` (layer ``layer`` of the stacks) and the queries attend
    over each row's cache (split over ``mesh`` as :func:`mtp_jax.gqa.gqa_paged` does). Returns
    (out [b, t, d], pages)."""
    q, k, v = qkv(p, x, cos, sin, cfg.rms_norm_eps)
    scale = cfg.softmax_scale
    if paged is None:
        out = gqa_dense(q, k, v, scale)
    else:
        seen, tree = paged.attention(positions)
        out, pages = gqa_paged(q, k, v, pages, paged.slots, paged.page_table, seen, scale, layer, mesh, tree)
    return adapted(jnp.einsum("bthk,hkd->btd", out, p["o"]), out, p.get("lora"), "o", 2), pages


def decoder_layer(
    p: dict,
    h: jax.Array,
    cfg: Llama3Config,
    cos: jax.Array,
    sin: jax.Array,
    positions: jax.Array,
    paged: PagedAttention | None = None,
    pages: dict | None = None,
    layer: jax.Array | int | None = None,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, dict | None]:
    """One pre-norm decoder layer (see the module docstring). Returns (h, pages)."""
    x = rms_norm(h, p["input_norm"], cfg.rms_norm_eps)
    attn_out, pages = attention(p["attn"], x, cfg, cos, sin, positions, paged, pages, layer, mesh)
    h = h + attn_out
    x = rms_norm(h, p["post_attn_norm"], cfg.rms_norm_eps)
    return h + swiglu(x, **p["mlp"]), pages


def rope_tables(cfg: Llama3Config, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin [b, t, head_dim/2] float32 at absolute positions [b, t]."""
    inv_freq = llama3_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    return rope_cos_sin(positions, jnp.asarray(inv_freq), 1.0)


def forward(
    params: dict,
    cfg: Llama3Config,
    tokens: jax.Array,
    positions: jax.Array,
    paged: PagedAttention | None = None,
    capture: tuple[int, ...] = (),
    mesh: Mesh | None = None,
    lora_slots: jax.Array | None = None,
) -> tuple[Hidden, dict | None]:
    """Run the decoder on tokens [b, t] at absolute positions [b, t].

    Without ``paged``: teacher-forced over whole sequences (positions must be 0..t-1), no cache.
    With ``paged``: the tokens' keys and values are written at ``paged.slots`` and attention reads
    each row's paged cache, which is returned updated. ``capture`` (static) selects layer outputs
    for ``Hidden.layers``. ``mesh``: the parameters' mesh (:mod:`mtp_jax.sharding`): hidden states
    pinned to the row split at layer boundaries, heads and MLP columns split over ``tensor`` by
    the parameters' shardings, paged attention under ``shard_map``. ``lora_slots`` [b]: each row's
    LoRA adapter slot, applied from ``params["lora"]`` (:mod:`mtp_jax.lora`; slot 0: none).
    """
    plan = CapturePlan(cfg.num_hidden_layers, capture)
    cos, sin = rope_tables(cfg, positions)
    h = constrain(params["embed"][tokens], mesh, ACTIVATION)
    captured = plan.start(h)

    def layer(carry, xs):
        h, captured, pages = carry
        p, slot, index = xs
        p = with_lora(p, lora_slots)
        h, pages = decoder_layer(p, h, cfg, cos, sin, positions, paged, pages, index, mesh)
        h = constrain(h, mesh, ACTIVATION)
        if captured is not None:
            captured = jax.lax.dynamic_update_index_in_dim(captured, h, slot, 0)
        return (h, captured, pages), None

    # the cache stacks ride in the carry and each layer writes its slice in place
    pages_in = None if paged is None else paged.pages
    n = cfg.num_hidden_layers
    carry = (h, captured, pages_in)
    (h, captured, pages), _ = scan_layers(
        layer,
        carry,
        lora_stack(params["layers"], params, "layers"),
        plan.slot_of,
        np.arange(n, dtype=np.int32),
    )
    hidden = Hidden(
        post_norm=rms_norm(h, params["final_norm"], cfg.rms_norm_eps),
        pre_norm=h,
        layers=plan.finish(captured),
    )
    return hidden, pages


def init_cache(cfg: Llama3Config, num_pages: int, page_size: int, dtype: jnp.dtype) -> dict:
    """Zeroed K and V pages, each [L, P, page, Hkv, head_dim]."""
    shape = (cfg.num_hidden_layers, num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def _cache_logical(name: str, rank: int) -> tuple[str | None, ...]:
    return (None, "pages", None, "kv_heads", None)


def _cache_bytes_per_token(cfg: Llama3Config, itemsize: int) -> int:
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * itemsize


def _check_axes(cfg: Llama3Config, axes: Mapping[str, int]) -> None:
    if axes["expert"] != 1:
        raise ValueError(
            f"Llama has no experts: use the 'data' and 'tensor' axes (got expert={axes['expert']})"
        )
    check_tensor_split(cfg.num_attention_heads, cfg.num_key_value_heads, axes["tensor"])


def _check_mesh(cfg: Llama3Config, mesh: Mesh) -> None:
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"mesh axes must be {MESH_AXES} (use mtp_jax.make_mesh), got {mesh.axis_names}")
    _check_axes(cfg, mesh.shape)


_SPLITS = {"heads": "tensor", "ffn": "tensor", "kv_heads": "kv_heads"}


def hub_tensors(cfg: Llama3Config) -> Iterator[HubTensor]:
    """Every tensor of a Llama-family hub checkpoint (its layers as :func:`target_layer_leaves`
    declares them), with the tensor-parallel split of each (:mod:`mtp_jax.sharding`)."""
    d, v, n = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    yield HubTensor("embedding", (v, d), 1, "plain")
    yield HubTensor("norms", (d,), 1, "plain")  # model.norm
    for leaf in target_layer_leaves(cfg):
        split = next((_SPLITS[a] for a in leaf.logical if a), None)
        yield HubTensor(
            leaf.component, leaf.hub_shape, n, "linear" if leaf.kind == "linear" else "plain", split
        )
    if not cfg.tie_word_embeddings:
        yield HubTensor("lm_head", (v, d), 1, "plain", split="tensor")  # vocabulary-parallel head


def abstract_groups(cfg: Llama3Config, shapes: Any, own_draft: bool = False) -> dict:
    """The parameter groups (one layer of the stack) built with ``shapes`` (:mod:`mtp_jax.plan`'s
    builder): dense, in its dtype; no head when the embedding is tied. No draft of its own."""
    d = cfg.hidden_size
    out = {
        "embed": shapes.plain(cfg.vocab_size, d),
        "layers": leaves_tree(target_layer_leaves(cfg), lambda leaf: shapes.plain(*leaf.shape)),
        "final_norm": shapes.plain(d),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head"] = shapes.plain(d, cfg.vocab_size)
    return out


def _describe(cfg: Llama3Config, title: str) -> list[str]:
    rope = "no rope scaling"
    if cfg.rope_scaling is not None:
        r = cfg.rope_scaling
        rope = (
            f"llama3 rope scaling x{r.factor:g} (original {r.original_max_position_embeddings}, "
            f"low/high freq factors {r.low_freq_factor:g}/{r.high_freq_factor:g})"
        )
    return [
        f"Model: {cfg.model_type} ({title})",
        f"  layers      {cfg.num_hidden_layers}",
        f"  attention   {cfg.num_attention_heads} heads, {cfg.num_key_value_heads} KV heads (GQA), "
        f"head_dim {cfg.head_dim}, rope_theta {cfg.rope_theta:g}, {rope}",
        f"  hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, vocab {cfg.vocab_size}"
        + (", tied embeddings" if cfg.tie_word_embeddings else ""),
    ]


def lora_sites(cfg: Llama3Config) -> tuple[LoraSite, ...]:
    """Every projection of the decoder layers takes an adapter: q/k/v/o and gate/up/down."""
    sites = []
    for leaf in target_layer_leaves(cfg):
        if leaf.kind != "linear":
            continue
        split = split_leaf(leaf.shape, leaf.logical, leaf.hub_shape[1])
        module = leaf.hub.removesuffix(".weight")
        sites.append(LoraSite(module, "layers", 0, cfg.num_hidden_layers, leaf.path, *split))
    return tuple(sites)


def family_target(name: str, config_class: type, title: str = "") -> Target:
    """The :class:`Target` of a Llama-family model (Llama 3, Qwen2, Qwen3: this module's forward,
    the family's extras read from the config and the layer tree)."""
    return Target(
        name=name,
        config_class=config_class,
        forward=forward,
        init_cache=init_cache,
        cache_logical=_cache_logical,
        cache_bytes_per_token=_cache_bytes_per_token,
        check_mesh=_check_mesh,
        layer_stacks=lambda cfg: ("layers",),
        layer_leaves=target_layer_leaves,
        title=title or name,
        hub_tensors=hub_tensors,
        check_axes=_check_axes,
        cache_split=lambda cfg, axes: axes["tensor"] if cfg.num_key_value_heads % axes["tensor"] == 0 else 1,
        describe=lambda cfg: _describe(cfg, title or name),
        abstract_groups=abstract_groups,
        lora_sites=lora_sites,
    )


TARGET = family_target("llama", Llama3Config, title="Llama 3")
register_group_layout("layers", layer_logical)
