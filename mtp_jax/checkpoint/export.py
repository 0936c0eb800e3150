"""The parameter pytree -> hub-layout tensors: the inverse of the loaders.

Used to save trained models (``scripts/train_tiny.py``, the draft trainers) in the exact layout
``transformers`` and every other engine read: [out, in] projections; a target's tensors come from
its checkpoint format's ``export_tensors`` (:mod:`mtp_jax.checkpoint.formats`: DeepSeek-V3 one
tensor per expert and the MTP layer as ``model.layers.{N}`` with its own copies of the embedding
and head, as published checkpoints have them; Llama no ``lm_head.weight`` when the embedding is
tied), written with the layer helpers here, which read each model's declared layer leaves.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from mtp_jax.checkpoint.fp8 import Fp8Weight
from mtp_jax.config import DeepseekV3Config, DFlashConfig, Eagle3Config, ModelConfig
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


def hub_tensors_from_params(params: dict, cfg: ModelConfig, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """Every hub tensor of ``params`` (as built by the loader) in ``dtype``, written by the
    checkpoint format of ``cfg``'s family (its ``export_tensors``, the inverse of its
    ``param_groups``); DeepSeek-V3's routers and correction biases stay float32 as in the published
    checkpoints."""
    from mtp_jax.checkpoint.formats import checkpoint_format

    return checkpoint_format(cfg).export_tensors(jax.device_get(params), cfg, np.dtype(dtype))


def eagle3_hub_tensors_from_params(
    tree: dict, cfg: Eagle3Config, dtype: Any = np.float32, layer_prefix: str = "layers.0."
) -> dict[str, np.ndarray]:
    """An EAGLE-3 draft (``params["eagle3"]``, as :func:`mtp_jax.checkpoint.eagle3.load_eagle3` builds
    it) as hub tensors in the dialect of ``layer_prefix`` ("layers.0." as vLLM and NVIDIA write it,
    "midlayer." as EAGLE and SpecForge do): ``fc``, the layer (GQA, or MLA with ``cfg.mla``), ``norm``,
    ``lm_head`` over the draft vocabulary, ``d2t`` offsets and the ``t2d`` mask when the draft
    vocabulary is a subset, ``embed_tokens`` only when the draft has its own embedding."""
    dtype = np.dtype(dtype)
    tree = jax.device_get(tree)
    pre = layer_prefix
    if cfg.mla is None:
        t = llama_layer_tensors(tree, pre, dtype)
    else:
        t = mla_layer_tensors(tree, cfg.mla, pre, False, dtype, d_in=2 * cfg.hidden_size)
    t[f"{pre}hidden_norm.weight"] = as_numpy(tree["hidden_norm"], dtype)
    t["fc.weight"] = linear_to_hub(tree["fc"], dtype)
    t["norm.weight"] = as_numpy(tree["norm"], dtype)
    t["lm_head.weight"] = linear_to_hub(tree["lm_head"], dtype)
    if "draft_to_target" in tree:
        ids = np.asarray(tree["draft_to_target"], np.int64)
        t["d2t"] = ids - np.arange(len(ids), dtype=np.int64)  # OFFSETS: target id = i + d2t[i]
        t2d = np.zeros(cfg.vocab_size, bool)
        t2d[ids] = True
        t["t2d"] = t2d
    if "embed" in tree:
        t["embed_tokens.weight"] = as_numpy(tree["embed"], dtype)
    return t


def dflash_hub_tensors_from_params(
    tree: dict, cfg: DFlashConfig, dtype: Any = np.float32
) -> dict[str, np.ndarray]:
    """A DFlash draft (``params["dflash"]``, as :func:`mtp_jax.checkpoint.dflash.load_dflash` builds
    it) as hub tensors in the published layout: ``fc``, ``hidden_norm``, ``norm`` and
    ``layers.{i}.*`` with ``self_attn.q_norm`` / ``k_norm``; no embedding, no head."""
    dtype = np.dtype(dtype)
    tree = jax.device_get(tree)
    t = {
        "fc.weight": linear_to_hub(tree["fc"], dtype),
        "hidden_norm.weight": as_numpy(tree["hidden_norm"], dtype),
        "norm.weight": as_numpy(tree["norm"], dtype),
    }
    for i in range(cfg.num_hidden_layers):
        layer = jax.tree.map(lambda x, i=i: x[i], tree["layers"])
        pre = f"layers.{i}."
        t.update(llama_layer_tensors(layer, pre, dtype))  # with its q/k norms
    return t
