"""Confidence-scheduled verification: how many drafts a step verifies, chosen on the device from the
draft's own acceptance estimates and the engine's measured speed (DSpark's hardware-aware prefix
scheduler, paper Algorithm 1, for a step of one static width).

A draft with a confidence head (:attr:`mtp_jax.drafts.Draft.confidence`) gives, for row r's draft
j, c_{r,j}: the probability that it is accepted given that drafts 1..j-1 were. Its product
a_{r,j} = c_{r,1} ... c_{r,j} is the probability that draft j is accepted, so verifying drafts
1..W-1 of every row is expected to emit

    tau(W) = sum over active rows r of (1 + sum_{j < W, j <= cap_r} a_{r,j})

tokens (the 1: the bonus or corrected token), and a step of width W (every row's next token and W-1
drafts; the target pass is padded to one width, so a row's drafts inside the width cost nothing
more) runs at SPS(W) steps per second (:class:`SpsTable`, measured by
:func:`mtp_jax.timing.sps_table`).
Throughput is theta(W) = tau(W) · SPS(W). The width goes up one at a time from 1 while theta rises
and stops at the first W whose next width would not raise it (the paper's early stop).

Why exactly so: a_{r,j} depends on the drafts before j (the head reads the previous draft), never
on draft j itself. Going from W to W + 1 is decided by theta(W + 1), which reads a_{., <= W}: the
decision to verify draft W looks only at drafts before it, so each row's verified length is a
stopping time of its own draws and acceptance stays exact (as dynamic draft lengths are). A search
over every width that keeps the best (``early_stop=False``) reads a_{r, j+1}, a function of draft j,
when deciding whether to verify draft j: the paper's Appendix A shows that this biases the output,
and tests/test_acceptance.py shows our checker catching it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.errors import InvalidRequestError

SCHEDULES = ("fixed", "confidence")
"""``SpeculativeConfig.schedule``: verify every proposed draft (K, capped per request), or the
width :func:`choose_width` picks each step."""


def cumulative(confidence_logits: jax.Array) -> jax.Array:
    """a [b, K] = the running products of sigmoid(logits) [b, K]: draft j's probability of
    acceptance."""
    return jnp.cumprod(jax.nn.sigmoid(confidence_logits.astype(jnp.float32)), axis=-1)


def throughputs(a: jax.Array, cap: jax.Array, active: jax.Array, sps: Sequence[float]) -> jax.Array:
    """theta(W) [K+1] for W = 1..K+1: expected tokens of a step of width W over the active rows
    (a [b, K], each row verifying at most ``cap`` [b] drafts) times ``sps`` [K+1] steps/s."""
    k = a.shape[1]
    allowed = active[:, None] & (jnp.arange(1, k + 1)[None, :] <= cap[:, None])
    gain = jnp.sum(jnp.where(allowed, a, 0.0), axis=0)  # [K]: draft j over the rows
    tau = jnp.sum(active).astype(jnp.float32) + jnp.concatenate([jnp.zeros(1), jnp.cumsum(gain)])
    return tau * jnp.asarray(sps, jnp.float32)


def choose_width(
    a: jax.Array, cap: jax.Array, active: jax.Array, sps: Sequence[float], early_stop: bool = True
) -> jax.Array:
    """The step's width W (int32, 1..K+1): up from 1 while :func:`throughputs` rises, stopping at
    the first width whose next one would not raise it (without ``early_stop``: the best of all
    widths, which is biased; see the module docstring). A batch whose rows may verify no draft
    verifies one token each."""
    theta = throughputs(a, cap, active, sps)
    if not early_stop:
        return (jnp.argmax(theta) + 1).astype(jnp.int32)
    rises = theta[1:] > theta[:-1]
    return (1 + jnp.sum(jnp.cumprod(rises.astype(jnp.int32)))).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class SpsTable:
    """Steps per second of the engine's step at each width 1..K+1, per batch size (slots a step
    computes): what :func:`choose_width` weighs expected tokens by. Measured by
    :func:`mtp_jax.timing.sps_table`, written by ``mtp-jax bench --sps-table FILE``, read back with
    :meth:`load`."""

    k: int
    tables: Mapping[int, tuple[float, ...]]
    """batch -> steps/s at widths 1..K+1."""
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    plain: Mapping[int, float] = dataclasses.field(default_factory=dict)
    """batch -> steps/s of plain decoding (no draft at all), where measured."""

    def __post_init__(self) -> None:
        if not self.tables:
            raise InvalidRequestError("an SPS table needs at least one batch size")
        for batch, row in self.tables.items():
            if len(row) != self.k + 1 or not all(v > 0 and np.isfinite(v) for v in row):
                raise InvalidRequestError(
                    f"SPS table for batch {batch}: {self.k + 1} positive steps/s (widths 1..{self.k + 1}) "
                    f"expected, got {list(row)}"
                )
        if not all(v > 0 and np.isfinite(v) for v in self.plain.values()):
            raise InvalidRequestError(
                f"SPS table: plain decoding's steps/s must be positive, got {dict(self.plain)}"
            )

    def for_batch(self, batch: int, k: int) -> tuple[float, ...]:
        """The widths 1..k+1 of the table measured at the smallest batch >= ``batch`` (else the
        largest): a step over more slots is no faster."""
        if k > self.k:
            raise InvalidRequestError(
                f"the SPS table covers widths up to {self.k + 1}; K = {k} needs {k + 1}"
            )
        sizes = sorted(self.tables)
        at = next((s for s in sizes if s >= batch), sizes[-1])
        return tuple(float(v) for v in self.tables[at][: k + 1])

    def speculation_can_pay(self, batch: int, k: int) -> bool:
        """Whether some width could beat plain decoding at ``batch`` were every draft accepted
        (W tokens a step at SPS(W) against one at plain's speed): where none can, not drafting at
        all is faster whatever the draft proposes. True when plain decoding was not measured."""
        sizes = sorted(self.plain)
        if not sizes:
            return True
        plain = self.plain[next((s for s in sizes if s >= batch), sizes[-1])]
        return max(w * sps for w, sps in enumerate(self.for_batch(batch, k), start=1)) > plain

    def to_json(self) -> dict:
        plain = {"plain": {str(b): v for b, v in sorted(self.plain.items())}} if self.plain else {}
        tables = {str(b): list(r) for b, r in sorted(self.tables.items())}
        return {"k": self.k, "tables": tables, **plain, **self.meta}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the table as JSON (atomically: a temporary name, then renamed)."""
        path = os.fspath(path)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, source: str | os.PathLike[str] | Mapping | SpsTable) -> SpsTable:
        """A table from a file :meth:`save` wrote, its JSON object, or ``{batch: [steps/s...]}``."""
        if isinstance(source, SpsTable):
            return source
        if isinstance(source, (str, os.PathLike)):
            try:
                with open(source, encoding="utf-8") as f:
                    source = json.load(f)
            except (OSError, ValueError) as e:
                raise InvalidRequestError(f"cannot read the SPS table {os.fspath(source)}: {e}") from e
        if not isinstance(source, Mapping):
            raise InvalidRequestError(
                f"an SPS table is a file, or {{batch: [steps/s per width]}}, got {source!r}"
            )
        whole = "tables" in source  # a file's object; else {batch: [steps/s]} alone
        raw, plain = (source["tables"], source.get("plain", {})) if whole else (source, {})
        try:
            tables = {int(b): tuple(float(v) for v in row) for b, row in raw.items()}
            plain = {int(b): float(v) for b, v in plain.items()}
        except (TypeError, ValueError, AttributeError) as e:
            raise InvalidRequestError(f"an SPS table maps batch sizes to lists of steps/s: {e}") from e
        k = int(source.get("k", len(next(iter(tables.values()))) - 1)) if tables else 0
        meta = {key: v for key, v in source.items() if key not in ("k", "tables", "plain")} if whole else {}
        return cls(k, tables, meta, plain)
