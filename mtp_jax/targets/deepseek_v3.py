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

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from mtp_jax.config import DeepseekV3Config
from mtp_jax.ep import moe_sharded
from mtp_jax.layers import rms_norm, rope_cos_sin, rope_frequencies, swiglu
from mtp_jax.mla import mla_dense, mla_paged
from mtp_jax.moe import DISPATCH, resolve_dispatch, route
from mtp_jax.sharding import ACTIVATION, constrain
from mtp_jax.targets.base import CapturePlan, Hidden, PagedAttention, Target, lm_head, scan_layers

__all__ = ["TARGET", "Hidden", "PagedAttention", "decoder_layer", "forward", "init_cache", "lm_head"]

STACKS = ("dense", "moe")


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
) -> tuple[Hidden, dict[str, jax.Array] | None]:
    """Run the decoder on tokens [b, t] at absolute positions [b, t].

    Without ``paged``: teacher-forced over whole sequences (positions must be 0..t-1), expanded
    attention, no cache. With ``paged``: absorbed attention against the paged latent cache, which
    is returned updated. ``capture`` (static) selects layer outputs to return in ``Hidden.layers``.
    ``dispatch`` (static) is how routed experts are evaluated (see :func:`moe`).
    ``mesh`` (static): run MoE layers expert-parallel over it and keep the hidden states split over
    its batch axis at layer boundaries (:func:`mtp_jax.sharding.constrain`); None: one device.
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
            h, pages, load = decoder_layer(p, h, cfg, is_moe, attention, pages, dispatch, mesh, index)
            h = constrain(h, mesh, ACTIVATION)
            if captured is not None:
                captured = jax.lax.dynamic_update_index_in_dim(captured, h, slot, 0)
            return (h, captured, pages), load

        # the stack's pages ride in the carry and each layer writes its slice in place
        pages_in = None if paged is None else paged.pages[name]
        slots, index = plan.slot_of[first : first + n], np.arange(n, dtype=np.int32)
        (h, captured, pages_out), load = scan_layers(
            layer, (h, captured, pages_in), params[name], slots, index
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
    over ``mesh``'s row axes (:func:`mtp_jax.mla.mla_paged`)."""
    inv_freq, magnitude = rope_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    cos, sin = rope_cos_sin(positions, jnp.asarray(inv_freq), magnitude)

    def attend(p: dict, x: jax.Array, pages: jax.Array | None, layer: jax.Array | int | None = None):
        if paged is None:
            return mla_dense(p, x, cfg, cos, sin), pages
        return mla_paged(p, x, cfg, cos, sin, positions, paged.slots, pages, paged.page_table, layer, mesh)

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
    sort + grouped matmul), ``"dense"`` (:func:`mtp_jax.moe.routed_experts_dense`, used for
    training), ``"gather"`` (:func:`mtp_jax.moe.routed_experts_gathered`) or ``"auto"`` (on the CPU
    gather for fewer token copies than experts, dense for other small sizes, else sorted; see
    :func:`mtp_jax.moe.resolve_dispatch`).
    The per-expert load feeds DeepSeek-V3's auxiliary-loss-free bias update during training.
    With a ``mesh`` of more than one device, routing and the routed experts run under ``shard_map``,
    expert-parallel over its ``expert`` axis (:func:`mtp_jax.ep.moe_sharded`); ``mesh=None`` is the
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
        out = out + swiglu(flat, p["shared_gate"], p["shared_up"], p["shared_down"])
    return out.reshape(x.shape), load


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
)
