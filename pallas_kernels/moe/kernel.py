"""Grouped matmul (MoE expert projections) as a Pallas Triton-backend kernel, bf16/f16/f32 and block-FP8.

``gmm(lhs [m, kdim], rhs [E, kdim, ndim], group_sizes [E]) -> [m, ndim]``: the rows of group e
(contiguous, groups in order from row 0) times rhs[e]; rows at or beyond sum(group_sizes) are zero.
Same contract as :func:`pallas_kernels.moe.reference.gmm`.

Layout. The grid is (ndim tiles, m tiles); one program owns one [block_m, block_n] output tile and
writes it exactly once. Group boundaries need not align with tiles: a program walks the non-empty
groups that overlap its rows (first one and a next-non-empty-group table come as small int32 inputs
computed here, the megablox metadata in another form), runs the whole kdim loop for each against
that group's rhs tile, and keeps from it only the rows inside the group (a select, so whatever sits
in the other rows, NaN included, never leaks). Empty groups cost nothing; a tile straddling g
groups costs g tile matmuls, as in any gmm. The kdim reduction is an in-kernel loop rather than a
grid axis because GPU programs of one grid run concurrently (no revisiting an output block).

FP8 (:class:`Fp8Weight`, block (b_in, b_out), 128x128 for DeepSeek-V3): block_k must divide b_in
and block_n b_out, so one scale covers a whole rhs tile. The tile is converted to lhs.dtype
(exact: every e4m3 value is a bf16/f16/f32 value) and the scale applied to the tile's float32
partial product: the dot with the dequantised tile up to rounding (closer to exact than rounding
w * scale to bf16 first, as ``materialize`` does), without a float32 copy of the tile.

Unaligned dims (m, ndim or kdim not multiples of the tiles) are zero-padded here before the call
(a copy): GPU loads through refs are not bounds-masked. DeepSeek-V3's expert dims (7168, 2048) are
multiples of 128, so in practice only the token rows are padded.

Permute and combine (:mod:`pallas_kernels.moe.reference`) stay jnp: an argsort plus a row gather,
and a scatter-add, each one bandwidth-bound pass that XLA already does well. A kernel would only pay
by fusing the gather into this kernel's lhs loads, which is left for later.

Backend. Written against the generic ``pl.pallas_call`` API (BlockSpecs, ``jnp.dot``, ``lax`` loops)
and compiled on NVIDIA GPUs by the Pallas **Triton** backend, selected explicitly through
``compiler_params=pallas.triton.CompilerParams`` because jax 0.10 defaults GPU ``pallas_call`` to
Mosaic GPU. The generic API cannot target Mosaic GPU for this kernel: Mosaic GPU has no lowering for
``dot_general`` on values (matmuls must be ``plgpu.wgmma`` on swizzled shared-memory refs, written
with ``plgpu.kernel``), and ``pl.pallas_call`` for Mosaic GPU is itself deprecated. The Triton
backend is deprecated from JAX 0.11 (and may not lower at all there), so the Mosaic GPU port,
:mod:`pallas_kernels.moe.mosaic_gpu`, is what the dispatcher runs on Hopper; this kernel stays
available as ``impl="triton"`` (what ``"auto"`` picks on non-Hopper GPUs of compute capability
>= 8.0) and ``impl="triton_interpret"``, for those GPUs and for comparison.

Run on an H100 (JAX 0.11.2, BENCHMARKS.md): bf16 correct at DeepSeek-V3's sizes (256 experts,
7.5 GB) and 0.7-1.4x the Mosaic GPU kernel's time; FP8 correct up to 128 experts x 7168 x 2048
(1.88 GB) and wrong beyond 2^31 bytes in one call, hence the split over experts in :func:`gmm`
(:data:`FP8_MAX_RHS_BYTES`), whose own GPU run is still to come. Not yet tuned (block sizes,
``num_warps``, ``num_stages``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels.fp8 import Fp8Weight
from pallas_kernels.moe.reference import pad_operands

LHS_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def tile_sizes(
    rhs: jax.Array | Fp8Weight, block_m: int, block_n: int | None, block_k: int | None, native: bool
) -> tuple[int, int, int]:
    """The (block_m, block_n, block_k) a call uses; ValueError if they cannot serve ``rhs``.

    Defaults: block_n 128, block_k 64, each lowered to the FP8 block size when that is smaller.
    Tiles are powers of two, at least 16 when compiled natively (Triton's dot minimum); FP8 tiles
    divide the scale block so each rhs tile has a single scale.
    """
    fp8_block = rhs.block if isinstance(rhs, Fp8Weight) else None
    if block_n is None:
        block_n = min(128, fp8_block[1]) if fp8_block else 128
    if block_k is None:
        block_k = min(64, fp8_block[0]) if fp8_block else 64
    tiles = {"block_m": block_m, "block_n": block_n, "block_k": block_k}
    for name, size in tiles.items():
        if not _is_pow2(size) or (native and size < 16):
            need = "a power of two >= 16 (native compile)" if native else "a power of two"
            raise ValueError(f"gmm kernel: {name} must be {need}, got {size}")
    if fp8_block and (fp8_block[0] % block_k or fp8_block[1] % block_n):
        raise ValueError(
            f"gmm kernel: FP8 rhs with scale block (b_in, b_out) = {fp8_block} needs block_k | b_in and "
            f"block_n | b_out, got block_k={block_k}, block_n={block_n}"
        )
    return block_m, block_n, block_k


def group_metadata(group_sizes: jax.Array, m: int, block_m: int) -> tuple[jax.Array, ...]:
    """Per-tile walk over the groups for a padded row count m_pad = ceil(m / block_m) * block_m.

    Returns (first [m_tiles]: the non-empty group holding the tile's first row, E if none;
    next [E]: the next non-empty group after g, E if none; starts [E+1]: first row of each group,
    with starts[E] = m_pad so a walk stops there; ends [E]: one past the last row), all int32.
    Group rows are clipped to [0, m); group sizes must be non-negative.
    """
    m_tiles = pl.cdiv(m, block_m)
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1], jnp.full(1, m_tiles * block_m, jnp.int32)])
    tile_rows = jnp.arange(m_tiles, dtype=jnp.int32) * block_m
    # ends is non-decreasing, so the first group ending after row r is non-empty and holds r.
    first = jnp.searchsorted(ends, tile_rows, side="right").astype(jnp.int32)
    nxt = jnp.searchsorted(ends, ends, side="right").astype(jnp.int32)
    return first, nxt, starts, ends


def _gmm_kernel(
    first_ref,
    next_ref,
    starts_ref,
    ends_ref,
    lhs_ref,
    rhs_ref,
    *refs,
    block_k,
    num_k,
    fp8_block,
    kdim_blocks,
    ndim_blocks,
):
    """One [block_m, block_n] output tile. lhs_ref [block_m, kdim_pad], rhs_ref [E, kdim_pad, block_n],
    scale_ref (FP8 only) [E * kdim_blocks * ndim_blocks] (the [E, kdim_blocks, ndim_blocks] scales
    flattened: one scalar load with no block strides; run correct on an H100 this way),
    out_ref [block_m, block_n]."""
    scale_ref, out_ref = refs if fp8_block else (None, refs[0])
    j, i = pl.program_id(0), pl.program_id(1)
    block_m, block_n = out_ref.shape
    rows = i * block_m + jax.lax.broadcasted_iota(jnp.int32, (block_m, block_n), 0)
    tile_end = (i + 1) * block_m

    def group_tile(g):
        def k_step(kk, acc):
            x = lhs_ref[:, pl.ds(kk * block_k, block_k)]
            w = rhs_ref[g, pl.ds(kk * block_k, block_k), :].astype(x.dtype)
            part = jnp.dot(x, w, preferred_element_type=jnp.float32)
            if fp8_block:  # scales flattened: [E * kdim_blocks * ndim_blocks], one scalar load
                b_in, b_out = fp8_block
                row = g * kdim_blocks + kk * block_k // b_in
                part = part * scale_ref[row * ndim_blocks + j * block_n // b_out]
            return acc + part

        return jax.lax.fori_loop(0, num_k, k_step, jnp.zeros((block_m, block_n), jnp.float32))

    # The loop condition only compares carried scalars: no ref reads in the while's cond region.
    def more(carry):
        _, start, _ = carry
        return start < tile_end

    def step(carry):
        g, start, out = carry
        inside = (rows >= start) & (rows < ends_ref[g])
        out = jnp.where(inside, group_tile(g), out)
        g = next_ref[g]
        return g, starts_ref[g], out

    g0 = first_ref[i]
    out0 = jnp.zeros((block_m, block_n), jnp.float32)
    _, _, out = jax.lax.while_loop(more, step, (g0, starts_ref[g0], out0))
    out_ref[...] = out.astype(out_ref.dtype)


FP8_MAX_RHS_BYTES = 2**31 - 1
"""The largest FP8 expert stack one kernel call reads. Measured on an H100 (JAX 0.11.2, Triton 3.6):
FP8 stacks of 128 experts x 7168 x 2048 (1.88 GB) gave correct results, 160 and 256 experts (2.35
and 3.76 GB) wrong values or an illegal address; bf16 stacks of 256 such experts (7.5 GB) were
correct. Larger FP8 stacks are split over the expert axis (see :func:`gmm`)."""


@functools.partial(
    jax.jit,
    static_argnames=(
        "block_m",
        "block_n",
        "block_k",
        "interpret",
        "num_warps",
        "num_stages",
        "max_rhs_bytes",
    ),
)
def gmm(
    lhs: jax.Array,
    rhs: jax.Array | Fp8Weight,
    group_sizes: jax.Array,
    *,
    block_m: int = 64,
    block_n: int | None = None,
    block_k: int | None = None,
    interpret: bool = False,
    num_warps: int = 4,
    num_stages: int = 3,
    max_rhs_bytes: int = FP8_MAX_RHS_BYTES,
) -> jax.Array:
    """Grouped matmul kernel: out [m, ndim] in lhs.dtype, float32 accumulation.

    lhs [m, kdim] bf16/f16/f32; rhs [E, kdim, ndim] float array (cast to lhs.dtype tile by tile) or
    :class:`Fp8Weight` (w [E, kdim, ndim] float8_e4m3fn, scale_inv [E, ceil(kdim/b_in),
    ceil(ndim/b_out)]); group_sizes [E] int, non-negative, sum <= m. Tiles: see :func:`tile_sizes`.
    ``interpret=True`` runs the kernel through the Pallas interpreter (any backend, CPU included).
    Shapes and dtypes are checked by the dispatcher :func:`pallas_kernels.moe.gmm`, not here.

    An FP8 stack over ``max_rhs_bytes`` (:data:`FP8_MAX_RHS_BYTES`) runs as one call per slice of
    experts that fits: each call sees its experts' rows moved to row 0 (a roll of lhs), and its
    output, zero outside those rows, is rolled back and summed. The slices of w are copies, so this
    is a correctness path, not a fast one (it only arises for stacks of 2 GB or more on one device).
    """
    if isinstance(rhs, Fp8Weight) and rhs.w.nbytes > max_rhs_bytes:
        num_experts = rhs.w.shape[0]
        per_call = max(1, max_rhs_bytes // (rhs.w.nbytes // num_experts))
        options = dict(
            block_m=block_m,
            block_n=block_n,
            block_k=block_k,
            interpret=interpret,
            num_warps=num_warps,
            num_stages=num_stages,
        )
        sizes = group_sizes.astype(jnp.int32)
        offsets = jnp.cumsum(sizes) - sizes  # first row of each expert's rows
        out = jnp.zeros((lhs.shape[0], rhs.w.shape[2]), jnp.float32)
        for a in range(0, num_experts, per_call):
            b = min(a + per_call, num_experts)
            part = Fp8Weight(rhs.w[a:b], rhs.scale_inv[a:b], rhs.shape, rhs.block)
            shifted = jnp.roll(lhs, -offsets[a], axis=0)
            got = gmm(shifted, part, sizes[a:b], **options)  # zero past the slice's rows
            out = out + jnp.roll(got, offsets[a], axis=0).astype(jnp.float32)
        return out.astype(lhs.dtype)
    block_m, block_n, block_k = tile_sizes(rhs, block_m, block_n, block_k, native=not interpret)
    m = lhs.shape[0]
    fp8_block = rhs.block if isinstance(rhs, Fp8Weight) else None
    w = rhs.w if fp8_block else rhs
    num_experts, _, ndim = w.shape
    first, nxt, starts, ends = group_metadata(group_sizes, m, block_m)

    lhs_p, w_p = pad_operands(lhs, w, block_m, block_n, block_k)
    m_pad, k_pad = lhs_p.shape
    n_pad = w_p.shape[2]
    operands = [first, nxt, starts, ends, lhs_p, w_p]

    def whole(x):
        return pl.BlockSpec(x.shape, lambda j, i: (0,) * x.ndim)

    in_specs = [
        whole(first),
        whole(nxt),
        whole(starts),
        whole(ends),
        pl.BlockSpec((block_m, k_pad), lambda j, i: (i, 0)),
        pl.BlockSpec((num_experts, k_pad, block_n), lambda j, i: (0, 0, j)),
    ]
    scale_blocks = (0, 0)
    if fp8_block:
        scale_blocks = rhs.scale_inv.shape[1:]
        operands.append(rhs.scale_inv.astype(jnp.float32).reshape(-1))
        in_specs.append(whole(operands[-1]))

    kernel = functools.partial(
        _gmm_kernel,
        block_k=block_k,
        num_k=k_pad // block_k,
        fp8_block=fp8_block,
        kdim_blocks=scale_blocks[0],
        ndim_blocks=scale_blocks[1],
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m_pad, n_pad), lhs.dtype),
        grid=(n_pad // block_n, m_pad // block_m),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda j, i: (i, j)),
        interpret=interpret,
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="moe_gmm",
    )(*operands)
    return out[:m, :ndim]
