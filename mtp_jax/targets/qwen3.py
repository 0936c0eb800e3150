"""Qwen3 (``Qwen3ForCausalLM``, dense): the Llama family with an RMSNorm over each query and key
head before rope, and no biases.

Everything else is Llama 3's (:mod:`mtp_jax.targets.llama3`); the norms are the layer tree's
``attn.{q,k}_norm`` [hd] (epsilon ``rms_norm_eps``), and ``head_dim`` is given explicitly (128 in
the published models, not hidden/heads). ``attention_bias`` and sliding windows are refused by
name, as are Qwen3's MoE checkpoints (``qwen3_moe``: another model type).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mtp_jax.config import Llama3Config, _get, parse_llama_family
from mtp_jax.errors import ConfigError
from mtp_jax.targets.llama3 import family_target
from mtp_jax.targets.qwen2 import refuse_sliding_window

MODEL_TYPES = ("qwen3",)


@dataclasses.dataclass(frozen=True)
class Qwen3Config(Llama3Config):
    """A Qwen3 config: :class:`mtp_jax.config.Llama3Config` with per-head q/k norms."""

    model_type: str = "qwen3"
    qk_norm: bool = True


def parse_config(raw: Mapping[str, Any]) -> Qwen3Config:
    """:class:`Qwen3Config` from a Qwen3 config.json."""
    if raw.get("model_type") not in MODEL_TYPES:
        raise ConfigError(f"model_type {raw.get('model_type')!r} is not a Qwen3 model")
    for flag in ("attention_bias", "mlp_bias"):
        if _get(raw, flag, bool, False):
            raise ConfigError(f"{flag}=true is not supported (Qwen3's published projections have no bias)")
    refuse_sliding_window(raw, "Qwen3")
    return parse_llama_family(raw, Qwen3Config, "Qwen3", qk_norm=True)


TARGET = family_target("qwen3", Qwen3Config, MODEL_TYPES, parse_config, title="Qwen3")
