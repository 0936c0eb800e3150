"""Parity with Hugging Face transformers' DeepseekV3ForCausalLM (float32, eager attention).

The fixtures in tests/fixtures/parity were written by scripts/make_parity_fixtures.py: tiny random
checkpoints in the exact hub layout and transformers' outputs on them.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax.cache import page_table_array, slots_for
from mtp_jax.targets.deepseek_v3.model import PagedAttention, forward, init_cache, lm_head
from tests.conftest import PARITY_DIR, greedy_reference

FIXTURES = sorted(d for d in os.listdir(PARITY_DIR) if os.path.isdir(os.path.join(PARITY_DIR, d)))


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module", params=FIXTURES)
def parity(request):
    path = os.path.join(PARITY_DIR, request.param)
    return mtp_jax.load(path, dtype="float32"), np.load(os.path.join(path, "reference.npz"))


def test_fixture_set_covers_the_cases():
    assert {"base", "yarn", "nogroup_dense2", "odd_heads", "sharded", "yarn_default_mscale"} <= set(FIXTURES)


def test_logits_match_transformers(parity):
    model, ref = parity
    logits = model.logits(ref["input_ids"])
    assert logits.shape == ref["logits"].shape and logits.dtype == np.float32
    assert rel_err(logits, ref["logits"]) < 1e-5
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-5 * np.abs(ref["logits"]).max())


def test_greedy_generation_equals_transformers(parity):
    """Prefill, the paged cache, continuous batching and the unified step (K = 0) give the tokens of
    transformers' own greedy ``generate`` (with its KV cache)."""
    model, ref = parity
    prompts, n, want = greedy_reference(ref)
    assert model.generate(prompts, max_new_tokens=n, ignore_eos=True).tokens == want


@pytest.mark.parametrize("dispatch", ["sorted", "dense"])
def test_both_expert_dispatches_match_transformers(parity, dispatch):
    """ "auto" picks one of these by size and backend; each must be the same MoE."""
    model, ref = parity
    ids = jnp.asarray(ref["input_ids"])
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    hidden, _ = forward(model.params, model.config, ids, positions, dispatch=dispatch)
    assert rel_err(np.asarray(lm_head(model.params, hidden.post_norm)), ref["logits"]) < 1e-5


def test_hidden_states_match_transformers(parity):
    model, ref = parity
    n = model.config.num_hidden_layers
    hidden = model.hidden_states(ref["input_ids"], layers=tuple(range(n)))
    assert rel_err(hidden.post_norm, ref["last_hidden_post_norm"]) < 1e-5
    # transformers' hidden_states[k] (1 <= k < n) is the output of layer k-1 == our layer k-1
    for k in range(1, n):
        assert rel_err(hidden.layers[k - 1], ref["hidden_states"][k]) < 1e-5
    assert rel_err(hidden.layers[n - 1], ref["layer_outputs"][n - 1]) < 1e-5
    assert np.array_equal(hidden.pre_norm, hidden.layers[n - 1])


def test_paged_prefill_matches_transformers(parity):
    """The serving path (absorbed attention over a shuffled paged cache) against the same reference."""
    model, ref = parity
    cfg, page_size = model.config, 4
    tokens = jnp.asarray(ref["input_ids"])
    b, t = tokens.shape
    per_row = -(-t // page_size)
    order = np.random.default_rng(0).permutation(b * per_row)
    table = jnp.asarray(page_table_array([list(order[i::b]) for i in range(b)], per_row))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    slots = slots_for(table, positions, jnp.ones((b, t), bool), page_size)
    pages = init_cache(cfg, b * per_row, page_size, jnp.float32)
    hidden, _ = forward(model.params, cfg, tokens, positions, PagedAttention(pages, slots, table))
    logits = np.asarray(lm_head(model.params, hidden.post_norm))
    assert rel_err(logits, ref["logits"]) < 1e-5


def test_fp8_kept_on_device_matches_transformers():
    """The real FP8 layout (128x128 blocks, partial edges) kept as FP8 and dequantised on use."""
    path = os.path.join(PARITY_DIR, "fp8_mtp")
    ref = np.load(os.path.join(path, "reference.npz"))
    model = mtp_jax.load(path, dtype="float32", weights="fp8")
    assert model.params["moe"]["mlp"]["gate"].w.dtype == jnp.float8_e4m3fn
    assert rel_err(model.logits(ref["input_ids"]), ref["logits"]) < 1e-5


@pytest.mark.parametrize("name", ["fp8_mtp", "sharded_mtp_bf16"])
def test_mtp_layer_is_loaded_from_hub_fixtures(name):
    model = mtp_jax.load(os.path.join(PARITY_DIR, name), dtype="float32")
    mtp = model.params["mtp"]
    d = model.config.hidden_size
    assert mtp["eh_proj"].shape == (1, 2 * d, d)
    # the fixtures' MTP embed/head are exact copies of the main ones: stored once
    assert "embed" not in mtp and "head" not in mtp
