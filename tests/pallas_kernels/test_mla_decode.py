"""MLA decode attention: reference against numpy, kernel (Mosaic GPU interpret mode) against reference.

Every kernel run is in interpret mode, which fills fresh buffers (the output, shared memory) with
NaN and raises on an out-of-bounds read; page-table entries past each row's needed pages are
garbage (out-of-range ids, or the id of a NaN-filled page), so reading or using one fails the test.
The ``hopper`` tests compile the kernel natively and only run on a Hopper GPU.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.mla_decode.kernel as kernel_module
from pallas_kernels.mla_decode import (
    ENV_VAR,
    mla_decode,
    mla_decode_kernel,
    resolve_impl,
)
from pallas_kernels.mla_decode import mla_decode_reference as _reference
from pallas_kernels.mla_decode.kernel import BLOCK_KEYS, default_splits, pick_schedule

# jitted (op by op each call compiled ~30 one-op programs); ``layer`` is an index or None: static
mla_decode_reference = jax.jit(_reference, static_argnames=("scale", "value_dim", "layer"))

ON_HOPPER = jax.devices()[0].platform == "gpu" and str(
    getattr(jax.devices()[0], "compute_capability", "")
).startswith("9")
hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (compiles the kernel natively)")

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def make_inputs(
    seed: int,
    *,
    batch: int,
    tokens: int,
    heads: int,
    width: int,
    page_size: int,
    pages_per_row: int,
    dtype,
    garbage: bool = True,
    last: list[int] | None = None,
):
    """Random q [B, T, H, C], pages [P, S, C], page_table [B, N], positions [B, T].

    Rows end at ragged positions (``last`` or random, mostly mid-page); row 0 starts at the cache's
    first position so its early queries have negative positions, and with B >= 3 the last row sees
    nothing. The last page is NaN and never needed; with ``garbage`` the table entries past each
    row's needed pages are out-of-range ids or that NaN page.
    """
    rng = np.random.default_rng(seed)
    capacity = pages_per_row * page_size
    num_pages = batch * pages_per_row + 1
    q = rng.standard_normal((batch, tokens, heads, width))
    pages = rng.standard_normal((num_pages, page_size, width))
    pages[-1] = np.nan
    table = np.stack([rng.permutation(num_pages - 1)[:pages_per_row] for _ in range(batch)])
    if last is None:
        last = [int(x) for x in rng.integers(tokens - 1, capacity, size=batch)]
        last[0] = max(tokens - 3, 0)  # queries at positions -2, -1, 0, ... (T >= 3)
        if batch >= 3:
            last[-1] = -1  # the whole row sees nothing
    positions = np.asarray(last)[:, None] - np.arange(tokens)[::-1][None, :]
    if garbage:
        for b in range(batch):
            first_unneeded = max(int(positions[b].max()), -1) // page_size + 1
            for j in range(first_unneeded, pages_per_row):
                table[b, j] = (10**6, -7, num_pages - 1)[j % 3]
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(pages, dtype),
        jnp.asarray(table, jnp.int32),
        jnp.asarray(positions, jnp.int32),
    )


def numpy_attention(q, pages, page_table, positions, scale: float, value_dim: int) -> np.ndarray:
    """The same attention in float64, one query at a time, keys gathered by page table."""
    q, pages = np.asarray(q, np.float64), np.asarray(pages, np.float64)
    page_table, positions = np.asarray(page_table), np.asarray(positions)
    page_size = pages.shape[1]
    out = np.zeros((*q.shape[:3], value_dim))
    for b in range(q.shape[0]):
        for t in range(q.shape[1]):
            n = positions[b, t] + 1
            if n <= 0:
                continue
            keys = np.stack([pages[page_table[b, s // page_size], s % page_size] for s in range(n)])
            scores = q[b, t] @ keys.T * scale  # [H, n]
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            out[b, t] = probs @ keys[:, :value_dim]
    return out


def assert_close(actual, expected, dtype) -> None:
    actual = np.asarray(actual, np.float32)
    assert not np.isnan(actual).any()
    tol = TOL[dtype]
    np.testing.assert_allclose(actual, np.asarray(expected, np.float32), atol=tol, rtol=tol)


def test_reference_matches_numpy():
    inputs = make_inputs(
        0, batch=3, tokens=3, heads=2, width=12, page_size=4, pages_per_row=5, dtype=jnp.float32
    )
    q, pages, table, positions = inputs
    assert (np.asarray(positions) < 0).any() and (np.asarray(positions) >= 0).any()
    out = mla_decode_reference(*inputs, scale=0.37, value_dim=9)
    assert out.shape == (3, 3, 2, 9) and out.dtype == jnp.float32
    expected = numpy_attention(q, pages, table, positions, 0.37, 9)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(out)[np.asarray(positions) < 0] == 0)


# (batch, tokens, heads, width, value_dim, page_size, pages_per_row, dtype, num_splits)
KERNEL_CASES = {
    "t1-h1-f32": (2, 1, 1, 40, 32, 8, 5, jnp.float32, 1),
    "t2-h3-bf16": (3, 2, 3, 40, 32, 16, 4, jnp.bfloat16, 1),
    "t5-h16-two-row-blocks-f32": (2, 5, 16, 64, 64, 16, 6, jnp.float32, 1),
    "t4-h8-page64-bf16": (2, 4, 8, 64, 48, 64, 3, jnp.bfloat16, 1),
    "t6-h4-page128-f32": (3, 6, 4, 72, 64, 128, 2, jnp.float32, 1),
    "t6-h2-splits3-bf16": (2, 6, 2, 64, 64, 8, 24, jnp.bfloat16, 3),
    "t3-h2-five-value-blocks-f32": (2, 3, 2, 384, 320, 16, 4, jnp.float32, 2),
    "t2-h5-idle-splits-f32": (3, 2, 5, 40, 40, 32, 3, jnp.float32, 4),
}


# Value widths the shared-keys schedule takes (two halves of whole 64-column tiles).
SHARED_CASES = {
    "shared-t2-h3-f32": (2, 2, 3, 192, 128, 16, 4, jnp.float32, 1),
    "shared-t2-h5-splits2-page32-f32": (3, 2, 5, 384, 256, 32, 3, jnp.float32, 2),
    "shared-t3-h40-page64-bf16": (2, 3, 40, 128, 128, 64, 3, jnp.bfloat16, 1),
    "shared-t2-h5-idle-splits-bf16": (3, 2, 5, 136, 128, 8, 20, jnp.bfloat16, 4),
}
KERNEL_CASES.update(SHARED_CASES)


@pytest.mark.parametrize("name", KERNEL_CASES)
def test_kernel_matches_reference(name):
    batch, tokens, heads, width, value_dim, page_size, pages_per_row, dtype, splits = KERNEL_CASES[name]
    inputs = make_inputs(
        10 + list(KERNEL_CASES).index(name),
        batch=batch,
        tokens=tokens,
        heads=heads,
        width=width,
        page_size=page_size,
        pages_per_row=pages_per_row,
        dtype=dtype,
    )
    scale = width**-0.5
    expected = mla_decode_reference(*inputs, scale=scale, value_dim=value_dim)
    schedule = "shared" if name in SHARED_CASES else "single"
    kw = dict(scale=scale, value_dim=value_dim, interpret=True, num_splits=splits, schedule=schedule)
    out = mla_decode_kernel(*inputs, **kw)
    assert out.shape == (batch, tokens, heads, value_dim) and out.dtype == dtype
    assert_close(out, expected, dtype)
    assert np.all(np.asarray(out, np.float32)[np.asarray(inputs[3]) < 0] == 0)


@pytest.mark.parametrize("schedule", ["shared", "single"])
def test_kernel_deepseek_sizes(schedule):
    """H = 128, C = 512 + 64, value_dim = 512 (four row blocks; two value blocks or two consumers),
    a few pages."""
    inputs = make_inputs(
        1,
        batch=1,
        tokens=2,
        heads=128,
        width=576,
        page_size=64,
        pages_per_row=3,
        dtype=jnp.bfloat16,
        last=[150],
    )
    expected = mla_decode_reference(*inputs, scale=576**-0.5, value_dim=512)
    out = mla_decode_kernel(*inputs, scale=576**-0.5, value_dim=512, interpret=True, schedule=schedule)
    assert_close(out, expected, jnp.bfloat16)


@pytest.mark.slow
def test_kernel_long_context():
    """32k cached positions (512 key blocks, 2048 pages of 16) for one row, the default splits."""
    page_size, pages_per_row = 16, 2048
    inputs = make_inputs(
        2,
        batch=2,
        tokens=2,
        heads=2,
        width=64,
        page_size=page_size,
        pages_per_row=pages_per_row,
        dtype=jnp.bfloat16,
        last=[page_size * pages_per_row - 1, 1000],
    )
    expected = mla_decode_reference(*inputs, scale=0.125, value_dim=64)
    out = mla_decode_kernel(*inputs, scale=0.125, value_dim=64, interpret=True)
    assert_close(out, expected, jnp.bfloat16)


def test_garbage_past_needed_pages_is_ignored():
    """Out-of-range and NaN-page ids past the needed pages change nothing (and are never read)."""
    kw = dict(batch=3, tokens=4, heads=2, width=40, page_size=8, pages_per_row=9, dtype=jnp.float32)
    clean = make_inputs(3, garbage=False, last=[20, 37, 5], **kw)
    dirty = make_inputs(3, garbage=True, last=[20, 37, 5], **kw)
    assert not np.array_equal(np.asarray(clean[2]), np.asarray(dirty[2]))
    expected = mla_decode_reference(*clean, scale=0.2, value_dim=32)
    np.testing.assert_array_equal(mla_decode_reference(*dirty, scale=0.2, value_dim=32), expected)
    out = mla_decode_kernel(*dirty, scale=0.2, value_dim=32, interpret=True, num_splits=2)
    assert_close(out, expected, jnp.float32)


@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_stacked_pages_read_the_given_layer(impl):
    """A stack [L, P, S, C] with a traced layer index reads that layer's cache, as the model's scan
    over layers calls it; the other layers (here poisoned with NaN) are never touched."""
    q, pages, table, positions = make_inputs(
        7, batch=2, tokens=3, heads=2, width=40, page_size=8, pages_per_row=4, dtype=jnp.float32
    )
    poison = jnp.full_like(pages, jnp.nan)
    stack = jnp.stack([poison, pages, poison])
    expected = mla_decode_reference(q, pages, table, positions, scale=0.3, value_dim=32)
    run = jax.jit(
        lambda s, i: mla_decode(q, s, table, positions, scale=0.3, value_dim=32, impl=impl, layer=i)
    )
    assert_close(run(stack, jnp.int32(1)), expected, jnp.float32)


def test_dispatcher_interpret_under_jit():
    inputs = make_inputs(
        4, batch=2, tokens=3, heads=3, width=40, page_size=8, pages_per_row=4, dtype=jnp.bfloat16
    )
    run = jax.jit(lambda *a: mla_decode(*a, scale=0.3, value_dim=24, impl="interpret"))
    assert_close(run(*inputs), mla_decode_reference(*inputs, scale=0.3, value_dim=24), jnp.bfloat16)


@pytest.mark.skipif(ON_HOPPER, reason="checks the fallback away from a Hopper GPU")
def test_dispatcher_auto_is_reference_off_gpu(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    inputs = make_inputs(
        5, batch=2, tokens=2, heads=2, width=40, page_size=8, pages_per_row=3, dtype=jnp.bfloat16
    )
    assert resolve_impl("auto", inputs[1]) == "reference"
    np.testing.assert_array_equal(
        mla_decode(*inputs, scale=0.3, value_dim=32),
        mla_decode_reference(*inputs, scale=0.3, value_dim=32),
    )


@pytest.mark.skipif(ON_HOPPER, reason="needs a device where the native kernel cannot compile")
def test_auto_falls_back_to_the_reference_when_the_kernel_does_not_compile(monkeypatch):
    """On a (faked) Hopper GPU "auto" picks the kernel, compiles it alone first and, as it cannot
    compile here, warns once per shape and runs the reference, also inside a jitted caller."""
    import pallas_kernels.mla_decode as dispatcher
    from pallas_kernels import native

    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(dispatcher, "_on_hopper", lambda: True)
    monkeypatch.setattr(native, "_RESULTS", {})
    inputs = make_inputs(
        6, batch=2, tokens=2, heads=2, width=64, page_size=16, pages_per_row=3, dtype=jnp.bfloat16
    )
    assert resolve_impl("auto", inputs[1]) == "kernel"
    run = jax.jit(lambda *a: mla_decode(*a, scale=0.3, value_dim=64))
    with pytest.warns(RuntimeWarning, match=r"mla_decode \(single schedule\): the native kernel did not"):
        out = run(*inputs)
    assert_close(out, mla_decode_reference(*inputs, scale=0.3, value_dim=64), jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the verdict is cached: no second compile, no second warning
        mla_decode(*inputs, scale=0.3, value_dim=64)
    with pytest.raises(ValueError, match="interpret mode"):  # forced, the kernel's own error surfaces
        mla_decode(*inputs, scale=0.3, value_dim=64, impl="kernel")


def test_auto_uses_the_kernel_when_it_compiles(monkeypatch):
    import pallas_kernels.mla_decode as dispatcher
    from pallas_kernels import native

    calls = []
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(dispatcher, "_on_hopper", lambda: True)
    monkeypatch.setattr(
        native, "compiles_natively", lambda name, fn, args, key=(): calls.append(name) or True
    )
    monkeypatch.setattr(dispatcher, "mla_decode_kernel", lambda *a, **kw: calls.append(kw["interpret"]))
    inputs = make_inputs(
        7, batch=1, tokens=2, heads=2, width=64, page_size=16, pages_per_row=2, dtype=jnp.bfloat16
    )
    mla_decode(*inputs, scale=0.3, value_dim=64)
    assert calls == ["mla_decode (single schedule)", False]  # probed, then the compiled kernel called


def test_auto_probes_the_picked_schedule_then_the_single_one(monkeypatch):
    """Where pick_schedule picks the shared schedule, it is probed first; should it not compile,
    the single one is probed and run (not the reference)."""
    import pallas_kernels.mla_decode as dispatcher
    from pallas_kernels import native

    probes, schedules, verdict = [], [], {"shared": True}

    def compiles(name, fn, args, key=()):
        probes.append(name)
        return verdict.get(name.split("(")[1].split()[0], True)

    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(dispatcher, "_on_hopper", lambda: True)
    monkeypatch.setattr(native, "compiles_natively", compiles)
    monkeypatch.setattr(dispatcher, "mla_decode_kernel", lambda *a, **kw: schedules.append(kw["schedule"]))
    monkeypatch.setattr(kernel_module, "TARGET_PROGRAMS", 1)  # no key splits
    # 64 pages of 64 positions: 64 key blocks for the one program: shared
    inputs = make_inputs(
        8, batch=1, tokens=1, heads=2, width=192, page_size=64, pages_per_row=64, dtype=jnp.bfloat16
    )
    mla_decode(*inputs, scale=0.3, value_dim=128)
    verdict["shared"] = False
    mla_decode(*inputs, scale=0.3, value_dim=128)
    assert schedules == ["shared", "single"]
    assert probes == ["mla_decode (shared schedule)"] * 2 + ["mla_decode (single schedule)"]


def test_pick_schedule_follows_the_measured_shapes():
    """The H200 measurements behind SHARED_MIN_BLOCKS: DeepSeek-V3 (128 heads, 512 values), page
    tables of 1024 / 32768 positions."""
    picks = {
        (batch, tokens, keys): pick_schedule(batch, tokens, 128, 512, keys)
        for batch in (1, 64)
        for tokens in (1, 4)
        for keys in (1024, 32768)
    }
    assert {k for k, v in picks.items() if v == "shared"} == {
        (1, 4, 32768),
        (64, 1, 32768),
        (64, 4, 1024),
        (64, 4, 32768),
    }
    assert pick_schedule(64, 4, 128, 64, 32768) == "single"  # 64 values cannot split in two


@pytest.mark.parametrize("stacked", [False, True])
def test_reference_dispatch_in_query_chunks_equals_one_call(monkeypatch, stacked):
    """Prefill-length blocks go through the reference in chunks of QUERY_CHUNK queries (bounded
    score memory); every query gets what one call of the reference gives it, padding included."""
    import pallas_kernels.mla_decode as dispatcher

    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(dispatcher, "QUERY_CHUNK", 4)
    q, pages, table, positions = make_inputs(
        9, batch=3, tokens=11, heads=2, width=40, page_size=8, pages_per_row=3, dtype=jnp.float32
    )
    layer = None
    if stacked:
        pages, layer = jnp.stack([pages * 0.5, pages]), 1
    want = mla_decode_reference(q, pages, table, positions, scale=0.3, value_dim=32, layer=layer)
    got = jax.jit(lambda *a: mla_decode(*a, scale=0.3, value_dim=32, layer=layer))(q, pages, table, positions)
    assert got.shape == want.shape == (3, 11, 2, 32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    expected = numpy_attention(
        *(np.asarray(a) for a in (q, pages[1] if stacked else pages, table, positions)), 0.3, 32
    )
    assert_close(got, expected, jnp.float32)


@pytest.mark.parametrize(
    "last, width", [([5, 9, 12], 2), ([5, 30, 12], 4), ([5, 40, 12], 8), ([-1, -1, -1], 2)]
)
def test_reference_dispatch_reads_only_the_live_pages(monkeypatch, last, width):
    """Off the kernel, a call reads the narrowest prefix of the page table (a factor 2 apart, not
    under LIVE_KEYS keys) holding every key its queries see, chosen on device, and gives what the
    reference over the whole table gives."""
    import pallas_kernels.mla_decode as dispatcher
    import pallas_kernels.paged as chunks

    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(chunks, "LIVE_KEYS", 16)  # 8 pages of 8 keys: widths 8, 4 and 2
    widths = []

    def spy(q, pages, table, positions, **kw):
        jax.debug.callback(lambda: widths.append(table.shape[1]))
        return mla_decode_reference(q, pages, table, positions, **kw)

    monkeypatch.setattr(dispatcher, "mla_decode_reference", spy)
    q, pages, table, positions = make_inputs(
        3, batch=3, tokens=2, heads=2, width=40, page_size=8, pages_per_row=8, dtype=jnp.float32, last=last
    )
    got = jax.jit(lambda *a: mla_decode(*a, scale=0.3, value_dim=32))(q, pages, table, positions)
    assert widths == [width]
    want = mla_decode_reference(q, pages, table, positions, scale=0.3, value_dim=32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    expected = numpy_attention(*(np.asarray(a) for a in (q, pages, table, positions)), 0.3, 32)
    assert_close(got, expected, jnp.float32)


def test_dispatcher_impl_choice(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(ValueError, match="impl must be one of"):
        resolve_impl("triton")
    for impl in ("kernel", "interpret", "reference"):
        assert resolve_impl(impl) == impl
        monkeypatch.setenv(ENV_VAR, impl)
        assert resolve_impl("auto") == impl
        assert resolve_impl("reference") == "reference"  # an explicit impl wins over the variable
    monkeypatch.setenv(ENV_VAR, "fast")
    with pytest.raises(ValueError, match=ENV_VAR):
        resolve_impl("auto")


def test_dispatcher_rejects_bad_arguments():
    q, pages, table, positions = make_inputs(
        6, batch=2, tokens=2, heads=2, width=40, page_size=8, pages_per_row=3, dtype=jnp.float32
    )
    kw = dict(scale=0.3, value_dim=32)
    with pytest.raises(ValueError, match="impl must be one of"):
        mla_decode(q, pages, table, positions, impl="pallas", **kw)
    with pytest.raises(ValueError, match=r"q must be \[B, T, H, C\]"):
        mla_decode(q[0], pages, table, positions, **kw)
    with pytest.raises(ValueError, match=r"pages must be \[P, S, C=40\].*\(7, 8, 39\)"):
        mla_decode(q, pages[..., :39], table, positions, **kw)
    with pytest.raises(ValueError, match="pages dtype"):
        mla_decode(q, pages.astype(jnp.bfloat16), table, positions, **kw)
    with pytest.raises(ValueError, match="needs the layer to read"):
        mla_decode(q, pages[None], table, positions, **kw)
    with pytest.raises(ValueError, match="only a stack takes"):
        mla_decode(q, pages, table, positions, layer=0, **kw)
    with pytest.raises(ValueError, match=r"page_table must be \[B=2, N\].*\(1, 3\)"):
        mla_decode(q, pages, table[:1], positions, **kw)
    with pytest.raises(ValueError, match=r"positions must be \[B, T\] = \(2, 2\).*\(2, 1\)"):
        mla_decode(q, pages, table, positions[:, :1], **kw)
    with pytest.raises(ValueError, match="positions must be an integer array"):
        mla_decode(q, pages, table, positions.astype(jnp.float32), **kw)
    with pytest.raises(ValueError, match="value_dim must be in"):
        mla_decode(q, pages, table, positions, scale=0.3, value_dim=41)
    with pytest.raises(ValueError, match="compiled kernel takes"):
        mla_decode(q, pages, table, positions, impl="kernel", **kw)
    with pytest.raises(ValueError, match="page_size must be a multiple of 8"):
        mla_decode(q, pages[:, :4], table, positions, impl="interpret", **kw)


def test_default_splits():
    assert default_splits(programs=512, max_keys=32768) == 1  # enough programs already
    assert default_splits(programs=16, max_keys=32768) == 9  # 132 / 16, rounded up
    assert default_splits(programs=1, max_keys=3 * BLOCK_KEYS) == 1  # too few key blocks


@pytest.mark.parametrize("schedule", ["shared", "single"])
@pytest.mark.parametrize("page_size, pages_per_row, splits", [(16, 8, 1), (64, 512, None)])
def test_native_path_lowers_to_mosaic_gpu(page_size, pages_per_row, splits, schedule):
    """The compiled (non-interpret) path at DeepSeek-V3 sizes lowers to a Mosaic GPU module on CPU."""
    shapes = (
        jax.ShapeDtypeStruct((2, 4, 128, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((64, page_size, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((2, pages_per_row), jnp.int32),
        jax.ShapeDtypeStruct((2, 4), jnp.int32),
    )
    kw = dict(scale=0.1, value_dim=512, num_splits=splits, schedule=schedule)
    run = jax.jit(lambda *a: mla_decode_kernel(*a, **kw))
    text = run.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@hopper
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("splits", [1, None])
@pytest.mark.parametrize("schedule", ["shared", "single"])
def test_native_kernel_deepseek_sizes(page_size, splits, schedule):
    """Compiled on the GPU: DeepSeek-V3 heads and widths, K+1 = 4 tokens, one row at 32k positions."""
    pages_per_row = 32768 // page_size
    inputs = make_inputs(
        7,
        batch=4,
        tokens=4,
        heads=128,
        width=576,
        page_size=page_size,
        pages_per_row=pages_per_row,
        dtype=jnp.bfloat16,
        last=[32767, 5000, 77, 2],
    )
    scale = 192**-0.5
    expected = mla_decode_reference(*inputs, scale=scale, value_dim=512)
    out = mla_decode_kernel(*inputs, scale=scale, value_dim=512, num_splits=splits, schedule=schedule)
    assert_close(out, expected, jnp.bfloat16)
    if splits is None and schedule == pick_schedule(4, 4, 128, 512, 32768):  # what the dispatcher runs here
        np.testing.assert_array_equal(mla_decode(*inputs, scale=scale, value_dim=512), out)
