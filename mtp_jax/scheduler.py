"""Host side of decoding: continuous batching over B slots around the jitted step.

Requests wait in a queue and join when a slot frees (prefill writes them into the running state);
a request finishes at EOS or after max_new_tokens, and tokens emitted past its stop are dropped.
The host reads each step's results one step late: step n+1 is dispatched before the tokens of step
n are copied back, so the device never waits for host bookkeeping; except when step n may finish
every active row (by length), whose results are then read first so that no step runs past the end.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.cache import PrefixCache, ShardedPageAllocator, page_table_array
from mtp_jax.grammar import Constraints
from mtp_jax.request import CheckedRequest, row_sampling
from mtp_jax.sampling import RowSampling
from mtp_jax.sharding import row_shards, state_shardings
from mtp_jax.step import (
    StepConfig,
    deactivate,
    host_orchestrated_step,
    init_state,
    prefill,
    prefill_chunk,
    step,
)

TokenCallback = Callable[[int, int], None]
"""Called as ``on_token(prompt_index, token_id)`` for every emitted token, in order."""
VerifiedCallback = Callable[[np.ndarray, np.ndarray, np.ndarray], None]
"""Called as ``on_verified(confidence_logits [n, K], verified [n], accepted [n])`` after each step
(:class:`Scheduler`)."""


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the target's raw distribution at its position (the
    logits' log-softmax, before temperature, top-k/p, min-p or a grammar), and the request's
    ``logprobs`` most likely tokens there with theirs, most likely first: ``top`` ((id, logprob), ...).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass
class GenerateResult:
    """New tokens per prompt (EOS included when it stopped the row), why each row stopped
    ("eos", "length", "stop": a stop string or id, or "grammar": its grammar admits nothing
    more), run statistics, per prompt its speculation statistics (:class:`SpecCounters`), and
    with text prompts or stop strings each request's new text. ``logprobs``: per prompt that asked
    (``SamplingParams.logprobs``), one :class:`TokenLogprob` per new token (None for the others);
    ``prompt_logprobs``: per prompt that asked, one per prompt token (None for the first, which
    follows nothing). Each request's stats also hold its latencies (:meth:`Request.timings`)."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    stats: dict
    request_stats: list[dict] = dataclasses.field(default_factory=list)
    texts: list[str] | None = None
    logprobs: list[list[TokenLogprob] | None] | None = None
    prompt_logprobs: list[list[TokenLogprob | None] | None] | None = None


class SpecCounters:
    """Speculation counters of a request or of a whole run, named as serving engines export them:
    steps (verification steps), num_drafts (steps that verified at least one draft),
    num_draft_tokens, num_accepted_tokens and num_accepted_tokens_per_pos[j] (steps that accepted
    draft j, 0-based: with a token tree, a node of depth j + 1); steps_per_verified_drafts[n]: steps
    that verified n drafts (the lengths a confidence schedule chose, or the caps);
    expected_accepted_tokens: with a draft that estimates its confidence (in a single-process run),
    the accepted drafts its calibrated confidences expected (the sum over verified drafts of their
    running products: set against num_accepted_tokens, the calibration's check)."""

    def __init__(self, k: int) -> None:
        self.steps = self.emitted = self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.per_pos = np.zeros(k, np.int64)
        self.per_length = np.zeros(k + 1, np.int64)
        self.expected = 0.0

    def add(self, drafted: int, emitted: int, expected: float = 0.0) -> None:
        self.steps += 1
        self.expected += expected
        self.per_length[min(drafted, len(self.per_length) - 1)] += 1
        self.emitted += emitted
        self.num_drafts += drafted > 0
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += emitted - 1
        self.per_pos[: emitted - 1] += 1

    def as_dict(self) -> dict:
        steps = max(self.steps, 1)
        return {
            "steps": self.steps,
            "acceptance_length": self.emitted / steps,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": self.per_pos.tolist(),
            "steps_per_verified_drafts": self.per_length.tolist(),
            "acceptance_rate_per_position": [float(x) / steps for x in self.per_pos],
            "draft_acceptance_rate": self.num_accepted_tokens / max(self.num_draft_tokens, 1),
            "expected_accepted_tokens": self.expected,
        }


TIMINGS = ("time_to_first_token_seconds", "time_per_output_token_seconds")
"""The latencies :meth:`Request.timings` reports (seconds); a generate call's stats hold their means
(``mean_time_to_first_token_seconds``, ...)."""


def _mean(values: Iterable[float | None]) -> float | None:
    """The mean of the values that are not None (None if none is)."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def next_power_of_two(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def shortest_prompt_bucket(rows: int) -> int:
    """The shortest prompt bucket of a prefill of ``rows`` rows (a power of two): 16 tokens, so that
    few programs cover short prompts, down to 1 for prefills so wide that padding every row to 16
    costs more than a program (at most 4,096 padded tokens; 16,384 rows of 3-token prompts
    prefilled 2.9x faster)."""
    return max(1, min(16, 4096 // max(rows, 1)))


@dataclasses.dataclass(eq=False)
class Request:
    """One request in a :class:`Scheduler`: its prompt, how many new tokens at most, its sampling
    row (:class:`RowSampling` of one row), and where its tokens go: ``on_token(token)`` for each
    (returning True stops the request: finish reason "stop"), ``on_finish(request)`` at the end.
    The scheduler fills in ``tokens``, ``finish`` ("eos", "stop", "grammar", "length" or
    "cancelled") and ``counters``; with ``logprobs`` (how many alternatives, 0 to MAX_LOGPROBS)
    also ``token_logprobs``, each token's before ``on_token`` is called for it. ``cache_salt``
    separates cached prefixes (:class:`mtp_jax.cache.PrefixCache`): only requests with equal salts
    (and LoRA slots) share pages; whoever builds requests changes it when the weights that
    computed a prefix change (an adapter reloaded into the same slot). ``submitted_at``,
    ``first_token_at`` and ``finished_at`` (:func:`time.perf_counter` seconds) are filled in as the
    scheduler queues the request, hands it its first token and finishes it: :meth:`timings`."""

    prompt: list[int]
    max_new_tokens: int
    sampling: RowSampling
    on_token: Callable[[int], bool | None] | None = None
    on_finish: Callable[[Request], None] | None = None
    id: int = -1
    ignore_eos: bool = False
    tokens: list[int] = dataclasses.field(default_factory=list)
    finish: str = ""
    counters: SpecCounters | None = None
    logprobs: int | None = None
    token_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    cache_salt: bytes = b""
    submitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None

    @classmethod
    def from_checked(
        cls, checked: CheckedRequest, id: int, sampling: RowSampling | None = None, **fields: Any
    ) -> Request:
        """The scheduler's request for a checked one (:func:`mtp_jax.request.check_request`): the one
        construction ``generate``, the offline :func:`generate` and the serving engine share.
        ``sampling``: its row, when the caller built every row at once (default: its own);
        ``fields``: the rest (hooks, timestamps)."""
        params = checked.params
        return cls(
            checked.prompt,
            params.max_new_tokens,
            row_sampling([checked]) if sampling is None else sampling,
            id=id,
            ignore_eos=params.ignore_eos,
            logprobs=params.logprobs,
            cache_salt=b"" if params.cache_salt is None else b"salt:" + params.cache_salt.encode(),
            **fields,
        )

    def timings(self) -> dict:
        """Its latencies as serving engines report them, in seconds (None where not reached yet):
        ``time_to_first_token_seconds`` (queued to first token: waiting, prefill) and
        ``time_per_output_token_seconds`` (first token to the last, over the tokens after the
        first: decoding alone; None with fewer than two). Tokens are timed when the host reads
        them, a step after they were dispatched."""
        ttft = tpot = None
        if self.first_token_at is not None and self.submitted_at is not None:
            ttft = self.first_token_at - self.submitted_at
        if self.first_token_at is not None and self.finished_at is not None and len(self.tokens) > 1:
            tpot = (self.finished_at - self.first_token_at) / (len(self.tokens) - 1)
        return dict(zip(TIMINGS, (ttft, tpot), strict=True))


def _lora_slot(req: Request) -> int:
    """The LoRA adapter slot a request decodes with (0: none)."""
    return int(np.asarray(req.sampling.lora_slot)[0])


def pages_needed(prompt_len: int, max_new_tokens: int, sc: StepConfig) -> int:
    """Cache pages a request owns: its prompt, its new tokens and the speculative overshoot of the
    last steps (target rows up to K ahead, MTP rows up to 2K ahead, one step read late)."""
    return math.ceil((prompt_len + max_new_tokens + 2 * (sc.k + 1)) / sc.page_size)


@dataclasses.dataclass(eq=False)
class _Admission:
    """A request placed in a slot with its pages, not prefilled yet: positions before ``start`` are
    in the caches already (a cached prefix, chunks written so far)."""

    req: Request
    slot: int
    shard: int
    pages: list[int]
    start: int
    digests: list[bytes] = dataclasses.field(default_factory=list)  # its pages' names (prefix caching)


class Scheduler:
    """Continuous batching over ``slots`` rows of ``width`` cache pages each, around the jitted step.

    Requests are :meth:`submit`-ted at any time and join free slots between steps (prefill writes
    them into the running state); :meth:`advance` runs one iteration (admit, dispatch a step, read
    the previous one); :meth:`cancel` stops a request and frees its pages at once. The caches and
    the compiled programs live as long as the scheduler.

    Each request accepts at most its own ``sampling.num_speculative_tokens``; a step verifies as many drafts
    as
    its active rows ask for at most (one compiled step per distinct count; with none, a plain step
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
        if on_verified is not None and (not sc.confident or jax.process_count() > 1):
            raise ValueError("on_verified needs a draft with a confidence head, in one process")
        self.on_verified, self.reads_confidence = on_verified, sc.confident and jax.process_count() == 1
        if chunked_prefill is not None and (
            isinstance(chunked_prefill, bool) or not isinstance(chunked_prefill, int) or chunked_prefill < 16
        ):
            raise ValueError(f"chunked_prefill must be None or an integer >= 16, got {chunked_prefill!r}")
        self.chunk = chunked_prefill
        self.filling: collections.deque[_Admission] = collections.deque()  # prompts still arriving
        self.callback = constraints is not None and grammar_masks == "callback"
        # whose constraints the step's callback asks (made once: not a transfer per step)
        self.grammar_key = jnp.int32(constraints.key) if self.callback else None
        if self.callback and (not fused or jax.process_count() > 1):
            raise ValueError('grammar_masks="callback" runs in the fused step of a single-process run')
        if self.callback and sc.tree is not None:
            raise ValueError('the grammar masks of a token tree come from the host: grammar_masks="host"')
        self.shards = row_shards(sc.mesh)  # rows and their pages split over this many devices
        if slots % self.shards:
            raise ValueError(f"{slots} slots do not split over {self.shards} row devices")
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
        lookahead = 0 if sc.draft_method is None else sc.draft_method.cache_lookahead
        self.prefix = PrefixCache(self.allocator, sc.page_size, lookahead) if prefix_caching else None
        state = init_state(sc, slots, self.allocator.num_pages, width, cache_dtype)
        if sc.mesh is not None:
            state = jax.device_put(state, state_shardings(sc, state))
        self.state = state
        self.queue: collections.deque[Request] = collections.deque()
        self.owner: list[Request | None] = [None] * slots
        self.pages_of: dict[int, list[int]] = {}
        self.proposed = np.zeros(slots, np.int64)  # drafts standing for each slot (the state's num_drafts)
        self.pending = None
        self.counters = SpecCounters(self.depth)
        self.counts = {"steps": 0, "prefills": 0, "prefill_chunks": 0}
        self.first_step_seconds = 0.0
        self.first_admitted: float | None = None  # when the first admission's prefill returned
        self._next_id = 0

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
        need = pages_needed(len(req.prompt), req.max_new_tokens, self.sc)
        if need > self.width:
            room = self.width * self.sc.page_size - 2 * (self.sc.k + 1)
            raise ValueError(
                f"a prompt of {len(req.prompt)} tokens with max_new_tokens={req.max_new_tokens} needs "
                f"{len(req.prompt) + req.max_new_tokens} tokens of cache; a slot holds {room}"
            )
        if self.sc.greedy and bool(np.any(np.asarray(req.sampling.temperature) > 0)):
            raise ValueError(
                "this scheduler's programs are greedy-only (StepConfig.greedy): a request with "
                "temperature > 0 needs a scheduler without it"
            )
        if req.id < 0:
            req.id = self._next_id
        self._next_id = max(self._next_id, req.id + 1)
        req.counters = SpecCounters(self.depth)
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
            req.tokens.append(tok)
            if req.logprobs is not None and logprobs is not None:
                n = req.logprobs
                top = zip(logprobs.top_ids[i, :n].tolist(), logprobs.top[i, :n].tolist(), strict=True)
                req.token_logprobs.append(TokenLogprob(tok, float(logprobs.chosen[i]), tuple(top)))
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

    def _step_masks(self, k: int) -> np.ndarray | None:
        """The grammar masks of the next step's K+1 positions, from the drafts the last step left."""
        running = self._running()
        if not any(self._constrained(req) for req in running):
            return None
        drafts = np.asarray(self.state.drafts[:, :k])
        rows = [(req.id, b * (k + 1), drafts[b]) for b, req in enumerate(running) if self._constrained(req)]
        if k and self.sc.tree is not None:  # every node's, along its path
            return self.constraints.tree_masks(rows, self.sc.tree, (self.slots, k + 1))
        return self.constraints.masks(rows, (self.slots, k + 1))

    def _release(self, rows: list[int]) -> None:
        if not rows:
            return
        if self.filling:
            gone = set(rows)
            self.filling = collections.deque(a for a in self.filling if a.slot not in gone)
        for b in rows:
            pages = self.pages_of.pop(self.owner[b].id)
            (self.allocator if self.prefix is None else self.prefix).release(pages)
            self.owner[b] = None
        self._deactivate(rows)

    def _deactivate(self, rows: list[int]) -> None:
        # padded to a power of two with an out-of-range slot (ignored): a few programs at most
        padded = np.full(next_power_of_two(len(rows)), self.slots, np.int32)
        padded[: len(rows)] = rows
        self.state = deactivate(self.state, padded)

    def warmup_jobs(self, max_prompt_len: int, ks: Sequence[int]) -> list[tuple[str, int, int]]:
        """Every program requests without a grammar can make the scheduler run, smallest first:
        admissions ("prefill", rows per shard, prompt bucket) of 1, 2, 4 ... rows per shard with
        prompts padded to 16, 32 ... up to ``max_prompt_len`` tokens (from fewer than 16 for very
        wide admissions: :func:`shortest_prompt_bucket`); steps ("step", K, rows) for
        each K in ``ks`` over each row bucket; slot releases ("release", n, 0); with chunked prefill
        prompt buckets up to the chunk only, and the chunk's own program ("chunk", 1, chunk)."""
        per_shard = next_power_of_two(self.slots // self.shards)
        pers = [1 << i for i in range(per_shard.bit_length()) if 1 << i <= per_shard]
        chunked = self.chunk is not None and max_prompt_len > self.chunk
        if chunked:  # longer prompts arrive in chunks: their rest fits one
            max_prompt_len = self.chunk

        def buckets(per: int) -> list[int]:
            low = shortest_prompt_bucket(per * self.shards)
            top = next_power_of_two(max_prompt_len, minimum=low)
            return [low << i for i in range(top.bit_length()) if low << i <= top]

        powers = [1 << i for i in range(self.slots.bit_length() + 1)]
        rows = [r for r in powers if r < self.slots] if self.row_buckets else []
        releases = [r for r in powers if r <= next_power_of_two(self.slots)]
        ks = {self._variant(k).k for k in ks}  # the programs those K run (a token tree: whole or none)
        jobs = [("prefill", per, t) for per in pers for t in buckets(per)]
        jobs += [("step", k, r) for k in sorted(ks, reverse=True) for r in [*rows, self.slots]]
        jobs += [("release", n, 0) for n in releases]
        if chunked:
            jobs.append(("chunk", 1, self.chunk))
        return smallest_first(jobs)

    def warmup_job(self, kind: str, a: int, b: int) -> None:
        """Run one of :meth:`warmup_jobs`' programs on no request (padding rows and inactive
        slots: nothing changes), compiling it. Only while no request runs."""
        if self.pending is not None or any(o is not None for o in self.owner):
            raise ValueError("warm up before requests run (some are running now)")
        if kind == "prefill":  # host arrays, as _prefill passes them: the same compiled program
            r = a * self.shards
            first, self.state, _ = prefill(
                self.params,
                self.state,
                self.sc,
                np.full(r, self.slots, np.int32),
                np.zeros((r, b), np.int32),
                np.ones(r, np.int32),
                np.zeros((r, self.width), np.int32),
                jax.tree.map(np.asarray, RowSampling.build(r)),
                None,
                np.zeros(r, np.int32),
                np.zeros(r, bool),
            )
            np.asarray(first)
        elif kind == "step":
            extra = {"rows": b} if b < self.slots else {}
            sc = self._variant(a)
            emitted, n_emit, self.state, _ = self.step_fn(self.params, self.state, sc, None, **extra)
            np.asarray(n_emit)
        elif kind == "chunk":
            r, zeros = self.shards, jnp.asarray(np.zeros(self.shards, np.int32))
            self.state = prefill_chunk(
                self.params,
                self.state,
                self.sc,
                jnp.asarray(np.zeros((r, b), np.int32)),
                zeros,
                zeros,
                zeros,
                jnp.asarray(np.zeros((r, self.width), np.int32)),
                zeros,
            )
        elif kind == "release":
            self.state = deactivate(self.state, np.full(a, self.slots, np.int32))
        else:
            raise ValueError(f"unknown warm-up job {kind!r}")

    def warmup(
        self, max_prompt_len: int, ks: Sequence[int], progress: Callable[[int, int], None] | None = None
    ) -> int:
        """Compile every program of :meth:`warmup_jobs` now. Call it while no request runs.
        ``progress(done, total)`` after each; returns how many programs ran."""
        jobs = self.warmup_jobs(max_prompt_len, ks)
        for i, job in enumerate(jobs):
            self.warmup_job(*job)
            if progress is not None:
                progress(i + 1, len(jobs))
        return len(jobs)

    def _admit(self) -> None:
        # Prefill rows are split over the row shards like the state's slots, so each request is
        # prefilled on the devices that hold its slot and pages: shard s of the prefill batch
        # takes requests for free slots of shard s, filled evenly across shards.
        slots, shards = self.slots, self.shards
        free = [
            [b for b in range(s * slots // shards, (s + 1) * slots // shards) if self.owner[b] is None]
            for s in range(shards)
        ]
        ready: list[_Admission] = []
        while self.queue:
            s = max(range(shards), key=lambda s: (len(free[s]), -s))
            if not free[s]:
                break
            req, b = self.queue.popleft(), free[s].pop(0)
            need = pages_needed(len(req.prompt), req.max_new_tokens, self.sc)
            admission = _Admission(req, b, s, [], 0)
            if self.prefix is None:
                admission.pages = self.allocator.allocate(need, shard=s)
            else:
                admission.digests = self.prefix.digests(req.prompt, self._salt(req))
                admission.pages, hit = self.prefix.take(admission.digests, need, s)
                admission.start = hit * self.sc.page_size
            self.pages_of[req.id] = admission.pages
            self.owner[b] = req
            if self.chunk is not None and len(req.prompt) - admission.start > self.chunk:
                self.filling.append(admission)  # prefilled a chunk per iteration (:meth:`_fill`)
            else:
                ready.append(admission)
        if ready:
            self._prefill(ready)

    def _fill(self) -> bool:
        """Chunked prefill: the next chunk of the first request whose prompt is still arriving, or
        (its rest fitting one chunk) its admission. False when none is."""
        if not self.filling:
            return False
        a = self.filling[0]
        left = len(a.req.prompt) - a.start
        if left <= self.chunk:
            self.filling.popleft()
            self._prefill([a])
            return True
        r, i = self.shards, a.shard  # one row per shard, the request's on its own shard's
        tokens = np.zeros((r, self.chunk), np.int32)
        tokens[i] = a.req.prompt[a.start : a.start + self.chunk]
        counts, starts, after, lora = (np.zeros(r, np.int32) for _ in range(4))
        counts[i], starts[i], after[i] = self.chunk, a.start, a.req.prompt[a.start + self.chunk]
        lora[i] = _lora_slot(a.req)
        tables = [a.pages if j == i else [] for j in range(r)]
        self.state = prefill_chunk(
            self.params,
            self.state,
            self.sc,
            jnp.asarray(tokens),
            jnp.asarray(starts),
            jnp.asarray(counts),
            jnp.asarray(after),
            jnp.asarray(page_table_array(tables, self.width)),
            jnp.asarray(lora),
        )
        a.start += self.chunk
        self.counts["prefill_chunks"] += 1
        return True

    def _prefill(self, admissions: list[_Admission]) -> None:
        """Admit requests placed in their slots with their pages: prefill each prompt from its
        ``start`` (after a cached prefix or the chunks written so far) and emit its first token."""
        slots, shards = self.slots, self.shards
        per = next_power_of_two(max(sum(a.shard == s for a in admissions) for s in range(shards)))
        r = per * shards
        rows = np.full(r, slots, np.int32)  # padding rows: an out-of-range slot, ignored
        lengths = np.ones(r, np.int32)
        starts = np.zeros(r, np.int32)  # where each prompt's prefill begins
        thinking = np.zeros(r, bool)
        tables: list[list[int]] = [[] for _ in range(r)]
        reqs: list[tuple[int, Request]] = []
        row_sampling = [admissions[0].req.sampling] * r
        taken = [0] * shards
        for a in admissions:
            i = a.shard * per + taken[a.shard]
            taken[a.shard] += 1
            req, b = a.req, a.slot
            rows[i], lengths[i], starts[i] = b, len(req.prompt), a.start
            thinking[i] = self._thinking_before(req.prompt, a.start)
            tables[i] = a.pages
            row_sampling[i] = req.sampling
            reqs.append((i, req))
            self.proposed[b] = self.row_k(req)
        # prompt lengths (after their cached prefixes) padded to a power of two per admission (one
        # long prompt does not make every later prefill pay for its length); a few programs at most
        bucket = next_power_of_two(int(np.max(lengths - starts)), minimum=shortest_prompt_bucket(r))
        tokens = np.zeros((r, bucket), np.int32)
        for i, req in reqs:
            tokens[i, : lengths[i] - starts[i]] = req.prompt[starts[i] :]
        # host arrays straight into the jitted call (its C++ path moves them): a jnp.asarray each is an
        # eager dispatch of its own, about a tenth of a batch-1 admission's host time
        sampling = jax.tree.map(lambda *xs: np.concatenate(xs), *row_sampling)
        masks = None
        if any(self._constrained(req) for _, req in reqs):
            for _, req in reqs:
                if self._constrained(req):
                    self.constraints.start(req.id, req.prompt)
            masks = self.constraints.masks(
                [(req.id, i, ()) for i, req in reqs if self._constrained(req)], (r,)
            )
        wants = any(req.logprobs is not None for _, req in reqs)
        first, self.state, logprobs = prefill(
            self.params,
            self.state,
            dataclasses.replace(self.sc, logprobs=wants),
            rows,
            tokens,
            lengths,
            page_table_array(tables, self.width),
            sampling,
            masks,
            starts,
            thinking,
        )
        if self.prefix is not None:
            for a in admissions:  # later prefills may read what this one writes
                self.prefix.register(a.digests, a.pages)
        self.counts["prefills"] += 1
        first = np.asarray(first)
        lp = None if logprobs is None else jax.tree.map(np.asarray, logprobs)
        done = [
            int(rows[i])
            for i, req in reqs
            if self._emit(req, first[i : i + 1], _rows_of(lp, slice(i, i + 1)))
        ]
        self._release(done)

    def _salt(self, req: Request) -> bytes:
        """What separates a request's cached prefixes from others': its salt and its LoRA slot."""
        return req.cache_salt + b"lora:%d" % _lora_slot(req)

    def _thinking_before(self, prompt: list[int], start: int) -> bool:
        """Whether a thinking phase is open after ``prompt[:start]`` (the last marker decides)."""
        if self.sc.think_tokens is None:
            return False
        begin, end = self.sc.think_tokens
        for tok in reversed(prompt[:start]):
            if tok in (begin, end):
                return tok == begin
        return False

    def _process(self, emitted, n_emit, logprobs, owners: list[Request | None], drafted, conf=None) -> None:
        emitted, n_emit = np.asarray(emitted), np.asarray(n_emit)
        drafted = verified_drafts(drafted, emitted)
        lp, done = None if logprobs is None else jax.tree.map(np.asarray, logprobs), []
        expected = confidences(conf, drafted, n_emit, owners, self.on_verified)
        for b, req in enumerate(owners):
            if req is None or req.finish:
                continue
            k = int(n_emit[b])
            self.counters.add(int(drafted[b]), k, float(expected[b]))
            req.counters.add(int(drafted[b]), k, float(expected[b]))
            if self._emit(req, emitted[b, :k], _rows_of(lp, (b, slice(0, k)))):
                done.append(b)
        self._release(done)

    def _read_pending(self) -> None:
        pending, self.pending = self.pending, None
        self._process(*pending)

    def advance(self) -> bool:
        """One iteration: admit waiting requests into free slots, then dispatch a step (reading the
        previous one after it) or read the step in flight. False when there was nothing to do."""
        return self._advance()

    def _advance(self) -> bool:
        self._admit()
        filled = self._fill()
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
            masks = self._step_masks(sc_now.k)
        drafted = np.minimum(self.proposed, sc_now.k)
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
        # the verified drafts' confidences: copied before the step takes (donates) the state
        conf = jnp.copy(self.state.draft_conf[:, : sc_now.k]) if self.reads_confidence and sc_now.k else None
        t_call = time.perf_counter()
        args = (masks, grammar_rows) if self.callback else (masks,)
        emitted, n_emit, self.state, logprobs = self.step_fn(self.params, self.state, sc_now, *args, **extra)
        if not self.counts["steps"]:  # the call returns once compiled; the step itself runs on
            self.first_step_seconds = time.perf_counter() - t_call
        self.counts["steps"] += 1
        if self.pending is not None:
            self._read_pending()
        self.pending = (emitted, n_emit, logprobs, running, drafted, conf)
        return True


_JOB_SIZES = {
    "prefill": lambda a, b: a * b // 16,
    "chunk": lambda a, b: b // 16,
    "step": lambda a, b: b,
    "release": lambda a, b: a,
}


def smallest_first(jobs: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Warm-up jobs (:meth:`Scheduler.warmup_jobs`) by the work each program does, smallest first."""
    kinds = list(_JOB_SIZES)
    return sorted(jobs, key=lambda j: (_JOB_SIZES[j[0]](j[1], j[2]), kinds.index(j[0])))


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


def generate(
    params: dict,
    sc: StepConfig,
    *,
    checked: Sequence[CheckedRequest],
    eos_token_ids: Sequence[int],
    cache_dtype: jnp.dtype,
    max_batch: int = 32,
    on_token: TokenCallback | None = None,
    fused: bool = True,
    per_batch: Callable[[int, StepConfig], StepConfig] | None = None,
    constraints: Constraints | None = None,
    pipelined: bool = True,
    grammar_masks: str = "host",
    stop_checks: Sequence[Callable[[int], bool]] | None = None,
    on_verified: VerifiedCallback | None = None,
) -> GenerateResult:
    """Decode checked requests (:func:`mtp_jax.request.check_request`) to the end with a
    :class:`Scheduler` sized for them (up to K = sc.k drafts per step, 0 = plain): ``max_batch``
    slots at most (a power of two, a multiple of the mesh's row devices), pages for the longest
    request. ``per_batch(batch, sc)`` adjusts the step to the batch size (slots a step computes):
    :func:`mtp_jax.autok.batch_controls`. ``stop_checks[i](token)`` True stops request i (finish
    reason "stop"). The other arguments are the scheduler's."""
    t_start = time.perf_counter()
    n = len(checked)
    batch = math.lcm(next_power_of_two(min(n, max_batch)), row_shards(sc.mesh))  # whole rows per shard
    host_sampling = jax.tree.map(np.asarray, row_sampling(checked))
    if per_batch is not None and sc.k > 0:
        sc = per_batch(batch, sc)
    if sc.k == 0 or not np.minimum(host_sampling.num_speculative_tokens, sc.k).any():
        sc = sc.variant(0, draft=None, tree=None)  # plain decoding: no draft state at all
    if not np.any(host_sampling.temperature > 0):  # every row greedy: smaller programs, same tokens
        sc = dataclasses.replace(sc, greedy=True)
    width = next_power_of_two(max(pages_needed(len(c.prompt), c.params.max_new_tokens, sc) for c in checked))
    sched = Scheduler(
        params,
        sc,
        slots=batch,
        width=width,
        eos_token_ids=eos_token_ids,
        cache_dtype=cache_dtype,
        fused=fused,
        constraints=constraints,
        pipelined=pipelined,
        grammar_masks=grammar_masks,
        on_verified=on_verified if sc.confident else None,  # none: plain decoding, no drafts
    )
    requests = []
    for i, c in enumerate(checked):
        row = jax.tree.map(lambda x, i=i: x[i : i + 1], host_sampling)
        hook = _token_hook(i, on_token, None if stop_checks is None else stop_checks[i])
        requests.append(sched.submit(Request.from_checked(c, i, row, on_token=hook)))
    while sched.advance():
        pass
    t_end = time.perf_counter()
    out = [req.tokens for req in requests]
    timings = [req.timings() for req in requests]
    stats = _run_stats(sched, sc, checked, timings, sum(len(o) for o in out), (t_start, t_end), batch, fused)
    if constraints is not None:  # host time spent in the grammars (masks, advancing the matchers)
        stats["grammar_seconds"] = constraints.seconds
    return GenerateResult(
        tokens=out,
        finish_reasons=[req.finish for req in requests],
        stats=stats,
        request_stats=[{**req.counters.as_dict(), **t} for req, t in zip(requests, timings, strict=True)],
        logprobs=None
        if all(req.logprobs is None for req in requests)
        else [None if req.logprobs is None else req.token_logprobs for req in requests],
    )


def _run_stats(
    sched: Scheduler,
    sc: StepConfig,
    checked: Sequence[CheckedRequest],
    timings: list[dict],
    new_tokens: int,
    span: tuple[float, float],
    batch: int,
    fused: bool,
) -> dict:
    """A :func:`generate` call's statistics: sizes, programs, speculation counters and times, from
    the call's start (``span[0]``) to the first admission and decoding from there to ``span[1]``."""
    t_start, t_end = span
    t_first = sched.first_admitted or t_end
    decode_time = t_end - t_first
    run, spec = sched.counters, sched.counters.as_dict()
    first_step = sched.first_step_seconds
    return {
        "prompts": len(checked),
        "batch": batch,
        "num_speculative_tokens": sc.k,
        "fused": fused,
        "draft": sc.draft,
        "prompt_tokens": sum(len(c.prompt) for c in checked),
        "new_tokens": new_tokens,
        "steps": sched.counts["steps"],
        "step_programs": len(sched.programs),
        "step_num_speculative_tokens": sorted({k for k, _ in sched.variants}),
        "prefill_calls": sched.counts["prefills"],
        "acceptance_length": spec.pop("acceptance_length"),
        "first_prefill_seconds": t_first - t_start,
        "decode_seconds": decode_time,
        "tokens_per_second": new_tokens / max(t_end - t_start, 1e-9),
        "decode_tokens_per_second": run.emitted / max(decode_time, 1e-9),
        # the first step call's wall time: its compilation when the step is not compiled yet
        "first_step_call_seconds": first_step,
        "decode_tokens_per_second_after_first_call": run.emitted / max(decode_time - first_step, 1e-9),
        **{f"mean_{key}": _mean(t[key] for t in timings) for key in TIMINGS},
        **{k: v for k, v in spec.items() if k != "steps"},
    }


def _rows_of(logprobs, index):
    """The host TokenLogprobs ``logprobs`` (or None) at ``index`` of their leading axes."""
    return None if logprobs is None else jax.tree.map(lambda x: x[index], logprobs)


def _token_hook(i: int, on_token: TokenCallback | None, stop: Callable[[int], bool] | None):
    """Request i's token hook: the caller's streaming callback, then its stop check."""
    if on_token is None and stop is None:
        return None

    def hook(token: int) -> bool:
        if on_token is not None:
            on_token(i, token)
        return stop is not None and stop(token)

    return hook
