"""The persistent engine: requests from many threads (and event loops) at any time, cancellations,
the bounded queue, refusals; every finished request equals offline ``generate`` for its prompt."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

import mtp_jax
from tests.conftest import EMBEDDED_MODEL, require_extra

PROMPTS = [[1, 40 + i, 7, 100 + 3 * i][: 2 + i % 3] for i in range(12)]


@pytest.fixture(scope="module")
def model():
    return mtp_jax.load(EMBEDDED_MODEL, "float32")


@pytest.fixture(scope="module")
def engine(model):
    with mtp_jax.Engine(model, slots=4, max_len=128, draft="mtp", num_speculative_tokens=3) as engine:
        yield engine


def _offline(model, **kw):
    return model.generate(PROMPTS, draft="mtp", num_speculative_tokens=3, max_batch=4, **kw)


def _wait_idle(engine, timeout=60.0):
    t0 = time.monotonic()
    while engine.stats()["running"] or engine.stats()["waiting"]:
        assert time.monotonic() - t0 < timeout, engine.stats()
        time.sleep(0.01)


def test_requests_from_many_threads_equal_offline_generate(model, engine):
    """Twelve requests from twelve threads at staggered times (sampled, per-request seeds and
    lengths), three cancelled midway: every finished one has exactly offline generate's tokens,
    streamed once each and in order; the cancelled ones a prefix of them; all pages come back."""
    lengths = [20 + 3 * i for i in range(12)]
    # a row's tokens do not depend on its length limit: one offline run, cut to each request's
    full = _offline(model, max_new_tokens=max(lengths), temperature=0.9, seed=list(range(12))).tokens
    want = [full[i][:n] for i, n in enumerate(lengths)]
    streamed: dict[int, list[int]] = {}
    results = {}
    cancel = {2, 7, 11}
    rng = random.Random(0)
    delays = [rng.uniform(0, 0.3) for _ in PROMPTS]

    def client(i: int) -> None:
        time.sleep(delays[i])
        h = engine.submit(PROMPTS[i], max_new_tokens=lengths[i], temperature=0.9, seed=i)
        got = []
        for tok in h:
            got.append(tok)
            if i in cancel and len(got) == 5:
                h.cancel()
        streamed[i] = got
        results[i] = h.result(timeout=60)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i in range(12):
        r = results[i]
        assert streamed[i] == r.tokens, i
        if i in cancel and r.finish_reason == "cancelled":
            assert 5 <= len(r.tokens) < lengths[i] and r.tokens == want[i][: len(r.tokens)], i
        else:
            assert r.tokens == want[i] and r.finish_reason in ("eos", "length"), (i, r.finish_reason)
            assert r.stats["num_draft_tokens"] > 0
        # latencies from the engine's submit: the first token, then the tokens after it
        assert r.stats["time_to_first_token_seconds"] > 0 and r.stats["time_per_output_token_seconds"] > 0
    assert any(results[i].finish_reason == "cancelled" for i in cancel)
    _wait_idle(engine)
    stats = engine.stats()
    assert stats["free_pages"] == stats["num_pages"]
    assert {k for k, _ in stats["step_shapes"]} == {3} and {r for _, r in stats["step_shapes"]} <= {1, 2, 4}


def test_async_clients_and_per_request_k(model, engine):
    """Eight concurrent ``async for`` consumers in one event loop, greedy, K = 3 / 1 / 0 (plain)
    per request: plain greedy's tokens for all."""
    want = model.generate(PROMPTS[:8], max_new_tokens=24, max_batch=4).tokens

    async def consume(i: int) -> list[int]:
        h = engine.submit(PROMPTS[i], max_new_tokens=24, num_speculative_tokens=[3, 1, 0][i % 3])
        return [tok async for tok in h]

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(consume(i) for i in range(8)))

    assert asyncio.run(main()) == want


def test_stops_and_refusals(model, engine):
    h = engine.submit(PROMPTS[0], max_new_tokens=30, ignore_eos=True)
    plain = h.result(timeout=60).tokens
    stop_at = plain[6]
    r = engine.submit(PROMPTS[0], max_new_tokens=30, stop_token_ids=[stop_at]).result(timeout=60)
    assert r.finish_reason == "stop" and r.tokens == plain[: plain.index(stop_at) + 1]
    seen = []
    r = engine.submit(PROMPTS[0], max_new_tokens=30, stop_check=lambda t: seen.append(t) or len(seen) == 4)
    assert r.result(timeout=60).tokens == plain[:4] and r.finish_reason == "stop"
    with pytest.raises(mtp_jax.InvalidRequestError, match="beyond the engine's context of 128 tokens"):
        engine.submit([1] * 100, max_new_tokens=29)
    with pytest.raises(
        mtp_jax.InvalidRequestError, match=r"num_speculative_tokens must be an integer in \[0, 3\]"
    ):
        engine.submit(PROMPTS[0], num_speculative_tokens=4)
    with pytest.raises(mtp_jax.InvalidRequestError, match="token id 99999"):
        engine.submit([1, 99999])
    with pytest.raises(mtp_jax.InvalidRequestError, match="top_p"):
        engine.submit(PROMPTS[0], top_p=0.0)
    with pytest.raises(
        mtp_jax.InvalidRequestError, match="relaxed_topk needs an engine created with think_tokens"
    ):
        engine.submit(PROMPTS[0], relaxed_topk=2)
    assert engine.submit(PROMPTS[1], max_new_tokens=3).result(timeout=60).finish_reason in ("eos", "length")
    # one request at a time sits in slot 0: its steps cover that slot alone
    assert (3, 1) in engine.stats()["step_shapes"]


def test_bounded_queue_and_close(model):
    """``max_queue`` requests may wait beyond the free slots (a burst into free slots is not refused)."""
    engine = mtp_jax.Engine(model, slots=1, max_len=64, max_queue=0)
    running = engine.submit(PROMPTS[0], max_new_tokens=40, ignore_eos=True)  # takes the free slot
    with pytest.raises(mtp_jax.EngineFullError, match="queue is full"):
        engine.submit(PROMPTS[0], max_new_tokens=8)
    engine.close()
    assert running.result(timeout=60).finish_reason in ("length", "cancelled")
    with pytest.raises(mtp_jax.EngineClosedError):
        engine.submit(PROMPTS[0], max_new_tokens=8)
    engine = mtp_jax.Engine(model, slots=1, max_len=64, max_queue=8)
    handles = [engine.submit(p, max_new_tokens=40, ignore_eos=True) for p in PROMPTS[:4]]
    engine.close()
    reasons = {h.result(timeout=60).finish_reason for h in handles}
    assert reasons <= {"length", "cancelled"} and "cancelled" in reasons
    with pytest.raises(mtp_jax.InvalidRequestError, match="max_len must be an integer"):
        mtp_jax.Engine(model, max_len=10**9)


def test_a_16_bit_engine_on_the_cpu_warns_its_caller():
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("the warning is for the CPU backend")
    bf16 = mtp_jax.load(EMBEDDED_MODEL, "bfloat16")
    with pytest.warns(UserWarning, match="on the CPU backend") as record:
        engine = mtp_jax.Engine(bf16, slots=1, max_len=64)
    engine.close()
    assert [w.filename for w in record] == [__file__]  # points at the line that built the engine


def test_grammar_requests(model, engine):
    require_extra("llguidance")
    import re

    handles = [
        engine.submit(p, max_new_tokens=24, temperature=1.0, seed=i, grammar={"regex": r"(ab|cd){2,4}"})
        for i, p in enumerate(PROMPTS[:4])
    ]
    free = engine.submit(PROMPTS[5], max_new_tokens=16)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(model.tokenizer_path)
    for h in handles:
        r = h.result(timeout=60)
        text = tok.decode([t for t in r.tokens if t not in model.eos_token_ids])
        assert re.fullmatch(r"(ab|cd){2,4}", text), text
    assert free.result(timeout=60).tokens == model.generate([PROMPTS[5]], max_new_tokens=16).tokens[0]
    with pytest.raises(mtp_jax.InvalidRequestError, match="grammar of the request is invalid"):
        engine.submit(PROMPTS[0], grammar={"regex": "("})


def test_an_engine_of_token_trees(model):
    """An engine verifying a token tree each step: its warm-up compiles the tree's step and plain
    decoding's (nothing compiles after it); greedy requests give plain decoding's tokens, capped
    ones too (a cap is a depth: acceptance by depth stops there), one that does not speculate
    too; acceptance statistics come by depth; bad trees and drafts without trees are refused by
    name. (Grammars with trees: tests/test_grammar.py.)"""
    from mtp_jax.step import prefill, step

    tree = {"depth": 3, "topk": 2, "nodes": 6}
    plain = [model.generate([p], max_new_tokens=12).tokens[0] for p in PROMPTS[:3]]
    with mtp_jax.Engine(model, slots=2, max_len=48, draft="mtp", speculative_tree=tree) as engine:
        engine.warmup()
        programs = [f._cache_size() for f in (prefill, step)]
        handles = [
            engine.submit(p, max_new_tokens=12, num_speculative_tokens=cap)
            for p, cap in zip(PROMPTS[:3], (None, 1, 0), strict=True)
        ]
        results = [h.result(timeout=120) for h in handles]
        assert [r.tokens for r in results] == plain
        per_depth = [r.stats["num_accepted_tokens_per_pos"] for r in results]
        assert len(per_depth[0]) == 3 and per_depth[0][0] > 0
        assert per_depth[1][1:] == [0, 0] and sum(per_depth[2]) == 0
        _wait_idle(engine)
        assert [f._cache_size() for f in (prefill, step)] == programs
        with pytest.raises(mtp_jax.InvalidRequestError, match="the token tree's depth"):
            engine.submit(PROMPTS[0], num_speculative_tokens=4)
    for bad, words in (
        ({"depth": 2}, "speculative_tree must be"),
        ({"depth": 4, "topk": 4}, "at most 63 draft nodes"),
        ({"depth": 2, "topk": 2, "nodes": 9}, "got nodes=9"),
        ({"depth": 2, "topk": 2, "nodes": 7, "dynamic": True}, "between 2 and 6 draft nodes"),
        ({"depth": 2, "topk": 2, "dynamic": "yes"}, "dynamic must be true or false"),
    ):
        with pytest.raises(mtp_jax.InvalidRequestError, match=words):
            mtp_jax.Engine(model, slots=2, max_len=48, draft="mtp", speculative_tree=bad)
    dynamic = {"depth": 2, "topk": 2, "dynamic": True}
    with pytest.raises(mtp_jax.InvalidRequestError, match="draft_sampling='argmax'"):
        mtp_jax.Engine(
            model, slots=2, max_len=48, draft="mtp", speculative_tree=dynamic, draft_sampling="sampled"
        )
    with pytest.raises(mtp_jax.InvalidRequestError, match="proposes token trees"):
        mtp_jax.Engine(model, slots=2, max_len=48, draft="ngram", speculative_tree=tree)


def test_warmup_compiles_every_program_requests_need(model):
    """A background warm-up serves a request that arrives in its middle, then finishes while
    idle; after it no request compiles anything: prompts of every length bucket, one and two at
    once, K = 1 and 0, greedy and sampled, short and cancelled."""
    from mtp_jax.step import deactivate, prefill, step

    seen = []
    with mtp_jax.Engine(model, slots=2, max_len=48, draft="mtp", num_speculative_tokens=1) as engine:
        n = engine.warmup(progress=lambda done, total: seen.append((done, total)), background=True)
        first = engine.submit(PROMPTS[3], max_new_tokens=12).result(timeout=120)
        want = model.generate([PROMPTS[3]], max_new_tokens=12, draft="mtp", num_speculative_tokens=1)
        assert first.tokens == want.tokens[0]
        t0 = time.monotonic()
        while engine.stats()["warmup_left"]:
            assert time.monotonic() - t0 < 120
            time.sleep(0.05)
        assert n == len(seen) and seen[-1] == (n, n) and engine.stats()["running"] == 0
        programs = [f._cache_size() for f in (prefill, step, deactivate)]
        for length, k, temperature in [(3, 1, 0.0), (20, 0, 0.8), (39, 1, 0.8)]:
            prompt = [1] + [7 + i % 50 for i in range(length - 1)]
            alone = engine.submit(prompt, max_new_tokens=8, num_speculative_tokens=k, temperature=temperature)
            alone.result(timeout=60)
            pair = [engine.submit(prompt, max_new_tokens=8 - j, temperature=temperature) for j in range(2)]
            for h in pair:
                h.result(timeout=60)
        h = engine.submit(PROMPTS[0], max_new_tokens=30)
        next(iter(h))
        h.cancel()
        h.result(timeout=60)
        _wait_idle(engine)
        assert [f._cache_size() for f in (prefill, step, deactivate)] == programs
        go = threading.Event()
        go.set()
        engine.step_gate = go.is_set
        long = engine.submit(PROMPTS[0], max_new_tokens=40, ignore_eos=True)
        next(iter(long))
        go.clear()  # it stays running (a step at most after this one) until the refusal
        with pytest.raises(mtp_jax.InvalidRequestError, match="before requests run"):
            engine.warmup()
        assert not long.done
        go.set()
        assert len(long.result(timeout=60).tokens) == 40
