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
from collections.abc import Callable, Mapping
from typing import Any

from mtp_jax.errors import CheckpointNotFoundError, ConfigError

# Kimi-K2 ships the DeepSeek-V3 architecture under its own model_type.
DEEPSEEK_V3_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
LLAMA_MODEL_TYPES = ("llama",)
QWEN_MODEL_TYPES = ("qwen2", "qwen3")


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
        return parse_deepseek_v3(raw)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike[str]) -> DeepseekV3Config:
        return cls.from_dict(read_json(path, what="config"))


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency scaling (``rope_type: llama3``): long wavelengths divided by
    ``factor``, short ones kept, a smooth blend between (:func:`mtp_jax.layers.llama3_frequencies`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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


ModelConfig = DeepseekV3Config | Llama3Config


@dataclasses.dataclass(frozen=True)
class DraftModelConfig:
    """A separate draft model's configuration (:mod:`mtp_jax.drafts.draft_model.draft`): its own parsed
    config (any target family's) and the target's vocabulary size its proposals are in."""

    model: ModelConfig
    target_vocab_size: int


def _refuse_wrapped(raw: Mapping[str, Any]) -> None:
    if "text_config" in raw:
        raise ConfigError(
            "config.json wraps the language model in 'text_config' (a multimodal checkpoint such as "
            "Kimi-K2.5); this is not supported yet"
        )


def parse_config(raw: Mapping[str, Any]) -> ModelConfig:
    """The config dataclass of ``raw`` (a parsed config.json), chosen by its ``model_type`` (the
    registered targets': :func:`register_model_type`)."""
    _refuse_wrapped(raw)
    model_type = raw.get("model_type")
    parse = _PARSERS.get(model_type) if isinstance(model_type, str) else None
    if parse is None:
        raise ConfigError(f"unsupported model_type {model_type!r}; supported: {', '.join(model_types())}")
    return parse(raw)


def model_types() -> tuple[str, ...]:
    """Every ``model_type`` :func:`parse_config` reads."""
    return tuple(_PARSERS)


def register_model_type(
    model_type: str, parse: Callable[[Mapping[str, Any]], Any], *, built_in: bool = False
) -> None:
    """Make :func:`parse_config` read configs of ``model_type`` with ``parse(raw) -> config`` (every
    target's, through :func:`mtp_jax.targets.register_target`); a built-in type (``built_in``: the
    package's own registrations) cannot be replaced."""
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"a model_type is a non-empty string, got {model_type!r}")
    if model_type in _BUILT_IN_TYPES:
        raise ValueError(f"model_type {model_type!r} is built in")
    _PARSERS[model_type] = parse
    if built_in:
        _BUILT_IN_TYPES.add(model_type)


def load_config(path: str | os.PathLike[str]) -> ModelConfig:
    """:func:`parse_config` of a config.json file (or of the config.json in a directory)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    return parse_config(read_json(path, what="config"))


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


def _mla_widths(raw: Mapping[str, Any]) -> dict[str, int | None]:
    """MLA's low-rank and head widths (q_lora_rank may be absent: a full-rank query projection)."""
    return {
        "q_lora_rank": _positive(raw, "q_lora_rank", None),
        **{
            k: _positive(raw, k)
            for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        },
    }


def parse_deepseek_v3(raw: Mapping[str, Any]) -> DeepseekV3Config:
    _refuse_wrapped(raw)
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
        **_mla_widths(raw),
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
    _check_special_tokens(cfg)


def _rope_settings(raw: Mapping[str, Any]) -> tuple[float, Mapping[str, Any] | None]:
    """(rope_theta, the scaling object or None) from either spelling: top-level ``rope_theta`` and
    ``rope_scaling`` (hub repos), or ``rope_parameters`` (checkpoints saved by transformers >= 5)."""
    params = raw.get("rope_parameters")
    if params is not None and not isinstance(params, Mapping):
        raise ConfigError(f"config field 'rope_parameters' must be an object, got {params!r}")
    theta = _get(raw, "rope_theta", float, None)
    if theta is None:
        theta = _get(params or {}, "rope_theta", float, 10000.0)
    scaling = raw.get("rope_scaling")
    if scaling is None and params is not None:
        scaling = params
    if scaling is not None and not isinstance(scaling, Mapping):
        raise ConfigError(f"config field 'rope_scaling' must be an object or null, got {scaling!r}")
    return theta, scaling


def _parse_llama_rope(scaling: Mapping[str, Any] | None) -> Llama3RopeScaling | None:
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
        factor=_get(scaling, "factor", float),
        low_freq_factor=_get(scaling, "low_freq_factor", float),
        high_freq_factor=_get(scaling, "high_freq_factor", float),
        original_max_position_embeddings=_get(scaling, "original_max_position_embeddings", int),
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
        if _get(raw, flag, bool, False):
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
            if _get(raw, flag, bool, False):
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


def sliding_layers(raw: Mapping[str, Any]) -> list[int]:
    """The layers a Qwen-style config makes attend through a sliding window: those ``layer_types``
    names ``sliding_attention``, or, without it, with ``use_sliding_window`` and a
    ``sliding_window``, the layers from ``max_window_layers`` on (transformers' rule)."""
    n = int(raw.get("num_hidden_layers") or 0)
    types = raw.get("layer_types")
    if types is not None:
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    if raw.get("use_sliding_window") and raw.get("sliding_window") is not None:
        return list(range(int(raw.get("max_window_layers", n)), n))
    return []


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
    heads = _positive(raw, "num_attention_heads")
    kv_heads = _positive(raw, "num_key_value_heads", heads)
    hidden = _positive(raw, "hidden_size")
    head_dim = _positive(raw, "head_dim", None)
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(
                f"hidden_size ({hidden}) is not divisible by num_attention_heads ({heads}); give head_dim"
            )
        head_dim = hidden // heads
    theta, scaling = _rope_settings(raw)
    cfg = cls(
        vocab_size=_positive(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_positive(raw, "intermediate_size"),
        num_hidden_layers=_positive(raw, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_get(raw, "rms_norm_eps", float, 1e-6),
        rope_theta=theta,
        max_position_embeddings=_positive(raw, "max_position_embeddings", 2048),
        rope_scaling=_parse_llama_rope(scaling),
        tie_word_embeddings=_get(raw, "tie_word_embeddings", bool, False),
        bos_token_id=_get(raw, "bos_token_id", int, None),
        eos_token_ids=_parse_eos(raw),
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
    _check_special_tokens(cfg)
    return cfg


def _check_special_tokens(cfg: ModelConfig) -> None:
    for tok in cfg.eos_token_ids + ((cfg.bos_token_id,) if cfg.bos_token_id is not None else ()):
        if tok >= cfg.vocab_size:
            raise ConfigError(
                f"special token id {tok} is outside the vocabulary (vocab_size {cfg.vocab_size})"
            )


# --- EAGLE-3 drafts ------------------------------------------------------------------------------
EAGLE3_LAYER_READINGS = ("inputs", "outputs")
# Variant flags of published EAGLE-3 drafts: those whose math we implement, and those refused by name.
EAGLE3_FLAGS = ("norm_before_residual", "norm_output")
EAGLE3_REFUSED_FLAGS = ("norm_before_fc", "fc_norm")


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 draft (one Llama-style decoder layer over three fused target hidden states).

    ``aux_layer_ids``: the captured-layer ids written in its config (None: the default), as
    written; ``capture`` is what they mean for a particular target, resolved at load
    (:func:`eagle3_capture`): target layer outputs, -1 for the embedding.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: Llama3RopeScaling | None = None
    mla: DeepseekV3Config | None = None
    """For an MLA draft: its attention's config (a one-layer dense DeepSeek-V3 config: the MLA
    widths, rope and YaRN scaling); None for a GQA draft."""
    aux_layer_ids: tuple[int, ...] | None = None
    norm_before_residual: bool = False
    norm_output: bool = False
    capture: tuple[int, ...] = ()

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Eagle3Config:
        return parse_eagle3_config(raw)


def parse_eagle3_config(raw: Mapping[str, Any], mla: bool = False) -> Eagle3Config:
    """An EAGLE-3 draft's config.json (any of the published spellings; docs/formats.md, "EAGLE-3 drafts").
    ``mla``: the draft's attention is DeepSeek's MLA (its checkpoint has ``q_a_proj`` /
    ``kv_a_proj_with_mqa``), described by the DeepSeek fields (``kv_lora_rank``, ...) and a YaRN
    ``rope_scaling``; otherwise Llama-style GQA with the llama3 scaling or none."""
    layers = _positive(raw, "num_hidden_layers", 1)
    if layers != 1:
        raise ConfigError(f"num_hidden_layers={layers}: an EAGLE-3 draft has exactly one decoder layer")
    _check_draft_layers(raw, "EAGLE-3")
    for flag in EAGLE3_REFUSED_FLAGS:
        if _get(raw, flag, bool, False):
            raise ConfigError(
                f"{flag}=true is not supported for EAGLE-3 drafts (supported variant flags: "
                f"{', '.join(EAGLE3_FLAGS)})"
            )
    eagle = raw.get("eagle_config") or {}
    if not isinstance(eagle, Mapping):
        raise ConfigError(f"config field 'eagle_config' must be an object, got {eagle!r}")
    if eagle.get("use_aux_hidden_state", True) is False:
        raise ConfigError(
            "eagle_config.use_aux_hidden_state=false describes an EAGLE-1/2 draft (one hidden state), "
            "not EAGLE-3"
        )
    ids = eagle.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
    _check_layer_ids(ids, "eagle_aux_hidden_state_layer_ids")
    heads = _positive(raw, "num_attention_heads")
    hidden = _positive(raw, "hidden_size")
    # MLA attention is described by DeepSeek's fields; the GQA ones then mean nothing
    kv_heads, head_dim = (heads, 2) if mla else _gqa_heads(raw, hidden, heads)
    vocab = _positive(raw, "vocab_size")
    draft_vocab = _positive(raw, "draft_vocab_size", vocab)
    if draft_vocab > vocab:
        raise ConfigError(f"draft_vocab_size ({draft_vocab}) exceeds vocab_size ({vocab})")
    theta, scaling = _rope_settings(raw)
    cfg = Eagle3Config(
        hidden_size=hidden,
        intermediate_size=_positive(raw, "intermediate_size"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        target_hidden_size=_positive(raw, "target_hidden_size", hidden),
        rms_norm_eps=_get(raw, "rms_norm_eps", float, 1e-6),
        rope_theta=theta,
        max_position_embeddings=_positive(raw, "max_position_embeddings", 2048),
        rope_scaling=None if mla else _parse_llama_rope(scaling),
        mla=_eagle3_mla(raw, hidden, heads) if mla else None,
        aux_layer_ids=None if ids is None else tuple(ids),
        **{flag: _get(raw, flag, bool, False) for flag in EAGLE3_FLAGS},
    )
    if cfg.rms_norm_eps <= 0 or cfg.rope_theta <= 0:
        raise ConfigError(
            f"rms_norm_eps and rope_theta must be positive, got {cfg.rms_norm_eps} and {cfg.rope_theta}"
        )
    return cfg


def _check_draft_layers(raw: Mapping[str, Any], kind: str) -> None:
    """A draft's decoder layers: no biases, SiLU."""
    for flag in ("attention_bias", "mlp_bias"):
        if _get(raw, flag, bool, False):
            raise ConfigError(f"{flag}=true is not supported ({kind} draft projections have no bias)")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported ({kind} drafts use 'silu')")


def _check_layer_ids(ids: Any, name: str) -> None:
    """None, or a non-empty list of non-negative layer ids."""
    if ids is not None and (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
    ):
        raise ConfigError(f"{name} must be a non-empty list of non-negative layer ids, got {ids!r}")


def _gqa_heads(raw: Mapping[str, Any], hidden: int, heads: int) -> tuple[int, int]:
    """(num_key_value_heads, head_dim) of a rotary GQA attention, checked."""
    kv_heads = _positive(raw, "num_key_value_heads", heads)
    head_dim = _positive(raw, "head_dim", None) or (hidden // heads if hidden % heads == 0 else None)
    if head_dim is None:
        raise ConfigError(
            f"hidden_size ({hidden}) is not divisible by num_attention_heads ({heads}); give head_dim"
        )
    if heads % kv_heads:
        raise ConfigError(
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    if head_dim % 2:
        raise ConfigError(f"head_dim must be even for rotary embedding, got {head_dim}")
    return kv_heads, head_dim


def _eagle3_mla(raw: Mapping[str, Any], hidden: int, heads: int) -> DeepseekV3Config:
    """The attention config of an MLA EAGLE-3 draft: one dense DeepSeek-V3 layer (no experts)."""
    inter = _positive(raw, "intermediate_size")
    return DeepseekV3Config(
        vocab_size=_positive(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=inter,
        moe_intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=heads,
        **_mla_widths(raw),
        n_routed_experts=1,
        n_shared_experts=0,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        rms_norm_eps=_get(raw, "rms_norm_eps", float, 1e-6),
        rope_theta=_get(raw, "rope_theta", float, 10000.0),
        max_position_embeddings=_positive(raw, "max_position_embeddings", 2048),
        rope_scaling=_parse_rope_scaling(raw),
    )


def eagle3_capture(cfg: Eagle3Config, num_target_layers: int, layer_ids: str = "inputs") -> tuple[int, ...]:
    """The target layers an EAGLE-3 draft reads, as target layer OUTPUTS (-1: the embedding).

    ``layer_ids="inputs"`` reads a config id i as the input of decoder layer i (vLLM and MAX;
    transformers' ``hidden_states[i]``), ``"outputs"`` as the output of layer i (SGLang; what
    SpecForge writes). Without ids: the inputs of layers 2, L/2 and L-3 (EAGLE-3's default)."""
    if layer_ids not in EAGLE3_LAYER_READINGS:
        raise ValueError(f"layer_ids must be one of {EAGLE3_LAYER_READINGS}, got {layer_ids!r}")
    n = num_target_layers
    if cfg.aux_layer_ids is None:
        return tuple(max(i, 0) - 1 for i in (2, n // 2, n - 3))
    shift = 1 if layer_ids == "inputs" else 0
    for i in cfg.aux_layer_ids:
        if not 0 <= i < n:
            raise ConfigError(
                f"eagle_aux_hidden_state_layer_ids {list(cfg.aux_layer_ids)}: id {i} is beyond the "
                f"target's {n} layers (ids read as layer {layer_ids}: 0..{n - 1})"
            )
    return tuple(i - shift for i in cfg.aux_layer_ids)


def describe_capture(capture: tuple[int, ...]) -> str:
    """Words for captured layers: 'outputs of layers 1, 15, 28' or 'the embedding, ...'."""
    parts = ["the embedding" if i == -1 else f"layer {i}" for i in capture]
    return "outputs of " + ", ".join(parts) + " (0-based)"


# --- DFlash drafts ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """A DFlash block-diffusion draft (docs/formats.md, "DFlash drafts"): ``num_hidden_layers``
    Qwen3-style decoder layers (q_norm / k_norm before rope) that propose a whole block in one
    non-causal forward, conditioned on the target's hidden states injected as extra keys and values;
    no embedding and no head of its own (the target's).

    ``target_layer_ids``: the captured target layers as written (layer OUTPUTS; None: the default);
    ``capture`` is what they mean for a particular target, resolved at load (:func:`dflash_capture`).
    ``draft_vocab_size`` (an mtp-jax extension, absent from the published layout): the block's head
    is the target's head restricted to that many target ids (the checkpoint's ``d2t`` offsets, as
    EAGLE-3 writes them); None: the target's whole vocabulary.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    block_size: int
    mask_token_id: int
    rope_scaling: Llama3RopeScaling | None = None
    target_layer_ids: tuple[int, ...] | None = None
    num_target_layers: int | None = None
    vocab_size: int | None = None
    draft_vocab_size: int | None = None
    capture: tuple[int, ...] = ()

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> DFlashConfig:
        return parse_dflash_config(raw)


def parse_dflash_config(raw: Mapping[str, Any]) -> DFlashConfig:
    """A DFlash draft's config.json: ``block_size`` at top level or inside ``dflash_config`` (newer
    checkpoints), ``dflash_config.mask_token_id`` (required) and ``target_layer_ids``, the
    draft's own rope (``llama3`` scaling or none)."""
    _check_draft_layers(raw, "DFlash")
    dflash = raw.get("dflash_config") or {}
    if not isinstance(dflash, Mapping):
        raise ConfigError(f"config field 'dflash_config' must be an object, got {dflash!r}")
    if "mask_token_id" not in dflash:
        raise ConfigError(
            "a DFlash draft needs dflash_config.mask_token_id (the id its block is masked with)"
        )
    mask = _get(dflash, "mask_token_id", int)
    if mask < 0:
        raise ConfigError(f"dflash_config.mask_token_id must be a token id, got {mask}")
    sizes = {where: _positive(src, "block_size", None) for where, src in (("top", raw), ("dflash", dflash))}
    if sizes["top"] and sizes["dflash"] and sizes["top"] != sizes["dflash"]:
        raise ConfigError(
            f"block_size {sizes['top']} (top level) and dflash_config.block_size {sizes['dflash']} disagree"
        )
    block = sizes["dflash"] or sizes["top"]
    if block is None:
        raise ConfigError("a DFlash draft needs block_size (top level or in dflash_config)")
    if block < 2:
        raise ConfigError(f"block_size must be at least 2 (an anchor and one draft), got {block}")
    ids = dflash.get("target_layer_ids")
    _check_layer_ids(ids, "dflash_config.target_layer_ids")
    heads = _positive(raw, "num_attention_heads")
    hidden = _positive(raw, "hidden_size")
    kv_heads, head_dim = _gqa_heads(raw, hidden, heads)
    theta, scaling = _rope_settings(raw)
    cfg = DFlashConfig(
        hidden_size=hidden,
        intermediate_size=_positive(raw, "intermediate_size"),
        num_hidden_layers=_positive(raw, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_get(raw, "rms_norm_eps", float, 1e-6),
        rope_theta=theta,
        max_position_embeddings=_positive(raw, "max_position_embeddings", 2048),
        block_size=block,
        mask_token_id=mask,
        rope_scaling=_parse_llama_rope(scaling),
        target_layer_ids=None if ids is None else tuple(ids),
        num_target_layers=_positive(raw, "num_target_layers", None),
        vocab_size=_positive(raw, "vocab_size", None),
        draft_vocab_size=_positive(raw, "draft_vocab_size", None),
    )
    if cfg.rms_norm_eps <= 0 or cfg.rope_theta <= 0:
        raise ConfigError(
            f"rms_norm_eps and rope_theta must be positive, got {cfg.rms_norm_eps} and {cfg.rope_theta}"
        )
    if cfg.vocab_size is not None and (cfg.draft_vocab_size or 0) > cfg.vocab_size:
        raise ConfigError(f"draft_vocab_size ({cfg.draft_vocab_size}) exceeds vocab_size ({cfg.vocab_size})")
    if cfg.vocab_size is not None and mask >= cfg.vocab_size:
        raise ConfigError(
            f"dflash_config.mask_token_id {mask} is outside the vocabulary (vocab_size {cfg.vocab_size})"
        )
    return cfg


def dflash_default_layers(num_target_layers: int, count: int) -> tuple[int, ...]:
    """DFlash's default captured layers (outputs): the middle one for a single layer, else
    ``round(1 + i·(L − 4)/(count − 1))`` for i = 0..count−1 (36 layers, 5 → 1, 9, 17, 25, 33)."""
    if count == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (count - 1))) for i in range(count))


def dflash_capture(cfg: DFlashConfig, num_target_layers: int) -> tuple[int, ...]:
    """The target layer OUTPUTS a DFlash draft reads (transformers' ``hidden_states[i + 1]``): its
    ``target_layer_ids``, or without them the default for its ``num_target_layers`` and one layer
    per draft layer."""
    n = num_target_layers
    if cfg.num_target_layers is not None and cfg.num_target_layers != n:
        raise ConfigError(
            f"the DFlash draft was made for a target of {cfg.num_target_layers} layers "
            f"(num_target_layers); this target has {n}"
        )
    ids = cfg.target_layer_ids or dflash_default_layers(n, cfg.num_hidden_layers)
    for i in ids:
        if not 0 <= i < n:
            raise ConfigError(
                f"dflash_config.target_layer_ids {list(ids)}: layer {i} is beyond the target's {n} layers "
                f"(ids are layer outputs: 0..{n - 1})"
            )
    return tuple(ids)


def parse_draft_config(
    raw: Mapping[str, Any],
    num_target_layers: int,
    layer_ids: str = "inputs",
    target_vocab_size: int | None = None,
) -> Any:
    """A separately trained draft's config.json (DFlash by its architecture or ``dflash_config``; a
    draft model when it is a plain causal LM a target reads, e.g. Llama 3.1 8B for 70B: a
    :class:`mtp_jax.drafts.draft_model.draft.DraftModelConfig` over ``target_vocab_size``, default its
    own; else EAGLE-3, with MLA attention when it carries ``kv_lora_rank``), with the target layers
    it captures resolved for a target of ``num_target_layers`` layers (``layer_ids``: how EAGLE-3
    ids are read, :func:`eagle3_capture`)."""
    archs = " ".join(map(str, raw.get("architectures") or [])).lower()
    plain_lm = archs.endswith("forcausallm") and "eagle" not in archs and "eagle_config" not in raw
    if plain_lm and "dflash_config" not in raw and "draft_vocab_size" not in raw:
        model = parse_config(raw)
        return DraftModelConfig(model, target_vocab_size or model.vocab_size)
    if "dflash" in archs or "dflash_config" in raw:
        cfg: Eagle3Config | DFlashConfig = parse_dflash_config(raw)
        capture = dflash_capture(cfg, num_target_layers)
    else:
        cfg = parse_eagle3_config(raw, mla="kv_lora_rank" in raw)
        capture = eagle3_capture(cfg, num_target_layers, layer_ids)
    return dataclasses.replace(cfg, capture=capture)


_PARSERS: dict[str, Callable[[Mapping[str, Any]], Any]] = {}
"""model_type -> parser, filled by the targets' registrations (:mod:`mtp_jax.builtin`)."""
_BUILT_IN_TYPES: set[str] = set()
