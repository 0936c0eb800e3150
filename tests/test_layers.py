"""Rotary embedding and RMSNorm against independent formulations."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from mtp_jax.config import YarnRopeScaling
from mtp_jax.layers import apply_rope_interleaved, rms_norm, rope_cos_sin, rope_frequencies


def test_interleaved_rope_is_complex_rotation():
    """Pairs (x[2i], x[2i+1]) read as complex numbers are multiplied by exp(i·pos·freq_i)."""
    rng = np.random.default_rng(0)
    dim, pos = 8, np.array([[0, 3, 17]])
    x = rng.standard_normal((1, 3, 2, dim)).astype(np.float32)
    inv_freq, mag = rope_frequencies(dim, 10000.0, None)
    cos, sin = rope_cos_sin(jnp.asarray(pos), jnp.asarray(inv_freq), mag)
    got = np.asarray(apply_rope_interleaved(jnp.asarray(x), cos, sin))
    z = x[..., 0::2] + 1j * x[..., 1::2]
    rot = z * np.exp(1j * pos[..., None, None] * (10000.0 ** (-np.arange(0, dim, 2) / dim)))
    want = np.stack([rot.real, rot.imag], -1).reshape(x.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_yarn_frequencies_follow_the_paper():
    """YaRN: high-frequency dims (many rotations within the original context) keep their frequency,
    low-frequency dims are divided by the factor, with a linear ramp between beta_fast and beta_slow."""
    dim, theta = 64, 10000.0
    rs = YarnRopeScaling(
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    inv_freq, mag = rope_frequencies(dim, theta, rs)
    base = theta ** (-np.arange(0, dim, 2) / dim)
    rotations = 4096 * base / (2 * math.pi)
    fast = rotations > 32 * 1.2
    slow = rotations < 1 / 1.2
    np.testing.assert_allclose(inv_freq[fast], base[fast], rtol=1e-6)
    np.testing.assert_allclose(inv_freq[slow], base[slow] / 40.0, rtol=1e-6)
    assert np.all((inv_freq <= base * (1 + 1e-6)) & (inv_freq >= base / 40.0 * (1 - 1e-6)))
    assert mag == 1.0  # mscale == mscale_all_dim cancel
    rs2 = YarnRopeScaling(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=0.5)
    assert math.isclose(
        rope_frequencies(dim, theta, rs2)[1],
        (0.1 * math.log(40) + 1) / (0.05 * math.log(40) + 1),
        rel_tol=1e-6,
    )


def test_rms_norm():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 16)).astype(np.float32) * 5
    w = rng.standard_normal(16).astype(np.float32)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(np.asarray(rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6)), want, rtol=1e-5)
    y = rms_norm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), 1e-6)
    assert y.dtype == jnp.bfloat16
