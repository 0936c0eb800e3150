"""DeepSeek-V3 forward pass over a parameter pytree.

Parameters (weights [in, out]; a leading L axis on everything in a layer stack)::

    embed [V, d]
    dense: {input_norm [L, d], post_attn_norm [L, d], attn: {...mla...}, mlp: {gate, up, down}}
    moe:   {input_norm, post_attn_norm, attn: {...}, mlp: {router, bias, gate, up, down, shared_*}}
    final_norm [d]
    lm_head [d, V]

The first ``first_k_dense_replace`` layers form the dense stack and the rest the MoE stack; each
stack runs under ``lax.scan`` so compile time does not grow with depth. A stack with no layers is
absent from the pytree.

Layer numbering for captured hidden states: layer i (0-based) means the output of decoder layer i,
i.e. ``transformers``' ``hidden_states[i + 1]`` (its entry 0 is the embedding output).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from mtp_jax.layers import rms_norm, rope_cos_sin, rope_frequencies, swiglu
from mtp_jax.lora import LoraSite, split_leaf
from mtp_jax.sharding import ACTIVATION, constrain, expert_logical, register_group_layout
from mtp_jax.targets.base import (
    CapturePlan,
    Hidden,
    HubTensor,
    PagedAttention,
    Target,
    lm_head,
    lora_stack,
    scan_layers,
    with_lora,
)
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
from mtp_jax.targets.deepseek_v3.ep import moe_sharded
from mtp_jax.targets.deepseek_v3.mla import mla_dense, mla_paged
from mtp_jax.targets.deepseek_v3.moe import DISPATCH, resolve_dispatch, route

__all__ = [
    "KV_B",
    "TARGET",
    "Hidden",
    "MlaLeaf",
    "PagedAttention",
    "attention_leaves",
    "decoder_layer",
    "forward",
    "init_cache",
    "iter_hub",
    "layer_leaves",
    "layer_tree",
    "lm_head",
    "mtp_leaves",
    "split_expert_leaves",
]

STACKS = ("dense", "moe")


@dataclasses.dataclass(frozen=True)
class MlaLeaf:
    """One tensor of a DeepSeek-V3 decoder layer, declared once: the loader, the exporter, the
    synthetic checkpoints, ``plan``'s abstract parameters and the size estimate all read
    :func:`layer_leaves` (as the Llama family's :class:`mtp_jax.targets.llama.model.LayerLeaf`).

    ``path``: where it sits in our layer tree (:data:`KV_B` stands for ``k_b`` and ``v_b``, our two
    halves of the hub's ``kv_b_proj``, split on the last axis); ``hub``: its key under the layer's
    prefix (``model.layers.{i}.``), with ``{e}`` for a routed expert's index; ``shape``: ours, one
    layer (one expert); ``hub_shape``: as stored ([out, in] for a projection, whose ours is its
    transpose reshaped); ``kind``: ``linear`` (FP8 in FP8 checkpoints), ``projection`` (a
    projection the hub never quantises: the MTP layer's ``eh_proj``), ``norm`` (a norm's weight,
    near 1), ``router`` (float32 [e, d], ours its transpose) or ``bias`` (float32, the router's
    correction bias); ``component``: its part of the model in the size estimate; ``experts``: the
    number of routed experts (one hub tensor each, ours stacked on a leading axis), 0 otherwise;
    ``dense``: kept dense even in FP8 mode (``kv_b_proj``: used in absorbed form every step)."""

    path: tuple[str, ...]
    hub: str
    shape: tuple[int, ...]
    hub_shape: tuple[int, ...]
    kind: str
    component: str
    experts: int = 0
    dense: bool = False


KV_B = ("attn", "kv_b")


def _linear(
    path: tuple[str, ...], hub: str, shape: tuple[int, ...], out: int, inp: int, component: str, **kw: Any
) -> MlaLeaf:
    return MlaLeaf(path, hub, shape, (out, inp), "linear", component, **kw)


def attention_leaves(cfg: DeepseekV3Config, d_in: int | None = None) -> tuple[MlaLeaf, ...]:
    """An MLA attention's tensors (under ``self_attn.``); the first projections (q_a / q, kv_a) read
    inputs of width ``d_in`` (default hidden_size; an EAGLE-3 draft's read 2H)."""
    d, h, qk = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_head_dim
    d_in = d if d_in is None else d_in
    r, kvr, rope = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope_v = cfg.qk_nope_head_dim + cfg.v_head_dim
    a, at = "self_attn.", "attention"
    if r is None:
        q = (_linear(("attn", "q"), f"{a}q_proj.weight", (d_in, h, qk), h * qk, d_in, at),)
    else:
        q = (
            _linear(("attn", "q_a"), f"{a}q_a_proj.weight", (d_in, r), r, d_in, at),
            MlaLeaf(("attn", "q_a_norm"), f"{a}q_a_layernorm.weight", (r,), (r,), "norm", "norms"),
            _linear(("attn", "q_b"), f"{a}q_b_proj.weight", (r, h, qk), h * qk, r, at),
        )
    return q + (
        _linear(("attn", "kv_a"), f"{a}kv_a_proj_with_mqa.weight", (d_in, kvr + rope), kvr + rope, d_in, at),
        MlaLeaf(("attn", "kv_a_norm"), f"{a}kv_a_layernorm.weight", (kvr,), (kvr,), "norm", "norms"),
        _linear(KV_B, f"{a}kv_b_proj.weight", (kvr, h, nope_v), h * nope_v, kvr, at, dense=True),
        _linear(("attn", "o"), f"{a}o_proj.weight", (h, cfg.v_head_dim, d), d, h * cfg.v_head_dim, at),
    )


def _swiglu_leaves(path: str, hub: str, d: int, f: int, component: str, experts: int = 0) -> tuple:
    return (
        _linear(("mlp", f"{path}gate"), f"{hub}gate_proj.weight", (d, f), f, d, component, experts=experts),
        _linear(("mlp", f"{path}up"), f"{hub}up_proj.weight", (d, f), f, d, component, experts=experts),
        _linear(("mlp", f"{path}down"), f"{hub}down_proj.weight", (f, d), d, f, component, experts=experts),
    )


def layer_leaves(cfg: DeepseekV3Config, moe: bool, d_in: int | None = None) -> tuple[MlaLeaf, ...]:
    """The tensors of one decoder layer (dense MLP, or ``moe``: router, routed and shared experts),
    in the order the hub lists them (routed experts once each: see :func:`split_expert_leaves`);
    ``d_in``: the attention's input width (:func:`attention_leaves`)."""
    d = cfg.hidden_size
    leaves = (
        MlaLeaf(("input_norm",), "input_layernorm.weight", (d,), (d,), "norm", "norms"),
        MlaLeaf(("post_attn_norm",), "post_attention_layernorm.weight", (d,), (d,), "norm", "norms"),
        *attention_leaves(cfg, d_in),
    )
    if not moe:
        return leaves + _swiglu_leaves("", "mlp.", d, cfg.intermediate_size, "dense_mlp")
    f, e = cfg.moe_intermediate_size, cfg.n_routed_experts
    leaves += (
        MlaLeaf(("mlp", "router"), "mlp.gate.weight", (d, e), (e, d), "router", "routers"),
        MlaLeaf(("mlp", "bias"), "mlp.gate.e_score_correction_bias", (e,), (e,), "bias", "routers"),
        *_swiglu_leaves("", "mlp.experts.{e}.", d, f, "routed_experts", experts=e),
    )
    if cfg.n_shared_experts:
        leaves += _swiglu_leaves(
            "shared_", "mlp.shared_experts.", d, f * cfg.n_shared_experts, "shared_experts"
        )
    return leaves


def mtp_leaves(cfg: DeepseekV3Config) -> tuple[MlaLeaf, ...]:
    """The tensors an MTP (NextN) layer adds to its MoE decoder layer (``model.layers.{N + k}.``),
    in hub order: the two input norms, ``eh_proj`` (our [2d, d]: embedding first, then hidden; a
    ``projection``, never FP8 in the hub) and the shared head's norm. Its copies of the embedding
    and head are the main model's (kept apart only when they differ)."""
    d = cfg.hidden_size
    return (
        MlaLeaf(("enorm",), "enorm.weight", (d,), (d,), "norm", "mtp"),
        MlaLeaf(("hnorm",), "hnorm.weight", (d,), (d,), "norm", "mtp"),
        MlaLeaf(("eh_proj",), "eh_proj.weight", (2 * d, d), (d, 2 * d), "projection", "mtp", dense=True),
        MlaLeaf(("head_norm",), "shared_head.norm.weight", (d,), (d,), "norm", "mtp"),
    )


def split_expert_leaves(leaves: tuple[MlaLeaf, ...]) -> tuple[tuple, tuple, tuple]:
    """(the leaves before the routed experts, the routed experts' leaves, the leaves after): the hub
    lists each expert's tensors together (expert 0's gate, up, down, then expert 1's ...)."""
    idx = [i for i, leaf in enumerate(leaves) if leaf.experts]
    if not idx:
        return leaves, (), ()
    return leaves[: idx[0]], leaves[idx[0] : idx[-1] + 1], leaves[idx[-1] + 1 :]


def layer_tree(
    leaves: tuple[MlaLeaf, ...],
    value: Callable[[MlaLeaf], Any],
    kv_b_parts: Callable[[MlaLeaf, Any], tuple[Any, Any]],
) -> dict:
    """Our layer tree with ``value(leaf)`` at each declared leaf's path; :data:`KV_B`'s value is
    split by ``kv_b_parts(leaf, value)`` into ``attn.k_b`` and ``attn.v_b``."""
    out: dict = {}
    for leaf in leaves:
        node = out
        for name in leaf.path[:-1]:
            node = node.setdefault(name, {})
        if leaf.path == KV_B:
            node["k_b"], node["v_b"] = kv_b_parts(leaf, value(leaf))
        else:
            node[leaf.path[-1]] = value(leaf)
    return out


def iter_hub(leaves: tuple[MlaLeaf, ...]) -> Iterator[tuple[MlaLeaf, int | None]]:
    """Each (leaf, expert index or None) in hub order: the routed experts' leaves expert by expert."""
    before, experts, after = split_expert_leaves(leaves)
    for leaf in before:
        yield leaf, None
    if experts:
        for j in range(experts[0].experts):
            for leaf in experts:
                yield leaf, j
    for leaf in after:
        yield leaf, None


def abstract_tree(cfg: DeepseekV3Config, leaves: tuple[MlaLeaf, ...], shapes: Any) -> dict:
    """``leaves`` as the loader keeps them, built with ``shapes`` (:mod:`mtp_jax.plan`'s builder:
    ``plain``, ``linear``, ``stacked``): routers and biases float32, projections FP8 when the
    builder plans FP8 weights (``kv_b`` and ``eh_proj`` dense), routed experts stacked."""

    def value(leaf: MlaLeaf) -> Any:
        if leaf.kind in ("router", "bias"):
            return shapes.plain(*leaf.shape, dtype=jnp.float32)
        if leaf.kind != "linear" or leaf.dense:  # norms, kv_b, eh_proj
            return shapes.plain(*leaf.shape)
        x = shapes.linear(*leaf.hub_shape, leaf.shape)
        return shapes.stacked(x, leaf.experts) if leaf.experts else x

    def kv_b_parts(leaf: MlaLeaf, kv_b: Any) -> tuple[Any, Any]:
        r, h = leaf.shape[:2]
        return shapes.plain(r, h, cfg.qk_nope_head_dim), shapes.plain(r, h, cfg.v_head_dim)

    return layer_tree(leaves, value, kv_b_parts)


def abstract_groups(cfg: DeepseekV3Config, shapes: Any, own_draft: bool) -> dict:
    """The parameter groups (one layer of each stack) as :func:`abstract_tree` builds them; the MTP
    layers' group with ``own_draft``."""
    d, v = cfg.hidden_size, cfg.vocab_size
    out = {"embed": shapes.plain(v, d), "final_norm": shapes.plain(d), "lm_head": shapes.plain(d, v)}
    for name, moe, n in (("dense", False, cfg.num_dense_layers), ("moe", True, cfg.num_moe_layers)):
        if n:
            out[name] = abstract_tree(cfg, layer_leaves(cfg, moe), shapes)
    if own_draft and cfg.num_nextn_predict_layers:
        out["mtp"] = {
            **abstract_tree(cfg, mtp_leaves(cfg), shapes),
            "layer": abstract_tree(cfg, layer_leaves(cfg, True), shapes),
        }
    return out


def stack_sizes(cfg: DeepseekV3Config) -> dict[str, int]:
    sizes = {"dense": cfg.num_dense_layers, "moe": cfg.num_moe_layers}
    return {name: n for name, n in sizes.items() if n}


def forward(
    params: dict,
    cfg: DeepseekV3Config,
    tokens: jax.Array,
    positions: jax.Array,
    paged: PagedAttention | None = None,
    capture: tuple[int, ...] = (),
    dispatch: str = "auto",
    mesh: Mesh | None = None,
    lora_slots: jax.Array | None = None,
) -> tuple[Hidden, dict[str, jax.Array] | None]:
    """Run the decoder on tokens [b, t] at absolute positions [b, t].

    Without ``paged``: teacher-forced over whole sequences (positions must be 0..t-1), expanded
    attention, no cache. With ``paged``: absorbed attention against the paged latent cache, which
    is returned updated. ``capture`` (static) selects layer outputs to return in ``Hidden.layers``.
    ``dispatch`` (static) is how routed experts are evaluated (see :func:`moe`).
    ``mesh`` (static): run MoE layers expert-parallel over it and keep the hidden states split over
    its batch axis at layer boundaries (:func:`mtp_jax.sharding.constrain`); None: one device.
    ``lora_slots`` [b]: each row's LoRA adapter slot, applied from ``params["lora"]``
    (:mod:`mtp_jax.lora`; slot 0: none) to the attention, dense MLPs and shared experts.
    """
    plan = CapturePlan(cfg.num_hidden_layers, capture)
    attention = attention_fn(cfg, positions, paged, mesh)
    h = constrain(params["embed"][tokens], mesh, ACTIVATION)
    captured = plan.start(h)

    new_pages = {}
    expert_load = None
    first = 0
    for name, n in stack_sizes(cfg).items():

        def layer(carry, xs, is_moe=name == "moe"):
            h, captured, pages = carry
            p, slot, index = xs
            p = with_lora(p, lora_slots)
            h, pages, load = decoder_layer(p, h, cfg, is_moe, attention, pages, dispatch, mesh, index)
            h = constrain(h, mesh, ACTIVATION)
            if captured is not None:
                captured = jax.lax.dynamic_update_index_in_dim(captured, h, slot, 0)
            return (h, captured, pages), load

        # the stack's pages ride in the carry and each layer writes its slice in place
        pages_in = None if paged is None else paged.pages[name]
        slots, index = plan.slot_of[first : first + n], np.arange(n, dtype=np.int32)
        (h, captured, pages_out), load = scan_layers(
            layer, (h, captured, pages_in), lora_stack(params[name], params, name), slots, index
        )
        new_pages[name] = pages_out
        if load is not None:
            expert_load = load
        first += n
    hidden = Hidden(
        post_norm=rms_norm(h, params["final_norm"], cfg.rms_norm_eps),
        pre_norm=h,
        layers=plan.finish(captured),
        expert_load=expert_load,
    )
    return hidden, (None if paged is None else new_pages)


Attention = Callable[
    [dict, jax.Array, "jax.Array | None", "jax.Array | int | None"], tuple[jax.Array, "jax.Array | None"]
]


def attention_fn(
    cfg: DeepseekV3Config, positions: jax.Array, paged: PagedAttention | None, mesh: Mesh | None = None
) -> Attention:
    """(attention params, normed input, pages or None, layer) -> (output, pages): expanded causal
    attention without a cache, or absorbed attention over the paged cache (one layer's pages
    [P, page, c] with layer None, else layer ``layer`` of a stack [L, P, page, c]), data-parallel
    over ``mesh``'s row axes (:func:`mtp_jax.targets.deepseek_v3.mla.mla_paged`)."""
    inv_freq, magnitude = rope_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    cos, sin = rope_cos_sin(positions, jnp.asarray(inv_freq), magnitude)

    def attend(p: dict, x: jax.Array, pages: jax.Array | None, layer: jax.Array | int | None = None):
        if paged is None:
            return mla_dense(p, x, cfg, cos, sin), pages
        seen, tree = paged.attention(positions)
        return mla_paged(p, x, cfg, cos, sin, seen, paged.slots, pages, paged.page_table, layer, mesh, tree)

    return attend


def decoder_layer(
    p: dict,
    h: jax.Array,
    cfg: DeepseekV3Config,
    is_moe: bool,
    attention: Attention,
    pages: jax.Array | None,
    dispatch: str = "auto",
    mesh: Mesh | None = None,
    layer: jax.Array | int | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """One pre-norm decoder layer: h + attn(norm(h)), then + mlp(norm(.)) (MoE or dense).
    ``pages``/``layer`` as in :func:`attention_fn`. Returns (h, pages, expert load [e] or None for a
    dense layer)."""
    x = rms_norm(h, p["input_norm"], cfg.rms_norm_eps)
    attn_out, pages = attention(p["attn"], x, pages, layer)
    h = h + attn_out
    x = rms_norm(h, p["post_attn_norm"], cfg.rms_norm_eps)
    if not is_moe:
        return h + swiglu(x, **p["mlp"]), pages, None
    out, load = moe(p["mlp"], x, cfg, dispatch, mesh)
    return h + out, pages, load


def moe(
    p: dict, x: jax.Array, cfg: DeepseekV3Config, dispatch: str = "auto", mesh: Mesh | None = None
) -> tuple[jax.Array, jax.Array]:
    """The MoE block for x [b, t, d]: (output [b, t, d], tokens routed to each expert [e] float32).

    ``dispatch`` picks how the routed experts are evaluated (same result): ``"sorted"`` (dropless
    sort + grouped matmul), ``"dense"`` (:func:`mtp_jax.targets.deepseek_v3.moe.routed_experts_dense`, used
    for
    training), ``"gather"`` (:func:`mtp_jax.targets.deepseek_v3.moe.routed_experts_gathered`) or ``"auto"``
    (on the CPU
    gather for fewer token copies than experts, dense for other small sizes, else sorted; see
    :func:`mtp_jax.targets.deepseek_v3.moe.resolve_dispatch`).
    The per-expert load feeds DeepSeek-V3's auxiliary-loss-free bias update during training.
    With a ``mesh`` of more than one device, routing and the routed experts run under ``shard_map``,
    expert-parallel over its ``expert`` axis (:func:`mtp_jax.targets.deepseek_v3.ep.moe_sharded`);
    ``mesh=None`` is the
    single-device path.
    """
    flat = x.reshape(-1, x.shape[-1])
    if mesh is not None and mesh.devices.size > 1:
        # [b, t, d], not flat: tokens stay split by row, as the hidden states around the layer are
        out, load, _ = moe_sharded(
            x, p["router"], p["bias"], p["gate"], p["up"], p["down"], cfg, mesh, dispatch
        )
        out = out.reshape(flat.shape)
    else:
        how = resolve_dispatch(
            dispatch,
            flat.shape[0],
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.n_routed_experts,
            cfg.num_experts_per_tok,
        )
        weights, idx = route(flat, p["router"], p["bias"], cfg)
        out = DISPATCH[how](flat, weights, idx, p["gate"], p["up"], p["down"])
        load = jnp.zeros(cfg.n_routed_experts, jnp.float32).at[idx.reshape(-1)].add(1.0)
    if cfg.n_shared_experts:
        lora = {k.removeprefix("shared_"): v for k, v in (p.get("lora") or {}).items()}
        lora = lora if set(lora) - {"rows"} else {}
        shared = swiglu(x, p["shared_gate"], p["shared_up"], p["shared_down"], lora=lora or None)
        out = out + shared.reshape(flat.shape)
    return out.reshape(x.shape), load


def lora_sites(cfg: DeepseekV3Config) -> tuple[LoraSite, ...]:
    """The projections that take adapters: MLA's (q or q_a / q_b, kv_a, kv_b: absorbed in decode,
    o), the dense layers' MLPs and the shared experts; never the routed experts or the router.
    Attention and these MLPs are replicated (data-parallel), so are their adapters."""
    sites, first = [], 0
    for name, n in stack_sizes(cfg).items():
        for leaf in layer_leaves(cfg, moe=name == "moe"):
            if leaf.kind != "linear" or leaf.experts:
                continue
            split = split_leaf(leaf.shape, (None,) * len(leaf.shape), leaf.hub_shape[1])
            sites.append(LoraSite(leaf.hub.removesuffix(".weight"), name, first, n, leaf.path, *split))
        first += n
    return tuple(sites)


def latent_width(cfg: DeepseekV3Config) -> int:
    """Values one token occupies in one layer's cache: the compressed latent and the rope key."""
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim


def init_cache(cfg: DeepseekV3Config, num_pages: int, page_size: int, dtype: jnp.dtype) -> dict:
    """Zeroed latent pages [L, P, page, kv_lora + rope] for every layer stack (``dense``, ``moe``)."""
    return {
        name: jnp.zeros((n, num_pages, page_size, latent_width(cfg)), dtype)
        for name, n in stack_sizes(cfg).items()
    }


def _cache_logical(name: str, rank: int) -> tuple[str | None, ...]:
    return (None, "pages") + (None,) * (rank - 2)


def _cache_bytes_per_token(cfg: DeepseekV3Config, itemsize: int) -> int:
    return cfg.num_hidden_layers * latent_width(cfg) * itemsize


_STORAGE = {"linear": "linear", "projection": "plain", "norm": "plain", "router": "router", "bias": "fp32"}


def _hub_tensor(leaf: MlaLeaf, count: int, component: str | None = None) -> HubTensor:
    return HubTensor(
        component or leaf.component,
        leaf.hub_shape,
        count * (leaf.experts or 1),
        _STORAGE[leaf.kind],
        split="expert" if leaf.experts else None,
        absorbed=leaf.dense and leaf.kind == "linear",
    )


def hub_tensors(cfg: DeepseekV3Config) -> Iterator[HubTensor]:
    """Every tensor of a DeepSeek-V3 hub checkpoint, as :func:`layer_leaves` and :func:`mtp_leaves`
    declare them; the MTP layers' copies of the embedding and head under ``mtp_duplicates`` (our
    loader keeps them once)."""
    d, v, n_mtp = cfg.hidden_size, cfg.vocab_size, cfg.num_nextn_predict_layers
    yield HubTensor("embedding", (v, d), 1, "plain")
    for moe, count in ((False, cfg.num_dense_layers), (True, cfg.num_moe_layers)):
        if count:
            yield from (_hub_tensor(leaf, count) for leaf in layer_leaves(cfg, moe=moe))
    yield HubTensor("norms", (d,), 1, "plain")  # model.norm
    if not cfg.tie_word_embeddings:
        yield HubTensor("lm_head", (v, d), 1, "plain")
    if n_mtp:
        yield from (_hub_tensor(leaf, n_mtp, "mtp") for leaf in layer_leaves(cfg, moe=True))
        yield from (_hub_tensor(leaf, n_mtp) for leaf in mtp_leaves(cfg))  # norms, eh_proj
        yield HubTensor("mtp_duplicates", (v, d), 2 * n_mtp, "plain")  # embed_tokens, shared_head.head


def _check_axes(cfg: DeepseekV3Config, axes: Mapping[str, int]) -> None:
    if axes["tensor"] != 1:
        raise ValueError(
            f"mesh axis 'tensor'={axes['tensor']} is not supported yet: the sharding plan replicates "
            "attention and dense weights (data-parallel attention) and splits only the routed experts "
            "over 'expert'; use tensor=1"
        )
    if cfg.n_routed_experts % axes["expert"]:
        raise ValueError(
            f"mesh axis 'expert'={axes['expert']} does not divide n_routed_experts={cfg.n_routed_experts}; "
            "every device must hold the same number of routed experts"
        )


def _describe(cfg: DeepseekV3Config) -> list[str]:
    q = f"q_lora {cfg.q_lora_rank}" if cfg.q_lora_rank is not None else "q_proj (no q_lora)"
    return [
        f"Model: {cfg.model_type}",
        f"  layers      {cfg.num_hidden_layers} ({cfg.num_dense_layers} dense + {cfg.num_moe_layers} MoE)"
        f" + {cfg.num_nextn_predict_layers} MTP",
        f"  experts     {cfg.n_routed_experts} routed ({cfg.num_experts_per_tok} per token, "
        f"{cfg.n_group} groups, top {cfg.topk_group}) + {cfg.n_shared_experts} shared, "
        f"moe_intermediate {cfg.moe_intermediate_size}",
        f"  attention   {cfg.num_attention_heads} heads MLA, {q}, kv_lora {cfg.kv_lora_rank}, "
        f"head dims nope/rope/v {cfg.qk_nope_head_dim}/{cfg.qk_rope_head_dim}/{cfg.v_head_dim}",
        f"  hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, vocab {cfg.vocab_size}"
        + (", tied embeddings" if cfg.tie_word_embeddings else ""),
    ]


def _check_mesh(cfg: DeepseekV3Config, mesh: Mesh) -> None:
    from mtp_jax.sharding import check_mesh

    check_mesh(mesh, cfg.n_routed_experts)


TARGET = Target(
    name="deepseek_v3",
    title="DeepSeek-V3",
    config_class=DeepseekV3Config,
    forward=forward,
    init_cache=init_cache,
    cache_logical=_cache_logical,
    cache_bytes_per_token=_cache_bytes_per_token,
    check_mesh=_check_mesh,
    layer_stacks=lambda cfg: tuple(stack_sizes(cfg)),
    own_draft=lambda cfg: "mtp" if cfg.num_nextn_predict_layers else None,
    split_axis="expert",
    fp8_weights=True,
    hub_tensors=hub_tensors,
    routed_experts=lambda cfg: (cfg.n_routed_experts, cfg.num_experts_per_tok),
    check_axes=_check_axes,
    own_draft_cache_bytes_per_token=lambda cfg, itemsize: (
        cfg.num_nextn_predict_layers * latent_width(cfg) * itemsize
    ),
    describe=_describe,
    abstract_groups=abstract_groups,
    lora_sites=lora_sites,
)
for _group in ("moe", "mtp"):  # routed experts over the mesh's expert axis, the rest replicated
    register_group_layout(_group, expert_logical)
