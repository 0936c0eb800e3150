"""DeepSeek-V3 mixture of experts: group-limited sigmoid routing and the routed + shared experts.

Parameters of one layer: ``router`` [d, e] (float32), ``bias`` [e] (float32 correction bias),
``gate``/``up`` [e, d, f], ``down`` [e, f, d], and when the config has shared experts
``shared_gate``/``shared_up`` [d, f_s], ``shared_down`` [f_s, d]. Expert and shared weights may be
:class:`Fp8Weight` (dequantised on use, or fed to the FP8 grouped matmul kernel on a GPU).

This module evaluates routing and the routed experts on one device; :mod:`mtp_jax.targets.deepseek_v3.ep`
builds the
expert-parallel version on it, and the DeepSeek-V3 target (:func:`mtp_jax.targets.deepseek_v3.model.moe`)
chooses between them and adds the shared experts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mtp_jax.fp8 import Fp8Weight, materialize
from mtp_jax.layers import Weight
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
from pallas_kernels.moe import routed_experts as kernel_routed_experts


def route(
    x: jax.Array, router: jax.Array, bias: jax.Array, cfg: DeepseekV3Config
) -> tuple[jax.Array, jax.Array]:
    """Expert choice for tokens x [n, d]: (weights [n, k] float32, expert ids [n, k] int32).

    Selection uses the biased scores s + bias; the weights come from the unbiased sigmoid scores s.
    Groups: each scored by the sum of its two best biased scores; only the topk_group best groups
    stay eligible (the others are set to -inf, never 0, so a negative score cannot beat them).
    """
    scores = jax.nn.sigmoid(jnp.einsum("nd,de->ne", x.astype(jnp.float32), router))
    choice = scores + bias
    if cfg.n_group > 1:
        n = x.shape[0]
        grouped = choice.reshape(n, cfg.n_group, -1)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)
        _, keep = jax.lax.top_k(group_score, cfg.topk_group)
        kept = jnp.zeros((n, cfg.n_group), dtype=bool).at[jnp.arange(n)[:, None], keep].set(True)
        choice = jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(n, -1)
    _, idx = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, idx.astype(jnp.int32)


def routed_experts(
    x: jax.Array, weights: jax.Array, idx: jax.Array, gate: Weight, up: Weight, down: Weight
) -> jax.Array:
    """Σ_k weights[n,k] · expert_{idx[n,k]}(x[n]) for x [n, d], dropless.

    Token copies are sorted by expert so each expert's rows are contiguous, then one grouped
    matmul per projection, and the results are scattered back with their weights — through the
    kernel dispatcher :func:`pallas_kernels.moe.routed_experts`: the Pallas grouped matmul (bf16, or
    FP8 weights with their block scales) on a GPU it compiles for, ``lax.ragged_dot`` on the
    dequantised weights elsewhere (``MTP_JAX_KERNELS`` forces one).
    """
    return kernel_routed_experts(x, weights, idx, gate, up, down)


def routed_experts_dense(
    x: jax.Array, weights: jax.Array, idx: jax.Array, gate: Weight, up: Weight, down: Weight
) -> jax.Array:
    """The same sum as :func:`routed_experts`, computed by running every expert on every token and
    weighting the outputs by a dense [n, e] matrix that is zero outside each token's top-k.

    E/k times the FLOPs, but plain batched matmuls: on CPU, where ``ragged_dot`` (and its gradient)
    is slow, this is the fast way to train small models, and it is the reference kernels are held to.
    """
    gate, up, down = (materialize(w, x.dtype) for w in (gate, up, down))
    n, e = x.shape[0], gate.shape[0]
    dense_w = jnp.zeros((n, e), jnp.float32).at[jnp.arange(n)[:, None], idx].add(weights)
    # a batched matmul over experts reads each [d, f] weight in place; the unbatched "nd,edf" form
    # makes XLA:CPU copy every expert's weights into an [e·f, d] matrix first, each call
    xe = jnp.broadcast_to(x, (e,) + x.shape)
    h = jax.nn.silu(jnp.einsum("end,edf->enf", xe, gate)) * jnp.einsum("end,edf->enf", xe, up)
    ys = jnp.einsum("enf,efd->end", h, down).astype(jnp.float32)  # no bf16 x bf16 -> f32 dot on XLA:CPU
    return jnp.einsum("end,ne->nd", ys, dense_w).astype(x.dtype)


def routed_experts_gathered(
    x: jax.Array, weights: jax.Array, idx: jax.Array, gate: Weight, up: Weight, down: Weight
) -> jax.Array:
    """The same sum as :func:`routed_experts`, each token copy multiplied by its own expert's
    weights, gathered: reads the n·k chosen experts' weights (FP8 ones dequantised after the
    gather), not all E. For decode-sized batches on the CPU, where both other paths touch every
    expert (``ragged_dot`` is lowered there to a masked dense matmul over all groups). Ids outside
    [0, E) contribute nothing (expert parallelism marks copies routed elsewhere so).
    """
    n, k = idx.shape
    e = (gate.w if isinstance(gate, Fp8Weight) else gate).shape[0]
    flat = idx.reshape(-1)
    valid = flat < e
    chosen = jnp.where(valid, flat, 0)

    def pick(w: Weight) -> jax.Array:
        if isinstance(w, Fp8Weight):
            w = dataclasses.replace(w, w=w.w[chosen], scale_inv=w.scale_inv[chosen])
        else:
            w = w[chosen]
        return materialize(w, x.dtype).astype(x.dtype)

    xs = jnp.repeat(x, k, axis=0)  # copy j is token j // k

    def matvec(v: jax.Array, w: Weight) -> jax.Array:
        return jnp.einsum("ri,rio->ro", v, pick(w), preferred_element_type=jnp.float32).astype(x.dtype)

    h = jax.nn.silu(matvec(xs, gate)) * matvec(xs, up)
    ys = matvec(h, down).astype(jnp.float32)
    w = jnp.where(valid, weights.reshape(-1), 0.0).astype(jnp.float32)
    out = jnp.where(valid[:, None], ys * w[:, None], 0.0).reshape(n, k, -1).sum(axis=1)
    return out.astype(x.dtype)


DISPATCH = {"sorted": routed_experts, "dense": routed_experts_dense, "gather": routed_experts_gathered}
# On the CPU "auto" gathers each copy's expert when there are fewer token copies than experts
# (decode): the other two paths read every expert's weights. Otherwise it computes every expert
# densely when that costs at most this many multiply-adds, since ragged_dot runs about ten times
# slower there than a batched matmul of the same rows (tiny models, decode-sized batches); elsewhere
# (and for larger sizes) it is the sorted grouped matmul.
DENSE_DISPATCH_MAX_MACS = 1 << 26


def resolve_dispatch(dispatch: str, tokens: int, d: int, f: int, experts: int, k: int = 1) -> str:
    """The evaluation ``dispatch`` stands for at these (static) sizes: ``tokens`` rows of ``k``
    expert choices each over ``experts`` experts of width d -> f -> d."""
    if dispatch == "auto":
        if jax.default_backend() != "cpu":
            return "sorted"
        if tokens * k < experts:
            return "gather"
        return "dense" if tokens * experts * d * f * 3 <= DENSE_DISPATCH_MAX_MACS else "sorted"
    if dispatch not in DISPATCH:
        raise ValueError(f"dispatch must be one of {sorted(DISPATCH) + ['auto']}, got {dispatch!r}")
    return dispatch
