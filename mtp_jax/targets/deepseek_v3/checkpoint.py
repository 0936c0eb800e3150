"""Hub-layout DeepSeek-V3 tensors -> the parameter pytree of :mod:`mtp_jax.targets.deepseek_v3.model`.

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
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from mtp_jax.checkpoint.hub_layout import as_numpy
from mtp_jax.checkpoint.loader import (
    FLOAT32_LEAVES,
    WEIGHT_MODES,
    ExpertRows,
    Group,
    GroupEmitter,
    HubTensors,
    assemble_groups,
    host_dtype,
    report_unused,
    stack_leaves,
    stack_rows,
)
from mtp_jax.checkpoint.safetensors_io import CheckpointReader
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
from mtp_jax.targets.deepseek_v3.model import (
    KV_B,
    MlaLeaf,
    attention_leaves,
    iter_hub,
    layer_leaves,
    layer_tree,
    mtp_leaves,
    split_expert_leaves,
)

__all__ = [
    "FLOAT32_LEAVES",
    "STACKED_GROUPS",
    "WEIGHT_MODES",
    "ExpertRows",
    "assemble",
    "group_sizes",
    "host_dtype",
    "load_params",
    "param_groups",
]

log = logging.getLogger(__name__)

STACKED_GROUPS = ("dense", "moe", "mtp")
DRAFT_GROUPS = ("mtp",)
"""The groups holding the weights of the draft in the checkpoint (loaded only with ``mtp``)."""


def _read(t: HubTensors, pre: str, leaf: MlaLeaf, expert: int | None = None) -> Any:
    """One declared tensor under ``pre`` (routed experts: expert ``expert``) in our layout."""
    key = pre + leaf.hub.format(e=expert)
    if leaf.kind in ("linear", "projection"):
        return t.linear(key, *leaf.hub_shape, leaf.shape, dense=leaf.dense)
    if leaf.kind == "router":
        return np.ascontiguousarray(t.get(key, leaf.hub_shape, np.float32).T)
    return t.get(key, leaf.shape, np.float32 if leaf.kind == "bias" else None)


def _kv_b_parts(t: HubTensors) -> Any:
    nope = t.cfg.qk_nope_head_dim
    return lambda leaf, kv_b: (
        np.ascontiguousarray(kv_b[..., :nope]),
        np.ascontiguousarray(kv_b[..., nope:]),
    )


def read_layer(t: HubTensors, pre: str, leaves: tuple[MlaLeaf, ...]) -> dict:
    """The declared ``leaves`` of one layer under ``pre`` (``model.layers.{i}.``) as our tree: routed
    experts stacked (only this process's experts when ``t.experts`` is set: :class:`ExpertRows`),
    ``kv_b_proj`` split into ``k_b`` and ``v_b``."""
    _, routed, _ = split_expert_leaves(leaves)
    stacked = {}
    if routed:

        def expert(j: int) -> dict:
            return {leaf.path[-1]: _read(t, pre, leaf, j) for leaf in routed}

        e = routed[0].experts
        stacked = stack_leaves(expert, e) if t.experts is None else stack_rows(expert, t.experts, e)
    return layer_tree(
        leaves,
        lambda leaf: stacked[leaf.path[-1]] if leaf.experts else _read(t, pre, leaf),
        _kv_b_parts(t),
    )


def attention_tensors(t: HubTensors, pre: str, d_in: int | None = None) -> dict:
    """One MLA attention's tensors of the layer under ``pre`` (``...layers.{i}.``, its ``self_attn.``
    keys); the first projections (q_a / q, kv_a) read inputs of width ``d_in`` (default
    hidden_size; an EAGLE-3 draft's read 2H)."""
    return read_layer(t, pre, attention_leaves(t.cfg, d_in))["attn"]


def swiglu_tensors(t: HubTensors, pre: str, d: int, f: int) -> dict:
    return {
        "gate": t.linear(f"{pre}gate_proj.weight", f, d),
        "up": t.linear(f"{pre}up_proj.weight", f, d),
        "down": t.linear(f"{pre}down_proj.weight", d, f),
    }


def _layer(t: HubTensors, i: int) -> dict:
    moe = i >= t.cfg.first_k_dense_replace
    return read_layer(t, f"model.layers.{i}.", layer_leaves(t.cfg, moe))


def _mtp_layer(t: HubTensors, k: int) -> dict:
    cfg = t.cfg
    n = cfg.num_hidden_layers + k
    pre = f"model.layers.{n}."
    d, v = cfg.hidden_size, cfg.vocab_size
    p = {**read_layer(t, pre, mtp_leaves(cfg)), "layer": _layer(t, n)}
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
    emit = GroupEmitter(t, skip)

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
    layer_key = re.compile(r"model\.layers\.(\d+)\.")
    expert_key = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.")
    mtp_layers = range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)

    def left_out(key: str) -> bool:
        m = layer_key.match(key)
        if not mtp and m and int(m.group(1)) in mtp_layers:
            return True  # MTP layers were not asked for
        e = expert_key.match(key) if t.experts is not None else None
        return bool(e) and int(e.group(1)) not in t.experts  # another host's experts

    report_unused(reader, emit.used, strict=strict, left_out=left_out, logger=log)


def group_sizes(cfg: DeepseekV3Config, mtp: bool = True) -> dict[str, int]:
    sizes = {
        "dense": cfg.num_dense_layers,
        "moe": cfg.num_moe_layers,
        "mtp": cfg.num_nextn_predict_layers if mtp else 0,
    }
    return {k: n for k, n in sizes.items() if n}


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


def assemble(
    groups: Iterator[Group],
    cfg: DeepseekV3Config,
    dtype: Any = None,
    *,
    mtp: bool = True,
    mesh: jax.sharding.Mesh | None = None,
) -> dict:
    """Device parameters from groups (:func:`mtp_jax.checkpoint.loader.assemble_groups`); a tied
    head is stored as ``lm_head`` = the embedding's transpose."""
    return assemble_groups(groups, group_sizes(cfg, mtp), mesh=mesh, copy_tied_head=True)


def export_tensors(params: dict, cfg: DeepseekV3Config, dtype: np.dtype) -> dict[str, np.ndarray]:
    """The inverse of :func:`param_groups`: ``params`` (host arrays) as hub tensors in ``dtype``, the
    MTP layers as ``model.layers.{N + k}`` with their own copies of the embedding and head, as
    published checkpoints have them."""
    t = {"model.embed_tokens.weight": as_numpy(params["embed"], dtype)}
    layer = 0
    for name, n in (("dense", cfg.num_dense_layers), ("moe", cfg.num_moe_layers)):
        for i in range(n):
            p = jax.tree.map(lambda x, i=i: x[i], params[name])
            t.update(mla_layer_tensors(p, cfg, f"model.layers.{layer}.", name == "moe", dtype))
            layer += 1
    t["model.norm.weight"] = as_numpy(params["final_norm"], dtype)
    head = np.ascontiguousarray(as_numpy(params["lm_head"], dtype).T)
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = head
    if "mtp" in params:
        count = jax.tree.leaves(params["mtp"])[0].shape[0]
        for k in range(count):
            mp = jax.tree.map(lambda x, k=k: x[k], params["mtp"])
            pre = f"model.layers.{cfg.num_hidden_layers + k}."
            t.update(mla_layer_tensors(mp["layer"], cfg, pre, True, dtype))
            t.update(leaf_tensors(mp, pre, mtp_leaves(cfg), dtype))
            t[f"{pre}embed_tokens.weight"] = (
                as_numpy(mp["embed"], dtype) if "embed" in mp else t["model.embed_tokens.weight"]
            )
            t[f"{pre}shared_head.head.weight"] = (
                np.ascontiguousarray(as_numpy(mp["head"], dtype).T) if "head" in mp else head
            )
    return t


def mla_layer_tensors(
    p: dict, cfg: DeepseekV3Config, pre: str, is_moe: bool, dtype: np.dtype, d_in: int | None = None
) -> dict[str, np.ndarray]:
    """One decoder layer's hub tensors, as :func:`~mtp_jax.targets.deepseek_v3.model.layer_leaves`
    declares them (``d_in``: its attention's input width): a projection's ours [in..., out...] back
    to [out, in], ``k_b`` and ``v_b`` joined into ``kv_b_proj``, routers transposed, routers and
    biases float32."""
    return leaf_tensors(p, f"{pre}", layer_leaves(cfg, is_moe, d_in), dtype)


def leaf_tensors(p: dict, pre: str, leaves: tuple, dtype: np.dtype) -> dict[str, np.ndarray]:
    """The hub tensors of one DeepSeek-V3-style layer tree ``p`` under key prefix ``pre``, as
    ``leaves`` (:class:`mtp_jax.targets.deepseek_v3.model.MlaLeaf`) declare them."""
    t = {}
    for leaf, j in iter_hub(leaves):
        node = p
        for name in leaf.path[:-1]:
            node = node[name]
        if leaf.path == KV_B:
            x = np.concatenate([as_numpy(node["k_b"], dtype), as_numpy(node["v_b"], dtype)], axis=-1)
        else:
            x = node[leaf.path[-1]] if j is None else node[leaf.path[-1]][j]
        if leaf.kind in ("linear", "projection"):
            x = as_numpy(x, dtype).reshape(leaf.hub_shape[1], leaf.hub_shape[0]).T
        elif leaf.kind == "router":
            x = np.asarray(x, np.float32).T
        else:
            x = np.asarray(x, np.float32) if leaf.kind == "bias" else as_numpy(x, dtype)
        t[pre + leaf.hub.format(e=j)] = np.ascontiguousarray(x)
    return t
