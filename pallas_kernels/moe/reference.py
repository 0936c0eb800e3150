"""Pure-jnp MoE dispatch: permute token copies by expert, grouped matmul, combine.

The reference every MoE kernel is held to, with the kernels' signatures. Shapes: n tokens of width d,
k experts per token, E experts; m = n * k sorted token copies.

- :func:`permute`: x [n, d], idx [n, k] -> xs [m, d] grouped by expert, group_sizes [E], order [m].
- :func:`gmm`: lhs [m, kdim] @ rhs [E, kdim, ndim] group by group -> [m, ndim].
- :func:`combine`: ys [m, d] -> [n, d], each token's k rows weighted and summed.
- :func:`routed_experts`: the three above, as :func:`mtp_jax.targets.deepseek_v3.moe.routed_experts`.

:func:`gmm` here runs every expert over every row and keeps each row's own expert (E times the
FLOPs of a grouped matmul): simple enough to be obviously right, not meant to be fast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.fp8 import Fp8Weight, materialize


def permute(x: jax.Array, idx: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Token copies sorted by expert: (xs [n*k, d], group_sizes [E] int32, order [n*k] int32).

    x [n, d]; idx [n, k] int32 expert ids in [0, num_experts). Copy j of the flattened [n*k] choices
    is token j // k going to expert idx.reshape(-1)[j]; ``order`` lists the copies sorted by expert
    (stable, so a token's copies keep token order inside an expert), ``xs = x[order // k]`` and
    expert e owns the group_sizes[e] consecutive rows of xs after those of experts < e.
    """
    k = idx.shape[1]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return x[order // k], group_sizes, order


def combine(ys: jax.Array, order: jax.Array, weights: jax.Array, n: int) -> jax.Array:
    """Un-permute and weight-sum: out [n, d] with out[t] = Σ_j weights[t, j] · ys[row of copy (t, j)].

    ys [n*k, d] rows in ``order`` (from :func:`permute`); weights [n, k] float32. The sum is taken in
    float32 and the result is in ys.dtype.
    """
    k = weights.shape[1]
    w = weights.reshape(-1)[order].astype(jnp.float32)
    weighted = ys.astype(jnp.float32) * w[:, None]
    return jnp.zeros((n, ys.shape[1]), jnp.float32).at[order // k].add(weighted).astype(ys.dtype)


def pad_operands(
    lhs: jax.Array, w: jax.Array, block_m: int, block_n: int, block_k: int
) -> tuple[jax.Array, jax.Array]:
    """lhs [m, kdim] and w [E, kdim, ndim] zero-padded to whole tiles (a copy only where a dimension
    is not already a multiple): the grouped matmul kernels load fixed-size tiles without masks."""

    def pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, -x.shape[axis] % multiple)
        return x if not widths[axis][1] else jnp.pad(x, widths)

    return pad_to(pad_to(lhs, 0, block_m), 1, block_k), pad_to(pad_to(w, 1, block_k), 2, block_n)


def group_ids(group_sizes: jax.Array, m: int) -> jax.Array:
    """The group of each of m rows [m] int32: E for rows at or beyond sum(group_sizes)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right").astype(jnp.int32)


def gmm(lhs: jax.Array, rhs: jax.Array | Fp8Weight, group_sizes: jax.Array) -> jax.Array:
    """Grouped matmul: out [m, ndim] with rows of group e equal to lhs rows @ rhs[e].

    lhs [m, kdim] (float); rhs [E, kdim, ndim] array or :class:`Fp8Weight` (dequantised to lhs.dtype,
    as :func:`materialize` does); group_sizes [E] int, groups contiguous and in order from row 0.
    Rows at or beyond sum(group_sizes) are zero. Float32 accumulation, output in lhs.dtype.
    """
    m = lhs.shape[0]
    gid = group_ids(group_sizes, m)

    def one_expert(out, e_and_w):
        e, w = e_and_w
        w = materialize(w, lhs.dtype).astype(lhs.dtype)
        y = jnp.dot(lhs, w, preferred_element_type=jnp.float32)
        return jnp.where((gid == e)[:, None], y, out), None

    ndim = rhs.shape[-1] if isinstance(rhs, Fp8Weight) else rhs.shape[2]
    num_experts = group_sizes.shape[0]
    out0 = jnp.zeros((m, ndim), jnp.float32)
    out, _ = jax.lax.scan(one_expert, out0, (jnp.arange(num_experts), rhs))
    return out.astype(lhs.dtype)


def routed_experts(
    x: jax.Array,
    weights: jax.Array,
    idx: jax.Array,
    gate: jax.Array | Fp8Weight,
    up: jax.Array | Fp8Weight,
    down: jax.Array | Fp8Weight,
) -> jax.Array:
    """Σ_k weights[n,k] · expert_{idx[n,k]}(x[n]) for x [n, d]: out [n, d] in x.dtype, dropless.

    weights [n, k] float32, idx [n, k] int32; gate/up [E, d, f], down [E, f, d] (arrays or
    Fp8Weight); expert_e(v) = (silu(v @ gate[e]) * (v @ up[e])) @ down[e], each matmul rounded to
    x.dtype as in :func:`mtp_jax.targets.deepseek_v3.moe.routed_experts`.
    """
    num_experts = (gate.w if isinstance(gate, Fp8Weight) else gate).shape[0]
    xs, sizes, order = permute(x, idx, num_experts)
    h = jax.nn.silu(gmm(xs, gate, sizes)) * gmm(xs, up, sizes)
    return combine(gmm(h, down, sizes), order, weights, x.shape[0])
