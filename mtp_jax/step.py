"""THE unified speculative-decoding step, and prefill, as jitted functions over a donated state.

One call of :func:`step` does a whole speculative step for every batch slot, with no host round
trip inside (DESIGN.md, "The unified step"):

1. merge: the committed-but-uncached ``next_token`` and the K drafts form a [B, K+1] input at
   positions seq_len .. seq_len+K;
2. target: one forward over those B×(K+1) tokens writes their latent KV and yields logits;
3. accept (float32): greedy / argmax drafts (each position's token drawn exactly as plain
   decoding would draw it) or sampled drafts (min(1, p/q) with residual resampling);
4. commit: seq_len += n_accepted + 1; KV beyond it is stale, masked, and overwritten later;
5. draft: the MTP layer catches up on the newly committed positions (rows seq_len..seq_len+n_acc
   of its own paged cache) and proposes K new drafts by chaining itself K-1 more times.

K = 0 is plain decoding through the same machinery. Shapes (B, K, pages, page-table width) are
static, so the step compiles once; the state is donated, so caches are updated in place.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from mtp_jax.cache import slots_for
from mtp_jax.config import DeepseekV3Config
from mtp_jax.drafts.mtp import mtp_forward, mtp_logits
from mtp_jax.models.deepseek_v3 import PagedAttention, forward, lm_head
from mtp_jax.sampling import (
    DRAFT,
    SamplingParams,
    accept_argmax_drafts,
    accept_sampled_drafts,
    draft_probs,
    sample,
)
from mtp_jax.sharding import constrain_state, replicated

DRAFT_METHODS = ("mtp",)
DRAFT_SAMPLING = ("argmax", "sampled")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Everything static about a decoding run (part of the jit cache key)."""

    cfg: DeepseekV3Config
    page_size: int
    k: int = 0
    draft: str | None = None
    draft_sampling: str = "argmax"
    mesh: Mesh | None = None
    """With a mesh: rows and KV pages split over ``data`` x ``expert`` (data-parallel attention),
    MoE layers expert-parallel over ``expert`` (:mod:`mtp_jax.sharding`, :mod:`mtp_jax.ep`)."""

    @property
    def sampled(self) -> bool:
        return self.k > 0 and self.draft_sampling == "sampled"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Per-slot decoding state, all on device. B slots, K drafts, W pages per row.

    target_pages: {stack: [L, P, page, c]}; draft_pages: [P, page, c] (the MTP layer's cache; a
    [0]-shaped placeholder without a draft); page_table [B, W]; seq_len [B] tokens in the target
    cache; next_token [B] (committed, not yet cached); drafts [B, K]; draft_q [B, K, V] (sampled
    drafts only, else [B, 0, 0]); active [B]; sampling: per-row parameters.
    """

    target_pages: dict
    draft_pages: jax.Array
    page_table: jax.Array
    seq_len: jax.Array
    next_token: jax.Array
    drafts: jax.Array
    draft_q: jax.Array
    active: jax.Array
    sampling: SamplingParams


def init_state(sc: StepConfig, batch: int, num_pages: int, width: int, dtype) -> DecodeState:
    from mtp_jax.cache import init_pages, latent_width

    cfg = sc.cfg
    draft_pages = (
        jnp.zeros((num_pages, sc.page_size, latent_width(cfg)), dtype) if sc.k else jnp.zeros((0,), dtype)
    )
    q_shape = (batch, sc.k, cfg.vocab_size) if sc.sampled else (batch, 0, 0)
    return DecodeState(
        target_pages=init_pages(cfg, num_pages, sc.page_size, dtype),
        draft_pages=draft_pages,
        page_table=jnp.zeros((batch, width), jnp.int32),
        seq_len=jnp.zeros((batch,), jnp.int32),  # every leaf its own buffer: the state is donated
        next_token=jnp.zeros((batch,), jnp.int32),
        drafts=jnp.zeros((batch, sc.k), jnp.int32),
        draft_q=jnp.zeros(q_shape, jnp.float32),
        active=jnp.zeros((batch,), bool),
        sampling=SamplingParams.build(batch),
    )


def forward_paged(
    params: dict,
    pages: dict,
    cfg: DeepseekV3Config,
    page_size: int,
    tokens: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    page_table: jax.Array,
    mesh: Mesh | None = None,
    logits: bool = True,
):
    """Write tokens [b, t] at positions [b, t] (only where valid) and run the target over the cache
    (``mesh`` as in :func:`mtp_jax.models.deepseek_v3.forward`).

    Returns (post-norm hidden [b, t, d], float32 logits [b, t, V], pages); the logits are None
    with ``logits=False`` (prefill needs the head at one row per prompt: :func:`at_rows` first).
    """
    paged = PagedAttention(pages, slots_for(page_table, positions, valid, page_size), page_table)
    hidden, pages = forward(params, cfg, tokens, positions, paged, mesh=mesh)
    return hidden.post_norm, lm_head(params, hidden.post_norm) if logits else None, pages


def at_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[b, index[b]] for x [b, t, ...] and index [b]."""
    return jnp.take_along_axis(x, index.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]


forward_paged_jit = jax.jit(
    forward_paged, static_argnames=("cfg", "page_size", "mesh"), donate_argnames=("pages",)
)


def _mtp_rows(params, sc, draft_pages, page_table, next_tokens, hidden, positions, valid):
    """The MTP layer over rows written to its paged cache: (states g [b, t, d], pages). No head:
    drafts read it at one state per row (:func:`_propose`)."""
    paged = PagedAttention(draft_pages, slots_for(page_table, positions, valid, sc.page_size), page_table)
    out = mtp_forward(params, sc.cfg, next_tokens, hidden, positions, paged, mesh=sc.mesh, logits=False)
    return out.state, out.pages


def _propose(params, sc, draft_pages, page_table, active, sampling, g, first_pos):
    """K drafts per row from the MTP state g [b, d] of the row before them.

    The first draft is for position first_pos [b]; each next one feeds the previous draft and the
    recycled state g back through the MTP layer at the following position.
    """

    def pick(lg, pos):
        if sc.sampled:
            q = draft_probs(lg, sampling)
            return sample(lg, sampling, pos, DRAFT), q
        return jnp.argmax(lg, axis=-1).astype(jnp.int32), jnp.zeros((lg.shape[0], 0), jnp.float32)

    d, q = pick(mtp_logits(params, g), first_pos)

    def chain(carry, j):
        d, g, pages = carry
        pos = (first_pos - 2 + j)[:, None]  # MTP row i predicts position i + 2 (draft j+1's)
        g_new, pages = _mtp_rows(params, sc, pages, page_table, d[:, None], g[:, None], pos, active[:, None])
        d_new, q_new = pick(mtp_logits(params, g_new[:, 0]), first_pos + j)
        return (d_new, g_new[:, 0], pages), (d_new, q_new)

    (_, _, draft_pages), (more_d, more_q) = jax.lax.scan(chain, (d, g, draft_pages), jnp.arange(1, sc.k))
    drafts = jnp.concatenate([d[:, None], jnp.moveaxis(more_d, 0, 1)], axis=1)
    qs = jnp.concatenate([q[:, None], jnp.moveaxis(more_q, 0, 1)], axis=1)
    return drafts, qs, draft_pages


@functools.partial(jax.jit, static_argnames=("sc",), donate_argnames=("state",))
def prefill(
    params: dict,
    state: DecodeState,
    sc: StepConfig,
    rows: jax.Array,
    tokens: jax.Array,
    lengths: jax.Array,
    page_table: jax.Array,
    sampling: SamplingParams,
) -> tuple[jax.Array, DecodeState]:
    """Admit requests into slots ``rows`` [R] (an index >= B is a padding row, ignored): right-padded
    prompts tokens [R, T] of ``lengths`` [R] with their page-table rows [R, W] and sampling [R].

    Fills the target cache, samples each request's first token and, with a draft, fills the MTP
    cache for the prompt and proposes the first K drafts. Returns (first tokens [R], state).
    """
    r, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (r, t))
    real = rows < state.active.shape[0]
    valid = (positions < lengths[:, None]) & real[:, None]
    hidden, _, target_pages = forward_paged(  # no head here: it runs at each prompt's last row below
        params,
        state.target_pages,
        sc.cfg,
        sc.page_size,
        tokens,
        positions,
        valid,
        page_table,
        sc.mesh,
        logits=False,
    )
    last = lengths - 1
    first = sample(lm_head(params, at_rows(hidden, last)), sampling, lengths)
    draft_pages = state.draft_pages
    drafts = jnp.zeros((r, sc.k), jnp.int32)
    q = jnp.zeros((r,) + state.draft_q.shape[1:], jnp.float32)
    if sc.k:
        # MTP row i pairs h_i with token i+1: the prompt shifted left, the sampled token at the end
        shifted = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
        next_tokens = jnp.where(positions == last[:, None], first[:, None], shifted)
        g, draft_pages = _mtp_rows(params, sc, draft_pages, page_table, next_tokens, hidden, positions, valid)
        drafts, q, draft_pages = _propose(
            params, sc, draft_pages, page_table, real, sampling, at_rows(g, last), lengths + 1
        )
        q = q if sc.sampled else jnp.zeros((r,) + state.draft_q.shape[1:], jnp.float32)

    def put(dst, src):
        return dst.at[rows].set(src, mode="drop")

    return replicated(first, sc.mesh), constrain_state(
        DecodeState(
            target_pages=target_pages,
            draft_pages=draft_pages,
            page_table=put(state.page_table, page_table),
            seq_len=put(state.seq_len, lengths),
            next_token=put(state.next_token, first),
            drafts=put(state.drafts, drafts),
            draft_q=put(state.draft_q, q),
            active=put(state.active, real),
            sampling=jax.tree.map(put, state.sampling, sampling),
        ),
        sc.mesh,
    )


def _verify(params: dict, state: DecodeState, sc: StepConfig):
    """Stages 1-2: merge next_token and drafts, run the target over them (writes their KV)."""
    b = state.seq_len.shape[0]
    tokens = jnp.concatenate([state.next_token[:, None], state.drafts], axis=1)
    positions = state.seq_len[:, None] + jnp.arange(sc.k + 1, dtype=jnp.int32)
    valid = jnp.broadcast_to(state.active[:, None], (b, sc.k + 1))
    return forward_paged(
        params, state.target_pages, sc.cfg, sc.page_size, tokens, positions, valid, state.page_table, sc.mesh
    )


def _accept(logits: jax.Array, state: DecodeState, sc: StepConfig) -> tuple[jax.Array, jax.Array]:
    """Stage 3: (emitted [B, K+1], n_accepted [B])."""
    if sc.sampled:
        return accept_sampled_drafts(logits, state.drafts, state.draft_q, state.sampling, state.seq_len + 1)
    return accept_argmax_drafts(logits, state.drafts, state.sampling, state.seq_len + 1)


def _commit_and_draft(params, state, sc, hidden, target_pages, emitted, n_acc):
    """Stages 4-5: advance the committed length, catch the MTP layer up, propose K drafts."""
    k = sc.k
    seq = state.seq_len
    n_emit = jnp.where(state.active, n_acc + 1, 0)
    new_seq = seq + n_emit
    new_next = jnp.take_along_axis(emitted, n_acc[:, None], axis=1)[:, 0]
    draft_pages, drafts, q = state.draft_pages, state.drafts, state.draft_q
    if k:
        # catch up: MTP rows seq..seq+n_acc pair the accepted positions' hidden states with the
        # tokens that followed them (the emitted ones); rows past n_acc are not written
        positions = seq[:, None] + jnp.arange(k + 1, dtype=jnp.int32)
        catch_valid = state.active[:, None] & (jnp.arange(k + 1)[None, :] <= n_acc[:, None])
        g, draft_pages = _mtp_rows(
            params, sc, draft_pages, state.page_table, emitted, hidden, positions, catch_valid
        )
        g_last = at_rows(g, n_acc)  # the head runs on the last accepted row alone
        new_drafts, new_q, draft_pages = _propose(
            params, sc, draft_pages, state.page_table, state.active, state.sampling, g_last, new_seq + 1
        )
        drafts = jnp.where(state.active[:, None], new_drafts, state.drafts)
        if sc.sampled:
            q = new_q
    new_state = dataclasses.replace(
        state,
        target_pages=target_pages,
        draft_pages=draft_pages,
        seq_len=new_seq,
        next_token=jnp.where(state.active, new_next, state.next_token),
        drafts=drafts,
        draft_q=q,
    )
    return replicated(n_emit, sc.mesh), new_state  # replicated: every process reads the counts


@functools.partial(jax.jit, static_argnames=("sc",), donate_argnames=("state",))
def step(params: dict, state: DecodeState, sc: StepConfig) -> tuple[jax.Array, jax.Array, DecodeState]:
    """One speculative step for all slots. Returns (emitted [B, K+1], n_emit [B], new state);
    row b's new tokens are emitted[b, :n_emit[b]] (n_emit is 0 for inactive slots)."""
    hidden, logits, target_pages = _verify(params, state, sc)
    emitted, n_acc = _accept(logits, state, sc)
    n_emit, state = _commit_and_draft(params, state, sc, hidden, target_pages, emitted, n_acc)
    return replicated(emitted, sc.mesh), n_emit, constrain_state(state, sc.mesh)


# The host-orchestrated baseline: the same stages as separate executables with the host reading
# the acceptance result in between, as engines without a fused step do. Benchmarks only: it is
# how the benefit of fusion is measured rather than assumed.
_verify_jit = jax.jit(_verify, static_argnames=("sc",))
_commit_and_draft_jit = jax.jit(_commit_and_draft, static_argnames=("sc",), donate_argnames=("state",))


@functools.partial(jax.jit, static_argnames=("sc",))
def _accept_jit(logits: jax.Array, state: DecodeState, sc: StepConfig) -> tuple[jax.Array, jax.Array]:
    # replicated, so that every process of a multi-host run can read the acceptance counts
    return jax.tree.map(lambda x: replicated(x, sc.mesh), _accept(logits, state, sc))


def host_orchestrated_step(
    params: dict, state: DecodeState, sc: StepConfig
) -> tuple[jax.Array, jax.Array, DecodeState]:
    hidden, logits, target_pages = _verify_jit(params, state, sc)
    emitted, n_acc = _accept_jit(logits, state, sc)
    n_acc = jnp.asarray(np.asarray(n_acc))  # the host round trip a fused step avoids
    n_emit, state = _commit_and_draft_jit(params, state, sc, hidden, target_pages, emitted, n_acc)
    return emitted, n_emit, state


@functools.partial(jax.jit, donate_argnames=("state",))
def deactivate(state: DecodeState, rows: jax.Array) -> DecodeState:
    """Mark slots ``rows`` [n] (indices >= B ignored) inactive: they stop writing caches."""
    return dataclasses.replace(state, active=state.active.at[rows].set(False, mode="drop"))
