"""Grouped matmul (MoE expert projections) as a Pallas Mosaic GPU kernel (Hopper), bf16/f16 and block-FP8.

``gmm(lhs [m, kdim], rhs [E, kdim, ndim], group_sizes [E]) -> [m, ndim]``: the rows of group e
(contiguous, groups in order from row 0) times rhs[e]; rows at or beyond sum(group_sizes) are zero;
whatever sits in rows outside a group (NaN included) never reaches the output. Same contract and
result (up to float32 summation order) as :func:`pallas_kernels.moe.reference.gmm` and the Triton
kernel :func:`pallas_kernels.moe.kernel.gmm`; this is the port that replaces the latter on Hopper,
since the Pallas Triton backend is deprecated from JAX 0.11.

Backend: Pallas **Mosaic GPU** (``jax.experimental.pallas.mosaic_gpu``) written with
``plgpu.kernel``, one warpgroup per program, the pattern of
:mod:`pallas_kernels.mla_decode.kernel`: TMA copies (``copy_gmem_to_smem``) into swizzled shared
memory tiles, an mbarrier per pipeline slot, ``wgmma`` from shared memory into a float32
``plgpu.ACC`` accumulator, and the output staged through shared memory (``copy_smem_to_gmem``).

Layout. The grid is (m tiles, ndim tiles), m fastest so that programs sharing an expert's weight
tile run side by side (L2 reuse); one program owns one [block_m, block_n] output tile and writes it
exactly once. The wrapper computes a walk over the groups (:func:`group_walk`): the non-empty groups
in order (id, first row, end row) and, per m tile, the half-open range of them overlapping its rows.
A program loops over that range; for each group it runs the whole kdim loop against that expert's
rhs tile into a fresh accumulator and keeps from it only the rows inside the group (a select, so
NaN in other rows never leaks). Empty groups cost nothing; a tile straddling g groups costs g tile
matmuls, as in any gmm. A tile past all groups runs no step and writes zeros.

Pipeline. The (group, k) steps of a program form one sequence of ``(hi - lo) · kdim/block_k`` steps
over ``num_stages`` shared-memory slots: the lhs and rhs tiles of step ``s + num_stages - 1`` are
in flight while step ``s`` is multiplied, across group boundaries too. After issuing the wgmma of
step ``s`` the program waits for the one of step ``s - 1`` (``wgmma_wait(1)``) and only then
refills that slot. ``num_stages >= 2``.

FP8 (:class:`Fp8Weight`, scale block (b_in, b_out), 128x128 for DeepSeek-V3). wgmma needs both
operands of one 16-bit type, so each float8_e4m3fn rhs tile is copied by TMA into its own shared
memory slot, loaded into registers, dequantised there exactly as :func:`materialize` does
(``(w.astype(float32) * scale).astype(lhs.dtype)``, one scale per tile since block_k | b_in and
block_n | b_out), stored into a 16-bit swizzled buffer (two of them, alternating, so the store of
step s never races the wgmma of step s - 1), fenced with ``plgpu.commit_smem()`` and fed to the
wgmma. The weights the matmul sees are therefore bit-identical to ``materialize(rhs, lhs.dtype)``,
so the result matches the reference and the ragged_dot path up to summation order (the Triton
kernel instead scales each tile's float32 partial product, slightly more exact for bf16). The
alternative, a wgmma on the unscaled tile into a second accumulator that is scaled and added per
k-block, would need one more 64 x block_n float32 register tile and still the conversion through
registers, so it buys nothing here.

Tiles. ``block_m`` is a multiple of 64 (the wgmma M tile of a warpgroup; the accumulator and the
selected output are two block_m x block_n float32 register tiles, so keep block_m · block_n <=
8192). ``block_k`` and ``block_n`` are multiples of 32 in [32, 256]; the shared-memory swizzle is
the largest of 128/64/32 bytes whose width divides both (wgmma uses one swizzle for both operands).
Defaults 64 x 128 x 64 (128 and 64 lowered to the FP8 block when that is smaller). Shared memory:
``num_stages`` x (lhs tile + rhs tile), plus two 16-bit dequantised tiles for FP8 (72 KiB / 80 KiB at
the defaults); a configuration over the SM's 227 KiB fails at lowering with Mosaic GPU's own
"exceeds available shared memory" error. Unaligned m, ndim and kdim are zero-padded by the wrapper
(a copy), as TMA boxes are fixed-size; DeepSeek-V3's expert dims (7168, 2048) need no padding.

Dtypes. Native: lhs bfloat16 / float16 with rhs of the same dtype (other float rhs are cast by the
wrapper, a copy) or FP8. float32 lhs runs in interpret mode only (a native wgmma on float32 would be
tf32); :func:`gmm` raises ValueError for it natively.

Interpret mode. On CPU the kernel runs in Mosaic GPU interpret mode (``InterpretGPUParams``,
simulated shared memory, barriers, TMA and wgmma from shared memory; fresh buffers, outputs
included, are NaN, so an unwritten tile shows up). Unlike the MLA kernel, every wgmma here takes
both operands from shared memory, which the interpreter supports, so interpret mode runs the very
code that compiles; the only difference is that register-layout casts (``plgpu.layout_cast``, which
has no CPU rule) are skipped.

Verified: interpret-mode results on CPU against the reference, ``jax.lax.ragged_dot`` and numpy
(bf16, f16, f32, FP8 with partial scale blocks; ragged, empty and tile-straddling groups, NaN outside
groups, unaligned shapes, pipeline depths 2-4, group splits), the group walk against a numpy overlap
list, lowering to a Mosaic GPU module for CUDA from the CPU, and on an H100 (JAX 0.11.2) the native
compile and results at DeepSeek-V3 sizes (``test_native_gmm_on_hopper``: bf16 and FP8, 32 and 2048
rows). The interpreter executes copies and wgmmas synchronously, so it cannot show a slot refilled
too early; the barrier protocol (arrival counts, phases) it does check.

Decode. With m <= 64 token copies there are only ndim / block_n output tiles (16 for DeepSeek-V3's
2048 columns at block_n 128) for 132 SMs, each walking every group of its rows. ``group_splits``
programs share a tile: program g takes the tile's groups g, g + group_splits, ... and writes a
partial tile, zero outside its groups' rows; the wrapper sums the partial tiles (exact: each row
belongs to one group). The default (:func:`default_group_splits`) adds splits until about 132
programs run, at most as many as a tile can hold groups: one program per expert at decode sizes.
Measured on an H100 inside a DeepSeek-V3 step (3 layers, FP8, batch 1, 8 token copies): 430 -> 81
us per call, about 1.45 TB/s against 2.9 TB/s of copy bandwidth. Each 64-row wgmma still wastes most
of its rows on a few tokens; swapping the operands (out^T = rhs^T lhs^T puts the weight columns on
the wgmma M side) is the next step. For prefill, a producer warp
(``emit_pipeline_warp_specialized``) and two consumer warpgroups per program are the usual next steps.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8 import Fp8Weight
from pallas_kernels.moe.reference import pad_operands

NATIVE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
LHS_DTYPES = (*NATIVE_DTYPES, jnp.dtype(jnp.float32))
WGMMA_M = 64  # rows of one wgmma instruction (one warpgroup)
TILE_QUANTUM = 32  # block_k / block_n granularity (a 32-byte swizzle of fp8 needs 32 columns)
MAX_TILE = 256  # TMA box and wgmma N limit
MAX_TILE_ELEMENTS = 64 * 128  # block_m * block_n: register budget of the two float32 tiles
DEFAULT_BLOCK_N = 128
DEFAULT_BLOCK_K = 64
DEFAULT_STAGES = 3
TARGET_PROGRAMS = 132  # an H100 / H200 has 132 SMs
_BIG = 2**30  # start/end of the padding entries of the group walk: past every row

_ROW = plgpu.Layout.WGMMA.reduce(1)


@dataclasses.dataclass(frozen=True)
class _Dims:
    """Static sizes of one launch (padded)."""

    block_m: int
    block_n: int
    block_k: int
    num_k: int  # k steps per group
    stages: int
    dtype: jnp.dtype  # lhs / wgmma operand dtype
    rhs_dtype: jnp.dtype  # dtype of the rhs in memory: dtype, or float8_e4m3fn
    fp8_block: tuple[int, int] | None
    interpret: bool  # no register layouts in interpret mode
    group_splits: int  # programs sharing one output tile's groups (strided), each a partial output


def interpret_params(**kwargs: Any) -> Any:
    """Mosaic GPU interpret-mode parameters (``InterpretGPUParams``; kwargs such as detect_races).

    By default the interpreter fills fresh buffers (the output, shared memory) with NaN and raises
    on an out-of-bounds read.
    """
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(**kwargs)


def tile_sizes(
    fp8_block: tuple[int, int] | None, block_m: int, block_n: int | None, block_k: int | None
) -> tuple[int, int, int]:
    """The (block_m, block_n, block_k) a call uses; ValueError if they cannot serve the rhs.

    fp8_block: the (b_in, b_out) scale block of an FP8 rhs, None for a float array.

    block_m: a positive multiple of 64 (the wgmma M tile). block_n / block_k: multiples of 32 in
    [32, 256], defaults 128 / 64, each lowered to the FP8 block when that is smaller. block_m ·
    block_n <= 8192: the accumulator and the selected output are two float32 register tiles of a
    warpgroup (64 registers per thread each at 64 x 128). FP8 rhs: block_k a multiple of 64 (the
    tile is dequantised in the wgmma register layout, 64 rows at a time) dividing b_in, block_n
    dividing b_out (one scale per rhs tile). The same rules hold in interpret mode, so the
    interpreted kernel is the one that compiles.
    """
    if block_n is None:
        block_n = min(DEFAULT_BLOCK_N, fp8_block[1]) if fp8_block else DEFAULT_BLOCK_N
    if block_k is None:
        block_k = min(DEFAULT_BLOCK_K, fp8_block[0]) if fp8_block else DEFAULT_BLOCK_K
    if block_m < WGMMA_M or block_m % WGMMA_M:
        raise ValueError(
            f"gmm Mosaic GPU kernel: block_m must be a positive multiple of {WGMMA_M} (the wgmma M "
            f"tile), got {block_m}"
        )
    for name, size in (("block_n", block_n), ("block_k", block_k)):
        if size % TILE_QUANTUM or not TILE_QUANTUM <= size <= MAX_TILE:
            raise ValueError(
                f"gmm Mosaic GPU kernel: {name} must be a multiple of {TILE_QUANTUM} in "
                f"[{TILE_QUANTUM}, {MAX_TILE}], got {size}"
            )
    if block_m * block_n > MAX_TILE_ELEMENTS:
        raise ValueError(
            f"gmm Mosaic GPU kernel: block_m * block_n must be <= {MAX_TILE_ELEMENTS} (two float32 "
            f"register tiles per warpgroup), got {block_m} * {block_n}"
        )
    if fp8_block and (block_k % WGMMA_M or fp8_block[0] % block_k or fp8_block[1] % block_n):
        raise ValueError(
            f"gmm Mosaic GPU kernel: FP8 rhs with scale block (b_in, b_out) = {fp8_block} needs block_k "
            f"a multiple of {WGMMA_M} dividing b_in and block_n dividing b_out, got block_k={block_k}, "
            f"block_n={block_n}"
        )
    return block_m, block_n, block_k


def _swizzle(*minor_bytes: int) -> int:
    """The largest swizzle (bytes) dividing every minor width (all multiples of 32 bytes here)."""
    return next(s for s in (128, 64, 32) if all(b % s == 0 for b in minor_bytes))


def _transforms(dtype, swizzle: int) -> tuple:
    return (
        plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )


def group_walk(group_sizes: jax.Array, m: int, block_m: int) -> tuple[jax.Array, jax.Array]:
    """The groups each m tile walks: (groups [3, E], tiles [2, m_tiles]), int32.

    groups[:, p] = (id, first row, end row) of the p-th non-empty group, in order (rows clipped to
    [0, m); padding entries past the non-empty ones are (E, 2**30, 2**30)). tiles[:, i] = (lo, hi):
    the non-empty groups overlapping rows [i·block_m, (i+1)·block_m) are groups[:, lo:hi].
    Group sizes must be non-negative.
    """
    num_groups = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1]])
    nonempty = ends > starts
    order = jnp.argsort(~nonempty, stable=True).astype(jnp.int32)  # non-empty groups first, in order
    live = jnp.arange(num_groups) < nonempty.sum()
    ids = jnp.where(live, order, num_groups)
    first = jnp.where(live, starts[order], _BIG)
    end = jnp.where(live, ends[order], _BIG)
    tile_start = jnp.arange(pl.cdiv(m, block_m), dtype=jnp.int32) * block_m
    lo = jnp.searchsorted(end, tile_start, side="right")  # first group ending after the tile's start
    hi = jnp.searchsorted(first, tile_start + block_m, side="left")  # groups starting before its end
    return jnp.stack([ids, first, end]).astype(jnp.int32), jnp.stack([lo, hi]).astype(jnp.int32)


def _cast(x: jax.Array, layout, d: _Dims) -> jax.Array:
    """Pin x to a register layout; interpret mode has no layouts (and no CPU rule for the cast)."""
    return x if d.interpret else plgpu.layout_cast(x, layout)


def _dequantise(w_smem, scale, deq_smem, d: _Dims) -> None:
    """deq_smem [block_k, block_n] (d.dtype) = w_smem (float8_e4m3fn) · scale, as materialize rounds."""
    w = w_smem[...].astype(jnp.float32) * scale
    deq_smem[...] = w.astype(d.dtype)
    plgpu.commit_smem()  # every thread's stores, visible to the wgmma (async proxy)


def _walk(
    groups_ref, tiles_ref, lhs_ref, rhs_ref, scale_ref, *, lhs_smem, rhs_smem, bars, deq_smem=None, d: _Dims
):
    """One program's walk over its groups; returns the [block_m, block_n] float32 output tile."""
    i = lax.axis_index("m")
    j = lax.axis_index("n")
    # This program's groups: the tile's walk lo, lo+1, ... hi-1 taken from lo + split, every
    # group_splits-th one.
    first = tiles_ref[0, i] + lax.axis_index("g")
    hi = tiles_ref[1, i]
    mine = lax.div(jnp.maximum(hi - first + d.group_splits - 1, 0), d.group_splits)
    num_steps = mine * d.num_k
    row0 = i * d.block_m

    def fetch(s):
        """Start the copies of step s (the program's group s // num_k, k block s % num_k) into its slot."""
        p = first + lax.div(s, d.num_k) * d.group_splits
        kk = lax.rem(s, d.num_k)
        slot = lax.rem(s, d.stages)
        g = groups_ref[0, p]
        plgpu.copy_gmem_to_smem(
            lhs_ref.at[pl.ds(row0, d.block_m), pl.ds(kk * d.block_k, d.block_k)],
            lhs_smem.at[slot],
            bars.at[slot],
        )
        plgpu.copy_gmem_to_smem(
            rhs_ref.at[g, pl.ds(kk * d.block_k, d.block_k), pl.ds(j * d.block_n, d.block_n)],
            rhs_smem.at[slot],
            bars.at[slot],
        )

    for s in range(d.stages - 1):  # prologue: the first stages - 1 steps
        pl.when(s < num_steps)(functools.partial(fetch, s))

    def group(q, out):
        p = first + q * d.group_splits
        g = groups_ref[0, p]
        base = q * d.num_k

        def k_loop(acc_ref):
            def step(kk, carry):
                s = base + kk
                slot = lax.rem(s, d.stages)
                plgpu.barrier_wait(bars.at[slot])
                b = rhs_smem.at[slot]
                if d.fp8_block:
                    b_in, b_out = d.fp8_block
                    scale = scale_ref[g, lax.div(kk * d.block_k, b_in), lax.div(j * d.block_n, b_out)]
                    b = deq_smem.at[lax.rem(s, 2)]
                    _dequantise(rhs_smem.at[slot], scale, b, d)
                plgpu.wgmma(acc_ref, lhs_smem.at[slot], b)
                plgpu.wgmma_wait(1)  # the wgmma of step s - 1 is done: its slot may be refilled

                @pl.when(s + d.stages - 1 < num_steps)
                def _():
                    fetch(s + d.stages - 1)

                return carry

            lax.fori_loop(0, d.num_k, step, None)
            return acc_ref[...]

        acc = pl.run_scoped(k_loop, plgpu.ACC((d.block_m, d.block_n), jnp.float32))
        rows = _cast(lax.broadcasted_iota(jnp.int32, (d.block_m,), 0), _ROW, d) + row0
        rows = lax.broadcast_in_dim(rows, acc.shape, [0])
        inside = (rows >= groups_ref[1, p]) & (rows < groups_ref[2, p])
        return jnp.where(inside, acc, out)

    out = _cast(jnp.zeros((d.block_m, d.block_n), jnp.float32), plgpu.Layout.WGMMA, d)
    return lax.fori_loop(0, mine, group, out)


def _kernel(groups_ref, tiles_ref, lhs_ref, rhs_ref, *refs, d: _Dims):
    """One [block_m, block_n] output tile; refs = ([scale_ref (FP8 only)], out_ref)."""
    scale_ref, out_ref = refs if d.fp8_block else (None, refs[0])
    itemsize = d.dtype.itemsize
    operand = _transforms(d.dtype, _swizzle(d.block_k * itemsize, d.block_n * itemsize))
    scratch = {
        "lhs_smem": plgpu.SMEM((d.stages, d.block_m, d.block_k), d.dtype, transforms=operand),
        # The wgmma operand, or for FP8 the raw 1-byte tiles (with their own swizzle).
        "rhs_smem": plgpu.SMEM(
            (d.stages, d.block_k, d.block_n),
            d.rhs_dtype,
            transforms=_transforms(d.rhs_dtype, _swizzle(d.block_n)) if d.fp8_block else operand,
        ),
        "bars": plgpu.Barrier(num_arrivals=2, num_barriers=d.stages),  # the lhs and rhs copy of a step
    }
    if d.fp8_block:  # the dequantised rhs tiles the wgmma reads, two alternating
        scratch["deq_smem"] = plgpu.SMEM((2, d.block_k, d.block_n), d.dtype, transforms=operand)
    out = pl.run_scoped(
        functools.partial(_walk, groups_ref, tiles_ref, lhs_ref, rhs_ref, scale_ref, d=d), **scratch
    )
    out = out.astype(out_ref.dtype)
    rows = pl.ds(lax.axis_index("m") * d.block_m, d.block_m)
    cols = pl.ds(lax.axis_index("n") * d.block_n, d.block_n)
    target = out_ref.at[rows, cols] if d.group_splits == 1 else out_ref.at[lax.axis_index("g"), rows, cols]

    # A second scope, so the output tile reuses the shared memory of the pipeline's buffers.
    def store(out_smem):
        out_smem[...] = out
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, target)
        plgpu.wait_smem_to_gmem(0)

    out_transforms = _transforms(d.dtype, _swizzle(d.block_n * itemsize))
    pl.run_scoped(store, plgpu.SMEM((d.block_m, d.block_n), d.dtype, transforms=out_transforms))


def default_group_splits(m: int, experts: int, tiles: int, block_m: int) -> int:
    """Programs to share each output tile's groups when ``tiles`` (m tiles x n tiles) programs
    would leave SMs idle: enough to reach about :data:`TARGET_PROGRAMS`, at most the groups one
    tile can hold (min(experts, rows of a tile))."""
    return max(1, min(-(-TARGET_PROGRAMS // tiles), experts, block_m, m))


@functools.partial(
    jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_stages", "group_splits", "interpret")
)
def gmm(
    lhs: jax.Array,
    rhs: jax.Array | Fp8Weight,
    group_sizes: jax.Array,
    *,
    block_m: int = WGMMA_M,
    block_n: int | None = None,
    block_k: int | None = None,
    num_stages: int = DEFAULT_STAGES,
    group_splits: int | None = None,
    interpret: Any = False,
) -> jax.Array:
    """Grouped matmul on a Hopper GPU: out [m, ndim] in lhs.dtype, float32 accumulation.

    lhs [m, kdim] bf16/f16 (f32 in interpret mode only); rhs [E, kdim, ndim] float array (cast to
    lhs.dtype if it differs) or :class:`Fp8Weight` (w [E, kdim, ndim] float8_e4m3fn, scale_inv
    [E, ceil(kdim/b_in), ceil(ndim/b_out)]); group_sizes [E] int, non-negative, sum <= m. Tiles: see
    :func:`tile_sizes`; ``num_stages`` (>= 2) shared-memory slots in the copy pipeline.
    ``group_splits``: programs per output tile, each taking every ``group_splits``-th of the tile's
    groups and writing a partial output tile (zero outside its groups' rows) that are summed after
    the kernel (exact: each row is one group's); None picks :func:`default_group_splits` (decode
    sizes: one program per group instead of one SM per column tile walking all of them).
    ``interpret`` True (or an :func:`interpret_params` object) runs the kernel in Mosaic GPU interpret
    mode on any backend; otherwise it compiles for a Hopper GPU. Shapes and dtypes are checked by the
    dispatcher :func:`pallas_kernels.moe.gmm`; this checks what only the kernel requires.
    """
    fp8_block = rhs.block if isinstance(rhs, Fp8Weight) else None
    block_m, block_n, block_k = tile_sizes(fp8_block, block_m, block_n, block_k)
    if num_stages < 2:
        raise ValueError(f"gmm Mosaic GPU kernel: num_stages must be >= 2, got {num_stages}")
    if group_splits is not None and group_splits < 1:
        raise ValueError(f"gmm Mosaic GPU kernel: group_splits must be >= 1, got {group_splits}")
    dtype = jnp.dtype(lhs.dtype)
    if dtype not in LHS_DTYPES or (not interpret and dtype not in NATIVE_DTYPES):
        allowed = LHS_DTYPES if interpret else NATIVE_DTYPES
        raise ValueError(
            f"gmm Mosaic GPU kernel: lhs dtype must be one of {[str(t) for t in allowed]}"
            f"{'' if interpret else ' when compiled (float32 runs in interpret mode only)'}, got {dtype}"
        )
    w = rhs.w if fp8_block else rhs.astype(dtype)
    (m, kdim), ndim = lhs.shape, w.shape[2]
    if not m * kdim * ndim:  # nothing to launch: an empty sum is zero
        return jnp.zeros((m, ndim), dtype)
    groups, walk = group_walk(group_sizes, m, block_m)
    lhs_p, w_p = pad_operands(lhs, w, block_m, block_n, block_k)
    m_pad, k_pad = lhs_p.shape
    n_pad = w_p.shape[2]
    tiles = (m_pad // block_m, n_pad // block_n)
    if group_splits is None:
        group_splits = default_group_splits(m, w.shape[0], math.prod(tiles), block_m)
    d = _Dims(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        num_k=k_pad // block_k,
        stages=num_stages,
        dtype=dtype,
        rhs_dtype=jnp.dtype(w.dtype),
        fp8_block=fp8_block,
        interpret=bool(interpret),
        group_splits=group_splits,
    )
    operands = [groups, walk, lhs_p, w_p]
    if fp8_block:
        operands.append(rhs.scale_inv.astype(jnp.float32))
    if interpret is True:
        interpret = interpret_params()
    parts = () if group_splits == 1 else (group_splits,)
    call = plgpu.kernel(
        functools.partial(_kernel, d=d),
        out_type=jax.ShapeDtypeStruct((*parts, m_pad, n_pad), dtype),
        grid=(*tiles, group_splits),
        grid_names=("m", "n", "g"),
        interpret=interpret or None,
        kernel_name="moe_gmm",
    )
    out = call(*operands)
    if group_splits > 1:  # each element is non-zero in at most one part: the sum is exact
        out = out.sum(axis=0, dtype=dtype)
    return out[:m, :ndim]
