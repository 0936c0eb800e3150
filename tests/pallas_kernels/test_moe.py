"""MoE dispatch kernels: the Pallas grouped matmul (interpret mode) against the jnp reference,
jax.lax.ragged_dot and numpy loops; permute/combine; routed experts against mtp_jax.moe; dispatcher."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_kernels.moe as pm
from mtp_jax.checkpoint.fp8 import Fp8Weight, materialize
from mtp_jax.moe import routed_experts as moe_routed_experts
from pallas_kernels.moe import kernel, reference

SMALL_TILES = {"block_m": 16, "block_n": 32, "block_k": 32}


def np_gmm(lhs: np.ndarray, rhs: np.ndarray, sizes) -> np.ndarray:
    """Group by group in float64; rows past the groups stay zero."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for e, size in enumerate(sizes):
        out[start : start + size] = lhs[start : start + size] @ rhs[e]
        start += size
    return out


def np_routed_experts(x, weights, idx, gate, up, down) -> np.ndarray:
    """Token by token, expert by expert, float64."""
    x, gate, up, down = (np.asarray(a, np.float64) for a in (x, gate, up, down))
    out = np.zeros(x.shape)
    for t in range(x.shape[0]):
        for j, e in enumerate(np.asarray(idx)[t]):
            a, b = x[t] @ gate[e], x[t] @ up[e]
            out[t] += float(weights[t, j]) * ((a / (1.0 + np.exp(-a)) * b) @ down[e])
    return out


def rand(rng, shape, dtype=jnp.float32, scale=1.0) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def rand_fp8(rng, experts: int, kdim: int, ndim: int, block=(128, 128)) -> Fp8Weight:
    """Random e4m3 values (never all zero) and per-block scales; edge blocks partial when dims are not
    multiples of the block."""
    w = (rng.standard_normal((experts, kdim, ndim)) * 40).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2.0, (experts, math.ceil(kdim / block[0]), math.ceil(ndim / block[1])))
    scale = scale / (40 * math.sqrt(kdim))
    return Fp8Weight(
        w=jnp.asarray(w), scale_inv=jnp.asarray(scale, jnp.float32), shape=(kdim, ndim), block=block
    )


def assert_close(got, want, rel: float) -> None:
    """Elementwise |got - want| <= rel * max|want| (outputs are O(1) dot products of random data)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=rel * max(np.abs(want).max(), 1e-6))


# m not a multiple of block_m (16), kdim 48 not a multiple of block_k (32), ndim 40 not of block_n (32);
# empty groups first, inside and last; groups start and end inside tiles; rows past the groups.
@pytest.mark.parametrize(
    "dtype, sizes, m",
    [
        (jnp.float32, [0, 7, 20, 0, 6, 0], 40),
        (jnp.bfloat16, [5, 0, 16, 11, 0, 3], 35),
        (jnp.float32, [0, 0, 0, 0], 9),
        (jnp.float32, None, None),
    ],
    ids=["f32", "bf16", "all-empty", "random-sizes"],
)
def test_gmm_kernel_matches_reference_and_ragged_dot(dtype, sizes, m):
    rng = np.random.default_rng(0 if m is None else m)
    if sizes is None:  # 7 random sizes, one forced empty, and 5 rows past the groups
        sizes = rng.integers(0, 13, 7)
        sizes[rng.integers(7)] = 0
        sizes, m = sizes.tolist(), int(sizes.sum()) + 5
    kdim, ndim = 48, 40
    lhs = rand(rng, (m, kdim), dtype)
    rhs = rand(rng, (len(sizes), kdim, ndim), dtype, scale=1 / math.sqrt(kdim))
    group_sizes = jnp.asarray(sizes, jnp.int32)

    got = kernel.gmm(lhs, rhs, group_sizes, interpret=True, **SMALL_TILES)
    ref = reference.gmm(lhs, rhs, group_sizes)
    ragged = jax.lax.ragged_dot(lhs, rhs, group_sizes)
    assert got.dtype == ref.dtype == dtype and got.shape == (m, ndim)

    tight = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16: outputs rounded to 8 bits
    assert_close(got, ref, tight)
    assert_close(ragged, ref, tight)
    assert_close(got, np_gmm(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes), 2 * tight)
    assert not np.asarray(got[sum(sizes) :]).any()


def test_gmm_rows_outside_groups_never_leak():
    """NaN rows past the groups share tiles with real rows: they must not reach them, their outputs are
    exact zeros, and every output tile is written (the interpreter starts outputs as NaN)."""
    rng = np.random.default_rng(1)
    sizes, m = [3, 0, 9, 5], 26
    lhs = rand(rng, (m, 48))
    rhs = rand(rng, (4, 48, 40), scale=0.2)
    poisoned = lhs.at[sum(sizes) :].set(jnp.nan)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(kernel.gmm(poisoned, rhs, group_sizes, interpret=True, **SMALL_TILES))
    assert np.isfinite(got).all()
    assert not got[sum(sizes) :].any()
    assert_close(got[: sum(sizes)], np_gmm(lhs, rhs, sizes)[: sum(sizes)], 1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gmm_fp8_matches_dequantised_matmul(dtype):
    """128x128 scale blocks with partial edge blocks (kdim 200 = 128 + 72, ndim 160 = 128 + 32), tiles
    smaller than a block (several tiles share one scale) and an empty group."""
    rng = np.random.default_rng(2)
    sizes, m = [9, 0, 14], 27
    fp8 = rand_fp8(rng, 3, 200, 160)
    lhs = rand(rng, (m, 200), dtype)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = kernel.gmm(lhs, fp8, group_sizes, interpret=True, block_m=16, block_n=32, block_k=64)
    dense = materialize(fp8, jnp.float32)
    want = np_gmm(lhs.astype(jnp.float32), dense, sizes)
    # bf16: the references round each dequantised weight to bf16, the kernel keeps w * scale exact.
    tight = 1e-5 if dtype == jnp.float32 else 1.5e-2
    assert got.dtype == dtype
    assert_close(got, want, 2 * tight)
    assert_close(got, reference.gmm(lhs, fp8, group_sizes), tight)
    assert_close(got, pm.gmm(lhs, fp8, group_sizes, impl="ragged_dot"), tight)
    assert not np.asarray(got[sum(sizes) :]).any()


@pytest.mark.parametrize("case", ["bf16", "f32-small-tiles", "fp8-deepseek-dims"])
def test_kernel_lowers_to_triton_for_cuda(case):
    """Cross-platform lowering on this CPU: every op in the kernel has a Pallas Triton lowering rule
    (the Triton -> PTX compile and a GPU run are not checked here)."""
    spec = jax.ShapeDtypeStruct
    tiles = {}
    if case == "bf16":
        args = spec((100, 256), jnp.bfloat16), spec((8, 256, 384), jnp.bfloat16), spec((8,), jnp.int32)
    elif case == "f32-small-tiles":
        args = spec((37, 40), jnp.float32), spec((5, 40, 24), jnp.float32), spec((5,), jnp.int32)
        tiles = {"block_m": 16, "block_n": 16, "block_k": 16}
    else:  # DeepSeek-V3 gate/up: 256 experts, 7168 -> 2048, 128x128 blocks; > 2**32 bytes (64-bit offsets)
        w = spec((256, 7168, 2048), jnp.float8_e4m3fn)
        fp8 = Fp8Weight(w=w, scale_inv=spec((256, 56, 16), jnp.float32), shape=(7168, 2048), block=(128, 128))
        args = spec((64, 7168), jnp.bfloat16), fp8, spec((256,), jnp.int32)
    fn = jax.jit(lambda lhs, rhs, sizes: kernel.gmm(lhs, rhs, sizes, **tiles))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text


def test_permute_combine_round_trip():
    rng = np.random.default_rng(3)
    n, k, e, d = 10, 3, 5, 8
    x = rand(rng, (n, d))
    idx = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (n, k)), jnp.float32)
    xs, sizes, order = pm.permute(x, idx, e)

    flat = np.asarray(idx).reshape(-1)
    np.testing.assert_array_equal(sizes, np.bincount(flat, minlength=e))
    assert (np.diff(flat[np.asarray(order)]) >= 0).all()  # rows grouped by expert, experts in order
    np.testing.assert_array_equal(xs, np.asarray(x)[np.asarray(order) // k])

    # combine(permute(x)) weights each token by the sum of its routing weights
    np.testing.assert_allclose(
        pm.combine(xs, order, weights, n), x * weights.sum(1, keepdims=True), rtol=1e-6
    )
    # per-copy values land on their own token with their own weight
    ys = rand(rng, (n * k, d))
    want = np.zeros((n, d))
    for row, copy in enumerate(np.asarray(order)):
        want[copy // k] += float(weights.reshape(-1)[copy]) * np.asarray(ys[row], np.float64)
    np.testing.assert_allclose(pm.combine(ys, order, weights, n), want, rtol=1e-5, atol=1e-6)


def moe_inputs(rng, dtype, n=12, k=3, e=6, d=40, f=24, fp8=False):
    """Top-k distinct experts per token, expert 2 never chosen (an empty group)."""
    x = rand(rng, (n, d), dtype)
    choices = [i for i in range(e) if i != 2]
    idx = jnp.asarray(np.stack([rng.choice(choices, k, replace=False) for _ in range(n)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (n, k)), jnp.float32)
    if fp8:
        gate, up, down = rand_fp8(rng, e, d, f), rand_fp8(rng, e, d, f), rand_fp8(rng, e, f, d)
    else:
        gate, up = (
            rand(rng, (e, d, f), dtype, 1 / math.sqrt(d)),
            rand(rng, (e, d, f), dtype, 1 / math.sqrt(d)),
        )
        down = rand(rng, (e, f, d), dtype, 1 / math.sqrt(f))
    return x, weights, idx, gate, up, down


@pytest.mark.parametrize(
    "impl, dtype",
    [
        ("reference", jnp.float32),
        ("ragged_dot", jnp.float32),
        ("interpret", jnp.float32),
        ("interpret", jnp.bfloat16),
    ],
)
def test_routed_experts_matches_moe_and_numpy(impl, dtype):
    rng = np.random.default_rng(4)
    args = moe_inputs(rng, dtype)
    got = pm.routed_experts(*args, impl=impl)
    assert got.dtype == dtype
    want_moe = moe_routed_experts(*args)
    want_np = np_routed_experts(*(a.astype(jnp.float32) if i != 2 else a for i, a in enumerate(args)))
    # bf16: every matmul output and h are rounded to bf16 along the way, in both implementations
    tight = 1e-5 if dtype == jnp.float32 else 3e-2
    assert_close(got, want_moe, tight)
    assert_close(got, want_np, 3 * tight)


def test_routed_experts_fp8_matches_moe():
    rng = np.random.default_rng(5)
    x, weights, idx, gate, up, down = moe_inputs(rng, jnp.float32, fp8=True)
    got = pm.routed_experts(x, weights, idx, gate, up, down, impl="interpret")
    dense = [materialize(w, jnp.float32) for w in (gate, up, down)]
    assert_close(got, moe_routed_experts(x, weights, idx, gate, up, down), 1e-5)
    assert_close(got, np_routed_experts(x, weights, idx, *dense), 3e-5)


def test_select_impl_and_environment(monkeypatch):
    monkeypatch.delenv(pm.ENV_VAR, raising=False)
    if jax.default_backend() != "gpu":
        assert pm.select_impl("auto") == "ragged_dot"
        with pytest.raises(ValueError, match="impl='kernel'"):
            pm.select_impl("kernel")
    assert pm.select_impl("auto", fp8_block=(16, 8)) == "ragged_dot"  # no native tiles for 8 columns
    with pytest.raises(ValueError, match="impl must be one of"):
        pm.select_impl("pallas")
    monkeypatch.setenv(pm.ENV_VAR, "interpret")
    assert pm.select_impl("auto") == "interpret"
    assert pm.select_impl("ragged_dot") == "ragged_dot"  # an explicit impl wins over the environment
    monkeypatch.setenv(pm.ENV_VAR, "triton")
    with pytest.raises(ValueError, match="MTP_JAX_KERNELS.*'triton'"):
        pm.select_impl("auto")


def test_environment_routes_the_dispatchers(monkeypatch):
    calls = []
    monkeypatch.setattr(reference, "gmm", lambda *a: calls.append("reference") or jnp.zeros((4, 3)))
    monkeypatch.setattr(kernel, "gmm", lambda *a, interpret: calls.append(interpret) or jnp.zeros((4, 3)))
    lhs, rhs, sizes = jnp.ones((4, 2)), jnp.ones((2, 2, 3)), jnp.asarray([1, 3], jnp.int32)
    for env, want in [("reference", "reference"), ("interpret", True)]:
        monkeypatch.setenv(pm.ENV_VAR, env)
        pm.gmm(lhs, rhs, sizes)
        assert calls.pop() == want
    monkeypatch.setenv(pm.ENV_VAR, "reference")
    monkeypatch.setattr(reference, "routed_experts", lambda *a: calls.append("routed") or 0)
    x, weights, idx = jnp.ones((2, 2)), jnp.ones((2, 1)), jnp.zeros((2, 1), jnp.int32)
    pm.routed_experts(x, weights, idx, rhs, rhs, jnp.ones((2, 3, 2)))
    assert calls.pop() == "routed"


def test_gmm_argument_errors():
    lhs, rhs, sizes = jnp.ones((6, 4)), jnp.ones((3, 4, 5)), jnp.asarray([1, 2, 3], jnp.int32)
    fp8 = Fp8Weight(
        w=jnp.ones((3, 4, 5), jnp.float8_e4m3fn), scale_inv=jnp.ones((3, 1, 1)), shape=(4, 5), block=(16, 8)
    )
    cases = [
        ((jnp.ones((2, 3, 4)), rhs, sizes), r"lhs must be \[m, kdim\], got shape \(2, 3, 4\)"),
        ((lhs.astype(jnp.int32), rhs, sizes), "lhs dtype"),
        (
            (lhs, jnp.ones((4, 5)), sizes),
            r"rhs must be a float \[E, kdim, ndim\] array, got float32 \(4, 5\)",
        ),
        (
            (lhs, jnp.ones((3, 5, 5)), sizes),
            r"lhs \[m, kdim\] \(6, 4\) and rhs .* \(3, 5, 5\) differ in kdim",
        ),
        ((lhs, rhs, sizes[:2]), r"group_sizes must be an integer \[E\] = \[3\].*\(2,\)"),
        ((lhs, rhs, sizes.astype(jnp.float32)), "group_sizes must be an integer"),
        ((lhs, Fp8Weight(fp8.w, jnp.ones((3, 2, 1)), (4, 5), (16, 8)), sizes), r"scale_inv .* \(3, 1, 1\)"),
        ((lhs, Fp8Weight(fp8.w, fp8.scale_inv, (4, 1, 5), (16, 8)), sizes), "shape"),
        ((lhs, Fp8Weight(rhs, fp8.scale_inv, (4, 5), (16, 8)), sizes), "float8_e4m3fn"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            pm.gmm(*args, impl="reference")
    with pytest.raises(ValueError, match="impl must be one of"):
        pm.gmm(lhs, rhs, sizes, impl="triton")


def test_kernel_tile_errors():
    lhs, sizes = jnp.ones((6, 4)), jnp.asarray([1, 2, 3], jnp.int32)
    fp8 = Fp8Weight(
        w=jnp.ones((3, 4, 5), jnp.float8_e4m3fn), scale_inv=jnp.ones((3, 1, 1)), shape=(4, 5), block=(16, 8)
    )
    with pytest.raises(ValueError, match=r"block_k \| b_in and block_n \| b_out, got block_k=16, block_n=16"):
        kernel.gmm(lhs, fp8, sizes, interpret=True, block_n=16, block_k=16)
    with pytest.raises(ValueError, match="block_m must be a power of two, got 24"):
        kernel.gmm(lhs, jnp.ones((3, 4, 5)), sizes, interpret=True, block_m=24)
    with pytest.raises(ValueError, match=r"block_m must be a power of two >= 16 \(native compile\), got 8"):
        kernel.gmm(lhs, jnp.ones((3, 4, 5)), sizes, block_m=8)


def test_routed_experts_shape_errors():
    rng = np.random.default_rng(6)
    x, weights, idx, gate, up, down = moe_inputs(rng, jnp.float32, n=4, k=2, e=3, d=8, f=4)
    with pytest.raises(ValueError, match=r"weights \[n, k\].*weights \(4, 1\), idx \(4, 2\)"):
        pm.routed_experts(x, weights[:, :1], idx, gate, up, down, impl="reference")
    with pytest.raises(ValueError, match=r"got gate \(3, 8, 4\), up \(3, 8, 4\), down \(3, 8, 4\)"):
        pm.routed_experts(x, weights, idx, gate, up, up, impl="reference")
    with pytest.raises(ValueError, match=r"d = x.shape\[1\] = 7"):
        pm.routed_experts(x[:, :7], weights, idx, gate, up, down, impl="reference")
