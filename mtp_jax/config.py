"""Model configuration parsed once from a Hugging Face ``config.json``.

Only the fields the math needs are kept, in frozen dataclasses; everything is validated here so the
model code can trust it. Unknown model types and inconsistent fields raise :class:`ConfigError`
naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

from mtp_jax.errors import CheckpointNotFoundError, ConfigError

# Kimi-K2 ships the DeepSeek-V3 architecture under its own model_type.
DEEPSEEK_V3_MODEL_TYPES = ("deepseek_v3", "kimi_k2")


@dataclasses.dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN rope scaling as DeepSeek-V3 configures it (``rope_scaling.type == "yarn"``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """Block-wise FP8 weight quantisation (``quant_method: fp8``)."""

    quant_method: str
    fmt: str
    weight_block_size: tuple[int, int]
    activation_scheme: str = "dynamic"


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config:
    """DeepSeek-V3 architecture (MLA attention, dense then MoE layers, optional MTP layers)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: YarnRopeScaling | None = None
    num_nextn_predict_layers: int = 0
    quantization_config: QuantizationConfig | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "deepseek_v3"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_dense_layers(self) -> int:
        return self.first_k_dense_replace

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_mscale(rs.factor, rs.mscale_all_dim)
            scale *= m * m
        return scale

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> DeepseekV3Config:
        return _parse_deepseek_v3(raw)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike[str]) -> DeepseekV3Config:
        return cls.from_dict(read_json(path, what="config"))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1·mscale·ln(factor) + 1 (1 when factor ≤ 1)."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def read_json(path: str | os.PathLike[str], *, what: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(f"{what} file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} file {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{what} file {path} must hold a JSON object, got {type(data).__name__}")
    return data


def _get(raw: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if key not in raw or (raw[key] is None and default is not ...):
        if default is ...:
            raise ConfigError(f"config.json is missing the required field '{key}'")
        return default
    value = raw[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int subclass; never accept it where a number is meant.
    if isinstance(value, bool) and bool not in kinds:
        raise ConfigError(f"config field '{key}' must be {_kind_name(kinds)}, got {value!r}")
    if float in kinds and isinstance(value, int):
        value = float(value)
    if not isinstance(value, kinds):
        raise ConfigError(f"config field '{key}' must be {_kind_name(kinds)}, got {value!r}")
    return value


def _kind_name(kinds: tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kinds)


def _positive(raw: Mapping[str, Any], key: str, default: Any = ...) -> int:
    value = _get(raw, key, int, default)
    if value is not None and value <= 0:
        raise ConfigError(f"config field '{key}' must be a positive integer, got {value}")
    return value


def _parse_rope_scaling(raw: Mapping[str, Any]) -> YarnRopeScaling | None:
    rs = raw.get("rope_scaling")
    if rs is None:
        # transformers >= 5 writes rope_parameters instead; a plain default rope has no scaling.
        rs = raw.get("rope_parameters")
        if isinstance(rs, Mapping) and rs.get("rope_type", rs.get("type", "default")) == "default":
            return None
    if rs is None:
        return None
    if not isinstance(rs, Mapping):
        raise ConfigError(f"config field 'rope_scaling' must be an object or null, got {rs!r}")
    kind = rs.get("type", rs.get("rope_type"))
    if kind != "yarn":
        raise ConfigError(
            f"rope_scaling type {kind!r} is not supported for DeepSeek-V3 (only 'yarn' or no scaling)"
        )
    factor = _get(rs, "factor", float)
    if factor < 1.0:
        raise ConfigError(f"rope_scaling.factor must be >= 1, got {factor}")
    orig = rs.get("original_max_position_embeddings")
    if not isinstance(orig, int) or isinstance(orig, bool) or orig <= 0:
        raise ConfigError(
            f"rope_scaling.original_max_position_embeddings must be a positive integer, got {orig!r}"
        )
    return YarnRopeScaling(
        factor=factor,
        original_max_position_embeddings=orig,
        beta_fast=_get(rs, "beta_fast", float, 32.0),
        beta_slow=_get(rs, "beta_slow", float, 1.0),
        mscale=_get(rs, "mscale", float, 1.0),
        mscale_all_dim=_get(rs, "mscale_all_dim", float, 0.0),
    )


def _parse_quantization(raw: Mapping[str, Any]) -> QuantizationConfig | None:
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise ConfigError(f"config field 'quantization_config' must be an object, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        detail = ""
        if method == "compressed-tensors":
            detail = " (e.g. the INT4 expert weights of Kimi-K2.5)"
        raise ConfigError(
            f"quantization_config.quant_method {method!r} is not supported{detail}; "
            "only block-wise 'fp8' checkpoints (DeepSeek-V3/R1) are"
        )
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"quantization_config.fmt {fmt!r} is not supported (only 'e4m3')")
    block = q.get("weight_block_size")
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ConfigError(f"quantization_config.weight_block_size must be two positive ints, got {block!r}")
    return QuantizationConfig(
        quant_method=method,
        fmt=fmt,
        weight_block_size=(block[0], block[1]),
        activation_scheme=q.get("activation_scheme", "dynamic"),
    )


def _parse_eos(raw: Mapping[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(
            f"config field 'eos_token_id' must be a non-negative int or a list of them, got {eos!r}"
        )
    return tuple(ids)


def _parse_deepseek_v3(raw: Mapping[str, Any]) -> DeepseekV3Config:
    if "text_config" in raw:
        raise ConfigError(
            "config.json wraps the language model in 'text_config' (a multimodal checkpoint such as "
            "Kimi-K2.5); this is not supported yet"
        )
    model_type = raw.get("model_type")
    if model_type not in DEEPSEEK_V3_MODEL_TYPES:
        raise ConfigError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(DEEPSEEK_V3_MODEL_TYPES)}"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported (DeepSeek-V3 uses 'silu')")
    scoring = raw.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ConfigError(f"scoring_func {scoring!r} is not supported (DeepSeek-V3 routes with 'sigmoid')")
    topk_method = raw.get("topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
        raise ConfigError(f"topk_method {topk_method!r} is not supported (DeepSeek-V3 uses 'noaux_tc')")
    if raw.get("moe_layer_freq", 1) != 1:
        raise ConfigError(
            f"moe_layer_freq {raw['moe_layer_freq']!r} is not supported (only 1: every layer after "
            "first_k_dense_replace is MoE, as in DeepSeek-V3 and Kimi-K2)"
        )
    if raw.get("attention_bias", False):
        raise ConfigError("attention_bias=true is not supported (DeepSeek-V3 projections have no bias)")

    heads = _positive(raw, "num_attention_heads")
    kv_heads = raw.get("num_key_value_heads", heads)
    if kv_heads is not None and kv_heads != heads:
        raise ConfigError(
            f"num_key_value_heads ({kv_heads}) must equal num_attention_heads ({heads}) for MLA attention"
        )
    cfg = DeepseekV3Config(
        vocab_size=_positive(raw, "vocab_size"),
        hidden_size=_positive(raw, "hidden_size"),
        intermediate_size=_positive(raw, "intermediate_size"),
        moe_intermediate_size=_positive(raw, "moe_intermediate_size"),
        num_hidden_layers=_positive(raw, "num_hidden_layers"),
        num_attention_heads=heads,
        q_lora_rank=_positive(raw, "q_lora_rank", None),
        kv_lora_rank=_positive(raw, "kv_lora_rank"),
        qk_nope_head_dim=_positive(raw, "qk_nope_head_dim"),
        qk_rope_head_dim=_positive(raw, "qk_rope_head_dim"),
        v_head_dim=_positive(raw, "v_head_dim"),
        n_routed_experts=_positive(raw, "n_routed_experts"),
        n_shared_experts=_get(raw, "n_shared_experts", int, 0),
        num_experts_per_tok=_positive(raw, "num_experts_per_tok"),
        n_group=_positive(raw, "n_group", 1),
        topk_group=_positive(raw, "topk_group", 1),
        first_k_dense_replace=_get(raw, "first_k_dense_replace", int, 0),
        norm_topk_prob=_get(raw, "norm_topk_prob", bool, False),
        routed_scaling_factor=_get(raw, "routed_scaling_factor", float, 1.0),
        rms_norm_eps=_get(raw, "rms_norm_eps", float, 1e-6),
        rope_theta=_get(raw, "rope_theta", float, 10000.0),
        max_position_embeddings=_positive(raw, "max_position_embeddings"),
        rope_scaling=_parse_rope_scaling(raw),
        num_nextn_predict_layers=_get(raw, "num_nextn_predict_layers", int, 0),
        quantization_config=_parse_quantization(raw),
        tie_word_embeddings=_get(raw, "tie_word_embeddings", bool, False),
        bos_token_id=_get(raw, "bos_token_id", int, None),
        eos_token_ids=_parse_eos(raw),
        model_type=model_type,
    )
    _check_consistency(cfg)
    return cfg


def _check_consistency(cfg: DeepseekV3Config) -> None:
    if cfg.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim must be even for rotary embedding, got {cfg.qk_rope_head_dim}")
    if not 0 <= cfg.first_k_dense_replace <= cfg.num_hidden_layers:
        raise ConfigError(
            f"first_k_dense_replace ({cfg.first_k_dense_replace}) must lie in [0, num_hidden_layers="
            f"{cfg.num_hidden_layers}]"
        )
    if cfg.n_shared_experts < 0:
        raise ConfigError(f"n_shared_experts must be >= 0, got {cfg.n_shared_experts}")
    if cfg.num_nextn_predict_layers < 0:
        raise ConfigError(f"num_nextn_predict_layers must be >= 0, got {cfg.num_nextn_predict_layers}")
    if cfg.n_routed_experts % cfg.n_group:
        raise ConfigError(
            f"n_routed_experts ({cfg.n_routed_experts}) must be divisible by n_group ({cfg.n_group})"
        )
    per_group = cfg.n_routed_experts // cfg.n_group
    if per_group < 2 and cfg.n_group > 1:
        raise ConfigError(
            f"each expert group needs at least 2 experts (group score = sum of its top-2), got "
            f"n_routed_experts={cfg.n_routed_experts} over n_group={cfg.n_group}"
        )
    if cfg.topk_group > cfg.n_group:
        raise ConfigError(f"topk_group ({cfg.topk_group}) must not exceed n_group ({cfg.n_group})")
    if cfg.num_experts_per_tok > cfg.topk_group * per_group:
        raise ConfigError(
            f"num_experts_per_tok ({cfg.num_experts_per_tok}) exceeds the experts in the kept groups "
            f"(topk_group {cfg.topk_group} x {per_group} experts per group)"
        )
    if cfg.rms_norm_eps <= 0:
        raise ConfigError(f"rms_norm_eps must be positive, got {cfg.rms_norm_eps}")
    if cfg.rope_theta <= 0:
        raise ConfigError(f"rope_theta must be positive, got {cfg.rope_theta}")
    for tok in cfg.eos_token_ids + ((cfg.bos_token_id,) if cfg.bos_token_id is not None else ()):
        if tok >= cfg.vocab_size:
            raise ConfigError(
                f"special token id {tok} is outside the vocabulary (vocab_size {cfg.vocab_size})"
            )
