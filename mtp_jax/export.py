"""The parameter pytree -> hub-layout tensors: the inverse of the loaders.

Used to save trained models (``scripts/train_tiny.py``, the draft trainers) in the exact layout
``transformers`` and every other engine read: [out, in] projections; a target's tensors come from
its checkpoint format's ``export_tensors`` (:mod:`mtp_jax.checkpoint.formats`: DeepSeek-V3 one
tensor per expert and the MTP layer as ``model.layers.{N}`` with its own copies of the embedding
and head, as published checkpoints have them; Llama no ``lm_head.weight`` when the embedding is
tied), written with :mod:`mtp_jax.checkpoint.hub_layout`'s layer helpers, which read each model's
declared layer leaves.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from mtp_jax.checkpoint.formats import checkpoint_format
from mtp_jax.checkpoint.hub_layout import as_numpy, linear_to_hub, vocab_map_tensors
from mtp_jax.config import DFlashConfig, Eagle3Config, ModelConfig
from mtp_jax.targets.deepseek_v3.checkpoint import mla_layer_tensors
from mtp_jax.targets.llama.checkpoint import llama_layer_tensors


def hub_tensors_from_params(params: dict, cfg: ModelConfig, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """Every hub tensor of ``params`` (as built by the loader) in ``dtype``, written by the
    checkpoint format of ``cfg``'s family (its ``export_tensors``, the inverse of its
    ``param_groups``); DeepSeek-V3's routers and correction biases stay float32 as in the published
    checkpoints."""
    return checkpoint_format(cfg).export_tensors(jax.device_get(params), cfg, np.dtype(dtype))


def eagle3_hub_tensors_from_params(
    tree: dict, cfg: Eagle3Config, dtype: Any = np.float32, layer_prefix: str = "layers.0."
) -> dict[str, np.ndarray]:
    """An EAGLE-3 draft (``params["eagle3"]``, as :func:`mtp_jax.drafts.eagle3.checkpoint.load_eagle3` builds
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
        t.update(vocab_map_tensors(tree["draft_to_target"], cfg.vocab_size))
    if "embed" in tree:
        t["embed_tokens.weight"] = as_numpy(tree["embed"], dtype)
    return t


def dflash_hub_tensors_from_params(
    tree: dict, cfg: DFlashConfig, dtype: Any = np.float32
) -> dict[str, np.ndarray]:
    """A DFlash draft (``params["dflash"]``, as :func:`mtp_jax.drafts.dflash.checkpoint.load_dflash` builds
    it) as hub tensors in the published layout: ``fc``, ``hidden_norm``, ``norm`` and
    ``layers.{i}.*`` with ``self_attn.q_norm`` / ``k_norm``; no embedding, no head (a draft
    vocabulary: its ``d2t`` / ``t2d``, the head being the target's columns for it)."""
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
    if "draft_to_target" in tree:
        t.update(vocab_map_tensors(tree["draft_to_target"], cfg.vocab_size))
    return t
