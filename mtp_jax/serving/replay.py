"""Multi-process serving: process 0's engine loop records what it does before each step (requests
admitted, with everything needed to rebuild them, cancellations, warm-ups) and sends it over the
coordinator's key-value store; every other process replays it and runs the same step, so the
requests sit in the same slots and every collective matches."""

from __future__ import annotations

import contextlib
import json
import logging
from typing import TYPE_CHECKING

import jax

from mtp_jax.distributed import PEER_TIMEOUT_S, Broadcast, Heartbeat, stream_name
from mtp_jax.errors import InvalidRequestError
from mtp_jax.request import CheckedRequest

if TYPE_CHECKING:
    from mtp_jax.serving.engine import Engine
    from mtp_jax.serving.thread import EngineThread

log = logging.getLogger(__name__)


class Replay:
    """One engine's stream of events to the other processes (a no-op in a one-process run).

    Events are JSON lists: ``["submit", id, request]``, ``["cancel", id]``, ``["lora_load", name,
    path]`` and ``["lora_unload", name]`` (an adapter loaded into the same slot, or freed, before the
    next step; each process reads the adapter from ``path`` itself), ``["warmup"]`` (the followers
    warm up instead of stepping), ``["warmjob", kind, ...]`` (one program of a background warm-up
    instead of a step), ``["prompt_logprobs", ids, n, lora]`` (a prompt scored instead of a step)
    and ``["close"]``."""

    def __init__(self) -> None:
        self.leader = jax.process_index() == 0
        self.channel = Broadcast(stream_name("mtp_jax/engine")) if jax.process_count() > 1 else None
        self.events: list[list] = []  # what the loop did since the last step
        self.heartbeat: Heartbeat | None = None

    def watch(self, engine: Engine, timeout_s: float = PEER_TIMEOUT_S) -> None:
        """(Multi-process runs.) Fail ``engine`` when another process stops answering for
        ``timeout_s`` seconds, even while its thread waits inside a collective
        (:class:`~mtp_jax.distributed.Heartbeat`)."""
        if self.channel is not None:
            name = stream_name("mtp_jax/alive")

            def lost(error: BaseException) -> None:
                log.error("%s: failing every request", error)
                engine.fail(error)

            self.heartbeat = Heartbeat(name, lost, timeout_s=timeout_s)

    def stop_watching(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()

    @property
    def multi_process(self) -> bool:
        return self.channel is not None

    def check_replayable(self, stop_check: object | None, checked: CheckedRequest | None = None) -> None:
        """Refuse a request the other processes could not rebuild (InvalidRequestError): a Python
        ``stop_check`` (checked first, before the request itself), or a request whose description
        (``checked.to_json()``) is not JSON."""
        spec = None if checked is None else checked.to_json()  # what a process needs to rebuild it
        if not self.multi_process:
            return
        if stop_check is not None:
            raise InvalidRequestError(
                "stop_check cannot be replayed on the other processes of a multi-process run: use "
                "stop strings or stop_token_ids"
            )
        try:
            json.dumps(spec)
        except (TypeError, ValueError) as e:
            raise InvalidRequestError(f"the request cannot be sent to the other processes: {e}") from e

    def record(self, *event) -> None:
        self.events.append(list(event))

    def publish(self) -> None:
        """(Process 0.) Tell the followers what happened before this step."""
        events, self.events = self.events, []
        if self.channel is not None:
            self.channel.send(json.dumps(events))

    def abort(self) -> None:
        """(Process 0, its loop failed.) Let the followers stop too, best effort."""
        if self.channel is not None:
            with contextlib.suppress(BaseException):
                self.channel.send(json.dumps([["close"]]))

    def follow(self, thread: EngineThread) -> None:
        """(Processes other than 0: the engine thread's loop.) Hand ``thread`` what process 0's
        engine did before each of its steps (:meth:`~mtp_jax.serving.thread.EngineThread.follow`
        applies it and runs the same step) until process 0 closes the engine."""
        try:
            while thread.follow(json.loads(self.channel.receive())):
                pass
            self.stop_watching()
        except BaseException as e:
            log.exception("the engine's follower loop failed")
            thread.engine.fail(e)
