"""Small building blocks shared by the models: RMSNorm, rotary embeddings, SwiGLU MLP.

Shape letters used in einsum strings across the package: b batch, t query tokens, s key positions,
d hidden, h heads, k per-head dim, r low-rank (lora) dim, c latent (kv_lora + rope), e experts,
f feed-forward dim, v vocabulary.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.config import Llama3RopeScaling, YarnRopeScaling, yarn_mscale
from mtp_jax.fp8 import Fp8Weight, dense_einsum


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, cast back to x's dtype before the weight (as DeepSeek does)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


def rope_frequencies(dim: int, theta: float, scaling: YarnRopeScaling | None) -> tuple[np.ndarray, float]:
    """Inverse frequencies [dim/2] and the cos/sin magnitude factor for a rotary slice of width dim.

    Under YaRN, frequencies between the beta_fast/beta_slow correction dims are blended linearly
    between extrapolation (original) and interpolation (divided by factor); the cos/sin factor is
    mscale(factor, mscale) / mscale(factor, mscale_all_dim). Computed on the host in float64.
    """
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    inv_freq = 1.0 / theta**exponents
    if scaling is None:
        return inv_freq.astype(np.float32), 1.0

    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolate = 1.0 - ramp
    inv_freq = inv_freq / scaling.factor * (1.0 - extrapolate) + inv_freq * extrapolate
    if scaling.mscale and scaling.mscale_all_dim:
        magnitude = yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    else:
        magnitude = yarn_mscale(scaling.factor)
    # Rounded through float32 like the reference implementations, so tables agree bit for bit.
    return inv_freq.astype(np.float32), float(np.float32(magnitude))


def llama3_frequencies(dim: int, theta: float, scaling: Llama3RopeScaling | None) -> np.ndarray:
    """Inverse frequencies [dim/2] of Llama's rotate-half rope, with llama3 scaling when given.

    The scaling changes frequencies, not long positions only, so it applies at every position:
    wavelengths 2π/inv above ``orig / low_freq_factor`` are divided by ``factor``, those below
    ``orig / high_freq_factor`` are kept, and in between ``(1 - s)·inv/factor + s·inv`` with
    ``s = (orig / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
    Computed on the host in float64 and rounded to float32.
    """
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if scaling is not None:
        orig = scaling.original_max_position_embeddings
        wavelength = 2 * math.pi / inv_freq
        long = wavelength > orig / scaling.low_freq_factor
        short = wavelength < orig / scaling.high_freq_factor
        lo, hi = scaling.low_freq_factor, scaling.high_freq_factor
        s = (orig / wavelength - lo) / (hi - lo)
        blended = (1 - s) * inv_freq / scaling.factor + s * inv_freq
        inv_freq = np.where(long, inv_freq / scaling.factor, np.where(short, inv_freq, blended))
    return inv_freq.astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array, magnitude: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [..., dim/2] in float32 for integer positions [...]."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles) * magnitude, jnp.sin(angles) * magnitude


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... of the last axis.

    x: [b, t, ..., dim]; cos/sin: [b, t, dim/2], broadcast over the axes between. The result is in
    the same interleaved layout; queries and keys only meet through dot products, so any fixed
    permutation of the rope slice (transformers de-interleaves) gives identical attention.
    """
    extra = x.ndim - cos.ndim
    cos = cos.reshape(cos.shape[:2] + (1,) * extra + cos.shape[2:])
    sin = sin.reshape(sin.shape[:2] + (1,) * extra + sin.shape[2:])
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., 0::2], x32[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def apply_rope_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half (NeoX) rope over the whole last axis: ``x·cos + rotate_half(x)·sin`` with
    ``rotate_half(x) = cat(-x[d/2:], x[:d/2])`` and each frequency used for both halves.

    x: [b, t, heads, dim]; cos/sin: [b, t, dim/2] float32. Computed in float32, cast back.
    """
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


Weight = jax.Array | Fp8Weight


def swiglu(x: jax.Array, gate: Weight, up: Weight, down: Weight, lora: dict | None = None) -> jax.Array:
    """down(silu(x·gate) * (x·up)); x [..., d], gate/up [d, f], down [f, d]. ``lora``: the rows'
    adapters of any of the three (x [b, t, d]; :func:`mtp_jax.lora.delta`)."""
    g = dense_einsum("...d,df->...f", x, gate)
    u = dense_einsum("...d,df->...f", x, up)
    if lora:
        g = adapted(g, x, lora, "gate")
        u = adapted(u, x, lora, "up")
    y = jax.nn.silu(g) * u
    out = dense_einsum("...f,fd->...d", y, down)
    return adapted(out, y, lora, "down") if lora else out


def adapted(y: jax.Array, x: jax.Array, lora: dict | None, name: str, n_in: int = 1) -> jax.Array:
    """``y`` (projection ``name`` of x [b, t, *in], ``n_in`` input axes) plus the rows' LoRA
    adapters of it, when ``lora`` (a layer's gathered adapters) has ``name``."""
    if not lora or name not in lora:
        return y
    from mtp_jax.lora import delta

    return y + delta(x, lora[name], lora["rows"], n_in).astype(y.dtype)
