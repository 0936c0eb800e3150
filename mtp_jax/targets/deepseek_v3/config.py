"""DeepSeek-V3's configuration (and Kimi-K2's, the same architecture) parsed from config.json:
MLA widths, MoE routing, YaRN rope, FP8 quantisation, MTP layers; validated here so the model code
can trust it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from mtp_jax.config import (
    YarnRopeScaling,
    check_special_tokens,
    get_field,
    parse_eos,
    positive_field,
    read_json,
    refuse_wrapped,
    yarn_mscale,
)
from mtp_jax.errors import ConfigError

# Kimi-K2 ships the DeepSeek-V3 architecture under its own model_type.
DEEPSEEK_V3_MODEL_TYPES = ("deepseek_v3", "kimi_k2")


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
        return parse_deepseek_v3(raw)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike[str]) -> DeepseekV3Config:
        return cls.from_dict(read_json(path, what="config"))


def parse_yarn_rope(raw: Mapping[str, Any]) -> YarnRopeScaling | None:
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
    factor = get_field(rs, "factor", float)
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
        beta_fast=get_field(rs, "beta_fast", float, 32.0),
        beta_slow=get_field(rs, "beta_slow", float, 1.0),
        mscale=get_field(rs, "mscale", float, 1.0),
        mscale_all_dim=get_field(rs, "mscale_all_dim", float, 0.0),
    )


def parse_quantization(raw: Mapping[str, Any]) -> QuantizationConfig | None:
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


def mla_widths(raw: Mapping[str, Any]) -> dict[str, int | None]:
    """MLA's low-rank and head widths (q_lora_rank may be absent: a full-rank query projection)."""
    return {
        "q_lora_rank": positive_field(raw, "q_lora_rank", None),
        **{
            k: positive_field(raw, k)
            for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        },
    }


def parse_deepseek_v3(raw: Mapping[str, Any]) -> DeepseekV3Config:
    refuse_wrapped(raw)
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

    heads = positive_field(raw, "num_attention_heads")
    kv_heads = raw.get("num_key_value_heads", heads)
    if kv_heads is not None and kv_heads != heads:
        raise ConfigError(
            f"num_key_value_heads ({kv_heads}) must equal num_attention_heads ({heads}) for MLA attention"
        )
    cfg = DeepseekV3Config(
        vocab_size=positive_field(raw, "vocab_size"),
        hidden_size=positive_field(raw, "hidden_size"),
        intermediate_size=positive_field(raw, "intermediate_size"),
        moe_intermediate_size=positive_field(raw, "moe_intermediate_size"),
        num_hidden_layers=positive_field(raw, "num_hidden_layers"),
        num_attention_heads=heads,
        **mla_widths(raw),
        n_routed_experts=positive_field(raw, "n_routed_experts"),
        n_shared_experts=get_field(raw, "n_shared_experts", int, 0),
        num_experts_per_tok=positive_field(raw, "num_experts_per_tok"),
        n_group=positive_field(raw, "n_group", 1),
        topk_group=positive_field(raw, "topk_group", 1),
        first_k_dense_replace=get_field(raw, "first_k_dense_replace", int, 0),
        norm_topk_prob=get_field(raw, "norm_topk_prob", bool, False),
        routed_scaling_factor=get_field(raw, "routed_scaling_factor", float, 1.0),
        rms_norm_eps=get_field(raw, "rms_norm_eps", float, 1e-6),
        rope_theta=get_field(raw, "rope_theta", float, 10000.0),
        max_position_embeddings=positive_field(raw, "max_position_embeddings"),
        rope_scaling=parse_yarn_rope(raw),
        num_nextn_predict_layers=get_field(raw, "num_nextn_predict_layers", int, 0),
        quantization_config=parse_quantization(raw),
        tie_word_embeddings=get_field(raw, "tie_word_embeddings", bool, False),
        bos_token_id=get_field(raw, "bos_token_id", int, None),
        eos_token_ids=parse_eos(raw),
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
    check_special_tokens(cfg)
