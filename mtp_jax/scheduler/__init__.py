"""Host side of decoding: continuous batching over B slots around the jitted step.

Requests wait in a queue and join when a slot frees (prefill writes them into the running state);
a request finishes at EOS or after max_new_tokens, and tokens emitted past its stop are dropped.
The host reads each step's results one step late: step n+1 is dispatched before the tokens of step
n are copied back, so the device never waits for host bookkeeping; except when step n may finish
every active row (by length), whose results are then read first so that no step runs past the end.


The package, one module per idea: :mod:`.requests` (a request, its counters and log-probabilities,
what :func:`generate` returns), :mod:`.core` (the :class:`Scheduler`: slots, steps, reading results),
:mod:`.admission` (waiting requests into slots: pages, prefix cache, prefill, chunks), :mod:`.programs`
(the padded shapes that bound how many programs compile, and the warm-up) and :mod:`.generate`
(offline decoding of requests known up front).
"""

from mtp_jax.scheduler.core import Scheduler, confidences, occupancy, verified_drafts
from mtp_jax.scheduler.generate import generate
from mtp_jax.scheduler.programs import next_power_of_two, shortest_prompt_bucket, smallest_first
from mtp_jax.scheduler.requests import (
    TIMINGS,
    GenerateResult,
    Request,
    SpecCounters,
    TokenCallback,
    TokenLogprob,
    VerifiedCallback,
    pages_needed,
)

__all__ = [
    "TIMINGS",
    "GenerateResult",
    "Request",
    "Scheduler",
    "SpecCounters",
    "TokenCallback",
    "TokenLogprob",
    "VerifiedCallback",
    "confidences",
    "generate",
    "next_power_of_two",
    "occupancy",
    "pages_needed",
    "shortest_prompt_bucket",
    "smallest_first",
    "verified_drafts",
]
