"""Meshes and the mapping from parameters to mesh axes: the only module that names mesh axes.

Axes: ``data`` (batch rows and their KV pages), ``expert`` (routed experts), ``tensor`` (reserved;
must be 1 for now). Today's rule set: routed experts are split over ``expert``; every other
parameter is replicated (attention runs data-parallel, DeepSeek style).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "expert", "tensor")
EXPERT_STACKS = ("moe", "mtp")
ROUTED_EXPERT_LEAVES = ("gate", "up", "down")
_STORAGE_KEYS = ("fp8", "scale_inv")


def make_mesh(
    data: int = 1, expert: int = 1, tensor: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A (data, expert, tensor) mesh over ``devices`` (default: all), axis types set explicitly to Auto
    (the compiler propagates shardings from the parameters and the few constraints we place)."""
    sizes = {"data": data, "expert": expert, "tensor": tensor}
    for name, n in sizes.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"mesh axis {name!r} must be a positive integer, got {n!r}")
    if tensor != 1:
        raise ValueError("tensor parallelism is not supported yet: use tensor=1")
    devices = list(jax.devices() if devices is None else devices)
    need = data * expert * tensor
    if need != len(devices):
        raise ValueError(
            f"mesh data={data} x expert={expert} x tensor={tensor} needs {need} devices, "
            f"{len(devices)} available"
        )
    grid = np.asarray(devices, dtype=object).reshape(data, expert, tensor)
    return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def _names(path: tuple) -> list[str]:
    names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    while names and names[-1] in _STORAGE_KEYS:
        names.pop()
    return names


def group_spec(group: str, path: tuple) -> PartitionSpec:
    """PartitionSpec of one leaf of a parameter group (one layer, no stacking axis)."""
    names = _names(path)
    if group in EXPERT_STACKS and "mlp" in names and names[-1] in ROUTED_EXPERT_LEAVES:
        return PartitionSpec("expert")
    return PartitionSpec()


def group_shardings(mesh: Mesh, group: str, tree: Any, stacked: bool = False) -> Any:
    """NamedShardings for every leaf of ``tree`` (a group; with a leading layer axis if stacked)."""

    def one(path: tuple, _: Any) -> NamedSharding:
        spec = group_spec(group, path)
        return NamedSharding(mesh, PartitionSpec(None, *spec) if stacked else spec)

    return jax.tree_util.tree_map_with_path(one, tree)


def check_mesh(mesh: Mesh, n_routed_experts: int) -> None:
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"mesh axes must be {MESH_AXES} (use mtp_jax.make_mesh), got {mesh.axis_names}")
    if n_routed_experts % mesh.shape["expert"]:
        raise ValueError(
            f"mesh axis 'expert'={mesh.shape['expert']} does not divide the model's "
            f"{n_routed_experts} routed experts"
        )
