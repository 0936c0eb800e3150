"""A persistent engine: caches allocated once, requests submitted at any time from any thread.

    engine = mtp_jax.Engine(model, slots=8, max_len=2048, draft="mtp", num_speculative_tokens=3)
    handle = engine.submit([0, 17, 42], max_new_tokens=64, temperature=0.7, seed=1)
    # or: engine.submit(prompt, mtp_jax.SamplingParams(max_new_tokens=64, temperature=0.7))
    for token in handle:            # or: async for token in handle (inside an event loop)
        ...
    handle.result()                 # Completion(tokens, finish_reason, stats)
    handle.cancel()                 # stop it now: its slot and pages are freed
    engine.close()

One background thread owns the :class:`~mtp_jax.scheduler.Scheduler` (the device state, the page
allocator and the compiled steps) and runs it whenever a request is waiting or running; other
threads only validate requests and pass them in, so a request never sees another's tokens. The
waiting queue is bounded (:class:`EngineFullError` past ``max_queue``); a request that cannot fit a
slot's cache is refused at submission.

In a multi-process run (``jax.distributed``, a mesh over every process's devices) every process
makes the same engine; process 0 takes the requests and, before each step, sends the others what
it did (requests admitted, with everything needed to rebuild them, and cancellations) over the
coordinator's key-value store; they replay it and run the same step, so the collectives match.
``scripts/launch.py --serve`` runs the server that way.

The package follows those ideas, one module each: :mod:`.handle` (what a caller holds: tokens
and text as they come, the result, cancel), :mod:`.engine` (what other threads call: submission,
jobs, statistics, closing), :mod:`.thread` (the engine's own thread: its loop, the inbox, the
requests' ends), :mod:`.replay` (the multi-process event stream and the followers' loop) and
:mod:`.warmup` (compiling programs before requests need them). Requests are checked by :mod:`mtp_jax.request`,
the same checks ``Model.generate`` makes.
"""

from mtp_jax.serving.engine import Engine
from mtp_jax.serving.errors import EngineClosedError, EngineFullError
from mtp_jax.serving.handle import Completion, RequestHandle, StopCheck

__all__ = ["Completion", "Engine", "EngineClosedError", "EngineFullError", "RequestHandle", "StopCheck"]
