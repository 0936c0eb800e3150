"""Parameters -> hub tensors is the exact inverse of loading."""

from __future__ import annotations

import numpy as np
import pytest

import mtp_jax
from mtp_jax.export import hub_tensors_from_params
from mtp_jax.synthetic import quantize_fp8
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
from mtp_jax.targets.deepseek_v3.synthetic import hub_tensors
from tests.conftest import TINY_CONFIG


@pytest.mark.parametrize(
    "overrides",
    [{}, {"q_lora_rank": None, "tie_word_embeddings": True, "first_k_dense_replace": 0}],
    ids=["mtp", "no-q-lora-tied"],
)
def test_round_trip_is_bit_exact(make_checkpoint, overrides):
    config = {**TINY_CONFIG, **overrides}
    cfg = DeepseekV3Config.from_dict(config)
    tensors = hub_tensors(cfg, seed=3)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    model = mtp_jax.load(make_checkpoint(config, tensors=tensors), "float32", strict=True)
    back = hub_tensors_from_params(model.params, cfg)
    assert sorted(back) == sorted(tensors)
    for name, want in tensors.items():
        assert back[name].dtype == want.dtype and np.array_equal(back[name], want), name


def test_bf16_export_keeps_routers_in_float32(make_checkpoint):
    import ml_dtypes

    cfg = DeepseekV3Config.from_dict(TINY_CONFIG)
    model = mtp_jax.load(make_checkpoint(TINY_CONFIG, tensors=hub_tensors(cfg)), "float32")
    back = hub_tensors_from_params(model.params, cfg, ml_dtypes.bfloat16)
    assert back["model.layers.1.mlp.gate.weight"].dtype == np.float32
    assert back["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == np.float32
    assert back["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == ml_dtypes.bfloat16


def test_fp8_weights_are_refused(make_checkpoint):
    config = {**TINY_CONFIG, "quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}}
    cfg = DeepseekV3Config.from_dict(config)
    path = make_checkpoint(config, tensors=quantize_fp8(hub_tensors(cfg), (16, 16)))
    model = mtp_jax.load(path, "float32", weights="fp8")
    with pytest.raises(ValueError, match="FP8"):
        hub_tensors_from_params(model.params, cfg)


@pytest.mark.parametrize("name", ["llama3_gqa42", "gqa81_tied_head_dim"])
def test_llama_round_trip_is_bit_exact(name):
    import os

    from mtp_jax.checkpoint.safetensors_io import CheckpointReader
    from tests.conftest import REPO

    path = os.path.join(REPO, "tests", "fixtures", "parity_llama", name)
    model = mtp_jax.load(path, "float32", strict=True)
    reader = CheckpointReader(path)
    back = hub_tensors_from_params(model.params, model.config)
    assert sorted(back) == sorted(reader.keys())  # a tied model writes no lm_head.weight
    for key in reader.keys():
        want = reader.get(key)
        assert back[key].dtype == want.dtype and np.array_equal(back[key], want), key
