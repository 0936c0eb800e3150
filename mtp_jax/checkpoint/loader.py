"""Reading hub checkpoints, whatever the model: shape-checked tensors, stacked layers, device placement.

Each model's key map (:mod:`mtp_jax.targets.deepseek_v3.checkpoint`, :mod:`mtp_jax.targets.llama.checkpoint`)
yields its parameters one group at a time (the embedding, one decoder layer, the final norm, the
head, ...) as host arrays through :class:`HubTensors`; :func:`assemble_groups` moves each group to
the device and writes it into preallocated stacked arrays in place, so host memory peaks near the
largest group, never the whole model. The same groups are what ``mtp-jax convert`` writes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from mtp_jax.checkpoint.safetensors_io import CheckpointReader
from mtp_jax.errors import CheckpointError
from mtp_jax.fp8 import Fp8Weight, dequantize

log = logging.getLogger(__name__)

WEIGHT_MODES = ("dense", "fp8")
# Leaves kept in float32 whatever the model dtype (routing decisions are made in float32).
FLOAT32_LEAVES = ("router", "bias")
_FLOATS = {np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float64)}
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)

Group = tuple[str, int | None, Any]
"""(name, index within its stack or None, host pytree)."""


def host_dtype(dtype: Any) -> np.dtype:
    return (
        np.dtype(ml_dtypes.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(jnp.dtype(dtype).name)
    )


class HubTensors:
    """Reads hub tensors by key, with shape checks, into host arrays of the target dtype."""

    def __init__(
        self,
        reader: CheckpointReader,
        cfg: Any,
        dtype: Any,
        weights: str = "dense",
        experts: Sequence[int] | None = None,
    ) -> None:
        """``cfg``: the parsed config (its ``quantization_config`` describes FP8 tensors). ``dtype``:
        what every tensor is cast to, or None to keep each one's stored dtype (with
        ``weights="fp8"`` FP8 ones stay FP8 with their scales; those dequantised go to float32,
        exactly).
        ``experts``: the routed experts to read (None: all of them), for MoE checkpoints."""
        if weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
        if weights == "fp8" and cfg.quantization_config is None:
            raise CheckpointError(
                f"weights='fp8' needs an FP8 checkpoint, but {reader.directory}/config.json has no "
                "quantization_config"
            )
        self.reader = reader
        self.cfg = cfg
        self.dtype = None if dtype is None else host_dtype(dtype)
        self.weights = weights
        self.experts = None if experts is None else sorted(set(experts))
        self.used: list[str] = []

    def _check(self, key: str, shape: tuple[int, ...]) -> np.dtype:
        if key not in self.reader:
            raise CheckpointError(f"checkpoint {self.reader.directory} is missing tensor '{key}'")
        got = self.reader.shape(key)
        if got != shape:
            raise CheckpointError(
                f"tensor '{key}' has shape {list(got)} but config.json implies {list(shape)}"
            )
        dtype = self.reader.dtype(key)
        if dtype not in _FLOATS and dtype != _FP8:
            raise CheckpointError(f"tensor '{key}' has dtype {dtype}, expected a floating-point type")
        self.used.append(key)
        return dtype

    def get(self, key: str, shape: tuple[int, ...], dtype: Any = None) -> np.ndarray:
        """An unquantised tensor (norms, embeddings, router) cast to ``dtype`` (default: the model's,
        or its stored dtype when the model's is None)."""
        if self._check(key, shape) == _FP8:
            raise CheckpointError(f"tensor '{key}' is FP8, but this tensor is never quantised")
        x = self.reader.get(key)
        want = dtype or self.dtype
        return x if want is None else x.astype(want, copy=False)

    def linear(
        self,
        key: str,
        out_dim: int,
        in_dim: int,
        shape: tuple[int, ...] | None = None,
        *,
        dense: bool = False,
    ) -> np.ndarray | Fp8Weight:
        """A projection [out, in] as [in, out] reshaped to ``shape``; FP8 stays FP8 in fp8 mode."""
        shape = shape or (in_dim, out_dim)
        if self._check(key, (out_dim, in_dim)) != _FP8:
            x = self.reader.get(key)
            return (x if self.dtype is None else x.astype(self.dtype, copy=False)).T.reshape(shape)
        quant = self.cfg.quantization_config
        if quant is None:
            raise CheckpointError(
                f"tensor '{key}' is float8_e4m3fn but config.json has no quantization_config to describe it"
            )
        b0, b1 = quant.weight_block_size
        scale_key = f"{key}_scale_inv"
        if scale_key not in self.reader:
            raise CheckpointError(f"FP8 tensor '{key}' has no block scales: '{scale_key}' is missing")
        scale_shape = (math.ceil(out_dim / b0), math.ceil(in_dim / b1))
        if self.reader.shape(scale_key) != scale_shape:
            raise CheckpointError(
                f"tensor '{scale_key}' has shape {list(self.reader.shape(scale_key))}, but a "
                f"[{out_dim}, {in_dim}] weight in {b0}x{b1} blocks needs {list(scale_shape)}"
            )
        self.used.append(scale_key)
        fp8, scale = self.reader.get(key), self.reader.get(scale_key).astype(np.float32)
        if self.weights == "fp8" and not dense:
            return Fp8Weight.from_hub(fp8, scale, (b0, b1), shape)
        return dequantize(fp8, scale, (b0, b1), self.dtype or np.float32).T.reshape(shape)

    def same(self, key: str, main_key: str) -> bool:
        """Whether a duplicated tensor (MTP embed/head) is bit-identical to the main one."""
        a, b = self.reader.get(key), self.reader.get(main_key)
        return (
            a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))
        )


class GroupEmitter:
    """Turns reads into the ``((name, index, tree), keys)`` items a model's ``param_groups`` yields,
    skipping the groups in ``skip`` (name, index) -> keys (an interrupted conversion's finished
    ones: yielded with a None tree, not read) and collecting every key consumed in :attr:`used`."""

    def __init__(self, tensors: HubTensors, skip: Mapping[tuple[str, int | None], list[str]] | None) -> None:
        self.tensors = tensors
        self.skip = skip or {}
        self.used: set[str] = set()

    def __call__(self, name: str, index: int | None, read: Callable[[], Any]) -> tuple[Group, list[str]]:
        if (name, index) in self.skip:
            keys, tree = list(self.skip[(name, index)]), None
        else:
            tree = read()
            keys, self.tensors.used = self.tensors.used, []
        self.used.update(keys)
        return (name, index, tree), keys


def stack_leaves(make: Callable[[int], Any], n: int) -> Any:
    """Stack ``make(0..n-1)`` (identical pytrees, Fp8Weight leaves included) along a new leading
    axis, filling preallocated arrays so only one item is ever held beside the stack."""
    first = make(0)
    out = jax.tree.map(lambda x: np.empty((n,) + x.shape, x.dtype), first)
    for i in range(n):
        item = first if i == 0 else make(i)
        jax.tree.map(lambda o, x, i=i: o.__setitem__(i, x), out, item)
    return out


class ExpertRows:
    """Some experts (rows) of a stacked routed-expert leaf [E, ...]: what one process of a multi-host
    run reads when the other experts live on other hosts' devices. Indexing it with a device
    shard's index (a block of experts, all of them read, then the full trailing axes) returns that
    shard, which is how :func:`assemble` builds the global array."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, rows: dict[int, np.ndarray]) -> None:
        self.shape = shape
        self.dtype = dtype
        self.rows = rows

    def view(self, dtype: Any) -> ExpertRows:
        return ExpertRows(self.shape, np.dtype(dtype), {e: r.view(dtype) for e, r in self.rows.items()})

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        experts = range(self.shape[0])[index[0]]
        missing = [e for e in experts if e not in self.rows]
        if missing:
            raise ValueError(f"experts {missing} were not read by this process (it read {sorted(self.rows)})")
        return np.stack([self.rows[e][index[1:]] for e in experts])


def stack_rows(make: Callable[[int], Any], rows: Sequence[int], n: int) -> Any:
    """Like :func:`stack_leaves` over ``n`` items, but reading only items ``rows``: the leaves
    become :class:`ExpertRows`."""
    items = [make(i) for i in rows]
    return jax.tree.map(
        lambda *xs: ExpertRows((n,) + xs[0].shape, xs[0].dtype, dict(zip(rows, xs, strict=True))), *items
    )


def _set_layer(stack: Any, layer: Any, i: int) -> Any:
    return jax.tree.map(lambda s, x: jax.lax.dynamic_update_index_in_dim(s, x, i, 0), stack, layer)


_set_layer_jit = jax.jit(_set_layer, donate_argnums=0)


def _as_bits(x: np.ndarray) -> np.ndarray:
    # XLA:CPU updates float8 arrays element by element through float32 (hundreds of times slower
    # than bytes), so FP8 stacks are assembled as uint8 and bitcast back once at the end.
    return x.view(np.uint8) if x.dtype == _FP8 else x


_from_bits = jax.jit(lambda x: jax.lax.bitcast_convert_type(x, jnp.float8_e4m3fn), donate_argnums=0)


def assemble_groups(
    groups: Iterator[Group],
    sizes: Mapping[str, int],
    *,
    mesh: jax.sharding.Mesh | None = None,
    copy_tied_head: bool = False,
) -> dict:
    """Build the device parameter pytree from groups (host arrays, or device arrays already placed),
    stacking the layers of each group named in ``sizes`` (name -> layer count) in place on device.
    With a mesh, every leaf gets its sharding from :mod:`mtp_jax.sharding` as it arrives. Without an
    ``lm_head`` group the head is tied to the embedding: ``copy_tied_head`` stores its transpose as
    ``lm_head`` (DeepSeek-V3's layout), else nothing is added (the head reads ``embed``)."""
    from mtp_jax.sharding import group_shardings

    params: dict = {}
    fp8_paths: set = set()
    for name, index, tree in groups:
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if leaf.dtype == _FP8:
                fp8_paths.add((jax.tree_util.DictKey(name),) + path)
        bits = jax.tree.map(_as_bits, tree)
        device_tree = _put(bits, None if mesh is None else group_shardings(mesh, name, bits))
        if name not in sizes:
            params[name] = device_tree
            continue
        if name not in params:
            n = sizes[name]
            params[name] = _zeros_stack(
                device_tree,
                n,
                None if mesh is None else group_shardings(mesh, name, device_tree, stacked=True),
            )
        params[name] = _set_layer_jit(params[name], device_tree, index)
    if "lm_head" not in params and copy_tied_head:
        params["lm_head"] = params["embed"].T
    if fp8_paths:
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: _from_bits(x) if path in fp8_paths else x, params
        )
    return params


def _put(tree: Any, shardings: Any) -> Any:
    """``jax.device_put``, except that :class:`ExpertRows` leaves (the experts this process read)
    become global arrays assembled from this process's shards."""
    if shardings is None or not any(isinstance(x, ExpertRows) for x in jax.tree.leaves(tree)):
        return jax.device_put(tree, shardings)
    return jax.tree.map(
        lambda x, s: (
            jax.make_array_from_callback(x.shape, s, x.__getitem__)
            if isinstance(x, ExpertRows)
            else jax.device_put(x, s)
        ),
        tree,
        shardings,
    )


def _zeros_stack(layer: Any, n: int, shardings: Any) -> Any:
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct((n,) + x.shape, x.dtype), layer)
    make = jax.jit(
        lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), out_shardings=shardings
    )
    return make()


def read_vocab_map(
    reader: CheckpointReader,
    d2t_key: str | None,
    t2d_key: str | None,
    draft_vocab_size: int,
    vocab_size: int,
    used: set[str],
) -> np.ndarray | None:
    """A draft vocabulary's target ids (int32 [Vd], draft id j is target id ``j + d2t[j]``: EAGLE-3's
    OFFSETS), checked for range and repeats and against the ``t2d`` mask when present; None when
    draft ids are target ids. The keys read are added to ``used``."""
    if d2t_key is None:
        if draft_vocab_size != vocab_size:
            raise CheckpointError(
                f"{reader.directory}: draft_vocab_size {draft_vocab_size} < vocab_size {vocab_size} "
                "but the checkpoint has no 'd2t' mapping draft ids to target ids"
            )
        return None
    used.add(d2t_key)
    if reader.shape(d2t_key) != (draft_vocab_size,) or not np.issubdtype(reader.dtype(d2t_key), np.integer):
        raise CheckpointError(
            f"tensor '{d2t_key}' must be integer offsets [{draft_vocab_size}] (draft_vocab_size), got "
            f"{reader.dtype(d2t_key)} {list(reader.shape(d2t_key))}"
        )
    d2t = reader.get(d2t_key).astype(np.int64)
    ids = np.arange(draft_vocab_size) + d2t  # OFFSETS: target id = i + d2t[i]
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if len(bad):
        i = int(bad[0])
        raise CheckpointError(
            f"tensor '{d2t_key}': draft id {i} maps to target id {int(ids[i])} (= {i} + d2t[{i}] = {i} + "
            f"{int(d2t[i])}), outside [0, {vocab_size}); d2t holds offsets, not ids"
        )
    uniq, counts = np.unique(ids, return_counts=True)
    if len(uniq) != len(ids):
        repeated = int(uniq[counts > 1][0])
        raise CheckpointError(f"tensor '{d2t_key}' maps several draft ids to target id {repeated}")
    if t2d_key is not None:
        used.add(t2d_key)
        t2d = reader.get(t2d_key)
        if t2d.shape != (vocab_size,):
            raise CheckpointError(f"tensor '{t2d_key}' has shape {list(t2d.shape)}, expected [{vocab_size}]")
        if int(t2d.astype(bool).sum()) != draft_vocab_size or not t2d.astype(bool)[ids].all():
            raise CheckpointError(
                f"tensors '{d2t_key}' and '{t2d_key}' disagree on which target ids the draft vocabulary holds"
            )
    if draft_vocab_size == vocab_size and not d2t.any():
        return None  # the identity
    return ids.astype(np.int32)


def report_unused(
    reader: CheckpointReader,
    used: set[str],
    *,
    strict: bool,
    left_out: Callable[[str], bool] = lambda key: False,
    logger: logging.Logger = log,
) -> None:
    """Report the tensors of ``reader`` nobody read (neither in ``used`` nor deliberately
    ``left_out``): a warning on ``logger``, or with ``strict`` a :class:`CheckpointError` naming them."""
    unexpected = [key for key in reader.keys() if key not in used and not left_out(key)]
    if not unexpected:
        return
    shown = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
    if strict:
        raise CheckpointError(f"{len(unexpected)} unexpected tensors in {reader.directory}: {shown}")
    logger.warning("ignoring %d unexpected tensors in %s: %s", len(unexpected), reader.directory, shown)
