"""Per-layer weight buffers (``load(..., layer_buffers=True)``): the unrolled layers read each
layer's own buffers instead of slicing the scanned stacks; the numbers must not change."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import mtp_jax
from mtp_jax import model as model_module
from mtp_jax.roofline import step_bytes
from mtp_jax.sharding import make_mesh
from tests.conftest import EMBEDDED_MODEL, REPO

LLAMA = f"{REPO}/checkpoints/tiny-llama3-stdlib"
PROMPTS = [[1, 40, 7, 100, 9], [1, 300, 12]]


def _both(path: str, **kw) -> tuple[mtp_jax.Model, mtp_jax.Model]:
    return (
        mtp_jax.load(path, dtype="float32", layer_buffers=False, **kw),
        mtp_jax.load(path, dtype="float32", layer_buffers=True, **kw),
    )


def test_deepseek_layer_buffers_equal_the_scanned_stacks():
    """Dense and MoE stacks unrolled: same logits, same tokens and acceptance with the MTP draft."""
    stacked, buffered = _both(EMBEDDED_MODEL)
    assert not stacked.layer_buffers and buffered.layer_buffers
    for name in ("dense", "moe"):
        stack, layers = stacked.params[name], buffered.params[name]
        assert isinstance(layers, tuple) and len(layers) == jax.tree.leaves(stack)[0].shape[0]
        assert jax.tree.leaves(layers[0])[0].shape == jax.tree.leaves(stack)[0].shape[1:]
    tokens = np.asarray([PROMPTS[0] * 2])
    np.testing.assert_allclose(buffered.logits(tokens), stacked.logits(tokens), rtol=1e-5, atol=1e-5)
    runs = [
        m.generate(PROMPTS, max_new_tokens=10, num_speculative_tokens=2, draft="mtp")
        for m in (stacked, buffered)
    ]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].stats["acceptance_length"] == runs[1].stats["acceptance_length"] > 1
    # the roofline counts the same bytes either way
    args = dict(k=2, batch=1, context=64, cache_itemsize=4)
    assert step_bytes(buffered.params, buffered.config, **args) == step_bytes(
        stacked.params, stacked.config, **args
    )


def test_llama_and_dflash_layer_buffers_equal_the_scanned_stacks():
    """The Llama stack and the DFlash draft's own stack unrolled: the same tokens."""
    draft = f"{LLAMA}-dflash"
    stacked, buffered = _both(LLAMA, draft_model=draft)
    assert isinstance(buffered.params["layers"], tuple)
    assert isinstance(buffered.params["dflash"]["layers"], tuple)
    kw = dict(max_new_tokens=10, num_speculative_tokens=3, draft="dflash")
    runs = [m.generate(PROMPTS, **kw) for m in (stacked, buffered)]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].stats["acceptance_length"] == runs[1].stats["acceptance_length"] > 1


def test_layer_buffers_policy(monkeypatch):
    model = mtp_jax.load(LLAMA, dtype="float32")
    assert not model.layer_buffers  # the tiny model's layers are under the size threshold
    monkeypatch.setattr(model_module, "LAYER_BUFFER_MIN_BYTES", 1)
    assert mtp_jax.load(LLAMA, dtype="float32").layer_buffers  # a real model's are not
    mesh = make_mesh(devices=jax.devices()[:1])
    assert not model_module.resolve_layer_buffers(model.params, model.config, mesh, None)
    with pytest.raises(ValueError, match="not supported with a mesh"):
        model_module.resolve_layer_buffers(model.params, model.config, mesh, True)


def test_consuming_conversion_deletes_the_stacks_and_keeps_the_values():
    """``with_layer_buffers(..., consume=True)`` (bench_step's random weights): each stacked leaf is
    deleted once split, FP8 weights and their scales included, and the layers hold the same values."""
    stacked = mtp_jax.load(EMBEDDED_MODEL, dtype="float32", layer_buffers=False)
    params = jax.tree.map(lambda x: x.copy(), stacked.params)
    moe_leaves = jax.tree.leaves(params["moe"])
    out = model_module.with_layer_buffers(params, stacked.config, consume=True)
    assert all(x.is_deleted() for x in moe_leaves)
    assert params["embed"] is out["embed"] and not out["embed"].is_deleted()  # not a stack: untouched
    for i, layer in enumerate(out["moe"]):
        for got, want in zip(jax.tree.leaves(layer), jax.tree.leaves(stacked.params["moe"]), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want[i]))
