"""Block-wise FP8 weights (DeepSeek-V3/R1 style): dequantisation and the kept-FP8 parameter type
(:class:`Fp8Weight`, defined with the kernels that take it in :mod:`pallas_kernels.fp8`).

A hub FP8 weight W [out, in] is stored as ``float8_e4m3fn`` plus ``weight_scale_inv``
[ceil(out/b0), ceil(in/b1)] float32, with (b0, b1) = ``weight_block_size`` (128×128 for V3), and
``W[r, c] = fp8[r, c] · scale_inv[r // b0, c // b1]`` — a multiply; edge blocks are partial.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.fp8 import Fp8Weight, materialize

__all__ = ["BLOCKED_MAX_ROWS", "Fp8Weight", "dense_einsum", "dequantize", "materialize"]


def dequantize(
    fp8: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], dtype=np.float32
) -> np.ndarray:
    """Host dequantisation of a hub-layout FP8 weight [out, in] into ``dtype``."""
    out_dim, in_dim = fp8.shape
    b0, b1 = block
    rows = np.repeat(scale_inv.astype(np.float32), b0, axis=0)[:out_dim]
    scale = np.repeat(rows, b1, axis=1)[:, :in_dim]
    return (fp8.astype(np.float32) * scale).astype(dtype)


# A projection of at most this many rows reads an FP8 weight in place (:func:`dense_einsum`): its
# per-block partial sums (rows x in/b_in x out float32) then cost at most as many bytes as the
# dequantised copy they replace.
BLOCKED_MAX_ROWS = 32


def dense_einsum(spec: str, x: jax.Array, w: jax.Array | Fp8Weight) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` in x.dtype for a projection whose contracted axes are x's last and
    w's first (``"btd,dhk->bthk"``, ``"bthk,hkd->btd"``, ...), w an array or an :class:`Fp8Weight`.

    An FP8 weight is read in place when x has at most :data:`BLOCKED_MAX_ROWS` rows (decode): one
    product per block of ``b_in`` inputs, the FP8 values converted as the product reads them, and the
    float32 partial sums [rows, in/b_in, out] scaled by their blocks' scales and summed. Measured on
    an H200, that is 2.5-4.3x faster than dequantising the weight first at 1 and 4 rows and 1.8-2x at
    32 (BENCHMARKS.md, "FP8 dense projections"). More rows, and partial input blocks, dequantise
    first (:func:`materialize`), which costs the same whatever the rows.
    """
    if not isinstance(w, Fp8Weight):
        return jnp.einsum(spec, x, w)
    inputs, out = spec.split("->")
    lhs, rhs = inputs.split(",")
    n_in = len(rhs) - len(set(rhs) & set(out))  # w's leading, contracted axes
    k, n = w.w.shape[-2:] if w.w.ndim == 2 else (0, 0)
    rows = math.prod(x.shape[:-n_in])
    b_in, b_out = w.block
    if not k or rows > BLOCKED_MAX_ROWS or k % b_in or math.prod(x.shape[-n_in:]) != k:
        return jnp.einsum(spec, x, materialize(w, x.dtype))
    # XLA:CPU has no bfloat16 x bfloat16 -> float32 product; there it runs in float32.
    compute = x.dtype if jax.default_backend() != "cpu" else jnp.float32
    part = jnp.einsum(
        "mkc,kcn->mkn",
        x.reshape(rows, k // b_in, b_in).astype(compute),
        w.w.reshape(k // b_in, b_in, n).astype(compute),
        preferred_element_type=jnp.float32,
    )
    scale = jnp.repeat(w.scale_inv, b_out, axis=-1)[:, :n]  # [k / b_in, n]
    y = jnp.einsum("mkn,kn->mn", part, scale).astype(x.dtype)
    return y.reshape(x.shape[:-n_in] + tuple(w.shape[n_in:]))
