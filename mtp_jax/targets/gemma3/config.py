"""Gemma 3's text decoder configuration parsed from config.json (``Gemma3ForCausalLM``,
``model_type`` ``gemma3_text``): the local/global layer pattern, its two rope bases, the sliding
window and ``query_pre_attn_scalar``. What the model code does not implement is refused by name.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from mtp_jax.config import check_special_tokens, get_field, parse_eos, positive_field, read_json
from mtp_jax.errors import ConfigError

GEMMA3_MODEL_TYPES = ("gemma3_text",)
SLIDING, FULL = "sliding_attention", "full_attention"
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class Gemma3Config:
    """Gemma 3 (text): GQA attention with RMSNorm'd queries and keys, rotate-half rope with one base
    for the local (sliding-window) layers and another for the global ones, four RMSNorms per layer
    whose gain is ``1 + weight``, GeGLU (tanh GELU), embeddings scaled by sqrt(width), a tied head
    and an optional tanh soft cap on the final logits."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    sliding_window: int
    """Keys a local layer's query sees, itself included (transformers: ``kv > q - window``)."""
    layer_types: tuple[str, ...]
    """``sliding_attention`` or ``full_attention`` per layer."""
    rope_theta: float
    """The global (full-attention) layers' rope base."""
    rope_local_base_freq: float
    """The local (sliding-window) layers' rope base."""
    max_position_embeddings: int
    query_pre_attn_scalar: float = 256.0
    """Attention scores are scaled by ``query_pre_attn_scalar ** -0.5``."""
    rope_linear_factor: float = 1.0
    """Linear rope scaling of the global layers (positions divided by it; 1: none)."""
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "gemma3_text"
    quantization_config: None = None

    @property
    def softmax_scale(self) -> float:
        return self.query_pre_attn_scalar**-0.5

    @property
    def sliding(self) -> tuple[bool, ...]:
        """Whether each layer attends through the sliding window."""
        return tuple(t == SLIDING for t in self.layer_types)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Gemma3Config:
        return parse_gemma3(raw)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike[str]) -> Gemma3Config:
        return cls.from_dict(read_json(path, what="config"))


def _layer_types(raw: Mapping[str, Any], n: int) -> tuple[str, ...]:
    types = raw.get("layer_types")
    if types is None:  # the older spelling: every pattern-th layer is global
        pattern = get_field(raw, "sliding_window_pattern", int, 6)
        if pattern <= 0:
            raise ConfigError(f"sliding_window_pattern must be positive, got {pattern}")
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(n))
    if not isinstance(types, list) or len(types) != n:
        raise ConfigError(f"layer_types must list one type per layer ({n}), got {types!r}")
    for i, t in enumerate(types):
        if t not in (SLIDING, FULL):
            raise ConfigError(f"layer_types[{i}] = {t!r} is not supported (only {SLIDING!r} and {FULL!r})")
    return tuple(types)


def _rope(raw: Mapping[str, Any]) -> tuple[float, float, float]:
    """(global base, local base, global linear factor) from either spelling: ``rope_parameters``
    per layer type (transformers >= 5) or ``rope_theta``, ``rope_local_base_freq`` and
    ``rope_scaling`` (hub configs)."""
    params = raw.get("rope_parameters")
    if params is not None and not isinstance(params, Mapping):
        raise ConfigError(f"config field 'rope_parameters' must be an object, got {params!r}")
    params = params or {}
    full = dict(params.get(FULL) or {})
    local = dict(params.get(SLIDING) or {})
    if raw.get("rope_scaling") is not None:
        if not isinstance(raw["rope_scaling"], Mapping):
            raise ConfigError(
                f"config field 'rope_scaling' must be an object or null, got {raw['rope_scaling']!r}"
            )
        full.update(raw["rope_scaling"])
    theta = get_field(raw, "rope_theta", float, None) or get_field(full, "rope_theta", float, 1e6)
    local_theta = get_field(raw, "rope_local_base_freq", float, None) or get_field(
        local, "rope_theta", float, 1e4
    )
    factor = 1.0
    for name, p in ((FULL, full), (SLIDING, local)):
        kind = p.get("rope_type", p.get("type", "default"))
        if kind == "linear" and name == FULL:
            factor = get_field(p, "factor", float)
            if factor <= 0:
                raise ConfigError(f"rope scaling factor must be positive, got {factor}")
        elif kind != "default":
            raise ConfigError(
                f"rope_type {kind!r} for the {name} layers is not supported (Gemma 3: 'default', and "
                "'linear' for the full-attention layers)"
            )
    if theta <= 0 or local_theta <= 0:
        raise ConfigError(f"rope bases must be positive, got {theta} (global) and {local_theta} (local)")
    return theta, local_theta, factor


def parse_gemma3(raw: Mapping[str, Any]) -> Gemma3Config:
    model_type = raw.get("model_type")
    if model_type not in GEMMA3_MODEL_TYPES:
        raise ConfigError(
            f"model_type {model_type!r} is not a Gemma 3 text model ({', '.join(GEMMA3_MODEL_TYPES)})"
        )
    act = raw.get("hidden_activation", raw.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in _ACTIVATIONS:
        raise ConfigError(f"hidden_activation {act!r} is not supported (Gemma 3 uses 'gelu_pytorch_tanh')")
    for flag in ("attention_bias", "use_bidirectional_attention"):
        if get_field(raw, flag, bool, False):
            raise ConfigError(f"{flag}=true is not supported (Gemma 3's causal decoder has neither)")
    if raw.get("attn_logit_softcapping") is not None:
        raise ConfigError(
            f"attn_logit_softcapping={raw['attn_logit_softcapping']!r} is not supported (Gemma 3's "
            "attention has no soft cap: transformers ignores the field and llama.cpp refuses it)"
        )
    if raw.get("quantization_config") is not None:
        raise ConfigError(
            "quantization_config is not supported for Gemma 3 checkpoints (BF16/FP16/FP32 only)"
        )
    n = positive_field(raw, "num_hidden_layers")
    heads = positive_field(raw, "num_attention_heads")
    kv_heads = positive_field(raw, "num_key_value_heads", heads)
    types = _layer_types(raw, n)
    window = get_field(raw, "sliding_window", int, None)
    if SLIDING in types and (window is None or window <= 0):
        raise ConfigError(f"sliding_window must be a positive integer when layers slide, got {window!r}")
    theta, local_theta, factor = _rope(raw)
    cap = get_field(raw, "final_logit_softcapping", (int, float), None)
    if cap is not None and cap <= 0:
        raise ConfigError(f"final_logit_softcapping must be positive or null, got {cap}")
    cfg = Gemma3Config(
        vocab_size=positive_field(raw, "vocab_size"),
        hidden_size=positive_field(raw, "hidden_size"),
        intermediate_size=positive_field(raw, "intermediate_size"),
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=positive_field(raw, "head_dim", 256),
        rms_norm_eps=get_field(raw, "rms_norm_eps", float, 1e-6),
        sliding_window=window or 0,
        layer_types=types,
        rope_theta=theta,
        rope_local_base_freq=local_theta,
        max_position_embeddings=positive_field(raw, "max_position_embeddings", 131072),
        query_pre_attn_scalar=float(get_field(raw, "query_pre_attn_scalar", (int, float), 256)),
        rope_linear_factor=factor,
        final_logit_softcapping=None if cap is None else float(cap),
        tie_word_embeddings=get_field(raw, "tie_word_embeddings", bool, True),
        bos_token_id=get_field(raw, "bos_token_id", int, None),
        eos_token_ids=parse_eos(raw),
        model_type=model_type,
    )
    if heads % kv_heads:
        raise ConfigError(
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    if cfg.head_dim % 2:
        raise ConfigError(f"head_dim must be even for rotary embedding, got {cfg.head_dim}")
    if cfg.rms_norm_eps <= 0 or cfg.query_pre_attn_scalar <= 0:
        raise ConfigError(
            f"rms_norm_eps and query_pre_attn_scalar must be positive, got {cfg.rms_norm_eps} and "
            f"{cfg.query_pre_attn_scalar}"
        )
    check_special_tokens(cfg)
    return cfg
