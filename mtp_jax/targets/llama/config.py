"""The Llama family's configuration parsed from config.json: Llama 3.x (llama3 rope scaling),
Qwen2 (q/k/v biases) and Qwen3 (q/k norms), and the shared parser a plug-in of the family uses.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from mtp_jax.config import (
    Llama3RopeScaling,
    check_special_tokens,
    get_field,
    parse_eos,
    positive_field,
    read_json,
    rope_settings,
    sliding_layers,
)
from mtp_jax.errors import ConfigError

LLAMA_MODEL_TYPES = ("llama",)


@dataclasses.dataclass(frozen=True)
class Llama3Config:
    """Llama 3 / 3.1 / 3.2 / 3.3 (``LlamaForCausalLM``): GQA attention, rotate-half rope (optionally
    with llama3 scaling), RMSNorm, SwiGLU, tied or untied embeddings, no biases."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: Llama3RopeScaling | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    quantization_config: None = None  # the checkpoint reader's FP8 path never applies to Llama
    qkv_bias: bool = False
    """Biases on the q/k/v projections (Qwen2)."""
    qk_norm: bool = False
    """An RMSNorm over each query and key head before rope (Qwen3)."""

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Llama3Config:
        return parse_llama3(raw)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike[str]) -> Llama3Config:
        return cls.from_dict(read_json(path, what="config"))


@dataclasses.dataclass(frozen=True)
class Qwen2Config(Llama3Config):
    """Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): the Llama family with q/k/v biases
    (:mod:`mtp_jax.targets.llama.qwen2`)."""

    model_type: str = "qwen2"
    qkv_bias: bool = True


@dataclasses.dataclass(frozen=True)
class Qwen3Config(Llama3Config):
    """Qwen3 (``Qwen3ForCausalLM``, dense): the Llama family with an RMSNorm over each query and
    key head before rope (:mod:`mtp_jax.targets.llama.qwen3`)."""

    model_type: str = "qwen3"
    qk_norm: bool = True


def parse_llama_rope(scaling: Mapping[str, Any] | None) -> Llama3RopeScaling | None:
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ConfigError(
            f"rope_scaling.rope_type {kind!r} is not supported for Llama (only 'llama3' or no scaling)"
        )
    out = Llama3RopeScaling(
        factor=get_field(scaling, "factor", float),
        low_freq_factor=get_field(scaling, "low_freq_factor", float),
        high_freq_factor=get_field(scaling, "high_freq_factor", float),
        original_max_position_embeddings=get_field(scaling, "original_max_position_embeddings", int),
    )
    if out.factor <= 0 or out.low_freq_factor <= 0 or out.original_max_position_embeddings <= 0:
        raise ConfigError(
            f"rope_scaling: factor, low_freq_factor and original_max_position_embeddings must be positive, "
            f"got {out}"
        )
    if out.high_freq_factor <= out.low_freq_factor:
        raise ConfigError(
            f"rope_scaling.high_freq_factor ({out.high_freq_factor}) must exceed low_freq_factor "
            f"({out.low_freq_factor})"
        )
    return out


def parse_llama3(raw: Mapping[str, Any]) -> Llama3Config:
    model_type = raw.get("model_type")
    if model_type not in LLAMA_MODEL_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not a Llama model ({', '.join(LLAMA_MODEL_TYPES)})")
    for flag in ("attention_bias", "mlp_bias"):
        if get_field(raw, flag, bool, False):
            raise ConfigError(f"{flag}=true is not supported (Llama 3 projections have no bias)")
    if raw.get("sliding_window") is not None:
        raise ConfigError(
            f"sliding_window={raw['sliding_window']!r} is not supported (Llama 3 attends over the whole "
            "context)"
        )
    return parse_llama_family(raw, Llama3Config, "Llama 3")


def parse_qwen(raw: Mapping[str, Any]) -> Qwen2Config | Qwen3Config:
    """Qwen2 (q/k/v biases) or Qwen3 (q/k norms, no biases); a sliding-window layer is refused."""
    model_type = raw.get("model_type")
    family = {"qwen2": "Qwen2", "qwen3": "Qwen3"}[model_type]
    if model_type == "qwen3":
        for flag in ("attention_bias", "mlp_bias"):
            if get_field(raw, flag, bool, False):
                raise ConfigError(
                    f"{flag}=true is not supported (Qwen3's published projections have no bias)"
                )
    layers = sliding_layers(raw)
    if layers:
        raise ConfigError(
            f"sliding-window attention is not supported ({family} config: layers {layers[0]}..{layers[-1]} "
            f"attend through a window of {raw.get('sliding_window')}); every layer must attend over the "
            "whole context (use_sliding_window false)"
        )
    if model_type == "qwen2":
        return parse_llama_family(raw, Qwen2Config, family, qkv_bias=True)
    return parse_llama_family(raw, Qwen3Config, family, qk_norm=True)


def parse_llama_family(
    raw: Mapping[str, Any], cls: type, family: str, *, qkv_bias: bool = False, qk_norm: bool = False
) -> Any:
    """A Llama-family config (``cls``: :class:`Llama3Config` or a subclass; ``family`` names it in
    errors): the fields and checks Llama 3, Qwen2 and Qwen3 share, with the family's extras
    (:attr:`Llama3Config.qkv_bias`, :attr:`Llama3Config.qk_norm`). The caller refuses what its
    family does not support (biases, sliding windows) first."""
    model_type = raw.get("model_type")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported ({family} uses 'silu')")
    if raw.get("quantization_config") is not None:
        raise ConfigError(
            f"quantization_config is not supported for {family} checkpoints (BF16/FP16/FP32 only)"
        )
    heads = positive_field(raw, "num_attention_heads")
    kv_heads = positive_field(raw, "num_key_value_heads", heads)
    hidden = positive_field(raw, "hidden_size")
    head_dim = positive_field(raw, "head_dim", None)
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(
                f"hidden_size ({hidden}) is not divisible by num_attention_heads ({heads}); give head_dim"
            )
        head_dim = hidden // heads
    theta, scaling = rope_settings(raw)
    cfg = cls(
        vocab_size=positive_field(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=positive_field(raw, "intermediate_size"),
        num_hidden_layers=positive_field(raw, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=get_field(raw, "rms_norm_eps", float, 1e-6),
        rope_theta=theta,
        max_position_embeddings=positive_field(raw, "max_position_embeddings", 2048),
        rope_scaling=parse_llama_rope(scaling),
        tie_word_embeddings=get_field(raw, "tie_word_embeddings", bool, False),
        bos_token_id=get_field(raw, "bos_token_id", int, None),
        eos_token_ids=parse_eos(raw),
        model_type=model_type,
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
    )
    if heads % kv_heads:
        raise ConfigError(
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    if head_dim % 2:
        raise ConfigError(f"head_dim must be even for rotary embedding, got {head_dim}")
    if cfg.rms_norm_eps <= 0 or cfg.rope_theta <= 0:
        raise ConfigError(
            f"rms_norm_eps and rope_theta must be positive, got {cfg.rms_norm_eps} and {cfg.rope_theta}"
        )
    check_special_tokens(cfg)
    return cfg
