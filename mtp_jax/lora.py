"""LoRA adapters in the PEFT layout, many at once over one base model, per row of a step.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (what
``peft``'s ``save_pretrained`` writes). For a module with base weight W [out, in] (the hub's
layout) it holds ``lora_A`` [r, in] and ``lora_B`` [out, r], and the adapted module computes
``x W^T + s · x A^T B^T`` with ``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
``use_rslora``), ``r`` and ``lora_alpha`` overridden per module by ``rank_pattern`` /
``alpha_pattern``. ``target_modules`` (names or one regular expression) and
``layers_to_transform`` say which modules an adapter changes; its tensors are what it changes.

On device (:class:`LoraStacks`), each adaptable module of a target (:class:`LoraSite`, declared by
the target: :attr:`mtp_jax.targets.base.Target.lora_sites`) has two stacks over the layers of
its parameter group and ``max_loras`` slots: ``a`` [L, *in, S, R] (A transposed, in our
layout's input axes) and ``b`` [L, S, R, *out] (B transposed, with ``s`` folded in), ``R`` the
largest rank (``max_lora_rank``; smaller ranks padded with zeros, which adds exactly nothing);
with per-layer weight buffers, a tuple of L such layers, each its own buffer. Adapter slots are
numbered from 1 (slot ``i`` at index ``i - 1``); slot 0, a row without an adapter, is not stored:
its one-hot row is all zeros. Each row of a step names its slot, and a layer adds
``(x · a[slot]) · b[slot]`` beside the base matmul (:func:`delta`: every slot's ``x · a`` at once,
as one matmul over the slots' ranks side by side, the other slots' masked to zero: each slot's
weights are read once and nothing is copied per row). Loading an adapter writes its slot
(:func:`write_slot`), unloading zeroes it: shapes never change, so nothing recompiles.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.errors import AdapterError, InvalidRequestError

__all__ = ["AdapterError", "LoraSite", "LoraTable", "read_adapter"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclasses.dataclass(frozen=True)
class LoraSite:
    """A projection of a target's layers that takes an adapter.

    ``module``: its name inside a layer, as the hub (and so PEFT) names it ("self_attn.q_proj");
    ``group``: the parameter group holding the layer stack it belongs to ("layers"); ``first``:
    the model's layer index of that stack's layer 0; ``path``: its leaf in one layer's tree
    (("attn", "q")); ``in_shape`` / ``out_shape``: our layout's input and output axes (the weight is
    ``in_shape + out_shape``; the hub's [out, in] flattened); ``in_logical`` / ``out_logical``:
    their logical axis names (:mod:`mtp_jax.sharding`)."""

    module: str
    group: str
    first: int
    count: int
    path: tuple[str, ...]
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    in_logical: tuple[str | None, ...]
    out_logical: tuple[str | None, ...]

    @property
    def fan_in(self) -> int:
        return math.prod(self.in_shape)

    @property
    def fan_out(self) -> int:
        return math.prod(self.out_shape)


def split_leaf(
    shape: Sequence[int], logical: Sequence[str | None], fan_in: int
) -> tuple[tuple, tuple, tuple, tuple]:
    """(in_shape, out_shape, in_logical, out_logical) of a projection leaf of ``shape`` whose
    leading axes hold ``fan_in`` inputs."""
    n, size = 0, 1
    while size < fan_in:
        size *= shape[n]
        n += 1
    if size != fan_in:
        raise ValueError(f"no leading axes of {tuple(shape)} hold {fan_in} inputs")
    return tuple(shape[:n]), tuple(shape[n:]), tuple(logical[:n]), tuple(logical[n:])


# --- the PEFT adapter --------------------------------------------------------------------------

_REFUSED_FEATURES = {
    "use_dora": "DoRA (use_dora) adapters",
    "layer_replication": "layer_replication",
    "target_parameters": "target_parameters (LoRA on raw parameters, e.g. routed experts)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "lora_bias": "lora_bias (a bias on lora_B)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-layout base weights)",
    "modules_to_save": "modules_to_save (whole modules replaced by the adapter)",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
    "megatron_config": "megatron_config (Megatron-parallel LoRA layers)",
    "arrow_config": "Arrow routing among adapters (arrow_config)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "kasa_config": "kasa_config",
    "velora_config": "velora_config",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
}
"""adapter_config.json settings that change what an adapter computes and that mtp-jax does not
implement: an adapter that sets one is refused by name rather than applied wrongly. (Settings that
only decide how training starts, such as init_lora_weights, loftq_config or eva_config, are read
past.)"""

_NOT_ADAPTABLE = (
    (re.compile(r"(^|\.)(embed_tokens|wte|word_embeddings)$"), "the token embedding"),
    (re.compile(r"(^|\.)lm_head$"), "the output head"),
    (re.compile(r"\.experts\.\d+\.|\.experts$"), "routed experts"),
    (re.compile(r"\.gate$"), "the MoE router"),
)


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """The parts of ``adapter_config.json`` that decide what an adapter computes."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str | None
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] = dataclasses.field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = dataclasses.field(default_factory=dict)
    layers_to_transform: tuple[int, ...] | None = None
    base_model_name_or_path: str | None = None

    @classmethod
    def parse(cls, raw: Mapping[str, Any], where: str) -> AdapterConfig:
        """Check and parse a raw ``adapter_config.json``; AdapterError names what cannot be applied."""
        peft_type = str(raw.get("peft_type", "LORA")).upper()
        if peft_type != "LORA":
            raise AdapterError(f"{where}: peft_type {raw.get('peft_type')!r} is not a LoRA adapter")
        for key, what in _REFUSED_FEATURES.items():
            value = raw.get(key)
            if value not in (None, False, [], {}, "", 0):
                raise AdapterError(f"{where}: {what} cannot be applied (adapter_config.json {key}={value!r})")
        if raw.get("bias", "none") != "none":
            raise AdapterError(
                f"{where}: bias={raw['bias']!r} adapters train base biases; only 'none' is supported"
            )
        r = raw.get("r")
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise AdapterError(f"{where}: adapter_config.json r must be a positive integer, got {r!r}")
        alpha = raw.get("lora_alpha", r)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise AdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
        targets = raw.get("target_modules")
        if isinstance(targets, list):
            targets = tuple(str(t) for t in targets)
        elif targets is not None and not isinstance(targets, str):
            raise AdapterError(
                f"{where}: target_modules must be a list or a regular expression, got {targets!r}"
            )
        layers = raw.get("layers_to_transform")
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = (layers,)
        elif layers is not None:
            layers = tuple(int(i) for i in layers)
        for name, pattern in (
            ("rank_pattern", raw.get("rank_pattern") or {}),
            ("alpha_pattern", raw.get("alpha_pattern") or {}),
        ):
            if not isinstance(pattern, dict):
                raise AdapterError(f"{where}: {name} must be a mapping, got {pattern!r}")
        return cls(
            r=r,
            lora_alpha=float(alpha),
            target_modules=targets,
            use_rslora=bool(raw.get("use_rslora", False)),
            rank_pattern={str(k): int(v) for k, v in (raw.get("rank_pattern") or {}).items()},
            alpha_pattern={str(k): float(v) for k, v in (raw.get("alpha_pattern") or {}).items()},
            layers_to_transform=layers,
            base_model_name_or_path=raw.get("base_model_name_or_path"),
        )

    @staticmethod
    def _pattern_value(patterns: Mapping[str, Any], name: str, default: Any) -> Any:
        """PEFT's rule: the first pattern that matches the module name's end wins."""
        for key, value in patterns.items():
            if re.match(rf"(.*\.)?({key})$", name):
                return value
        return default

    def rank(self, name: str) -> int:
        return int(self._pattern_value(self.rank_pattern, name, self.r))

    def scaling(self, name: str) -> float:
        """``s`` of module ``name`` (its full name, "model.layers.3.self_attn.q_proj")."""
        r = self.rank(name)
        alpha = float(self._pattern_value(self.alpha_pattern, name, self.lora_alpha))
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_]+)?\.weight$")
_LAYER = re.compile(r"^(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<rest>.+)$")


@dataclasses.dataclass(frozen=True)
class Adapter:
    """A read adapter: its config and, per (layer, module), (A [r, in], B [out, r]) float32 and s."""

    name: str
    path: str
    config: AdapterConfig
    weights: Mapping[tuple[int, str], tuple[np.ndarray, np.ndarray, float]]

    @property
    def max_rank(self) -> int:
        return max((a.shape[0] for a, _, _ in self.weights.values()), default=0)


def read_adapter(path: str | os.PathLike[str], name: str | None = None) -> Adapter:
    """Read a PEFT LoRA adapter directory (config and tensors, checked against each other)."""
    from mtp_jax.checkpoint.safetensors_io import SafetensorsFile

    path = os.fspath(path)
    name = name or os.path.basename(os.path.normpath(path))
    where = f"adapter {name!r} ({path})"
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise AdapterError(f"{where}: no {CONFIG_FILE} (a PEFT LoRA adapter directory has one)")
    with open(config_path) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise AdapterError(f"{where}: {CONFIG_FILE} is not JSON: {e}") from None
    config = AdapterConfig.parse(raw, where)
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        bin_path = os.path.join(path, "adapter_model.bin")
        hint = (
            " (adapter_model.bin is a pickle: re-save it with safe_serialization=True)"
            if os.path.isfile(bin_path)
            else ""
        )
        raise AdapterError(f"{where}: no {WEIGHTS_FILE}{hint}")
    tensors = SafetensorsFile(weights_path)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key in tensors.keys():
        m = _KEY.match(key)
        if m is None:
            if "lora_embedding" in key:
                raise AdapterError(f"{where}: {key}: LoRA on the token embedding cannot be applied")
            raise AdapterError(
                f"{where}: unexpected tensor {key!r} (a LoRA adapter holds lora_A / lora_B weights)"
            )
        pairs.setdefault(m["module"], {})[m["ab"]] = np.asarray(tensors.get(key), np.float32)
    weights = {}
    for module, ab in sorted(pairs.items()):
        for what, reason in _NOT_ADAPTABLE:
            if what.search(module):
                raise AdapterError(f"{where}: {module}: {reason} cannot take a LoRA adapter in mtp-jax")
        if set(ab) != {"A", "B"}:
            raise AdapterError(
                f"{where}: {module} has lora_{next(iter(ab))} but no lora_{'AB'.replace(next(iter(ab)), '')}"
            )
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(
                f"{where}: {module}: lora_A {a.shape} and lora_B {b.shape} are not [r, in] and [out, r]"
            )
        full = module.removeprefix("base_model.model.")
        if a.shape[0] != config.rank(full):
            raise AdapterError(
                f"{where}: {module}: rank {a.shape[0]}, adapter_config.json says {config.rank(full)}"
            )
        lm = _LAYER.match(full)
        if lm is None:
            raise AdapterError(
                f"{where}: {module} is not inside a decoder layer; mtp-jax adapts decoder layers only"
            )
        layer = int(lm["layer"])
        if config.layers_to_transform is not None and layer not in config.layers_to_transform:
            raise AdapterError(
                f"{where}: {module} is outside layers_to_transform {list(config.layers_to_transform)}"
            )
        weights[(layer, lm["rest"])] = (a, b, config.scaling(full))
    if not weights:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    return Adapter(name, os.fspath(path), config, weights)


# --- on device ----------------------------------------------------------------------------------


def init_stacks(sites: Iterable[LoraSite], slots: int, rank: int, dtype, per_layer: bool = False) -> dict:
    """Zeroed stacks for ``slots`` adapters (slots 1..slots at indices 0..slots-1) of rank up to ``rank``:
    ``{group: {path...: {"a": [L, *in, S, R], "b": [L, S, R, *out]}}}``; ``per_layer``: each group a
    tuple of L layer trees (leaves without the L axis, each its own buffer), for models whose
    layers are per-layer buffers (a scan over stacked adapters would copy each layer's out)."""
    out: dict = {}
    counts: dict[str, int] = {}
    for site in sites:
        node = out.setdefault(site.group, {})
        counts[site.group] = site.count
        for name in site.path[:-1]:
            node = node.setdefault(name, {})
        node[site.path[-1]] = {
            "a": jnp.zeros((site.count, *site.in_shape, slots, rank), dtype),
            "b": jnp.zeros((site.count, slots, rank, *site.out_shape), dtype),
        }
    if per_layer:
        out = {
            g: tuple(jax.tree.map(lambda x, i=i: x[i], tree) for i in range(counts[g]))
            for g, tree in out.items()
        }
    return out


def stack_logical(sites: Iterable[LoraSite]) -> dict[tuple[str, ...], tuple[str | None, ...]]:
    """Logical axes of every stack leaf, by its path in :func:`init_stacks`'s tree."""
    out = {}
    for site in sites:
        base = (site.group, *site.path)
        out[base + ("a",)] = (None, *site.in_logical, None, None)
        out[base + ("b",)] = (None, None, None, *site.out_logical)
    return out


def slot_arrays(adapter: Adapter, sites: Sequence[LoraSite], rank: int, num_layers: int) -> dict:
    """The adapter as one slot of the stacks (numpy, float32, zero-padded to ``rank``): the same
    tree as :func:`init_stacks` without the slot axis. AdapterError for modules the target cannot
    adapt, shape mismatches with the base model and ranks above ``rank``."""
    where = f"adapter {adapter.name!r} ({adapter.path})"
    used = set()
    out: dict = {}
    for site in sites:
        a_all = np.zeros((site.count, *site.in_shape, rank), np.float32)
        b_all = np.zeros((site.count, rank, *site.out_shape), np.float32)
        for i in range(site.count):
            key = (site.first + i, site.module)
            if key not in adapter.weights:
                continue
            used.add(key)
            a, b, s = adapter.weights[key]
            r = a.shape[0]
            if r > rank:
                raise AdapterError(
                    f"{where}: rank {r} of layers.{key[0]}.{key[1]} is above max_lora_rank {rank}"
                )
            if a.shape[1] != site.fan_in or b.shape[0] != site.fan_out:
                raise AdapterError(
                    f"{where}: layers.{key[0]}.{key[1]}: lora_A {a.shape} / lora_B {b.shape} do not fit the "
                    f"base model's [{site.fan_out}, {site.fan_in}] weight (an adapter for another model?)"
                )
            a_all[i, ..., :r] = a.T.reshape(*site.in_shape, r)
            b_all[i, :r] = (s * b.T).reshape(r, *site.out_shape)
        node = out.setdefault(site.group, {})
        for name in site.path[:-1]:
            node = node.setdefault(name, {})
        node[site.path[-1]] = {"a": a_all, "b": b_all}
    unknown = sorted(set(adapter.weights) - used)
    if unknown:
        layer, module = unknown[0]
        if layer >= num_layers:
            raise AdapterError(f"{where}: layers.{layer}.{module}: the base model has {num_layers} layers")
        names = sorted({s.module for s in sites})
        raise AdapterError(
            f"{where}: layers.{layer}.{module} cannot take an adapter here; "
            f"this model adapts {', '.join(names)}"
        )
    return out


def _set(leaf: jax.Array, kind: str, slot: jax.Array, value: jax.Array, stacked: bool) -> jax.Array:
    """``leaf`` ("a" [L?, *in, S, R] or "b" [L?, S, R, *out]) with slot ``slot`` set to ``value``."""
    value = value.astype(leaf.dtype)
    if kind == "a":
        return leaf.at[..., slot, :].set(value)
    return leaf.at[:, slot].set(value) if stacked else leaf.at[slot].set(value)


@jax.jit
def _write(stacks: dict, slot: jax.Array, values: dict) -> dict:
    out = {}
    for group, tree in stacks.items():
        if isinstance(tree, tuple):  # per-layer buffers: layer i takes values[..., i]
            out[group] = tuple(
                jax.tree_util.tree_map_with_path(
                    lambda path, leaf, v, i=i: _set(leaf, path[-1].key, slot, v[i], False),
                    layer,
                    values[group],
                )
                for i, layer in enumerate(tree)
            )
        else:
            out[group] = jax.tree_util.tree_map_with_path(
                lambda path, leaf, v: _set(leaf, path[-1].key, slot, v, True), tree, values[group]
            )
    return out


def write_slot(stacks: dict, slot: int, values: dict | None) -> dict:
    """``stacks`` with adapter slot ``slot`` (1..max_loras, at index ``slot - 1``) set to ``values``
    (:func:`slot_arrays`; None: zeros)."""
    if values is None:
        values = {group: _zero_values(tree) for group, tree in stacks.items()}
    return _write(stacks, jnp.int32(slot - 1), values)


def _zero_values(tree: Any) -> Any:
    """Zeros shaped as one slot's values of a group's stacks (stacked, or a tuple of layers)."""
    stacked = not isinstance(tree, tuple)
    layer = tree if stacked else tree[0]
    one = jax.tree_util.tree_map_with_path(
        lambda path, leaf: _zeros(path[-1].key, leaf.shape, stacked), layer
    )
    if stacked:
        return one
    n = len(tree)
    return jax.tree.map(lambda z: np.zeros((n, *z.shape), np.float32), one)


def _zeros(kind: str, shape: tuple[int, ...], stacked: bool) -> np.ndarray:
    """Zeros shaped as one slot's values of a leaf of ``shape`` (the slot axis dropped)."""
    shape = list(shape)
    del shape[-2 if kind == "a" else (1 if stacked else 0)]
    return np.zeros(shape, np.float32)


def delta(x: jax.Array, site: Mapping[str, jax.Array], rows: jax.Array, n_in: int) -> jax.Array:
    """``(x · a[slot]) · b[slot]`` of each row: x [b, t, *in] (``n_in`` input axes), site {"a":
    [*in, S, R], "b": [S, R, *out]} (one layer's slots), ``rows`` [b, S] each row's slot one-hot
    -> [b, t, *out]. Every slot's ``x · a`` comes from one matmul over the slots' ranks side by side
    and the other slots' are multiplied by zero (exact), so each slot's weights are read once,
    whatever the batch, and nothing is copied per row."""
    a, b = site["a"].astype(x.dtype), site["b"].astype(x.dtype)
    ins, outs = "ijklmn"[:n_in], "pqrs"[: b.ndim - 2]
    xa = jnp.einsum(f"xt{ins},{ins}sz->xtsz", x, a) * rows.astype(x.dtype)[:, None, :, None]
    return jnp.einsum(f"xtsz,sz{outs}->xt{outs}", xa, b)


def check_names(names: Iterable[str | None], known: Mapping[str, int]) -> list[int]:
    """Slots of per-row adapter names (None: no adapter); InvalidRequestError for unknown ones."""
    out = []
    for name in names:
        if name is None:
            out.append(0)
        elif name not in known:
            raise InvalidRequestError(
                f"unknown LoRA adapter {name!r}; loaded: {', '.join(sorted(known)) or 'none'}"
            )
        else:
            out.append(known[name])
    return out


def place(stacks: dict, sites: Sequence[LoraSite], mesh) -> dict:
    """``stacks`` placed on ``mesh`` as their sites' logical axes say (no mesh: unchanged)."""
    if mesh is None:
        return stacks
    from jax.sharding import NamedSharding

    from mtp_jax.sharding import logical_spec

    logical = stack_logical(sites)

    def one(path: tuple, leaf: jax.Array) -> jax.Array:
        names = tuple(str(k.key) for k in path)
        return jax.device_put(leaf, NamedSharding(mesh, logical_spec(mesh, logical[names], leaf.shape)))

    return jax.tree_util.tree_map_with_path(one, stacks)


class LoraTable:
    """Which adapter is in which slot of a model's stacks (slot 0: none), and the limits."""

    def __init__(
        self, sites: Sequence[LoraSite], max_loras: int, max_lora_rank: int, num_layers: int
    ) -> None:
        for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.sites = tuple(sites)
        self.max_loras, self.max_lora_rank, self.num_layers = max_loras, max_lora_rank, num_layers
        self.slots: dict[str, int] = {}
        self.paths: dict[str, str] = {}
        self.writes: dict[int, int] = {}  # how often each slot was written (a prefix cache's salt)

    def free_slot(self, name: str) -> int:
        if name in self.slots:
            raise ValueError(f"a LoRA adapter named {name!r} is loaded already; unload it first")
        used = set(self.slots.values())
        for slot in range(1, self.max_loras + 1):
            if slot not in used:
                return slot
        raise ValueError(
            f"all {self.max_loras} LoRA slots are taken ({', '.join(sorted(self.slots))}); unload one or "
            "load the model with a larger max_loras"
        )

    def prepare(self, name: str, path: str | os.PathLike[str]) -> tuple[Adapter, dict]:
        """Adapter ``name`` read from ``path`` and its slot arrays, for :meth:`load` on another
        thread (a serving engine's): a bad name, a name loaded already, or an adapter these slots
        cannot hold (its shapes, its rank) is refused here (:class:`~mtp_jax.InvalidRequestError`,
        :class:`~mtp_jax.AdapterError`), before anything changes."""
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"an adapter's name must be a non-empty string, got {name!r}")
        if name in self.slots:
            raise InvalidRequestError(f"a LoRA adapter named {name!r} is loaded already")
        adapter = read_adapter(path, name)
        return adapter, slot_arrays(adapter, self.sites, self.max_lora_rank, self.num_layers)

    def load(
        self, stacks: dict, name: str, path: str | os.PathLike[str] | Adapter, values: dict | None
    ) -> dict:
        """``stacks`` with adapter ``name`` (read from ``path`` unless already an :class:`Adapter`;
        ``values``: its slot arrays already made) written into a free slot, recorded here; raises
        before anything changes when it cannot be applied."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter's name must be a non-empty string, got {name!r}")
        slot = self.free_slot(name)
        adapter = path if isinstance(path, Adapter) else read_adapter(path, name)
        if values is None:
            values = slot_arrays(adapter, self.sites, self.max_lora_rank, self.num_layers)
        stacks = write_slot(stacks, slot, values)
        self.writes[slot] = self.writes.get(slot, 0) + 1
        self.slots[name] = slot
        self.paths[name] = adapter.path
        return stacks

    def unload(self, stacks: dict, name: str) -> dict:
        """``stacks`` with adapter ``name``'s slot zeroed and freed."""
        if name not in self.slots:
            loaded = ", ".join(sorted(self.slots))
            raise ValueError(f"no LoRA adapter named {name!r} is loaded (loaded: {loaded or 'none'})")
        slot = self.slots.pop(name)
        self.paths.pop(name)
        self.writes[slot] = self.writes.get(slot, 0) + 1
        return write_slot(stacks, slot, None)

    def slot_of(self, name: str | None) -> int:
        """The slot of adapter ``name`` (None: 0, no adapter); InvalidRequestError when unknown."""
        return check_names([name], self.slots)[0]
