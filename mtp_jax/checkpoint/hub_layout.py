"""Our parameter trees -> hub-layout tensors: the pieces every family's key map (``export_tensors``
in its folder) and the draft exporters (:mod:`mtp_jax.export`) are written with."""

from __future__ import annotations

from typing import Any

import numpy as np

from mtp_jax.fp8 import Fp8Weight


def as_numpy(x: Any, dtype: np.dtype) -> np.ndarray:
    """A dense weight as a numpy array of ``dtype`` (FP8 weights are refused)."""
    if isinstance(x, Fp8Weight):
        raise ValueError("exporting FP8 weights is not supported; load the model with weights='dense'")
    return np.asarray(x, dtype=np.float32).astype(dtype)


def linear_to_hub(w: Any, dtype: np.dtype) -> np.ndarray:
    """Ours [in, ...out axes] (or [in..., out] for o_proj) flattened to hub [out, in]."""
    w = as_numpy(w, dtype)
    return np.ascontiguousarray(w.reshape(w.shape[0], -1).T)


def vocab_map_tensors(draft_to_target: Any, vocab_size: int | None) -> dict[str, np.ndarray]:
    """A draft vocabulary as EAGLE-3 checkpoints store it: ``d2t`` int64 OFFSETS (target id = i +
    d2t[i]) and, when the target's vocabulary size is known, the ``t2d`` mask over target ids."""
    ids = np.asarray(draft_to_target, np.int64)
    t = {"d2t": ids - np.arange(len(ids), dtype=np.int64)}
    if vocab_size is not None:
        t2d = np.zeros(vocab_size, bool)
        t2d[ids] = True
        t["t2d"] = t2d
    return t
