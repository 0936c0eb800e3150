"""THE unified speculative-decoding step, and prefill, as jitted functions over a donated state.

One call of :func:`step` does a whole speculative step for every batch slot, with no host round
trip inside (docs/architecture.md, "The step"):

1. merge: the committed-but-uncached ``next_token`` and the K drafts form a [B, K+1] input at
   positions seq_len .. seq_len+K;
2. target: one forward over those B×(K+1) tokens writes their KV and yields logits plus the
   hidden states the draft asks for;
3. accept (float32): greedy / argmax drafts (each position's token drawn exactly as plain
   decoding would draw it) or sampled drafts (min(1, p/q) with residual resampling);
4. commit: seq_len += n_accepted + 1; KV beyond it is stale, masked, and overwritten later;
5. draft: the draft consumes the newly committed rows (for MTP: rows seq_len..seq_len+n_acc of its
   own paged cache) and proposes K new drafts (for MTP: chaining itself K-1 more times).

The target and the draft are pieces: :func:`mtp_jax.targets.target_for` gives the target's
functions from its config, :func:`mtp_jax.drafts.draft_for` the draft's from its name, and nothing
here depends on which they are. K = 0 is plain decoding through the same machinery. Shapes (B, K,
pages, page-table width) are static, so the step compiles once; the state is donated, so caches are
updated in place.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from mtp_jax.cache import ring_pages, ring_table
from mtp_jax.drafts import DRAFTS, Draft, Rows, draft_for
from mtp_jax.drafts.base import DraftContext, TreeDrafts, at_rows
from mtp_jax.grammar import in_step_masks, mask_logits
from mtp_jax.sampling import (
    MAX_LOGPROBS,
    RowSampling,
    TokenLogprobs,
    accept_argmax_drafts,
    accept_sampled_drafts,
    greedy_only,
    relaxed_ok,
    sample,
    sort_only,
    token_logprobs,
)
from mtp_jax.schedule import choose_width, cumulative
from mtp_jax.sharding import constrain_state, replicated, row_shards
from mtp_jax.targets import PagedAttention, Target, target_for
from mtp_jax.targets.base import Hidden, TreeMask
from mtp_jax.tree import (
    DynamicTree,
    RowTrees,
    TokenTree,
    accept_tree,
    along_path,
    commit_path,
    node_mask,
    node_positions,
)
from pallas_kernels.paged import QUERY_CHUNK

__all__ = ["DRAFT_SAMPLING", "DecodeState", "StepConfig", "at_rows", "prefill", "prefill_chunk", "step"]

DRAFT_SAMPLING = ("argmax", "sampled")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Everything static about a decoding run (part of the jit cache key)."""

    cfg: Any
    """The target's parsed config: its type picks the target (:func:`mtp_jax.targets.target_for`)."""
    page_size: int
    k: int = 0
    draft: str | None = None
    """The draft method's name (:data:`mtp_jax.drafts.DRAFTS`); None with K = 0."""
    draft_sampling: str = "argmax"
    mesh: Mesh | None = None
    """With a mesh: rows and KV pages split over ``data`` x ``expert`` (data-parallel attention),
    MoE layers expert-parallel over ``expert`` (:mod:`mtp_jax.sharding`,
    :mod:`mtp_jax.targets.deepseek_v3.ep`)."""
    draft_cfg: Any = None
    """A separately loaded draft's parsed config (EAGLE-3's
    :class:`mtp_jax.drafts.eagle3.config.Eagle3Config`), or
    None for drafts that live in the target's checkpoint (MTP)."""
    draft_idle: bool = False
    """The draft's state is carried but not fed (K = 0 once no request will speculate again)."""
    think_tokens: tuple[int, int] | None = None
    """(start, end) token ids of a thinking phase, tracked per row for relaxed acceptance
    (:func:`mtp_jax.sampling.relaxed_ok`); None: strict acceptance everywhere."""
    logprobs: bool = False
    """Also return each emitted token's log-probability and the MAX_LOGPROBS most likely tokens'
    (:class:`mtp_jax.sampling.TokenLogprobs`), from the verified logits; a program of its own, run
    only while some request asks."""
    tree: TokenTree | DynamicTree | None = None
    """Verify a token tree of drafts (:mod:`mtp_jax.tree`) instead of a chain: ``k`` is then its
    draft nodes (``tree.size - 1``), the draft a chained one (:attr:`Draft.trees`). A
    :class:`~mtp_jax.tree.DynamicTree`'s shape is each row's own, chosen by the draft every step."""
    schedule: tuple[float, ...] | None = None
    """Confidence-scheduled verification (:mod:`mtp_jax.schedule`): the engine's steps/s at widths
    1..K+1 for this program's batch; each step verifies the width :func:`mtp_jax.schedule.
    choose_width` picks from the draft's confidences (a draft with :attr:`Draft.confidence`).
    None: every proposed draft is verified (up to each request's cap)."""
    schedule_global: bool = False
    """Pick the best of all widths instead of stopping early: BIASED (the width then depends on
    drafts it verifies; the paper's Appendix A). Only for tests that show the bias is caught."""
    greedy: bool = False
    """Every row decodes greedily (temperature 0): sampling is traced as the argmax alone
    (:func:`mtp_jax.sampling.greedy_only`), a smaller program giving the same tokens. For callers
    that know every request up front (:func:`mtp_jax.scheduler.generate`); a scheduler with it refuses
    requests that sample."""
    local_ring: int = 0
    """Pages per slot of a ring that keeps a sliding-window layer's keys and values (a target with
    :attr:`~mtp_jax.targets.base.Target.init_ring_cache`, loaded with ``window_cache="ring"``):
    those layers then hold only their window's pages (:func:`mtp_jax.cache.ring_table`), the global
    layers every page. 0: every layer keeps every page."""

    def __post_init__(self) -> None:
        if self.k > 0 and (self.draft is None or self.draft_idle):
            raise ValueError(f"K = {self.k} drafts need a working draft method, got draft={self.draft!r}")
        if self.draft is not None:
            draft_for(self.draft)  # a known name
        if self.tree is not None:
            nodes = self.tree.size - 1
            if self.k != nodes:
                raise ValueError(f"a token tree of {nodes} draft nodes needs k = {nodes}, got {self.k}")
            method = self.draft_method
            if method is not None and not method.trees:
                takers = ", ".join(name for name, d in DRAFTS.items() if d.trees)
                raise ValueError(
                    f"the {method.title or self.draft} draft does not propose token trees "
                    f"(chained drafts do: {takers})"
                )
            if self.think_tokens is not None:
                raise ValueError(
                    "relaxed acceptance in thinking phases is not available with token trees yet"
                )
            if self.tree.dynamic and self.draft_sampling != "argmax":
                raise ValueError(
                    "a dynamic token tree verifies the draft's likeliest tokens (fixed candidates, exact for "
                    f"sampled rows too): it needs draft_sampling='argmax', got {self.draft_sampling!r}"
                )
        if self.draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(f"draft_sampling must be one of {DRAFT_SAMPLING}, got {self.draft_sampling!r}")
        if self.schedule is not None:
            self._check_schedule()
        if self.local_ring:
            self._check_ring()

    def _check_ring(self) -> None:
        target = self.target
        window = target.sliding_window(self.cfg)
        if target.init_ring_cache is None or window is None:
            raise ValueError(
                f"a ring cache keeps sliding-window layers' pages: {target.title or target.name} has none"
            )
        need = ring_pages(window, self.page_size, ring_span(self))
        if self.local_ring < need:
            raise ValueError(
                f"a ring of {self.local_ring} pages per slot is too short for this step: a window of "
                f"{window} positions and {ring_span(self)} written per call need {need}"
            )

    def _check_schedule(self) -> None:
        if self.k == 0 or not self.confident:
            takers = ", ".join(d.title or name for name, d in DRAFTS.items() if d.confidence)
            raise ValueError(
                f"confidence scheduling needs K > 0 and a draft that estimates its acceptance ({takers}, "
                f"with a confidence head), got draft={self.draft!r}, K = {self.k}"
            )
        if self.tree is not None:
            raise ValueError("confidence scheduling verifies a chain: it does not go with token trees")
        if len(self.schedule) != self.k + 1:
            raise ValueError(
                f"the schedule needs steps/s at widths 1..{self.k + 1}, got {len(self.schedule)}"
            )

    def variant(self, k: int, **changes: Any) -> StepConfig:
        """This configuration at K = k (with ``changes``), its schedule cut to widths 1..k+1."""
        schedule = self.schedule[: k + 1] if k and self.schedule is not None else None
        return dataclasses.replace(self, k=k, schedule=schedule, **changes)

    @property
    def confident(self) -> bool:
        """The draft estimates its drafts' acceptance (:attr:`Draft.confidence`)."""
        method = self.draft_method
        return method is not None and method.confidence is not None and method.confidence(self.draft_cfg)

    @property
    def target(self) -> Target:
        return target_for(self.cfg)

    @property
    def draft_method(self) -> Draft | None:
        """The draft whose state the decode state carries."""
        return None if self.draft is None else draft_for(self.draft)

    @property
    def drafter(self) -> Draft | None:
        """The draft this step feeds and asks (None when idle)."""
        return None if self.draft_idle else self.draft_method

    @property
    def draft_context(self) -> DraftContext:
        """What the draft's functions are given of this configuration."""
        tree = None if self.draft_idle else self.tree
        return DraftContext(self.cfg, self.draft_cfg, self.k, self.sampled, self.page_size, self.mesh, tree)

    @property
    def capture(self) -> tuple[int, ...]:
        """The target layers the draft reads (static)."""
        return () if self.drafter is None else tuple(self.drafter.capture(self.draft_context))

    @property
    def sampled(self) -> bool:
        return self.k > 0 and self.draft_sampling == "sampled"

    @property
    def overshoot(self) -> int:
        """Cache rows a step may write past a row's committed tokens, beyond its K + 1 verified
        ones: a dynamic tree's draft runs its expanded candidates on scratch rows."""
        return self.k if self.tree is None or not self.tree.dynamic else max(self.k, self.tree.expanded)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Per-slot decoding state, all on device. B slots, room for K drafts, W pages per row.

    target_pages: the target's cache (leaves [L, P, page, ...]); draft_state: the draft's device
    state (for MTP its layer's pages [P, page, c]; {} without a draft); page_table [B, W]; seq_len
    [B] tokens in the target cache; next_token [B] (committed, not yet cached); drafts [B, K];
    draft_q [B, K, V] (sampled drafts only, else [B, 0, 0]); draft_conf [B, K]: each draft's
    calibrated confidence logit, sigmoid of which is its probability of acceptance given the drafts
    before it were accepted (the running products, :func:`mtp_jax.schedule.cumulative`, are what the
    confidence schedule weighs; a draft with :attr:`~mtp_jax.drafts.Draft.confidence`, else [B, 0]);
    num_drafts [B]: how many of the drafts were proposed for the row (its request's cap, and at
    most what the last step proposed: a step may speculate less than K); thinking [B]: inside a
    thinking phase after the committed tokens before next_token; active [B]; sampling: per-row
    parameters; tree_parent [B, N]: with a :class:`~mtp_jax.tree.DynamicTree`, each row's proposed
    tree's parents (the drafts are its nodes 1..N-1; -1 at the root and at a node a per-row draft
    did not propose, which is then inert), else [B, 0]; draft_source [B]: with a draft
    of several :attr:`~mtp_jax.drafts.Draft.sources`, the index of the one each row's drafts came
    from (-1: none; the scheduler counts drafts by it), else -1.
    """

    target_pages: dict
    draft_state: Any
    page_table: jax.Array
    seq_len: jax.Array
    next_token: jax.Array
    drafts: jax.Array
    draft_q: jax.Array
    num_drafts: jax.Array
    thinking: jax.Array
    active: jax.Array
    sampling: RowSampling
    draft_conf: jax.Array
    tree_parent: jax.Array
    draft_source: jax.Array


def init_state(sc: StepConfig, batch: int, num_pages: int, width: int, dtype) -> DecodeState:
    """A zeroed decode state of ``batch`` slots over ``num_pages`` cache pages, ``width`` per row."""
    q_shape = (batch, sc.k, sc.cfg.vocab_size) if sc.sampled else (batch, 0, 0)
    method = sc.draft_method
    return DecodeState(
        target_pages=_init_target_cache(sc, batch, num_pages, dtype),
        draft_state={} if method is None else method.init_state(sc.draft_context, num_pages, dtype),
        page_table=jnp.zeros((batch, width), jnp.int32),
        seq_len=jnp.zeros((batch,), jnp.int32),  # every leaf its own buffer: the state is donated
        next_token=jnp.zeros((batch,), jnp.int32),
        drafts=jnp.zeros((batch, sc.k), jnp.int32),
        draft_q=jnp.zeros(q_shape, jnp.float32),
        num_drafts=jnp.zeros((batch,), jnp.int32),
        thinking=jnp.zeros((batch,), bool),
        active=jnp.zeros((batch,), bool),
        sampling=RowSampling.build(batch),
        draft_conf=jnp.zeros((batch, sc.k if sc.confident else 0), jnp.float32),
        tree_parent=jnp.zeros((batch, _dynamic_size(sc)), jnp.int32),
        draft_source=jnp.full((batch,), -1, jnp.int32),
    )


def _init_target_cache(sc: StepConfig, batch: int, num_pages: int, dtype) -> dict:
    """The target's zeroed cache: every layer's ``num_pages`` pages, or with ``sc.local_ring`` its
    sliding-window layers' rings (``batch`` slots of ``sc.local_ring`` pages) beside them."""
    if not sc.local_ring:
        return sc.target.init_cache(sc.cfg, num_pages, sc.page_size, dtype)
    return sc.target.init_ring_cache(sc.cfg, num_pages, batch * sc.local_ring, sc.page_size, dtype)


def ring_span(sc: StepConfig) -> int:
    """The positions one call may write past the oldest query it attends for: a chunk of a prompt
    (:data:`pallas_kernels.paged.QUERY_CHUNK`) or a step's verified tokens and scratch rows."""
    return max(QUERY_CHUNK, sc.k + 1 + sc.overshoot)


def with_ring(sc: StepConfig) -> StepConfig:
    """``sc`` with its target's sliding-window layers kept in rings sized for it (``local_ring``:
    :func:`mtp_jax.cache.ring_pages` of the window and :func:`ring_span`)."""
    window = sc.target.sliding_window(sc.cfg)
    if window is None:
        name = sc.target.title or sc.target.name
        raise ValueError(f"{name} has no sliding-window layers to keep in a ring")
    return dataclasses.replace(sc, local_ring=ring_pages(window, sc.page_size, ring_span(sc)))


def _ring_of(sc: StepConfig, rows: jax.Array | None, batch: int, width: int) -> jax.Array | None:
    """The ring table [batch, width] of the slots ``rows`` [batch] (default: slots 0..batch-1, a
    step's rows), or None without a ring."""
    if not sc.local_ring:
        return None
    rows = jnp.arange(batch, dtype=jnp.int32) if rows is None else rows
    return ring_table(rows, sc.local_ring, width)


def commit_tree_path(sc: StepConfig, pages: dict, page_table: jax.Array, *args) -> dict:
    """:func:`mtp_jax.tree.commit_path` over the target's cache: the ring leaves (``ring_*``,
    :attr:`~mtp_jax.targets.base.Target.init_ring_cache`) through the slots' ring tables."""
    if not sc.local_ring:
        return commit_path(pages, page_table, *args, sc.page_size)
    ring = {name: leaf for name, leaf in pages.items() if name.startswith("ring_")}
    rest = {name: leaf for name, leaf in pages.items() if name not in ring}
    table = _ring_of(sc, None, page_table.shape[0], page_table.shape[1])
    return {
        **commit_path(rest, page_table, *args, sc.page_size),
        **commit_path(ring, table, *args, sc.page_size),
    }


def _dynamic_size(sc: StepConfig) -> int:
    """The nodes of each row's dynamic tree (its root included), 0 without one."""
    return sc.tree.size if sc.tree is not None and sc.tree.dynamic else 0


def _split_tree(new_drafts: Any, parent: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(drafts, parents) of a proposal: a dynamic tree's (:class:`TreeDrafts`), else the drafts
    and ``parent`` unchanged."""
    if isinstance(new_drafts, TreeDrafts):
        return new_drafts.tokens, new_drafts.parent
    return new_drafts, parent


def propose(sc: StepConfig, params: dict, *args) -> tuple[jax.Array, jax.Array, Any, jax.Array | None, Any]:
    """``sc.drafter.extend_and_propose(params, context, *args)``: (drafts, q, draft state, the
    drafts' calibrated confidence logits [b, K] from a draft with a confidence head, else None, and
    each row's proposal's source [b] from a draft with :attr:`~mtp_jax.drafts.Draft.sources`, else
    None)."""
    out = sc.drafter.extend_and_propose(params, sc.draft_context, *args)
    drafts, q, draft_state, *extra = out
    want = int(sc.confident) + bool(sc.drafter.sources)
    if len(extra) != want:
        raise TypeError(
            f"draft {sc.drafter.name!r}: extend_and_propose returned {3 + len(extra)} values, expected "
            f"{3 + want} (drafts, q, state"
            + (", confidence logits" if sc.confident else "")
            + (", each row's source" if sc.drafter.sources else "")
            + ")"
        )
    z = extra.pop(0) if sc.confident else None
    source = extra.pop(0) if sc.drafter.sources else None
    return drafts, q, draft_state, z, source


def forward_paged(
    params: dict,
    pages: dict,
    cfg: Any,
    page_size: int,
    tokens: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    page_table: jax.Array,
    mesh: Mesh | None = None,
    logits: bool = True,
    capture: tuple[int, ...] = (),
    lora_slots: jax.Array | None = None,
    tree: TreeMask | None = None,
    ring_table: jax.Array | None = None,
    ring_valid: jax.Array | None = None,
):
    """Write tokens [b, t] at positions [b, t] (only where valid) and run the target of ``cfg`` over
    its cache, capturing the outputs of layers ``capture`` (``mesh`` as in the target's forward),
    each row with its LoRA adapter slot of ``lora_slots`` [b] when the parameters hold adapters.
    ``tree``: the tokens are a token tree's nodes (:class:`mtp_jax.targets.base.TreeMask`: written
    at its cache positions, under tree attention; ``positions`` are then rotary positions).
    ``ring_table``: the rows' table into the sliding-window layers' rings (a ring cache), written
    where ``ring_valid`` (default ``valid``).

    Returns (Hidden [b, t, d] each, float32 logits [b, t, V], pages); the logits are None with
    ``logits=False`` (prefill needs the head at one row per prompt: :func:`at_rows` first).
    """
    target = target_for(cfg)
    paged = PagedAttention.at(pages, page_table, positions, valid, page_size, tree, ring_table, ring_valid)
    extra = {"lora_slots": lora_slots} if "lora" in params and lora_slots is not None else {}
    hidden, pages = target.forward(params, cfg, tokens, positions, paged, capture=capture, mesh=mesh, **extra)
    return hidden, target.lm_head(params, hidden.post_norm, cfg) if logits else None, pages


forward_paged_jit = jax.jit(
    forward_paged,
    static_argnames=("cfg", "page_size", "mesh", "logits", "capture"),
    donate_argnames=("pages",),
)


def _traced_sampling(fn: Callable) -> Callable:
    """``fn`` (taking a ``sc``) traced with :func:`mtp_jax.sampling.sort_only` when ``sc`` has a mesh
    and with :func:`mtp_jax.sampling.greedy_only` when ``sc.greedy``."""

    @functools.wraps(fn)
    def inner(*args, **kwargs):
        sc = kwargs.get("sc") or next(a for a in args if isinstance(a, StepConfig))
        with sort_only(sc.mesh is not None), greedy_only(sc.greedy):
            return fn(*args, **kwargs)

    return inner


def _target_pass(
    params,
    state,
    sc,
    tokens,
    positions,
    valid,
    page_table,
    lora_slots,
    logits: bool,
    tree=None,
    rows=None,
    ring_valid=None,
):
    """:func:`forward_paged` over the state's target caches with the configuration's capture:
    (hidden, float32 logits or None, the target's pages). ``rows`` [b]: the slots of the rows
    (default 0..b-1), whose rings a ring cache reads (written where ``ring_valid``, default
    ``valid``)."""
    return forward_paged(
        params,
        state.target_pages,
        sc.cfg,
        sc.page_size,
        tokens,
        positions,
        valid,
        page_table,
        sc.mesh,
        logits=logits,
        capture=sc.capture,
        lora_slots=lora_slots,
        tree=tree,
        ring_table=_ring_of(sc, rows, tokens.shape[0], page_table.shape[1]),
        ring_valid=ring_valid,
    )


def _write_prompts(
    params, state, sc, tokens, positions, valid, page_table, lora_slots, rows=None, fresh=None
):
    """The target over prompt pieces of the slots ``rows``, writing its caches; no head (prefill
    runs it at one row per prompt: :func:`at_rows` first). ``fresh`` [b]: each row's first position
    not in a cached prefix; the tokens before it (recomputed so that a ring cache holds the window
    before it) fill the rings only, not the prefix's shared pages. Returns (hidden, the target's
    pages, the tokens written to the pages: those the draft consumes)."""
    written = valid if fresh is None else valid & (positions >= fresh[:, None])
    hidden, _, target_pages = _target_pass(
        params,
        state,
        sc,
        tokens,
        positions,
        written,
        page_table,
        lora_slots,
        False,
        rows=rows,
        ring_valid=valid,
    )
    return hidden, target_pages, written


def _followed_by(tokens: jax.Array, last: jax.Array, after: jax.Array) -> jax.Array:
    """The token after each of tokens [r, t] (the pair a draft conditions on): the next one in the
    row, and ``after`` [r] after the row's last one (index ``last`` [r])."""
    shifted = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    return jnp.where(jnp.arange(tokens.shape[1])[None, :] == last[:, None], after[:, None], shifted)


def _first_drafts(params, state, sc, prompt: Rows, page_table, real, sampling, first, lengths):
    """The draft's first proposal after a prompt (:func:`prefill`): (drafts [R, K], q, confidences,
    each row's draft count, the draft's state, tree parents, sources); without a draft, only the
    counts (its cap)."""
    r = prompt.tokens.shape[0]
    drafts = jnp.zeros((r, state.drafts.shape[1]), jnp.int32)
    q = jnp.zeros((r,) + state.draft_q.shape[1:], jnp.float32)
    conf = jnp.zeros((r,) + state.draft_conf.shape[1:], jnp.float32)
    parent = jnp.zeros((r,) + state.tree_parent.shape[1:], jnp.int32)
    none = jnp.full((r,), -1, jnp.int32)
    if sc.drafter is None:
        count = jnp.minimum(sampling.num_speculative_tokens, sc.k)
        return drafts, q, conf, count, state.draft_state, parent, none
    new_drafts, q_new, draft_state, z, source = propose(
        sc, params, state.draft_state, page_table, prompt, real, sampling, lengths + 1
    )
    new_drafts, parent = _split_tree(new_drafts, parent)
    new_drafts, count = _proposed(sc, new_drafts, sampling.num_speculative_tokens, first)
    drafts, q = _room(drafts, new_drafts), _room(q, q_new) if sc.sampled else q
    source = none if source is None else source
    return drafts, q, conf if z is None else _room(conf, z), count, draft_state, parent, source


@functools.partial(jax.jit, static_argnames=("sc",), donate_argnames=("state",))
@_traced_sampling
def prefill(
    params: dict,
    state: DecodeState,
    sc: StepConfig,
    rows: jax.Array,
    tokens: jax.Array,
    lengths: jax.Array,
    page_table: jax.Array,
    sampling: RowSampling,
    bitmask: jax.Array | None = None,
    starts: jax.Array | None = None,
    thinking: jax.Array | None = None,
    fresh: jax.Array | None = None,
) -> tuple[jax.Array, DecodeState, TokenLogprobs | None]:
    """Admit requests into slots ``rows`` [R] (an index >= B is a padding row, ignored): prompts of
    ``lengths`` [R] tokens with their page-table rows [R, W] and sampling [R] (``bitmask``
    [R, ceil(V/32)]: the tokens a grammar allows first). ``tokens`` [R, T] (right-padded) are each
    prompt's from position ``starts`` [R] on (default 0): the positions before are in the caches
    already (a cached prefix, :class:`mtp_jax.cache.PrefixCache`), with ``thinking`` [R] whether a
    thinking phase is open there (default: not). ``fresh`` [R] (a ring cache after a cached
    prefix): the first position not in the cached prefix; the tokens from ``starts`` to it are
    recomputed into the sliding-window layers' rings only (the rest of the caches hold them).

    Fills the target cache, samples each request's first token and, with a draft, fills the draft's
    caches for the prompt and proposes the first K drafts. Returns (first tokens [R], state,
    logprobs): with ``sc.logprobs`` the first tokens' :class:`TokenLogprobs` [R], else None.
    """
    r, t = tokens.shape
    starts = jnp.zeros((r,), jnp.int32) if starts is None else starts
    positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    real = rows < state.active.shape[0]
    valid = (positions < lengths[:, None]) & real[:, None]
    # no head here: it runs at each prompt's last row below
    slots = jnp.minimum(rows, state.active.shape[0] - 1)  # a padding row writes nothing
    hidden, target_pages, written = _write_prompts(
        params, state, sc, tokens, positions, valid, page_table, sampling.lora_slot, slots, fresh
    )
    last = lengths - 1 - starts  # each prompt's last row in ``tokens``
    raw_logits = sc.target.lm_head(params, at_rows(hidden.post_norm, last), sc.cfg)
    first_logits = raw_logits if bitmask is None else mask_logits(raw_logits, bitmask)
    first = sample(first_logits, sampling, lengths)
    logprobs = token_logprobs(raw_logits, first, MAX_LOGPROBS) if sc.logprobs else None
    prompt = Rows(tokens, _followed_by(tokens, last, first), positions, written, hidden, last)
    drafts, q, conf, count, draft_state, parent, source = _first_drafts(
        params, state, sc, prompt, page_table, real, sampling, first, lengths
    )
    thinking = jnp.zeros((r,), bool) if thinking is None else thinking
    if sc.think_tokens is not None:
        thinking = at_rows(think_phase(tokens, valid, thinking, sc.think_tokens), last)

    def put(dst, src):
        return dst.at[rows].set(src, mode="drop")

    logprobs = jax.tree.map(lambda x: replicated(x, sc.mesh), logprobs)
    return (
        replicated(first, sc.mesh),
        constrain_state(
            DecodeState(
                target_pages=target_pages,
                draft_state=draft_state,
                page_table=put(state.page_table, page_table),
                seq_len=put(state.seq_len, lengths),
                next_token=put(state.next_token, first),
                drafts=put(state.drafts, drafts),
                draft_q=put(state.draft_q, q),
                num_drafts=put(state.num_drafts, count),
                thinking=put(state.thinking, thinking),
                active=put(state.active, real),
                sampling=jax.tree.map(put, state.sampling, sampling),
                draft_conf=put(state.draft_conf, conf),
                tree_parent=put(state.tree_parent, parent),
                draft_source=put(state.draft_source, source),
            ),
            sc,
        ),
        logprobs,
    )


@functools.partial(jax.jit, static_argnames=("sc",), donate_argnames=("state",))
@_traced_sampling
def prefill_chunk(
    params: dict,
    state: DecodeState,
    sc: StepConfig,
    tokens: jax.Array,
    starts: jax.Array,
    counts: jax.Array,
    after: jax.Array,
    page_table: jax.Array,
    lora_slots: jax.Array,
    rows: jax.Array | None = None,
    fresh: jax.Array | None = None,
) -> DecodeState:
    """Write a piece of prompts that are not whole yet (chunked prefill): ``tokens`` [R, T] at
    positions ``starts`` [R] on, ``counts`` [R] of them (0: a padding row), each followed by the
    prompt's token ``after`` [R]; page-table rows [R, W], LoRA slots [R]; ``rows`` [R]: their
    slots (needed by a ring cache, ``sc.local_ring``), ``fresh`` [R] as :func:`prefill` takes
    it. Fills the target's caches
    there and lets the draft consume the rows (its caches; nothing proposed). Nothing else of the
    state changes: the slots stay inactive until :func:`prefill` admits them with the prompts'
    rest."""
    r, t = tokens.shape
    positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = jnp.arange(t)[None, :] < counts[:, None]
    if sc.local_ring and rows is None:
        raise ValueError("a ring cache (sc.local_ring) needs the chunk's slots: prefill_chunk(..., rows=)")
    slots = None if rows is None else jnp.minimum(rows, state.active.shape[0] - 1)
    hidden, target_pages, written = _write_prompts(
        params, state, sc, tokens, positions, valid, page_table, lora_slots, slots, fresh
    )
    draft_state = state.draft_state
    if sc.drafter is not None:
        last = jnp.maximum(counts - 1, 0)
        rows = Rows(tokens, _followed_by(tokens, last, after), positions, written, hidden, last)
        # only consume: nothing proposed mid-prompt (no chain, no tree)
        consume = dataclasses.replace(sc, k=0, schedule=None, tree=None)
        draft_state = propose(
            consume,
            params,
            draft_state,
            page_table,
            rows,
            counts > 0,
            RowSampling.build(r),
            starts + counts + 1,
        )[2]
    return constrain_state(dataclasses.replace(state, target_pages=target_pages, draft_state=draft_state), sc)


def _room(room: jax.Array, new: jax.Array) -> jax.Array:
    """``new`` [b, k, ...] written into the first k of ``room`` [b, K, ...] (a step may speculate
    less than the state has room for)."""
    return jax.lax.dynamic_update_slice_in_dim(room, new.astype(room.dtype), 0, axis=1)


def think_phase(tokens: jax.Array, valid: jax.Array, before: jax.Array, think: tuple[int, int]) -> jax.Array:
    """Whether each row is inside a thinking phase after each of tokens [b, t] ([b, t] bool): the
    last valid start or end marker so far decides; before any, the phase ``before`` [b]."""
    start, end = think
    idx = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    last_start = jax.lax.cummax(jnp.where(valid & (tokens == start), idx, -1), axis=1)
    last_end = jax.lax.cummax(jnp.where(valid & (tokens == end), idx, -1), axis=1)
    return jnp.where(jnp.maximum(last_start, last_end) < 0, before[:, None], last_start > last_end)


def _inputs(state: DecodeState, sc: StepConfig, k: int | None = None) -> jax.Array:
    """The step's verified tokens [B, k+1]: next_token and the first k drafts (k: sc.k)."""
    k = sc.k if k is None else k
    return jnp.concatenate([state.next_token[:, None], state.drafts[:, :k]], axis=1)


def _verify(params: dict, state: DecodeState, sc: StepConfig, k: int | None = None):
    """Stages 1-2: merge next_token and the first k drafts (k: sc.k), run the target over them
    (writes their KV)."""
    b = state.seq_len.shape[0]
    k = sc.k if k is None else k
    tokens = _inputs(state, sc, k)
    positions = state.seq_len[:, None] + jnp.arange(k + 1, dtype=jnp.int32)
    valid = jnp.broadcast_to(state.active[:, None], (b, k + 1))
    return _target_pass(
        params, state, sc, tokens, positions, valid, state.page_table, state.sampling.lora_slot, logits=True
    )


def _accept(
    logits: jax.Array,
    state: DecodeState,
    sc: StepConfig,
    bitmask: jax.Array | None = None,
    k: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Stage 3: (emitted [B, k+1], n_accepted [B]), each row accepting at most its num_drafts; with
    ``bitmask`` [B, k+1, ceil(V/32)] the target's distributions are the grammar-masked ones."""
    k = sc.k if k is None else k
    if bitmask is not None:
        logits = mask_logits(logits, bitmask)
    drafts, first, cap = state.drafts[:, :k], state.seq_len + 1, jnp.minimum(state.num_drafts, k)
    relaxed = None
    if sc.think_tokens is not None and k > 0:  # draft j is judged after inputs 0..j
        tokens = _inputs(state, sc, k)
        phase = think_phase(tokens, jnp.ones_like(tokens, bool), state.thinking, sc.think_tokens)
        relaxed = relaxed_ok(logits, drafts, state.sampling, phase[:, :k])
    if sc.sampled and k > 0:
        q = state.draft_q[:, :k]
        return accept_sampled_drafts(logits, drafts, q, state.sampling, first, cap, relaxed)
    return accept_argmax_drafts(logits, drafts, state.sampling, first, cap, relaxed)


def _proposed(sc: StepConfig, new_drafts: jax.Array, cap: jax.Array, fallback: jax.Array):
    """(drafts [b, k] with any unproposed entry (< 0, from a draft with ``proposes_per_row``)
    replaced by ``fallback`` [b] (a valid id), and each row's draft count [b]: at most ``cap``, and
    only its leading proposed drafts)."""
    count = jnp.minimum(cap, sc.k)
    if sc.drafter is None or not sc.drafter.proposes_per_row or new_drafts.shape[1] == 0:
        return new_drafts, count
    given = new_drafts >= 0
    leading = jnp.sum(jnp.cumprod(given.astype(jnp.int32), axis=1), axis=1)
    return jnp.where(given, new_drafts, fallback[:, None]), jnp.minimum(count, leading)


def _commit_and_draft(
    params, state, sc, hidden, target_pages, emitted, n_acc, k: int | None = None, tokens=None
):
    """Stages 4-5: advance the committed length, let the draft consume the committed rows (the k+1
    verified ones, k: sc.k; or ``tokens`` [B, t], a token tree's accepted path with its ``hidden``
    states) and propose sc.k drafts."""
    tokens = _inputs(state, sc, sc.k if k is None else k) if tokens is None else tokens
    seq = state.seq_len
    n_emit = jnp.where(state.active, n_acc + 1, 0)
    new_seq = seq + n_emit
    new_next = jnp.take_along_axis(emitted, n_acc[:, None], axis=1)[:, 0]
    draft_state, drafts, q, num_drafts = state.draft_state, state.drafts, state.draft_q, state.num_drafts
    conf, parent, source = state.draft_conf, state.tree_parent, state.draft_source
    num_drafts = jnp.where(state.active, jnp.minimum(state.sampling.num_speculative_tokens, sc.k), num_drafts)
    thinking = state.thinking
    if sc.think_tokens is not None:
        phase = think_phase(tokens, jnp.ones_like(tokens, bool), thinking, sc.think_tokens)
        thinking = jnp.where(state.active, at_rows(phase, n_acc), thinking)
    if sc.drafter is not None:
        # the committed rows: the verified positions seq..seq+n_acc, each followed by the token
        # emitted after it; rows past n_acc are not consumed
        k1 = tokens.shape[1]
        positions = seq[:, None] + jnp.arange(k1, dtype=jnp.int32)
        valid = state.active[:, None] & (jnp.arange(k1)[None, :] <= n_acc[:, None])
        committed = Rows(tokens, emitted, positions, valid, hidden, n_acc)
        new_drafts, new_q, draft_state, z, new_source = propose(
            sc, params, draft_state, state.page_table, committed, state.active, state.sampling, new_seq + 1
        )
        if z is not None:
            conf = jnp.where(state.active[:, None], _room(conf, z), conf)
        if new_source is not None:
            source = jnp.where(state.active, new_source, source)
        new_drafts, new_parent = _split_tree(new_drafts, parent)
        if new_parent.shape[1] and sc.drafter.proposes_per_row:  # a node not proposed (-1) is inert:
            # its own root, no node's child, never on a path; the rest are the row's tree (its size)
            new_parent = new_parent.at[:, 1:].set(jnp.where(new_drafts >= 0, new_parent[:, 1:], -1))
        parent = jnp.where(state.active[:, None], new_parent, parent)
        new_drafts, count = _proposed(sc, new_drafts, state.sampling.num_speculative_tokens, new_next)
        drafts = jnp.where(state.active[:, None], _room(drafts, new_drafts), drafts)
        num_drafts = jnp.where(state.active, count, num_drafts)
        if sc.sampled:
            q = _room(q, new_q)
    new_state = dataclasses.replace(
        state,
        target_pages=target_pages,
        draft_state=draft_state,
        seq_len=new_seq,
        next_token=jnp.where(state.active, new_next, state.next_token),
        drafts=drafts,
        draft_q=q,
        num_drafts=num_drafts,
        thinking=thinking,
        draft_conf=conf,
        tree_parent=parent,
        draft_source=source,
    )
    return replicated(n_emit, sc.mesh), new_state  # replicated: every process reads the counts


def _tree_verified(params: dict, state: DecodeState, sc: StepConfig, bitmask: jax.Array | None = None):
    """The step with a token tree (``sc.tree``): the target over every node under tree attention
    (node n at cache position seq_len + n, rotary position seq_len + its depth), the accepted path's
    walk (:func:`mtp_jax.tree.accept_tree`, at most each row's num_drafts deep; with ``bitmask``
    [B, N, words] over the grammar-masked distributions at each node), the KV shift of
    that path to consecutive positions (:func:`mtp_jax.tree.commit_path`), then the draft consumes
    the path's rows and proposes the next tree. Returns (emitted [B, D+1], n_emit, state, the
    logits along the path [B, D+1, V])."""
    tree, seq = sc.tree, state.seq_len
    tokens = _inputs(state, sc)
    b = tokens.shape[0]
    rows = RowTrees.of(state.tree_parent, tree.width, tree.max_depth) if tree.dynamic else tree.rows(b)
    valid = jnp.broadcast_to(state.active[:, None], tokens.shape)
    hidden, logits, target_pages = _target_pass(
        params,
        state,
        sc,
        tokens,
        node_positions(rows, seq),
        valid,
        state.page_table,
        state.sampling.lora_slot,
        logits=True,
        tree=node_mask(rows, seq),
    )
    q = None
    if sc.sampled:  # the law at nodes 0..N-2 (the last node, the deepest, has no children)
        q = jnp.concatenate([state.draft_q, jnp.zeros_like(state.draft_q[:, :1])], axis=1)
    judged = logits if bitmask is None else mask_logits(logits, bitmask)
    path, emitted, n_acc = accept_tree(
        judged, tokens, tree, state.sampling, seq + 1, q, state.num_drafts, rows
    )
    target_pages = commit_tree_path(sc, target_pages, state.page_table, seq, path, n_acc, state.active)
    hidden = Hidden(
        *(None if x is None else along_path(x, path, axis=x.ndim - 2) for x in hidden[:3]), *hidden[3:]
    )
    n_emit, state = _commit_and_draft(
        params, state, sc, hidden, target_pages, emitted, n_acc, tokens=along_path(tokens, path)
    )
    return emitted, n_emit, state, along_path(logits, path)


_POOLS = ("target_pages", "draft_state")  # the state's page pools; every other leaf is per slot


def _first_rows(state: DecodeState, rows: int) -> DecodeState:
    per_slot = {
        f.name: jax.tree.map(lambda x: x[:rows], getattr(state, f.name))
        for f in dataclasses.fields(state)
        if f.name not in _POOLS
    }
    return dataclasses.replace(state, **per_slot)


def _merge_rows(state: DecodeState, part: DecodeState, rows: int) -> DecodeState:
    per_slot = {
        f.name: jax.tree.map(lambda x, y: x.at[:rows].set(y), getattr(state, f.name), getattr(part, f.name))
        for f in dataclasses.fields(state)
        if f.name not in _POOLS
    }
    return dataclasses.replace(part, **per_slot)


@functools.partial(jax.jit, static_argnames=("sc", "rows"), donate_argnames=("state",))
@_traced_sampling
def step(
    params: dict,
    state: DecodeState,
    sc: StepConfig,
    bitmask: jax.Array | None = None,
    grammar_rows: jax.Array | None = None,
    rows: int | None = None,
    grammar_key: jax.Array | None = None,
    width: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, DecodeState, TokenLogprobs | None]:
    """One speculative step for all slots. Returns (emitted [B, K+1], n_emit [B], new state,
    logprobs); row b's new tokens are emitted[b, :n_emit[b]] (n_emit is 0 for inactive slots), and
    for a chain the entries past the width the step verified (fewer than K + 1 tokens: a confidence
    schedule's choice, or no draft to verify) are -1;
    with ``sc.logprobs`` their :class:`TokenLogprobs` [B, K+1] (from the target's raw logits at the
    verified positions: what plain decoding would give them), else None. ``bitmask``
    [B, K+1, ceil(V/32)]: the tokens a grammar allows at each verified position
    (:mod:`mtp_jax.grammar`); or ``grammar_rows`` [B] (each slot's request, -1 for none) with
    ``grammar_key`` (the scheduler's :class:`mtp_jax.grammar.Constraints` key): the step asks the
    host for those masks itself, through a callback, while the target runs.

    ``rows``: step only slots [0, rows) (every other slot must be inactive), over the same page
    pools; emitted and n_emit then have ``rows`` rows. A server with few requests in many slots
    runs a program that size (one per power of two) instead of paying for every slot. Not with
    rows split over devices (a data axis).

    ``width`` (with ``sc.schedule``): verify that many tokens per row (1..K+1) instead of the width
    the confidences pick: how :func:`mtp_jax.timing.sps_table` times each width of this program."""
    whole = state
    if rows is not None:
        if row_shards(sc.mesh) > 1:
            raise ValueError("step(rows=...) needs the slots on every device (no data axis)")
        state = _first_rows(state, rows)
        bitmask = None if bitmask is None else bitmask[:rows]
        grammar_rows = None if grammar_rows is None else grammar_rows[:rows]
    if grammar_rows is not None:
        if sc.tree is not None:
            raise ValueError("a token tree's grammar masks come from the host (grammar_masks='host')")
        drafts = state.drafts[:, : sc.k]
        if grammar_key is None:
            raise ValueError("grammar_rows needs grammar_key: whose constraints compute the masks")
        bitmask = in_step_masks(
            grammar_key, grammar_rows, state.seq_len, state.next_token, drafts, sc.cfg.vocab_size
        )

    def verified(k: int, params: dict, state: DecodeState):
        if sc.tree is not None:
            emitted, n_emit, state, logits = _tree_verified(params, state, sc, bitmask)
        else:
            hidden, logits, target_pages = _verify(params, state, sc, k)
            emitted, n_acc = _accept(logits, state, sc, None if bitmask is None else bitmask[:, : k + 1], k)
            n_emit, state = _commit_and_draft(params, state, sc, hidden, target_pages, emitted, n_acc, k)
        logprobs = None
        if sc.logprobs:  # every verified position's, padded to K+1 like the tokens
            logprobs = jax.tree.map(
                lambda x: _room(jnp.zeros((x.shape[0], sc.k + 1, *x.shape[2:]), x.dtype), x),
                token_logprobs(logits, emitted, MAX_LOGPROBS),
            )
        # a chain's positions past the width verified hold -1: the host counts the drafts verified
        # (a tree verifies all its nodes whatever the depth of the path it emits)
        fill = -1 if sc.tree is None else 0
        padded = _room(jnp.full((emitted.shape[0], sc.k + 1), fill, emitted.dtype), emitted)
        return padded, n_emit, state, logprobs

    emitted, n_emit, state, logprobs = _at_width(params, state, sc, verified, width)
    if rows is not None:
        state = _merge_rows(whole, state, rows)
    logprobs = jax.tree.map(lambda x: replicated(x, sc.mesh), logprobs)
    return replicated(emitted, sc.mesh), n_emit, constrain_state(state, sc), logprobs


def _at_width(params: dict, state: DecodeState, sc: StepConfig, verified: Callable, width) -> tuple:
    """``verified(k, params, state)`` at the step's width: the one the confidence schedule picks
    (or ``width``, forced); for a chain of a draft that proposes per row, the narrowest of
    :func:`verify_widths` that holds every active row's drafts (one token per row when none has
    one); else K + 1 (a token tree is verified whole)."""
    b = state.seq_len.shape[0]
    if sc.schedule is not None:  # the width the confidences and the measured speeds pick
        if width is None:
            cap, a = jnp.minimum(state.num_drafts, sc.k), cumulative(state.draft_conf[:, : sc.k])
            width = choose_width(a, cap, state.active, sc.schedule, not sc.schedule_global)
        branches = [functools.partial(verified, w) for w in range(sc.k + 1)]
        return one_of(width - 1, branches, params, state, _blank(b, sc))
    if sc.k and sc.tree is None and sc.drafter is not None and sc.drafter.proposes_per_row:
        # the narrowest width that holds every active row's drafts: one token per row, as plain
        # decoding, when none has a draft. The rows' tokens are the same at any such width (every
        # proposed draft is verified; the acceptance draws are keyed by position, not by width)
        widths = verify_widths(sc)
        need = 1 + jnp.max(jnp.where(state.active, jnp.minimum(state.num_drafts, sc.k), 0))
        index = jnp.sum(jnp.asarray(widths[:-1], jnp.int32) < need)
        branches = [functools.partial(verified, w - 1) for w in widths]
        return one_of(index, branches, params, state, _blank(b, sc))
    return verified(sc.k, params, state)


def verify_widths(sc: StepConfig) -> tuple[int, ...]:
    """The widths a step of a draft that proposes per row verifies at (ascending): 1, the
    draft's own (:attr:`mtp_jax.drafts.base.Draft.verify_widths`) and K + 1."""
    method = sc.drafter
    extra = () if method is None or method.verify_widths is None else method.verify_widths(sc.draft_cfg, sc.k)
    return tuple(sorted({1, sc.k + 1, *(w for w in extra if 1 < w <= sc.k)}))


def _blank(b: int, sc: StepConfig) -> tuple:
    """Zeros of a step's (emitted, n_emit, logprobs) for :func:`one_of`'s branches."""
    logprobs = None
    if sc.logprobs:
        logprobs = TokenLogprobs(
            jnp.zeros((b, sc.k + 1), jnp.float32),
            jnp.zeros((b, sc.k + 1, MAX_LOGPROBS), jnp.int32),
            jnp.zeros((b, sc.k + 1, MAX_LOGPROBS), jnp.float32),
        )
    return jnp.zeros((b, sc.k + 1), jnp.int32), jnp.zeros((b,), jnp.int32), logprobs


def one_of(index: jax.Array, branches: list[Callable], params: dict, state: Any, blank: tuple) -> tuple:
    """``branches[index](params, state)`` for a traced ``index``; each branch returns ``(emitted,
    n_emit, state, extra)``, and ``blank`` holds zeros of the other three's shapes and types.

    What ``lax.switch`` computes, without its copies: XLA copies a buffer that a conditional's
    branch updates in place (the KV caches here: the whole page pools, twice a step whatever the
    context; BENCHMARKS.md, "N-gram: the step's two widths without copying the caches"). One loop of
    zero or one trip per branch carries the state instead, and a loop's carry is updated in place.
    Inside each loop the weights pass an optimization barrier with the state, so that XLA cannot
    hoist work on the weights alone out of the loops (where it would run whether or not the loop
    does: bfloat16 weights converted for the CPU's dots, on every branch)."""

    def once(run: jax.Array, fn: Callable, carry: tuple) -> tuple:
        def body(c: tuple) -> tuple:
            weights, state = jax.lax.optimization_barrier((params, c[1][2]))
            return c[0] + 1, tuple(fn(weights, state))

        return jax.lax.while_loop(lambda c: c[0] < run.astype(jnp.int32), body, (jnp.int32(0), carry))[1]

    emitted, n_emit, extra = blank
    carry = (emitted, n_emit, state, extra)
    for i, fn in enumerate(branches):
        carry = once(index == i, fn, carry)
    return carry


def either(
    pred: jax.Array, if_true: Callable, if_false: Callable, params: dict, state: Any, blank: tuple
) -> tuple:
    """``if_true(params, state)`` where ``pred`` (a traced bool) holds, else ``if_false(params,
    state)`` (:func:`one_of`'s two branches)."""
    return one_of(pred.astype(jnp.int32), [if_false, if_true], params, state, blank)


# The host-orchestrated baseline: the same stages as separate executables with the host reading
# the acceptance result in between, as engines without a fused step do. Benchmarks only: it is
# how the benefit of fusion is measured rather than assumed.
_verify_jit = jax.jit(_verify, static_argnames=("sc",))
_commit_and_draft_jit = jax.jit(
    _traced_sampling(_commit_and_draft), static_argnames=("sc",), donate_argnames=("state",)
)


@functools.partial(jax.jit, static_argnames=("sc",))
@_traced_sampling
def _accept_jit(
    logits: jax.Array, state: DecodeState, sc: StepConfig, bitmask: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    # replicated, so that every process of a multi-host run can read the acceptance counts
    return jax.tree.map(lambda x: replicated(x, sc.mesh), _accept(logits, state, sc, bitmask))


def host_orchestrated_step(
    params: dict, state: DecodeState, sc: StepConfig, bitmask: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, DecodeState, None]:
    if sc.logprobs:
        raise ValueError("the host-orchestrated baseline step returns no log-probabilities")
    hidden, logits, target_pages = _verify_jit(params, state, sc)
    emitted, n_acc = _accept_jit(logits, state, sc, bitmask)
    n_acc = jnp.asarray(np.asarray(n_acc))  # the host round trip a fused step avoids
    n_emit, state = _commit_and_draft_jit(params, state, sc, hidden, target_pages, emitted, n_acc)
    return emitted, n_emit, state, None


@functools.partial(jax.jit, donate_argnames=("state",))
def deactivate(state: DecodeState, rows: jax.Array) -> DecodeState:
    """Mark slots ``rows`` [n] (indices >= B ignored) inactive: they stop writing caches."""
    return dataclasses.replace(state, active=state.active.at[rows].set(False, mode="drop"))
