"""The engine: one background thread that owns the scheduler (device state, page allocator,
compiled steps) and runs it whenever a request waits or runs; other threads only check requests
and pass them in through its inbox."""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from mtp_jax.autok import batch_controls
from mtp_jax.distributed import PEER_TIMEOUT_S
from mtp_jax.errors import InvalidRequestError
from mtp_jax.request import (
    SamplingParams,
    SpeculativeConfig,
    check_request,
    speculative_config,
    step_config,
)
from mtp_jax.sampling import check_logprobs
from mtp_jax.scheduler import Scheduler, TokenLogprob, next_power_of_two, occupancy, pages_needed
from mtp_jax.serving.errors import EngineClosedError, EngineFullError
from mtp_jax.serving.handle import RequestHandle, StopCheck
from mtp_jax.serving.replay import Replay
from mtp_jax.serving.thread import EngineThread
from mtp_jax.serving.warmup import Warmup
from mtp_jax.sharding import row_shards
from mtp_jax.step import StepConfig


def engine_step_config(model, speculative: SpeculativeConfig, slots: int) -> tuple[StepConfig, int]:
    """The engine's step configuration and slot count (a power of two, whole rows per row shard):
    with ``schedule="confidence"`` the speeds it weighs are those of its slot count (its
    ``sps_table``, or measured before it starts)."""
    if speculative.auto_k is not None:
        raise InvalidRequestError(
            "auto_k is a setting of Model.generate (one batch of known size); an engine verifies up "
            "to its K for whatever runs"
        )
    if speculative.schedule == "confidence" and speculative.sps_table is None and jax.process_count() > 1:
        raise InvalidRequestError(
            "schedule='confidence' over several processes needs an sps_table (mtp-jax bench --sps-table): "
            "every process must weigh the same speeds"
        )
    sc = step_config(model, speculative)
    slots = int(np.lcm(next_power_of_two(slots), row_shards(sc.mesh)))
    controls = batch_controls(model, speculative)
    return (sc if controls is None or sc.k == 0 else controls(slots, sc)), slots


def _engine_max_len(model, max_len: int | None) -> int:
    """The engine's context: ``max_len``, by default the model's up to 4,096, checked against the
    model's limit; warns when a 16-bit model is served on the CPU backend."""
    limit = model.config.max_position_embeddings
    max_len = min(limit, 4096) if max_len is None else max_len
    if isinstance(max_len, bool) or not isinstance(max_len, int) or not 2 <= max_len <= limit:
        raise InvalidRequestError(f"max_len must be an integer in [2, {limit}], got {max_len!r}")
    if model.dtype != "float32" and jax.default_backend() == "cpu":
        warnings.warn(
            f"a {model.dtype} engine on the CPU backend: XLA:CPU copies a 16-bit cache's whole page pool "
            "on every cache write (about 20 tok/s against 840 for float32 with 8 slots x 4096 tokens of "
            "the tiny model); load the model with dtype='float32' to serve on a CPU",
            stacklevel=3,
        )
    return max_len


def _check_settings(
    slots: int, max_queue: int, grammar_masks: str, chunked_prefill_size: int | None, peer_timeout_s: float
) -> None:
    """InvalidRequestError naming the first of an engine's settings out of its range."""
    from mtp_jax.grammar import DELIVERIES

    if chunked_prefill_size is not None and (
        isinstance(chunked_prefill_size, bool)
        or not isinstance(chunked_prefill_size, int)
        or chunked_prefill_size < 16
    ):
        raise InvalidRequestError(
            f"chunked_prefill_size must be None or an integer >= 16, got {chunked_prefill_size!r}"
        )
    for name, value, low in (("slots", slots, 1), ("max_queue", max_queue, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InvalidRequestError(f"{name} must be an integer >= {low}, got {value!r}")
    if grammar_masks not in DELIVERIES:
        raise InvalidRequestError(f"grammar_masks must be one of {DELIVERIES}, got {grammar_masks!r}")
    timeout_ok = isinstance(peer_timeout_s, (int, float)) and 0 < peer_timeout_s < float("inf")
    if isinstance(peer_timeout_s, bool) or not timeout_ok:
        raise InvalidRequestError(
            f"peer_timeout_s must be a positive number of seconds, got {peer_timeout_s!r}"
        )


class Engine:
    """Serve a loaded model (and its draft) to requests that come and go.

    ``slots`` rows decode at once (continuous batching; rounded up to a power of two and to a
    multiple of the mesh's row devices); each slot holds ``max_len`` tokens (prompt + new tokens;
    default: the model's maximum length, at most 4096); ``max_queue`` requests may wait for a slot.
    ``speculative`` (a :class:`~mtp_jax.SpeculativeConfig`), or its fields ``draft`` /
    ``num_speculative_tokens`` / ``draft_sampling`` / ``draft_options`` (or ``draft_block_size``) /
    ``think_tokens`` / ``speculative_tree`` as keywords, is the engine's speculation (a request may
    ask for fewer drafts, or none; ``auto_k`` is ``generate``'s alone); ``think_tokens`` enables
    per-request relaxed acceptance between those markers (see :meth:`mtp_jax.Model.generate`);
    ``grammar_masks`` how grammar masks reach the step. With ``row_buckets`` (the default, unless
    rows are split over a data axis) a step covers only the slots up to the last occupied one,
    rounded up to a power of two: a few requests in many slots cost what they would alone, for a
    program per (K, power of two) that occurs (``stats()["step_programs"]``). With
    ``prefix_caching`` (the default) requests whose prompts share a prefix share its cache pages
    and prefill only the rest (:class:`mtp_jax.cache.PrefixCache`; ``stats()`` counts the prompt
    tokens looked up and found: ``prefix_cache_queries``, ``prefix_cache_hits``; with a ring cache
    the sliding-window layers' last window before the prefix's end is computed again). A prompt longer
    than ``chunked_prefill_size`` tokens (after its cached prefix) is prefilled that many tokens
    per iteration, between the running requests' steps, so they keep producing tokens while it
    arrives (None: every prompt in one prefill). In a multi-process run, the engine fails (every
    request ends with an error) once another process has not been heard from for
    ``peer_timeout_s`` seconds (:class:`mtp_jax.distributed.Heartbeat`)."""

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
        draft_options: dict | None = None,
        think_tokens: tuple[int, int] | None = None,
        speculative_tree: dict | None = None,
        max_queue: int = 256,
        grammar_masks: str = "host",
        row_buckets: bool = True,
        prefix_caching: bool = True,
        chunked_prefill_size: int | None = 2048,
        peer_timeout_s: float = PEER_TIMEOUT_S,
    ) -> None:
        from mtp_jax.model import DTYPES

        _check_settings(slots, max_queue, grammar_masks, chunked_prefill_size, peer_timeout_s)
        max_len = _engine_max_len(model, max_len)
        self.model = model
        given = {
            "draft": draft,
            "num_speculative_tokens": num_speculative_tokens,
            "draft_sampling": draft_sampling,
            "draft_block_size": draft_block_size,
            "draft_options": draft_options,
            "think_tokens": think_tokens,
            "speculative_tree": speculative_tree,
        }
        speculative = speculative_config(speculative, **{k: v for k, v in given.items() if v is not None})
        sc, self.slots = engine_step_config(model, speculative, slots)
        self.speculative = speculative
        self.sc = sc
        self.max_len = max_len
        self.max_queue = max_queue
        width = pages_needed(max_len, 0, sc)
        self._constraints = None
        self.scheduler = Scheduler(
            model.params,
            sc,
            slots=self.slots,
            width=width,
            eos_token_ids=model.eos_token_ids,
            cache_dtype=DTYPES[model.dtype],
            grammar_masks=grammar_masks,
            row_buckets=row_buckets,
            prefix_caching=prefix_caching,
            chunked_prefill=chunked_prefill_size,
        )
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiting = 0  # submitted, not yet in a slot
        self._free_slots = self.slots  # after the engine's last iteration
        self._next_id = 0
        self._handles: dict[int, RequestHandle] = {}
        self._finished_by: dict[str, int] = {}  # finished requests by finish reason
        self._prompt_tokens = self._generation_tokens = 0  # of finished requests
        self._closed = False
        self._failure: BaseException | None = None
        self._fresh: set[RequestHandle] = set()  # handles with tokens their consumers have not seen
        self.step_gate: Callable[[], bool] | None = None
        """Consulted by the engine's thread before each iteration of work (prefill, step, warm-up
        program): while it returns False the engine does none, but still takes submissions,
        cancellations and jobs (a LoRA load, a warm-up call). For tests and diagnostics that must
        act between two steps whatever the machine's speed; None (the default): never held. One
        process only."""
        self.warming = Warmup(self.scheduler, max_len - 1, range(sc.k + 1))
        self.replay = Replay()
        self.replay.watch(self, peer_timeout_s)
        self.leader = self.replay.leader
        self.worker = EngineThread(self)  # what the engine's own thread does
        loop = self.worker.run if self.leader else functools.partial(self.replay.follow, self.worker)
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
        self._check_leader("takes requests")
        self.replay.check_replayable(stop_check)
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
        self.replay.check_replayable(None, checked)
        with self._lock:
            if self._closed:
                raise EngineClosedError(f"the engine is closed{self._failure_note()}")
            if self._waiting >= self.max_queue + self._free_slots:  # a burst may fill the free slots too
                raise EngineFullError(f"the engine's queue is full ({self.max_queue} requests waiting)")
            adapter = checked.params.lora
            if adapter is not None and self.model.lora.slots.get(adapter) != checked.lora_slot:
                raise InvalidRequestError(
                    f"LoRA adapter {adapter!r} was unloaded while the request was checked"
                )
            rid = self._next_id
            self._next_id += 1
            handle = self.worker.build(rid, checked, stop_check)
            self._handles[rid] = handle
            self._waiting += 1
        self._inbox.put(("submit", handle))
        return handle

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

    # -- jobs the engine's thread runs between two steps (any thread; serving/thread.py) ------------

    def warmup(self, progress: Callable[[int, int], None] | None = None, background: bool = False) -> int:
        """Compile every prefill and step program a request without a grammar can need (each
        admission size and prompt-length bucket, each K up to the engine's and each row bucket),
        so that no request waits for a compilation. ``progress(done, total)`` is called on the
        engine's thread after each program; returns how many there are. By default it returns
        when all are compiled (requests submitted meanwhile wait); with ``background`` it returns
        at once and the engine compiles them, smallest first, whenever no request runs (a request
        meanwhile may still compile the program it needs; ``stats()["warmup_left"]`` counts down).
        (Process 0 of a multi-process run: the others follow.)"""
        self._check_leader("warms up")
        if background:
            jobs = self.warming.plan()
            self._inbox.put(("warmup_background", (jobs, progress)))
            return len(jobs)
        return self.worker.call("warmup", progress)

    def prompt_logprobs(
        self, prompt: Sequence[int] | str, n: int = 0, lora: str | None = None
    ) -> list[TokenLogprob | None]:
        """:meth:`mtp_jax.Model.prompt_logprobs` run by the engine's thread between two steps (and by
        every process of a multi-process run): each prompt token's log-probability after the ones
        before it, with the ``n`` most likely (None for the first token). Blocks until done."""
        self._check_leader("scores prompts")
        ids = self.model.check_tokens(
            self.model.text.encode(prompt) if isinstance(prompt, str) else list(prompt), "prompt"
        )
        if len(ids) > self.max_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens, beyond the engine's context of {self.max_len} tokens"
            )
        n = check_logprobs("prompt_logprobs", n)
        self.model._lora_slots(lora, 1)  # a known adapter (checked again on the engine's thread)
        return self.worker.call("prompt_logprobs", ([int(t) for t in ids], n, lora))

    # -- LoRA adapters while serving (any thread) ----------------------------------------------

    def load_lora(self, name: str, path: str | os.PathLike[str]) -> None:
        """Load the PEFT LoRA adapter in directory ``path`` under ``name`` while the engine serves:
        read and checked on the calling thread (:class:`~mtp_jax.AdapterError` naming what cannot be
        applied), then written into a free slot by the engine's thread between two steps. Nothing
        compiles and requests already running are not disturbed; requests may name ``name`` once
        this returns. The model needs free LoRA slots (``mtp_jax.load(..., max_loras=N)``). The
        other processes of a multi-process run read the adapter from the same path."""
        self._check_leader("loads adapters")
        table = self.model.lora
        if table is None:
            raise InvalidRequestError(
                "this engine's model has no LoRA slots: load it with max_loras=N (and max_lora_rank=R)"
            )
        adapter, values = table.prepare(name, path)  # refused here: the engine's thread only writes
        self.worker.call("lora_load", (name, adapter, values))

    def unload_lora(self, name: str) -> None:
        """Free adapter ``name``'s slot between two steps (nothing compiles). Refused while a request
        that names it waits or runs: cancel those, or let them finish, first."""
        self._check_leader("unloads adapters")
        if name not in self.model.loras:
            loaded = ", ".join(repr(n) for n in self.model.loras) or "none"
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})")
        self.worker.call("lora_unload", name)

    def _check_leader(self, what: str) -> None:
        if not self.leader:
            raise InvalidRequestError(
                f"this is process {self.replay.channel.me} of a multi-process run: process 0's engine "
                f"{what} (the others follow it)"
            )

    def fail(self, error: BaseException) -> None:
        """End the engine with ``error``: every waiting and running request is closed with it (an
        :class:`EngineClosedError`: cancelled). Its own loop calls it when a step fails; in a
        multi-process run, the replay when process 0 closes or another process is lost."""
        with self._lock:
            self._closed = True
            if not isinstance(error, EngineClosedError):
                self._failure = error
            handles = list(self._handles.values())
            self._handles.clear()
        for handle in handles:
            handle._close("error" if self._failure is not None else "cancelled", self._failure)

    # -- lifecycle (fail: also the engine's thread and the replay) -----------------------------------

    def close(self, timeout: float | None = 60.0) -> None:
        """Stop taking requests, cancel those still waiting or running, and stop the thread. (On the
        other processes of a multi-process run: wait up to ``timeout`` for process 0 to close.)"""
        with self._lock:
            self._closed = True
        self.replay.stop_watching()  # the others stop with this engine: their silence is no fault
        self._inbox.put(("close", None))
        self._thread.join(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the engine's loop ends (closed) or the engine fails (its thread may then still
        be waiting inside a collective for a lost process); True if either happened. What the other
        processes of a multi-process run do while process 0 serves."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._thread.is_alive() and self._failure is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._thread.join(0.2 if left is None else min(0.2, left))
        return True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict:
        """The engine's counters (the names serving engines export) and its occupancy."""
        return {
            **occupancy(self.scheduler),
            "slots": self.slots,
            "waiting": self._waiting,
            "warmup_left": self.warming.left,  # programs a background warm-up has left
            "finished": dict(self._finished_by),
            "prompt_tokens": self._prompt_tokens,
            "generation_tokens": self._generation_tokens,
        }
