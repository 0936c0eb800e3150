"""A guard for the dispatchers' automatic choice of a native kernel.

When ``impl="auto"`` picks a compiled kernel (a Mosaic GPU kernel on a Hopper GPU, the Triton one on
an Ampere / Ada GPU), the dispatcher first compiles that kernel alone at the call's shapes, once per
shape signature. Should the device's toolchain refuse it (a compiler error, too much shared memory
for a shape), "auto" falls back to the dispatcher's portable path with a warning naming the error,
instead of failing the caller's whole program at compile time. An explicit ``impl="kernel"`` (or
``MTP_JAX_KERNELS=kernel``) skips the guard, so the error itself surfaces.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp

_RESULTS: dict[tuple, bool] = {}


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def compiles_natively(name: str, fn: Callable[..., Any], args: tuple, key: Hashable = ()) -> bool:
    """Whether ``jax.jit(fn)`` compiles on the default device for arguments shaped like ``args``
    (arrays or tracers: only their shapes and dtypes are used; pytrees such as FP8 weights keep
    their static fields). ``key`` holds whatever else ``fn`` closes over that changes the program
    (static sizes, options). The answer is cached per (name, argument shapes, key); a failure
    warns once, with the error, and returns False."""
    abstract = jax.tree.map(_abstract, args)
    leaves, tree = jax.tree.flatten(abstract)
    cache_key = (name, str(tree), tuple((a.shape, str(a.dtype)) for a in leaves), key)
    if cache_key not in _RESULTS:
        try:
            jax.jit(fn).lower(*abstract).compile()
        except Exception as e:  # noqa: BLE001 -- any compiler failure means: do not use the kernel here
            first = (str(e).strip().splitlines() or [""])[0][:300]
            shapes = ", ".join(f"{a.dtype}{list(a.shape)}" for a in leaves)
            warnings.warn(
                f"{name}: the native kernel did not compile for ({shapes}): {type(e).__name__}: {first}. "
                "impl='auto' uses the portable path for these shapes; force the kernel (impl='kernel' "
                "or MTP_JAX_KERNELS=kernel) to see the full error.",
                RuntimeWarning,
                stacklevel=3,
            )
            _RESULTS[cache_key] = False
        else:
            _RESULTS[cache_key] = True
    return _RESULTS[cache_key]


def settled(out: Any) -> Any:
    """``out`` waited for, when it is a concrete result (not a tracer): for the interpret modes.

    An interpreted kernel runs through host callbacks that dispatch JAX operations of their own. If
    the caller dispatches anything while those callbacks run (the next eager operation after an
    asynchronous call returns), XLA:CPU deadlocks: both wait for the one device. The suite hung so
    in ``test_moe`` (a callback in ``unstack``, the test in ``jnp.repeat``; faulthandler's stacks),
    once on CI. Inside ``jit`` there is nothing to wait for here: whoever calls the compiled
    function must not dispatch until it has finished."""
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(out)):
        return out
    return jax.block_until_ready(out)
