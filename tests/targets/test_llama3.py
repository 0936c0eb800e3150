"""Llama 3 target: parity with transformers' LlamaForCausalLM (and Qwen2/Qwen3ForCausalLM for the
family's other targets) on committed hub-layout fixtures
(scripts/make_llama_parity_fixtures.py), the paged decode path, and the errors a bad checkpoint
or request gets."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

import mtp_jax
from mtp_jax.checkpoint.safetensors_io import CheckpointReader, save_safetensors
from mtp_jax.config import Llama3RopeScaling
from mtp_jax.layers import llama3_frequencies
from mtp_jax.targets.llama.config import Llama3Config
from tests.conftest import REPO, greedy_reference

FIXTURES = os.path.join(REPO, "tests", "fixtures", "parity_llama")
NAMES = ["llama3_gqa42", "gqa81_tied_head_dim", "sharded_bf16_rope_parameters", "mha_fp16"]
NAMES += ["qwen2_bias_tied", "qwen3_qk_norm"]  # the Llama family's other targets (tests/targets/test_qwen.py)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def load_fixtures(root: str, names: list[str]) -> dict:
    """name -> (the float32 model of fixture ``root/name``, transformers' reference arrays)."""
    out = {}
    for name in names:
        path = os.path.join(root, name)
        out[name] = (
            mtp_jax.load(path, "float32", strict=True),
            dict(np.load(os.path.join(path, "reference.npz"))),
        )
    return out


@pytest.fixture(scope="module")
def fixtures():
    return load_fixtures(FIXTURES, NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_logits_and_hidden_states_match_transformers(fixtures, name):
    model, ref = fixtures[name]
    assert rel_err(model.logits(ref["input_ids"]), ref["logits"]) < 1e-5
    layers = model.config.num_hidden_layers
    hidden = model.hidden_states(ref["input_ids"], layers=range(layers - 1))
    # transformers' entry i+1 is the output of layer i, except the last entry, which is after the norm
    for i in range(layers - 1):
        assert rel_err(hidden.layers[i], ref["hidden_states"][i + 1]) < 1e-5, i
    assert rel_err(hidden.post_norm, ref["hidden_states"][layers]) < 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_equals_transformers(fixtures, name):
    """The paged cache, continuous batching and the unified step (K = 0) give transformers' tokens."""
    model, ref = fixtures[name]
    prompts, n, want = greedy_reference(ref)
    assert model.generate(prompts, max_new_tokens=n, ignore_eos=True).tokens == want


def test_tied_model_reads_the_embedding_as_its_head(fixtures):
    model, _ = fixtures["gqa81_tied_head_dim"]
    assert "lm_head" not in model.params  # no transposed copy of the embedding


def test_llama3_frequencies_follow_the_formula():
    """Each branch of the llama3 scaling, against the formula written out by hand."""
    scaling = Llama3RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    got = llama3_frequencies(8, 10000.0, scaling)
    inv = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)  # wavelengths 6.3, 63, 628, 6283
    s = (64 / (2 * np.pi / inv[1]) - 1.0) / (4.0 - 1.0)
    want = [inv[0], (1 - s) * inv[1] / 8 + s * inv[1], inv[2] / 8, inv[3] / 8]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(llama3_frequencies(8, 10000.0, None), inv, rtol=1e-6)


def test_bfloat16_model_stays_close_to_float32(fixtures):
    _, ref = fixtures["llama3_gqa42"]
    bf16 = mtp_jax.load(os.path.join(FIXTURES, "llama3_gqa42"), "bfloat16")
    assert rel_err(bf16.logits(ref["input_ids"]), ref["logits"]) < 3e-2


def test_sampling_is_per_row_and_reproducible(fixtures):
    model, ref = fixtures["llama3_gqa42"]
    prompts = [list(map(int, row)) for row in ref["input_ids"][:, :6]]
    kw = {
        "max_new_tokens": 10,
        "temperature": 0.9,
        "top_k": 20,
        "top_p": 0.9,
        "min_p": 0.02,
        "ignore_eos": True,
    }
    both = model.generate(prompts, seed=[5, 6], **kw)
    alone = model.generate(prompts[1:], seed=6, **kw)
    assert both.tokens[1] == alone.tokens[0]
    assert model.generate(prompts, seed=[5, 6], **kw).tokens == both.tokens
    assert model.generate(prompts, seed=[7, 6], **kw).tokens[0] != both.tokens[0]


def test_speculation_needs_a_draft_the_model_has(fixtures):
    model, ref = fixtures["llama3_gqa42"]
    assert model.drafts == ()
    with pytest.raises(mtp_jax.InvalidRequestError, match="DeepSeek-V3's NextN layer"):
        model.generate([[3, 4, 5]], draft="mtp")
    with pytest.raises(mtp_jax.InvalidRequestError, match="needs a draft"):
        model.generate([[3, 4, 5]], num_speculative_tokens=2)


def test_bad_requests_name_the_problem_and_the_model_stays_usable(fixtures):
    model, ref = fixtures["llama3_gqa42"]
    v = model.config.vocab_size
    with pytest.raises(mtp_jax.InvalidRequestError, match=f"token id {v} at index 1"):
        model.generate([[3, v, 5]])
    with pytest.raises(mtp_jax.InvalidRequestError, match="token id -1"):
        model.logits([[3, -1]])
    with pytest.raises(mtp_jax.InvalidRequestError, match="top_p"):
        model.generate([[3, 4]], temperature=1.0, top_p=0.0)
    with pytest.raises(mtp_jax.InvalidRequestError, match="captured layer 3"):
        model.hidden_states([[3, 4]], layers=[3])
    assert rel_err(model.logits(ref["input_ids"]), ref["logits"]) < 1e-5


# --- bad checkpoints -------------------------------------------------------------------------------
def _copy(tmp_path, name="llama3_gqa42", root=FIXTURES):
    dst = tmp_path / name
    shutil.copytree(os.path.join(root, name), dst, ignore=shutil.ignore_patterns("reference.npz"))
    return dst


def _edit_config(path, **changes):
    with open(path / "config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        cfg.pop(key)
    with open(path / "config.json", "w", encoding="utf-8") as f:
        json.dump(cfg, f)


def _edit_tensors(path, change):
    reader = CheckpointReader(str(path))
    tensors = {k: reader.get(k) for k in reader.keys()}
    change(tensors)
    save_safetensors(str(path / "model.safetensors"), tensors, {"format": "pt"})


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"attention_bias": True}, "attention_bias=true is not supported"),
        ({"mlp_bias": True}, "mlp_bias=true is not supported"),
        ({"sliding_window": 4096}, "sliding_window=4096 is not supported"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "rope_type 'yarn' is not supported for Llama",
        ),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
        (
            {"num_key_value_heads": 3},
            r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)",
        ),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"model_type": "mistral"}, "unsupported model_type 'mistral'"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config is not supported for Llama"),
    ],
)
def test_unsupported_variants_are_refused_by_name(tmp_path, changes, message):
    path = _copy(tmp_path)
    _edit_config(path, **changes)
    with pytest.raises(mtp_jax.ConfigError, match=message):
        mtp_jax.load(path, "float32")


def test_missing_and_misshaped_tensors_are_named(tmp_path):
    path = _copy(tmp_path)
    _edit_tensors(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(
        mtp_jax.CheckpointError, match="missing tensor 'model.layers.1.self_attn.k_proj.weight'"
    ):
        mtp_jax.load(path, "float32")
    path = _copy(tmp_path / "b")
    _edit_tensors(
        path, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros((60, 32), np.float32)})
    )
    with pytest.raises(
        mtp_jax.CheckpointError, match=r"'model.layers.2.mlp.up_proj.weight' has shape \[60, 32\]"
    ):
        mtp_jax.load(path, "float32")


def test_untied_model_without_lm_head_and_tied_model_with_a_different_one(tmp_path):
    path = _copy(tmp_path)
    _edit_tensors(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(mtp_jax.CheckpointError, match="missing tensor 'lm_head.weight'"):
        mtp_jax.load(path, "float32")
    path = _copy(tmp_path / "b", "gqa81_tied_head_dim")
    _edit_tensors(path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1.0}))
    with pytest.raises(mtp_jax.CheckpointError, match="lm_head.weight differs from model.embed_tokens"):
        mtp_jax.load(path, "float32")
    path = _copy(tmp_path / "c", "gqa81_tied_head_dim")  # an identical stored copy is fine
    _edit_tensors(path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"]}))
    mtp_jax.load(path, "float32", strict=True)


def test_unexpected_tensor_is_refused_under_strict(tmp_path):
    path = _copy(tmp_path)
    _edit_tensors(
        path, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(32, np.float32)})
    )
    with pytest.raises(mtp_jax.CheckpointError, match="q_proj.bias"):
        mtp_jax.load(path, "float32", strict=True)


def test_config_parses_both_rope_spellings():
    base = {
        "model_type": "llama",
        "vocab_size": 16,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    scaling = {
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    hub = Llama3Config.from_dict(
        {**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}}
    )
    v5 = Llama3Config.from_dict(
        {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}}
    )
    assert hub == v5 and hub.rope_theta == 5e5 and hub.rope_scaling.factor == 32.0
    plain = Llama3Config.from_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling is None and plain.rope_theta == 1e4
    assert plain.num_key_value_heads == 2 and plain.head_dim == 4 and plain.num_queries_per_kv == 1
    jax.clear_caches()
