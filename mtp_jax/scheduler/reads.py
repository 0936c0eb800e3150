"""What the scheduler reads of each row's standing proposal beside a step's tokens: the drafts'
calibrated confidences (a draft with a confidence head), each row's own draft count (a draft that
proposes per row; with a dynamic tree, the nodes of its own: its tree's size) and each row's
source (a draft of several :attr:`~mtp_jax.drafts.Draft.sources`).
Each is copied from the decode state before the step takes (donates) it, and read with the step's
tokens one step later, so the host never waits for it. Single-process only: in a multi-host run the
rows' arrays are split over processes (the counts then stay K per drafting row, an upper bound)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.step import StepConfig


@dataclasses.dataclass(frozen=True)
class RowReads:
    confidence: bool
    """Copy the drafts' confidence logits (:func:`mtp_jax.scheduler.core.confidences` reads them)."""
    counts: bool
    """Copy each row's draft count (``DecodeState.num_drafts``)."""
    sources: tuple[str, ...]
    """The draft's sources: copy each row's (``DecodeState.draft_source``); () for none."""

    @classmethod
    def of(cls, sc: StepConfig) -> RowReads:
        one = jax.process_count() == 1
        method = sc.draft_method
        counts = method is not None and method.proposes_per_row and one  # a tree's: its real nodes
        return cls(sc.confident and one, counts, method.sources if method is not None and one else ())

    def before_step(self, state, sc: StepConfig, proposed: np.ndarray) -> tuple:
        """(drafted [slots], confidences or None, sources or None) of the step ``sc`` about to run:
        device copies where read, else the host's count (each slot's cap)."""
        drafted, sources = np.minimum(proposed, sc.k), None
        if sc.k and not sc.draft_idle:
            if self.counts and state.tree_parent.shape[1]:  # a dynamic tree's size: its proposed nodes
                nodes = jnp.sum(state.tree_parent[:, 1:] >= 0, axis=1, dtype=jnp.int32)
                drafted = jnp.where(state.num_drafts > 0, nodes, 0)  # none for a request of K = 0
            elif self.counts:  # fewer than K where the row's text had no match
                drafted = jnp.minimum(state.num_drafts, sc.k)  # a new buffer: read before the step
            if self.sources:
                sources = jnp.copy(state.draft_source)
        conf = jnp.copy(state.draft_conf[:, : sc.k]) if self.confidence and sc.k else None
        return drafted, conf, sources

    def source(self, sources: np.ndarray | None, drafted: np.ndarray, b: int) -> str | None:
        """Row ``b``'s source name (None for a draft of one source); a row-step that verified no
        draft (none proposed, K = 0) is "none"."""
        if not self.sources:
            return None
        src = -1 if sources is None or drafted[b] == 0 else int(sources[b])
        return self.sources[src] if 0 <= src < len(self.sources) else "none"
