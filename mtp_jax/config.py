"""Model configuration parsed once from a Hugging Face ``config.json``: the parser registry and the
field readers every family's parser shares.

Each target family and draft keeps its config dataclass and parser in its own folder
(``targets/<family>/config.py``, ``drafts/<name>/config.py``); a target's parser is registered by
``model_type`` (:func:`register_model_type`, through :func:`mtp_jax.targets.register_target`).
Only the fields the math needs are kept, in frozen dataclasses, validated when parsed so the model
code can trust them. Unknown model types and inconsistent fields raise :class:`ConfigError` naming
the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from mtp_jax.errors import CheckpointNotFoundError, ConfigError


# Rope scalings several families share (the math: mtp_jax.layers)
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
class Llama3RopeScaling:
    """Llama 3.1's frequency scaling (``rope_type: llama3``): long wavelengths divided by
    ``factor``, short ones kept, a smooth blend between (:func:`mtp_jax.layers.llama3_frequencies`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


ModelConfig = Any
"""A registered target's parsed config (each family's frozen dataclass, in its folder:
``mtp_jax.targets.deepseek_v3.config.DeepseekV3Config``, ``mtp_jax.targets.llama.config.Llama3Config``,
...)."""


def refuse_wrapped(raw: Mapping[str, Any]) -> None:
    if "text_config" in raw:
        raise ConfigError(
            "config.json wraps the language model in 'text_config' (a multimodal checkpoint such as "
            "Kimi-K2.5); this is not supported yet"
        )


def parse_config(raw: Mapping[str, Any]) -> ModelConfig:
    """The config dataclass of ``raw`` (a parsed config.json), chosen by its ``model_type`` (the
    registered targets': :func:`register_model_type`)."""
    refuse_wrapped(raw)
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


def get_field(raw: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
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


def positive_field(raw: Mapping[str, Any], key: str, default: Any = ...) -> int:
    value = get_field(raw, key, int, default)
    if value is not None and value <= 0:
        raise ConfigError(f"config field '{key}' must be a positive integer, got {value}")
    return value


def parse_eos(raw: Mapping[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(
            f"config field 'eos_token_id' must be a non-negative int or a list of them, got {eos!r}"
        )
    return tuple(ids)


def rope_settings(raw: Mapping[str, Any]) -> tuple[float, Mapping[str, Any] | None]:
    """(rope_theta, the scaling object or None) from either spelling: top-level ``rope_theta`` and
    ``rope_scaling`` (hub repos), or ``rope_parameters`` (checkpoints saved by transformers >= 5)."""
    params = raw.get("rope_parameters")
    if params is not None and not isinstance(params, Mapping):
        raise ConfigError(f"config field 'rope_parameters' must be an object, got {params!r}")
    theta = get_field(raw, "rope_theta", float, None)
    if theta is None:
        theta = get_field(params or {}, "rope_theta", float, 10000.0)
    scaling = raw.get("rope_scaling")
    if scaling is None and params is not None:
        scaling = params
    if scaling is not None and not isinstance(scaling, Mapping):
        raise ConfigError(f"config field 'rope_scaling' must be an object or null, got {scaling!r}")
    return theta, scaling


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


def check_special_tokens(cfg: ModelConfig) -> None:
    for tok in cfg.eos_token_ids + ((cfg.bos_token_id,) if cfg.bos_token_id is not None else ()):
        if tok >= cfg.vocab_size:
            raise ConfigError(
                f"special token id {tok} is outside the vocabulary (vocab_size {cfg.vocab_size})"
            )


def check_draft_layers(raw: Mapping[str, Any], kind: str) -> None:
    """A draft's decoder layers: no biases, SiLU."""
    for flag in ("attention_bias", "mlp_bias"):
        if get_field(raw, flag, bool, False):
            raise ConfigError(f"{flag}=true is not supported ({kind} draft projections have no bias)")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported ({kind} drafts use 'silu')")


def check_layer_ids(ids: Any, name: str) -> None:
    """None, or a non-empty list of non-negative layer ids."""
    if ids is not None and (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
    ):
        raise ConfigError(f"{name} must be a non-empty list of non-negative layer ids, got {ids!r}")


def gqa_heads(raw: Mapping[str, Any], hidden: int, heads: int) -> tuple[int, int]:
    """(num_key_value_heads, head_dim) of a rotary GQA attention, checked."""
    kv_heads = positive_field(raw, "num_key_value_heads", heads)
    head_dim = positive_field(raw, "head_dim", None) or (hidden // heads if hidden % heads == 0 else None)
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


def describe_capture(capture: tuple[int, ...]) -> str:
    """Words for captured layers: 'outputs of layers 1, 15, 28' or 'the embedding, ...'."""
    parts = ["the embedding" if i == -1 else f"layer {i}" for i in capture]
    return "outputs of " + ", ".join(parts) + " (0-based)"


_PARSERS: dict[str, Callable[[Mapping[str, Any]], Any]] = {}
"""model_type -> parser, filled by the targets' registrations (:mod:`mtp_jax.builtin`)."""


_BUILT_IN_TYPES: set[str] = set()
