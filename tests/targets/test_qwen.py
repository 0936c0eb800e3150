"""Qwen2 and Qwen3 targets (their own modules, one registration each): parity with transformers'
Qwen2ForCausalLM / Qwen3ForCausalLM on committed hub-layout fixtures
(scripts/make_llama_parity_fixtures.py; the parity tests are tests/targets/test_llama3.py's, over
the whole family), every draft lossless on them, the tools that derive from the declared layer tree
(plan, estimate, export, shardings), and the refusals."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax.checkpoint.safetensors_io import CheckpointReader, save_safetensors
from tests.conftest import REPO, check_lossless
from tests.targets.test_llama3 import _copy, _edit_config

FIXTURES = os.path.join(REPO, "tests", "fixtures", "parity_llama")
NAMES = ["qwen2_bias_tied", "qwen3_qk_norm"]
PROMPTS = [[5, 9, 17, 3], [40, 2, 2, 7, 91, 13, 13, 60, 1, 77, 5], [100], [8, 8, 8, 8, 8, 8, 8]]


@pytest.fixture(scope="module")
def fixtures():
    """name -> (model, transformers' reference); parity itself is tests/targets/test_llama3.py's."""
    return {
        name: (mtp_jax.load(os.path.join(FIXTURES, name), "float32", strict=True), None) for name in NAMES
    }


def test_each_family_is_its_own_target_with_its_own_extras(fixtures):
    from mtp_jax.targets import target_for
    from mtp_jax.targets.llama.config import Qwen2Config, Qwen3Config

    qwen2, _ = fixtures["qwen2_bias_tied"]
    qwen3, _ = fixtures["qwen3_qk_norm"]
    assert isinstance(qwen2.config, Qwen2Config) and target_for(qwen2.config).name == "qwen2"
    assert isinstance(qwen3.config, Qwen3Config) and target_for(qwen3.config).name == "qwen3"
    assert set(qwen2.params["layers"]["attn"]) == {"q", "k", "v", "o", "q_bias", "k_bias", "v_bias"}
    assert qwen2.params["layers"]["attn"]["k_bias"].shape == (3, 2, 8) and "lm_head" not in qwen2.params
    assert set(qwen3.params["layers"]["attn"]) == {"q", "k", "v", "o", "q_norm", "k_norm"}
    assert qwen3.params["layers"]["attn"]["q"].shape == (3, 32, 4, 16)  # explicit head_dim 16


@pytest.mark.parametrize("name", NAMES)
def test_every_draft_is_lossless(fixtures, name, tmp_path):
    from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint
    from mtp_jax.drafts.dflash.config import DFlashConfig
    from mtp_jax.drafts.dflash.synthetic import dflash_hub_tensors
    from tests.drafts.test_dflash import DRAFT_A as DFLASH
    from tests.drafts.test_eagle3 import DRAFT_A as EAGLE3
    from tests.drafts.test_eagle3 import draft_tensors

    model, _ = fixtures[name]
    plain = model.generate(PROMPTS, max_new_tokens=12, ignore_eos=True, max_batch=3).tokens
    ngram = check_lossless(model, "ngram", PROMPTS, (1, 4), plain, max_new_tokens=12)
    assert ngram[1].stats["acceptance_length"] > 1.0  # the n-gram draft accepts on the repeating prompt
    write_hub_checkpoint(tmp_path / "eagle3", EAGLE3, draft_tensors(EAGLE3))
    tensors = dflash_hub_tensors(DFlashConfig.from_dict(DFLASH), 2, seed=4, std=0.2)
    write_hub_checkpoint(tmp_path / "dflash", DFLASH, tensors)
    path = os.path.join(FIXTURES, name)
    for draft in ("eagle3", "dflash"):
        drafted = mtp_jax.load(path, "float32", strict=True, draft_model=str(tmp_path / draft))
        # random drafts made for the Llama fixtures: Qwen's verification is exercised with accepted
        # drafts by the n-gram check above; these check that foreign drafts plug in losslessly
        why = "a random draft of another target's fixtures"
        check_lossless(drafted, draft, PROMPTS, (1, 3), plain, max_new_tokens=12, unaccepted=why)


@pytest.mark.parametrize("name", NAMES)
def test_plan_estimate_and_export_follow_the_declared_tree(fixtures, name):
    from mtp_jax.estimate import count_parameters, weight_bytes
    from mtp_jax.export import hub_tensors_from_params
    from mtp_jax.plan import abstract_params
    from mtp_jax.sharding import make_mesh

    model, _ = fixtures[name]
    cfg = model.config
    reader = CheckpointReader(os.path.join(FIXTURES, name))
    stored = {k: np.asarray(reader.get(k), np.float32) for k in reader.keys()}
    back = hub_tensors_from_params(model.params, cfg)
    assert sorted(back) == sorted(stored)
    for key, x in stored.items():
        np.testing.assert_array_equal(back[key], x, err_msg=key)
    total = sum(x.size for x in stored.values())
    assert count_parameters(cfg).total == total and weight_bytes(cfg, "fp32") == {"float32": 4 * total}
    abstract = abstract_params(cfg, make_mesh(1, 1, devices=jax.devices()[:1]), jnp.float32, weights="bf16")
    assert jax.tree.structure(abstract) == jax.tree.structure(model.params)
    for a, r in zip(jax.tree.leaves(abstract), jax.tree.leaves(model.params), strict=True):
        assert (a.shape, a.dtype) == (r.shape, r.dtype)


def test_the_shardings_name_every_declared_leaf():
    """sharding.py's table of logical axes (it cannot import the targets) equals the declaration."""
    from mtp_jax.sharding import param_logical
    from mtp_jax.targets.llama.model import layer_leaves

    for leaf in layer_leaves(32, 4, 2, 8, 64, qkv_bias=True, qk_norm=True):
        assert param_logical("layers", leaf.path, len(leaf.shape)) == leaf.logical, leaf.path


@pytest.mark.parametrize(
    "name, changes, message",
    [
        (
            "qwen2_bias_tied",
            {"use_sliding_window": True, "max_window_layers": 1},
            r"sliding-window attention is not supported \(Qwen2 config: layers 1..2 attend through a window "
            "of 4096",
        ),
        (
            "qwen3_qk_norm",
            {"layer_types": ["full_attention", "sliding_attention", "full_attention"], "sliding_window": 64},
            r"sliding-window attention is not supported \(Qwen3 config: layers 1..1",
        ),
        ("qwen3_qk_norm", {"attention_bias": True}, "attention_bias=true is not supported"),
        ("qwen3_qk_norm", {"model_type": "qwen3_moe"}, "unsupported model_type 'qwen3_moe'.*qwen2, qwen3"),
        ("qwen2_bias_tied", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        (
            "qwen2_bias_tied",
            {"hidden_act": "gelu"},
            r"hidden_act 'gelu' is not supported \(Qwen2 uses 'silu'\)",
        ),
    ],
)
def test_unsupported_variants_are_refused_by_name(tmp_path, name, changes, message):
    path = _copy(tmp_path, name)
    _edit_config(path, **changes)
    with pytest.raises(mtp_jax.ConfigError, match=message):
        mtp_jax.load(path, "float32")


@pytest.mark.parametrize(
    "name, key",
    [
        ("qwen2_bias_tied", "model.layers.1.self_attn.k_proj.bias"),
        ("qwen3_qk_norm", "model.layers.2.self_attn.q_norm.weight"),
    ],
)
def test_a_missing_family_tensor_is_named(tmp_path, name, key):
    path = _copy(tmp_path, name)
    reader = CheckpointReader(str(path))
    tensors = {k: reader.get(k) for k in reader.keys() if k != key}
    save_safetensors(str(path / "model.safetensors"), tensors, {"format": "pt"})
    with pytest.raises(mtp_jax.CheckpointError, match=key.replace(".", r"\.")):
        mtp_jax.load(path, "float32")
