"""Meshes and the mapping from parameters to mesh axes: the only module that names mesh axes.

Axes: ``data`` and ``expert`` (together: the devices rows are split over) and ``tensor``.
Parameters carry logical axis names (:func:`param_logical`) that :data:`RULES` maps to mesh axes:
DeepSeek-V3's routed experts go over ``expert`` (the rest of DeepSeek is replicated); Llama's
attention heads, MLP columns and output vocabulary go over ``tensor`` (Megatron-style: q/k/v and
gate/up split by column, o and down by row, one reduction per block, inserted by XLA), its KV heads
too when they divide the axis (else they are replicated and each device reads the one its query
heads share). A dimension the mesh axes do not divide stays replicated. Activations and decode
state carry logical axis names mapped by :data:`RULES`:
``batch`` (rows of the decode state, of the hidden states at layer boundaries) and ``pages`` (the
pages of the paged KV caches) go over :data:`ROW_AXES`, ``("data", "expert")``: DeepSeek-style
data-parallel attention, every device attends for its own rows against its own pages, and the
MoE layers gather each expert group's tokens and scatter the results back
(:mod:`mtp_jax.targets.deepseek_v3.ep`).
Paged attention (:mod:`mtp_jax.targets.deepseek_v3.mla`) and routing (:mod:`mtp_jax.targets.deepseek_v3.ep`)
run under ``shard_map``
over the row axes, so no cache page ever leaves its device. A dimension the row axes do not
divide is split over the longest prefix of them that does (``data`` alone, or nothing: e.g. a
batch of 1 stays replicated).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "expert", "tensor")
ROUTED_EXPERT_LEAVES = ("gate", "up", "down")
_STORAGE_KEYS = ("fp8", "scale_inv")
ROUTED_EXPERT_SPEC = PartitionSpec("expert")
"""How a routed-expert leaf [E, ...] of one layer is split: its expert axis over ``expert``."""
ROW_AXES = ("data", "expert")
"""The mesh axes batch rows and their KV pages are split over (data-parallel attention)."""
RULES: dict[str, str | tuple[str, ...]] = {
    "batch": ROW_AXES,
    "pages": ROW_AXES,
    "experts": "expert",
    "heads": "tensor",
    "kv_heads": "tensor",
    "ffn": "tensor",
    "vocab": "tensor",
}
"""Logical axis -> mesh axis (or axes, of which the longest prefix that divides the dimension is
used); logical axes not listed are replicated."""
ACTIVATION = ("batch", None, None)
"""Logical axes of hidden states [b, t, d] at block boundaries."""


def make_mesh(
    data: int = 1, expert: int = 1, tensor: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A (data, expert, tensor) mesh over ``devices`` (default: all), axis types set explicitly to Auto:
    the compiler propagates shardings from the parameters and the few constraints we place
    (:func:`constrain` at block boundaries, :func:`constrain_state` on the step's outputs), and
    ``shard_map`` takes over inside the MoE (:mod:`mtp_jax.targets.deepseek_v3.ep`).

    Why not ``AxisType.Explicit`` (tried with jax 0.10.2): sharding-in-types makes every op whose
    output sharding is ambiguous an error, and the model has many of them: the scatters of the
    router's group mask, of the MoE combine and of the paged-cache writes, the ``jnp.zeros`` buffers
    they scatter into, the page-table gathers. Each would need an ``out_sharding`` argument threaded
    through math that is otherwise free of partitioning (``with_sharding_constraint`` also refuses
    Explicit axes: ``reshard`` instead). With Auto the math stays mesh-agnostic and the results are
    the same; the explicit spelling is left for when the model code carries logical axes itself.
    """
    sizes = {"data": data, "expert": expert, "tensor": tensor}
    for name, n in sizes.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"mesh axis {name!r} must be a positive integer, got {n!r}")
    devices = list(jax.devices() if devices is None else devices)
    need = data * expert * tensor
    if need != len(devices):
        raise ValueError(
            f"mesh data={data} x expert={expert} x tensor={tensor} needs {need} devices, "
            f"{len(devices)} available"
        )
    grid = np.asarray(devices, dtype=object).reshape(data, expert, tensor)
    return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def split_axes(mesh: Mesh, axes: str | tuple[str, ...], *sizes: int) -> tuple[str, ...]:
    """The longest prefix of ``axes`` whose device count divides every one of ``sizes``, without its
    axes of size 1 (a split over one device is no split)."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    for end in range(len(axes), 0, -1):
        n = math.prod(mesh.shape[a] for a in axes[:end])
        if all(size % n == 0 for size in sizes):
            return tuple(a for a in axes[:end] if mesh.shape[a] > 1)
    return ()


def row_shards(mesh: Mesh | None) -> int:
    """How many shards batch rows and KV pages are split into under ``mesh`` when they divide."""
    return 1 if mesh is None else math.prod(mesh.shape[a] for a in ROW_AXES)


def axes_spec(axes: tuple[str, ...], dim: int = 0) -> PartitionSpec:
    """PartitionSpec splitting dimension ``dim`` over ``axes`` (all of them, as one), the rest replicated."""
    return PartitionSpec(*([None] * dim), spec_entry(axes))


def shard_index(mesh: Mesh, axes: tuple[str, ...]) -> jax.Array:
    """Inside ``shard_map``: this device's shard number along ``axes`` taken together (row-major,
    the order a dimension split over ``axes`` is laid out in)."""
    index = jnp.int32(0)
    for a in axes:
        index = index * mesh.shape[a] + jax.lax.axis_index(a)
    return index


def spec_entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    """A PartitionSpec entry splitting one dimension over ``axes`` taken together (None: none)."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


def logical_spec(mesh: Mesh, logical: Sequence[str | None], shape: Sequence[int]) -> PartitionSpec:
    """PartitionSpec of an array of ``shape`` whose dimensions have the ``logical`` names (None:
    replicated); a dimension its mesh axes do not divide is split over a prefix of them that does
    (see :func:`split_axes`), possibly none."""
    if len(logical) != len(shape):
        raise ValueError(f"{len(logical)} logical axes for a rank-{len(shape)} array")
    entries = []
    for name, n in zip(logical, shape, strict=True):
        axes = RULES.get(name) if name is not None else None
        entries.append(None if axes is None else spec_entry(split_axes(mesh, axes, n)))
    return PartitionSpec(*entries)


def constrain(x: jax.Array, mesh: Mesh | None, logical: Sequence[str | None]) -> jax.Array:
    """``x`` with its sharding pinned to the ``logical`` axes under ``mesh``; unchanged without one."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_spec(mesh, logical, x.shape)))


def replicated(x: jax.Array, mesh: Mesh | None) -> jax.Array:
    """``x`` pinned to every device of ``mesh`` (inside jit); unchanged without one. The step's
    small outputs the host reads (tokens, counts) are replicated so that every process of a
    multi-host run can fetch them whole."""
    return constrain(x, mesh, (None,) * x.ndim)


def state_logical(path: tuple, shape: Sequence[int], sc: Any) -> tuple[str | None, ...]:
    """Logical axes of one leaf of a :class:`mtp_jax.step.DecodeState` decoded with the step
    config ``sc``: the target's cache leaves as its :attr:`~mtp_jax.targets.base.Target.
    cache_logical` names them (split by page), the draft's state as the draft names it, and every
    other leaf by row."""
    first = path[0].name if path and isinstance(path[0], jax.tree_util.GetAttrKey) else None
    keys = [str(k.key) for k in path[1:] if isinstance(k, jax.tree_util.DictKey)]
    rank = len(shape)
    if first == "target_pages":
        return tuple(sc.target.cache_logical(keys[-1] if keys else "", rank))
    if first == "draft_state":
        return tuple(sc.draft_method.state_logical(keys, rank))
    if rank == 0:
        return ()
    return ("batch",) + (None,) * (rank - 1)


ROW_LOGICAL = ("batch", "pages")
"""The logical axes of a decode state that go over :func:`state_axes` (rows and their pages)."""


def state_axes(mesh: Mesh, state: Any) -> tuple[str, ...]:
    """The mesh axes a decode state's rows and pages are split over: the longest prefix of
    :data:`ROW_AXES` that divides both its batch and its page count, so that every row shard holds
    its rows' pages (attention then needs no cache traffic,
    :func:`mtp_jax.targets.deepseek_v3.mla.mla_paged`)."""
    num_pages = jax.tree.leaves(state.target_pages)[0].shape[1]
    return split_axes(mesh, ROW_AXES, state.seq_len.shape[0], num_pages)


def _state_specs(sc: Any, state: Any) -> Any:
    mesh = sc.mesh
    rows = spec_entry(state_axes(mesh, state))

    def spec(path: tuple, x: Any) -> PartitionSpec:
        entries = []
        for name, n in zip(state_logical(path, x.shape, sc), x.shape, strict=True):
            if name in ROW_LOGICAL:
                entries.append(rows)
            else:
                axes = RULES.get(name) if name is not None else None
                entries.append(None if axes is None else spec_entry(split_axes(mesh, axes, n)))
        return PartitionSpec(*entries)

    return jax.tree_util.tree_map_with_path(spec, state)


def state_shardings(sc: Any, state: Any) -> Any:
    """NamedShardings for every leaf of a decode state under ``sc.mesh``: rows and pages
    (:func:`state_logical`) over :func:`state_axes`, other named axes by :data:`RULES`, everything
    else replicated."""
    return jax.tree.map(lambda spec: NamedSharding(sc.mesh, spec), _state_specs(sc, state))


def constrain_state(state: Any, sc: Any) -> Any:
    """A decode state with every leaf pinned to :func:`state_shardings` (inside jit); unchanged
    without a mesh. Pinning the step's outputs keeps its input shardings a fixed point, so the step
    compiles once."""
    if sc.mesh is None:
        return state
    return jax.tree.map(
        lambda x, spec: jax.lax.with_sharding_constraint(x, NamedSharding(sc.mesh, spec)),
        state,
        _state_specs(sc, state),
    )


def _names(path: tuple) -> list[str]:
    return [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]


def param_logical(group: str, names: Sequence[str], rank: int) -> tuple[str | None, ...]:
    """Logical axes of one parameter leaf of ``group`` (e.g. "moe", "layers", "lm_head") at dict
    path ``names`` inside it, of ``rank`` dimensions (one layer, no stacking axis): as the module
    that owns the group registered them (:func:`register_group_layout`: each target its layer
    stacks, each draft its own weights); the head [d, V] vocabulary-parallel, anything else
    replicated."""
    names = list(names)
    while names and names[-1] in _STORAGE_KEYS:
        names.pop()
    if group in _GROUP_LAYOUTS:
        return tuple(_GROUP_LAYOUTS[group](names, rank))
    if rank == 2 and group == "lm_head":
        return (None, "vocab")  # [d, V]: vocabulary-parallel head
    return (None,) * rank


def expert_logical(names: Sequence[str], rank: int) -> tuple[str | None, ...]:
    """A layer of a mixture of experts: its routed experts' projections (``mlp.gate`` / ``up`` /
    ``down`` [E, ...]) split over ``experts``, everything else replicated (data-parallel
    attention)."""
    if len(names) >= 2 and names[-2] == "mlp" and names[-1] in ROUTED_EXPERT_LEAVES:
        return ("experts",) + (None,) * (rank - 1)
    return (None,) * rank


_GROUP_LAYOUTS: dict[str, Any] = {}


def register_group_layout(group: str, layout: Any) -> None:
    """Make ``layout(names, rank) -> logical axes`` decide the leaves of parameter group ``group``
    (a target's layer stacks, a draft's own weights, registered by their modules:
    :func:`param_logical` names no model)."""
    _GROUP_LAYOUTS[group] = layout


def group_shardings(mesh: Mesh, group: str, tree: Any, stacked: bool = False) -> Any:
    """NamedShardings for every leaf of ``tree`` (one group, e.g. one layer), from
    :func:`param_logical` through :data:`RULES`; dimensions the mesh axes do not divide stay
    replicated. ``stacked``: the shardings of the stack of such layers (a leading layer axis,
    never split)."""

    def one(path: tuple, leaf: Any) -> NamedSharding:
        shape = tuple(leaf.shape)
        logical = param_logical(group, _names(path), len(shape))
        spec = logical_spec(mesh, logical, shape)
        return NamedSharding(mesh, PartitionSpec(None, *spec) if stacked else spec)

    return jax.tree_util.tree_map_with_path(one, tree)


def local_experts(mesh: Mesh, n_experts: int) -> list[int] | None:
    """The routed experts whose weights this process's devices hold under ``mesh`` (ascending), or
    None when they hold all of them (one process, or every expert group within each host). A loader
    reads only these from the checkpoint."""
    sharding = NamedSharding(mesh, ROUTED_EXPERT_SPEC)
    shards = sharding.addressable_devices_indices_map((n_experts,)).values()
    ids = {e for index in shards for e in range(n_experts)[index[0]]}
    return None if len(ids) == n_experts else sorted(ids)


def check_mesh(mesh: Mesh, n_routed_experts: int) -> None:
    """A DeepSeek-V3 mesh: the standard axes, no tensor split, ``expert`` dividing the experts."""
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"mesh axes must be {MESH_AXES} (use mtp_jax.make_mesh), got {mesh.axis_names}")
    if mesh.shape["tensor"] != 1:
        raise ValueError(
            f"mesh axis 'tensor'={mesh.shape['tensor']}: DeepSeek-V3 runs data-parallel attention and "
            "expert-parallel MoE (data x expert); tensor parallelism is for Llama"
        )
    if n_routed_experts % mesh.shape["expert"]:
        raise ValueError(
            f"mesh axis 'expert'={mesh.shape['expert']} does not divide the model's "
            f"{n_routed_experts} routed experts"
        )
