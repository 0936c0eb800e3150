"""The engine's thread: the one that owns the scheduler. It takes what other threads put in the
engine's inbox (submissions, cancellations, jobs: a warm-up, an adapter loaded or unloaded, a prompt
scored), runs the scheduler whenever a request waits or runs, hands each step's tokens to the
requests' handles, and fails every request if a step fails. On the other processes of a multi-process
run it replays what process 0's thread did instead (:mod:`mtp_jax.serving.replay`)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from mtp_jax.errors import AdapterError, InvalidRequestError
from mtp_jax.request import CheckedRequest
from mtp_jax.scheduler import Request
from mtp_jax.serving.errors import EngineClosedError
from mtp_jax.serving.handle import RequestHandle, StopCheck, token_hook
from mtp_jax.text import TextStream

if TYPE_CHECKING:
    from mtp_jax.serving.engine import Engine

log = logging.getLogger("mtp_jax.serving.engine")  # the engine's failures, under the engine's name


class EngineThread:
    """What an :class:`~mtp_jax.serving.engine.Engine`'s own thread does (the engine's state and
    counters are the engine's, read by other threads under its lock): :meth:`run` is its loop on
    process 0, :meth:`follow` applies process 0's events on the others."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def call(self, kind: str, argument: Any) -> Any:
        """(Any other thread.) Have this thread run job ``kind`` (:meth:`job`) between two steps,
        wait for it and return its result (or raise its error)."""
        eng = self.engine
        done: list = [threading.Condition()]
        with done[0]:
            eng._inbox.put((kind, (argument, done)))
            while len(done) == 1:
                if not eng._thread.is_alive():
                    raise EngineClosedError(f"the engine is closed{eng._failure_note()}")
                done[0].wait(1.0)
        if isinstance(done[1], BaseException):
            raise done[1]
        return done[1]

    def run(self) -> None:
        """(Process 0.) The loop: take the inbox, then run one program (a step, a prefill, a
        background warm-up's program) whenever there is work, until the engine closes or fails."""
        eng = self.engine
        running = True
        while running:
            held = eng.step_gate is not None and not eng.step_gate()
            block = not eng.scheduler.busy and not eng.warming.jobs
            try:
                # held: wait for a submission or job a little, then ask the gate again
                item = eng._inbox.get(timeout=0.005) if held and not block else eng._inbox.get(block=block)
                running = self.take(item)
                while running:
                    running = self.take(eng._inbox.get_nowait())
            except queue.Empty:
                pass
            # asked again: a gate closed while the loop waited on an empty inbox holds this submission
            held = eng.step_gate is not None and not eng.step_gate()
            job = None
            if running and not held and not eng.scheduler.busy:
                # idle: one program of a background warm-up instead of a step (the followers too)
                job = eng.warming.next_job()
                if job is not None:
                    eng.replay.record("warmjob", *job)
            try:
                eng.replay.publish()
            except BaseException as e:
                log.exception("the engine could not reach the other processes")
                eng.fail(e)
                return
            if not running:
                break
            if held:
                continue
            if job is not None:
                try:
                    eng.warming.compile(job)
                except BaseException as e:
                    log.exception("the engine's warm-up failed")
                    eng.fail(e)
                    return
                continue
            queued = len(eng.scheduler.queue)
            try:
                eng.scheduler.advance()
                self.announce()
            except BaseException as e:  # the device state is unknown now: fail everything, stop
                log.exception("the engine's loop failed")
                eng.fail(e)
                eng.replay.abort()
                return
            admitted = queued - len(eng.scheduler.queue)
            free = sum(o is None for o in eng.scheduler.owner)
            with eng._lock:
                eng._waiting -= max(admitted, 0)
                eng._free_slots = free
        eng.fail(EngineClosedError("the engine was closed"))

    def take(self, item: tuple[str, Any]) -> bool:
        """Act on one inbox item (kind, value); False when it closes the engine."""
        eng = self.engine
        kind, value = item
        if kind == "submit":
            if value.done:  # cancelled before it reached the scheduler
                with eng._lock:
                    eng._waiting -= 1
                return True
            self.schedule(value)
            eng.replay.record("submit", value.id, value._checked.to_json())
        elif kind == "cancel":
            request = value.request
            if request.counters is None:  # not in the scheduler yet: its "submit" item follows
                self.finished(value, "cancelled")
                return True
            waiting = request in eng.scheduler.queue
            eng.scheduler.cancel(request)
            eng.replay.record("cancel", value.id)
            if waiting:
                with eng._lock:
                    eng._waiting -= 1
        elif kind in ("warmup", "lora_load", "lora_unload", "prompt_logprobs"):
            argument, done = value
            try:
                done.append(self.job(kind, argument))
            except BaseException as e:
                # refused (nothing changed; serving goes on): a bad request, or an adapter that
                # cannot be loaded (e.g. no free slot); anything else ends the loop
                refused = isinstance(e, (InvalidRequestError, AdapterError)) or (
                    kind != "warmup" and isinstance(e, ValueError)
                )
                done.append(e)
                if not refused:
                    raise
            finally:
                with done[0]:
                    done[0].notify_all()
        elif kind == "warmup_background":
            eng.warming.start(*value)
        elif kind == "close":
            eng.replay.record("close")
            return False
        return True

    def job(self, kind: str, argument: Any) -> Any:
        """(The engine's thread, between two steps.) A warm-up, loading or unloading an adapter, or
        a prompt's log-probabilities."""
        eng = self.engine
        if kind == "prompt_logprobs":
            eng.model._lora_slots(argument[2], 1)  # still loaded: refused here, before the others hear
            # the followers run the same program instead of their next step (see Replay.follow)
            eng.replay.record("prompt_logprobs", *argument)
            eng.replay.publish()
            return eng.model.prompt_logprobs(*argument)
        if kind == "warmup":
            if eng.scheduler.pending is not None or any(o is not None for o in eng.scheduler.owner):
                raise InvalidRequestError("warm the engine up before requests run (some are running)")
            # the followers compile the same programs in the same order (and, this message
            # ending with "warmup", do not step after it: neither does this loop)
            eng.replay.record("warmup")
            eng.replay.publish()
            return eng.warming.run(argument)
        if kind == "lora_load":
            name, adapter, values = argument
            eng.model.load_lora(name, adapter, values=values)
            eng.replay.record("lora_load", name, adapter.path)
            return None
        name = argument
        with eng._lock:  # no request naming it may be submitted meanwhile (see submit)
            users = sum(1 for h in eng._handles.values() if h._checked.params.lora == name)
            if users:
                raise InvalidRequestError(
                    f"LoRA adapter {name!r} is in use by {users} waiting or running request(s): cancel "
                    "them or let them finish first"
                )
            eng.model.unload_lora(name)
        eng.replay.record("lora_unload", name)
        return None

    def schedule(self, handle: RequestHandle) -> None:
        """Hand a built request to the scheduler (with its grammars, from the first that has one)."""
        eng = self.engine
        if handle._checked.params.grammar is not None and eng.scheduler.constraints is None:
            eng.scheduler.constraints = eng._constraints
        eng.scheduler.submit(handle.request)

    def build(self, rid: int, checked: CheckedRequest, stop_check: StopCheck | None) -> RequestHandle:
        """The request ``checked`` describes, as request ``rid``, and its handle (its grammar added)."""
        eng = self.engine
        params = checked.params
        text = TextStream(eng.model.text, params.stop) if checked.text else None
        if params.grammar is not None:
            self.grammar_for(rid, params.grammar)
        # time to first token counts the engine's queue too
        request = Request.from_checked(checked, rid, submitted_at=time.perf_counter())
        table = eng.model.lora
        if table is not None:  # an adapter reloaded into a slot does not reuse its predecessor's prefixes
            request.cache_salt += b"|writes:%d" % table.writes.get(checked.lora_slot, 0)
        handle = RequestHandle(eng, request, text)
        handle._checked = checked
        stop_ids = frozenset(params.stop_token_ids) or None
        request.on_token = token_hook(handle, stop_ids, stop_check)
        request.on_finish = lambda req, handle=handle: self.finished(handle, req.finish)
        return handle

    def grammar_for(self, rid: int, spec: dict) -> None:
        eng = self.engine
        from mtp_jax.grammar import Constraints

        if eng._constraints is None:
            model = eng.model
            constraints = Constraints(model.tokenizer_path, model.config.vocab_size, model.eos_token_ids)
            eng._constraints = constraints  # the scheduler's from the first constrained request on
        eng._constraints.add(rid, spec)

    def finished(self, handle: RequestHandle, reason: str) -> None:
        """A request ended (the scheduler's ``on_finish``): counted, and its handle closed."""
        eng = self.engine
        with eng._lock:
            eng._handles.pop(handle.id, None)
            eng._finished_by[reason] = eng._finished_by.get(reason, 0) + 1
            eng._prompt_tokens += len(handle.request.prompt)
            eng._generation_tokens += len(handle.request.tokens)
        handle._close(reason)

    def announce(self) -> None:
        """Wake the consumers of the handles that got tokens in this step (once per step)."""
        eng = self.engine
        fresh, eng._fresh = eng._fresh, set()
        for handle in fresh:
            handle._announce()

    def follow(self, events: list[list]) -> bool:
        """(Processes other than 0: their engine thread.) Apply the events process 0's loop
        recorded before one of its steps (:class:`~mtp_jax.serving.replay.Replay` lists them: the
        requests it admitted, cancelled, the adapters it loaded or unloaded), then run what it ran
        next: the same step, warm-up, warm-up program or prompt scoring. False once process 0 has
        closed the engine (this one is then closed too)."""
        eng = self.engine
        for kind, *args in events:
            if kind == "submit":  # rebuilt from what process 0 checked, under its id
                rid, spec = args
                handle = self.build(rid, CheckedRequest.from_json(spec), None)
                with eng._lock:
                    eng._handles[rid] = handle
                self.schedule(handle)
            elif kind == "cancel":
                handle = eng._handles.get(args[0])
                if handle is not None:
                    eng.scheduler.cancel(handle.request)
            elif kind == "lora_load":
                eng.model.load_lora(*args)
            elif kind == "lora_unload":
                eng.model.unload_lora(args[0])
            elif kind == "close":
                eng.fail(EngineClosedError("process 0 closed the engine"))
                return False
        last = events[-1] if events else [None]
        if last == ["warmup"]:
            eng.warming.run(None)
        elif last[0] == "prompt_logprobs":
            eng.model.prompt_logprobs(*last[1:])
        elif last[0] == "warmjob":
            eng.scheduler.warmup_job(*last[1:])
        else:
            eng.scheduler.advance()
            self.announce()
        return True
