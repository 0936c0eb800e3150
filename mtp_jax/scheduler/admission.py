"""How waiting requests enter a scheduler's slots: each takes a free slot on the row shard with the
most room and its cache pages (after the longest cached prefix, with prefix caching), then one
prefill per iteration writes every admitted prompt into the running state and emits its first token;
a prompt longer than the chunk arrives a chunk per iteration instead (chunked prefill)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.cache import page_table_array
from mtp_jax.scheduler.programs import next_power_of_two, shortest_prompt_bucket
from mtp_jax.scheduler.requests import Request, logprob_rows, lora_slot, pages_needed
from mtp_jax.step import StepConfig, prefill, prefill_chunk

if TYPE_CHECKING:
    from mtp_jax.scheduler.core import Scheduler


@dataclasses.dataclass(eq=False)
class Admission:
    """A request placed in a slot with its pages, not prefilled yet: positions before ``start`` are
    in the caches already (a cached prefix, chunks written so far). With a ring cache
    (``sc.local_ring``) and a cached prefix, ``start`` is a window before the prefix's end,
    ``fresh``: the positions from ``start`` to it are computed again for the sliding-window layers'
    ring only (:func:`ring_restart`)."""

    req: Request
    slot: int
    shard: int
    pages: list[int]
    start: int
    digests: list[bytes] = dataclasses.field(default_factory=list)  # its pages' names (prefix caching)
    fresh: int = 0


def ring_restart(sc: StepConfig, fresh: int) -> int:
    """Where the prefill of a prompt whose first ``fresh`` positions are a cached prefix begins
    with a ring cache: at the page holding position ``fresh - window + 1``, the oldest key the
    first new token's window reads (the prefix's pages hold every layer but the rings, which the
    slot's last request filled)."""
    window = sc.target.sliding_window(sc.cfg)
    return max(0, (fresh - window + 1) // sc.page_size * sc.page_size)


def check_fits(req: Request, sc: StepConfig, width: int) -> None:
    """Refuse a request a scheduler of step ``sc`` and ``width`` pages per slot cannot run: its
    prompt and new tokens past a slot's cache, or sampling in greedy-only programs."""
    if pages_needed(len(req.prompt), req.max_new_tokens, sc) > width:
        room = width * sc.page_size - 2 * (sc.overshoot + 1)
        raise ValueError(
            f"a prompt of {len(req.prompt)} tokens with max_new_tokens={req.max_new_tokens} needs "
            f"{len(req.prompt) + req.max_new_tokens} tokens of cache; a slot holds {room}"
        )
    if sc.greedy and bool(np.any(np.asarray(req.sampling.temperature) > 0)):
        raise ValueError(
            "this scheduler's programs are greedy-only (StepConfig.greedy): a request with "
            "temperature > 0 needs a scheduler without it"
        )


class Admissions:
    """The admission half of a :class:`~mtp_jax.scheduler.Scheduler` (its queue, slots, pages and
    state are the scheduler's): :meth:`admit` places waiting requests and prefills those whose
    prompts fit one prefill, :meth:`fill` moves a long prompt on by a chunk."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.tenants: dict[bytes, int] = {}  # salt (cache salt and adapter) -> the rows' tenant number
        method, sc = scheduler.sc.draft_method, scheduler.sc
        learns = method is not None and method.learner is not None and sc.k > 0
        self.learner = method.learner(sc.draft_cfg) if learns else None
        if self.learner is not None and hasattr(self.learner, "seeds"):  # outputs it starts from
            for prompt, output, salt in self.learner.seeds():
                self.learner.finished(prompt, output, self.tenants.setdefault(salt, len(self.tenants)))

    def admit(self) -> None:
        """Place waiting requests in free slots with their pages; prefill those whose prompts need
        no chunks (one prefill for all), queue the others for :meth:`fill`. With prefix caching, a
        request whose prompt shares pages with one admitted before it in the same call waits for
        the next (in order: those behind it wait too), when this prefill has named them: a burst of
        requests on one prompt (samples of one prompt, a shared system prompt) computes it once."""
        sched = self.scheduler
        if self.learner is not None:  # what finished requests taught the draft, before the next step
            sched.state = dataclasses.replace(
                sched.state, draft_state=self.learner.apply(sched.state.draft_state)
            )
        # Prefill rows are split over the row shards like the state's slots, so each request is
        # prefilled on the devices that hold its slot and pages: shard s of the prefill batch
        # takes requests for free slots of shard s, filled evenly across shards.
        slots, shards = sched.slots, sched.shards
        free = [
            [b for b in range(s * slots // shards, (s + 1) * slots // shards) if sched.owner[b] is None]
            for s in range(shards)
        ]
        ready: list[Admission] = []
        naming: set[tuple[int, bytes]] = set()  # the pages this admission's prefill will name
        while sched.queue:
            s = max(range(shards), key=lambda s: (len(free[s]), -s))
            if not free[s]:
                break
            req = sched.queue[0]
            digests = [] if sched.prefix is None else sched.prefix.digests(req.prompt, salt(req))
            if naming and sched.prefix.longest(digests, s, naming) > sched.prefix.longest(digests, s):
                break  # it shares pages this prefill writes: admitted next iteration, it reads them
            sched.queue.popleft()
            b = free[s].pop(0)
            need = pages_needed(len(req.prompt), req.max_new_tokens, sched.sc)
            admission = Admission(req, b, s, [], 0, digests)
            if sched.prefix is None:
                admission.pages = sched.allocator.allocate(need, shard=s)
            else:
                admission.pages, hit = sched.prefix.take(digests, need, s)
                admission.start = admission.fresh = hit * sched.sc.page_size
                if hit and sched.sc.local_ring:
                    admission.start = ring_restart(sched.sc, admission.fresh)
            sched.pages_of[req.id] = admission.pages
            sched.owner[b] = req
            if sched.chunk is not None and len(req.prompt) - admission.start > sched.chunk:
                sched.filling.append(admission)  # prefilled a chunk per iteration (:meth:`fill`)
            else:
                ready.append(admission)
                naming.update((s, d) for d in digests)
        if ready:
            self.prefill(ready)

    def release(self, req: Request, pages: list[int]) -> None:
        """Give a finished (or cancelled) request's pages back. With prefix caching, first name the
        full pages of its prompt and of the tokens it was handed: their caches are complete (a
        position's entries are written by the step that verified the token after it), so a later
        prompt that continues this text, the next turn of a chat, prefills only what follows. A
        request whose prompt never finished arriving (no token yet) names nothing."""
        sched = self.scheduler
        if self.learner is not None and req.tokens and sched.row_k(req):
            self.learner.finished(req.prompt, req.tokens, self.tenant(req))  # written at the next admit
        prefix = sched.prefix
        if prefix is None:
            sched.allocator.release(pages)
            return
        if req.tokens:
            prefix.register(prefix.digests(req.prompt + req.tokens, salt(req)), pages)
        prefix.release(pages)

    def tenant(self, req: Request) -> int:
        """The number of ``req``'s tenant (its cache salt and adapter; :func:`salt`), in order of
        first admission: rows of different tenants never share what a draft learns."""
        return self.tenants.setdefault(salt(req), len(self.tenants))

    def fill(self) -> bool:
        """Chunked prefill: the next chunk of the first request whose prompt is still arriving, or
        (its rest fitting one chunk) its admission. False when none is."""
        sched = self.scheduler
        if not sched.filling:
            return False
        a = sched.filling[0]
        left = len(a.req.prompt) - a.start
        if left <= sched.chunk:
            sched.filling.popleft()
            self.prefill([a])
            return True
        r, i = sched.shards, a.shard  # one row per shard, the request's on its own shard's
        tokens = np.zeros((r, sched.chunk), np.int32)
        tokens[i] = a.req.prompt[a.start : a.start + sched.chunk]
        counts, starts, after, lora, slots, fresh = (np.zeros(r, np.int32) for _ in range(6))
        counts[i], starts[i], after[i] = sched.chunk, a.start, a.req.prompt[a.start + sched.chunk]
        lora[i], slots[i], fresh[i] = lora_slot(a.req), a.slot, a.fresh
        tables = [a.pages if j == i else [] for j in range(r)]
        sched.state = prefill_chunk(
            sched.params,
            sched.state,
            sched.sc,
            jnp.asarray(tokens),
            jnp.asarray(starts),
            jnp.asarray(counts),
            jnp.asarray(after),
            jnp.asarray(page_table_array(tables, sched.width)),
            jnp.asarray(lora),
            jnp.asarray(slots),
            **({"fresh": jnp.asarray(fresh)} if sched.sc.local_ring else {}),  # else the warm-up's program
        )
        a.start += sched.chunk
        sched.counts["prefill_chunks"] += 1
        return True

    def prefill(self, admissions: list[Admission]) -> None:
        """Admit requests placed in their slots with their pages: prefill each prompt from its
        ``start`` (after a cached prefix or the chunks written so far) and emit its first token."""
        sched = self.scheduler
        slots, shards = sched.slots, sched.shards
        per = next_power_of_two(max(sum(a.shard == s for a in admissions) for s in range(shards)))
        r = per * shards
        rows = np.full(r, slots, np.int32)  # padding rows: an out-of-range slot, ignored
        lengths = np.ones(r, np.int32)
        starts = np.zeros(r, np.int32)  # where each prompt's prefill begins
        fresh = np.zeros(r, np.int32)  # past its cached prefix (a ring cache recomputes before it)
        thinking = np.zeros(r, bool)
        tables: list[list[int]] = [[] for _ in range(r)]
        reqs: list[tuple[int, Request]] = []
        row_sampling = [admissions[0].req.sampling] * r
        taken = [0] * shards
        for a in admissions:
            i = a.shard * per + taken[a.shard]
            taken[a.shard] += 1
            req, b = a.req, a.slot
            rows[i], lengths[i], starts[i], fresh[i] = b, len(req.prompt), a.start, a.fresh
            thinking[i] = thinking_before(sched.sc.think_tokens, req.prompt, a.start)
            tables[i] = a.pages
            row_sampling[i] = dataclasses.replace(req.sampling, tenant=np.full(1, self.tenant(req), np.int32))
            reqs.append((i, req))
            sched.proposed[b] = sched.row_k(req)
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
        if any(sched._constrained(req) for _, req in reqs):
            for _, req in reqs:
                if sched._constrained(req):
                    sched.constraints.start(req.id, req.prompt)
            masks = sched.constraints.masks(
                [(req.id, i, ()) for i, req in reqs if sched._constrained(req)], (r,)
            )
        wants = any(req.logprobs is not None for _, req in reqs)
        first, sched.state, logprobs = prefill(
            sched.params,
            sched.state,
            dataclasses.replace(sched.sc, logprobs=wants),
            rows,
            tokens,
            lengths,
            page_table_array(tables, sched.width),
            sampling,
            masks,
            starts,
            thinking,
            **({"fresh": fresh} if sched.sc.local_ring else {}),  # else the warm-up's program
        )
        if sched.prefix is not None:
            for a in admissions:  # later prefills may read what this one writes
                sched.prefix.register(a.digests, a.pages)
        sched.counts["prefills"] += 1
        first = np.asarray(first)
        lp = None if logprobs is None else jax.tree.map(np.asarray, logprobs)
        done = [
            int(rows[i])
            for i, req in reqs
            if sched._emit(req, first[i : i + 1], logprob_rows(lp, slice(i, i + 1)))
        ]
        sched._release(done)


def salt(req: Request) -> bytes:
    """What separates a request's cached prefixes from others': its salt and its LoRA slot."""
    return req.cache_salt + b"lora:%d" % lora_slot(req)


def thinking_before(think_tokens: tuple[int, int] | None, prompt: list[int], start: int) -> bool:
    """Whether a thinking phase (between the ``think_tokens`` markers) is open after
    ``prompt[:start]`` (the last marker decides)."""
    if think_tokens is None:
        return False
    begin, end = think_tokens
    for tok in reversed(prompt[:start]):
        if tok in (begin, end):
            return tok == begin
    return False
