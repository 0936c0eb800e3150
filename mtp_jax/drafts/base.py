"""What every draft method supplies to the unified step.

A draft proposes K tokens per row for the target to verify. Each draft module builds one
:class:`Draft`, registered by name in :data:`mtp_jax.drafts.DRAFTS`; the step (:mod:`mtp_jax.step`)
composes any target with any draft through these functions alone.

The one operation a draft performs, in prefill and after every verification alike, is
``extend_and_propose``: consume the rows the target has just committed (:class:`Rows`: the tokens,
the token that followed each, their positions and the target's hidden states there), update the
draft's own device state (its cache, a recycled state), and propose the next K tokens starting
right after the last committed row. In prefill the rows are the prompt's; after a step they are the
K+1 verified rows, of which the accepted ones (and the bonus token) are valid.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.sampling import (
    DRAFT,
    RowSampling,
    draft_probs,
    repeat_rows,
    row_keys,
    sample,
    traced_greedy_only,
)
from mtp_jax.targets.base import Hidden, TreeMask


class Rows(NamedTuple):
    """Rows of a batch the target has just written and committed, for a draft to consume.

    tokens [b, t]: the token at each row's position (what the target read there);
    next_tokens [b, t]: the token that follows it (the next prompt token, the sampled first token,
    or the emitted token), the pair a draft conditions on;
    positions [b, t]; valid [b, t]: the rows committed this time (others are not consumed);
    hidden: the target's hidden states at these rows (those the draft asks for);
    last [b]: index of each sequence's last valid row: the draft proposes from its state.
    """

    tokens: jax.Array
    next_tokens: jax.Array
    positions: jax.Array
    valid: jax.Array
    hidden: Hidden
    last: jax.Array


@dataclasses.dataclass(frozen=True)
class DraftContext:
    """What a draft's functions may read of the step's configuration (static: part of the jit key).
    The step hands every draft this, not its whole :class:`~mtp_jax.step.StepConfig`."""

    cfg: Any
    """The target's parsed config."""
    draft_cfg: Any
    """A separately loaded draft's parsed config (None for drafts in the target's checkpoint)."""
    k: int
    """Drafts to propose per row (0: only consume the rows)."""
    sampled: bool
    """Propose samples of the draft distribution (and return it), else its argmax."""
    page_size: int
    """Tokens per cache page (a draft's own caches use the target's page table)."""
    mesh: Any = None
    """The step's mesh (None on one device)."""
    tree: Any = None
    """A :class:`mtp_jax.tree.TokenTree` (or :class:`~mtp_jax.tree.DynamicTree`) to propose instead
    of a chain (then ``k`` is its draft nodes), for drafts with :attr:`Draft.trees`; None: a chain
    of ``k``."""


@dataclasses.dataclass(frozen=True)
class Draft:
    """A draft method's functions.

    available(params, cfg) -> None when the loaded model can draft this way, else the reason.
    Each function receives ``ctx``, a :class:`DraftContext`.
    capture(ctx) -> the target layers whose outputs the draft reads (static; () for none; numbered
        as :class:`mtp_jax.targets.base.CapturePlan` numbers them).
    init_state(ctx, num_pages, dtype) -> the draft's zeroed device state (a pytree; its caches use
        the target's page table and page ids).
    state_logical(path_names, rank) -> logical axes of one leaf of that state, for sharding.
    extend_and_propose(params, ctx, state, page_table, rows, active [b], sampling, first_position [b])
        -> (drafts [b, K] int32 target ids, q [b, K, V] float32 draft distributions in sampled mode
        else [b, K, 0], new state): see the module docstring. ``first_position`` is the absolute
        position of the first draft. With ``ctx.k`` = 0 it only consumes the rows (a step that
        speculates no further keeps the draft's state current).
    teacher_forced(params, ctx, tokens [b, T], hidden) -> float32 logits over whole sequences for
        scoring a draft offline: for a chained draft [b, T-1, V], its first step, row i from the
        target's hidden states at i (``hidden``, with the captured layers) and token i+1, predicting
        token i+2 (-inf at ids it cannot propose); for a block draft (DFlash) [b, T, B-1, V], the
        block anchored at each token.
    """

    name: str
    available: Callable[[dict, Any], str | None]
    capture: Callable[[Any], tuple[int, ...]]
    init_state: Callable[..., Any]
    state_logical: Callable[[list[str], int], tuple[str | None, ...]]
    extend_and_propose: Callable[..., tuple[jax.Array, jax.Array, Any]]
    teacher_forced: Callable[..., jax.Array]
    layer_stacks: tuple[tuple[str, ...], ...] = ()
    """Paths into the parameters of the draft's stacked layer trees (run with
    :func:`mtp_jax.targets.base.scan_layers`, so they may be per-layer buffers)."""
    step_reads: Callable[..., StepReads] | None = None
    """``step_reads(params, cfg, draft_cfg, k, batch, positions, cache_itemsize) -> StepReads``:
    what one step of K > 0 drafts reads for this draft (the roofline, :mod:`mtp_jax.roofline`);
    ``params`` is the whole tree, ``positions`` the rows' cache positions a step reads
    (``batch · (context + K + 1)``). None: nothing worth counting."""
    abstract_params: Callable[[Any, Any], dict] | None = None
    """``abstract_params(draft_cfg, shapes) -> tree``: a separately loaded draft's parameter tree as
    the loader builds it, as ShapeDtypeStructs made with ``shapes`` (:mod:`mtp_jax.plan`'s builder:
    ``plain(*shape, dtype=None)``, ``dense(cfg)`` (a dense builder for another config's tensors),
    ``stacked(tree, n)``,
    ``whole_model(cfg)``), for
    ``mtp-jax plan`` and random-weight timings."""
    params_group: str | None = None
    """The top-level key of the draft's weights in the parameter tree (None: it has none there)."""
    config_class: type | None = None
    """The parsed config class of a separately loaded draft (None: the draft lives in the target's
    checkpoint, or has no config)."""
    proposes_per_row: bool = False
    """The draft marks drafts it has no proposal for with -1 (a row's drafts count up to the first
    such); a step verifies at the narrowest of its widths (:attr:`verify_widths`; at least 1 and
    K + 1) that holds every active row's drafts: one token per row, as plain decoding, when no
    active row has a draft (:func:`mtp_jax.step.one_of` in :func:`mtp_jax.step.step`)."""
    verify_widths: Callable[[Any, int], tuple[int, ...]] | None = None
    """``verify_widths(draft_cfg, k)``: for a draft that :attr:`proposes_per_row`, the widths
    between 1 and K + 1 (tokens verified per row) worth a branch of the step of their own: each is
    one more target pass compiled into the step program, and saves, whenever every active row
    proposed that few drafts, the verification of K + 1. None: only 1 and K + 1."""
    sources: tuple[str, ...] = ()
    """For a draft that takes each row's proposal from one of several sources (suffix decoding: the
    row's own text or the engine-wide index; the hybrid: also its neural draft), their names. Its
    ``extend_and_propose`` then returns, last, each row's source [b] int32 (an index into these
    names, -1 where it proposed nothing), and the statistics count steps, drafts and accepted
    drafts by source (``drafts_by_source``; in a single-process run). Empty: one source."""
    title: str = ""
    """How messages name it (e.g. "EAGLE-3"; default: its name)."""
    check_plan: Callable[[Any, Any, int], None] | None = None
    """``check_plan(draft_cfg, target_cfg, k)``: ValueError when a separately loaded draft of this
    config cannot draft K tokens for that target (``mtp-jax plan``, random-weight timings)."""
    recognises: Callable[[dict, Any], bool] | None = None
    """``recognises(raw_config, reader) -> bool``: whether a draft directory (its parsed config.json
    and its tensors' reader) holds this kind of draft; asked in registration order by
    :func:`mtp_jax.model.load_draft`. None: never loaded from a directory."""
    parse_config: Callable[[Mapping[str, Any], int, Mapping[str, Any], int | None], Any] | None = None
    """``parse_config(raw_config, num_target_layers, options, target_vocab_size) -> config | None``:
    a separately stored draft's config.json read alone, with the target layers it reads resolved
    for a target of that many layers (``options``: its :attr:`load_options`, e.g. how EAGLE-3 ids
    are read), or None when the config is not this draft's. Asked in registration order by
    :func:`mtp_jax.drafts.parse_draft_config` (planning, ``mtp-jax inspect``, the roofline), which
    see no tensors; loading also sees them (:attr:`recognises`)."""
    load: Callable[..., tuple[Any, dict]] | None = None
    """``load(reader, raw, target_cfg, target_params, dtype, *, options, strict, mesh, target_path)
    -> (draft config, params[params_group])``: read a recognised draft for the target; ``options``
    (a mapping of its :attr:`load_options`) it checks itself."""
    load_options: tuple[str, ...] = ()
    """The names of the options it takes when loaded (``load(..., draft_options={...})``; EAGLE-3:
    ``layer_ids``, also given as ``draft_layer_ids``). Others are refused by name."""
    param_logical: Callable[[list[str], int], tuple[str | None, ...]] | None = None
    """``param_logical(names, rank)``: logical axes (:mod:`mtp_jax.sharding`) of the leaf at dict
    path ``names`` inside the draft's ``params_group`` (one layer: ``rank`` without a stacking
    axis). None: replicated."""
    default_k: int = 3
    """K when a request or engine names the draft without one."""
    configure: Callable[[Any, int | None, Mapping[str, Any]], tuple[Any, int | None]] | None = None
    """``configure(draft_cfg, k, options) -> (draft_cfg, k)``: a draft with settings of its own
    applies ``options`` (a mapping of its :attr:`options`, from ``SpeculativeConfig.draft_options``;
    empty: its defaults) to its config and resolves K (None: its default), raising
    InvalidRequestError for values it cannot take. None: K defaults to :attr:`default_k`."""
    options: tuple[str, ...] = ()
    """The names of the per-engine or per-call settings it takes (``draft_options``; DFlash:
    ``block_size``, also given as ``draft_block_size``). Others are refused by name."""
    block_size: Callable[[Any], int] | None = None
    """``block_size(draft_cfg)``: for a draft that proposes a block at a time (DFlash), the block it
    was trained on, the largest a request's ``draft_block_size`` may ask for (``mtp-jax bench
    --block-size`` runs each block size it is given up to that one). None: no blocks."""
    weights: bool = True
    """Whether the draft is a model with weights of its own. A weightless one (n-gram lookup) works
    with any target, so it is asked for by name only: not listed in ``Model.drafts`` nor picked by
    ``--draft auto``."""
    trees: bool = False
    """Whether it proposes token trees (:class:`mtp_jax.tree.TokenTree`): a chained draft whose
    ``extend_and_propose`` goes through :func:`chain_drafts`, whose ``advance`` then takes a level
    of nodes under a :class:`mtp_jax.targets.base.TreeMask`."""
    confidence: Callable[[Any], bool] | None = None
    """``confidence(draft_cfg)``: whether the loaded draft estimates, with each proposal, the
    probability that each draft is accepted given that the drafts before it were (DSpark's
    confidence head). Its ``extend_and_propose`` then returns a fourth element, those estimates as
    logits [b, K] (float32, calibrated), which the confidence scheduler (:mod:`mtp_jax.schedule`)
    verifies by. None: never."""
    cache_lookahead: int = 0
    """How many tokens after a position its entry in the draft's caches depends on: 1 for a draft
    whose row p pairs the target's state at p with token p+1 (MTP, EAGLE-3), 0 when an entry depends
    only on tokens up to its own position (a draft model, DFlash's context, n-gram's tokens).
    Automatic prefix caching shares a page only between prompts that also agree on that many tokens
    after it (:class:`mtp_jax.cache.PrefixCache`); a value too small would share wrong entries."""
    learner: Callable[[Any], Any] | None = None
    """``learner(draft_cfg)``: for a draft that learns from finished requests (the suffix draft's
    engine-wide index), the host object a scheduler keeps for it: ``finished(prompt, output,
    tenant)`` when a request that drafted finishes (``tenant``: the scheduler's number for its cache
    salt and LoRA adapter, also each row's ``RowSampling.tenant``), and ``apply(draft_state) ->
    draft_state`` between steps, writing what it learned into the draft's device state; optionally
    ``seeds() -> [(prompt, output, salt)]``, outputs counted before the first request (``salt`` as
    :func:`mtp_jax.scheduler.admission.salt` names a request's tenant), and ``stats() -> dict``,
    shown in the engine's statistics as ``draft_learned``. None: it learns nothing."""


@dataclasses.dataclass(frozen=True)
class StepReads:
    """Bytes a draft reads in one step of K drafts, by kind, and what it reads of the target's."""

    weights: float = 0.0
    """Its own weights (routed experts excepted), as often as its passes read them."""
    experts: float = 0.0
    """Its routed experts: per pass, those the pass's tokens are expected to touch."""
    heads: float = 0.0
    """Its own output head(s)."""
    kv: float = 0.0
    """Its own caches."""
    target_embedding_rows: tuple[int, ...] = ()
    """Rows of the TARGET's embedding each of its passes looks up (its own embedding: none)."""
    target_head_passes: int = 0
    """How often it reads the TARGET's output head."""


def chained_passes(k: int, batch: int) -> list[int]:
    """Tokens of each pass of a chained draft: the catch-up over the K+1 verified rows, then K-1
    one-token passes."""
    return [batch * (k + 1)] + [batch] * (k - 1) if k else []


def in_target_vocab(logits: jax.Array, draft_to_target: jax.Array | None, vocab_size: int) -> jax.Array:
    """Logits [..., Vd] over a draft vocabulary placed at their target ids (``draft_to_target``
    [Vd]) of a [..., vocab_size] float32 row, -inf elsewhere: the draft's distribution is exactly
    zero outside its vocabulary. ``None``: draft ids are target ids (returned unchanged)."""
    if draft_to_target is None:
        return logits
    full = jnp.full(logits.shape[:-1] + (vocab_size,), float("-inf"), jnp.float32)
    return full.at[..., draft_to_target].set(logits.astype(jnp.float32), unique_indices=True)


def choose(logits: jax.Array, sampled: bool, sampling: RowSampling, position: jax.Array):
    """One draft token per row from draft logits [b, V] for absolute ``position`` [b]: the argmax
    (q empty, [b, 0]) or, with ``sampled``, a sample from the processed distribution q [b, V]
    (the row's own sampling parameters, the draft's random stream)."""
    if sampled:
        return sample(logits, sampling, position, DRAFT), draft_probs(logits, sampling)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), jnp.zeros((logits.shape[0], 0), jnp.float32)


def chain_drafts(ctx, sampling: RowSampling, first_pos: jax.Array, logits: jax.Array, state, cache, advance):
    """K drafts per row, chained: the first chosen from ``logits`` [b, V] (for position first_pos
    [b]); each next one from ``advance(drafts [b, f], states [b, f, ...], cache, row_positions
    [b, f], tree) -> (logits [b, f, V], states, cache)``, which feeds drafts and the recycled
    states they were proposed with back through the draft at the rows before them (position
    first_pos - 2 + j for draft j, 0-based); ``tree`` is None for a chain (f = 1). With
    ``ctx.tree``, the tree's nodes instead (:func:`tree_drafts`). Returns (drafts [b, K], q
    [b, K, V] or [b, K, 0], cache). With K = 0 nothing is proposed (the draft only kept its cache
    current, and the unused logits compile away)."""
    if ctx.k == 0:
        return no_drafts(logits.shape[0]) + (cache,)
    if ctx.tree is not None and ctx.tree.dynamic:
        return dynamic_tree_drafts(ctx, first_pos, logits, state, cache, advance)
    if ctx.tree is not None:
        return tree_drafts(ctx, sampling, first_pos, logits, state, cache, advance)
    d, q = choose(logits, ctx.sampled, sampling, first_pos)

    def link(carry, j):
        d, state, cache = carry
        logits, state, cache = advance(d[:, None], state[:, None], cache, (first_pos - 2 + j)[:, None], None)
        logits, state = logits[:, 0], state[:, 0]
        d_new, q_new = choose(logits, ctx.sampled, sampling, first_pos + j)
        return (d_new, state, cache), (d_new, q_new)

    (_, _, cache), (more_d, more_q) = jax.lax.scan(link, (d, state, cache), jnp.arange(1, ctx.k))
    drafts = jnp.concatenate([d[:, None], jnp.moveaxis(more_d, 0, 1)], axis=1)
    qs = jnp.concatenate([q[:, None], jnp.moveaxis(more_q, 0, 1)], axis=1)
    return drafts, qs, cache


def tree_drafts(ctx, sampling: RowSampling, first_pos: jax.Array, logits: jax.Array, state, cache, advance):
    """A token tree's drafts (``ctx.tree``, :class:`mtp_jax.tree.TokenTree`), level by level: the
    root's children from ``logits`` [b, V] (the draft's distribution after the committed rows, with
    ``state`` [b, ...]); then each level's nodes that have children run through ``advance`` at once
    (as :func:`chain_drafts` describes, with f of them and a :class:`TreeMask`: node n sits in the
    draft's cache at row position first_pos - 2 + n, seeing the committed rows and its ancestors),
    and each such node's children are its ``c`` likeliest tokens under the draft (argmax mode) or
    ``c`` tokens drawn without replacement from its processed distribution (sampled mode: Gumbel
    top-c, the draft's random stream per node). Returns (drafts [b, N-1]: nodes 1..N-1's tokens,
    q [b, N-1, V]: in sampled mode the distribution at nodes 0..N-2 their children were drawn from
    (node N-1, the deepest, has none), else [b, N-1, 0], cache)."""
    tree = ctx.tree
    b, n = logits.shape[0], tree.size
    kids = tree.children()
    ancestors = tree.ancestors()
    tokens: list = [None] * n
    q_at: list = [None] * n
    states = {0: state}
    row0 = first_pos - 1  # the row of node 1 (depth 1): the position before its token
    for level in range(tree.max_depth):
        parents = [p for p in range(n) if tree.depth[p] == level and kids[p, 0] >= 0]
        if level == 0:
            level_logits = logits[:, None]
        else:
            idx = np.asarray(parents)
            fed = jnp.stack([tokens[p] for p in parents], axis=1)  # [b, f]
            fed_state = jnp.stack([states[tree.parent[p]] for p in parents], axis=1)
            mask = TreeMask(
                positions=row0[:, None] + jnp.asarray(idx - 1, jnp.int32)[None, :],
                base=row0,
                nodes=jnp.broadcast_to(jnp.asarray(ancestors[idx, 1:]), (b, len(parents), n - 1)),
            )
            rows = jnp.broadcast_to(row0[:, None] + level - 1, (b, len(parents)))
            level_logits, level_state, cache = advance(fed, fed_state, cache, rows, mask)
            for i, p in enumerate(parents):
                states[p] = level_state[:, i]
        width = int(max((kids[p] >= 0).sum() for p in parents))
        top, q = _children(level_logits, width, ctx.sampled, sampling, first_pos + level, parents)
        for i, p in enumerate(parents):
            if ctx.sampled:
                q_at[p] = q[:, i]
            for r, child in enumerate(kids[p]):
                if child >= 0:
                    tokens[child] = top[:, i, r]
    drafts = jnp.stack(tokens[1:], axis=1)
    if not ctx.sampled:
        return drafts, jnp.zeros((b, n - 1, 0), jnp.float32), cache
    v = logits.shape[-1]
    qs = jnp.stack([jnp.zeros((b, v), jnp.float32) if x is None else x for x in q_at[: n - 1]], axis=1)
    return drafts, qs, cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeDrafts:
    """A proposal of trees whose shape each row chose (:class:`mtp_jax.tree.DynamicTree`): the
    nodes' tokens [b, N-1] (nodes 1..N-1) and their parents [b, N] (node 0 the root, -1)."""

    tokens: jax.Array
    parent: jax.Array


def dynamic_tree_drafts(ctx, first_pos: jax.Array, logits: jax.Array, state, cache, advance):
    """EAGLE-2's dynamic tree (``ctx.tree``, :class:`mtp_jax.tree.DynamicTree` of depth D, topk k,
    N - 1 nodes): the root's k likeliest tokens under the draft are the first level's candidates;
    at each next level the k candidates of highest cumulative log-probability (the frontier) run
    through ``advance`` at once (as :func:`chain_drafts` describes; frontier slot i of level l
    sits in the draft's cache at row first_pos - 1 + (l - 1) k + i, seeing the committed rows and
    its frontier ancestors) and each proposes its k likeliest children. Of all the candidates,
    the N - 1 of highest cumulative log-probability are the tree (ties to the earlier candidate, so
    a node's parent, never less likely and proposed before it, is always kept), in the order they
    were proposed (parents first). Returns (:class:`TreeDrafts`, q [b, N-1, 0]: the candidates are
    fixed, cache)."""
    tree = ctx.tree
    k, expanded, nodes = tree.topk, tree.expanded, tree.nodes
    b = logits.shape[0]
    row0 = first_pos - 1
    logq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    front_tokens = likeliest(logq, k)  # [b, k]
    front_score = jnp.take_along_axis(logq, front_tokens, axis=-1)
    front_ids = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))  # candidate ids
    tokens, scores, parents = [front_tokens], [front_score], [jnp.full((b, k), -1, jnp.int32)]
    front_state = jax.tree.map(lambda x: jnp.repeat(x[:, None], k, axis=1), state)
    slots = jnp.arange(k, dtype=jnp.int32)
    seen = jnp.broadcast_to(jax.nn.one_hot(slots, max(expanded, 1), dtype=bool), (b, k, max(expanded, 1)))
    proposed = k
    for level in range(1, tree.depth):
        mask = TreeMask(positions=row0[:, None] + ((level - 1) * k + slots)[None, :], base=row0, nodes=seen)
        rows = jnp.broadcast_to(row0[:, None] + level - 1, (b, k))
        level_logits, level_state, cache = advance(front_tokens, front_state, cache, rows, mask)
        level_logq = jax.nn.log_softmax(level_logits.astype(jnp.float32), axis=-1)  # [b, k, V]
        kids = likeliest(level_logq, k)  # [b, k, k]
        kid_score = front_score[:, :, None] + jnp.take_along_axis(level_logq, kids, axis=-1)
        kid_score = kid_score.reshape(b, k * k)
        kids = kids.reshape(b, k * k)
        tokens.append(kids)
        scores.append(kid_score)
        parents.append(jnp.repeat(front_ids, k, axis=1))
        if level < tree.depth - 1:  # the next frontier: the k likeliest children
            best = likeliest(kid_score, k)  # [b, k]
            src = best // k  # the frontier slot each is a child of
            front_tokens = jnp.take_along_axis(kids, best, axis=1)
            front_score = jnp.take_along_axis(kid_score, best, axis=1)
            front_ids = proposed + best
            front_state = jax.tree.map(functools.partial(at_slots, index=src), level_state)
            seen = at_slots(seen, src) | jax.nn.one_hot(level * k + slots, expanded, dtype=bool)[None]
        proposed += k * k
    tokens, scores, parents = (jnp.concatenate(x, axis=1) for x in (tokens, scores, parents))
    _, chosen = jax.lax.top_k(scores, nodes)  # equal scores: the earlier candidate first
    chosen = jnp.sort(chosen, axis=1)  # proposal order: each parent before its children
    rows_ = jnp.arange(b)[:, None]
    numbers = jnp.broadcast_to(jnp.arange(1, nodes + 1, dtype=jnp.int32), (b, nodes))
    index = jnp.zeros((b, proposed), jnp.int32).at[rows_, chosen].set(numbers)  # candidate -> node
    up = jnp.take_along_axis(parents, chosen, axis=1)
    parent = jnp.where(up >= 0, jnp.take_along_axis(index, jnp.maximum(up, 0), axis=1), 0)
    parent = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), parent], axis=1)
    drafts = TreeDrafts(jnp.take_along_axis(tokens, chosen, axis=1), parent)
    return drafts, jnp.zeros((b, nodes, 0), jnp.float32), cache


def at_slots(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[b, index[b, i]] for x [b, s, ...] and index [b, i]."""
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def likeliest(scores: jax.Array, m: int) -> jax.Array:
    """The indices [..., m] of the m largest of ``scores`` [..., V], largest first: m argmaxes, each
    after masking the ones before (a few passes over the vocabulary instead of a sort of it, which
    is what ``lax.top_k`` becomes on a CPU)."""
    picks = []
    for _ in range(m):
        pick = jnp.argmax(scores, axis=-1).astype(jnp.int32)
        picks.append(pick)
        scores = jnp.where(jax.nn.one_hot(pick, scores.shape[-1], dtype=bool), -jnp.inf, scores)
    return jnp.stack(picks, axis=-1)


def _children(logits: jax.Array, width: int, sampled: bool, sampling: RowSampling, position, parents: list):
    """Each of f nodes' ``width`` children from the draft's logits there [b, f, V]: (tokens
    [b, f, width], q [b, f, V] or None). The likeliest tokens; in sampled mode, for rows that sample
    (temperature > 0), tokens drawn without replacement from the processed distribution q (Gumbel
    top-k; the draft's stream at ``position`` [b], folded with the parent node's index)."""
    b, f, v = logits.shape
    top = likeliest(logits, width)
    if not sampled:
        return top, None
    per = repeat_rows(sampling, f)
    flat = logits.reshape(b * f, v)
    q = draft_probs(flat, per)
    if traced_greedy_only():  # every row greedy: the likeliest children, as below, and no draws
        return top, q.reshape(b, f, v)
    keys = row_keys(per.seed, jnp.repeat(position, f), DRAFT)
    keys = jax.vmap(jax.random.fold_in)(keys, jnp.tile(jnp.asarray(parents, jnp.uint32), b))
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(keys)
    scores = jnp.where(q > 0, jnp.log(jnp.maximum(q, 1e-38)) + gumbel, -jnp.inf)
    drawn = likeliest(scores, width).reshape(b, f, width)
    drawn = jnp.where(sampling.temperature[:, None, None] > 0, drawn, top)
    return drawn, q.reshape(b, f, v)


def fixed_draft_logits(drafts: jax.Array, vocab_size: int) -> jax.Array:
    """Teacher-forced "logits" [..., V] of a draft that proposes fixed tokens ``drafts`` [...]: 0 at
    the draft, -inf elsewhere (a weightless draft's distribution)."""
    return jnp.where(jax.nn.one_hot(drafts, vocab_size, dtype=jnp.float32) > 0, 0.0, -jnp.inf)


def no_drafts(b: int) -> tuple[jax.Array, jax.Array]:
    """The (drafts [b, 0], q [b, 0, 0]) of a step that proposes none."""
    return jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0, 0), jnp.float32)


def at_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[b, index[b]] for x [b, t, ...] and index [b]."""
    return jnp.take_along_axis(x, index.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]
