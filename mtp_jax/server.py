"""``mtp-jax serve``: an OpenAI-compatible HTTP server over the persistent engine.

Starlette routes on uvicorn (the ``serve`` extra: ``pip install 'mtp-jax[serve]'``):

- ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream`` as server-sent events),
  with ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``, ``n``,
  ``response_format`` ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema":
  ...}}, or {"type": "regex", "regex": ...}), and the extension object ``speculation``
  ({"num_speculative_tokens", "relaxed_topk", "relaxed_delta"}) and vLLM's ``ignore_eos`` and
  ``cache_salt`` per request; log-probabilities (chat: ``logprobs`` and ``top_logprobs``;
  completions: ``logprobs`` n, and ``echo`` with the prompt's own, ``max_tokens`` 0 for the
  prompt alone, as evaluation harnesses score log-likelihoods), from the target's raw
  distribution, streamed or whole, the same with speculation as without;
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text; the speculative-decoding
  and prefix-cache counters under vLLM's names, ``vllm:spec_decode_num_accepted_tokens_total``,
  ``vllm:prefix_cache_hits_total`` and the rest);
- LoRA adapters (``--lora-modules``) are served as models of their own: a request names one as its
  ``model``. With ``runtime_lora`` (``--allow-runtime-lora-updating``), ``POST
  /v1/load_lora_adapter`` ({"lora_name", "lora_path"}) and ``POST /v1/unload_lora_adapter``
  ({"lora_name"}) load and unload them while serving (vLLM's routes), into the model's free slots.

With an API key (``--api-key`` or ``MTP_JAX_API_KEY``) every ``/v1`` request needs it as a bearer
token (401); a request body over ``--max-request-bytes`` (16 MiB) gets 413 before it is read, and
prompts are tokenised off the event loop, so no single request makes the server deaf.

A bad request gets an OpenAI-style error body (``{"error": {"message", "type", "param",
"code"}}``) with HTTP 400 and the server keeps serving; a full queue gets 429. A client that
disconnects cancels its requests (their pages are freed at once).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from mtp_jax.errors import InvalidRequestError
from mtp_jax.request import SamplingParams
from mtp_jax.sampling import MAX_LOGPROBS
from mtp_jax.serving import Engine, EngineClosedError, EngineFullError, RequestHandle

log = logging.getLogger(__name__)

FINISH = {"eos": "stop", "stop": "stop", "grammar": "stop", "length": "length", "cancelled": "abort"}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed")
SPECULATION_FIELDS = ("num_speculative_tokens", "relaxed_topk", "relaxed_delta")


class BadRequest(Exception):
    """A request the server refuses, with the HTTP status and OpenAI error type to answer with."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error", param=None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


def _error(message: str, status: int = 400, kind: str = "invalid_request_error", param=None):
    from starlette.responses import JSONResponse

    return JSONResponse(_error_body(message, kind, param), status_code=status)


def _error_body(message: str, kind: str, param=None, code=None) -> dict:
    """An OpenAI-style error object (a response's body, or a stream's last event)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


MAX_REQUEST_BYTES = 16 * 2**20


async def _json_object(request, limit: int, timeout: float | None = None) -> Mapping:
    """The request's JSON object body, read as it arrives and refused (413) once over ``limit``
    bytes, whatever its Content-Length said (a chunked body has none); 408 when it has not all
    arrived within ``timeout`` seconds (a client sending slowly holds no worker forever)."""
    chunks: list[bytes] = []

    async def read() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BadRequest(f"the request body is over {limit} bytes", 413)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise BadRequest(f"the request body did not arrive within {timeout:g} s", 408) from None
    try:
        body = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, Mapping):
        raise BadRequest("the request body must be a JSON object")
    return body


def _number(body: Mapping, name: str, kind: type, default):
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        ok = ok and float(value).is_integer()
    if not ok:
        raise BadRequest(
            f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}", param=name
        )
    return kind(value)


def _logprobs(body: Mapping, chat: bool) -> int | None:
    """How many alternatives per token a request asks log-probabilities of (None: none). Chat:
    ``logprobs`` true, ``top_logprobs`` of them; completions: ``logprobs`` n."""
    if chat:
        wanted = body.get("logprobs", False)
        if wanted not in (None, True, False):
            raise BadRequest(f"logprobs must be a boolean, got {wanted!r}", param="logprobs")
        top = _number(body, "top_logprobs", int, None)
        if top is not None and not wanted:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        n, name = (top or 0) if wanted else None, "top_logprobs"
    else:
        n, name = _number(body, "logprobs", int, None), "logprobs"
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise BadRequest(f"{name} must be in [0, {MAX_LOGPROBS}], got {n}", param=name)
    return n


def _grammar(body: Mapping) -> dict | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping) or not isinstance(fmt.get("type"), str):
        raise BadRequest("response_format must be an object with a 'type'", param="response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind in ("json_object", "json_schema"):
        return dict(fmt)
    if kind == "regex":
        return {"regex": fmt.get("regex")}
    raise BadRequest(
        f"response_format type {kind!r} is not one of text, json_object, json_schema, regex",
        param="response_format",
    )


def request_settings(
    body: Mapping,
    *,
    adapter: str | None,
    model_name: str,
    max_len: int,
    default_max_tokens: int | None,
    prompt_len: int,
    chat: bool,
    echo: bool = False,
) -> dict:
    """A completion or chat request's settings, checked (400 naming the field): its
    :class:`~mtp_jax.SamplingParams` under "params", whether it generates (max_tokens 0 with echo
    does not), ``n``, ``stream``, whether a seed was given, and the model name it answers as."""
    room = max_len - prompt_len
    if room < 1:
        raise BadRequest(
            f"the prompt has {prompt_len} tokens, beyond the engine's context of "
            f"{max_len} tokens (prompt and completion together)",
            param="messages" if "messages" in body else "prompt",
        )
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(
        body, name, int, room if default_max_tokens is None else min(default_max_tokens, room)
    )
    if max_tokens < (0 if echo else 1):
        raise BadRequest(
            f"max_tokens must be at least {0 if echo else 1}"
            f"{'' if echo else ' (0 only with echo: the prompt scored alone)'}, got {max_tokens}",
            param="max_tokens",
        )
    if prompt_len + max_tokens > max_len:
        raise BadRequest(
            f"the prompt has {prompt_len} tokens; with max_tokens={max_tokens} it would reach "
            f"{prompt_len + max_tokens}, beyond the engine's context of {max_len} tokens",
            param="max_tokens",
        )
    kw: dict = {"max_new_tokens": max_tokens, "lora": adapter, "logprobs": _logprobs(body, chat)}
    kw["temperature"] = _number(body, "temperature", float, 1.0)
    kw["top_p"] = _number(body, "top_p", float, 1.0)
    kw["top_k"] = _number(body, "top_k", int, 0)
    if kw["top_k"] == -1:  # vLLM's spelling of "off"
        kw["top_k"] = 0
    kw["min_p"] = _number(body, "min_p", float, 0.0)
    seed = body.get("seed")
    kw["seed"] = secrets.randbelow(2**32) if seed is None else _number(body, "seed", int, 0)
    kw["stop"] = body.get("stop")
    ignore_eos = body.get("ignore_eos", False)  # vLLM's extension: benchmarks use it
    if not isinstance(ignore_eos, bool):
        raise BadRequest(f"ignore_eos must be a boolean, got {ignore_eos!r}", param="ignore_eos")
    kw["ignore_eos"] = ignore_eos
    kw["grammar"] = _grammar(body)
    salt = body.get("cache_salt")  # vLLM's extension: prefix-cache isolation between tenants
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BadRequest(f"cache_salt must be a non-empty string, got {salt!r}", param="cache_salt")
    kw["cache_salt"] = salt
    spec = body.get("speculation") or {}
    if not isinstance(spec, Mapping) or set(spec) - set(SPECULATION_FIELDS):
        raise BadRequest(
            f"speculation must be an object with some of {SPECULATION_FIELDS}", param="speculation"
        )
    for name in SPECULATION_FIELDS:
        if name in spec:
            kw[name] = _number(spec, name, float if name == "relaxed_delta" else int, None)
    n = _number(body, "n", int, 1)
    if not 1 <= n <= 16:
        raise BadRequest(f"n must be in [1, 16], got {n}", param="n")
    if body.get("stream") not in (None, True, False):
        raise BadRequest("stream must be a boolean", param="stream")
    generate = max_tokens > 0
    if not generate:
        kw["max_new_tokens"] = 1  # a valid request; nothing is generated (see _handle)
    return {
        "params": SamplingParams(**kw),
        "generate": generate,
        "n": n,
        "stream": bool(body.get("stream")),
        "seed_given": seed is not None,
        "model": adapter or model_name,
    }


class OpenAIFormat:
    """OpenAI's shapes of a response's choices and log-probabilities, token texts from ``codec``
    (the model's :class:`~mtp_jax.text.TextCodec`)."""

    def __init__(self, codec: Any) -> None:
        self.codec = codec

    def chat_choices(self, records: list[dict], n_top: int | None) -> list[dict]:
        """The choices of a finished (not streamed) chat completion."""
        return [
            {
                "index": i,
                "message": {"role": "assistant", "content": r["text"]},
                "finish_reason": r["finish_reason"],
                "logprobs": None if n_top is None else self.chat_logprobs(r["entries"]),
                "speculation": r["spec"],
            }
            for i, r in enumerate(records)
        ]

    def completion_choices(
        self, records: list[dict], n_top: int | None, echoed: str, prompt_entries: list | None
    ) -> list[dict]:
        """The choices of a finished (not streamed) completion: the echoed prompt's text and
        log-probabilities ahead of each choice's own."""
        choices = []
        for i, r in enumerate(records):
            logprobs = None
            if n_top is not None:  # the completion's offsets start where the echoed text ends, as streamed
                logprobs, _ = self.completion_logprobs(prompt_entries or [], 0)
                own, _ = self.completion_logprobs([(e.token, e) for e in r["entries"]], len(echoed))
                logprobs = {key: logprobs[key] + own[key] for key in logprobs}
            choice = {"index": i, "text": echoed + (r["text"] or ""), "finish_reason": r["finish_reason"]}
            choices.append({**choice, "logprobs": logprobs, "speculation": r["spec"]})
        return choices

    def token(self, token: int, logprob: float | None) -> dict:
        text = self.codec.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat_logprobs(self, entries: list) -> dict:
        """OpenAI's chat ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs}, ...]}."""
        return {
            "content": [
                {**self.token(e.token, e.logprob), "top_logprobs": [self.token(t, lp) for t, lp in e.top]}
                for e in entries
            ]
        }

    def completion_logprobs(self, pairs: list, offset: int) -> tuple[dict, int]:
        """OpenAI's completions ``logprobs`` of (token, TokenLogprob or None) pairs whose text starts
        at character ``offset``: {tokens, token_logprobs, top_logprobs, text_offset}; and the offset
        after them."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        codec = self.codec
        for token, entry in pairs:
            text = codec.token_text(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if entry is None else entry.logprob)
            out["top_logprobs"].append(
                None if entry is None else {codec.token_text(t): lp for t, lp in entry.top}
            )
            out["text_offset"].append(offset)
            offset += len(text)
        return out, offset


class StreamChunks:
    """The streamed chunks of one request, as ``chunk(i, text, finish, first, spec, entries)``: choice
    ``i``'s opening chunk (``first``: the chat role, or a completion's echoed prompt; None when a
    completion echoes nothing) or its next text, finish reason, speculation statistics and
    log-probabilities (a completion's with each choice's running text offset)."""

    def __init__(
        self,
        base: dict,
        fmt: OpenAIFormat,
        chat: bool,
        n_top: int | None,
        echoed: str | None,
        prompt_entries: list | None,
        choices: int,
    ) -> None:
        self.base, self.fmt, self.chat, self.n_top = base, fmt, chat, n_top
        self.echoed, self.prompt_entries = echoed, prompt_entries
        self.kind = "chat.completion.chunk" if chat else "text_completion"
        self.offsets = [0] * max(1, choices)

    def __call__(self, i: int, text, finish, first: bool = False, spec=None, entries=None) -> dict | None:
        if self.chat:
            choice = self._chat(i, text, finish, first, entries)
        elif first:
            return self._echo(i)
        else:
            logprobs = None
            if self.n_top is not None:
                pairs = [(e.token, e) for e in entries or []]
                logprobs, self.offsets[i] = self.fmt.completion_logprobs(pairs, self.offsets[i])
            choice = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        if spec is not None:
            choice["speculation"] = spec
        return {**self.base, "object": self.kind, "choices": [choice]}

    def _chat(self, i: int, text, finish, first: bool, entries) -> dict:
        if first:
            return {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": finish}
        choice = {"index": i, "delta": {} if text is None else {"content": text}, "finish_reason": finish}
        if self.n_top is not None:
            choice["logprobs"] = self.fmt.chat_logprobs(entries or [])
        return choice

    def _echo(self, i: int) -> dict | None:
        if self.echoed is None:
            return None
        logprobs = None
        if self.n_top is not None:
            logprobs, _ = self.fmt.completion_logprobs(self.prompt_entries, 0)
        choice = {"index": i, "text": self.echoed, "finish_reason": None, "logprobs": logprobs}
        self.offsets[i] = len(self.echoed)
        return {**self.base, "object": self.kind, "choices": [choice]}


def _record(handle: RequestHandle) -> dict:
    result = handle.result(timeout=0)
    return {
        "text": result.text,
        "finish_reason": FINISH.get(result.finish_reason, result.finish_reason),
        "tokens": len(result.tokens),
        "entries": result.logprobs or [],
        "spec": {
            "acceptance_length": result.stats["acceptance_length"],
            "num_draft_tokens": result.stats["num_draft_tokens"],
            "num_accepted_tokens": result.stats["num_accepted_tokens"],
        },
    }


def _usage(prompt_len: int, done: list[dict]) -> dict:
    completion = sum(d["tokens"] for d in done)
    return {
        "prompt_tokens": prompt_len,
        "completion_tokens": completion,
        "total_tokens": prompt_len + completion,
    }


async def _wait_all(request, handles: list[RequestHandle]) -> None:
    """Wait for the handles; a client that goes away cancels them."""

    async def drain(h: RequestHandle) -> None:
        async for _ in h.astream():
            pass

    work = asyncio.ensure_future(asyncio.gather(*(drain(h) for h in handles)))
    while not work.done():
        done, _ = await asyncio.wait({work}, timeout=0.5)
        if not done and await request.is_disconnected():
            for h in handles:
                h.cancel()
    await work


async def _events(
    handles: list[RequestHandle], prompt_len: int, chunk, include_usage: bool, engine: Engine
) -> AsyncIterator[bytes]:
    """Server-sent events: each request's pieces as they come (interleaved), then its end; with
    log-probabilities, each piece carries those of the tokens whose text it brings (a token
    holding part of a character waits for the piece that completes it)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, h: RequestHandle) -> None:
        given = 0  # tokens whose log-probabilities went out
        try:
            async for tokens, text in h.astream():  # ends with the handle's error, if any
                if text:
                    entries = h.token_logprobs(given, given + len(tokens))
                    given += len(tokens)
                    await queue.put((i, text, entries, None))
                elif tokens:
                    await queue.put((i, "", h.token_logprobs(given, given + len(tokens)), None))
                    given += len(tokens)
        except RuntimeError:  # the engine failed: the stream says so below
            pass
        finally:
            await queue.put((i, None, None, h))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    done: list[dict] = []
    held: dict[int, list] = {}  # log-probabilities of tokens whose text has not gone out yet
    try:
        for i in range(len(handles)):
            first = chunk(i, None, None, first=True)
            if first is not None:
                yield _sse(first)
        ended = 0
        while ended < len(handles):
            i, text, entries, h = await queue.get()
            if h is None:
                if entries:
                    held.setdefault(i, []).extend(entries)
                if text:
                    yield _sse(chunk(i, text, None, entries=held.pop(i, None)))
                continue
            ended += 1
            if h.finish_reason == "error":  # an error event, then the stream ends properly
                message = f"the engine failed while this request ran: {engine.failure}"
                yield _sse(_error_body(message, "server_error", code=500))
                yield b"data: [DONE]\n\n"
                return
            record = _record(h)
            done.append(record)
            yield _sse(
                chunk(i, None, record["finish_reason"], spec=record["spec"], entries=held.pop(i, None))
            )
        if include_usage:
            yield _sse({**chunk(0, None, None), "choices": [], "usage": _usage(prompt_len, done)})
        yield b"data: [DONE]\n\n"
    finally:  # the client went away (or the stream ended): stop whatever still runs
        for h in handles:
            h.cancel()
        for t in tasks:
            t.cancel()


async def _echo_only(chunk, prompt_len: int, include_usage: bool) -> AsyncIterator[bytes]:
    """The stream of a request that generates nothing (echo with max_tokens 0)."""
    yield _sse(chunk(0, None, None, first=True))
    yield _sse(chunk(0, None, "length"))
    if include_usage:
        yield _sse({**chunk(0, None, None), "choices": [], "usage": _usage(prompt_len, [])})
    yield b"data: [DONE]\n\n"


class Server:
    """The routes over one :class:`~mtp_jax.serving.Engine` serving ``model_name``."""

    def __init__(
        self,
        engine: Engine,
        model_name: str,
        runtime_lora: bool = False,
        api_key: str | None = None,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        request_timeout: float | None = None,
    ) -> None:
        if request_timeout is not None and (
            isinstance(request_timeout, bool)
            or not isinstance(request_timeout, (int, float))
            or not request_timeout > 0
        ):
            raise InvalidRequestError(
                f"request_timeout must be a positive number of seconds, got {request_timeout!r}"
            )
        if (
            isinstance(max_request_bytes, bool)
            or not isinstance(max_request_bytes, int)
            or max_request_bytes < 1
        ):
            raise InvalidRequestError(
                f"max_request_bytes must be a positive integer, got {max_request_bytes!r}"
            )
        self.engine = engine
        self.model_name = model_name
        self.runtime_lora = runtime_lora
        self.api_key = api_key or None
        self.max_request_bytes = max_request_bytes
        self.request_timeout = request_timeout
        self.created = int(time.time())

    # -- request parsing -----------------------------------------------------------------------

    def _adapter(self, body: Mapping) -> str | None:
        """The LoRA adapter a request's ``model`` names (vLLM's convention: an adapter is served
        under its own model name); None for the base model. 400 for a name not served here."""
        model = body.get("model")
        if model is None or model == self.model_name:
            return None
        if isinstance(model, str) and model in self.engine.model.loras:
            return model
        served = ", ".join(repr(m) for m in (self.model_name, *self.engine.model.loras))
        raise BadRequest(f"model {model!r} is not served here; this server serves {served}", param="model")

    def _check_chars(self, chars: int, param: str) -> None:
        """Refuse, before tokenising, a text too long for the context whatever its tokens."""
        most = self.engine.max_len * self.engine.model.text.longest_token_chars
        if chars > most:
            raise BadRequest(
                f"the prompt has {chars} characters: more than the engine's context of "
                f"{self.engine.max_len} tokens can hold (at most {most} characters; refused before "
                "tokenising)",
                param=param,
            )

    def _submit(self, prompt, parsed: dict) -> list[RequestHandle]:
        handles = []
        try:
            for j in range(parsed["n"]):
                params = parsed["params"]
                if j and parsed["seed_given"]:
                    params = dataclasses.replace(params, seed=(params.seed + j) % 2**32)
                elif j:
                    params = dataclasses.replace(params, seed=secrets.randbelow(2**32))
                handles.append(self.engine.submit(prompt, params, detokenize=True))
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        return handles

    # -- responses -----------------------------------------------------------------------------

    # -- routes --------------------------------------------------------------------------------

    async def completions(self, request):
        return await self._handle(request, chat=False)

    async def chat_completions(self, request):
        return await self._handle(request, chat=True)

    async def _handle(self, request, chat: bool):
        from starlette.responses import JSONResponse, StreamingResponse

        try:
            body = await _json_object(request, self.max_request_bytes, self.request_timeout)
            text_codec = self.engine.model.text
            fmt = OpenAIFormat(text_codec)
            prompt = await self._prompt(body, chat)
            echo = body.get("echo", False)
            if echo not in (True, False) or (chat and echo):
                raise BadRequest("echo must be a boolean (completions only)", param="echo")
            sizes = {"max_len": self.engine.max_len, "default_max_tokens": None if chat else 16}
            adapter = self._adapter(body)
            parsed = request_settings(
                body,
                adapter=adapter,
                model_name=self.model_name,
                prompt_len=len(prompt),
                chat=chat,
                echo=echo,
                **sizes,
            )
            n_top = parsed["params"].logprobs
            prompt_entries = None
            if echo and n_top is not None:  # the prompt's own log-probabilities, scored by the engine
                scored = await asyncio.to_thread(
                    self.engine.prompt_logprobs, prompt, n_top, parsed["params"].lora
                )
                prompt_entries = list(zip(prompt, scored, strict=True))
            handles = self._submit(prompt, parsed) if parsed["generate"] else []
            if self.request_timeout is not None:  # whatever the client does, the slot is freed then
                loop = asyncio.get_running_loop()
                for h in handles:
                    loop.call_later(self.request_timeout, h.cancel)
        except BadRequest as e:
            return _error(str(e), e.status, e.kind, e.param)
        except EngineFullError as e:
            return _error(str(e), 429, "rate_limit_error")
        except EngineClosedError as e:
            return _error(str(e), 503, "server_error")
        except InvalidRequestError as e:
            return _error(str(e))

        rid = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        created = int(time.time())
        base = {"id": rid, "created": created, "model": parsed["model"]}
        echoed = text_codec.decode(prompt) if echo else ""
        if not handles:  # max_tokens 0 with echo: the prompt, scored, and nothing else
            records = [{"text": "", "finish_reason": "length", "tokens": 0, "spec": None, "entries": []}]
        if parsed["stream"]:
            opts = body.get("stream_options") or {}
            include_usage = bool(isinstance(opts, Mapping) and opts.get("include_usage"))
            chunk = StreamChunks(
                base, fmt, chat, n_top, echoed if echo else None, prompt_entries, len(handles)
            )
            if not handles:
                return StreamingResponse(
                    _echo_only(chunk, len(prompt), include_usage), media_type="text/event-stream"
                )
            return StreamingResponse(
                _events(handles, len(prompt), chunk, include_usage, self.engine),
                media_type="text/event-stream",
            )
        if handles:
            await _wait_all(request, handles)
            records = [_record(h) for h in handles]
        kind = "chat.completion" if chat else "text_completion"
        if chat:
            choices = fmt.chat_choices(records, n_top)
        else:
            choices = fmt.completion_choices(records, n_top, echoed, prompt_entries)
        return JSONResponse(
            {**base, "object": kind, "choices": choices, "usage": _usage(len(prompt), records)}
        )

    async def _prompt(self, body: Mapping, chat: bool) -> list[int]:
        """A request's prompt as token ids: the chat messages rendered with the model's template, or
        the completion prompt (one string or one list of ids); rendered and tokenised off the event
        loop, so other requests go on meanwhile."""
        text_codec = self.engine.model.text
        if chat:
            messages = body.get("messages")
            if isinstance(messages, list):
                texts = [m.get("content") for m in messages if isinstance(m, Mapping)]
                self._check_chars(sum(len(t) for t in texts if isinstance(t, str)), "messages")
            return await asyncio.to_thread(lambda: text_codec.encode(text_codec.render_chat(messages)))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            self._check_chars(len(prompt), "prompt")
            return await asyncio.to_thread(text_codec.encode, prompt)
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            raise BadRequest("prompt must be a string or a list of token ids (one prompt)", param="prompt")
        return prompt

    async def models(self, request):
        from starlette.responses import JSONResponse

        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "mtp-jax"}
        table = self.engine.model.lora
        adapters = (
            [
                {**card, "id": name, "root": table.paths[name], "parent": self.model_name}
                for name in sorted(table.slots)
            ]
            if table is not None
            else []
        )
        return JSONResponse({"object": "list", "data": [card, *adapters]})

    async def health(self, request):
        from starlette.responses import JSONResponse

        if self.engine.failed:
            return JSONResponse({"status": "error", "message": str(self.engine.failure)}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request):
        from starlette.responses import PlainTextResponse

        text = prometheus_text(self.engine.stats(), self.model_name)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def app(self):
        from starlette.applications import Starlette
        from starlette.routing import Route

        adapters = AdapterRoutes(self)
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/load_lora_adapter", adapters.load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", adapters.unload, methods=["POST"]),
        ]

        async def not_found(request, exc):
            return _error(f"no route {request.method} {request.url.path}", exc.status_code, "not_found_error")

        async def crashed(request, exc):  # never a bare 500 page: an OpenAI-style body
            log.exception("request failed")
            return _error(f"internal error: {exc}", 500, "server_error")

        app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found, 500: crashed})
        return _Guard(app, self.api_key, self.max_request_bytes)


class AdapterRoutes:
    """vLLM's runtime LoRA routes (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``) of a
    :class:`Server`: off unless it was started with ``runtime_lora``."""

    def __init__(self, server: Server) -> None:
        self.server = server

    async def load(self, request):
        return await self._update(request, load=True)

    async def unload(self, request):
        return await self._update(request, load=False)

    async def _update(self, request, load: bool):
        """vLLM's runtime adapter routes: read and check the adapter off the event loop, then the
        engine writes (or frees) its slot between two steps; nothing compiles."""
        from starlette.responses import PlainTextResponse

        try:
            if not self.server.runtime_lora:
                raise BadRequest(
                    "loading and unloading LoRA adapters at run time is off: start the server with "
                    "--allow-runtime-lora-updating (it lets clients make the server read any adapter "
                    "directory it can reach)",
                    403,
                    "permission_error",
                )
            body = await _json_object(request, self.server.max_request_bytes, self.server.request_timeout)
            name = body.get("lora_name")
            if not isinstance(name, str) or not name:
                raise BadRequest("lora_name must be a non-empty string", param="lora_name")
            if name == self.server.model_name:
                raise BadRequest(f"{name!r} is the base model's name", param="lora_name")
            if load:
                path = body.get("lora_path")
                if not isinstance(path, str) or not path:
                    raise BadRequest("lora_path must be a non-empty string", param="lora_path")
                await asyncio.to_thread(self.server.engine.load_lora, name, path)
                return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")
            if name not in self.server.engine.model.loras:
                loaded = ", ".join(repr(n) for n in self.server.engine.model.loras) or "none"
                raise BadRequest(
                    f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})",
                    404,
                    "not_found_error",
                    "lora_name",
                )
            await asyncio.to_thread(self.server.engine.unload_lora, name)
            return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
        except BadRequest as e:
            return _error(str(e), e.status, e.kind, e.param)
        except EngineClosedError as e:
            return _error(str(e), 503, "server_error")
        except (ValueError, FileNotFoundError) as e:  # AdapterError, InvalidRequestError included
            return _error(str(e), param="lora_path" if load else "lora_name")


class _Guard:
    """ASGI middleware in front of the routes: without the API key's bearer token a ``/v1`` request
    gets 401 (``/health`` and ``/metrics`` stay open); a body whose Content-Length is over the limit
    gets 413 before any of it is read (bodies without one are counted as they arrive)."""

    def __init__(self, app, api_key: str | None, max_request_bytes: int) -> None:
        self.app, self.api_key, self.limit = app, api_key, max_request_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        refusal = None
        if self.api_key is not None and scope["path"].startswith("/v1"):
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + self.api_key.encode()):
                refusal = (
                    "a valid API key is needed: Authorization: Bearer <key>",
                    401,
                    "authentication_error",
                )
        length = headers.get(b"content-length")
        if refusal is None and length is not None:
            if not length.isdigit():
                refusal = (
                    f"Content-Length must be a number of bytes, got {length!r}",
                    400,
                    "invalid_request_error",
                )
            elif int(length) > self.limit:
                refusal = (f"the request body is over {self.limit} bytes", 413, "invalid_request_error")
        if refusal is None:
            return await self.app(scope, receive, send)
        await _error(refusal[0], refusal[1], refusal[2])(scope, receive, send)


def prometheus_text(st: dict, model_name: str) -> str:
    """An engine's counters (:meth:`mtp_jax.serving.Engine.stats`) in Prometheus text format, named
    as vLLM names them (ours ``mtp_jax:``), labelled with the served model name."""
    label = f'model_name="{model_name}"'
    lines = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for extra, value in samples:
            labels = label + (f",{extra}" if extra else "")
            lines.append(f"{name}{{{labels}}} {value}")

    metric("vllm:num_requests_running", "gauge", "Requests in a decode slot.", [("", st["running"])])
    metric("vllm:num_requests_waiting", "gauge", "Requests waiting for a slot.", [("", st["waiting"])])
    used = 1 - st["free_pages"] / max(st["num_pages"], 1)
    metric("vllm:kv_cache_usage_perc", "gauge", "Fraction of KV-cache pages in use.", [("", used)])
    metric(
        "mtp_jax:warmup_programs_left", "gauge", "Programs the background warm-up has left to compile.",
        [("", st["warmup_left"])],
    )  # fmt: skip
    metric(
        "vllm:prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
        [("", st["prompt_tokens"])],
    )  # fmt: skip
    metric(
        "vllm:generation_tokens_total", "counter", "Tokens generated by finished requests.",
        [("", st["generation_tokens"])],
    )  # fmt: skip
    metric(
        "vllm:request_success_total", "counter", "Finished requests by finish reason.",
        [(f'finished_reason="{k}"', v) for k, v in sorted(_by_reason(st["finished"]).items())],
    )  # fmt: skip
    metric(
        "vllm:prefix_cache_queries_total", "counter",
        "Prompt tokens looked up in the prefix cache (admitted requests).",
        [("", st.get("prefix_cache_queries", 0))],
    )  # fmt: skip
    metric(
        "vllm:prefix_cache_hits_total", "counter",
        "Prompt tokens found in the prefix cache (not prefilled again).",
        [("", st.get("prefix_cache_hits", 0))],
    )  # fmt: skip
    metric(
        "vllm:spec_decode_num_drafts_total", "counter", "Steps that verified drafts.",
        [("", st["num_drafts"])],
    )  # fmt: skip
    metric(
        "vllm:spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified.",
        [("", st["num_draft_tokens"])],
    )  # fmt: skip
    metric(
        "vllm:spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
        [("", st["num_accepted_tokens"])],
    )  # fmt: skip
    metric(
        "vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
        "Steps that accepted the draft at each position (0-based).",
        [(f'position="{j}"', v) for j, v in enumerate(st["num_accepted_tokens_per_pos"])],
    )  # fmt: skip
    metric(
        "mtp_jax:spec_decode_expected_accepted_tokens_total", "counter",
        "Draft tokens accepted as the draft's calibrated confidences expected (a draft with a "
        "confidence head; against vllm:spec_decode_num_accepted_tokens_total: the calibration).",
        [("", st.get("expected_accepted_tokens", 0.0))],
    )  # fmt: skip
    metric(
        "mtp_jax:spec_decode_steps_per_verified_drafts_total", "counter", "Row-steps by drafts verified.",
        [(f'drafts="{n}"', v) for n, v in enumerate(st.get("steps_per_verified_drafts", []))],
    )  # fmt: skip
    metric(
        "mtp_jax:spec_decode_drafts_by_source_total", "counter",
        "Row-steps, draft tokens verified and draft tokens accepted by where the row's drafts came "
        "from (suffix decoding: text, index, none; a hybrid: also neural).",
        [(f'source="{source}",count="{what}"', v)
         for source, counts in st.get("drafts_by_source", {}).items() for what, v in counts.items()],
    )  # fmt: skip
    return "\n".join(lines) + "\n"


def _by_reason(finished: dict[str, int]) -> dict[str, int]:
    """Finish reasons as the API names them ("eos" and "stop" are both "stop", ...)."""
    out: dict[str, int] = {}
    for reason, count in finished.items():
        name = FINISH.get(reason, reason)
        out[name] = out.get(name, 0) + count
    return out


def _sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def serve(
    engine: Engine,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    runtime_lora: bool = False,
    api_key: str | None = None,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    request_timeout: float | None = None,
    shutdown_timeout: float | None = 60.0,
    ready: Callable[[int], None] | None = None,
) -> None:
    """Run the server until interrupted (uvicorn). ``port`` 0: a free port the system picks (the
    server binds it itself, so no other process can take it between a choice and the bind);
    ``ready(port)`` is called, from another thread, once the server accepts connections on
    ``port``. ``runtime_lora``: enable the routes that load and unload LoRA adapters while
    serving. ``api_key``: every ``/v1`` request must carry it as a bearer
    token (401 otherwise). ``max_request_bytes``: larger request bodies get 413 unread.
    ``request_timeout``: a request body must arrive within it (408) and a request running longer is
    cancelled (finish reason "abort"), its slot freed, whether or not its client reads. On SIGTERM or
    SIGINT the server drains: it stops accepting connections and lets the requests in flight finish,
    for at most ``shutdown_timeout`` seconds (then they are cancelled), and returns. When the engine
    fails (a device error; in a multi-process run, another process lost) its requests end with an
    error (an error event in a stream) and the server stops and returns: check ``engine.failed``."""
    try:
        import uvicorn
    except ImportError as e:
        raise InvalidRequestError("mtp-jax serve needs the serve extra: pip install 'mtp-jax[serve]'") from e
    if shutdown_timeout is not None and not shutdown_timeout >= 0:
        raise InvalidRequestError(f"shutdown_timeout must be >= 0 seconds, got {shutdown_timeout!r}")
    app = Server(engine, model_name, runtime_lora, api_key, max_request_bytes, request_timeout).app()
    level = os.environ.get("MTP_JAX_LOG_LEVEL", "info")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family)
    except OSError as e:
        raise InvalidRequestError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    bound = sock.getsockname()[1]
    # uvicorn drains on SIGTERM, then raises it again under the handler it found: with the default
    # one the process would die of it after draining; with this one serve() returns and the caller
    # closes the engine and exits normally
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: None) if main else None
    config = uvicorn.Config(
        app, host=host, port=port, log_level=level, timeout_graceful_shutdown=shutdown_timeout
    )
    server = uvicorn.Server(config)
    stop = threading.Event()

    def watch() -> None:  # a failed engine answers nothing more: stop serving, so the caller exits
        waiting = ready is not None
        while not stop.wait(0.01 if waiting else 0.2):
            if waiting and server.started:
                waiting = False
                ready(bound)
            if engine.failed:
                log.error("the engine failed (%s): the server stops", engine.failure)
                stop.wait(1.0)  # the requests it failed get their error bodies and events out first
                server.should_exit = True
                return

    watcher = threading.Thread(target=watch, name="mtp-jax-engine-watch", daemon=True)
    watcher.start()
    try:
        server.run(sockets=[sock])
    finally:
        stop.set()
        sock.close()
        if main:
            signal.signal(signal.SIGTERM, previous)
