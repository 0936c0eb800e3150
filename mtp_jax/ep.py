"""Expert parallelism: the routed experts of one MoE layer evaluated under ``shard_map`` with the
experts split over the mesh axis ``expert`` (E_l = e / |expert| local experts per device).

Tokens arrive split over ``data`` (data-parallel attention) and replicated within each expert group.
Routing runs outside, replicated; only the routed experts run inside the ``shard_map``. Two paths,
chosen statically by the number of tokens each data shard holds:

- **decode** (:func:`routed_replicated`; fewer than ``a2a_min_tokens`` tokens, or a token count the
  expert axis does not divide): every device of the group evaluates only its local experts on the
  copies routed to them (dropless: sorted grouped matmul, or dense over the local experts for small
  sizes on CPU) and the partial sums are added with ``psum`` over ``expert``. No dispatch traffic,
  one reduction of [n, d] per layer: the low-latency choice for decode-sized batches.
- **prefill** (:func:`routed_all_to_all`): each device of the group takes 1/|expert| of the tokens,
  sends every token copy to the device owning its expert with a dense ``all_to_all`` of fixed
  capacity C per (source, destination) pair, evaluates its local experts on what it received, sends
  the results back with a second ``all_to_all``, combines them with the routing weights and
  ``all_gather``s the group's tokens. Dropless: when any pair would exceed C, the whole group takes
  the decode path instead (``lax.cond`` on a ``pmax``-reduced flag), so no token is ever dropped.
  TODO: ``jax.lax.ragged_all_to_all`` (GPU/TPU) would send exactly the routed rows without a
  capacity; it does not run on the CPU backend the tests use, so the dense form is the only one here.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from mtp_jax.config import DeepseekV3Config
from mtp_jax.moe import DISPATCH, resolve_dispatch

# Both knobs are read when a MoE layer is traced: set them before the first compile (or clear
# JAX's caches), as the jitted entry points are keyed on the mesh, not on these values.
# Tokens per data shard from which the all-to-all dispatch is used (prefill-sized batches); decode
# steps (B x (K+1) tokens) stay below it and take the replicate + psum path.
A2A_MIN_TOKENS = 256
# Capacity per (source, destination) pair as a multiple of the balanced load m·k/|expert|; a larger
# load falls back to the replicated path (never drops). |expert| or more makes overflow impossible.
CAPACITY_FACTOR = 2.0


def expert_parallel(mesh: Mesh | None) -> bool:
    """Whether MoE layers under ``mesh`` run expert-parallel (an ``expert`` axis larger than 1)."""
    return mesh is not None and mesh.shape["expert"] > 1


def _local_choice(weights: jax.Array, idx: jax.Array, n_local: int) -> tuple[jax.Array, jax.Array]:
    """Routing restricted to this device's experts: copies routed elsewhere get weight 0 and the
    out-of-range id ``n_local``, which the sorted grouped matmul skips and the dense path drops."""
    local = idx - jax.lax.axis_index("expert") * n_local
    mine = (local >= 0) & (local < n_local)
    return jnp.where(mine, weights, 0.0), jnp.where(mine, local, n_local).astype(jnp.int32)


def routed_replicated(
    how: str, n_local: int, x: jax.Array, weights: jax.Array, idx: jax.Array, gate, up, down
) -> jax.Array:
    """Inside ``shard_map``: x [n, d] (the same on every device of the expert group), weights/idx
    [n, k] global routing, gate/up/down the local [E_l, ...] experts -> Σ over all experts [n, d]."""
    w_l, idx_l = _local_choice(weights, idx, n_local)
    part = DISPATCH[how](x, w_l, idx_l, gate, up, down)
    return jax.lax.psum(part.astype(jnp.float32), "expert").astype(x.dtype)


def capacity(tokens: int, k: int, n_dev: int, factor: float) -> int:
    """Rows per (source, destination) buffer for ``tokens`` tokens of top-``k`` routing per source."""
    return max(1, min(tokens * k, math.ceil(factor * tokens * k / n_dev)))


def routed_all_to_all(
    how: str, n_local: int, cap: int, x: jax.Array, weights: jax.Array, idx: jax.Array, gate, up, down
) -> tuple[jax.Array, jax.Array]:
    """Inside ``shard_map``: as :func:`routed_replicated` (x [n, d] replicated in the group, n divisible
    by |expert|), through all-to-all dispatch with ``cap`` rows per (source, destination).

    Returns (output [n, d], overflowed: bool scalar, the same on the whole group; when set, the
    output came from :func:`routed_replicated`).
    """
    n_dev = jax.lax.axis_size("expert")
    me = jax.lax.axis_index("expert")
    n, d = x.shape
    k = idx.shape[1]
    m = n // n_dev
    xs = jax.lax.dynamic_slice_in_dim(x, me * m, m)
    ws = jax.lax.dynamic_slice_in_dim(weights, me * m, m)
    ids = jax.lax.dynamic_slice_in_dim(idx, me * m, m).reshape(-1)
    dest = ids // n_local
    onehot = jax.nn.one_hot(dest, n_dev, dtype=jnp.int32)  # [m·k, n_dev]
    rank = jnp.take_along_axis(jnp.cumsum(onehot, axis=0), dest[:, None], axis=1)[:, 0] - 1
    counts = onehot.sum(0)
    overflow = jax.lax.pmax(jnp.any(counts > cap).astype(jnp.int32), "expert") > 0

    def dispatch(_):
        token = jnp.arange(m * k) // k
        send_x = jnp.zeros((n_dev, cap, d), x.dtype).at[dest, rank].set(xs[token], mode="drop")
        send_id = jnp.full((n_dev, cap), n_local, jnp.int32).at[dest, rank].set(ids % n_local, mode="drop")
        recv_x = jax.lax.all_to_all(send_x, "expert", 0, 0).reshape(n_dev * cap, d)
        recv_id = jax.lax.all_to_all(send_id, "expert", 0, 0).reshape(n_dev * cap, 1)
        one = (recv_id < n_local).astype(jnp.float32)
        y = DISPATCH[how](recv_x, one, recv_id, gate, up, down).reshape(n_dev, cap, d)
        back = jax.lax.all_to_all(y, "expert", 0, 0)
        got = back[dest, jnp.minimum(rank, cap - 1)].astype(jnp.float32) * ws.reshape(-1)[:, None]
        out = got.reshape(m, k, d).sum(1).astype(x.dtype)
        return jax.lax.all_gather(out, "expert", tiled=True)

    def fallback(_):
        return routed_replicated(how, n_local, x, weights, idx, gate, up, down)

    return jax.lax.cond(overflow, fallback, dispatch, None), overflow


def choose_path(tokens: int, mesh: Mesh, a2a_min_tokens: int) -> str:
    """ "a2a" or "replicated" for ``tokens`` tokens in total (static), as in the module docstring."""
    data, n_dev = mesh.shape["data"], mesh.shape["expert"]
    per_shard = tokens // data if tokens % data == 0 else tokens
    if per_shard >= a2a_min_tokens and per_shard % n_dev == 0:
        return "a2a"
    return "replicated"


def routed_experts_ep(
    x: jax.Array,
    weights: jax.Array,
    idx: jax.Array,
    gate,
    up,
    down,
    cfg: DeepseekV3Config,
    mesh: Mesh,
    dispatch: str = "auto",
    a2a_min_tokens: int | None = None,
    capacity_factor: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Routed experts for x [n, d] with routing weights/idx [n, k] over ``mesh``; gate/up/down are the
    full [e, ...] expert weights (split over ``expert``; the ``shard_map`` takes the local slices).

    Returns (Σ_k weights · expert(x) [n, d], overflowed: bool scalar, always False on the decode
    path). ``a2a_min_tokens``/``capacity_factor`` default to :data:`A2A_MIN_TOKENS`/:data:`CAPACITY_FACTOR`.
    """
    a2a_min_tokens = A2A_MIN_TOKENS if a2a_min_tokens is None else a2a_min_tokens
    capacity_factor = CAPACITY_FACTOR if capacity_factor is None else capacity_factor
    n, data, n_dev = x.shape[0], mesh.shape["data"], mesh.shape["expert"]
    n_local = cfg.n_routed_experts // n_dev
    tok = PartitionSpec("data") if n % data == 0 else PartitionSpec()
    per_shard = n // data if n % data == 0 else n
    path = choose_path(n, mesh, a2a_min_tokens)
    if path == "a2a":
        cap = capacity(per_shard // n_dev, idx.shape[1], n_dev, capacity_factor)
        how = resolve_dispatch(dispatch, n_dev * cap, cfg.hidden_size, cfg.moe_intermediate_size, n_local)

        def body(x, weights, idx, gate, up, down):
            out, over = routed_all_to_all(how, n_local, cap, x, weights, idx, gate, up, down)
            return out, over[None]

    else:
        how = resolve_dispatch(dispatch, per_shard, cfg.hidden_size, cfg.moe_intermediate_size, n_local)

        def body(x, weights, idx, gate, up, down):
            out = routed_replicated(how, n_local, x, weights, idx, gate, up, down)
            return out, jnp.zeros((1,), bool)

    expert = PartitionSpec("expert")
    out, over = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(tok, tok, tok, expert, expert, expert),
        out_specs=(tok, PartitionSpec("data")),
        # the value checker cannot tell that both cond branches end replicated over "expert"
        # (psum vs all_gather) and refuses the cond; the specs above are right by construction
        check_vma=False,
    )(x, weights, idx, gate, up, down)
    return out, jnp.any(over)
