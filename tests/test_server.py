"""``mtp-jax serve`` on a loopback port, driven by the official ``openai`` client (completions and
chat, streaming and not, json_schema) and by raw HTTP for bad requests; a bounded load test with
cancelling clients; every greedy response equals offline ``generate``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import shutil
import socket
import threading
import time

import pytest

import mtp_jax
from tests.conftest import EMBEDDED_MODEL, REPO, require_extra

pytestmark = pytest.mark.spawns  # an HTTP server for the module (the served fixture)

require_extra("starlette")
require_extra("uvicorn")
openai = require_extra("openai")
httpx = require_extra("httpx")

NAME = "tiny-chat"
LLAMA = f"{REPO}/checkpoints/tiny-llama3-stdlib"
# A chat template of our own in the hub's tokenizer_config.json layout.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The embedded model (with a chat template) behind a real server on a free loopback port."""
    path = tmp_path_factory.mktemp("served") / NAME
    shutil.copytree(EMBEDDED_MODEL, path)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    model = mtp_jax.load(str(path), "float32")
    engine = mtp_jax.Engine(model, slots=8, max_len=256, draft="mtp", num_speculative_tokens=3, max_queue=128)
    with running_server(engine, NAME) as base:
        yield model, engine, base


@contextlib.contextmanager
def running_server(engine, name: str, runtime_lora: bool = False, close: bool = True, **server_kw):
    """``engine`` served as ``name`` on a free loopback port (yields its base URL); the engine is
    closed after (unless ``close`` is False: a second server over an engine another one serves)."""
    import uvicorn

    from mtp_jax.server import Server

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = Server(engine, name, runtime_lora, **server_kw).app()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(2400):  # at most 2 minutes
        if server.started or not thread.is_alive():
            break
        time.sleep(0.05)
    assert server.started, "the test server did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        if close:
            engine.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[2] + "/v1", api_key="unused")


def _offline_text(model, prompt: str, n: int) -> tuple[str, str]:
    out = model.generate([prompt], max_new_tokens=n)
    return out.texts[0], out.finish_reasons[0]


def test_completions_equal_offline_generate(served, client):
    model = served[0]
    prompt = "def fibonacci(n):"
    want, reason = _offline_text(model, prompt, 24)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == (
        "length" if reason == "length" else "stop"
    )
    ids = model.text.encode(prompt)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens > 0
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model=NAME, prompt=prompt, max_tokens=24, temperature=0, stream=True
        )
    ]
    assert "".join(pieces) == want and len([p for p in pieces if p]) > 1
    # sampled with a seed: the same as offline sampling with that seed
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0.8, seed=7)
    off = model.generate([prompt], max_new_tokens=16, temperature=0.8, seed=7)
    assert r.choices[0].text == off.texts[0]
    two = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0.9, n=2, seed=3)
    assert len(two.choices) == 2 and {c.index for c in two.choices} == {0, 1}


def test_chat_completions_and_stop(served, client):
    model = served[0]
    messages = [{"role": "user", "content": "import os"}]
    prompt = model.text.render_chat(messages)
    want, _ = _offline_text(model, prompt, 20)
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=20, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    stop = want[3:6]
    r = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=20, temperature=0, stop=[stop]
    )
    assert r.choices[0].message.content == want[: want.index(stop)] and r.choices[0].finish_reason == "stop"


def _values(entries) -> list[float]:
    return [e.logprob for e in entries]


def test_logprobs_through_the_api_equal_offline_plain_decodings(served, client):
    """The served engine speculates (MTP, K = 3); each token's log-probability and alternatives, whole
    and streamed, on both routes, equal offline plain decoding's. Echo with max_tokens 0 scores the
    prompt alone, as evaluation harnesses ask (lm-evaluation-harness's local-completions)."""
    model = served[0]
    prompt = "def fibonacci(n):"
    want = model.generate([prompt], max_new_tokens=12, logprobs=3).logprobs[0]
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(_values(want), abs=2e-5)
    assert lp.tokens == [model.text.token_text(e.token) for e in want]
    assert [sorted(d.values(), reverse=True) for d in lp.top_logprobs] == [
        pytest.approx(
            sorted({model.text.token_text(t): v for t, v in e.top}.values(), reverse=True), abs=2e-5
        )
        for e in want
    ]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = list(
        client.completions.create(
            model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=3, stream=True
        )
    )
    streamed = [
        v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed == pytest.approx(_values(want), abs=2e-5)

    messages = [{"role": "user", "content": "import os"}]
    want = model.generate([model.text.render_chat(messages)], max_new_tokens=10, logprobs=2).logprobs[0]
    r = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(_values(want), abs=2e-5)
    assert [[t.logprob for t in c.top_logprobs] for c in content] == [
        pytest.approx([v for _, v in e.top], abs=2e-5) for e in want
    ]
    assert content[0].bytes == list(content[0].token.encode())
    stream = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=10, temperature=0, logprobs=True, stream=True
    )
    streamed = [
        t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ]
    assert [t.logprob for t in streamed] == pytest.approx(_values(want), abs=2e-5)
    assert all(t.top_logprobs == [] for t in streamed)  # logprobs without top_logprobs: the token's own

    scored = model.prompt_logprobs(prompt, 1)
    r = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    lp = r.choices[0].logprobs
    assert (
        r.choices[0].text == model.text.decode(model.text.encode(prompt)) and r.usage.completion_tokens == 0
    )
    assert lp.token_logprobs[0] is None and lp.token_logprobs[1:] == pytest.approx(
        _values(scored[1:]), abs=2e-5
    )
    both = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=4, echo=True, logprobs=1, temperature=0
    )
    ids = model.text.encode(prompt)
    assert both.choices[0].logprobs.token_logprobs[: len(ids)] == lp.token_logprobs
    assert len(both.choices[0].logprobs.tokens) == len(ids) + both.usage.completion_tokens
    assert both.choices[0].text.startswith(r.choices[0].text)
    streamed = list(
        client.completions.create(
            model=NAME, prompt=prompt, max_tokens=4, echo=True, logprobs=1, temperature=0, stream=True
        )
    )
    pieces = [c.choices[0] for c in streamed if c.choices]
    assert "".join(p.text for p in pieces) == both.choices[0].text  # the echoed prompt comes first
    logprobs = [p.logprobs for p in pieces if p.logprobs]
    assert [t for lp in logprobs for t in lp.tokens] == both.choices[0].logprobs.tokens
    offsets = both.choices[0].logprobs.text_offset
    assert [o for lp in logprobs for o in lp.text_offset] == offsets
    assert offsets[len(ids)] == len(r.choices[0].text)  # the completion starts where the echoed text ends


def test_json_schema_response_format(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}
    for seed in range(3):
        r = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=60,
            seed=seed,
            response_format=fmt,
        )
        assert r.choices[0].finish_reason == "stop"
        obj = json.loads(r.choices[0].message.content)
        assert set(obj) == {"name", "ok"} and isinstance(obj["ok"], bool)


BAD = [
    ("/v1/completions", b"{not json", "not valid JSON"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, "is not served here"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, "max_tokens must be at least 1"),
    ("/v1/completions", {"prompt": "x " * 400}, "beyond the engine's context"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature must be a number"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": [1, 99999]}, "token id 99999"),
    ("/v1/completions", {"prompt": {"a": 1}}, "prompt must be a string"),
    ("/v1/chat/completions", {"messages": []}, "non-empty list"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "role"),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}},
        },
        "grammar of the request is invalid: Invalid type",
    ),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "regex", "regex": "("}}, "invalid"),
    (
        "/v1/completions",
        {"prompt": "x", "speculation": {"num_speculative_tokens": 9}},
        "num_speculative_tokens",
    ),
    ("/v1/completions", {"prompt": "x", "n": 99}, "n must be in"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": "yes"}, "ignore_eos must be a boolean"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs must be in [0, 20]"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "0 only with echo"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo must be a boolean"),
    ("/v1/completions", {"prompt": "x", "cache_salt": ""}, "cache_salt must be a non-empty string"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        "needs logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "echo": True},
        "completions only",
    ),
]


@pytest.mark.parametrize(("route", "body", "words"), BAD, ids=[w for _, _, w in BAD])
def test_bad_requests_get_a_400_and_the_server_keeps_serving(served, route, body, words):
    base = served[2]
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(base + route, content=data, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error", err
    ok = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_models_health_metrics_and_unknown_routes(served, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    base = served[2]
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    text = httpx.get(base + "/metrics").text
    samples = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#") and "position=" not in line and "finished_reason" not in line
    }
    assert samples["vllm:spec_decode_num_draft_tokens_total"] > 0
    assert samples["mtp_jax:warmup_programs_left"] == 0  # no warm-up asked for
    assert samples["mtp_jax:spec_decode_expected_accepted_tokens_total"] == 0  # MTP has no confidence head
    assert (
        0
        < samples["vllm:spec_decode_num_accepted_tokens_total"]
        <= samples["vllm:spec_decode_num_draft_tokens_total"]
    )
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny-chat",position="2"}' in text
    by_length = {  # row-steps by the drafts they verified: they add up to the drafts verified
        int(line.split('drafts="')[1].split('"')[0]): float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("mtp_jax:spec_decode_steps_per_verified_drafts_total{")
    }
    assert (
        by_length
        and sum(n * v for n, v in by_length.items()) == samples["vllm:spec_decode_num_draft_tokens_total"]
    )
    r = httpx.get(base + "/v1/nothing")
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]


def _metric(base: str, name: str) -> float:
    line = next(ln for ln in httpx.get(base + "/metrics").text.splitlines() if ln.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_a_shared_prompt_prefix_is_prefilled_once(served, client):
    """Requests that start with the same long instructions: the later ones hit the prefix cache
    (counted under vLLM's metric names) and answer what offline generate does; a request with a
    cache_salt of its own hits nothing."""
    model, _, base = served
    system = "You are a careful assistant. Answer in Python, with a docstring and no comments. " * 2
    hits = _metric(base, "vllm:prefix_cache_hits_total")
    queries = _metric(base, "vllm:prefix_cache_queries_total")
    for i, question in enumerate(["def add(a, b):", "def mul(a, b):", "def add(a, b):"]):
        r = client.completions.create(model=NAME, prompt=system + question, max_tokens=12, temperature=0)
        assert r.choices[0].text == _offline_text(model, system + question, 12)[0]
        if i == 0:  # the first one computes the prefix
            hits = _metric(base, "vllm:prefix_cache_hits_total")
    assert _metric(base, "vllm:prefix_cache_hits_total") >= hits + 2 * 2 * model.page_size
    assert _metric(base, "vllm:prefix_cache_queries_total") > queries
    before = _metric(base, "vllm:prefix_cache_hits_total")
    salted = {"cache_salt": "t1"}
    r = client.completions.create(
        model=NAME, prompt=system + "def add(a, b):", max_tokens=12, temperature=0, extra_body=salted
    )
    assert r.choices[0].text == _offline_text(model, system + "def add(a, b):", 12)[0]
    assert _metric(base, "vllm:prefix_cache_hits_total") == before


def _assert_drained(engine) -> None:
    """Within a minute no request runs or waits, and every cache page is free again."""
    t0 = time.monotonic()
    while engine.stats()["running"] or engine.stats()["waiting"]:
        assert time.monotonic() - t0 < 60
        time.sleep(0.05)
    st = engine.stats()
    assert st["free_pages"] == st["num_pages"]


def test_load_many_streaming_clients_some_cancelling(served):
    """64 concurrent streaming clients on 8 slots, every fourth hanging up after a few pieces:
    each completed greedy response is offline generate's text; all pages come back."""
    model, engine, base = served
    prompts = [f"def f{i}(x):" if i % 2 else f"import m{i}" for i in range(64)]
    want = model.generate(prompts, max_new_tokens=24, max_batch=8).texts

    async def one(http: httpx.AsyncClient, i: int) -> tuple[int, str | None, float]:
        body = {"prompt": prompts[i], "max_tokens": 24, "temperature": 0, "stream": True}
        text, t0, first = "", time.perf_counter(), None
        async with http.stream("POST", base + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                first = first or time.perf_counter() - t0
                text += json.loads(line[6:])["choices"][0]["text"]
                if i % 4 == 3 and len(text) > 4:
                    return i, None, first  # hang up mid-stream
        return i, text, first

    async def run() -> list:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(one(http, i) for i in range(64)))

    results = asyncio.run(run())
    finished = [(i, text) for i, text, _ in results if text is not None]
    assert len(finished) == 48
    for i, text in finished:
        assert text == want[i], i
    _assert_drained(engine)
    metrics = httpx.get(base + "/metrics").text
    assert 'finished_reason="abort"' in metrics


def test_overload_far_beyond_slots_and_queue(served, monkeypatch):
    """96 concurrent requests (half streaming) on 8 slots and a queue of 4: each gets exactly one
    answer, offline generate's text or a 429 body (never a 5xx, never a dropped connection); the
    server stays healthy, every page comes back, and it serves again at once. The engine runs no
    step until the burst is answered or waiting, so exactly the free slots and the queue's worth are
    taken, on any machine."""
    model, engine, base = served
    monkeypatch.setattr(engine, "max_queue", 4)
    taken = 4 + engine.slots - engine.stats()["running"]
    assert taken == 12
    go = threading.Event()
    monkeypatch.setattr(engine, "step_gate", go.is_set)
    refused = []
    prompts = [f"def g{i % 6}(y):" for i in range(96)]
    want = dict(zip(prompts, model.generate(prompts[:6], max_new_tokens=12, max_batch=8).texts, strict=False))

    def refuse(status: int) -> None:  # the last refusal: every request is answered or waiting
        if status == 429:
            refused.append(1)
            if len(refused) == 96 - taken:
                go.set()

    async def one(http: httpx.AsyncClient, i: int) -> tuple[int, str]:
        body = {"prompt": prompts[i], "max_tokens": 12, "temperature": 0, "stream": bool(i % 2)}
        if not i % 2:
            r = await http.post(base + "/v1/completions", json=body)
            refuse(r.status_code)
            payload = r.json()
            return r.status_code, payload["choices"][0]["text"] if r.status_code == 200 else payload["error"][
                "type"
            ]
        async with http.stream("POST", base + "/v1/completions", json=body) as r:
            refuse(r.status_code)
            if r.status_code != 200:
                return r.status_code, json.loads(await r.aread())["error"]["type"]
            text = ""
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
            return 200, text

    async def run() -> list:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as http:
            return await asyncio.gather(*(one(http, i) for i in range(96)))

    results = asyncio.run(run())
    assert len(results) == 96 and {status for status, _ in results} <= {200, 429}
    served_ok = [i for i, (status, _) in enumerate(results) if status == 200]
    # the burst fills the free slots and the queue before the engine admits any of it
    assert len(served_ok) == taken
    for i in served_ok:
        assert results[i][1] == want[prompts[i]], i
    assert all(text == "rate_limit_error" for status, text in results if status == 429)
    _assert_drained(engine)
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    r = httpx.post(base + "/v1/completions", json={"prompt": prompts[0], "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[prompts[0]]


def test_serve_cli_refuses_clearly(capsys):
    from mtp_jax.cli import main

    rc = main(["serve", "--draft", "eagle3"])
    err = capsys.readouterr().err
    assert rc == 2 and "--draft eagle3 needs --draft-model" in err


@pytest.fixture(scope="module")
def lora_served(tmp_path_factory):
    """The tiny Llama with two random LoRA adapters behind a server (``--lora-modules``' path)."""
    from tests.test_lora import write_random_adapter

    base = mtp_jax.load(LLAMA, "float32")
    root = tmp_path_factory.mktemp("adapters")
    adapters = {
        "terse": write_random_adapter(root / "terse", base, 4, ["q_proj", "v_proj"], seed=1, alpha=64),
        "wordy": write_random_adapter(root / "wordy", base, 8, ["gate_proj", "up_proj", "down_proj"], seed=2),
    }
    model = mtp_jax.load(LLAMA, "float32", lora_adapters=adapters, max_loras=3)  # a free slot
    engine = mtp_jax.Engine(model, slots=4, max_len=128, draft="ngram", num_speculative_tokens=2)
    extra = write_random_adapter(root / "extra", base, 8, ["o_proj", "down_proj"], seed=3, alpha=32)
    with running_server(engine, "tiny-llama", runtime_lora=True) as url:
        yield model, url, extra


def test_lora_adapters_are_served_as_models(lora_served):
    """Two adapters served at once through the openai client, each request naming its adapter as
    its model (vLLM's convention), each equal to offline generate with that adapter."""
    model, base, _ = lora_served
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    listed = client.models.list().data
    assert [m.id for m in listed] == ["tiny-llama", "terse", "wordy"]
    assert all(getattr(m, "parent", None) == "tiny-llama" for m in listed[1:])
    prompt = "def parse_args(argv):"
    texts = {}
    for name in ("tiny-llama", "terse", "wordy"):
        lora = None if name == "tiny-llama" else name
        want = model.generate([prompt], max_new_tokens=16, ignore_eos=True, lora=lora).texts[0]
        r = client.completions.create(
            model=name, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].text == want and r.model == name, name
        texts[name] = want
    assert len(set(texts.values())) == 3  # the adapters change the output
    r = httpx.post(base + "/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 400 and "'nope' is not served here" in r.json()["error"]["message"]
    assert "'terse', 'wordy'" in r.json()["error"]["message"]


def test_adapters_load_and_unload_while_serving(lora_served, served):
    """vLLM's runtime routes: an adapter loaded into the free slot is served under its name (equal to
    offline generate with it), unloaded it is gone; the refusals answer with clear error bodies;
    a server started without --allow-runtime-lora-updating refuses with 403."""
    from mtp_jax.step import prefill, step

    model, base, extra = lora_served
    prompt = "def parse_args(argv):"
    body = {"model": "extra", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    before = httpx.post(base + "/v1/completions", json={**body, "model": "tiny-llama"}).json()
    compiled = (step._cache_size(), prefill._cache_size())  # the server's programs, all in use now
    r = httpx.post(base + "/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": str(extra)})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'extra' added successfully."
    listed = [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]]
    assert listed == ["tiny-llama", "extra", "terse", "wordy"]
    got = httpx.post(base + "/v1/completions", json=body).json()["choices"][0]["text"]
    assert (step._cache_size(), prefill._cache_size()) == compiled  # nothing compiled
    want = model.generate([prompt], max_new_tokens=16, ignore_eos=True, lora="extra").texts[0]
    assert got == want != before["choices"][0]["text"]
    for route, payload, status, message in (
        ("load", {"lora_name": "extra", "lora_path": str(extra)}, 400, "'extra' is loaded already"),
        ("load", {"lora_name": "more", "lora_path": str(extra)}, 400, "all 3 LoRA slots are taken"),
        ("load", {"lora_name": "x", "lora_path": str(extra) + "-missing"}, 400, "missing"),
        ("load", {"lora_name": "x"}, 400, "lora_path must be a non-empty string"),
        ("load", {"lora_name": "tiny-llama", "lora_path": str(extra)}, 400, "the base model's name"),
        ("unload", {"lora_name": "nope"}, 404, "no LoRA adapter named 'nope' is loaded"),
    ):
        r = httpx.post(f"{base}/v1/{route}_lora_adapter", json=payload)
        assert r.status_code == status and message in r.json()["error"]["message"], (payload, r.text)
    r = httpx.post(base + "/v1/unload_lora_adapter", json={"lora_name": "extra"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'extra' removed successfully."
    r = httpx.post(base + "/v1/completions", json=body)
    assert r.status_code == 400 and "'extra' is not served here" in r.json()["error"]["message"]
    assert model.loras == ("terse", "wordy")
    r = httpx.post(served[2] + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(extra)})
    assert r.status_code == 403 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]


def test_api_key_and_request_size_guard_the_routes(served):
    """With an API key every /v1 route needs its bearer token (401; /health and /metrics stay open);
    a body over the limit gets 413, from its Content-Length unread or counted as it arrives."""
    from starlette.testclient import TestClient

    from mtp_jax.server import Server

    model, engine, _ = served
    app = Server(engine, NAME, api_key="sekrit", max_request_bytes=1000).app()
    ok = {"Authorization": "Bearer sekrit"}
    with TestClient(app) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = http.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", headers
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 401
        assert http.get("/v1/models", headers=ok).json()["data"][0]["id"] == NAME
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
        big = {"prompt": "x" * 2000, "max_tokens": 1}
        r = http.post("/v1/completions", json=big, headers=ok)
        assert r.status_code == 413 and "over 1000 bytes" in r.json()["error"]["message"]
        chunks = iter([b'{"prompt": "', b"x" * 2000, b'", "max_tokens": 1}'])  # no Content-Length
        r = http.post("/v1/completions", content=chunks, headers=ok)
        assert r.status_code == 413 and "over 1000 bytes" in r.json()["error"]["message"]
        body = {"prompt": "import os", "max_tokens": 4, "temperature": 0}
        r = http.post("/v1/completions", json=body, headers=ok)
        assert (
            r.status_code == 200 and r.json()["choices"][0]["text"] == _offline_text(model, "import os", 4)[0]
        )


def test_request_timeout_frees_the_slot_and_refuses_a_slow_body(served):
    """--request-timeout: a request still running then is cancelled (finish reason "abort", its
    pages freed) and a body that has not all arrived gets 408; the server goes on serving."""
    _, engine, _ = served
    go = threading.Event()  # closed: the engine takes the request but runs no step, on any machine
    engine.step_gate = go.is_set
    try:
        with running_server(engine, NAME, close=False, request_timeout=0.2) as base:
            body = {"prompt": "def f():", "max_tokens": 240, "ignore_eos": True, "temperature": 0}
            r = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
            assert r["choices"][0]["finish_reason"] == "abort" and r["usage"]["completion_tokens"] == 0
            go.set()
            _check_timeouts_go_on(engine, base)
    finally:
        engine.step_gate = None


def _check_timeouts_go_on(engine, base: str) -> None:
    """The aborted request left nothing running; a body that has not all arrived gets 408; the
    server goes on serving."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\ncontent-type: application/json\r\n"
        sock.sendall((head + "content-length: 50\r\n\r\n" + '{"prompt": "x"').encode())
        reply = sock.recv(4096).decode()  # the rest never comes
    assert reply.startswith("HTTP/1.1 408") and "did not arrive within 0.2 s" in reply
    for _ in range(100):
        if engine.stats()["running"] == 0:
            break
        time.sleep(0.05)
    assert engine.stats()["running"] == 0
    ok = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_a_prompt_too_long_for_any_tokenisation_is_refused_untokenised(served, monkeypatch):
    """A text longer than the context times the longest vocabulary entry cannot fit whatever its
    tokens: refused (400) before it is tokenised (the tokenizer is never called), chat too; one
    that may fit is tokenised off the event loop and then judged by its tokens."""
    model, engine, base = served
    most = engine.max_len * model.text.longest_token_chars
    assert 1 < model.text.longest_token_chars < 100
    calls = []
    encode = model.text.encode
    monkeypatch.setattr(model.text, "encode", lambda *a, **k: calls.append(1) or encode(*a, **k))
    for route, body in (
        ("completions", {"prompt": "x" * (most + 1), "max_tokens": 1}),
        ("chat/completions", {"messages": [{"role": "user", "content": "y" * (most + 1)}]}),
    ):
        r = httpx.post(f"{base}/v1/{route}", json=body, timeout=60)
        assert r.status_code == 400 and "refused before tokenising" in r.json()["error"]["message"], route
    assert calls == []
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "import os\n" * (most // 10), "max_tokens": 1})
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"] and calls == [1]


def test_a_failed_engine_ends_streams_with_an_error_and_stops_the_server(served):
    """The engine's loop fails mid-stream (here: failed by hand, as a lost device or process would):
    the stream ends with an OpenAI-style error event and [DONE] rather than a cut connection, and
    serve() returns so that the process can exit non-zero."""
    from mtp_jax.server import serve

    engine = mtp_jax.Engine(served[0], slots=1, max_len=64)
    ports: queue.SimpleQueue = queue.SimpleQueue()
    kwargs = {"port": 0, "ready": ports.put}  # the server binds a free port itself and reports it
    thread = threading.Thread(target=serve, args=(engine, NAME), kwargs=kwargs, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{ports.get(timeout=120)}"
    assert httpx.get(base + "/health", timeout=30).status_code == 200
    lines: list[str] = []
    body = {"prompt": "import os", "max_tokens": 40, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
            if len(lines) == 2:
                engine.fail(RuntimeError("device lost"))
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert "device lost" in error["message"] and error["type"] == "server_error"
    thread.join(30)
    assert not thread.is_alive() and engine.failed
