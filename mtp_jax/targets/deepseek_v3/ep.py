"""Expert parallelism: the MoE routing and routed experts of one layer under ``shard_map``, with the
experts split over the mesh axis ``expert`` (E_l = e / |expert| local experts per device).

Tokens arrive split over the row axes (:data:`mtp_jax.sharding.ROW_AXES`: data-parallel
attention over ``data`` x ``expert``), or over ``data`` alone when their count is not divisible
by every device (then replicated within each expert group). Routing runs per token on the device
that holds it; the expert *group* (the devices of one ``data`` index) then shares its tokens. Two
paths, chosen statically by the number of tokens the group holds:

- **decode** (:func:`routed_replicated`; fewer than ``a2a_min_tokens`` tokens, or a token count the
  expert axis does not divide): the group's tokens are gathered on each of its devices
  (``all_gather`` over ``expert``), every device evaluates only its local experts on the copies
  routed to them (dropless: sorted grouped matmul, or dense over the local experts for small sizes
  on CPU) and the partial sums are reduced and handed back to the devices that own the tokens
  (``psum_scatter``; ``psum`` when the tokens were replicated). No dispatch traffic: the
  low-latency choice for decode-sized batches.
- **prefill** (:func:`routed_all_to_all`): each device of the group takes its 1/|expert| of the
  tokens (the ones it holds), sends every token copy to the device owning its expert, evaluates
  its local experts on what it received, sends the results back the same way and combines them
  with the routing weights. Two exchanges (:data:`EXCHANGE`): ``jax.lax.ragged_all_to_all``
  (GPU/TPU: exactly the routed rows travel, into a receive buffer of C rows per device) or a
  dense ``all_to_all`` of fixed capacity C per (source, destination) pair (XLA:CPU, which has no
  ragged all-to-all; the tests run the ragged path there through an equivalent built from
  ``all_gather``). Dropless: when a buffer would overflow, the whole group takes the decode path
  instead (``lax.cond`` on a group-wide flag), so no token is ever dropped.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from mtp_jax.sharding import ROW_AXES, axes_spec, split_axes
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
from mtp_jax.targets.deepseek_v3.moe import DISPATCH, resolve_dispatch, route

# Both knobs are read when a MoE layer is traced: set them before the first compile (or clear
# JAX's caches), as the jitted entry points are keyed on the mesh, not on these values.
# Tokens per expert group from which the all-to-all dispatch is used (prefill-sized batches);
# decode steps (B x (K+1) tokens) stay below it and take the gather + reduce-scatter path.
A2A_MIN_TOKENS = 256
# Buffer size as a multiple of the balanced load: per (source, destination) pair m·k/|expert| rows for
# the dense exchange, per receiving device m·k rows for the ragged one. A larger load falls back to
# the replicated path (never drops); |expert| or more makes overflow impossible.
CAPACITY_FACTOR = 2.0
# How the prefill path exchanges token copies: "dense" (all_to_all of fixed-size buffers, the only
# one XLA:CPU runs), "ragged" (jax.lax.ragged_all_to_all: exactly the routed rows; emulated on CPU)
# or "auto" (ragged on GPU/TPU, dense on CPU).
EXCHANGE = "auto"


def _local_choice(weights: jax.Array, idx: jax.Array, n_local: int) -> tuple[jax.Array, jax.Array]:
    """Routing restricted to this device's experts: copies routed elsewhere get weight 0 and the
    out-of-range id ``n_local``, which the sorted grouped matmul skips and the dense path drops."""
    local = idx - jax.lax.axis_index("expert") * n_local
    mine = (local >= 0) & (local < n_local)
    return jnp.where(mine, weights, 0.0), jnp.where(mine, local, n_local).astype(jnp.int32)


def routed_replicated(
    how: str, n_local: int, split: bool, x: jax.Array, weights: jax.Array, idx: jax.Array, gate, up, down
) -> jax.Array:
    """Inside ``shard_map``: x [n, d] this device's tokens (``split``: its 1/|expert| of the group's,
    else all of them), weights/idx [n, k] their global routing, gate/up/down the local [E_l, ...]
    experts -> Σ over all experts [n, d] for the same tokens."""
    if split:
        x, weights, idx = (jax.lax.all_gather(a, "expert", tiled=True) for a in (x, weights, idx))
    w_l, idx_l = _local_choice(weights, idx, n_local)
    part = DISPATCH[how](x, w_l, idx_l, gate, up, down).astype(jnp.float32)
    if split:
        return jax.lax.psum_scatter(part, "expert", scatter_dimension=0, tiled=True).astype(x.dtype)
    return jax.lax.psum(part, "expert").astype(x.dtype)


def capacity(tokens: int, k: int, n_dev: int, factor: float) -> int:
    """Rows per (source, destination) buffer of the dense exchange for ``tokens`` tokens of
    top-``k`` routing per source."""
    return max(1, min(tokens * k, math.ceil(factor * tokens * k / n_dev)))


def ragged_capacity(tokens: int, k: int, n_dev: int, factor: float) -> int:
    """Rows of each device's receive buffer in the ragged exchange (from all sources together)."""
    return max(1, min(n_dev * tokens * k, math.ceil(factor * tokens * k)))


def resolve_exchange(exchange: str) -> str:
    """ "dense" or "ragged" for ``exchange`` ("auto": ragged on GPU/TPU, dense on the CPU, whose
    XLA backend has no ragged all-to-all)."""
    if exchange == "auto":
        return "dense" if jax.default_backend() == "cpu" else "ragged"
    if exchange not in ("dense", "ragged"):
        raise ValueError(f"exchange must be 'auto', 'dense' or 'ragged', got {exchange!r}")
    return exchange


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name):
    """``jax.lax.ragged_all_to_all`` (one slice per device); on the CPU backend, which cannot run it,
    the same exchange built from ``all_gather``/``all_to_all`` (every source's whole buffer travels:
    for tests, not for speed)."""
    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
    if jax.default_backend() != "cpu":
        return jax.lax.ragged_all_to_all(*args, axis_name=axis_name)
    n = jax.lax.axis_size(axis_name)
    everyone = jax.lax.all_gather(operand, axis_name)  # [n, rows, ...]
    starts = jax.lax.all_to_all(input_offsets, axis_name, 0, 0, tiled=True)  # source s's slice for me
    lands = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # ... and where it goes
    r = jnp.arange(operand.shape[0])
    rows = jnp.clip(starts[:, None] + r, 0, operand.shape[0] - 1)
    values = everyone[jnp.arange(n)[:, None], rows]
    dst = jnp.where(r < recv_sizes[:, None], lands[:, None] + r, output.shape[0])  # past the end: dropped
    return output.at[dst.reshape(-1)].set(values.reshape((-1,) + operand.shape[1:]), mode="drop")


def _dense_exchange(how, n_local, cap, xs, ids, k, gate, up, down):
    """All-to-all with a fixed ``cap`` rows per (source, destination): (overflowed, run) where run()
    gives the expert output of every token copy [m·k, d] in copy order."""
    n_dev = jax.lax.axis_size("expert")
    d = xs.shape[1]
    dest = ids // n_local
    onehot = jax.nn.one_hot(dest, n_dev, dtype=jnp.int32)  # [m·k, n_dev]
    rank = jnp.take_along_axis(jnp.cumsum(onehot, axis=0), dest[:, None], axis=1)[:, 0] - 1
    overflow = jax.lax.pmax(jnp.any(onehot.sum(0) > cap).astype(jnp.int32), "expert") > 0

    def run():
        token = jnp.arange(ids.shape[0]) // k
        send_x = jnp.zeros((n_dev, cap, d), xs.dtype).at[dest, rank].set(xs[token], mode="drop")
        send_id = jnp.full((n_dev, cap), n_local, jnp.int32).at[dest, rank].set(ids % n_local, mode="drop")
        recv_x = jax.lax.all_to_all(send_x, "expert", 0, 0).reshape(n_dev * cap, d)
        recv_id = jax.lax.all_to_all(send_id, "expert", 0, 0).reshape(n_dev * cap, 1)
        one = (recv_id < n_local).astype(jnp.float32)
        y = DISPATCH[how](recv_x, one, recv_id, gate, up, down).reshape(n_dev, cap, d)
        back = jax.lax.all_to_all(y, "expert", 0, 0)
        return back[dest, jnp.minimum(rank, cap - 1)]

    return overflow, run


def _ragged_exchange(how, n_local, cap, xs, ids, k, gate, up, down):
    """Ragged all-to-all: each token copy travels alone (sorted by destination device) into a
    receive buffer of ``cap`` rows per device; results come back the same way. Same contract as
    :func:`_dense_exchange`; overflow means some device would receive more than ``cap`` copies."""
    me = jax.lax.axis_index("expert")
    n_dev = jax.lax.axis_size("expert")
    d = xs.shape[1]
    dest = ids // n_local
    order = jnp.argsort(dest, stable=True)
    send_sizes = jnp.zeros(n_dev, jnp.int32).at[dest].add(1)
    sizes = jax.lax.all_gather(send_sizes, "expert")  # [source, destination]
    at_source = jnp.cumsum(sizes, axis=1) - sizes  # where a slice starts in its source's sorted buffer
    at_dest = jnp.cumsum(sizes, axis=0) - sizes  # ... and in its destination's receive buffer
    overflow = jnp.any(sizes.sum(0) > cap)  # the same on every device: sizes is gathered

    def run():
        send_x = xs[(jnp.arange(ids.shape[0]) // k)[order]]
        send_id = (ids % n_local)[order]
        there = (at_source[me], send_sizes, at_dest[me], sizes[:, me])
        recv_x = ragged_all_to_all(send_x, jnp.zeros((cap, d), xs.dtype), *there, "expert")
        recv_id = ragged_all_to_all(send_id, jnp.full((cap,), n_local, jnp.int32), *there, "expert")
        one = (recv_id < n_local).astype(jnp.float32)[:, None]
        y = DISPATCH[how](recv_x, one, recv_id[:, None], gate, up, down)
        back_args = (at_dest[:, me], sizes[:, me], at_source[:, me], send_sizes)
        back = ragged_all_to_all(y, jnp.zeros((ids.shape[0], d), y.dtype), *back_args, "expert")
        return jnp.zeros_like(back).at[order].set(back)

    return overflow, run


def routed_all_to_all(
    how: str,
    n_local: int,
    cap: int,
    split: bool,
    x: jax.Array,
    weights: jax.Array,
    idx: jax.Array,
    gate,
    up,
    down,
    exchange: str = "dense",
) -> tuple[jax.Array, jax.Array]:
    """Inside ``shard_map``: as :func:`routed_replicated`, through all-to-all dispatch: ``exchange``
    "dense" (``cap`` rows per source and destination) or "ragged" (``cap`` rows received per
    device, :func:`ragged_all_to_all`). Without ``split`` the group's tokens must divide by |expert|.

    Returns (output, overflowed: bool scalar, the same on the whole group; when set, the output
    came from :func:`routed_replicated`).
    """
    n_dev = jax.lax.axis_size("expert")
    me = jax.lax.axis_index("expert")
    k = idx.shape[1]
    if split:
        xs, ws, ids = x, weights, idx
    else:
        m = x.shape[0] // n_dev
        xs, ws, ids = (jax.lax.dynamic_slice_in_dim(a, me * m, m) for a in (x, weights, idx))
    m, d = xs.shape
    build = {"dense": _dense_exchange, "ragged": _ragged_exchange}[exchange]
    overflow, run = build(how, n_local, cap, xs, ids.reshape(-1), k, gate, up, down)

    def dispatch(_):
        got = run().astype(jnp.float32) * ws.reshape(-1)[:, None]
        out = got.reshape(m, k, d).sum(1).astype(x.dtype)
        return out if split else jax.lax.all_gather(out, "expert", tiled=True)

    def fallback(_):
        return routed_replicated(how, n_local, split, x, weights, idx, gate, up, down)

    return jax.lax.cond(overflow, fallback, dispatch, None), overflow


def token_axes(rows: int, mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes tokens of ``rows`` rows are split over (by row: the row axes, or the prefix of
    them ``rows`` divides)."""
    return split_axes(mesh, ROW_AXES, rows)


def choose_path(shape: tuple[int, ...], mesh: Mesh, a2a_min_tokens: int) -> str:
    """ "a2a" or "replicated" for tokens of leading shape ``shape`` ([rows] or [rows, t]; static), as
    in the module docstring."""
    n_dev = mesh.shape["expert"]
    group = math.prod(shape) // math.prod(mesh.shape[a] for a in token_axes(shape[0], mesh) if a != "expert")
    if n_dev > 1 and group >= a2a_min_tokens and group % n_dev == 0:
        return "a2a"
    return "replicated"


def moe_sharded(
    x: jax.Array,
    router: jax.Array,
    bias: jax.Array,
    gate,
    up,
    down,
    cfg: DeepseekV3Config,
    mesh: Mesh,
    dispatch: str = "auto",
    a2a_min_tokens: int | None = None,
    capacity_factor: float | None = None,
    exchange: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Routing and routed experts for tokens x [b, ..., d] over ``mesh`` (router [d, e], bias [e]
    replicated; gate/up/down the full [e, ...] expert weights, split over ``expert``: the
    ``shard_map`` takes the local slices).

    The tokens are split over the row axes by their leading dimension b (rows), as the hidden
    states around the layer are (:func:`token_axes`).

    Returns (Σ_k weights · expert(x) [b, ..., d], tokens routed to each expert [e] float32, overflowed:
    bool scalar, always False on the decode path). ``a2a_min_tokens``/``capacity_factor``/``exchange``
    default to :data:`A2A_MIN_TOKENS`/:data:`CAPACITY_FACTOR`/:data:`EXCHANGE`.
    """
    a2a_min_tokens = A2A_MIN_TOKENS if a2a_min_tokens is None else a2a_min_tokens
    capacity_factor = CAPACITY_FACTOR if capacity_factor is None else capacity_factor
    b, n, n_dev = x.shape[0], math.prod(x.shape[:-1]), mesh.shape["expert"]
    n_local = cfg.n_routed_experts // n_dev
    axes = token_axes(b, mesh)
    split = "expert" in axes
    group = n // math.prod(mesh.shape[a] for a in axes if a != "expert")
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    if choose_path(x.shape[:-1], mesh, a2a_min_tokens) == "a2a":
        how_exchange = resolve_exchange(EXCHANGE if exchange is None else exchange)
        k = cfg.num_experts_per_tok
        if how_exchange == "ragged":
            cap = ragged_capacity(group // n_dev, k, n_dev, capacity_factor)
            how = resolve_dispatch(dispatch, cap, d, f, n_local)
        else:
            cap = capacity(group // n_dev, k, n_dev, capacity_factor)
            how = resolve_dispatch(dispatch, n_dev * cap, d, f, n_local)

        def experts(x, weights, idx, gate, up, down):
            return routed_all_to_all(how, n_local, cap, split, x, weights, idx, gate, up, down, how_exchange)

    else:
        how = resolve_dispatch(dispatch, group, d, f, n_local, cfg.num_experts_per_tok)

        def experts(x, weights, idx, gate, up, down):
            return routed_replicated(how, n_local, split, x, weights, idx, gate, up, down), jnp.bool_(False)

    def body(x, router, bias, gate, up, down):
        shape, x = x.shape, x.reshape(-1, d)
        weights, idx = route(x, router, bias, cfg)
        out, over = experts(x, weights, idx, gate, up, down)
        out = out.reshape(shape)
        load = jnp.zeros(cfg.n_routed_experts, jnp.float32).at[idx.reshape(-1)].add(1.0)
        if axes:
            load = jax.lax.psum(load, axes)
        return out, load, over[None]

    tok, expert, rep = axes_spec(axes), PartitionSpec("expert"), PartitionSpec()
    out, load, over = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(tok, rep, rep, expert, expert, expert),
        out_specs=(tok, rep, PartitionSpec(ROW_AXES)),
        # the value checker cannot tell that both cond branches end the same (replicated or split
        # over "expert": psum/psum_scatter vs all_gather/none) and refuses the cond; the specs above
        # are right by construction
        check_vma=False,
    )(x, router, bias, gate, up, down)
    return out, load, jnp.any(over)
