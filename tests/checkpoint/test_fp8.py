"""FP8 block weights: dequantisation math, kept-FP8 parameters, MTP layer loading, strictness."""

from __future__ import annotations

import copy
import logging

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mtp_jax
from mtp_jax.fp8 import BLOCKED_MAX_ROWS, Fp8Weight, dense_einsum, dequantize, materialize
from mtp_jax.synthetic import quantize_fp8
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
from mtp_jax.targets.deepseek_v3.synthetic import hub_tensors
from tests.conftest import TINY_CONFIG

BLOCK = (16, 8)  # non-square, so swapped block axes are caught; tiny dims give partial edge blocks


def fp8_config() -> dict:
    cfg = copy.deepcopy(TINY_CONFIG)
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }
    return cfg


def brute_force_dequantize(q: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    out = np.zeros(q.shape, np.float64)
    for r in range(q.shape[0]):
        for c in range(q.shape[1]):
            out[r, c] = float(q[r, c]) * float(scale[r // block[0], c // block[1]])
    return out


def test_dequantize_matches_elementwise_definition():
    rng = np.random.default_rng(0)
    q = (rng.standard_normal((37, 21)) * 50).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.random((3, 3)).astype(np.float32) + 0.1  # ceil(37/16), ceil(21/8)
    np.testing.assert_allclose(
        dequantize(q, scale, BLOCK), brute_force_dequantize(q, scale, BLOCK), rtol=1e-6
    )


def test_fp8_weight_materializes_like_host_dequantization():
    rng = np.random.default_rng(1)
    q = (rng.standard_normal((36, 20)) * 30).astype(ml_dtypes.float8_e4m3fn)  # out 36 = 3 heads x 12
    scale = (rng.random((3, 3)) + 0.5).astype(np.float32)
    fw = Fp8Weight.from_hub(q, scale, BLOCK, (20, 3, 12))
    want = dequantize(q, scale, BLOCK).T.reshape(20, 3, 12)
    np.testing.assert_allclose(fw.dequantize_host(np.float32), want, rtol=1e-6)
    device = jax.tree.map(jnp.asarray, fw)
    np.testing.assert_allclose(np.asarray(materialize(device, jnp.float32)), want, rtol=1e-6)
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), device)  # leading (layer/expert) axes survive
    assert materialize(stacked, jnp.bfloat16).shape == (2, 20, 3, 12)


@pytest.mark.parametrize(
    "spec, x_shape, w_shape, rows",
    [
        ("btd,dhk->bthk", (2, 3), (32, 3, 12), 6),  # q / q_b: one input axis, two output axes
        ("bthk,hkd->btd", (1, 4), (2, 16, 20), 4),  # o: two input axes; 20 outputs, a partial block
        ("...d,df->...f", (1, 1), (48, 36), 1),  # swiglu's projections at one row
        ("btd,dc->btc", (4, 9), (32, 24), 36),  # more rows than BLOCKED_MAX_ROWS: dequantised first
        ("btd,dc->btc", (1, 2), (40, 24), 2),  # 40 inputs, not whole blocks of 16: dequantised first
    ],
)
def test_dense_einsum_reads_fp8_in_place_and_equals_the_dequantised_product(spec, x_shape, w_shape, rows):
    """Up to BLOCKED_MAX_ROWS rows, an FP8 projection is summed block by block from the FP8 values
    (no dequantised [in, out] weight in the program); the result is the product with the
    dequantised weight either way."""
    rng = np.random.default_rng(7)
    n_in = 2 if spec.startswith("bthk") else 1
    k, n = int(np.prod(w_shape[:n_in])), int(np.prod(w_shape[n_in:]))
    q = (rng.standard_normal((n, k)) * 30).astype(ml_dtypes.float8_e4m3fn)
    scale = (rng.random((-(-n // BLOCK[1]), -(-k // BLOCK[0]))) + 0.5).astype(np.float32)
    # from_hub takes the hub's (b_out, b_in): the kept weight's block is (16, 8) over (in, out)
    w = jax.tree.map(jnp.asarray, Fp8Weight.from_hub(q, scale, BLOCK[::-1], w_shape))
    x = jnp.asarray(rng.standard_normal(x_shape + tuple(w_shape[:n_in])), jnp.float32)
    if spec.startswith("..."):
        x = x.reshape(x_shape[-1:] + tuple(w_shape[:n_in]))
    want = jnp.einsum(spec, x, materialize(w, jnp.float32))
    got = dense_einsum(spec, x, w)
    assert got.shape == want.shape and got.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    blocked = rows <= BLOCKED_MAX_ROWS and k % w.block[0] == 0
    shapes = {
        tuple(v.aval.shape)
        for e in jax.make_jaxpr(dense_einsum, static_argnums=0)(spec, x, w).eqns
        for v in e.outvars
    }
    assert ((k, n) in shapes) != blocked  # the dequantised weight exists only when not blocked
    if blocked:
        assert (rows, k // w.block[0], n) in shapes  # the per-block partial sums


def test_quantize_round_trip_is_close():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((40, 24)).astype(np.float32)
    t = quantize_fp8({"model.layers.0.mlp.up_proj.weight": w}, BLOCK)
    back = dequantize(
        t["model.layers.0.mlp.up_proj.weight"], t["model.layers.0.mlp.up_proj.weight_scale_inv"], BLOCK
    )
    assert np.abs(back - w).max() <= 0.07 * np.abs(w).max()  # e4m3 has 3 mantissa bits


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    """(FP8 checkpoint, float32 checkpoint of its independently dequantised weights)."""
    from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint

    cfg_dict = fp8_config()
    cfg = DeepseekV3Config.from_dict(cfg_dict)
    quant = quantize_fp8(hub_tensors(cfg, seed=5), BLOCK)
    dense = {}
    for key, x in quant.items():
        if key.endswith("_scale_inv"):
            continue
        dense[key] = (
            brute_force_dequantize(x, quant[f"{key}_scale_inv"], BLOCK).astype(np.float32)
            if x.dtype == ml_dtypes.float8_e4m3fn
            else x
        )
    root = tmp_path_factory.mktemp("fp8")
    write_hub_checkpoint(root / "fp8", cfg_dict, quant, shards=2)
    plain = {k: v for k, v in cfg_dict.items() if k != "quantization_config"}
    write_hub_checkpoint(root / "dense", plain, dense)
    return str(root / "fp8"), str(root / "dense")


IDS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19]]


def test_fp8_checkpoint_dequantised_equals_dense_checkpoint(fp8_pair):
    fp8_dir, dense_dir = fp8_pair
    got = mtp_jax.load(fp8_dir, "float32").logits(IDS)
    want = mtp_jax.load(dense_dir, "float32").logits(IDS)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_fp8_weights_kept_on_device(fp8_pair):
    fp8_dir, dense_dir = fp8_pair
    model = mtp_jax.load(fp8_dir, "float32", weights="fp8")
    attn, experts = model.params["moe"]["attn"], model.params["moe"]["mlp"]
    for w in (
        attn["q_a"],
        attn["q_b"],
        attn["kv_a"],
        attn["o"],
        experts["gate"],
        experts["down"],
        experts["shared_up"],
    ):
        assert (
            isinstance(w, Fp8Weight) and w.w.dtype == jnp.float8_e4m3fn and w.scale_inv.dtype == jnp.float32
        )
    assert experts["gate"].w.shape[:2] == (2, 8)  # [moe layers, experts, in, out]
    assert not isinstance(attn["k_b"], Fp8Weight)  # kv_b is always dequantised
    assert not isinstance(experts["router"], Fp8Weight) and experts["router"].dtype == jnp.float32
    got = model.logits(IDS)
    want = mtp_jax.load(dense_dir, "float32").logits(IDS)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    result = model.generate(IDS, max_new_tokens=4, ignore_eos=True)
    assert (
        result.tokens
        == mtp_jax.load(dense_dir, "float32").generate(IDS, max_new_tokens=4, ignore_eos=True).tokens
    )


@pytest.mark.parametrize("weights", ["fp8", "dense"])
def test_weight_estimate_is_what_the_loader_holds(fp8_pair, weights):
    """mtp-jax inspect's byte estimate (from config.json alone) equals the bytes of the loaded tree,
    dtype by dtype: FP8 weights with their block scales, float32 routers, bfloat16 the rest."""
    from mtp_jax.estimate import weight_bytes

    model = mtp_jax.load(fp8_pair[0], "bfloat16", weights=weights)
    held: dict[str, int] = {}
    for x in jax.tree.leaves(model.params):
        held[str(x.dtype)] = held.get(str(x.dtype), 0) + x.nbytes
    assert held == weight_bytes(model.config, "fp8" if weights == "fp8" else "bf16")


def test_fp8_errors(make_checkpoint, fp8_pair):
    cfg = DeepseekV3Config.from_dict(fp8_config())
    quant = quantize_fp8(hub_tensors(cfg, seed=5), BLOCK)
    key = "model.layers.1.self_attn.q_b_proj.weight"
    missing = {k: v for k, v in quant.items() if k != f"{key}_scale_inv"}
    with pytest.raises(mtp_jax.CheckpointError, match=f"'{key}_scale_inv' is missing"):
        mtp_jax.load(make_checkpoint(fp8_config(), name="a", tensors=missing), "float32")
    bad = dict(quant)
    bad[f"{key}_scale_inv"] = quant[f"{key}_scale_inv"][:, :1]
    with pytest.raises(mtp_jax.CheckpointError, match=rf"'{key}_scale_inv' has shape \[3, 1\]"):
        mtp_jax.load(make_checkpoint(fp8_config(), name="b", tensors=bad), "float32")
    with pytest.raises(mtp_jax.CheckpointError, match="needs an FP8 checkpoint"):
        mtp_jax.load(fp8_pair[1], "float32", weights="fp8")
    with pytest.raises(ValueError, match="weights must be one of"):
        mtp_jax.load(fp8_pair[1], "float32", weights="int4")


def test_mtp_layer_loaded_and_duplicates_stored_once(make_checkpoint):
    cfg = DeepseekV3Config.from_dict(TINY_CONFIG)
    tensors = hub_tensors(cfg, seed=3)
    model = mtp_jax.load(make_checkpoint(tensors=tensors), "float32")
    mtp = model.params["mtp"]
    assert set(mtp) == {"enorm", "hnorm", "eh_proj", "head_norm", "layer"}  # embed/head equal the main ones
    n, d = cfg.num_hidden_layers, cfg.hidden_size
    np.testing.assert_array_equal(
        np.asarray(mtp["eh_proj"][0]), tensors[f"model.layers.{n}.eh_proj.weight"].T
    )
    np.testing.assert_array_equal(np.asarray(mtp["enorm"][0]), tensors[f"model.layers.{n}.enorm.weight"])
    np.testing.assert_array_equal(
        np.asarray(mtp["layer"]["mlp"]["gate"][0, 5]),
        tensors[f"model.layers.{n}.mlp.experts.5.gate_proj.weight"].T,
    )
    assert mtp["eh_proj"].shape == (1, 2 * d, d)
    # a head that differs from lm_head is kept separately
    tensors[f"model.layers.{n}.shared_head.head.weight"] = tensors["lm_head.weight"] * 2
    model = mtp_jax.load(make_checkpoint(tensors=tensors, name="other"), "float32")
    np.testing.assert_array_equal(np.asarray(model.params["mtp"]["head"][0]), tensors["lm_head.weight"].T * 2)
    assert "embed" not in model.params["mtp"]
    assert (
        "mtp" not in mtp_jax.load(make_checkpoint(tensors=tensors, name="third"), "float32", mtp=False).params
    )


def test_strict_refuses_unexpected_tensors(make_checkpoint, caplog):
    tensors = hub_tensors(DeepseekV3Config.from_dict(TINY_CONFIG), seed=0)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(2, np.float32)
    path = make_checkpoint(tensors=tensors)
    with pytest.raises(mtp_jax.CheckpointError, match="rotary_emb.inv_freq"):
        mtp_jax.load(path, "float32", strict=True)
    with caplog.at_level(logging.WARNING):
        mtp_jax.load(path, "float32")
    assert "rotary_emb.inv_freq" in caplog.text
