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
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax import grammar
from mtp_jax.cache import ShardedPageAllocator, page_table_array
from mtp_jax.grammar import Constraints
from mtp_jax.sampling import SamplingParams
from mtp_jax.sharding import row_shards, state_shardings
from mtp_jax.step import StepConfig, deactivate, host_orchestrated_step, init_state, prefill, step

TokenCallback = Callable[[int, int], None]
"""Called as ``on_token(prompt_index, token_id)`` for every emitted token, in order."""


@dataclasses.dataclass
class GenerateResult:
    """New tokens per prompt (EOS included when it stopped the row), why each row stopped
    ("eos", "length", or "grammar": its grammar admits nothing more), run statistics, and per
    prompt its speculation statistics (:class:`SpecCounters`)."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    stats: dict
    request_stats: list[dict] = dataclasses.field(default_factory=list)


class SpecCounters:
    """Speculation counters of a request or of a whole run, named as serving engines export them:
    steps (verification steps), num_drafts (steps that verified at least one draft),
    num_draft_tokens, num_accepted_tokens and num_accepted_tokens_per_pos[j] (steps that accepted
    draft j, 0-based)."""

    def __init__(self, k: int) -> None:
        self.steps = self.emitted = self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.per_pos = np.zeros(k, np.int64)

    def add(self, drafted: int, emitted: int) -> None:
        self.steps += 1
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
            "acceptance_rate_per_position": [float(x) / steps for x in self.per_pos],
            "draft_acceptance_rate": self.num_accepted_tokens / max(self.num_draft_tokens, 1),
        }


def next_power_of_two(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def generate(
    params: dict,
    sc: StepConfig,
    *,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingParams,
    eos_token_ids: Sequence[int],
    cache_dtype: jnp.dtype,
    max_batch: int = 32,
    on_token: TokenCallback | None = None,
    fused: bool = True,
    auto_k: Callable[[int], int] | None = None,
    constraints: Constraints | None = None,
    pipelined: bool = True,
    grammar_masks: str = "host",
) -> GenerateResult:
    """Decode validated prompts with continuous batching (up to K = sc.k drafts per step, 0 = plain).

    Each request accepts at most its own ``sampling.max_drafts``; a step verifies as many drafts as
    its active rows ask for at most (one compiled step per distinct count; with none, a plain step
    that leaves the draft's state alone: a row only ever reads its own draft state, and a row that
    speculates runs only steps that do). ``auto_k(batch)`` caps K for the batch size (the slots a
    step computes, whatever their state), e.g. from a table measured by ``mtp-jax bench``.
    ``constraints`` holds the requests' grammars (:mod:`mtp_jax.grammar`): while a constrained
    request runs, each step's results are read before the next is dispatched (its masks follow the
    drafts that step proposed), and a request stops when its grammar admits nothing more; with
    ``grammar_masks="callback"`` the step asks the host for its masks itself (an ordered
    io_callback) and the engine keeps dispatching one step ahead (one process only).
    ``fused=False`` runs the host-orchestrated baseline step instead, and ``pipelined=False`` reads
    every step's results before dispatching the next (benchmarks only: the cost of a host round trip
    per step, which is what a grammar pays)."""
    step_fn = step if fused else host_orchestrated_step
    callback = constraints is not None and grammar_masks == "callback"
    if callback and (not fused or jax.process_count() > 1):
        raise ValueError('grammar_masks="callback" runs in the fused step of a single-process run')
    t_start = time.perf_counter()
    n = len(prompts)
    batch = next_power_of_two(min(n, max_batch))
    shards = row_shards(sc.mesh)  # rows and their pages split over this many devices
    batch = math.lcm(batch, shards)  # whole rows per shard (padding slots stay inactive)
    host_sampling = jax.tree.map(np.asarray, sampling)
    if auto_k is not None and sc.k > 0:
        sc = dataclasses.replace(sc, k=min(sc.k, auto_k(batch)))
    row_k = np.minimum(host_sampling.max_drafts, sc.k)  # each request's own K
    if sc.k == 0 or not row_k.any():
        sc = dataclasses.replace(sc, k=0, draft=None)  # plain decoding: no draft state at all
    variants: dict[int, StepConfig] = {}  # the steps run: one program each

    def variant(k: int) -> StepConfig:
        if k not in variants:
            variants[k] = dataclasses.replace(sc, k=k, draft_idle=k == 0 and sc.draft is not None)
        return variants[k]

    page = sc.page_size
    # a request owns pages for its prompt, its new tokens and the speculative overshoot of the
    # last steps (target rows up to K ahead, MTP rows up to 2K ahead, one step read late)
    need = [math.ceil((len(p) + max_new_tokens + 2 * (sc.k + 1)) / page) for p in prompts]
    width = next_power_of_two(max(need))
    allocator = ShardedPageAllocator(batch * width, shards)  # slot b's pages live on its row shard
    state = init_state(sc, batch, allocator.num_pages, width, cache_dtype)
    if sc.mesh is not None:
        state = jax.device_put(state, state_shardings(sc, state))

    queue = collections.deque(range(n))
    owner: list[int | None] = [None] * batch
    pages_of: dict[int, list[int]] = {}
    out: list[list[int]] = [[] for _ in range(n)]
    finish = [""] * n
    counts = {"steps": 0, "prefills": 0}
    run = SpecCounters(sc.k)
    per_request = [SpecCounters(sc.k) for _ in range(n)]
    proposed = np.zeros(batch, np.int64)  # drafts standing for each slot (as the state's num_drafts)

    def emit(req: int, tokens: np.ndarray) -> bool:
        for tok in tokens.tolist():
            out[req].append(tok)
            if on_token is not None:
                on_token(req, tok)
            ended = constrained(req) and constraints.consume(req, tok)
            if tok in eos:
                finish[req] = "eos"
            elif ended:
                finish[req] = "grammar"
            elif len(out[req]) >= max_new_tokens:
                finish[req] = "length"
            if finish[req]:
                if constrained(req):
                    constraints.finish(req)
                return True
        return False

    def constrained(req: int | None) -> bool:
        return constraints is not None and req is not None and constraints.constrained(req)

    def step_masks(k: int) -> np.ndarray | None:
        """The grammar masks of the next step's K+1 positions, from the drafts the last step left."""
        if not any(constrained(req) for req in owner):
            return None
        drafts = np.asarray(state.drafts[:, :k])
        rows = [(req, b * (k + 1), drafts[b]) for b, req in enumerate(owner) if constrained(req)]
        return constraints.masks(rows, (batch, k + 1))

    def release(rows: list[int]) -> None:
        nonlocal state
        for b in rows:
            allocator.release(pages_of.pop(owner[b]))
            owner[b] = None
        state = deactivate(state, jnp.asarray(rows, jnp.int32))

    def admit() -> None:
        nonlocal state
        # Prefill rows are split over the row shards like the state's slots, so each request is
        # prefilled on the devices that hold its slot and pages: shard s of the prefill batch
        # takes requests for free slots of shard s, filled evenly across shards.
        free = [
            [b for b in range(s * batch // shards, (s + 1) * batch // shards) if owner[b] is None]
            for s in range(shards)
        ]
        placed: list[list[tuple[int, int]]] = [[] for _ in range(shards)]
        while queue:
            s = max(range(shards), key=lambda s: (len(free[s]), -s))
            if not free[s]:
                break
            placed[s].append((queue.popleft(), free[s].pop(0)))
        per = max(len(p) for p in placed)
        if not per:
            return
        per = next_power_of_two(per)
        r = per * shards
        rows = np.full(r, batch, np.int32)  # padding rows: an out-of-range slot, ignored
        # prompt lengths padded to a power of two per admission (one long prompt does not make
        # every later prefill pay for its length); a few prefill programs at most
        bucket = next_power_of_two(max(len(prompts[req]) for group in placed for req, _ in group), minimum=16)
        tokens = np.zeros((r, bucket), np.int32)
        lengths = np.ones(r, np.int32)
        tables: list[list[int]] = [[] for _ in range(r)]
        reqs = []
        pick = np.zeros(r, np.int64)
        for s, group in enumerate(placed):
            for j, (req, b) in enumerate(group):
                i = s * per + j
                pages_of[req] = allocator.allocate(need[req], shard=s)
                owner[b] = req
                rows[i], lengths[i] = b, len(prompts[req])
                tokens[i, : lengths[i]] = prompts[req]
                tables[i] = pages_of[req]
                pick[i] = req
                reqs.append((i, req))
                proposed[b] = row_k[req]
        rows_sampling = jax.tree.map(lambda x: jnp.asarray(x[pick]), host_sampling)
        masks = None
        if any(constrained(req) for _, req in reqs):
            for _, req in reqs:
                if constrained(req):
                    constraints.start(req, prompts[req])
            masks = constraints.masks([(req, i, ()) for i, req in reqs if constrained(req)], (r,))
        first, state = prefill(
            params,
            state,
            sc,
            jnp.asarray(rows),
            tokens,
            jnp.asarray(lengths),
            jnp.asarray(page_table_array(tables, width)),
            rows_sampling,
            masks,
        )
        counts["prefills"] += 1
        first = np.asarray(first)
        done = [int(rows[i]) for i, req in reqs if emit(req, first[i : i + 1])]
        if done:
            release(done)

    def process(emitted: jax.Array, n_emit: jax.Array, owners: list[int | None], drafted: np.ndarray) -> None:
        emitted, n_emit = np.asarray(emitted), np.asarray(n_emit)
        done = []
        for b, req in enumerate(owners):
            if req is None or finish[req]:
                continue
            k = int(n_emit[b])
            run.add(int(drafted[b]), k)
            per_request[req].add(int(drafted[b]), k)
            if emit(req, emitted[b, :k]):
                done.append(b)
        if done:
            release(done)

    eos = frozenset(eos_token_ids)
    pending = None
    t_first = None
    first_step = 0.0
    grammar.serving(constraints if callback else None)
    try:
        while True:
            admit()
            if t_first is None:
                t_first = time.perf_counter()
            if not any(o is not None for o in owner):
                if pending is not None:
                    process(*pending)
                    pending = None
                    continue
                if not queue:
                    break
                continue
            if pending is not None and all(
                len(out[req]) + sc.k + 1 >= max_new_tokens for req in owner if req is not None
            ):
                # the step in flight may finish every active row: read it before dispatching another,
                # which would otherwise run for rows that are already done (a whole wasted step at batch 1)
                process(*pending)
                pending = None
                continue
            if pending is not None and (not pipelined or (not callback and any(map(constrained, owner)))):
                # a grammar's masks follow the drafts of the step in flight: read it first
                process(*pending)
                pending = None
                continue
            sc_now = variant(int(max(row_k[req] for req in owner if req is not None)))
            masks, grammar_rows = None, None
            if callback:
                grammar_rows = jnp.asarray([req if constrained(req) else -1 for req in owner], jnp.int32)
            else:
                masks = step_masks(sc_now.k)
            drafted = np.minimum(proposed, sc_now.k)
            live = np.array([o is not None for o in owner])
            proposed[live] = np.minimum(row_k[[o for o in owner if o is not None]], sc_now.k)
            t_call = time.perf_counter()
            emitted, n_emit, state = (
                step_fn(params, state, sc_now, masks, grammar_rows)
                if callback
                else step_fn(params, state, sc_now, masks)
            )
            if not counts["steps"]:  # the call returns once compiled; the step itself runs on
                first_step = time.perf_counter() - t_call
            counts["steps"] += 1
            if pending is not None:
                process(*pending)
            pending = (emitted, n_emit, list(owner), drafted)
    finally:
        grammar.serving(None)
    t_end = time.perf_counter()

    new_tokens = sum(len(o) for o in out)
    decode_time = t_end - t_first
    spec = run.as_dict()
    stats = {
        "prompts": n,
        "batch": batch,
        "num_speculative_tokens": sc.k,
        "fused": fused,
        "draft": sc.draft,
        "prompt_tokens": sum(len(p) for p in prompts),
        "new_tokens": new_tokens,
        "steps": counts["steps"],
        "step_programs": len(variants),
        "step_num_speculative_tokens": sorted(variants),
        "prefill_calls": counts["prefills"],
        "acceptance_length": spec.pop("acceptance_length"),
        "first_prefill_seconds": t_first - t_start,
        "decode_seconds": decode_time,
        "tokens_per_second": new_tokens / max(t_end - t_start, 1e-9),
        "decode_tokens_per_second": run.emitted / max(decode_time, 1e-9),
        # the first step call's wall time: its compilation when the step is not compiled yet
        "first_step_call_seconds": first_step,
        "decode_tokens_per_second_after_first_call": run.emitted / max(decode_time - first_step, 1e-9),
        **{k: v for k, v in spec.items() if k != "steps"},
    }
    if constraints is not None:  # host time spent in the grammars (masks, advancing the matchers)
        stats["grammar_seconds"] = constraints.seconds
    return GenerateResult(
        tokens=out, finish_reasons=finish, stats=stats, request_stats=[c.as_dict() for c in per_request]
    )
