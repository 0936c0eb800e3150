"""config.json parsing: the real DeepSeek-V3 and Kimi-K2 configs, derived values, and every refusal."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re

import pytest

from mtp_jax.config import YarnRopeScaling
from mtp_jax.errors import ConfigError, MtpJaxError
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config, QuantizationConfig
from tests.conftest import DEEPSEEK_V3_CONFIG

# moonshotai/Kimi-K2 (same architecture under its own model_type; one group, one dense layer, no MTP).
KIMI_K2_CONFIG = {
    **copy.deepcopy(DEEPSEEK_V3_CONFIG),
    "model_type": "kimi_k2",
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 131072,
    "n_group": 1,
    "topk_group": 1,
    "n_routed_experts": 384,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "vocab_size": 163840,
}


def v3() -> dict:
    return copy.deepcopy(DEEPSEEK_V3_CONFIG)


# --- the real configs --------------------------------------------------------------------------


def test_deepseek_v3_real_config_parses():
    cfg = DeepseekV3Config.from_dict(v3())
    assert cfg.model_type == "deepseek_v3"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.moe_intermediate_size) == (
        129280,
        7168,
        18432,
        2048,
    )
    assert (cfg.num_hidden_layers, cfg.num_attention_heads) == (61, 128)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank) == (1536, 512)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (128, 64, 128)
    assert (cfg.n_routed_experts, cfg.n_shared_experts, cfg.num_experts_per_tok) == (256, 1, 8)
    assert (cfg.n_group, cfg.topk_group, cfg.first_k_dense_replace) == (8, 4, 3)
    assert cfg.norm_topk_prob is True
    assert cfg.routed_scaling_factor == 2.5
    assert cfg.rms_norm_eps == 1e-6
    assert cfg.rope_theta == 10000.0 and isinstance(cfg.rope_theta, float)
    assert cfg.max_position_embeddings == 163840
    assert cfg.num_nextn_predict_layers == 1
    assert cfg.tie_word_embeddings is False
    assert cfg.bos_token_id == 0
    assert cfg.eos_token_ids == (1,)
    assert cfg.rope_scaling == YarnRopeScaling(
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    assert cfg.quantization_config == QuantizationConfig(
        quant_method="fp8", fmt="e4m3", weight_block_size=(128, 128), activation_scheme="dynamic"
    )


def test_deepseek_v3_derived_values():
    cfg = DeepseekV3Config.from_dict(v3())
    assert cfg.qk_head_dim == 192
    assert cfg.num_dense_layers == 3
    assert cfg.num_moe_layers == 58
    # YaRN attention temperature for factor 40, mscale_all_dim 1: (0.1*ln 40 + 1)^2 on top of 192^-0.5.
    expected = 192**-0.5 * (0.1 * 1.0 * math.log(40.0) + 1.0) ** 2
    assert cfg.softmax_scale == pytest.approx(expected, rel=1e-12)
    assert cfg.softmax_scale != pytest.approx(192**-0.5, rel=1e-3)  # the YaRN factor really applies


def test_softmax_scale_without_rope_scaling_and_with_mscale_all_dim_zero():
    raw = v3()
    raw["rope_scaling"] = None
    assert DeepseekV3Config.from_dict(raw).softmax_scale == pytest.approx(192**-0.5, rel=1e-12)
    raw = v3()
    raw["rope_scaling"]["mscale_all_dim"] = 0.0
    assert DeepseekV3Config.from_dict(raw).softmax_scale == pytest.approx(192**-0.5, rel=1e-12)
    raw = v3()
    raw["rope_scaling"]["mscale_all_dim"] = 0.7
    expected = 192**-0.5 * (0.1 * 0.7 * math.log(40.0) + 1.0) ** 2
    assert DeepseekV3Config.from_dict(raw).softmax_scale == pytest.approx(expected, rel=1e-12)


def test_kimi_k2_config_parses():
    cfg = DeepseekV3Config.from_dict(copy.deepcopy(KIMI_K2_CONFIG))
    assert cfg.model_type == "kimi_k2"
    assert cfg.num_attention_heads == 64
    assert cfg.n_routed_experts == 384
    assert (cfg.n_group, cfg.topk_group) == (1, 1)
    assert cfg.first_k_dense_replace == 1
    assert (cfg.num_dense_layers, cfg.num_moe_layers) == (1, 60)
    assert cfg.vocab_size == 163840
    assert cfg.num_nextn_predict_layers == 0
    assert cfg.eos_token_ids == (163585,)
    assert cfg.rope_theta == 50000.0
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 32.0


def test_optional_fields_take_defaults():
    raw = v3()
    for key in ("rope_scaling", "quantization_config", "num_nextn_predict_layers", "eos_token_id"):
        del raw[key]
    raw["q_lora_rank"] = None  # DeepSeek-V2-Lite style: a plain q_proj
    cfg = DeepseekV3Config.from_dict(raw)
    assert cfg.rope_scaling is None
    assert cfg.quantization_config is None
    assert cfg.num_nextn_predict_layers == 0
    assert cfg.eos_token_ids == ()
    assert cfg.q_lora_rank is None


def test_eos_token_id_list():
    raw = v3()
    raw["eos_token_id"] = [1, 7]
    assert DeepseekV3Config.from_dict(raw).eos_token_ids == (1, 7)


# --- files -------------------------------------------------------------------------------------


def test_from_json_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(KIMI_K2_CONFIG, indent=2), encoding="utf-8")
    assert DeepseekV3Config.from_json_file(path) == DeepseekV3Config.from_dict(KIMI_K2_CONFIG)
    assert DeepseekV3Config.from_json_file(str(path)).model_type == "kimi_k2"


def test_from_json_file_missing(tmp_path):
    path = tmp_path / "nowhere" / "config.json"
    with pytest.raises(FileNotFoundError, match=re.escape(str(path))):
        DeepseekV3Config.from_json_file(path)


@pytest.mark.parametrize("text", ["{not json", '{"model_type": "deepseek_v3",}', "", "\xff\xfe"])
def test_from_json_file_invalid_json(tmp_path, text):
    path = tmp_path / "config.json"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match=re.escape(str(path))):
        DeepseekV3Config.from_json_file(path)


def test_from_json_file_not_an_object(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[1, 2, 3]")
    with pytest.raises(ValueError, match="JSON object"):
        DeepseekV3Config.from_json_file(path)


# --- refusals ----------------------------------------------------------------------------------


_DELETE = object()


def _with(**changes) -> dict:
    raw = v3()
    for key, value in changes.items():
        if value is _DELETE:
            del raw[key]
        else:
            raw[key] = value
    return raw


def _rope(**changes) -> dict:
    rs = dict(DEEPSEEK_V3_CONFIG["rope_scaling"])
    for key, value in changes.items():
        if value is _DELETE:
            del rs[key]
        else:
            rs[key] = value
    return _with(rope_scaling=rs)


REFUSALS = {
    "model_type_llama": (_with(model_type="llama"), ["llama"]),
    "model_type_missing": (_with(model_type=_DELETE), ["model_type"]),
    "missing_hidden_size": (_with(hidden_size=_DELETE), ["hidden_size"]),
    "missing_vocab_size": (_with(vocab_size=_DELETE), ["vocab_size"]),
    "missing_kv_lora_rank": (_with(kv_lora_rank=_DELETE), ["kv_lora_rank"]),
    "missing_num_attention_heads": (_with(num_attention_heads=_DELETE), ["num_attention_heads"]),
    "hidden_size_string": (_with(hidden_size="64"), ["hidden_size", "'64'"]),
    "hidden_size_float": (_with(hidden_size=7168.0), ["hidden_size"]),
    "hidden_size_bool": (_with(hidden_size=True), ["hidden_size", "True"]),
    "n_shared_experts_bool": (_with(n_shared_experts=True), ["n_shared_experts"]),
    "norm_topk_prob_string": (_with(norm_topk_prob="true"), ["norm_topk_prob"]),
    "rope_theta_string": (_with(rope_theta="10000"), ["rope_theta"]),
    "hidden_size_zero": (_with(hidden_size=0), ["hidden_size"]),
    "vocab_size_negative": (_with(vocab_size=-5), ["vocab_size"]),
    "experts_not_divisible": (_with(n_group=7), ["n_routed_experts", "256", "n_group", "7"]),
    "topk_group_above_n_group": (_with(topk_group=9), ["topk_group", "9", "n_group"]),
    "experts_per_tok_too_large": (
        _with(topk_group=1, num_experts_per_tok=33),
        ["num_experts_per_tok", "33", "topk_group"],
    ),
    "kv_heads_differ": (_with(num_key_value_heads=8), ["num_key_value_heads", "8", "128"]),
    "odd_rope_dim": (_with(qk_rope_head_dim=63), ["qk_rope_head_dim", "63"]),
    "first_k_dense_above_layers": (_with(first_k_dense_replace=62), ["first_k_dense_replace", "62"]),
    "first_k_dense_negative": (_with(first_k_dense_replace=-1), ["first_k_dense_replace"]),
    "rope_scaling_linear": (_rope(type="linear"), ["rope_scaling", "linear"]),
    "rope_scaling_not_object": (_with(rope_scaling="yarn"), ["rope_scaling"]),
    "yarn_missing_factor": (_rope(factor=_DELETE), ["factor"]),
    "yarn_factor_below_one": (_rope(factor=0.5), ["factor", "0.5"]),
    "yarn_missing_original_max": (
        _rope(original_max_position_embeddings=_DELETE),
        ["original_max_position_embeddings"],
    ),
    "quant_compressed_tensors": (
        _with(quantization_config={"quant_method": "compressed-tensors", "config_groups": {}}),
        ["compressed-tensors", "not supported", "INT4", "Kimi-K2.5"],
    ),
    "quant_fmt_e5m2": (
        _with(quantization_config={**DEEPSEEK_V3_CONFIG["quantization_config"], "fmt": "e5m2"}),
        ["e5m2"],
    ),
    "quant_block_size_bad": (
        _with(quantization_config={**DEEPSEEK_V3_CONFIG["quantization_config"], "weight_block_size": [128]}),
        ["weight_block_size"],
    ),
    "text_config_wrapper": (
        {"model_type": "kimi_k25", "text_config": copy.deepcopy(KIMI_K2_CONFIG)},
        ["text_config"],
    ),
    "scoring_softmax": (_with(scoring_func="softmax"), ["scoring_func", "softmax"]),
    "topk_method_greedy": (_with(topk_method="greedy"), ["topk_method", "greedy"]),
    "hidden_act_gelu": (_with(hidden_act="gelu"), ["hidden_act", "gelu"]),
    "attention_bias": (_with(attention_bias=True), ["attention_bias"]),
    "eos_at_vocab": (_with(eos_token_id=129280), ["129280", "vocab"]),
    "eos_in_list_beyond_vocab": (_with(eos_token_id=[1, 200000]), ["200000", "vocab"]),
    "eos_negative": (_with(eos_token_id=-1), ["eos_token_id"]),
    "eos_bool": (_with(eos_token_id=True), ["eos_token_id"]),
    "bos_beyond_vocab": (_with(bos_token_id=129280), ["129280"]),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusal_names_the_culprit(case):
    raw, needles = REFUSALS[case]
    with pytest.raises(ConfigError) as info:
        DeepseekV3Config.from_dict(raw)
    assert isinstance(info.value, ValueError) and isinstance(info.value, MtpJaxError)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def test_refusal_cases_differ_from_a_valid_config_in_one_place_only():
    # Guards the table above: every _with()/_rope() case starts from the real config, which parses.
    DeepseekV3Config.from_dict(v3())
    DeepseekV3Config.from_dict(_with())
    DeepseekV3Config.from_dict(_rope())


def test_moe_layer_freq_other_than_one_is_refused():
    with pytest.raises(ConfigError, match="moe_layer_freq"):
        DeepseekV3Config.from_dict(_with(moe_layer_freq=2))


# --- frozen and hashable (jit static args) ---------------------------------------------------------


def test_config_is_frozen():
    cfg = DeepseekV3Config.from_dict(v3())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rope_scaling.factor = 2.0  # type: ignore[union-attr,misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.quantization_config.fmt = "e5m2"  # type: ignore[union-attr,misc]


def test_config_is_hashable_and_equal_dicts_hash_equal():
    a = DeepseekV3Config.from_dict(v3())
    b = DeepseekV3Config.from_dict(json.loads(json.dumps(DEEPSEEK_V3_CONFIG)))
    assert a is not b
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    c = DeepseekV3Config.from_dict(_with(num_hidden_layers=60))
    assert c != a
    assert len({a, b, c}) == 2
    # int vs float spellings of the same float field give the same config.
    d = DeepseekV3Config.from_dict(_with(rope_theta=10000.0, routed_scaling_factor=2.5))
    assert d == a and hash(d) == hash(a)


def test_config_works_as_a_jit_static_arg():
    import jax
    import jax.numpy as jnp

    traces = []

    def f(x, cfg):
        traces.append(cfg)
        return x * cfg.qk_head_dim

    jf = jax.jit(f, static_argnames=("cfg",))
    a = DeepseekV3Config.from_dict(v3())
    b = DeepseekV3Config.from_dict(v3())
    assert float(jf(jnp.float32(1.0), cfg=a)) == 192.0
    assert float(jf(jnp.float32(1.0), cfg=b)) == 192.0
    assert len(traces) == 1  # an equal config hits the cache
    k = DeepseekV3Config.from_dict(copy.deepcopy(KIMI_K2_CONFIG))
    jf(jnp.float32(1.0), cfg=k)
    assert len(traces) == 2
