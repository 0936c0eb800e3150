"""Grouped-query attention over the paged cache: the live-pages dispatch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax.gqa as gqa


def test_paged_attention_ignores_nan_pages_past_the_needed_ones():
    """Table entries past a row's needed pages are garbage; when one names a NaN-filled page the
    output is still finite and equals the output with those entries naming clean pages."""
    rng = np.random.default_rng(1)
    b, t, heads, kv, d, page, per_row = 2, 2, 4, 2, 8, 4, 4
    pool = rng.standard_normal((2, b * per_row + 1, page, kv, d)).astype(np.float32)
    pool[:, -1] = np.nan  # the last page: never needed
    pages = {n: jnp.asarray(pool) for n in "kv"}
    clean = np.arange(b * per_row).reshape(b, per_row)
    dirty = clean.copy()
    dirty[:, 2:] = b * per_row  # positions below 8 need two pages of 4; the rest name the NaN page
    positions = jnp.asarray([[5, 6], [6, 7]], jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, t, heads, d)), jnp.float32)
    attend = jax.jit(
        lambda table: gqa.gqa_paged_reference(q, pages["k"], pages["v"], table, positions, 0.3, 1)
    )
    got, want = (np.asarray(attend(jnp.asarray(x, jnp.int32))) for x in (dirty, clean))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("last, width", [([3, 12], 2), ([3, 25], 4), ([3, 50], 8)])
def test_paged_attention_reads_only_the_live_pages(monkeypatch, last, width):
    """A call attends over the narrowest page-table prefix holding every key its queries see (chosen
    on device) and gives what the reference over the whole table gives; grouped heads, a layer of a
    stack, keys written by the call itself."""
    import pallas_kernels.paged as chunks

    monkeypatch.setattr(chunks, "LIVE_KEYS", 16)  # 8 pages of 8 keys: widths 8, 4 and 2
    widths = []
    reference = gqa.gqa_paged_reference

    def spy(q, k_pages, v_pages, table, positions, scale, layer, tree=None, window=None):
        jax.debug.callback(lambda: widths.append(table.shape[1]))
        return reference(q, k_pages, v_pages, table, positions, scale, layer, tree, window)

    monkeypatch.setattr(gqa, "gqa_paged_reference", spy)
    rng = np.random.default_rng(0)
    b, t, heads, kv, d, page, per_row = 2, 3, 4, 2, 8, 8, 8
    pages = {n: jnp.asarray(rng.standard_normal((2, b * per_row, page, kv, d)), jnp.float32) for n in "kv"}
    table = jnp.asarray(np.stack([rng.permutation(b * per_row)[:per_row] for _ in range(b)]), jnp.int32)
    positions = jnp.asarray(np.asarray(last)[:, None] - np.arange(t)[::-1], jnp.int32)
    slots = jnp.take_along_axis(table, positions // page, axis=1) * page + positions % page
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32) for h in (heads, kv, kv))
    got, written = jax.jit(lambda *a: gqa.gqa_paged(*a, scale=0.3, layer=1))(
        q, k, v, pages, slots, table, positions
    )
    assert widths == [width]
    want = reference(q, written["k"], written["v"], table, positions, 0.3, 1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
