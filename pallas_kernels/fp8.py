"""The block-scaled FP8 weight the kernels take (DeepSeek-V3/R1 style), and its dequantisation.

Defined here, at the bottom of the stack, because the MoE kernels consume it and ``pallas_kernels``
imports nothing from ``mtp_jax``; :mod:`mtp_jax.fp8` re-exports it beside the host-side helpers
(hub dequantisation, FP8 projections) that the model code and the checkpoint reader use.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


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
