"""Our parameter trees -> hub-layout tensors, layer by layer, as each model's declared layer leaves
say: the pieces the checkpoint formats' ``export_tensors`` and the draft exporters
(:mod:`mtp_jax.checkpoint.export`) are written with."""

from __future__ import annotations

from typing import Any

import numpy as np

from mtp_jax.checkpoint.fp8 import Fp8Weight
from mtp_jax.config import DeepseekV3Config
from mtp_jax.targets.deepseek_v3 import KV_B, iter_hub
from mtp_jax.targets.deepseek_v3 import layer_leaves as deepseek_layer_leaves
from mtp_jax.targets.llama3 import layer_leaves


def as_numpy(x: Any, dtype: np.dtype) -> np.ndarray:
    """A dense weight as a numpy array of ``dtype`` (FP8 weights are refused)."""
    if isinstance(x, Fp8Weight):
        raise ValueError("exporting FP8 weights is not supported; load the model with weights='dense'")
    return np.asarray(x, dtype=np.float32).astype(dtype)


def linear_to_hub(w: Any, dtype: np.dtype) -> np.ndarray:
    """Ours [in, ...out axes] (or [in..., out] for o_proj) flattened to hub [out, in]."""
    w = as_numpy(w, dtype)
    return np.ascontiguousarray(w.reshape(w.shape[0], -1).T)


def mla_layer_tensors(
    p: dict, cfg: DeepseekV3Config, pre: str, is_moe: bool, dtype: np.dtype, d_in: int | None = None
) -> dict[str, np.ndarray]:
    """One decoder layer's hub tensors, as :func:`mtp_jax.targets.deepseek_v3.layer_leaves`
    declares them (``d_in``: its attention's input width): a projection's ours [in..., out...] back
    to [out, in], ``k_b`` and ``v_b`` joined into ``kv_b_proj``, routers transposed, routers and
    biases float32."""
    return leaf_tensors(p, f"{pre}", deepseek_layer_leaves(cfg, is_moe, d_in), dtype)


def leaf_tensors(p: dict, pre: str, leaves: tuple, dtype: np.dtype) -> dict[str, np.ndarray]:
    """The hub tensors of one DeepSeek-V3-style layer tree ``p`` under key prefix ``pre``, as
    ``leaves`` (:class:`mtp_jax.targets.deepseek_v3.MlaLeaf`) declare them."""
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


def llama_layer_tensors(p: dict, pre: str, dtype: np.dtype) -> dict[str, np.ndarray]:
    """One Llama-family layer's hub tensors, as :func:`mtp_jax.targets.llama3.layer_leaves`
    declares them for the layer's own shapes and extras (biases, q/k norms)."""
    a = p["attn"]
    d_in, h, hd = np.shape(a["q"])
    d, f = np.shape(p["mlp"]["gate"])
    leaves = layer_leaves(
        d, h, np.shape(a["k"])[1], hd, f, d_in=d_in, qkv_bias="q_bias" in a, qk_norm="q_norm" in a
    )
    t = {}
    for leaf in leaves:
        x = p
        for name in leaf.path:
            x = x[name]
        x = as_numpy(x, dtype)
        if leaf.kind == "linear":  # ours is the hub's [out, in] transposed, reshaped
            x = x.reshape(leaf.hub_shape[::-1]).T
        t[pre + leaf.hub] = np.ascontiguousarray(x.reshape(leaf.hub_shape))
    return t


def vocab_map_tensors(draft_to_target: Any, vocab_size: int | None) -> dict[str, np.ndarray]:
    """A draft vocabulary as EAGLE-3 checkpoints store it: ``d2t`` int64 OFFSETS (target id = i +
    d2t[i]) and, when the target's vocabulary size is known, the ``t2d`` mask over target ids."""
    ids = np.asarray(draft_to_target, np.int64)
    t = {"d2t": ids - np.arange(len(ids), dtype=np.int64)}
    if vocab_size is not None:
        t2d = np.zeros(vocab_size, bool)
        t2d[ids] = True
        t["t2d"] = t2d
    return t
