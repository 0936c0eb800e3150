"""Block-wise FP8 weights (DeepSeek-V3/R1 style): dequantisation and the kept-FP8 parameter type.

A hub FP8 weight W [out, in] is stored as ``float8_e4m3fn`` plus ``weight_scale_inv``
[ceil(out/b0), ceil(in/b1)] float32, with (b0, b1) = ``weight_block_size`` (128×128 for V3), and
``W[r, c] = fp8[r, c] · scale_inv[r // b0, c // b1]`` — a multiply; edge blocks are partial.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def dequantize(
    fp8: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], dtype=np.float32
) -> np.ndarray:
    """Host dequantisation of a hub-layout FP8 weight [out, in] into ``dtype``."""
    out_dim, in_dim = fp8.shape
    b0, b1 = block
    rows = np.repeat(scale_inv.astype(np.float32), b0, axis=0)[:out_dim]
    scale = np.repeat(rows, b1, axis=1)[:, :in_dim]
    return (fp8.astype(np.float32) * scale).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """A weight kept in FP8 on device, in our [in, out] orientation.

    w: float8_e4m3fn [..., in, out]; scale_inv: float32 [..., ceil(in/b_in), ceil(out/b_out)];
    leading axes (layers, experts) are batch axes. ``shape`` is the logical trailing shape the model
    expects after dequantisation (e.g. [in, heads, head_dim]); ``block`` is (b_in, b_out).
    """

    w: jax.Array
    scale_inv: jax.Array
    shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    block: tuple[int, int] = dataclasses.field(metadata={"static": True})

    @classmethod
    def from_hub(cls, fp8: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], shape: tuple[int, ...]):
        """From hub arrays fp8 [out, in], scale_inv [out_blocks, in_blocks], block (b_out, b_in)."""
        return cls(
            w=np.ascontiguousarray(fp8.T),
            scale_inv=np.ascontiguousarray(scale_inv.T),
            shape=tuple(shape),
            block=(block[1], block[0]),
        )

    @property
    def nbytes(self) -> int:
        return int(self.w.nbytes + self.scale_inv.nbytes)

    def dequantize_host(self, dtype) -> np.ndarray:
        """The dense weight as a numpy array (host arrays only), leading axes kept."""
        w, scale = np.asarray(self.w), np.asarray(self.scale_inv, np.float32)
        b_in, b_out = self.block
        n_in, n_out = w.shape[-2:]
        full = np.repeat(np.repeat(scale, b_in, axis=-2)[..., :n_in, :], b_out, axis=-1)[..., :n_out]
        return (w.astype(np.float32) * full).astype(dtype).reshape(w.shape[:-2] + self.shape)


def materialize(x: jax.Array | Fp8Weight, dtype) -> jax.Array:
    """The dense weight in ``dtype``: identity for arrays, block dequantisation for Fp8Weight."""
    if not isinstance(x, Fp8Weight):
        return x
    b_in, b_out = x.block
    n_in, n_out = x.w.shape[-2:]
    scale = jnp.repeat(jnp.repeat(x.scale_inv, b_in, axis=-2)[..., :n_in, :], b_out, axis=-1)[..., :n_out]
    dense = (x.w.astype(jnp.float32) * scale).astype(dtype)
    return dense.reshape(x.w.shape[:-2] + x.shape)
