"""MoE dispatch: grouped matmul (Pallas kernels, ragged_dot or jnp reference) and routed experts.

Two Pallas grouped-matmul kernels with one contract (:mod:`pallas_kernels.moe.reference`): the
Mosaic GPU kernel for Hopper (:mod:`pallas_kernels.moe.mosaic_gpu`, the main one) and the older
Triton-backend kernel (:mod:`pallas_kernels.moe.kernel`), kept for Ampere / Ada GPUs and for
comparison (the Pallas Triton backend is deprecated from JAX 0.11).

``impl`` picks the implementation; it is resolved when the function is traced:

- ``"auto"``: on a Hopper GPU (compute capability 9.x) the Mosaic GPU kernel when it takes the
  inputs (bf16/f16 lhs; FP8 scale blocks its default tiles divide, see
  :func:`pallas_kernels.moe.mosaic_gpu.tile_sizes`: DeepSeek-V3's 128x128 does), else
  ``ragged_dot``; on another NVIDIA GPU of compute capability >= 8.0 the Triton kernel when it
  compiles there (sm_89+ for FP8 rhs, FP8 scale blocks that are powers of two >= 16), else
  ``ragged_dot``; ``ragged_dot`` on every other backend. The environment variable
  ``MTP_JAX_KERNELS`` = ``reference`` / ``kernel`` / ``interpret`` overrides this choice (only for
  ``"auto"``; the variable is shared with :mod:`pallas_kernels.mla_decode`, hence no Triton
  values).
- ``"kernel"``: the Mosaic GPU kernel compiled natively; ValueError off a Hopper GPU or for inputs
  it does not take natively (float32 lhs, FP8 blocks it cannot tile).
- ``"interpret"``: the Mosaic GPU kernel in Mosaic GPU interpret mode (any backend; slow, for tests).
- ``"triton"``: the Triton kernel compiled natively; ValueError off a GPU it compiles for.
- ``"triton_interpret"``: the Triton kernel run by the generic Pallas interpreter (tests).
- ``"reference"``: :mod:`pallas_kernels.moe.reference` (every expert on every row; slow).
- ``"ragged_dot"``: ``jax.lax.ragged_dot`` on the dequantised weights, as
:mod:`mtp_jax.targets.deepseek_v3.moe` does.

When ``"auto"`` picks a compiled kernel ("kernel" or "triton"), it is first compiled alone at the
call's shapes (once per shape, :mod:`pallas_kernels.native`); if the device's toolchain refuses it,
``ragged_dot`` runs instead, with a warning.

Permute and combine are jnp (sort, gather, scatter-add) for every ``impl``.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp

from pallas_kernels import native
from pallas_kernels.fp8 import Fp8Weight, materialize
from pallas_kernels.moe import kernel, mosaic_gpu, reference
from pallas_kernels.moe.reference import combine, permute

__all__ = ["ENV_VAR", "IMPLS", "combine", "gmm", "permute", "routed_experts", "select_impl"]

IMPLS = ("auto", "kernel", "interpret", "triton", "triton_interpret", "reference", "ragged_dot")
ENV_VAR = "MTP_JAX_KERNELS"
ENV_CHOICES = ("reference", "kernel", "interpret")
# The keyword options each kernel takes; the others are dropped (and every option is ignored by the
# non-kernel implementations), so one set of options can go to whichever kernel "auto" picks.
KERNEL_OPTIONS = {
    "mosaic_gpu": ("block_m", "block_n", "block_k", "num_stages", "group_splits"),
    "triton": ("block_m", "block_n", "block_k", "num_warps", "num_stages"),
}


def _cuda_capability() -> tuple[int, int] | None:
    if jax.default_backend() != "gpu":
        return None
    try:
        major, minor = str(jax.devices()[0].compute_capability).split(".")[:2]
        return int(major), int(minor)
    except (AttributeError, ValueError):
        return None


def _on_hopper() -> bool:
    capability = _cuda_capability()
    return capability is not None and capability[0] == 9


def _mosaic_takes(fp8_block: tuple[int, int] | None, dtype: jax.typing.DTypeLike | None) -> str | None:
    """Why the compiled Mosaic GPU kernel cannot take these inputs (None if it can), on any device."""
    if dtype is not None and jnp.dtype(dtype) not in mosaic_gpu.NATIVE_DTYPES:
        return f"lhs dtype {jnp.dtype(dtype)} (the compiled kernel takes bfloat16 or float16)"
    if fp8_block is not None:
        try:
            mosaic_gpu.tile_sizes(fp8_block, mosaic_gpu.WGMMA_M, None, None)
        except ValueError as e:
            return f"FP8 scale block {fp8_block} ({e})"
    return None


def _triton_fits_device(fp8_block: tuple[int, int] | None) -> bool:
    capability = _cuda_capability()
    if capability is None:
        return False
    if fp8_block is None:
        return capability >= (8, 0)
    native_tiles = all(b >= 16 and b & (b - 1) == 0 for b in fp8_block)
    return capability >= (8, 9) and native_tiles


def select_impl(
    impl: str = "auto", fp8_block: tuple[int, int] | None = None, dtype: jax.typing.DTypeLike | None = None
) -> str:
    """The implementation ``impl`` stands for here: one of IMPLS other than ``"auto"``.

    fp8_block: the (b_in, b_out) scale block when the weights are FP8, else None; dtype: the lhs
    dtype when known. ValueError for an unknown ``impl`` or ``MTP_JAX_KERNELS`` value, and for
    ``"kernel"`` / ``"triton"`` where that kernel cannot be compiled for these inputs.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        forced = os.environ.get(ENV_VAR, "").strip().lower()
        if forced and forced not in ENV_CHOICES:
            raise ValueError(
                f"environment variable {ENV_VAR} must be one of {ENV_CHOICES} or unset, got {forced!r}"
            )
        if forced:
            impl = forced
        elif _on_hopper():
            impl = "ragged_dot" if _mosaic_takes(fp8_block, dtype) else "kernel"
        else:
            impl = "triton" if _triton_fits_device(fp8_block) else "ragged_dot"
    if impl == "kernel":
        if not _on_hopper():
            raise ValueError(
                f"impl='kernel' (the Mosaic GPU kernel) needs a Hopper GPU (compute capability 9.x); this "
                f"backend is {jax.default_backend()!r} with capability {_cuda_capability()}: use "
                "impl='interpret' to run the kernel interpreted, or impl='triton' on an sm_80+ GPU"
            )
        why = _mosaic_takes(fp8_block, dtype)
        if why:
            raise ValueError(f"impl='kernel': the compiled Mosaic GPU kernel cannot take {why}")
    if impl == "triton" and not _triton_fits_device(fp8_block):
        raise ValueError(
            f"impl='triton' needs an NVIDIA GPU of compute capability >= 8.0 (8.9 for FP8, with power-of-two "
            f"scale blocks >= 16; got fp8_block={fp8_block}); this backend is {jax.default_backend()!r} "
            f"with capability {_cuda_capability()}: use impl='triton_interpret' to run it interpreted"
        )
    return impl


def _check_gmm(lhs: jax.Array, rhs: jax.Array | Fp8Weight, group_sizes: jax.Array) -> None:
    if lhs.ndim != 2:
        raise ValueError(f"gmm: lhs must be [m, kdim], got shape {lhs.shape}")
    if lhs.dtype not in kernel.LHS_DTYPES:
        raise ValueError(f"gmm: lhs dtype must be bfloat16, float16 or float32, got {lhs.dtype}")
    if isinstance(rhs, Fp8Weight):
        w = rhs.w
        if w.ndim != 3 or tuple(rhs.shape) != tuple(w.shape[1:]):
            raise ValueError(
                f"gmm: FP8 rhs must have w [E, kdim, ndim] and shape (kdim, ndim), got w {w.shape}, "
                f"shape {rhs.shape}"
            )
        if w.dtype != jnp.float8_e4m3fn:
            raise ValueError(f"gmm: FP8 rhs.w must be float8_e4m3fn, got {w.dtype}")
        b_in, b_out = rhs.block
        want = (w.shape[0], math.ceil(w.shape[1] / b_in), math.ceil(w.shape[2] / b_out))
        if tuple(rhs.scale_inv.shape) != want:
            raise ValueError(
                f"gmm: FP8 rhs.scale_inv must be [E, ceil(kdim/b_in), ceil(ndim/b_out)] = {want} for w "
                f"{w.shape} and block {rhs.block}, got {rhs.scale_inv.shape}"
            )
    else:
        w = rhs
        if w.ndim != 3 or not jnp.issubdtype(w.dtype, jnp.floating):
            raise ValueError(f"gmm: rhs must be a float [E, kdim, ndim] array, got {w.dtype} {w.shape}")
    if w.shape[1] != lhs.shape[1]:
        raise ValueError(f"gmm: lhs [m, kdim] {lhs.shape} and rhs [E, kdim, ndim] {w.shape} differ in kdim")
    if group_sizes.shape != (w.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(
            f"gmm: group_sizes must be an integer [E] = [{w.shape[0]}] array for rhs {w.shape}, "
            f"got {group_sizes.dtype} {group_sizes.shape}"
        )


def _options(family: str, kernel_options: dict) -> dict:
    return {k: v for k, v in kernel_options.items() if k in KERNEL_OPTIONS[family]}


def gmm(
    lhs: jax.Array,
    rhs: jax.Array | Fp8Weight,
    group_sizes: jax.Array,
    *,
    impl: str = "auto",
    **kernel_options: int,
) -> jax.Array:
    """Grouped matmul: out [m, ndim] in lhs.dtype, rows of group e = lhs rows @ rhs[e].

    lhs [m, kdim] bf16/f16/f32; rhs [E, kdim, ndim] float array or :class:`Fp8Weight` (w
    [E, kdim, ndim] float8_e4m3fn, scale_inv [E, ceil(kdim/b_in), ceil(ndim/b_out)]); group_sizes
    [E] int, non-negative, sum <= m; rows at or beyond the sum are zero. Float32 accumulation.
    ``kernel_options`` go to the kernel that runs, each kernel taking its own (``KERNEL_OPTIONS``:
    block_m, block_n, block_k, num_stages, and num_warps for Triton); the rest are ignored, as all
    are by the non-kernel implementations.
    """
    _check_gmm(lhs, rhs, group_sizes)
    automatic = impl == "auto" and not os.environ.get(ENV_VAR, "").strip()
    impl = select_impl(impl, rhs.block if isinstance(rhs, Fp8Weight) else None, lhs.dtype)
    if automatic and impl in ("kernel", "triton"):
        family = "mosaic_gpu" if impl == "kernel" else "triton"
        options = _options(family, kernel_options)
        compiled = functools.partial((mosaic_gpu if impl == "kernel" else kernel).gmm, **options)
        key = tuple(sorted(options.items()))
        if not native.compiles_natively(f"gmm ({family})", compiled, (lhs, rhs, group_sizes), key):
            impl = "ragged_dot"
    if impl in ("kernel", "interpret"):
        options = _options("mosaic_gpu", kernel_options)
        out = mosaic_gpu.gmm(lhs, rhs, group_sizes, interpret=impl == "interpret", **options)
        return native.settled(out) if impl == "interpret" else out
    if impl in ("triton", "triton_interpret"):
        options = _options("triton", kernel_options)
        out = kernel.gmm(lhs, rhs, group_sizes, interpret=impl == "triton_interpret", **options)
        return native.settled(out) if impl == "triton_interpret" else out
    if impl == "reference":
        return reference.gmm(lhs, rhs, group_sizes)
    dense = materialize(rhs, lhs.dtype).astype(lhs.dtype)
    return jax.lax.ragged_dot(lhs, dense, group_sizes.astype(jnp.int32))


def _shape(w: jax.Array | Fp8Weight) -> tuple[int, ...]:
    return tuple(w.w.shape if isinstance(w, Fp8Weight) else w.shape)


def routed_experts(
    x: jax.Array,
    weights: jax.Array,
    idx: jax.Array,
    gate: jax.Array | Fp8Weight,
    up: jax.Array | Fp8Weight,
    down: jax.Array | Fp8Weight,
    *,
    impl: str = "auto",
    **kernel_options: int,
) -> jax.Array:
    """Σ_k weights[n,k] · expert_{idx[n,k]}(x[n]) for x [n, d]: out [n, d] in x.dtype, dropless.

    weights [n, k] float32; idx [n, k] int32 in [0, E); gate/up [E, d, f], down [E, f, d], arrays or
    :class:`Fp8Weight`. Same math as :func:`mtp_jax.targets.deepseek_v3.moe.routed_experts`: permute, three
    grouped
    matmuls (silu(xs @ gate) * (xs @ up) @ down, each rounded to x.dtype), combine. Under ``"auto"``
    each matmul picks its implementation by its own weight (FP8 or not).
    """
    if x.ndim != 2 or weights.shape != idx.shape or idx.ndim != 2 or idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"routed_experts: need x [n, d], weights [n, k], idx [n, k]; got x {x.shape}, "
            f"weights {weights.shape}, idx {idx.shape}"
        )
    e, d, f = _shape(gate)
    if _shape(up) != (e, d, f) or _shape(down) != (e, f, d) or d != x.shape[1]:
        raise ValueError(
            f"routed_experts: need gate, up [E, d, f] and down [E, f, d] with d = x.shape[1] = {x.shape[1]}; "
            f"got gate {_shape(gate)}, up {_shape(up)}, down {_shape(down)}"
        )
    # Validates impl and the environment; "auto" is then resolved per weight by gmm (FP8 or not).
    if select_impl(impl) == "reference":
        return reference.routed_experts(x, weights, idx, gate, up, down)
    xs, sizes, order = permute(x, idx, e)
    mm = functools.partial(gmm, group_sizes=sizes, impl=impl, **kernel_options)
    h = jax.nn.silu(mm(xs, gate)) * mm(xs, up)
    return combine(mm(h, down), order, weights, x.shape[0])
