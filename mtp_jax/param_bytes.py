"""Counting the bytes of parameter trees: shared by the roofline (:mod:`mtp_jax.roofline`) and the
drafts' ``step_reads`` hooks (:class:`mtp_jax.drafts.base.StepReads`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from mtp_jax.fp8 import Fp8Weight
from mtp_jax.sharding import param_logical


def nbytes(x: Any) -> int:
    """Bytes of an array or ShapeDtypeStruct."""
    return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


_FP8_FIELDS = tuple(f.name for f in dataclasses.fields(Fp8Weight))


def path_names(path: tuple) -> list[str]:
    """A tree path's keys as strings."""
    return [str(getattr(p, "key", getattr(p, "name", p))) for p in path]


def expected_experts(n_tokens: int, n_experts: int, top_k: int) -> float:
    """Expected number of distinct experts ``n_tokens`` tokens touch when each picks ``top_k`` of
    ``n_experts`` uniformly and independently (each expert is missed by a token with probability
    1 - top_k / n_experts)."""
    if n_tokens < 0 or not 0 < top_k <= n_experts:
        raise ValueError(
            f"need n_tokens >= 0 and 0 < top_k <= n_experts, got {n_tokens}, {top_k}, {n_experts}"
        )
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** n_tokens)


def is_routed_expert(names: list[str]) -> bool:
    """Whether the parameter at path ``names`` (group first) is a routed expert's projection (its
    group's layout splits it over ``experts``: DeepSeek-V3's MoE and MTP layers)."""
    names = list(names)
    while names and names[-1] in _FP8_FIELDS:  # an Fp8Weight's w / scale_inv
        names.pop()
    return param_logical(names[0], names[1:], 1) == ("experts",)
