"""A submitted request as its caller sees it: tokens and text as they come, the result, cancel."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING

from mtp_jax.request import CheckedRequest
from mtp_jax.scheduler import Request, TokenLogprob
from mtp_jax.text import TextStream

if TYPE_CHECKING:
    from mtp_jax.serving.engine import Engine

StopCheck = Callable[[int], bool]
"""Called with every emitted token of a request (after it is recorded); True stops the request
with finish reason "stop" (stop strings are checked this way)."""


@dataclasses.dataclass
class Completion:
    """A finished request: its new tokens, why it stopped ("eos", "length", "stop", "grammar",
    "cancelled", or "error"), its speculation counters (:class:`~mtp_jax.scheduler.SpecCounters`) and
    latencies (:meth:`~mtp_jax.scheduler.Request.timings`: time to first token from the engine's
    submit), its text (with a text prompt or stop strings), and with ``logprobs`` asked one
    :class:`~mtp_jax.TokenLogprob` per token."""

    tokens: list[int]
    finish_reason: str
    stats: dict
    text: str | None = None
    logprobs: list[TokenLogprob] | None = None


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
        wake(waiters)

    def _close(self, reason: str, error: BaseException | None = None) -> None:
        tail = self._text.finish() if self._text is not None and error is None else ""
        with self._cond:
            if self._finish is not None:
                return
            self._finish, self._error, self._tail = reason, error, tail
            self._cond.notify_all()
            waiters = list(self._waiters)
        wake(waiters)

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
        counters = {**self.request.counters.as_dict(), **self.request.timings()}
        return Completion(
            list(self._tokens), self._finish, counters, text, self.token_logprobs(0, len(self._tokens))
        )

    def token_logprobs(self, start: int, stop: int) -> list[TokenLogprob] | None:
        """The log-probabilities of tokens [start, stop) the handle has given out (None if the request
        did not ask): each is recorded before its token is."""
        if self.request.logprobs is None:
            return None
        return self.request.token_logprobs[start:stop]


def wake(waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]) -> None:
    for loop, event in waiters:
        with contextlib.suppress(RuntimeError):  # that event loop is closed
            loop.call_soon_threadsafe(event.set)


def token_hook(handle: RequestHandle, stops: frozenset[int] | None, stop: StopCheck | None) -> Callable:
    def on_token(token: int) -> bool:
        hit = handle._push(token)
        return hit or (stops is not None and token in stops) or (stop is not None and bool(stop(token)))

    return on_token
