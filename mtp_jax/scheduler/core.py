"""The scheduler: continuous batching over a fixed number of slots around the jitted step, one
step read late (see :mod:`mtp_jax.scheduler`)."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.cache import PrefixCache, ShardedPageAllocator
from mtp_jax.grammar import Constraints
from mtp_jax.scheduler.admission import Admission, Admissions, check_fits
from mtp_jax.scheduler.programs import next_power_of_two, warmup, warmup_job, warmup_jobs
from mtp_jax.scheduler.reads import RowReads
from mtp_jax.scheduler.requests import (
    Request,
    SpecCounters,
    VerifiedCallback,
    logprob_rows,
)
from mtp_jax.sharding import row_shards, state_shardings
from mtp_jax.step import StepConfig, deactivate, host_orchestrated_step, init_state, step
from mtp_jax.tree import TokenTree


class Scheduler:
    """Continuous batching over ``slots`` rows of ``width`` cache pages each, around the jitted step.

    Requests are :meth:`submit`-ted at any time and join free slots between steps (prefill writes
    them into the running state); :meth:`advance` runs one iteration (admit, dispatch a step, read
    the previous one); :meth:`cancel` stops a request and frees its pages at once. The caches and
    the compiled programs live as long as the scheduler.

    Each request accepts at most its own ``sampling.num_speculative_tokens``; a step verifies as many drafts
    as its active rows ask for at most (one compiled step per distinct count; with none, a plain step
    that leaves the draft's state alone: a row only ever reads its own draft state, and a row that
    speculates runs only steps that do). ``constraints`` holds the requests' grammars
    (:mod:`mtp_jax.grammar`): while a constrained request runs, each step's results are read
    before the next is dispatched (its masks follow the drafts that step proposed), and a request
    stops when its grammar admits nothing more; with ``grammar_masks="callback"`` the step asks the
    host for its masks itself (an ordered io_callback) and the scheduler keeps dispatching one step
    ahead (one process only). ``fused=False`` runs the host-orchestrated baseline step instead, and
    ``pipelined=False`` reads every step's results before dispatching the next (benchmarks only:
    the cost of a host round trip per step, which is what a grammar pays). With ``prefix_caching``
    requests share the cache pages of equal prompt prefixes (:class:`mtp_jax.cache.PrefixCache`):
    a request prefills only what follows its longest cached prefix. With ``chunked_prefill`` (a token
    count) a prompt longer than that is prefilled that many tokens per iteration, between the steps
    of the running requests (its slot waits meanwhile), instead of in one long prefill that stalls
    them all. ``on_verified``: with a draft that estimates its confidence, called after each step
    (:func:`confidences`)."""

    def __init__(
        self,
        params: dict,
        sc: StepConfig,
        *,
        slots: int,
        width: int,
        eos_token_ids: Sequence[int],
        cache_dtype: jnp.dtype,
        fused: bool = True,
        constraints: Constraints | None = None,
        pipelined: bool = True,
        grammar_masks: str = "host",
        row_buckets: bool = False,
        prefix_caching: bool = False,
        chunked_prefill: int | None = None,
        on_verified: VerifiedCallback | None = None,
    ) -> None:
        _check_options(sc, slots, fused, constraints, grammar_masks, chunked_prefill, on_verified)
        self.on_verified, self.reads = on_verified, RowReads.of(sc)
        self.chunk = chunked_prefill
        self.filling: collections.deque[Admission] = collections.deque()  # prompts still arriving
        self.callback = constraints is not None and grammar_masks == "callback"
        # whose constraints the step's callback asks (made once: not a transfer per step)
        self.grammar_key = jnp.int32(constraints.key) if self.callback else None
        self.shards = row_shards(sc.mesh)  # rows and their pages split over this many devices
        self.params, self.sc, self.slots, self.width = params, sc, slots, width
        self.step_fn = step if fused else host_orchestrated_step
        self.fused, self.pipelined = fused, pipelined
        self.constraints = constraints
        self.eos = frozenset(eos_token_ids)
        self.variants: dict[tuple[int, bool], StepConfig] = {}  # the (K, logprobs) of the steps run
        # with row_buckets, a step covers only the slots up to the last occupied one (rounded up
        # to a power of two): a program per (K, rows) pair run
        self.row_buckets = row_buckets and fused and self.shards == 1
        self.programs: set[tuple[int, int]] = set()
        self.allocator = ShardedPageAllocator(slots * width, self.shards)  # slot b's pages: its shard
        self.prefix = _prefix_cache(self.allocator, sc) if prefix_caching else None
        state = init_state(sc, slots, self.allocator.num_pages, width, cache_dtype)
        if sc.mesh is not None:
            state = jax.device_put(state, state_shardings(sc, state))
        self.state = state
        self.queue: collections.deque[Request] = collections.deque()
        self.owner: list[Request | None] = [None] * slots
        self.pages_of: dict[int, list[int]] = {}
        self.proposed = np.zeros(slots, np.int64)  # drafts standing for each slot (the state's num_drafts)
        self.pending = None
        self.counters = SpecCounters(self.depth, self.sc.k)
        self.counts = {"steps": 0, "prefills": 0, "prefill_chunks": 0}
        self.widths: collections.Counter[int] = collections.Counter()  # steps by tokens verified per row
        self.first_step_seconds = 0.0
        self.first_admitted: float | None = None  # when the first admission's prefill returned
        self._next_id = 0
        self.admissions = Admissions(self)

    # -- requests ----------------------------------------------------------------------------

    @property
    def depth(self) -> int:
        """How many drafts a step can accept: K, or a token tree's depth (acceptance by position is
        acceptance by depth)."""
        return self.sc.k if self.sc.tree is None else self.sc.tree.max_depth

    def row_k(self, req: Request) -> int:
        """The drafts a request verifies per step: its own cap, at most the scheduler's K (with a
        token tree, the whole tree unless the request speculates not at all: its cap is a depth)."""
        k = min(int(np.asarray(req.sampling.num_speculative_tokens)[0]), self.sc.k)
        return self.sc.k if self.sc.tree is not None and k > 0 else k

    def submit(self, req: Request) -> Request:
        """Queue a validated request (its grammar, if any, already added to ``constraints``)."""
        check_fits(req, self.sc, self.width)
        if req.id < 0:
            req.id = self._next_id
        self._next_id = max(self._next_id, req.id + 1)
        req.counters = SpecCounters(self.depth, self.sc.k)
        if req.submitted_at is None:  # an engine's request is timed from its own submit
            req.submitted_at = time.perf_counter()
        req.sampling = jax.tree.map(np.asarray, req.sampling)
        self.queue.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """Stop ``req`` now: out of the queue, or its slot and pages freed (tokens of a step in
        flight are dropped)."""
        if req.finish:
            return
        if req in self.queue:
            self.queue.remove(req)
            self._finish(req, "cancelled")
            return
        self._finish(req, "cancelled")
        self._release([b for b, o in enumerate(self.owner) if o is req])

    @property
    def free_pages(self) -> int:
        """Cache pages a new request could take (with prefix caching: cached ones nobody holds too)."""
        return self.allocator.free if self.prefix is None else self.prefix.free

    @property
    def busy(self) -> bool:
        """Requests waiting or running, or a step not read yet."""
        return bool(self.queue) or self.pending is not None or any(o is not None for o in self.owner)

    # -- internals ---------------------------------------------------------------------------

    def _constrained(self, req: Request | None) -> bool:
        return self.constraints is not None and req is not None and self.constraints.constrained(req.id)

    def _variant(self, k: int, logprobs: bool = False) -> StepConfig:
        """The step configuration of K = k (the draft idle at 0), with or without log-probabilities.
        A token tree is verified whole whenever some row speculates (each row's cap limits the
        depth it accepts), so its K is its nodes or 0."""
        sc = self.sc
        if sc.tree is not None and k > 0:
            k = sc.k
        if (k, logprobs) not in self.variants:
            idle = k == 0 and sc.draft is not None
            tree = sc.tree if k else None
            self.variants[k, logprobs] = sc.variant(k, draft_idle=idle, logprobs=logprobs, tree=tree)
        return self.variants[k, logprobs]

    def _finish(self, req: Request, reason: str) -> None:
        req.finish = reason
        req.finished_at = time.perf_counter()
        if self._constrained(req):
            self.constraints.finish(req.id)
        if req.on_finish is not None:
            req.on_finish(req)

    def _emit(self, req: Request, tokens: np.ndarray, logprobs=None) -> bool:
        """Hand ``tokens`` to ``req`` (with ``logprobs``: their host TokenLogprobs arrays); True
        when that finishes it."""
        if not req.tokens and len(tokens):
            req.first_token_at = time.perf_counter()
        for i, tok in enumerate(tokens.tolist()):
            req.add_token(tok, logprobs, i)
            stop = req.on_token is not None and req.on_token(tok)
            ended = self._constrained(req) and self.constraints.consume(req.id, tok)
            reason = ""
            if tok in self.eos and not req.ignore_eos:
                reason = "eos"
            elif stop:
                reason = "stop"
            elif ended:
                reason = "grammar"
            elif len(req.tokens) >= req.max_new_tokens:
                reason = "length"
            if reason:
                self._finish(req, reason)
                return True
        return False

    def _running(self) -> list[Request | None]:
        """Each slot's request, None where none runs (free, or its prompt still arriving)."""
        owners = list(self.owner)
        for a in self.filling:
            owners[a.slot] = None
        return owners

    def _release(self, rows: list[int]) -> None:
        if not rows:
            return
        if self.filling:
            gone = set(rows)
            self.filling = collections.deque(a for a in self.filling if a.slot not in gone)
        for b in rows:
            self.admissions.release(self.owner[b], self.pages_of.pop(self.owner[b].id))
            self.owner[b] = None
        self._deactivate(rows)

    def _deactivate(self, rows: list[int]) -> None:
        # padded to a power of two with an out-of-range slot (ignored): a few programs at most
        padded = np.full(next_power_of_two(len(rows)), self.slots, np.int32)
        padded[: len(rows)] = rows
        self.state = deactivate(self.state, padded)

    def warmup_jobs(self, max_prompt_len: int, ks: Sequence[int]) -> list[tuple[str, int, int]]:
        """Every program requests without a grammar can run (:func:`.programs.warmup_jobs`)."""
        return warmup_jobs(self, max_prompt_len, ks)

    def warmup_job(self, kind: str, a: int, b: int) -> None:
        """Compile one of :meth:`warmup_jobs` (:func:`mtp_jax.scheduler.programs.warmup_job`)."""
        warmup_job(self, kind, a, b)

    def warmup(
        self, max_prompt_len: int, ks: Sequence[int], progress: Callable[[int, int], None] | None = None
    ) -> int:
        """Compile every program of :meth:`warmup_jobs` now (no request running); how many ran."""
        return warmup(self, max_prompt_len, ks, progress)

    def _process(self, emitted, n_emit, logprobs, owners: list, drafted, conf, sources) -> None:
        emitted, n_emit = np.asarray(emitted), np.asarray(n_emit)
        if len(emitted):  # -1 past the width a chain's step verified (a tree verifies every node)
            self.widths[int(np.max(np.sum(emitted >= 0, axis=1)))] += 1
        drafted = verified_drafts(np.asarray(drafted), emitted)
        lp, done = None if logprobs is None else jax.tree.map(np.asarray, logprobs), []
        expected = confidences(conf, drafted, n_emit, owners, self.on_verified)
        sources = None if sources is None else np.asarray(sources)
        for b, req in enumerate(owners):
            if req is None or req.finish:
                continue
            k = int(n_emit[b])
            source = self.reads.source(sources, drafted, b)
            self.counters.add(int(drafted[b]), k, float(expected[b]), source)
            req.counters.add(int(drafted[b]), k, float(expected[b]), source)
            if self._emit(req, emitted[b, :k], logprob_rows(lp, (b, slice(0, k)))):
                done.append(b)
        self._release(done)

    def _read_pending(self) -> None:
        pending, self.pending = self.pending, None
        self._process(*pending)

    def advance(self) -> bool:
        """One iteration: admit waiting requests into free slots, then dispatch a step (reading the
        previous one after it) or read the step in flight. False when there was nothing to do."""
        self.admissions.admit()
        filled = self.admissions.fill()
        running = self._running()
        if self.first_admitted is None and any(o is not None for o in running):
            self.first_admitted = time.perf_counter()
        active = [req for req in running if req is not None]
        if not active:
            if self.pending is None:
                return bool(self.queue or self.filling) or filled
            self._read_pending()
            return True
        if self.pending is not None and all(
            len(r.tokens) + self.sc.k + 1 >= r.max_new_tokens for r in active
        ):
            # the step in flight may finish every active row: read it before dispatching another,
            # which would otherwise run for rows that are already done (a whole wasted step at batch 1)
            self._read_pending()
            return True
        constrained = any(self._constrained(req) for req in active)
        if self.pending is not None and (not self.pipelined or (constrained and not self.callback)):
            # a grammar's masks follow the drafts of the step in flight: read it first
            self._read_pending()
            return True
        sc_now = self._variant(
            max(self.row_k(req) for req in active), any(req.logprobs is not None for req in active)
        )
        masks, grammar_rows = None, None
        if self.callback:
            ids = [req.id if self._constrained(req) else -1 for req in running]
            grammar_rows = jnp.asarray(ids, jnp.int32)
        else:
            masks = None
            if self.constraints is not None:
                trees = grammar_trees(self.sc, self.state, [self._constrained(r) for r in running])
                masks = self.constraints.step_masks(running, self.state.drafts, sc_now.k, trees)
        drafted, conf, sources = self.reads.before_step(self.state, sc_now, self.proposed)
        for b, req in enumerate(running):
            if req is not None:
                self.proposed[b] = min(self.row_k(req), sc_now.k)
        rows = self.slots
        if self.row_buckets:
            rows = min(next_power_of_two(1 + max(b for b, o in enumerate(self.owner) if o is not None)), rows)
        self.programs.add((sc_now.k, rows))
        extra = {"rows": rows} if rows < self.slots else {}
        if self.callback:
            extra["grammar_key"] = self.grammar_key
        t_call = time.perf_counter()
        args = (masks, grammar_rows) if self.callback else (masks,)
        emitted, n_emit, self.state, logprobs = self.step_fn(self.params, self.state, sc_now, *args, **extra)
        if not self.counts["steps"]:  # the call returns once compiled; the step itself runs on
            self.first_step_seconds = time.perf_counter() - t_call
        self.counts["steps"] += 1
        if self.pending is not None:
            self._read_pending()
        self.pending = (emitted, n_emit, logprobs, running, drafted, conf, sources)
        return True


def _prefix_cache(allocator: ShardedPageAllocator, sc: StepConfig) -> PrefixCache:
    """The scheduler's prefix cache over ``allocator``'s pages (keyed with the draft's lookahead)."""
    lookahead = 0 if sc.draft_method is None else sc.draft_method.cache_lookahead
    return PrefixCache(allocator, sc.page_size, lookahead)


def occupancy(sched: Scheduler) -> dict:
    """A running scheduler's counters (:class:`SpecCounters`) and occupancy, as a serving engine's
    statistics name them: slots running and prefilling, pages, prefix-cache hits, step programs."""
    out = {
        **sched.counters.as_dict(),
        "running": sum(o is not None for o in sched.owner),
        "prefilling": len(sched.filling),  # of the running: prompts still arriving in chunks
        "prefill_chunks": sched.counts["prefill_chunks"],
        "free_pages": sched.free_pages,
        "num_pages": sched.allocator.num_pages,
        "prefix_caching": sched.prefix is not None,
        "step_programs": len(sched.programs),
        "step_shapes": sorted(sched.programs),  # (K, rows) of each step program run
        "steps_per_width": steps_per_width(sched),
    }
    if sched.prefix is not None:
        out["prefix_cache_queries"] = sched.prefix.queries  # prompt tokens looked up
        out["prefix_cache_hits"] = sched.prefix.hits  # of those, found cached
        out["cached_pages"] = sched.prefix.cached
    learner = sched.admissions.learner
    if learner is not None and hasattr(learner, "stats"):  # what a learning draft has learned
        out["draft_learned"] = learner.stats()
    return out


def steps_per_width(sched: Scheduler) -> dict[str, int]:
    """Steps by the tokens they verified per row ("1": plain decoding's width; a chain of a draft
    that proposes per row runs at the narrowest of its widths that holds its rows' drafts)."""
    return {str(w): n for w, n in sorted(sched.widths.items())}


def _check_options(
    sc: StepConfig,
    slots: int,
    fused: bool,
    constraints: Constraints | None,
    grammar_masks: str,
    chunked_prefill: int | None,
    on_verified: VerifiedCallback | None,
) -> None:
    """Refuse a :class:`Scheduler`'s options that cannot go together, naming them."""
    if on_verified is not None and (not sc.confident or jax.process_count() > 1):
        raise ValueError("on_verified needs a draft with a confidence head, in one process")
    if chunked_prefill is not None and (
        isinstance(chunked_prefill, bool) or not isinstance(chunked_prefill, int) or chunked_prefill < 16
    ):
        raise ValueError(f"chunked_prefill must be None or an integer >= 16, got {chunked_prefill!r}")
    if constraints is not None and grammar_masks == "callback":
        if not fused or jax.process_count() > 1:
            raise ValueError('grammar_masks="callback" runs in the fused step of a single-process run')
        if sc.tree is not None:
            raise ValueError('the grammar masks of a token tree come from the host: grammar_masks="host"')
    if slots % row_shards(sc.mesh):
        raise ValueError(f"{slots} slots do not split over {row_shards(sc.mesh)} row devices")


def confidences(
    conf, drafted: np.ndarray, n_emit: np.ndarray, owners: list, on_verified: VerifiedCallback | None
) -> np.ndarray:
    """A step's confidences (``conf`` [slots, K], the calibrated logits of the drafts it verified;
    None without a confident draft): the accepted drafts each slot's confidences expected [owners]
    (the sum of the running products over its ``drafted`` [slots] verified drafts:
    :class:`SpecCounters`), after ``on_verified(confidence_logits [n, K], verified [n], accepted [n])``
    for the n rows the step advanced (DSpark's calibration rollouts). Read in single-process runs
    only: on a multi-process mesh a process does not hold every row's."""
    expected = np.zeros(len(owners))
    if conf is None:
        return expected
    conf = np.asarray(conf, np.float64)
    a = np.cumprod(1 / (1 + np.exp(-conf)), axis=1)  # mtp_jax.schedule.cumulative, on the host
    verified = np.arange(1, conf.shape[1] + 1)[None, :] <= drafted[: len(conf), None]
    expected[: len(conf)] = np.sum(np.where(verified, a, 0.0), axis=1)
    if on_verified is not None:
        live = [b for b, req in enumerate(owners) if req is not None and not req.finish]
        accepted = np.minimum(np.maximum(n_emit[live] - 1, 0), drafted[live])
        on_verified(conf[live], drafted[live], accepted)
    return expected


def verified_drafts(drafted: np.ndarray, emitted: np.ndarray) -> np.ndarray:
    """The drafts each slot's step verified: at most ``drafted`` [slots], and no more than its
    width (``emitted`` [rows, K+1] holds -1 past it; rows: the slots the step computed)."""
    width = np.sum(emitted >= 0, axis=1)
    return np.concatenate([np.minimum(drafted[: len(width)], width - 1), drafted[len(width) :]])


def grammar_trees(sc: StepConfig, state, constrained: Sequence[bool]):
    """The token tree a step's grammar masks follow: the static one, or with a dynamic tree each
    constrained slot's own (the parents the last step proposed, read from ``state``; None
    elsewhere)."""
    tree = sc.tree
    if tree is None or not tree.dynamic or not any(constrained):
        return tree
    parents = np.asarray(state.tree_parent)
    return [TokenTree.from_parents(parents[b]) if c else None for b, c in enumerate(constrained)]
