"""MLA: the absorbed, paged evaluation equals the expanded one; cache writes land where they should."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.cache import page_table_array, slots_for
from mtp_jax.layers import rope_cos_sin, rope_frequencies
from mtp_jax.targets.deepseek_v3.config import DeepseekV3Config
from mtp_jax.targets.deepseek_v3.mla import latent_rows, mla_dense, mla_paged, write_rows
from pallas_kernels.mla_decode import ENV_VAR as KERNELS_ENV
from tests.conftest import TINY_CONFIG


def gather_rows(pages: jax.Array, page_table: jax.Array, layer: int | None = None) -> jax.Array:
    """A row's cache in position order: [b, n·page, c] from pages [P, page, c] (or a stack's layer)."""
    seq = pages[page_table] if layer is None else pages[layer, page_table]
    return seq.reshape(seq.shape[0], -1, seq.shape[-1])


def _params(cfg: DeepseekV3Config, key: jax.Array) -> dict:
    d, h, r, c = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    shapes = {
        "q_a": (d, r),
        "q_a_norm": (r,),
        "q_b": (r, h, cfg.qk_head_dim),
        "kv_a": (d, c + cfg.qk_rope_head_dim),
        "kv_a_norm": (c,),
        "k_b": (c, h, cfg.qk_nope_head_dim),
        "v_b": (c, h, cfg.v_head_dim),
        "o": (h, cfg.v_head_dim, d),
    }
    keys = jax.random.split(key, len(shapes))
    return {
        n: 0.3 * jax.random.normal(k, s) + (1.0 if n.endswith("norm") else 0.0)
        for (n, s), k in zip(shapes.items(), keys, strict=True)
    }


@pytest.mark.parametrize(
    "impl, page, stacked",
    [("reference", 4, False), ("reference", 8, True), ("interpret", 8, False), ("interpret", 8, True)],
)
def test_paged_incremental_equals_dense(monkeypatch, impl, page, stacked):
    """Prefill a prefix, then feed the rest in uneven chunks through a shuffled page table; through
    the attention dispatcher's jnp reference and its Pallas kernel (Mosaic GPU interpret mode), on
    one layer's pages and on layer 1 of a stack of three (as the scan over layers passes them)."""
    monkeypatch.setenv(KERNELS_ENV, impl)
    cfg = DeepseekV3Config.from_dict(TINY_CONFIG)
    p = _params(cfg, jax.random.key(0))
    b, t = 2, 23
    x = jax.random.normal(jax.random.key(1), (b, t, cfg.hidden_size))
    inv_freq, mag = rope_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    cos, sin = rope_cos_sin(pos, jnp.asarray(inv_freq), mag)
    expected = jax.jit(mla_dense, static_argnums=2)(p, x, cfg, cos, sin)

    per_row = 32 // page
    order = np.random.default_rng(3).permutation(b * per_row + 3)
    table = jnp.asarray(
        page_table_array([list(order[:per_row]), list(order[per_row : 2 * per_row])], per_row)
    )
    # stale garbage everywhere; masked positions must not leak
    pages = jnp.full((b * per_row + 3, page, cfg.kv_lora_rank + cfg.qk_rope_head_dim), 7.0)
    layer = None
    if stacked:
        pages, layer = jnp.stack([pages - 1.0, pages, pages + 1.0]), 1
    outs = []
    paged = jax.jit(mla_paged, static_argnames=("cfg", "layer"))  # eager dispatch is slower to start
    for lo, hi in [(0, 9), (9, 10), (10, 15), (15, 23)]:
        chunk_pos = pos[:, lo:hi]
        slots = slots_for(table, chunk_pos, jnp.ones(chunk_pos.shape, bool), page)
        out, pages = paged(
            p, x[:, lo:hi], cfg, cos[:, lo:hi], sin[:, lo:hi], chunk_pos, slots, pages, table, layer=layer
        )
        outs.append(out)
    got = jnp.concatenate(outs, axis=1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-5, atol=2e-5)
    if stacked:  # the other layers are untouched
        np.testing.assert_array_equal(np.asarray(pages[0]), 6.0)
        np.testing.assert_array_equal(np.asarray(pages[2]), 8.0)
    # the cache holds exactly the latent rows, in position order through the page table
    rows = jax.jit(latent_rows, static_argnums=2)(p, x, cfg, cos, sin)
    np.testing.assert_allclose(
        np.asarray(gather_rows(pages, table, layer)[:, :t]), np.asarray(rows), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_write_rows_drops_invalid_slots(dtype):
    pages = jnp.zeros((3, 2, 4), dtype)
    rows = jnp.arange(1, 1 + 2 * 3 * 4, dtype=jnp.float32).reshape(2, 3, 4) / 8  # exact in 16 bits
    slots = jnp.array([[0, 5, 2**31 - 1], [3, 2**31 - 1, 1]])
    written = write_rows(pages, rows, slots)
    assert written.dtype == dtype
    out = np.asarray(written.astype(jnp.float32)).reshape(6, 4)
    np.testing.assert_array_equal(out[0], rows[0, 0])
    np.testing.assert_array_equal(out[5], rows[0, 1])
    np.testing.assert_array_equal(out[3], rows[1, 0])
    np.testing.assert_array_equal(out[1], rows[1, 2])
    np.testing.assert_array_equal(out[[2, 4]], 0.0)


def test_16_bit_cache_write_does_not_convert_the_cache():
    """XLA:CPU has no bfloat16 scatter: a plain .at[].set converts the whole cache to float32 and
    back; the write scatters the bit patterns instead, so no float32 copy of the stack appears."""
    stack = jnp.zeros((3, 16, 4, 8), jnp.bfloat16)
    rows = jnp.ones((2, 3, 8), jnp.float32)
    slots = jnp.array([[0, 1, 2], [40, 41, 42]])
    hlo = jax.jit(write_rows).lower(stack, rows, slots, jnp.int32(1)).compile().as_text()
    assert "bf16[3,16,4,8]" in hlo and "f32[3,16,4,8]" not in hlo


def test_stack_write_and_gather_touch_only_their_layer():
    stack = jnp.arange(3 * 4 * 2 * 5, dtype=jnp.float32).reshape(3, 4, 2, 5)  # [L, P, page, c]
    rows = -jnp.arange(1, 1 + 2 * 2 * 5, dtype=jnp.float32).reshape(2, 2, 5)
    slots = jnp.array([[0, 7], [2**31 - 1, 3]])
    out = write_rows(stack, rows, slots, layer=1)
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(stack[0]))
    np.testing.assert_array_equal(np.asarray(out[2]), np.asarray(stack[2]))
    np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(write_rows(stack[1], rows, slots)))
    # a traced layer index (as inside the scan over layers) gives the same result
    traced = jax.jit(write_rows)(stack, rows, slots, jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(out))
    table = jnp.array([[3, 0], [1, 2]])
    np.testing.assert_array_equal(
        np.asarray(gather_rows(out, table, layer=1)), np.asarray(gather_rows(out[1], table))
    )


def test_paged_attention_uses_the_kernel_dispatcher(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "bogus")  # only the dispatcher reads (and refuses) it
    cfg = DeepseekV3Config.from_dict(TINY_CONFIG)
    p = _params(cfg, jax.random.key(0))
    x = jnp.ones((1, 1, cfg.hidden_size))
    pos = jnp.zeros((1, 1), jnp.int32)
    inv_freq, mag = rope_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    cos, sin = rope_cos_sin(pos, jnp.asarray(inv_freq), mag)
    pages = jnp.zeros((2, 8, cfg.kv_lora_rank + cfg.qk_rope_head_dim))
    with pytest.raises(ValueError, match=KERNELS_ENV):
        mla_paged(p, x, cfg, cos, sin, pos, jnp.zeros((1, 1), jnp.int32), pages, jnp.zeros((1, 1), jnp.int32))
