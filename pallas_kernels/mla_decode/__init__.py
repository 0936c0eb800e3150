"""MLA decode attention over a paged latent cache: Pallas Mosaic GPU kernel, reference, dispatcher.

:func:`mla_decode` picks an implementation: ``impl="auto"`` runs the kernel on a Hopper GPU
(compute capability 9.x) when the inputs suit it (16-bit dtype, a supported page size) and the
pure-jnp reference everywhere else. The environment variable ``MTP_JAX_KERNELS`` (``reference``,
``kernel`` or ``interpret``) overrides what ``"auto"`` would pick; an explicit ``impl`` wins over it.
When ``"auto"`` picks the kernel, it is first compiled alone at the call's shapes (once per shape,
:mod:`pallas_kernels.native`); if the device's toolchain refuses it, the reference runs instead,
with a warning.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from pallas_kernels import native
from pallas_kernels.mla_decode.kernel import (
    NATIVE_DTYPES,
    check_page_size,
    mla_decode_kernel,
    pick_schedule,
)
from pallas_kernels.mla_decode.reference import mla_decode_reference
from pallas_kernels.paged import QUERY_CHUNK, attend_paged, check_tree

__all__ = [
    "ENV_VAR",
    "IMPLS",
    "QUERY_CHUNK",
    "mla_decode",
    "mla_decode_kernel",
    "mla_decode_reference",
    "resolve_impl",
]

ENV_VAR = "MTP_JAX_KERNELS"
IMPLS = ("auto", "kernel", "interpret", "reference")


def _on_hopper() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")


def _kernel_suits(pages: jax.Array) -> bool:
    if jnp.dtype(pages.dtype) not in NATIVE_DTYPES:
        return False
    try:
        check_page_size(pages.shape[-2])
    except ValueError:
        return False
    return True


def resolve_impl(impl: str, pages: jax.Array | None = None) -> str:
    """The implementation ``impl`` stands for here: "kernel", "interpret" or "reference".

    ``pages`` (optional) lets ``"auto"`` fall back to the reference for inputs the native kernel
    does not take (float32, an unsupported page size).
    """
    if impl not in IMPLS:
        raise ValueError(f"mla_decode: impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced:
        if forced not in IMPLS[1:]:
            raise ValueError(f"{ENV_VAR} must be one of {IMPLS[1:]} (or unset), got {forced!r}")
        return forced
    if _on_hopper() and (pages is None or _kernel_suits(pages)):
        return "kernel"
    return "reference"


def _check_args(q, pages, page_table, positions, value_dim, layer) -> None:
    if q.ndim != 4:
        raise ValueError(f"mla_decode: q must be [B, T, H, C], got shape {q.shape}")
    batch, tokens, _, width = q.shape
    if pages.ndim not in (3, 4) or pages.shape[-1] != width:
        raise ValueError(
            f"mla_decode: pages must be [P, S, C={width}] or a stack [L, P, S, C] (C from q {q.shape}), "
            f"got {pages.shape}"
        )
    if (layer is None) != (pages.ndim == 3):
        raise ValueError(
            f"mla_decode: a stack of pages [L, P, S, C] needs the layer to read, and only a stack takes "
            f"one (pages {pages.shape}, layer {layer!r})"
        )
    if pages.dtype != q.dtype:
        raise ValueError(f"mla_decode: pages dtype {pages.dtype} differs from q dtype {q.dtype}")
    if page_table.ndim != 2 or page_table.shape[0] != batch:
        raise ValueError(
            f"mla_decode: page_table must be [B={batch}, N] (B from q {q.shape}), got {page_table.shape}"
        )
    if positions.shape != (batch, tokens):
        raise ValueError(
            f"mla_decode: positions must be [B, T] = {(batch, tokens)} (from q {q.shape}), "
            f"got {positions.shape}"
        )
    for name, x in (("page_table", page_table), ("positions", positions)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"mla_decode: {name} must be an integer array, got {x.dtype}")
    if not 0 < value_dim <= width:
        raise ValueError(f"mla_decode: value_dim must be in [1, C={width}], got {value_dim}")


def _compiling_schedule(q, pages, page_table, positions, scale, value_dim, layer) -> str | None:
    """The kernel schedule to run natively for these shapes: the one :func:`pick_schedule` picks,
    else the single one, the first that compiles (see :mod:`pallas_kernels.native`); None if neither
    does."""
    args = (q, pages, page_table, positions) + (() if layer is None else (layer,))
    batch, tokens, heads, _ = q.shape
    picked = pick_schedule(batch, tokens, heads, value_dim, page_table.shape[1] * pages.shape[-2])
    for schedule in dict.fromkeys([picked, "single"]):

        def run(q, pages, page_table, positions, *stack_layer, schedule=schedule):
            at = stack_layer[0] if stack_layer else None
            kw = dict(scale=scale, value_dim=value_dim, layer=at, schedule=schedule)
            return mla_decode_kernel(q, pages, page_table, positions, **kw)

        if native.compiles_natively(f"mla_decode ({schedule} schedule)", run, args, key=(scale, value_dim)):
            return schedule
    return None


def mla_decode(
    q: jax.Array,
    pages: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
    *,
    scale: float,
    value_dim: int,
    impl: str = "auto",
    layer: jax.Array | int | None = None,
    tree: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Absorbed MLA attention of T query tokens per row against the paged latent cache.

    q [B, T, H, C] and pages [P, S, C] of one dtype (or a stack [L, P, S, C] of layers' caches and
    the ``layer`` to read, possibly traced), page_table [B, N] int32, positions [B, T]
    int32 -> [B, T, H, value_dim] in q.dtype. Query (b, t) sees cache positions
    ``s <= positions[b, t]``; a negative position sees nothing and yields zeros. See
    :func:`mla_decode_reference` for the full contract. ``impl``: "auto", "kernel" (compiled Mosaic
    GPU kernel), "interpret" (the kernel in Mosaic GPU interpret mode, any backend) or "reference"
    (in chunks of :data:`QUERY_CHUNK` queries, each over the pages it can see:
    :func:`pallas_kernels.paged.attend_paged`). ``tree`` (base [B], nodes [B, T, N]): a token
    tree's attention mask (:func:`pallas_kernels.paged.visible_keys`), at most
    :data:`QUERY_CHUNK` queries; the kernel does not take one yet, so "auto" runs the reference.
    """
    _check_args(q, pages, page_table, positions, value_dim, layer)
    check_tree(tree, q, QUERY_CHUNK)
    automatic = impl == "auto" and not os.environ.get(ENV_VAR, "").strip()
    impl = resolve_impl(impl, pages)
    if tree is not None and impl != "reference":
        if not automatic:
            raise ValueError(f"mla_decode: tree attention runs on the reference only, got impl={impl!r}")
        impl = "reference"
    schedule = "auto"
    if automatic and impl == "kernel":
        schedule = _compiling_schedule(q, pages, page_table, positions, scale, value_dim, layer)
        impl = "reference" if schedule is None else impl
    if impl == "reference":

        def reference(q, table, positions):
            kw = dict(scale=scale, value_dim=value_dim, layer=layer, tree=tree)
            return mla_decode_reference(q, pages, table, positions, **kw)

        return attend_paged(reference, q, page_table, positions, pages.shape[-2], QUERY_CHUNK)
    if impl == "kernel" and jnp.dtype(q.dtype) not in NATIVE_DTYPES:
        raise ValueError(
            f"mla_decode: the compiled kernel takes {[str(d) for d in NATIVE_DTYPES]}, got {q.dtype} "
            "(use impl='reference' or 'interpret')"
        )
    out = mla_decode_kernel(
        q,
        pages,
        page_table,
        positions,
        scale=scale,
        value_dim=value_dim,
        interpret=impl == "interpret",
        layer=layer,
        schedule=schedule,
    )
    return native.settled(out) if impl == "interpret" else out
