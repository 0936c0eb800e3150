"""A persistent engine: caches allocated once, requests submitted at any time from any thread.

    engine = mtp_jax.Engine(model, slots=8, max_len=2048, draft="mtp", num_speculative_tokens=3)
    handle = engine.submit([0, 17, 42], max_new_tokens=64, temperature=0.7, seed=1)
    for token in handle:            # or: async for token in handle (inside an event loop)
        ...
    handle.result()                 # Completion(tokens, finish_reason, stats)
    handle.cancel()                 # stop it now: its slot and pages are freed
    engine.close()

One background thread owns the :class:`~mtp_jax.engine.Scheduler` (the device state, the page
allocator and the compiled steps) and runs it whenever a request is waiting or running; other
threads only validate requests and pass them in, so a request never sees another's tokens. The
waiting queue is bounded (:class:`EngineFullError` past ``max_queue``); a request that cannot fit a
slot's cache is refused at submission.

In a multi-process run (``jax.distributed``, a mesh over every process's devices) every process
makes the same engine; process 0 takes the requests and, before each step, sends the others what
it did (requests admitted, with everything needed to rebuild them, and cancellations) over the
coordinator's key-value store; they replay it and run the same step, so the collectives match.
``scripts/launch.py --serve`` runs the server that way.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import queue
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from mtp_jax.distributed import Broadcast
from mtp_jax.engine import Request, Scheduler, next_power_of_two, pages_needed
from mtp_jax.errors import InvalidRequestError
from mtp_jax.request import (
    CheckedRequest,
    SamplingParams,
    SpeculativeConfig,
    check_request,
    row_sampling,
    split_settings,
    step_config,
)
from mtp_jax.sharding import row_shards
from mtp_jax.text import TextStream

log = logging.getLogger(__name__)
_ENGINES = itertools.count()  # engines made by this process: each multi-process run's message stream

StopCheck = Callable[[int], bool]
"""Called with every emitted token of a request (after it is recorded); True stops the request
with finish reason "stop" (stop strings are checked this way)."""


class EngineFullError(InvalidRequestError):
    """The engine's waiting queue is full: try again later."""


class EngineClosedError(InvalidRequestError):
    """The engine was closed (or its loop failed): it takes no more requests."""


@dataclasses.dataclass
class Completion:
    """A finished request: its new tokens, why it stopped ("eos", "length", "stop", "grammar",
    "cancelled", or "error"), its speculation counters (:class:`~mtp_jax.engine.SpecCounters`),
    and its text (with a text prompt or stop strings)."""

    tokens: list[int]
    finish_reason: str
    stats: dict
    text: str | None = None


class RequestHandle:
    """A submitted request. Iterate it (``for`` in a thread, ``async for`` in an event loop) for
    its tokens as they are emitted, or :meth:`stream` / :meth:`astream` for (tokens, text) pieces;
    :meth:`result` waits for the end; :meth:`cancel` stops it. With a text prompt or stop strings
    the text is detokenised as it comes (never inside a character), stop strings cut out."""

    def __init__(self, engine: Engine, request: Request, text: TextStream | None = None) -> None:
        self._engine = engine
        self.request = request
        self._text = text
        self._cond = threading.Condition()
        self._tokens: list[int] = []
        self._pieces: list[str] = []  # the text each token released
        self._tail = ""  # the text released at the end
        self._finish: str | None = None
        self._error: BaseException | None = None
        self._checked: CheckedRequest | None = None  # what the engine was asked (see Engine.submit)
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    # called on the engine's thread
    def _push(self, token: int) -> bool:
        piece, stop = self._text.push(token) if self._text is not None else ("", False)
        with self._cond:
            self._tokens.append(token)
            self._pieces.append(piece)
        self._engine._fresh.add(self)  # consumers are woken once per step, not once per token
        return stop

    def _announce(self) -> None:
        with self._cond:
            self._cond.notify_all()
            waiters = list(self._waiters)
        _wake(waiters)

    def _close(self, reason: str, error: BaseException | None = None) -> None:
        tail = self._text.finish() if self._text is not None and error is None else ""
        with self._cond:
            if self._finish is not None:
                return
            self._finish, self._error, self._tail = reason, error, tail
            self._cond.notify_all()
            waiters = list(self._waiters)
        _wake(waiters)

    @property
    def id(self) -> int:
        return self.request.id

    @property
    def done(self) -> bool:
        return self._finish is not None

    @property
    def finish_reason(self) -> str | None:
        return self._finish

    def cancel(self) -> None:
        """Stop the request now (a no-op once it has finished); its pages are freed at once."""
        if not self.done:
            self._engine._cancel(self)

    def _since(self, i: int) -> tuple[list[int], str, bool]:
        """(tokens from i on, their text, finished); the end's text once all tokens are out."""
        tokens, pieces, finished = self._tokens[i:], self._pieces[i:], self._finish is not None
        return tokens, "".join(pieces) + (self._tail if finished else ""), finished

    def stream(self) -> Iterator[tuple[list[int], str]]:
        """(new tokens, new text) as they come, until the request ends."""
        i = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda i=i: len(self._tokens) > i or self._finish is not None)
                tokens, text, finished = self._since(i)
            i += len(tokens)
            if tokens or text:
                yield tokens, text
            if finished:
                self._raise_error()
                return

    async def astream(self) -> AsyncIterator[tuple[list[int], str]]:
        """:meth:`stream` in an event loop (woken from the engine's thread; no thread per request)."""
        event = asyncio.Event()
        entry = (asyncio.get_running_loop(), event)
        with self._cond:
            self._waiters.append(entry)
        try:
            i = 0
            while True:
                event.clear()
                with self._cond:
                    tokens, text, finished = self._since(i)
                i += len(tokens)
                if tokens or text:
                    yield tokens, text
                if finished:
                    break
                if not tokens:
                    await event.wait()
        finally:
            with self._cond:
                self._waiters.remove(entry)
        self._raise_error()

    def __iter__(self) -> Iterator[int]:
        for tokens, _ in self.stream():
            yield from tokens

    async def __aiter__(self) -> AsyncIterator[int]:
        async for tokens, _ in self.astream():
            for token in tokens:
                yield token

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"request {self.id} failed: {self._error}") from self._error

    def result(self, timeout: float | None = None) -> Completion:
        """Wait for the request to finish (TimeoutError after ``timeout`` seconds)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._finish is not None, timeout):
                raise TimeoutError(f"request {self.id} still running after {timeout} s")
            text = "".join(self._pieces) + self._tail if self._text is not None else None
        self._raise_error()
        return Completion(list(self._tokens), self._finish, self.request.counters.as_dict(), text)


class Engine:
    """Serve a loaded model (and its draft) to requests that come and go.

    ``slots`` rows decode at once (continuous batching; rounded up to a power of two and to a
    multiple of the mesh's row devices); each slot holds ``max_len`` tokens (prompt + new tokens;
    default: the model's maximum length, at most 4096); ``max_queue`` requests may wait for a slot.
    ``draft`` / ``num_speculative_tokens`` / ``draft_sampling`` / ``draft_block_size`` are the
    engine's speculation (a request may ask for fewer drafts, or none); ``think_tokens`` enables
    per-request relaxed acceptance between those markers (see :meth:`mtp_jax.Model.generate`);
    ``grammar_masks`` how grammar masks reach the step. With ``row_buckets`` (the default, unless
    rows are split over a data axis) a step covers only the slots up to the last occupied one,
    rounded up to a power of two: a few requests in many slots cost what they would alone, for a
    program per (K, power of two) that occurs (``stats()["step_programs"]``)."""

    def __init__(
        self,
        model,
        *,
        slots: int = 8,
        max_len: int | None = None,
        speculative: SpeculativeConfig | None = None,
        draft: str | None = None,
        num_speculative_tokens: int | None = None,
        draft_sampling: str | None = None,
        draft_block_size: int | None = None,
        think_tokens: tuple[int, int] | None = None,
        max_queue: int = 256,
        grammar_masks: str = "host",
        row_buckets: bool = True,
    ) -> None:
        from mtp_jax.grammar import DELIVERIES
        from mtp_jax.model import DTYPES

        for name, value, low in (("slots", slots, 1), ("max_queue", max_queue, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidRequestError(f"{name} must be an integer >= {low}, got {value!r}")
        if grammar_masks not in DELIVERIES:
            raise InvalidRequestError(f"grammar_masks must be one of {DELIVERIES}, got {grammar_masks!r}")
        limit = model.config.max_position_embeddings
        max_len = min(limit, 4096) if max_len is None else max_len
        if isinstance(max_len, bool) or not isinstance(max_len, int) or not 2 <= max_len <= limit:
            raise InvalidRequestError(f"max_len must be an integer in [2, {limit}], got {max_len!r}")
        self.model = model
        if model.dtype != "float32" and jax.default_backend() == "cpu":
            warnings.warn(
                f"a {model.dtype} engine on the CPU backend: XLA:CPU copies a 16-bit cache's whole page pool "
                "on every cache write (about 20 tok/s against 840 for float32 with 8 slots x 4096 tokens of "
                "the tiny model); load the model with dtype='float32' to serve on a CPU",
                stacklevel=2,
            )
        given = {
            "draft": draft,
            "num_speculative_tokens": num_speculative_tokens,
            "draft_sampling": draft_sampling,
            "draft_block_size": draft_block_size,
            "think_tokens": think_tokens,
        }
        given = {k: v for k, v in given.items() if v is not None}
        _, speculative = split_settings(0, None, speculative, given)
        if speculative.auto_k is not None:
            raise InvalidRequestError(
                "auto_k is a setting of Model.generate (one batch of known size); an engine verifies up "
                "to its K for whatever runs"
            )
        sc = step_config(model, speculative)
        self.speculative = speculative
        self.sc = sc
        self.max_len = max_len
        self.max_queue = max_queue
        self.slots = int(np.lcm(next_power_of_two(slots), row_shards(sc.mesh)))
        width = pages_needed(max_len, 0, sc)
        self._constraints = None
        self._grammar_masks = grammar_masks
        self.scheduler = Scheduler(
            model.params,
            sc,
            slots=self.slots,
            width=width,
            eos_token_ids=model.eos_token_ids,
            cache_dtype=DTYPES[model.dtype],
            grammar_masks=grammar_masks,
            row_buckets=row_buckets,
        )
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiting = 0  # submitted, not yet in a slot
        self._next_id = 0
        self._handles: dict[int, RequestHandle] = {}
        self._finished_by: dict[str, int] = {}  # finished requests by finish reason
        self._prompt_tokens = self._generation_tokens = 0  # of finished requests
        self._closed = False
        self._failure: BaseException | None = None
        self._events: list[list] = []  # what the loop did since the last step (for the followers)
        self._fresh: set[RequestHandle] = set()  # handles with tokens their consumers have not seen
        self._warm_jobs: list[tuple[str, int, int]] = []  # a background warm-up's programs left
        self._warm_progress: Callable[[int, int], None] | None = None
        self._warm_total = self._warm_done = 0
        self._channel = None
        self.leader = jax.process_index() == 0
        if jax.process_count() > 1:
            self._channel = Broadcast(f"mtp_jax/engine/{next(_ENGINES)}")
        loop = self._loop if self.leader else self._follow
        self._thread = threading.Thread(target=loop, name="mtp-jax-engine", daemon=True)
        self._thread.start()

    # -- submission (any thread) -------------------------------------------------------------

    def submit(
        self,
        prompt: Sequence[int] | str,
        sampling: SamplingParams | None = None,
        *,
        stop_check: StopCheck | None = None,
        detokenize: bool = False,
        **settings: Any,
    ) -> RequestHandle:
        """Check a request and queue it; returns its handle at once. ``prompt``: token ids or text
        (encoded with the model's tokenizer under its own BOS rules). ``sampling``: the request's
        :class:`~mtp_jax.SamplingParams`, or its fields as keywords (``max_new_tokens=64,
        temperature=0.7``); its ``num_speculative_tokens`` caps its drafts per step (0 = plain
        decoding; default: the engine's K). ``stop`` strings and ``stop_token_ids`` end it with
        finish reason "stop"; ``stop_check(token)`` True too (one process only). Text prompts, stop
        strings or ``detokenize`` give the handle the request's text as it comes."""
        if self._channel is not None and not self.leader:
            raise InvalidRequestError(
                f"this is process {self._channel.me} of a multi-process run: requests go to process 0's "
                "engine (the others follow it)"
            )
        if stop_check is not None and self._channel is not None:
            raise InvalidRequestError(
                "stop_check cannot be replayed on the other processes of a multi-process run: use stop "
                "strings or stop_token_ids"
            )
        if sampling is None:
            sampling = SamplingParams.per_prompt(1, **settings)[0]
        elif settings:
            raise TypeError(f"pass {sorted(settings)} inside sampling=SamplingParams(...), not beside it")
        checked = check_request(
            self.model,
            prompt,
            sampling,
            self.sc,
            context=self.max_len,
            context_name=f"the engine's context of {self.max_len} tokens",
            text=detokenize,
        )
        spec = checked.to_json()  # everything a process needs to build the same request
        if self._channel is not None:
            try:
                json.dumps(spec)
            except (TypeError, ValueError) as e:
                raise InvalidRequestError(f"the request cannot be sent to the other processes: {e}") from e
        with self._lock:
            if self._closed:
                raise EngineClosedError(f"the engine is closed{self._failure_note()}")
            if self._waiting >= self.max_queue:
                raise EngineFullError(f"the engine's queue is full ({self.max_queue} requests waiting)")
            rid = self._next_id
            self._next_id += 1
            handle = self._build(rid, checked, stop_check)
            self._handles[rid] = handle
            self._waiting += 1
        self._inbox.put(("submit", handle))
        return handle

    def _build(self, rid: int, checked: CheckedRequest, stop_check: StopCheck | None) -> RequestHandle:
        """The request ``checked`` describes, as request ``rid``, and its handle (its grammar added)."""
        params = checked.params
        text = TextStream(self.model.text, params.stop) if checked.text else None
        if params.grammar is not None:
            self._grammar_for(rid, params.grammar)
        sampling, past_eos = row_sampling([checked]), params.ignore_eos
        request = Request(checked.prompt, params.max_new_tokens, sampling, id=rid, ignore_eos=past_eos)
        handle = RequestHandle(self, request, text)
        handle._checked = checked
        stop_ids = frozenset(params.stop_token_ids) or None
        request.on_token = _token_hook(handle, stop_ids, stop_check)
        request.on_finish = lambda req, handle=handle: self._finished(handle, req.finish)
        return handle

    def _grammar_for(self, rid: int, spec: dict) -> None:
        from mtp_jax.grammar import Constraints

        if self._constraints is None:
            model = self.model
            constraints = Constraints(model.tokenizer_path, model.config.vocab_size, model.eos_token_ids)
            self._constraints = constraints  # the scheduler's from the first constrained request on
        self._constraints.add(rid, spec)

    def _cancel(self, handle: RequestHandle) -> None:
        self._inbox.put(("cancel", handle))

    @property
    def failed(self) -> bool:
        """The engine's loop failed (every request then ended with finish reason "error")."""
        return self._failure is not None

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def _failure_note(self) -> str:
        return f" (its loop failed: {self._failure})" if self._failure is not None else ""

    # -- the engine's thread -----------------------------------------------------------------

    def _finished(self, handle: RequestHandle, reason: str) -> None:
        with self._lock:
            self._handles.pop(handle.id, None)
            self._finished_by[reason] = self._finished_by.get(reason, 0) + 1
            self._prompt_tokens += len(handle.request.prompt)
            self._generation_tokens += len(handle.request.tokens)
        handle._close(reason)

    def _take(self, item) -> bool:
        kind, value = item
        if kind == "submit":
            if value.done:  # cancelled before it reached the scheduler
                with self._lock:
                    self._waiting -= 1
                return True
            self._schedule(value)
            self._events.append(["submit", value.id, value._checked.to_json()])
        elif kind == "cancel":
            request = value.request
            if request.counters is None:  # not in the scheduler yet: its "submit" item follows
                self._finished(value, "cancelled")
                return True
            waiting = request in self.scheduler.queue
            self.scheduler.cancel(request)
            self._events.append(["cancel", value.id])
            if waiting:
                with self._lock:
                    self._waiting -= 1
        elif kind == "warmup":
            progress, done = value
            try:
                if self.scheduler.pending is not None or any(o is not None for o in self.scheduler.owner):
                    raise InvalidRequestError("warm the engine up before requests run (some are running)")
                # the followers compile the same programs in the same order (and, this message
                # ending with "warmup", do not step after it: neither does this loop)
                self._events.append(["warmup"])
                self._publish()
                done.append(self._warmup(progress))
            except InvalidRequestError as e:
                done.append(e)
            except BaseException as e:
                done.append(e)
                raise
            finally:
                with done[0]:
                    done[0].notify_all()
        elif kind == "warmup_background":
            self._warm_jobs, self._warm_progress = list(value[0]), value[1]
        elif kind == "close":
            self._events.append(["close"])
            return False
        return True

    def _warmup_scope(self) -> tuple[int, range]:
        """The longest prompt and the Ks a request can bring: what a warm-up covers."""
        return self.max_len - 1, range(self.sc.k + 1)

    def _warmup(self, progress: Callable[[int, int], None] | None) -> int:
        self._warm_jobs = []  # a background warm-up still under way has nothing left to do
        self._warm_total = self._warm_done = 0
        return self.scheduler.warmup(*self._warmup_scope(), progress)

    def warmup(self, progress: Callable[[int, int], None] | None = None, background: bool = False) -> int:
        """Compile every prefill and step program a request without a grammar can need (each
        admission size and prompt-length bucket, each K up to the engine's and each row bucket),
        so that no request waits for a compilation. ``progress(done, total)`` is called on the
        engine's thread after each program; returns how many there are. By default it returns
        when all are compiled (requests submitted meanwhile wait); with ``background`` it returns
        at once and the engine compiles them, smallest first, whenever no request runs (a request
        meanwhile may still compile the program it needs; ``stats()["warmup_left"]`` counts down).
        (Process 0 of a multi-process run: the others follow.)"""
        if not self.leader:
            raise InvalidRequestError("only process 0's engine warms up: the others follow it")
        if background:
            jobs = self.scheduler.warmup_jobs(*self._warmup_scope())
            # counted here, so that stats() shows the programs left as soon as this returns
            self._warm_total, self._warm_done = len(jobs), 0
            self._inbox.put(("warmup_background", (jobs, progress)))
            return len(jobs)
        done: list = [threading.Condition()]
        with done[0]:
            self._inbox.put(("warmup", (progress, done)))
            while len(done) == 1:
                if not self._thread.is_alive():
                    raise EngineClosedError(f"the engine is closed{self._failure_note()}")
                done[0].wait(1.0)
        if isinstance(done[1], BaseException):
            raise done[1]
        return done[1]

    def _schedule(self, handle: RequestHandle) -> None:
        if handle._checked.params.grammar is not None and self.scheduler.constraints is None:
            self.scheduler.constraints = self._constraints
        self.scheduler.submit(handle.request)

    def _publish(self) -> None:
        """(Process 0 of a multi-process run.) Tell the followers what happened before this step."""
        events, self._events = self._events, []
        if self._channel is not None:
            self._channel.send(json.dumps(events))

    def _loop(self) -> None:
        running = True
        while running:
            block = not self.scheduler.busy and not self._warm_jobs
            try:
                item = self._inbox.get(block=block)
                running = self._take(item)
                while running:
                    running = self._take(self._inbox.get_nowait())
            except queue.Empty:
                pass
            job = None
            if running and self._warm_jobs and not self.scheduler.busy:
                # idle: one program of a background warm-up instead of a step (the followers too)
                job = self._warm_jobs.pop(0)
                self._events.append(["warmjob", *job])
            try:
                self._publish()
            except BaseException as e:
                log.exception("the engine could not reach the other processes")
                self._fail(e)
                return
            if not running:
                break
            if job is not None:
                try:
                    self.scheduler.warmup_job(*job)
                    self._warm_done += 1
                    if self._warm_progress is not None:
                        self._warm_progress(self._warm_done, self._warm_total)
                except BaseException as e:
                    log.exception("the engine's warm-up failed")
                    self._fail(e)
                    return
                continue
            queued = len(self.scheduler.queue)
            try:
                self.scheduler.advance()
                self._announce()
            except BaseException as e:  # the device state is unknown now: fail everything, stop
                log.exception("the engine's loop failed")
                self._fail(e)
                if self._channel is not None:  # let the followers stop too (best effort)
                    with contextlib.suppress(BaseException):
                        self._channel.send(json.dumps([["close"]]))
                return
            admitted = queued - len(self.scheduler.queue)
            if admitted > 0:
                with self._lock:
                    self._waiting -= admitted
        self._fail(EngineClosedError("the engine was closed"))

    def _announce(self) -> None:
        fresh, self._fresh = self._fresh, set()
        for handle in fresh:
            handle._announce()

    def _follow(self) -> None:
        """(Processes other than 0.) Apply what process 0's engine did before each of its steps, then
        run the same step: the same requests in the same slots, so every collective matches. A
        message ending with "warmup" is followed by the warm-up instead of a step, as on process 0."""
        try:
            while True:
                events = json.loads(self._channel.receive())
                for kind, *args in events:
                    if kind == "submit":
                        rid, spec = args
                        handle = self._build(rid, CheckedRequest.from_json(spec), None)
                        with self._lock:
                            self._handles[rid] = handle
                        self._schedule(handle)
                    elif kind == "cancel":
                        handle = self._handles.get(args[0])
                        if handle is not None:
                            self.scheduler.cancel(handle.request)
                    elif kind == "close":
                        self._fail(EngineClosedError("process 0 closed the engine"))
                        return
                if events and events[-1] == ["warmup"]:
                    self._warmup(None)
                elif events and events[-1][0] == "warmjob":
                    self.scheduler.warmup_job(*events[-1][1:])
                else:
                    self.scheduler.advance()
                    self._announce()
        except BaseException as e:
            log.exception("the engine's follower loop failed")
            self._fail(e)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self._closed = True
            if not isinstance(error, EngineClosedError):
                self._failure = error
            handles = list(self._handles.values())
            self._handles.clear()
        for handle in handles:
            handle._close("error" if self._failure is not None else "cancelled", self._failure)

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self, timeout: float | None = 60.0) -> None:
        """Stop taking requests, cancel those still waiting or running, and stop the thread. (On the
        other processes of a multi-process run: wait up to ``timeout`` for process 0 to close.)"""
        with self._lock:
            self._closed = True
        self._inbox.put(("close", None))
        self._thread.join(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the engine's loop ends (closed, or failed); True if it has. What the other
        processes of a multi-process run do while process 0 serves."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict:
        """The engine's counters (the names serving engines export) and its occupancy."""
        counters = self.scheduler.counters.as_dict()
        running = sum(o is not None for o in self.scheduler.owner)
        return {
            **counters,
            "slots": self.slots,
            "running": running,
            "waiting": self._waiting,
            "free_pages": self.scheduler.allocator.free,
            "num_pages": self.scheduler.allocator.num_pages,
            "step_programs": len(self.scheduler.programs),
            "step_shapes": sorted(self.scheduler.programs),  # (K, rows) of each step program run
            "warmup_left": self._warm_total - self._warm_done,  # programs a background warm-up has left
            "finished": dict(self._finished_by),
            "prompt_tokens": self._prompt_tokens,
            "generation_tokens": self._generation_tokens,
        }


def _wake(waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]) -> None:
    for loop, event in waiters:
        with contextlib.suppress(RuntimeError):  # that event loop is closed
            loop.call_soon_threadsafe(event.set)


def _token_hook(handle: RequestHandle, stops: frozenset[int] | None, stop: StopCheck | None) -> Callable:
    def on_token(token: int) -> bool:
        hit = handle._push(token)
        return hit or (stops is not None and token in stops) or (stop is not None and bool(stop(token)))

    return on_token
