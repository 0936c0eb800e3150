"""Hub-layout DeepSeek-V3 tensors -> the parameter pytree of :mod:`mtp_jax.models.deepseek_v3`.

Hub weights are [out, in] (``nn.Linear``); ours are [in, out], with per-head axes split out and
the layers of each stack (dense, MoE, MTP) stacked along a leading axis.

Loading streams: :func:`param_groups` reads one group at a time (the embedding, one decoder
layer, the final norm, the head, one MTP layer) into host arrays of the target dtype, and
:func:`assemble` moves each group to the device and writes it into the preallocated stacked
arrays in place. Host memory therefore peaks near the largest group (one MoE layer), never the
whole model; the same groups are what ``mtp-jax convert`` writes.

Multi-host: with a mesh whose ``expert`` axis spans processes, each process reads only the routed
experts its own devices hold (:func:`mtp_jax.sharding.local_experts`): the stacked expert leaves
are then :class:`ExpertRows`, and :func:`assemble` builds the global arrays from the local
shards. Every other tensor is replicated, so every process reads it.

FP8 checkpoints (``quantization_config.quant_method == "fp8"``) are dequantised block-wise with
``weight_scale_inv`` (``weights="dense"``), or kept as :class:`Fp8Weight` (``weights="fp8"``).
``kv_b_proj`` is always dequantised: it is small and used in absorbed form every step.

MTP/NextN layers (``model.layers.{N + k}``) go to ``params["mtp"]``: ``enorm``, ``hnorm``,
``eh_proj`` [2d, d] (input order: embedding first, then hidden), ``head_norm`` (shared_head.norm),
``layer`` (a MoE decoder layer), and ``embed`` / ``head`` only when the checkpoint's copies differ
from the main embedding / lm_head (normally they are identical and stored once).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from mtp_jax.checkpoint.fp8 import Fp8Weight, dequantize
from mtp_jax.checkpoint.safetensors_io import CheckpointReader
from mtp_jax.config import DeepseekV3Config
from mtp_jax.errors import CheckpointError

log = logging.getLogger(__name__)

WEIGHT_MODES = ("dense", "fp8")
STACKED_GROUPS = ("dense", "moe", "mtp")
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
        cfg: DeepseekV3Config,
        dtype: Any,
        weights: str = "dense",
        experts: Sequence[int] | None = None,
    ) -> None:
        """``experts``: the routed experts to read (None: all of them); see :func:`param_groups`."""
        if weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
        if weights == "fp8" and cfg.quantization_config is None:
            raise CheckpointError(
                f"weights='fp8' needs an FP8 checkpoint, but {reader.directory}/config.json has no "
                "quantization_config"
            )
        self.reader = reader
        self.cfg = cfg
        self.dtype = host_dtype(dtype)
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
        """An unquantised tensor (norms, embeddings, router) cast to ``dtype`` (default: the model's)."""
        if self._check(key, shape) == _FP8:
            raise CheckpointError(f"tensor '{key}' is FP8, but this tensor is never quantised in DeepSeek-V3")
        return self.reader.get(key).astype(dtype or self.dtype, copy=False)

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
            return self.reader.get(key).astype(self.dtype, copy=False).T.reshape(shape)
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
        return dequantize(fp8, scale, (b0, b1), self.dtype).T.reshape(shape)

    def same(self, key: str, main_key: str) -> bool:
        """Whether a duplicated tensor (MTP embed/head) is bit-identical to the main one."""
        a, b = self.reader.get(key), self.reader.get(main_key)
        return (
            a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))
        )


def _attention(t: HubTensors, pre: str) -> dict:
    c = t.cfg
    d, h, qk = c.hidden_size, c.num_attention_heads, c.qk_head_dim
    p: dict = {}
    if c.q_lora_rank is None:
        p["q"] = t.linear(f"{pre}q_proj.weight", h * qk, d, (d, h, qk))
    else:
        r = c.q_lora_rank
        p["q_a"] = t.linear(f"{pre}q_a_proj.weight", r, d)
        p["q_a_norm"] = t.get(f"{pre}q_a_layernorm.weight", (r,))
        p["q_b"] = t.linear(f"{pre}q_b_proj.weight", h * qk, r, (r, h, qk))
    p["kv_a"] = t.linear(f"{pre}kv_a_proj_with_mqa.weight", c.kv_lora_rank + c.qk_rope_head_dim, d)
    p["kv_a_norm"] = t.get(f"{pre}kv_a_layernorm.weight", (c.kv_lora_rank,))
    nope_v = c.qk_nope_head_dim + c.v_head_dim
    kv_b = t.linear(
        f"{pre}kv_b_proj.weight", h * nope_v, c.kv_lora_rank, (c.kv_lora_rank, h, nope_v), dense=True
    )
    p["k_b"] = np.ascontiguousarray(kv_b[..., : c.qk_nope_head_dim])
    p["v_b"] = np.ascontiguousarray(kv_b[..., c.qk_nope_head_dim :])
    p["o"] = t.linear(f"{pre}o_proj.weight", d, h * c.v_head_dim, (h, c.v_head_dim, d))
    return p


def _swiglu(t: HubTensors, pre: str, d: int, f: int) -> dict:
    return {
        "gate": t.linear(f"{pre}gate_proj.weight", f, d),
        "up": t.linear(f"{pre}up_proj.weight", f, d),
        "down": t.linear(f"{pre}down_proj.weight", d, f),
    }


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


def _moe(t: HubTensors, pre: str) -> dict:
    c = t.cfg
    d, f, e = c.hidden_size, c.moe_intermediate_size, c.n_routed_experts

    def expert(i: int) -> dict:
        return _swiglu(t, f"{pre}experts.{i}.", d, f)

    experts = stack_leaves(expert, e) if t.experts is None else stack_rows(expert, t.experts, e)
    p = {
        "router": np.ascontiguousarray(t.get(f"{pre}gate.weight", (e, d), np.float32).T),
        "bias": t.get(f"{pre}gate.e_score_correction_bias", (e,), np.float32),
        **experts,
    }
    if c.n_shared_experts:
        shared = _swiglu(t, f"{pre}shared_experts.", d, f * c.n_shared_experts)
        p.update({f"shared_{k}": v for k, v in shared.items()})
    return p


def _layer(t: HubTensors, i: int) -> dict:
    pre = f"model.layers.{i}."
    d = t.cfg.hidden_size
    is_moe = i >= t.cfg.first_k_dense_replace
    return {
        "input_norm": t.get(f"{pre}input_layernorm.weight", (d,)),
        "post_attn_norm": t.get(f"{pre}post_attention_layernorm.weight", (d,)),
        "attn": _attention(t, f"{pre}self_attn."),
        "mlp": _moe(t, f"{pre}mlp.") if is_moe else _swiglu(t, f"{pre}mlp.", d, t.cfg.intermediate_size),
    }


def _mtp_layer(t: HubTensors, k: int) -> dict:
    cfg = t.cfg
    n = cfg.num_hidden_layers + k
    pre = f"model.layers.{n}."
    d, v = cfg.hidden_size, cfg.vocab_size
    p = {
        "enorm": t.get(f"{pre}enorm.weight", (d,)),
        "hnorm": t.get(f"{pre}hnorm.weight", (d,)),
        "eh_proj": t.linear(f"{pre}eh_proj.weight", d, 2 * d),
        "head_norm": t.get(f"{pre}shared_head.norm.weight", (d,)),
        "layer": _layer(t, n),
    }
    main_head = "lm_head.weight" if "lm_head.weight" in t.reader else "model.embed_tokens.weight"
    for name, key, main in (
        ("embed", f"{pre}embed_tokens.weight", "model.embed_tokens.weight"),
        ("head", f"{pre}shared_head.head.weight", main_head),
    ):
        if key not in t.reader:
            continue  # absent copies mean "shared with the main model"
        if t.same(key, main):
            t._check(key, (v, d))
            continue
        log.info("%s differs from %s; keeping a separate copy for the MTP layer", key, main)
        p[name] = t.get(key, (v, d)) if name == "embed" else np.ascontiguousarray(t.get(key, (v, d)).T)
    return p


def param_groups(
    reader: CheckpointReader,
    cfg: DeepseekV3Config,
    dtype: Any,
    *,
    weights: str = "dense",
    mtp: bool = True,
    strict: bool = False,
    skip: Mapping[tuple[str, int | None], list[str]] | None = None,
    experts: Sequence[int] | None = None,
) -> Iterator[tuple[Group, list[str]]]:
    """Yield ((name, index, host pytree), hub keys consumed) one group at a time, in a fixed order.

    Groups in ``skip`` (mapped to the keys they consumed before, e.g. by an interrupted conversion)
    are yielded with a ``None`` tree and not read. ``experts`` (None: all) restricts the routed
    experts read in every MoE layer, MTP included, to those ids; the stacked expert leaves are then
    :class:`ExpertRows`. After the last group, tensors nobody asked for (other than the experts
    left out) are reported: a warning, or with ``strict`` a :class:`CheckpointError` naming them.
    """
    t = HubTensors(reader, cfg, dtype, weights, experts)
    d, v = cfg.hidden_size, cfg.vocab_size
    skip = skip or {}
    all_used: set[str] = set()

    def emit(name: str, index: int | None, read: Callable[[], Any]) -> tuple[Group, list[str]]:
        if (name, index) in skip:
            used, tree = list(skip[(name, index)]), None
        else:
            tree = read()
            used, t.used = t.used, []
        all_used.update(used)
        return (name, index, tree), used

    yield emit("embed", None, lambda: t.get("model.embed_tokens.weight", (v, d)))
    for i in range(cfg.num_hidden_layers):
        if i < cfg.first_k_dense_replace:
            yield emit("dense", i, lambda i=i: _layer(t, i))
        else:
            yield emit("moe", i - cfg.first_k_dense_replace, lambda i=i: _layer(t, i))
    yield emit("final_norm", None, lambda: t.get("model.norm.weight", (d,)))
    if "lm_head.weight" in reader or not cfg.tie_word_embeddings:
        yield emit("lm_head", None, lambda: np.ascontiguousarray(t.linear("lm_head.weight", v, d)))
    if mtp:
        for k in range(cfg.num_nextn_predict_layers):
            yield emit("mtp", k, lambda k=k: _mtp_layer(t, k))
    _report_unused(reader, all_used, cfg, skip_mtp=not mtp, strict=strict, experts=t.experts)


def group_sizes(cfg: DeepseekV3Config, mtp: bool = True) -> dict[str, int]:
    sizes = {
        "dense": cfg.num_dense_layers,
        "moe": cfg.num_moe_layers,
        "mtp": cfg.num_nextn_predict_layers if mtp else 0,
    }
    return {k: n for k, n in sizes.items() if n}


def _set_layer(stack: Any, layer: Any, i: int) -> Any:
    return jax.tree.map(lambda s, x: jax.lax.dynamic_update_index_in_dim(s, x, i, 0), stack, layer)


_set_layer_jit = jax.jit(_set_layer, donate_argnums=0)


def _as_bits(x: np.ndarray) -> np.ndarray:
    # XLA:CPU updates float8 arrays element by element through float32 (hundreds of times slower
    # than bytes), so FP8 stacks are assembled as uint8 and bitcast back once at the end.
    return x.view(np.uint8) if x.dtype == _FP8 else x


_from_bits = jax.jit(lambda x: jax.lax.bitcast_convert_type(x, jnp.float8_e4m3fn), donate_argnums=0)


def assemble(
    groups: Iterator[Group],
    cfg: DeepseekV3Config,
    dtype: Any,
    *,
    mtp: bool = True,
    mesh: jax.sharding.Mesh | None = None,
) -> dict:
    """Build the device parameter pytree from groups (host arrays, or device arrays already placed),
    stacking layers in place on device. With a mesh, every leaf gets its sharding from
    :mod:`mtp_jax.sharding` as it arrives."""
    from mtp_jax.sharding import group_shardings

    sizes = group_sizes(cfg, mtp)
    params: dict = {}
    fp8_paths: set = set()
    for name, index, tree in groups:
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if leaf.dtype == _FP8:
                fp8_paths.add((jax.tree_util.DictKey(name),) + path)
        bits = jax.tree.map(_as_bits, tree)
        device_tree = _put(bits, None if mesh is None else group_shardings(mesh, name, bits))
        if name not in STACKED_GROUPS:
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
    if "lm_head" not in params:
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


def load_params(
    reader: CheckpointReader,
    cfg: DeepseekV3Config,
    dtype: Any,
    *,
    weights: str = "dense",
    mtp: bool = True,
    strict: bool = False,
    mesh: jax.sharding.Mesh | None = None,
) -> dict:
    """Read a hub checkpoint into device parameters (see the module docstring). With a mesh, this
    process reads only the routed experts its devices hold."""
    from mtp_jax.sharding import local_experts

    experts = None if mesh is None else local_experts(mesh, cfg.n_routed_experts)
    groups = (
        g
        for g, _ in param_groups(reader, cfg, dtype, weights=weights, mtp=mtp, strict=strict, experts=experts)
    )
    return assemble(groups, cfg, dtype, mtp=mtp, mesh=mesh)


def _report_unused(
    reader: CheckpointReader,
    used: set[str],
    cfg: DeepseekV3Config,
    *,
    skip_mtp: bool,
    strict: bool,
    experts: Sequence[int] | None = None,
) -> None:
    layer_key = re.compile(r"model\.layers\.(\d+)\.")
    expert_key = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.")
    read = None if experts is None else set(experts)
    mtp_layers = range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
    unexpected = []
    for key in reader.keys():
        if key in used:
            continue
        m = layer_key.match(key)
        if skip_mtp and m and int(m.group(1)) in mtp_layers:
            continue  # MTP layers were not asked for
        e = expert_key.match(key) if read is not None else None
        if e and int(e.group(1)) not in read:
            continue  # another host's experts
        unexpected.append(key)
    if not unexpected:
        return
    shown = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
    if strict:
        raise CheckpointError(f"{len(unexpected)} unexpected tensors in {reader.directory}: {shown}")
    log.warning("ignoring %d unexpected tensors in %s: %s", len(unexpected), reader.directory, shown)
