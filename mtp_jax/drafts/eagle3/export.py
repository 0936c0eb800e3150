"""A trained EAGLE-3 draft's parameters back to the published hub layout (the training scripts'
checkpoints)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from mtp_jax.checkpoint.hub_layout import as_numpy, linear_to_hub, vocab_map_tensors
from mtp_jax.drafts.eagle3.config import Eagle3Config
from mtp_jax.targets.deepseek_v3.checkpoint import mla_layer_tensors
from mtp_jax.targets.llama.checkpoint import llama_layer_tensors


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
