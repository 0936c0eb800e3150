"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): the Llama family with biases on the q/k/v projections.

Everything else is Llama 3's (:mod:`mtp_jax.targets.llama3`: GQA, rotate-half rope, RMSNorm,
SwiGLU, tied or untied embeddings); the biases are the layer tree's ``attn.{q,k,v}_bias`` [H or
Hkv, hd], added after the projections, before rope. A checkpoint whose layers attend through a
sliding window (``use_sliding_window``, ``layer_types``) is refused: every layer here attends over
the whole context. Published checkpoints use plain rope (``rope_theta``); YaRN scaling is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mtp_jax.config import Llama3Config, parse_llama_family, sliding_layers
from mtp_jax.errors import ConfigError
from mtp_jax.targets.llama3 import family_target

MODEL_TYPES = ("qwen2",)


@dataclasses.dataclass(frozen=True)
class Qwen2Config(Llama3Config):
    """A Qwen2 config: :class:`mtp_jax.config.Llama3Config` with q/k/v biases."""

    model_type: str = "qwen2"
    qkv_bias: bool = True


def refuse_sliding_window(raw: Mapping[str, Any], family: str) -> None:
    """Stop on a config whose layers attend through a sliding window."""
    layers = sliding_layers(raw)
    if layers:
        raise ConfigError(
            f"sliding-window attention is not supported ({family} config: layers {layers[0]}..{layers[-1]} "
            f"attend through a window of {raw.get('sliding_window')}); every layer must attend over the "
            "whole context (use_sliding_window false)"
        )


def parse_config(raw: Mapping[str, Any]) -> Qwen2Config:
    """:class:`Qwen2Config` from a Qwen2 config.json."""
    if raw.get("model_type") not in MODEL_TYPES:
        raise ConfigError(f"model_type {raw.get('model_type')!r} is not a Qwen2 model")
    refuse_sliding_window(raw, "Qwen2")
    return parse_llama_family(raw, Qwen2Config, "Qwen2", qkv_bias=True)


TARGET = family_target("qwen2", Qwen2Config, MODEL_TYPES, parse_config, title="Qwen2")
