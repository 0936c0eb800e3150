"""A trained DFlash draft's parameters back to the published hub layout (the training scripts'
checkpoints)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from mtp_jax.checkpoint.hub_layout import as_numpy, linear_to_hub, vocab_map_tensors
from mtp_jax.drafts.dflash.config import DFlashConfig
from mtp_jax.targets.llama.checkpoint import llama_layer_tensors


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
