"""MLA decode attention over a paged latent cache, as a Pallas Mosaic GPU kernel (Hopper).

Backend: Pallas **Mosaic GPU** (``jax.experimental.pallas.mosaic_gpu``), written with
``plgpu.kernel``: TMA copies of cache pages into shared memory, ``wgmma`` for both products, one
or two warpgroups per program. The generic ``pl.pallas_call`` cannot express it on Mosaic GPU in jax 0.10:
that lowering rejects scalar prefetch and has no ``dot_general`` rule, so the paged gather and the
matmuls are written with the ``plgpu`` primitives. On CPU the same kernel runs in Mosaic GPU
interpret mode (``InterpretGPUParams``: simulated shared memory, barriers and TMA; NaN-filled fresh
buffers; out-of-bounds reads raise). That interpreter has no ``wgmma`` with a register or
transposed operand, no ``run_state`` and no register layouts, so in interpret mode (and only there)
the two products are ``jnp.dot`` on the shared-memory tiles and layout casts are skipped;
everything else (page-table walk, copies, barriers, double buffering, masking, online softmax,
split combination, output staging) is the code that compiles.

Two schedules (``schedule=``), one contract:

- **single**: grid ``(B, row_blocks, value_blocks, splits)``, one warpgroup per program. Queries
  are flattened to rows ``r = t·H + h`` and padded to blocks of 64 rows (the ``wgmma`` M tile);
  ``value_dim`` is cut into blocks of at most 256 columns so the float32 accumulator fits the
  warpgroup's registers. Each program streams its row's keys itself and scores every key, so at
  DeepSeek-V3's widths (two value blocks) each key is scored twice.
- **shared**: grid ``(B, row_blocks, splits)``, two warpgroups per program sharing each key block
  (:func:`_shared_kernel`): warpgroup 0 scores it and runs the softmax, hands the probabilities to
  warpgroup 1 through shared memory, and each accumulates half of the value columns. A third less
  tensor work per key at DeepSeek-V3's widths and half the programs reading each key; it needs
  every byte of the 227 KiB of shared memory (queries, two key blocks, the probabilities).

Both stream keys in blocks of 64 positions (several whole pages, or a 64-row slice of a larger
page), double-buffered: the copy of block ``j+1`` is in flight while block ``j`` is computed. A
program runs only ``ceil((max_t positions[b, t] + 1) / 64)`` blocks, reads page-table entries of
needed pages only, and keeps a running max / sum / accumulator in float32 (online softmax), so a
long context costs no more memory than a short one. With ``splits > 1`` (flash-decoding, for few
programs and long contexts) each program takes a contiguous share of the key blocks and writes a
float32 partial output plus its log-sum-exp; a small jnp epilogue combines them. ``"auto"``
(the default) runs the shared schedule where its programs get at least ``SHARED_MIN_BLOCKS`` key
blocks each (:func:`pick_schedule`), the single one elsewhere.

Layout requirements: the latent width ``C`` and ``value_dim`` are padded to multiples of 64
(DeepSeek-V3's 576 / 512 need none; a small width is padded by copying the cache, fine for tests
only); ``page_size`` must be a multiple of 8 that divides 64, or a multiple of 64. Native ``wgmma``
takes 16-bit operands: bfloat16 / float16 compile, float32 runs in interpret mode only.

A masked key still enters ``p @ V`` with probability 0, so cache rows of a needed page past the
query positions must be finite (the cache is zero-initialised and only holds finished rows).
Pages past the needed ones are never read.

Verified: interpret-mode results on CPU against the reference, lowering of the native path to a
Mosaic GPU module from the CPU (``jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))``),
and on an H100 and an H200 (JAX 0.11.2) the native compile and results of both schedules
(``test_native_kernel_deepseek_sizes`` in ``tests/pallas_kernels/test_mla_decode.py``: DeepSeek-V3
heads and widths, 32k positions, page sizes 16 and 64, one and automatic splits).

Speed on an H200 (device time; BENCHMARKS.md, "On an NVIDIA H200"): at 64 rows x 32k positions the
shared schedule runs 1273 us with one query token per row (459 TFLOP/s, 47% of the copy bandwidth)
and 4445 us with four (526 TFLOP/s), against 1600 / 6318 us for the single one. With 128 heads
MLA decode does about 240 flops per byte read per query token, above an H200's ratio of matrix
rate to bandwidth (about 200), so it is bound by the tensor cores, not by memory: the copy
bandwidth is out of reach at these sizes, and the measure to watch is the matrix rate (the best
kernels reach about two thirds of the peak).
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

BLOCK_ROWS = 64  # wgmma M tile: query rows (t, h) per program
BLOCK_KEYS = 64  # key positions per pipeline step
MAX_VALUE_BLOCK = 256  # float32 accumulator columns per program (128 registers per thread)
LANE = 64  # C and value_dim are padded to this (128-byte swizzle of 16-bit data)
NUM_BUFFERS = 2
NATIVE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Split the keys until about this many programs run (an H100 / H200 has 132 SMs), keeping at least
# MIN_BLOCKS_PER_SPLIT key blocks per split.
TARGET_PROGRAMS = 132
MIN_BLOCKS_PER_SPLIT = 4

_LOG2E = math.log2(math.e)
_ROW = plgpu.Layout.WGMMA.reduce(1)


@dataclasses.dataclass(frozen=True)
class _Dims:
    """Static sizes of one launch (padded)."""

    heads: int
    tokens: int
    width: int  # C padded to LANE
    value_block: int
    page_size: int
    max_keys: int  # N·S: positions past this have no page
    splits: int
    dtype: jnp.dtype
    interpret: bool  # interpret mode: jnp matmuls, no register layouts

    @property
    def copies_per_block(self) -> int:
        return max(1, BLOCK_KEYS // self.page_size)

    @property
    def rows_per_copy(self) -> int:
        return min(self.page_size, BLOCK_KEYS)


def interpret_params(**kwargs: Any) -> Any:
    """Mosaic GPU interpret-mode parameters (``InterpretGPUParams``; kwargs such as detect_races).

    By default the interpreter fills fresh buffers (the output, shared memory) with NaN and raises
    on an out-of-bounds read, so an unwritten output tile or a read past the cache shows up.
    """
    # Not re-exported under jax.experimental in jax 0.10.
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(**kwargs)


def check_page_size(page_size: int) -> None:
    """Raise ValueError unless ``page_size`` tiles the 64-position key blocks."""
    if page_size % 8 or not (BLOCK_KEYS % page_size == 0 or page_size % BLOCK_KEYS == 0):
        raise ValueError(
            f"mla_decode kernel: page_size must be a multiple of 8 that divides {BLOCK_KEYS} or a "
            f"multiple of {BLOCK_KEYS}, got {page_size}"
        )


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _value_block(value_padded: int) -> int:
    return max(b for b in range(LANE, MAX_VALUE_BLOCK + 1, LANE) if value_padded % b == 0)


def default_splits(programs: int, max_keys: int) -> int:
    """Key splits for ``programs`` (batch × row blocks × value blocks) over ``max_keys`` positions,
    each split at least MIN_BLOCKS_PER_SPLIT key blocks."""
    max_blocks = -(-max_keys // BLOCK_KEYS)
    return max(1, min(-(-TARGET_PROGRAMS // programs), max_blocks // MIN_BLOCKS_PER_SPLIT))


def _smem_transforms(dtype) -> tuple:
    minor = 128 // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, minor)), plgpu.SwizzleTransform(128))


def _cast(x: jax.Array, layout, d: _Dims) -> jax.Array:
    """Pin x to a register layout; interpret mode has no layouts (and no CPU rule for the cast)."""
    return x if d.interpret else plgpu.layout_cast(x, layout)


def _scores(q_smem, keys, d: _Dims) -> jax.Array:
    """q [64, c] · keys [n, c]ᵀ, both in shared memory -> [64, n] float32."""
    if d.interpret:
        return jnp.dot(q_smem[...], keys[...].T, preferred_element_type=jnp.float32)

    def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(keys, (1, 0)))
        return acc_ref[...]

    return pl.run_scoped(qk, plgpu.ACC((BLOCK_ROWS, keys.shape[0]), jnp.float32))


def _accumulate(acc: jax.Array, p, values, d: _Dims) -> jax.Array:
    """acc [64, n] float32 + p [64, k] (registers, or a shared-memory ref) @ values [k, n] (shared
    memory)."""
    if d.interpret:
        p = p if isinstance(p, jax.Array) else p[...]
        return acc + jnp.dot(p, values[...], preferred_element_type=jnp.float32)

    # The wgmma accumulates into acc's own registers; a second [64, n] tile would not fit.
    def pv(acc_ref):
        plgpu.wgmma(acc_ref, p, values)

    return pl.run_state(pv)(plgpu.ACC.init(acc))


def _row_positions(pos_ref, b, r0, d: _Dims) -> jax.Array:
    """Absolute position of each of the block's 64 query rows, -1 for padding rows: [64] int32."""
    row = _cast(lax.broadcasted_iota(jnp.int32, (BLOCK_ROWS,), 0), _ROW, d) + r0
    row_pos = _cast(jnp.full((BLOCK_ROWS,), -1, jnp.int32), _ROW, d)
    for t in range(d.tokens):
        in_t = (row >= t * d.heads) & (row < (t + 1) * d.heads)
        row_pos = jnp.where(in_t, pos_ref[b, t], row_pos)
    return row_pos


def _block_range(pos_ref, b, split, d: _Dims):
    """(first, stop, max_pos): this split's key blocks [first, stop) of the row's needed ones."""
    max_pos = pos_ref[b, 0]
    for t in range(1, d.tokens):
        max_pos = jnp.maximum(max_pos, pos_ref[b, t])
    # Positions past the table are a caller bug; never read a page-table entry beyond it.
    max_pos = jnp.clip(max_pos, -1, d.max_keys - 1)
    num_blocks = lax.div(max_pos + BLOCK_KEYS, BLOCK_KEYS)
    per_split = lax.div(num_blocks + d.splits - 1, d.splits)
    first = jnp.minimum(split * per_split, num_blocks)
    stop = jnp.minimum(first + per_split, num_blocks)
    return first, stop, max_pos


def _fetch(pages_ref, pt_ref, b, layer, max_pos, block, kv_smem, kv_bar, d: _Dims) -> None:
    """Start the copies of key block ``block`` into ``kv_smem`` (one slot), completing on ``kv_bar``."""
    for i in range(d.copies_per_block):
        key = block * BLOCK_KEYS + i * d.rows_per_copy
        # A page wholly past max_pos re-reads the block's first (needed) page rather than
        # trusting the page table beyond the needed pages; its keys are masked anyway.
        key = jnp.where(key <= max_pos, key, block * BLOCK_KEYS)
        page = pt_ref[b, lax.div(key, d.page_size)]
        plgpu.copy_gmem_to_smem(
            pages_ref.at[layer, page, pl.ds(lax.rem(key, d.page_size), d.rows_per_copy)],
            kv_smem.at[pl.ds(i * d.rows_per_copy, d.rows_per_copy)],
            kv_bar,
        )


def _probabilities(s, row_max, row_sum, row_pos, block, d: _Dims, scale: float):
    """One step of the online softmax over the scores s [64, n] of key block ``block``: (p [64, n]
    float32, alpha [64] the factor that rescales what was accumulated, the new row max, the new row
    sum); the max in base-2 logit units."""
    # Broadcast here, not once outside the loop: a live [64, n] int32 tile costs registers.
    key_offset = _cast(lax.broadcasted_iota(jnp.int32, s.shape, 1), plgpu.Layout.WGMMA, d)
    visible = key_offset <= lax.broadcast_in_dim(row_pos - block * BLOCK_KEYS, s.shape, [0])
    # Base-2 logits: exp2(s·scale·log2 e) = exp(s·scale).
    s = jnp.where(visible, s * (scale * _LOG2E), -jnp.inf)
    new_max = jnp.maximum(row_max, s.max(axis=1))
    # A row with nothing visible yet keeps max = -inf; subtract 0 then, not -inf.
    safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    alpha = jnp.exp2(row_max - safe_max)
    p = jnp.exp2(s - lax.broadcast_in_dim(safe_max, s.shape, [0]))
    return p, alpha, new_max, row_sum * alpha + p.sum(axis=1)


def _online_softmax(s, carry, row_pos, block, values, d: _Dims, scale: float):
    """Fold the scores s [64, n] of key block ``block`` into (acc, row_max, row_sum), with ``values``
    [n, value columns] the block's rows in shared memory."""
    acc, row_max, row_sum = carry
    p, alpha, row_max, row_sum = _probabilities(s, row_max, row_sum, row_pos, block, d, scale)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    return _accumulate(acc, p.astype(d.dtype), values, d), row_max, row_sum


def _initial_state(value_columns: int, d: _Dims):
    acc = _cast(jnp.zeros((BLOCK_ROWS, value_columns), jnp.float32), plgpu.Layout.WGMMA, d)
    row_max = _cast(jnp.full((BLOCK_ROWS,), -jnp.inf, jnp.float32), _ROW, d)
    row_sum = _cast(jnp.zeros((BLOCK_ROWS,), jnp.float32), _ROW, d)
    return acc, row_max, row_sum


def _normalised(acc, row_max, row_sum, out_dtype):
    """(acc / row_sum in out_dtype, the rows' log2-sum-exp2); rows that saw no key give zeros, -inf."""
    inv_sum = jnp.where(row_sum > 0.0, 1.0 / row_sum, 0.0)
    out = (acc * lax.broadcast_in_dim(inv_sum, acc.shape, [0])).astype(out_dtype)
    lse = jnp.where(row_sum > 0.0, row_max + jnp.log2(row_sum), -jnp.inf)
    return out, lse


def _attend(
    q_ref, pages_ref, pt_ref, pos_ref, layer_ref, q_smem, kv_smem, q_bar, kv_bar, *, d: _Dims, scale: float
):
    """One program's online softmax over its key blocks.

    Returns (acc [64, value_block] float32, row_max [64], row_sum [64]) with the max in base-2
    logit units; row_sum is 0 for rows that saw no key.
    """
    b = lax.axis_index("b")
    r0 = lax.axis_index("r") * BLOCK_ROWS
    v0 = lax.axis_index("v") * d.value_block
    split = lax.axis_index("k")
    layer = layer_ref[0]

    plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(r0, BLOCK_ROWS)], q_smem, q_bar)
    first, stop, max_pos = _block_range(pos_ref, b, split, d)

    def fetch(block, slot):
        _fetch(pages_ref, pt_ref, b, layer, max_pos, block, kv_smem.at[slot], kv_bar.at[slot], d)

    @pl.when(first < stop)
    def _():
        fetch(first, 0)

    row_pos = _row_positions(pos_ref, b, r0, d)
    plgpu.barrier_wait(q_bar)

    def step(block, carry):
        slot = lax.rem(block - first, NUM_BUFFERS)

        @pl.when(block + 1 < stop)
        def _():
            fetch(block + 1, lax.rem(block + 1 - first, NUM_BUFFERS))

        plgpu.barrier_wait(kv_bar.at[slot])
        keys = kv_smem.at[slot]
        s = _scores(q_smem, keys, d)
        return _online_softmax(s, carry, row_pos, block, keys.at[:, pl.ds(v0, d.value_block)], d, scale)

    return lax.fori_loop(first, stop, step, _initial_state(d.value_block, d))


def _kernel(q_ref, pages_ref, pt_ref, pos_ref, layer_ref, *out_refs, d: _Dims, scale: float):
    transforms = _smem_transforms(d.dtype)
    acc, row_max, row_sum = pl.run_scoped(
        functools.partial(_attend, q_ref, pages_ref, pt_ref, pos_ref, layer_ref, d=d, scale=scale),
        plgpu.SMEM((BLOCK_ROWS, d.width), d.dtype, transforms=transforms),
        plgpu.SMEM((NUM_BUFFERS, BLOCK_KEYS, d.width), d.dtype, transforms=transforms),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_arrivals=d.copies_per_block, num_barriers=NUM_BUFFERS),
    )
    out_dtype = d.dtype if d.splits == 1 else jnp.float32
    out, lse = _normalised(acc, row_max, row_sum, out_dtype)
    b = lax.axis_index("b")
    r0 = lax.axis_index("r") * BLOCK_ROWS
    v0 = lax.axis_index("v") * d.value_block
    split = lax.axis_index("k")
    rows = pl.ds(r0, BLOCK_ROWS)

    # A second scope, so the output tiles reuse the shared memory of the loop's buffers.
    def store(out_smem, lse_smem=None):
        out_smem[...] = out
        plgpu.commit_smem()
        if d.splits == 1:
            plgpu.copy_smem_to_gmem(out_smem, out_refs[0].at[b, rows, pl.ds(v0, d.value_block)])
        else:
            plgpu.copy_smem_to_gmem(out_smem, out_refs[0].at[split, b, rows, pl.ds(v0, d.value_block)])

            @pl.when(v0 == 0)
            def _():
                # log2-sum-exp2 of the row's scores in this split; -inf where it saw no key.
                lse_smem[...] = lse
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(lse_smem, out_refs[1].at[split, b, rows])

        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM((BLOCK_ROWS, d.value_block), out_dtype, transforms=_smem_transforms(out_dtype))]
    if d.splits > 1:
        scratch.append(plgpu.SMEM((BLOCK_ROWS,), jnp.float32))
    pl.run_scoped(store, *scratch)


def shared_takes(width: int, value_dim: int) -> bool:
    """Whether the shared-keys schedule takes these widths: value columns that split into two
    halves of whole LANE tiles, each at most MAX_VALUE_BLOCK (DeepSeek-V3's 512 does)."""
    values = _round_up(value_dim, LANE)
    return values % (2 * LANE) == 0 and values // 2 <= MAX_VALUE_BLOCK


def _shared_kernel(q_ref, pages_ref, pt_ref, pos_ref, layer_ref, *out_refs, d: _Dims, scale: float):
    """The shared-keys schedule: two warpgroups per (row, row block, split) program, sharing each
    key block and the scores of it.

    Warpgroup 0 streams the key blocks (double-buffered), scores each (q · keysᵀ, every latent
    column), runs the online softmax, hands the probabilities P (bfloat16) and the rows' rescaling
    factors to warpgroup 1 through shared memory, and accumulates P · values for the first half of
    the value columns; warpgroup 1 rescales its accumulator and accumulates the second half, its
    P read straight from shared memory by the tensor cores. Against the single schedule (one
    program per row block and value block, each scoring every key), each key is read by half as
    many programs and scored once, not twice: a third less tensor work per key at DeepSeek-V3's
    widths (576 + 512 columns, not 2·576 + 512).
    """
    transforms = _smem_transforms(d.dtype)
    half = d.value_block // 2  # value_block is the whole padded value width in this schedule
    out_dtype = d.dtype if d.splits == 1 else jnp.float32
    b = lax.axis_index("b")
    r0 = lax.axis_index("r") * BLOCK_ROWS
    split = lax.axis_index("k")
    rows = pl.ds(r0, BLOCK_ROWS)

    def write(out, lse, v0):
        # Straight from registers to global memory: a staging tile would not fit beside the
        # loop's buffers, and the output is small beside the keys read.
        if d.splits == 1:
            out_refs[0].at[b, rows, pl.ds(v0, half)][...] = out
        else:
            out_refs[0].at[split, b, rows, pl.ds(v0, half)][...] = out
            if lse is not None:
                out_refs[1].at[split, b, rows][...] = lse

    def body(q_smem, kv_smem, p_smem, stats, q_bar, kv_bar, p_ready, p_free, done):
        wg = lax.axis_index("wg")
        first, stop, max_pos = _block_range(pos_ref, b, split, d)
        layer = layer_ref[0]

        def fetch(block, slot):
            _fetch(pages_ref, pt_ref, b, layer, max_pos, block, kv_smem.at[slot], kv_bar.at[slot], d)

        @pl.when(wg == 0)
        def _scorer():
            plgpu.copy_gmem_to_smem(q_ref.at[b, rows], q_smem, q_bar)
            pl.when(first < stop)(functools.partial(fetch, first, 0))
            row_pos = _row_positions(pos_ref, b, r0, d)
            plgpu.barrier_wait(q_bar)

            def step(block, carry):
                acc, row_max, row_sum = carry
                i = block - first
                slot = lax.rem(i, NUM_BUFFERS)
                plgpu.barrier_wait(kv_bar.at[slot])
                keys = kv_smem.at[slot]
                p, alpha, row_max, row_sum = _probabilities(
                    _scores(q_smem, keys, d), row_max, row_sum, row_pos, block, d, scale
                )
                p = p.astype(d.dtype)

                # Warpgroup 1 is done with the last block: its P, factors and key slot are free.
                @pl.when(i > 0)
                def _():
                    plgpu.barrier_wait(p_free)

                p_smem[...] = p
                stats[...] = alpha
                plgpu.commit_smem()  # ordinary stores read next by the tensor cores
                plgpu.barrier_arrive(p_ready)

                @pl.when(block + 1 < stop)
                def _():
                    fetch(block + 1, lax.rem(i + 1, NUM_BUFFERS))

                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                acc = _accumulate(acc, p, keys.at[:, pl.ds(0, half)], d)
                return acc, row_max, row_sum

            acc, row_max, row_sum = lax.fori_loop(first, stop, step, _initial_state(half, d))

            @pl.when(first < stop)
            def _():  # warpgroup 1 has read the last factors
                plgpu.barrier_wait(p_free)

            stats[...] = row_sum
            plgpu.barrier_arrive(done)
            out, lse = _normalised(acc, row_max, row_sum, out_dtype)
            write(out, lse, 0)

        @pl.when(wg == 1)
        def _valuer():
            def step(block, acc):
                slot = lax.rem(block - first, NUM_BUFFERS)
                plgpu.barrier_wait(p_ready)
                plgpu.barrier_wait(kv_bar.at[slot])
                alpha = _cast(stats[...], _ROW, d)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                acc = _accumulate(acc, p_smem, kv_smem.at[slot, :, pl.ds(half, half)], d)
                plgpu.barrier_arrive(p_free)
                return acc

            acc = lax.fori_loop(first, stop, step, _initial_state(half, d)[0])
            plgpu.barrier_wait(done)
            row_sum = _cast(stats[...], _ROW, d)
            out, _ = _normalised(acc, jnp.zeros_like(row_sum), row_sum, out_dtype)
            write(out, None, half)

    pl.run_scoped(
        body,
        plgpu.SMEM((BLOCK_ROWS, d.width), d.dtype, transforms=transforms),
        plgpu.SMEM((NUM_BUFFERS, BLOCK_KEYS, d.width), d.dtype, transforms=transforms),
        plgpu.SMEM((BLOCK_ROWS, BLOCK_KEYS), d.dtype, transforms=transforms),
        plgpu.SMEM((BLOCK_ROWS,), jnp.float32),  # the rows' rescaling factors, at the end their sums
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_arrivals=d.copies_per_block, num_barriers=NUM_BUFFERS),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=1),
        collective_axes="wg",
    )


def _combine(parts: jax.Array, lse: jax.Array, dtype) -> jax.Array:
    """Merge per-split outputs [K, B, R, V] f32 by their log2-sum-exp2 [K, B, R] -> [B, R, V]."""
    top = jnp.max(lse, axis=0)
    weights = jnp.exp2(lse - jnp.where(jnp.isfinite(top), top, 0.0))  # 0 for splits that saw nothing
    total = jnp.sum(weights, axis=0)
    out = jnp.einsum("kbr,kbrv->brv", weights, parts) / jnp.where(total > 0, total, 1.0)[..., None]
    return out.astype(dtype)


SCHEDULES = ("auto", "single", "shared")
# "auto" runs the shared schedule when each of its programs gets at least this many key blocks: on
# an H200 it was 1.18-1.42x faster than the single one at every DeepSeek-V3 decode shape measured
# that gives its programs 16 blocks or more (64 rows x 1024 keys x 4 queries, 32k keys at 1 or 64
# rows x 4 queries, 64 rows x 32k keys), and 0.77-0.94x at the four that give them 4 to 8.
SHARED_MIN_BLOCKS = 16


def pick_schedule(
    batch: int, tokens: int, heads: int, value_dim: int, max_keys: int, num_splits: int | None = None
) -> str:
    """The schedule ``schedule="auto"`` runs for these sizes ("shared" or "single")."""
    if not shared_takes(0, value_dim):
        return "single"
    programs = batch * (_round_up(tokens * heads, BLOCK_ROWS) // BLOCK_ROWS)
    splits = num_splits or default_splits(programs, max_keys)
    blocks = -(-max_keys // BLOCK_KEYS) / splits
    return "shared" if blocks >= SHARED_MIN_BLOCKS else "single"


@functools.partial(jax.jit, static_argnames=("scale", "value_dim", "interpret", "num_splits", "schedule"))
def mla_decode_kernel(
    q: jax.Array,
    pages: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
    *,
    scale: float,
    value_dim: int,
    interpret: Any = False,
    num_splits: int | None = None,
    layer: jax.Array | int | None = None,
    schedule: str = "auto",
) -> jax.Array:
    """Absorbed MLA decode attention; same contract as :func:`mla_decode_reference`.

    q [B, T, H, C], pages [P, S, C] (same dtype as q) or a stack [L, P, S, C] with the ``layer``
    to read (a traced scalar is fine: the kernel indexes the stack, nothing is sliced out),
    page_table [B, N] int32, positions [B, T] int32 -> [B, T, H, value_dim] in q.dtype.
    ``interpret`` True (or an :func:`interpret_params` object) runs the kernel in Mosaic GPU
    interpret mode on any backend; otherwise it compiles for a Hopper GPU. ``num_splits``: key
    splits per row (flash-decoding); None picks one from the shapes (:func:`default_splits`).
    ``schedule``: "single" (one warpgroup per row block and value block), "shared" (two
    warpgroups per row block sharing each key block and its scores, see :func:`_shared_kernel`;
    value widths :func:`shared_takes`) or "auto" (:func:`pick_schedule`: shared when its programs
    get long shares of the keys).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"mla_decode kernel: schedule must be one of {SCHEDULES}, got {schedule!r}")
    batch, tokens, heads, width = q.shape
    if pages.ndim == 3:
        pages, layer = pages[None], 0
    page_size = pages.shape[2]
    check_page_size(page_size)
    max_keys = page_table.shape[1] * page_size
    if schedule == "auto":
        schedule = pick_schedule(batch, tokens, heads, value_dim, max_keys, num_splits)
    shared = schedule == "shared"
    if shared and not shared_takes(width, value_dim):
        raise ValueError(
            f"mla_decode kernel: the shared schedule needs value columns that split into two halves "
            f"of whole {LANE}-column tiles, at most {MAX_VALUE_BLOCK} each (got {value_dim})"
        )
    rows = tokens * heads
    rows_padded = _round_up(rows, BLOCK_ROWS)
    width_padded = _round_up(width, LANE)
    value_padded = _round_up(value_dim, LANE)
    value_block = value_padded if shared else _value_block(value_padded)
    grid = (batch, rows_padded // BLOCK_ROWS, 1 if shared else value_padded // value_block)
    if num_splits is None:
        num_splits = default_splits(math.prod(grid), max_keys)
    if num_splits < 1:
        raise ValueError(f"mla_decode kernel: num_splits must be >= 1, got {num_splits}")
    d = _Dims(
        heads=heads,
        tokens=tokens,
        width=width_padded,
        value_block=value_block,
        page_size=page_size,
        max_keys=max_keys,
        splits=num_splits,
        dtype=q.dtype,
        interpret=bool(interpret),
    )
    q_rows = q.reshape(batch, rows, width)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, rows_padded - rows), (0, width_padded - width)))
    if width_padded != width:
        pages = jnp.pad(pages, ((0, 0), (0, 0), (0, 0), (0, width_padded - width)))

    if num_splits == 1:
        out_type = jax.ShapeDtypeStruct((batch, rows_padded, value_padded), q.dtype)
    else:
        out_type = (
            jax.ShapeDtypeStruct((num_splits, batch, rows_padded, value_padded), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, batch, rows_padded), jnp.float32),
        )
    if interpret is True:
        interpret = interpret_params()
    if shared:
        body, names, threads = _shared_kernel, ("b", "r", "k"), {"num_threads": 2, "thread_name": "wg"}
        grid = grid[:2]
    else:
        body, names, threads = _kernel, ("b", "r", "v", "k"), {}
    call = plgpu.kernel(
        functools.partial(body, d=d, scale=scale),
        out_type=out_type,
        grid=(*grid, num_splits),
        grid_names=names,
        # The rows' max and sum reduce within warps (no scratch); the shared schedule needs the
        # 2 KiB of shared memory that reductions would reserve by default.
        compiler_params=plgpu.CompilerParams(
            approx_math=True, **({"reduction_scratch_bytes": 0} if shared else {})
        ),
        interpret=interpret or None,
        **threads,
    )
    layer_arg = jnp.asarray(layer, jnp.int32).reshape(1)
    out = call(q_rows, pages, page_table.astype(jnp.int32), positions.astype(jnp.int32), layer_arg)
    if num_splits > 1:
        out = _combine(*out, q.dtype)
    return out[:, :rows, :value_dim].reshape(batch, tokens, heads, value_dim)
