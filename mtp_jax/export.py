"""The parameter pytree -> hub-layout tensors: the inverse of the loaders.

Used to save trained models (``scripts/train_tiny.py``, the draft trainers) in the exact layout
``transformers`` and every other engine read: [out, in] projections; a target's tensors come from
its checkpoint format's ``export_tensors`` (:mod:`mtp_jax.checkpoint.formats`: DeepSeek-V3 one
tensor per expert and the MTP layer as ``model.layers.{N}`` with its own copies of the embedding
and head, as published checkpoints have them; Llama no ``lm_head.weight`` when the embedding is
tied), written with :mod:`mtp_jax.checkpoint.hub_layout`'s helpers and each family's layer exporters,
which read its declared layer leaves. The drafts' exporters live in their folders
(``drafts/eagle3/export.py``, ``drafts/dflash/export.py``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from mtp_jax.checkpoint.formats import checkpoint_format
from mtp_jax.config import ModelConfig


def hub_tensors_from_params(params: dict, cfg: ModelConfig, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """Every hub tensor of ``params`` (as built by the loader) in ``dtype``, written by the
    checkpoint format of ``cfg``'s family (its ``export_tensors``, the inverse of its
    ``param_groups``); DeepSeek-V3's routers and correction biases stay float32 as in the published
    checkpoints."""
    return checkpoint_format(cfg).export_tensors(jax.device_get(params), cfg, np.dtype(dtype))
