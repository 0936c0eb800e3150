"""Hybrid drafting: suffix decoding where its tree is trusted, a neural draft elsewhere, chosen per
row and per step inside the one jitted step (issue 66's item 3; Arctic Inference runs suffix
decoding beside EAGLE the same way).

``hybrid(NEURAL)`` is a draft named ``suffix_<neural>`` (registered in :mod:`mtp_jax.builtin` for the
shipped neural drafts). Every step both run: the neural draft consumes the committed rows and
proposes its K (its caches stay current whichever is used), and the suffix draft looks its matches
up; a row whose suffix proposal scores at least ``threshold`` (the expected number of its drafts
accepted: the sum of its nodes' empirical probabilities) verifies the suffix chain, the others the
neural chain. The choice depends only on the row's text and the index, never on the neural
draft's draws, so each row's drafts follow one law (the neural draft's q, or one-hot for the fixed
suffix candidates) and acceptance stays exact. A suffix chain shorter than K marks the rest -1
(the step verifies only its leading drafts).

With a dynamic ``speculative_tree`` (a neural draft that proposes trees: EAGLE-3, MTP, a draft
model) both propose a tree of the budget and a row verifies the suffix tree or the neural draft's
EAGLE-2 tree by the same rule; a dynamic tree's drafts are fixed candidates either way (argmax
drafting), so every row's law is one-hot and no per-row choice of laws is needed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from mtp_jax.drafts.base import Draft, Rows, StepReads, TreeDrafts
from mtp_jax.drafts.ngram.draft import token_buffer_reads
from mtp_jax.drafts.suffix.config import OPTIONS, SuffixConfig, suffix_config
from mtp_jax.drafts.suffix.draft import DRAFT as SUFFIX
from mtp_jax.drafts.suffix.draft import SOURCES as SUFFIX_SOURCES
from mtp_jax.drafts.suffix.draft import look_up, tree_drafts
from mtp_jax.drafts.suffix.index import Learner

SOURCES = (*SUFFIX_SOURCES, "neural")
"""A hybrid row's drafts come from the suffix draft's sources or from its neural draft."""


def _config(ctx) -> SuffixConfig:
    return ctx.draft_cfg


@dataclasses.dataclass(frozen=True)
class _Hybrid:
    """The functions of ``suffix_<neural>`` (see the module docstring)."""

    neural: Draft

    def inner(self, ctx):
        """The neural draft's view of the step: its own config, its own K (a dynamic tree's
        nodes with a tree: both propose a tree of that budget)."""
        cfg = _config(ctx)
        k = ctx.k if ctx.tree is not None else min(ctx.k, cfg.neural_k)
        return dataclasses.replace(ctx, draft_cfg=cfg.fallback, k=k)

    def init_state(self, ctx, num_pages: int, dtype) -> dict:
        return {
            "suffix": SUFFIX.init_state(ctx, num_pages, dtype),
            "neural": self.neural.init_state(self.inner(ctx), num_pages, dtype),
        }

    def state_logical(self, names: list[str], rank: int) -> tuple[str | None, ...]:
        own = SUFFIX if names[0] == "suffix" else self.neural
        return own.state_logical(names[1:], rank)

    def extend_and_propose(self, params, ctx, state, page_table, rows: Rows, active, sampling, first_pos):
        cfg, k = _config(ctx), ctx.k
        drafts, q, neural_state, *_ = self.neural.extend_and_propose(
            params, self.inner(ctx), state["neural"], page_table, rows, active, sampling, first_pos
        )
        suffix = state["suffix"]
        (tokens, parent, score, source), buffer = look_up(
            ctx, cfg, suffix, page_table, rows, first_pos, sampling.tenant
        )
        state = {"suffix": {**suffix, "tokens": buffer}, "neural": neural_state}
        if k == 0:
            return drafts, q, state, source
        use = (score >= cfg.threshold) & (source >= 0)
        neural = SOURCES.index("neural")
        if isinstance(drafts, TreeDrafts):  # two trees of the budget, both fixed candidates
            own = tree_drafts(tokens, parent)
            chosen = jax.tree.map(lambda a, b: jnp.where(use[:, None], a, b), own, drafts)
            return chosen, q, state, jnp.where(use, source, neural)
        short = k - drafts.shape[1]  # the neural draft proposes fewer: the rest unproposed (-1)
        drafts = jnp.pad(drafts, ((0, 0), (0, short)), constant_values=-1)
        q = jnp.pad(q, ((0, 0), (0, short), (0, 0)))
        drafts = jnp.where(use[:, None], tokens, drafts)
        if ctx.sampled:  # the fixed suffix candidates' law is one-hot
            fixed = jax.nn.one_hot(tokens, q.shape[-1], dtype=q.dtype)
            q = jnp.where(use[:, None, None], fixed, q)
        neural = neural if short < k else -1  # the neural draft proposed some
        return drafts, q, state, jnp.where(use, source, neural)

    def configure(
        self, draft_cfg: Any, k: int | None, options: Mapping[str, Any]
    ) -> tuple[SuffixConfig, int]:
        """Its own options and the neural draft's (resolved alone: its K is ``neural_k``, by default
        its own default); K (default: the larger of ``SUFFIX.default_k`` and the neural K)."""
        own = suffix_config({name: value for name, value in options.items() if name in OPTIONS})
        rest = {name: value for name, value in options.items() if name not in OPTIONS}
        neural_k = own.neural_k
        if self.neural.configure is not None:
            draft_cfg, neural_k = self.neural.configure(draft_cfg, neural_k, rest)
        neural_k = self.neural.default_k if neural_k is None else neural_k
        k = max(neural_k, SUFFIX.default_k) if k is None else k
        return dataclasses.replace(own, fallback=draft_cfg, neural_k=neural_k), k

    def step_reads(
        self, params, cfg, draft_cfg, k: int, batch: int, positions: int, itemsize: int
    ) -> StepReads:
        reads = StepReads()
        if self.neural.step_reads is not None:
            reads = self.neural.step_reads(params, cfg, draft_cfg.fallback, k, batch, positions, itemsize)
        buffer = token_buffer_reads(params, cfg, draft_cfg, k, batch, positions, itemsize)
        return dataclasses.replace(reads, kv=reads.kv + buffer.kv)

    def teacher_forced(self, params, ctx, tokens, hidden):
        return self.neural.teacher_forced(params, self.inner(ctx), tokens, hidden)


def hybrid(neural: Draft) -> Draft:
    """The draft ``suffix_<neural.name>``: suffix decoding with ``neural`` as its fallback."""
    h = _Hybrid(neural)
    return Draft(
        name=f"suffix_{neural.name}",
        available=neural.available,
        capture=lambda ctx: neural.capture(h.inner(ctx)),
        init_state=h.init_state,
        state_logical=h.state_logical,
        extend_and_propose=h.extend_and_propose,
        teacher_forced=h.teacher_forced,
        step_reads=h.step_reads,
        params_group=neural.params_group,
        param_logical=neural.param_logical,
        proposes_per_row=True,
        sources=SOURCES,
        verify_widths=lambda cfg, k: (*cfg.widths, cfg.neural_k + 1),
        title=f"suffix decoding + {neural.title or neural.name}",
        configure=h.configure,
        options=OPTIONS + tuple(o for o in neural.options if o not in OPTIONS),
        default_k=neural.default_k,
        weights=False,  # asked for by name
        cache_lookahead=neural.cache_lookahead,
        trees=neural.trees,
        learner=lambda cfg: Learner(cfg, at="suffix") if cfg.indexed else None,
    )
