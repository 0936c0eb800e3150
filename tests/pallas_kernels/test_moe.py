"""MoE dispatch kernels: the Pallas grouped matmuls (the Mosaic GPU kernel and the Triton-backend
kernel, in interpret mode) against the jnp reference, jax.lax.ragged_dot and numpy loops, and their
native paths lowered for CUDA on this CPU; permute/combine; routed experts against
mtp_jax.targets.deepseek_v3.moe;
dispatcher. The ``hopper`` tests compile the Mosaic GPU kernel natively and run only on a Hopper GPU."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_kernels.moe as pm
from mtp_jax.fp8 import Fp8Weight, materialize
from mtp_jax.targets.deepseek_v3.moe import routed_experts as moe_routed_experts
from pallas_kernels.moe import kernel, mosaic_gpu, reference

SMALL_TILES = {"block_m": 16, "block_n": 32, "block_k": 32}
MOSAIC_SMALL_TILES = {"block_m": 64, "block_n": 32, "block_k": 32}  # block_m: the wgmma M tile

ON_HOPPER = jax.devices()[0].platform == "gpu" and str(
    getattr(jax.devices()[0], "compute_capability", "")
).startswith("9")
hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (compiles the kernel natively)")


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


@pytest.mark.parametrize("per_call", [1, 2, 3])
def test_gmm_fp8_split_over_experts_equals_one_call(per_call):
    """An FP8 stack over the per-call limit (2^31 bytes on a GPU, where larger ones gave wrong values
    on an H100) runs as slices of experts: the same numbers as one call, for slices of one expert,
    of two, and of three (a ragged last slice), with empty groups and rows past the groups."""
    rng = np.random.default_rng(5)
    sizes, m = [4, 0, 9, 3, 0, 6, 2], 30
    fp8 = rand_fp8(rng, len(sizes), 200, 160)
    lhs = rand(rng, (m, 200))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    tiles = dict(block_m=16, block_n=32, block_k=64, interpret=True)
    whole = kernel.gmm(lhs, fp8, group_sizes, **tiles)
    limit = per_call * fp8.w.nbytes // len(sizes)
    split = kernel.gmm(lhs, fp8, group_sizes, max_rhs_bytes=limit, **tiles)
    assert_close(split, whole, 1e-5)
    assert not np.asarray(split[sum(sizes) :]).any()


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


# Mosaic GPU kernel (interpret mode: the code that compiles, on simulated shared memory, barriers, TMA
# and wgmma; fresh buffers and the output start as NaN). Tiles are 64 rows, so groups straddle tiles
# and a tile can hold several groups; kdim / ndim / m are not multiples of the tiles; empty groups
# first, inside and last; rows past the groups; several pipeline depths (the copies of the next
# group's first steps are issued during the current group's last ones).
@pytest.mark.parametrize("seed", range(3))
def test_group_walk_lists_exactly_the_overlapping_groups(seed):
    """Each 64-row tile walks exactly the non-empty groups that overlap its rows, in order: groups
    ending on a tile boundary, starting on a tile's last row, spanning tiles, and sums past m."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 40, 12) * rng.integers(0, 2, 12)
    sizes[:4] = [0, 64, 63, 1]  # ends exactly at a boundary; a 1-row group on a tile's last row
    m = int(sizes.sum()) - 10 if seed == 2 else int(sizes.sum()) + 70  # seed 2: groups run past m
    groups, tiles = (np.asarray(a) for a in mosaic_gpu.group_walk(jnp.asarray(sizes, jnp.int32), m, 64))
    ends = np.minimum(np.cumsum(sizes), m)
    starts = np.concatenate([[0], ends[:-1]])
    live = [e for e in range(len(sizes)) if ends[e] > starts[e]]
    np.testing.assert_array_equal(groups[:, : len(live)], [live, starts[live], ends[live]])
    assert tiles.shape == (2, -(-m // 64))
    for i, (lo, hi) in enumerate(tiles.T):
        overlapping = [e for e in live if starts[e] < (i + 1) * 64 and ends[e] > i * 64]
        assert groups[0, lo:hi].tolist() == overlapping, i


@pytest.mark.parametrize(
    "dtype, sizes, m, stages, splits",
    [
        (jnp.float32, [0, 9, 54, 1, 0, 30, 0], 117, 2, 1),  # a 1-row group at a tile's last row
        (jnp.bfloat16, [5, 0, 64, 11, 0, 3], 90, 3, 2),
        (jnp.float16, [40, 1, 1, 50], 92, 4, 3),
        (jnp.float32, [0, 0, 0], 9, 3, None),
        (jnp.bfloat16, None, None, 3, None),
    ],
    ids=["f32-stages2", "bf16-stages3-splits2", "f16-stages4-splits3", "all-empty", "bf16-random-sizes"],
)
def test_mosaic_gmm_matches_reference_and_ragged_dot(dtype, sizes, m, stages, splits):
    """Groups split over programs (``group_splits``, partial tiles summed) or not; None: the default
    for these few tiles, one program per group a tile can hold."""
    rng = np.random.default_rng(10 if m is None else m)
    if sizes is None:  # 9 random sizes, two forced empty, and 7 rows past the groups
        sizes = rng.integers(0, 30, 9)
        sizes[rng.choice(9, 2, replace=False)] = 0
        sizes, m = sizes.tolist(), int(sizes.sum()) + 7
    kdim, ndim = 80, 72
    lhs = rand(rng, (m, kdim), dtype)
    rhs = rand(rng, (len(sizes), kdim, ndim), dtype, scale=1 / math.sqrt(kdim))
    group_sizes = jnp.asarray(sizes, jnp.int32)

    got = mosaic_gpu.gmm(
        lhs, rhs, group_sizes, interpret=True, num_stages=stages, group_splits=splits, **MOSAIC_SMALL_TILES
    )
    ref = reference.gmm(lhs, rhs, group_sizes)
    ragged = jax.lax.ragged_dot(lhs, rhs, group_sizes)
    assert got.dtype == ref.dtype == dtype and got.shape == (m, ndim)

    tight = 1e-5 if dtype == jnp.float32 else 1e-2  # 16-bit: outputs rounded to 8 / 11 bits
    assert_close(got, ref, tight)
    assert_close(got, ragged, tight)
    assert_close(got, np_gmm(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes), 2 * tight)
    assert not np.asarray(got[sum(sizes) :]).any()


def test_mosaic_gmm_nan_outside_groups_never_leaks():
    """NaN rows past the groups share a tile with real rows and NaN weights belong to empty groups:
    neither reaches the output (rows past the groups are exact zeros, empty groups are never read)."""
    rng = np.random.default_rng(11)
    sizes, m = [3, 0, 49, 20, 0], 100  # rows 72..99 are past the groups, in the second tile
    lhs = rand(rng, (m, 64))
    rhs = rand(rng, (5, 64, 40), scale=0.2)
    poisoned_lhs = lhs.at[sum(sizes) :].set(jnp.nan)
    poisoned_rhs = rhs.at[1].set(jnp.nan).at[4].set(jnp.nan)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(mosaic_gpu.gmm(poisoned_lhs, poisoned_rhs, group_sizes, interpret=True, block_n=32))
    assert np.isfinite(got).all()
    assert not got[sum(sizes) :].any()
    assert_close(got[: sum(sizes)], np_gmm(lhs, rhs, sizes)[: sum(sizes)], 1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mosaic_gmm_fp8_matches_dequantised_matmul(dtype):
    """64x64 scale blocks (DeepSeek-V3's 128x128, scaled down) with partial edge blocks (kdim 200 =
    3 * 64 + 8, ndim 96 = 64 + 32), two n tiles per block column (block_n 32), an empty group and a
    group straddling the 64-row tiles. The kernel dequantises each tile as materialize does, so it
    matches the dequantised references as closely as a plain matmul does."""
    rng = np.random.default_rng(12)
    sizes, m = [9, 0, 70, 14], 99
    fp8 = rand_fp8(rng, 4, 200, 96, block=(64, 64))
    lhs = rand(rng, (m, 200), dtype)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = mosaic_gpu.gmm(lhs, fp8, group_sizes, interpret=True, block_n=32, block_k=64)
    want = np_gmm(lhs.astype(jnp.float32), materialize(fp8, dtype).astype(jnp.float32), sizes)
    tight = 1e-5 if dtype == jnp.float32 else 1e-2
    assert got.dtype == dtype
    assert_close(got, want, 2 * tight)
    assert_close(got, reference.gmm(lhs, fp8, group_sizes), tight)
    assert_close(got, pm.gmm(lhs, fp8, group_sizes, impl="ragged_dot"), tight)
    assert not np.asarray(got[sum(sizes) :]).any()


def test_mosaic_gmm_tile_and_dtype_errors():
    lhs, sizes = jnp.ones((6, 64), jnp.bfloat16), jnp.asarray([1, 2, 3], jnp.int32)
    rhs = jnp.ones((3, 64, 64), jnp.bfloat16)
    fp8 = Fp8Weight(
        w=jnp.ones((3, 64, 64), jnp.float8_e4m3fn),
        scale_inv=jnp.ones((3, 1, 1)),
        shape=(64, 64),
        block=(64, 64),
    )
    cases = [
        ({"block_m": 32}, rhs, "block_m must be a positive multiple of 64 .*got 32"),
        ({"block_k": 48}, rhs, r"block_k must be a multiple of 32 in \[32, 256\], got 48"),
        ({"block_n": 512}, rhs, r"block_n must be a multiple of 32 in \[32, 256\], got 512"),
        ({"block_m": 128, "block_n": 128}, rhs, r"block_m \* block_n must be <= 8192.*128 \* 128"),
        ({"num_stages": 1}, rhs, "num_stages must be >= 2, got 1"),
        ({"block_k": 32}, fp8, r"block_k a multiple of 64 dividing b_in .*block_k=32"),
        ({"block_n": 128}, fp8, r"\(b_in, b_out\) = \(64, 64\) .*block_n dividing b_out.*block_n=128"),
    ]
    for options, weights, message in cases:
        with pytest.raises(ValueError, match=message):
            mosaic_gpu.gmm(lhs, weights, sizes, interpret=True, **options)
    with pytest.raises(ValueError, match=r"lhs dtype must be one of \['bfloat16', 'float16'\] when compiled"):
        mosaic_gpu.gmm(lhs.astype(jnp.float32), rhs, sizes)


def _deepseek_fp8(experts: int = 256, spec=jax.ShapeDtypeStruct) -> Fp8Weight:
    """DeepSeek-V3 gate/up: 7168 -> 2048, 128x128 blocks (> 2**32 bytes for 256 experts)."""
    w = spec((experts, 7168, 2048), jnp.float8_e4m3fn)
    return Fp8Weight(
        w=w, scale_inv=spec((experts, 56, 16), jnp.float32), shape=(7168, 2048), block=(128, 128)
    )


@pytest.mark.parametrize(
    "case", ["bf16", "f16-small-tiles", "bf16-deep-pipeline", "fp8-deepseek-dims", "fp8-64-blocks"]
)
def test_mosaic_kernel_lowers_to_mosaic_gpu_for_cuda(case):
    """The native (non-interpret) path lowers to a Mosaic GPU module for CUDA on this CPU: every op has a
    Mosaic GPU lowering, the swizzles fit the wgmma and the shared memory fits a Hopper SM (ptxas and a
    GPU run are not checked here)."""
    spec = jax.ShapeDtypeStruct
    tiles = {}
    if case == "bf16":  # default tiles, m and kdim unaligned
        args = spec((100, 200), jnp.bfloat16), spec((8, 200, 384), jnp.bfloat16), spec((8,), jnp.int32)
    elif case == "f16-small-tiles":
        args = spec((37, 40), jnp.float16), spec((5, 40, 24), jnp.float16), spec((5,), jnp.int32)
        tiles = MOSAIC_SMALL_TILES
    elif case == "bf16-deep-pipeline":
        args = spec((300, 512), jnp.bfloat16), spec((4, 512, 256), jnp.bfloat16), spec((4,), jnp.int32)
        tiles = {"block_m": 128, "block_n": 64, "block_k": 128, "num_stages": 4}
    elif case == "fp8-deepseek-dims":
        args = spec((64, 7168), jnp.bfloat16), _deepseek_fp8(), spec((256,), jnp.int32)
    else:
        w = spec((4, 200, 96), jnp.float8_e4m3fn)
        fp8 = Fp8Weight(w=w, scale_inv=spec((4, 4, 2), jnp.float32), shape=(200, 96), block=(64, 64))
        args = spec((99, 200), jnp.bfloat16), fp8, spec((4,), jnp.int32)
        tiles = {"block_n": 32, "block_k": 64}
    fn = jax.jit(lambda lhs, rhs, sizes: mosaic_gpu.gmm(lhs, rhs, sizes, **tiles))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@hopper
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("rows", [32, 2048], ids=["decode", "prefill"])
def test_native_gmm_on_hopper(fp8, rows):
    """Compiled on the GPU at DeepSeek-V3 gate/up sizes (8 experts to keep the host-side random weights
    small), rows token copies plus 5 rows past the groups: against the reference, and what the
    dispatcher runs here."""
    rng = np.random.default_rng(13)
    experts = 8
    sizes = np.bincount(rng.integers(0, experts, rows), minlength=experts)
    sizes[3] = 0
    lhs = rand(rng, (rows + 5, 7168), jnp.bfloat16)
    if fp8:
        rhs = rand_fp8(rng, experts, 7168, 2048)
    else:
        rhs = rand(rng, (experts, 7168, 2048), jnp.bfloat16, scale=1 / math.sqrt(7168))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = mosaic_gpu.gmm(lhs, rhs, group_sizes)
    assert_close(got, reference.gmm(lhs, rhs, group_sizes), 1e-2)
    assert not np.asarray(got[int(sizes.sum()) :]).any()
    np.testing.assert_array_equal(pm.gmm(lhs, rhs, group_sizes), got)


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
        ("triton_interpret", jnp.float32),
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
        with pytest.raises(ValueError, match="impl='kernel'.*needs a Hopper GPU"):
            pm.select_impl("kernel")
        with pytest.raises(ValueError, match="impl='triton' needs an NVIDIA GPU"):
            pm.select_impl("triton")
    assert pm.select_impl("auto", fp8_block=(16, 8)) == "ragged_dot"  # no native tiles for 8 columns
    assert pm.select_impl("triton_interpret") == "triton_interpret"
    with pytest.raises(ValueError, match="impl must be one of"):
        pm.select_impl("pallas")
    monkeypatch.setenv(pm.ENV_VAR, "interpret")
    assert pm.select_impl("auto") == "interpret"
    assert pm.select_impl("ragged_dot") == "ragged_dot"  # an explicit impl wins over the environment
    monkeypatch.setenv(pm.ENV_VAR, "triton")  # shared with mla_decode: no Triton values
    with pytest.raises(ValueError, match="MTP_JAX_KERNELS.*'triton'"):
        pm.select_impl("auto")


@pytest.mark.parametrize("capability", [(9, 0), (8, 9), (8, 0), (10, 0)])
def test_select_impl_by_gpu(monkeypatch, capability):
    """What "auto" picks on each GPU generation (the capability query faked): the Mosaic GPU kernel on
    Hopper when it takes the inputs, the Triton kernel on other sm_80+ GPUs, ragged_dot otherwise."""
    monkeypatch.delenv(pm.ENV_VAR, raising=False)
    monkeypatch.setattr(pm, "_cuda_capability", lambda: capability)
    bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
    hopper, fp8_ok = capability[0] == 9, capability >= (8, 9)
    assert pm.select_impl("auto", dtype=bf16) == ("kernel" if hopper else "triton")
    deepseek = "kernel" if hopper else "triton" if fp8_ok else "ragged_dot"
    assert pm.select_impl("auto", fp8_block=(128, 128), dtype=bf16) == deepseek
    # float32 lhs and 32-row scale blocks: the compiled Mosaic GPU kernel takes neither; Triton does
    assert pm.select_impl("auto", dtype=f32) == ("ragged_dot" if hopper else "triton")
    assert pm.select_impl("auto", fp8_block=(32, 32), dtype=bf16) == ("ragged_dot" if hopper else deepseek)
    if hopper:
        assert pm.select_impl("kernel", fp8_block=(128, 128), dtype=bf16) == "kernel"
        with pytest.raises(ValueError, match="impl='kernel'.*cannot take lhs dtype float32"):
            pm.select_impl("kernel", dtype=f32)
        with pytest.raises(ValueError, match=r"impl='kernel'.*cannot take FP8 scale block \(32, 32\)"):
            pm.select_impl("kernel", fp8_block=(32, 32))
    else:
        with pytest.raises(ValueError, match="needs a Hopper GPU"):
            pm.select_impl("kernel", dtype=bf16)
    assert pm.select_impl("triton") == "triton"  # every capability here is >= 8.0


@pytest.mark.parametrize("capability", [(9, 0), (8, 0)])
def test_auto_falls_back_to_ragged_dot_when_the_kernel_does_not_compile(monkeypatch, capability):
    """On a (faked) Hopper / Ampere GPU "auto" picks the Mosaic GPU / Triton kernel, compiles it alone
    first and, as it cannot compile here, warns once per shape and runs ragged_dot."""
    from pallas_kernels import native

    monkeypatch.delenv(pm.ENV_VAR, raising=False)
    monkeypatch.setattr(pm, "_cuda_capability", lambda: capability)
    monkeypatch.setattr(native, "_RESULTS", {})
    rng = np.random.default_rng(4)
    lhs = jnp.asarray(rng.standard_normal((16, 64)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((3, 64, 32)), jnp.bfloat16)
    sizes = jnp.asarray([5, 0, 9], jnp.int32)
    family = "mosaic_gpu" if capability[0] == 9 else "triton"
    with pytest.warns(RuntimeWarning, match=rf"gmm \({family}\): the native kernel did not compile"):
        out = jax.jit(lambda a, b, c: pm.gmm(a, b, c))(lhs, rhs, sizes)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(pm.gmm(lhs, rhs, sizes, impl="ragged_dot")))


def test_environment_routes_the_dispatchers(monkeypatch):
    calls = []
    monkeypatch.setattr(reference, "gmm", lambda *a: calls.append("reference") or jnp.zeros((4, 3)))
    monkeypatch.setattr(
        mosaic_gpu,
        "gmm",
        lambda *a, interpret, **o: calls.append(("mosaic", interpret, o)) or jnp.zeros((4, 3)),
    )
    monkeypatch.setattr(
        kernel, "gmm", lambda *a, interpret, **o: calls.append(("triton", interpret, o)) or jnp.zeros((4, 3))
    )
    lhs, rhs, sizes = jnp.ones((4, 2)), jnp.ones((2, 2, 3)), jnp.asarray([1, 3], jnp.int32)
    for env, want in [("reference", "reference"), ("interpret", ("mosaic", True, {}))]:
        monkeypatch.setenv(pm.ENV_VAR, env)
        pm.gmm(lhs, rhs, sizes)
        assert calls.pop() == want
    # each kernel gets the options it takes
    options = {"block_n": 64, "num_warps": 8, "num_stages": 2}
    pm.gmm(lhs, rhs, sizes, impl="interpret", **options)
    assert calls.pop() == ("mosaic", True, {"block_n": 64, "num_stages": 2})
    pm.gmm(lhs, rhs, sizes, impl="triton_interpret", **options)
    assert calls.pop() == ("triton", True, options)
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
        pm.gmm(lhs, rhs, sizes, impl="pallas")


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
