"""mtp_jax.load on hub-layout DeepSeek-V3 checkpoints: tensor checks, dtypes, sharding, tying, EOS."""

from __future__ import annotations

import copy
import json
import logging
import os
import re

import jax
import ml_dtypes
import numpy as np
import pytest

import mtp_jax
from mtp_jax.checkpoint.safetensors_io import SafetensorsFile, write_hub_checkpoint
from mtp_jax.errors import CheckpointError, CheckpointNotFoundError, ConfigError
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
from mtp_jax.targets.deepseek_v3.synthetic import hub_tensors
from tests.conftest import TINY_CONFIG

LOGGER = "mtp_jax.targets.deepseek_v3.checkpoint"
TOKENS = np.random.default_rng(42).integers(0, TINY_CONFIG["vocab_size"], (2, 9)).astype(np.int32)


def _tensors(config: dict | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    return hub_tensors(DeepseekV3Config.from_dict(TINY_CONFIG if config is None else config), seed=seed)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(tensors, float32 logits) of the default tiny checkpoint, computed once."""
    tensors = _tensors()
    path = str(tmp_path_factory.mktemp("ref") / "ckpt")
    write_hub_checkpoint(path, TINY_CONFIG, tensors)
    return tensors, mtp_jax.load(path, dtype="float32").logits(TOKENS)


def _replace(tensors: dict, key: str, value: np.ndarray) -> dict:
    assert key in tensors, key
    out = dict(tensors)
    out[key] = value
    return out


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


# --- the parameter pytree is the checkpoint, laid out as documented ------------------------------------


def test_params_map_hub_tensors(make_checkpoint, reference):
    tensors, ref_logits = reference
    model = mtp_jax.load(make_checkpoint(tensors=tensors), dtype="float32")
    p = jax.tree_util.tree_map(np.asarray, model.params)
    np.testing.assert_array_equal(p["embed"], tensors["model.embed_tokens.weight"])
    np.testing.assert_array_equal(p["lm_head"], tensors["lm_head.weight"].T)
    np.testing.assert_array_equal(p["final_norm"], tensors["model.norm.weight"])
    # dense stack = layer 0; MoE stack = layers 1, 2 (first_k_dense_replace 1)
    assert p["dense"]["input_norm"].shape[0] == 1 and p["moe"]["input_norm"].shape[0] == 2
    np.testing.assert_array_equal(
        p["dense"]["mlp"]["down"][0], tensors["model.layers.0.mlp.down_proj.weight"].T
    )
    np.testing.assert_array_equal(p["moe"]["mlp"]["router"][1], tensors["model.layers.2.mlp.gate.weight"].T)
    np.testing.assert_array_equal(
        p["moe"]["mlp"]["bias"][0], tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    )
    np.testing.assert_array_equal(
        p["moe"]["mlp"]["up"][1, 5], tensors["model.layers.2.mlp.experts.5.up_proj.weight"].T
    )
    np.testing.assert_array_equal(model.logits(TOKENS), ref_logits)


# --- missing / malformed tensors --------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.self_attn.q_a_layernorm.weight",
        "model.layers.1.mlp.experts.7.down_proj.weight",
        "model.layers.2.mlp.gate.e_score_correction_bias",
        "model.layers.2.mlp.shared_experts.up_proj.weight",
        "model.layers.2.self_attn.kv_b_proj.weight",
    ],
)
def test_missing_tensor_is_named(make_checkpoint, reference, key):
    tensors = dict(reference[0])
    del tensors[key]
    path = make_checkpoint(tensors=tensors)
    with pytest.raises(CheckpointError) as info:
        mtp_jax.load(path, dtype="float32")
    message = str(info.value)
    assert f"'{key}'" in message
    assert "missing" in message


@pytest.mark.parametrize(
    ("key", "shape", "expected"),
    [
        ("model.layers.0.self_attn.o_proj.weight", (18, 32), (32, 18)),  # transposed [in, out]
        ("model.layers.1.mlp.experts.3.gate_proj.weight", (17, 32), (16, 32)),
        ("model.embed_tokens.weight", (96, 32), (97, 32)),
        ("model.layers.2.mlp.gate.e_score_correction_bias", (8, 1), (8,)),
    ],
)
def test_wrong_shape_names_key_and_both_shapes(make_checkpoint, reference, key, shape, expected):
    tensors = _replace(reference[0], key, np.zeros(shape, np.float32))
    with pytest.raises(CheckpointError) as info:
        mtp_jax.load(make_checkpoint(tensors=tensors), dtype="float32")
    message = str(info.value)
    assert f"'{key}'" in message
    assert str(list(shape)) in message
    assert str(list(expected)) in message


def test_fp8_weight_without_quantization_config_is_refused(make_checkpoint, reference):
    key = "model.layers.1.mlp.experts.0.up_proj.weight"
    tensors = _replace(reference[0], key, reference[0][key].astype(ml_dtypes.float8_e4m3fn))
    with pytest.raises(CheckpointError) as info:
        mtp_jax.load(make_checkpoint(tensors=tensors), dtype="float32")
    message = str(info.value)
    assert f"'{key}'" in message
    assert "float8_e4m3fn" in message and "quantization_config" in message


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.bool_, np.uint8])
def test_non_float_weight_is_refused(make_checkpoint, reference, dtype):
    key = "model.layers.0.self_attn.q_b_proj.weight"
    tensors = _replace(reference[0], key, np.ones(reference[0][key].shape, dtype))
    with pytest.raises(CheckpointError) as info:
        mtp_jax.load(make_checkpoint(tensors=tensors), dtype="float32")
    assert f"'{key}'" in str(info.value)
    assert np.dtype(dtype).name in str(info.value)


# --- unexpected tensors --------------------------------------------------------------------------


def test_unexpected_tensor_warns_and_loads(make_checkpoint, reference, caplog):
    tensors, ref_logits = reference
    extra = {**tensors, "model.rotary_emb.inv_freq": np.ones(2, np.float32)}
    caplog.set_level(logging.WARNING, logger=LOGGER)
    model = mtp_jax.load(make_checkpoint(tensors=extra), dtype="float32")
    warnings = _warnings(caplog)
    assert len(warnings) == 1
    assert "model.rotary_emb.inv_freq" in warnings[0]
    np.testing.assert_array_equal(model.logits(TOKENS), ref_logits)


def test_unused_tensor_of_a_target_layer_warns(make_checkpoint, reference, caplog):
    # q_lora is on, so a plain q_proj inside a target layer is unexpected (not an MTP tensor).
    key = "model.layers.2.self_attn.q_proj.weight"
    extra = {**reference[0], key: np.ones((3, 32), np.float32)}
    caplog.set_level(logging.WARNING, logger=LOGGER)
    mtp_jax.load(make_checkpoint(tensors=extra), dtype="float32")
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and key in warnings[0]


def test_mtp_layer_tensors_do_not_warn(make_checkpoint, reference, caplog):
    tensors = reference[0]
    n = TINY_CONFIG["num_hidden_layers"]
    mtp_keys = [k for k in tensors if k.startswith(f"model.layers.{n}.")]
    # The fixture really carries a full MTP layer, so silence here means the exemption works.
    assert f"model.layers.{n}.eh_proj.weight" in mtp_keys
    assert f"model.layers.{n}.mlp.experts.0.up_proj.weight" in mtp_keys
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    mtp_jax.load(make_checkpoint(tensors=tensors), dtype="float32")
    assert _warnings(caplog) == []


# --- dtypes of the stored tensors ---------------------------------------------------------------------


def test_bf16_checkpoint_equals_float32_checkpoint_of_rounded_values(make_checkpoint, reference):
    tensors, ref_logits = reference
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    rounded = {k: v.astype(np.float32) for k, v in bf16.items()}
    bf16_dir = make_checkpoint(tensors=bf16, name="bf16")
    stored = SafetensorsFile(os.path.join(bf16_dir, "model.safetensors"))
    assert {stored.dtype(k) for k in stored.keys()} == {np.dtype(ml_dtypes.bfloat16)}
    m_bf16 = mtp_jax.load(bf16_dir, dtype="float32")
    m_rounded = mtp_jax.load(make_checkpoint(tensors=rounded, name="rounded"), dtype="float32")
    assert m_bf16.params["embed"].dtype == np.float32
    jax.tree_util.tree_map(np.testing.assert_array_equal, m_bf16.params, m_rounded.params)
    logits = m_bf16.logits(TOKENS)
    np.testing.assert_array_equal(logits, m_rounded.logits(TOKENS))
    # The rounding did change the model, so the equality above is not trivially true.
    assert not np.array_equal(logits, ref_logits)


def test_fp16_checkpoint_loads(make_checkpoint, reference):
    tensors = reference[0]
    fp16 = {k: v.astype(np.float16) for k, v in tensors.items()}
    rounded = {k: v.astype(np.float32) for k, v in fp16.items()}
    a = mtp_jax.load(make_checkpoint(tensors=fp16, name="fp16"), dtype="float32").logits(TOKENS)
    b = mtp_jax.load(make_checkpoint(tensors=rounded, name="rounded"), dtype="float32").logits(TOKENS)
    np.testing.assert_array_equal(a, b)


# --- layouts ----------------------------------------------------------------------------------------


def test_sharded_and_single_file_give_identical_logits(make_checkpoint, reference):
    tensors, ref_logits = reference
    sharded = make_checkpoint(tensors=tensors, shards=3, name="sharded")
    files = sorted(n for n in os.listdir(sharded) if n.endswith(".safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    logits = mtp_jax.load(sharded, dtype="float32").logits(TOKENS)
    np.testing.assert_array_equal(logits, ref_logits)


def test_different_weights_give_different_logits(make_checkpoint, reference):
    # Sanity for the equality tests in this file: logits do depend on the checkpoint.
    other = mtp_jax.load(make_checkpoint(tensors=_tensors(seed=1)), dtype="float32").logits(TOKENS)
    assert not np.allclose(other, reference[1], atol=1e-3)


def test_tied_embeddings_use_embed_transpose(make_checkpoint, tiny_config):
    tiny_config["tie_word_embeddings"] = True
    tensors = _tensors(tiny_config)
    assert "lm_head.weight" not in tensors
    path = make_checkpoint(tiny_config, tensors=tensors)
    model = mtp_jax.load(path, dtype="float32")
    embed = tensors["model.embed_tokens.weight"]
    np.testing.assert_array_equal(np.asarray(model.params["lm_head"]), embed.T)
    hidden = model.hidden_states(TOKENS).post_norm
    expected = np.einsum("btd,vd->btv", hidden.astype(np.float64), embed.astype(np.float64))
    np.testing.assert_allclose(model.logits(TOKENS), expected, rtol=1e-4, atol=1e-4)


def test_untied_without_lm_head_is_an_error(make_checkpoint, reference):
    tensors = dict(reference[0])
    del tensors["lm_head.weight"]
    with pytest.raises(CheckpointError, match="'lm_head.weight'"):
        mtp_jax.load(make_checkpoint(tensors=tensors), dtype="float32")


# --- the dtype argument ------------------------------------------------------------------------------


def test_bfloat16_load_keeps_router_and_bias_float32(make_checkpoint, reference):
    tensors, ref_logits = reference
    model = mtp_jax.load(make_checkpoint(tensors=tensors), dtype="bfloat16")
    mlp = model.params["moe"]["mlp"]
    assert mlp["router"].dtype == np.float32
    assert mlp["bias"].dtype == np.float32
    np.testing.assert_array_equal(
        np.asarray(mlp["bias"][1]), tensors["model.layers.2.mlp.gate.e_score_correction_bias"]
    )
    assert mlp["up"].dtype == ml_dtypes.bfloat16
    assert mlp["shared_down"].dtype == ml_dtypes.bfloat16
    leaves = jax.tree_util.tree_leaves_with_path(model.params)
    assert len(leaves) > 20
    for path, leaf in leaves:
        last = path[-1].key
        want = np.float32 if last in ("router", "bias") else ml_dtypes.bfloat16
        assert leaf.dtype == want, (jax.tree_util.keystr(path), leaf.dtype)
    logits = model.logits(TOKENS)
    assert logits.dtype == np.float32
    err = np.abs(logits - ref_logits).max()
    assert err < 0.05 * np.abs(ref_logits).max()
    assert err > 0  # bf16 really ran
    assert np.corrcoef(logits.ravel(), ref_logits.ravel())[0, 1] > 0.999


@pytest.mark.parametrize("dtype", ["float16", "fp32", "bf16", "float64"])
def test_unknown_dtype_is_refused(make_checkpoint, dtype):
    path = make_checkpoint()
    with pytest.raises(ValueError, match=re.escape(repr(dtype))):
        mtp_jax.load(path, dtype=dtype)


# --- directories, config.json, generation_config.json -----------------------------------------------


def test_missing_directory(tmp_path):
    path = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=re.escape(str(path))) as info:
        mtp_jax.load(path)
    assert isinstance(info.value, CheckpointNotFoundError)


def test_directory_without_config_json(make_checkpoint):
    path = make_checkpoint()
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(FileNotFoundError, match=re.escape(os.path.join(path, "config.json"))):
        mtp_jax.load(path, dtype="float32")


def test_directory_without_safetensors(tmp_path, tiny_config):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        mtp_jax.load(tmp_path, dtype="float32")


def test_bad_config_is_a_config_error(make_checkpoint, tiny_config):
    path = make_checkpoint()
    bad = copy.deepcopy(tiny_config)
    bad["model_type"] = "mistral"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(bad, f)
    with pytest.raises(ConfigError, match="unsupported model_type 'mistral'"):
        mtp_jax.load(path, dtype="float32")


def _with_generation_config(path: str, gen: dict) -> str:
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(gen, f)
    return path


def test_eos_from_config_json_without_generation_config(make_checkpoint):
    assert mtp_jax.load(make_checkpoint(), dtype="float32").eos_token_ids == (1,)


@pytest.mark.parametrize(("eos", "expected"), [(7, (7,)), ([5, 9], (5, 9)), ([96], (96,))])
def test_generation_config_eos_overrides_config(make_checkpoint, eos, expected):
    path = _with_generation_config(make_checkpoint(), {"bos_token_id": 0, "eos_token_id": eos})
    model = mtp_jax.load(path, dtype="float32")
    assert model.eos_token_ids == expected
    assert model.config.eos_token_ids == (1,)  # config.json's own value is untouched


@pytest.mark.parametrize("gen", [{"do_sample": True}, {"eos_token_id": None}])
def test_generation_config_without_eos_falls_back(make_checkpoint, gen):
    path = _with_generation_config(make_checkpoint(), gen)
    assert mtp_jax.load(path, dtype="float32").eos_token_ids == (1,)


@pytest.mark.parametrize("eos", [97, [1, 500], -1, "2", 1.0])
def test_generation_config_bad_eos(make_checkpoint, eos):
    path = _with_generation_config(make_checkpoint(), {"eos_token_id": eos})
    with pytest.raises(ConfigError, match="generation_config.json"):
        mtp_jax.load(path, dtype="float32")


def test_generation_config_invalid_json(make_checkpoint):
    path = make_checkpoint()
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        f.write("{oops")
    with pytest.raises(ValueError, match="generation_config.json"):
        mtp_jax.load(path, dtype="float32")


def test_generation_config_bool_eos_refused(make_checkpoint):
    path = _with_generation_config(make_checkpoint(), {"eos_token_id": True})
    with pytest.raises(ConfigError, match="eos_token_id"):
        mtp_jax.load(path, dtype="float32")
