"""One path for requests (:mod:`mtp_jax.request`): ``SamplingParams`` and ``SpeculativeConfig``
drive ``Model.generate`` and the engine exactly as the keyword form does, each request may carry
its own settings, and ``generate``, ``Engine.submit`` and the server refuse the same bad request
with the same message."""

from __future__ import annotations

import dataclasses

import pytest

import mtp_jax
import mtp_jax.drafts
from mtp_jax import SamplingParams, SpeculativeConfig
from mtp_jax.request import CheckedRequest, check_request, step_config
from tests.conftest import EMBEDDED_MODEL, require_extra

PROMPTS = [[1, 40, 7, 100], [1, 41, 7], [1, 42, 7, 106, 9]]


@pytest.fixture(scope="module")
def model():
    return mtp_jax.load(EMBEDDED_MODEL, "float32")


@pytest.fixture(scope="module")
def engine(model):
    with mtp_jax.Engine(model, slots=4, max_len=64, speculative=SpeculativeConfig("mtp", 3)) as engine:
        yield engine


def test_the_objects_and_the_keyword_form_generate_the_same(model):
    kw = {"max_new_tokens": 12, "temperature": 0.8, "top_k": 20, "seed": 5, "ignore_eos": True}
    keywords = model.generate(PROMPTS, draft="mtp", num_speculative_tokens=3, max_batch=4, **kw)
    objects = model.generate(PROMPTS, SamplingParams(**kw), SpeculativeConfig("mtp", 3), max_batch=4)
    assert objects.tokens == keywords.tokens
    assert objects.stats["acceptance_length"] == keywords.stats["acceptance_length"] > 1.0


def test_each_request_brings_its_own_settings(model):
    """One SamplingParams per prompt (length, temperature, stop ids, K, ignore_eos): each row equals
    the same request run alone (rows never see their neighbours' settings)."""
    alone_plain = model.generate([PROMPTS[0]], max_new_tokens=8, ignore_eos=True).tokens[0]
    stop_at = alone_plain[3]
    params = [
        SamplingParams(max_new_tokens=8, ignore_eos=True, num_speculative_tokens=0),
        SamplingParams(max_new_tokens=5, temperature=0.9, seed=3, ignore_eos=True),
        SamplingParams(
            max_new_tokens=10, stop_token_ids=(stop_at,), ignore_eos=True, num_speculative_tokens=2
        ),
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    together = model.generate(prompts, params, SpeculativeConfig("mtp", 3), max_batch=4)
    for i, (p, r) in enumerate(zip(prompts, params, strict=True)):
        alone = model.generate([p], r, SpeculativeConfig("mtp", 3))
        assert together.tokens[i] == alone.tokens[0], i
        assert together.finish_reasons[i] == alone.finish_reasons[0]
    assert [len(t) for t in together.tokens[:2]] == [8, 5]
    assert together.tokens[0] == alone_plain  # K = 0 for that row: plain decoding's tokens
    assert together.tokens[2][-1] == stop_at and together.finish_reasons[2] == "stop"
    assert together.request_stats[0]["num_draft_tokens"] == 0 < together.request_stats[1]["num_draft_tokens"]


def test_per_request_k_sets_the_calls_k(model):
    """Without a K of the call's own, the requests' largest K is the step's; all 0 means no draft runs."""
    params = [SamplingParams(max_new_tokens=6, num_speculative_tokens=k) for k in (2, 1)]
    out = model.generate(PROMPTS[:2], params, SpeculativeConfig("mtp"))
    assert out.stats["num_speculative_tokens"] == 2
    none = [SamplingParams(max_new_tokens=6, num_speculative_tokens=0)] * 2
    assert model.generate(PROMPTS[:2], none, SpeculativeConfig("mtp")).stats["draft"] is None
    with pytest.raises(mtp_jax.InvalidRequestError, match=r"in \[0, 2\]"):
        model.generate(PROMPTS[:1], SamplingParams(num_speculative_tokens=3), SpeculativeConfig("mtp", 2))


def test_objects_and_keywords_do_not_mix(model):
    with pytest.raises(TypeError, match=r"inside sampling=SamplingParams"):
        model.generate(PROMPTS, SamplingParams(), temperature=0.5)
    with pytest.raises(TypeError, match=r"inside speculative=SpeculativeConfig"):
        model.generate(PROMPTS, speculative=SpeculativeConfig("mtp"), draft="mtp")
    with pytest.raises(TypeError, match="unknown setting.*temprature"):
        model.generate(PROMPTS, temprature=0.5)
    with pytest.raises(mtp_jax.InvalidRequestError, match="2 SamplingParams for 3 prompts"):
        model.generate(PROMPTS, [SamplingParams(), SamplingParams()])
    with pytest.raises(mtp_jax.InvalidRequestError, match="speculative must be a mtp_jax.SpeculativeConfig"):
        model.generate(PROMPTS, speculative={"draft": "mtp"})


# each fault, once per path: the message must be the same whichever path meets it
FAULTS = [
    ({"temperature": -1.0}, "temperature must be a finite number >= 0, got -1.0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
    ({"top_k": -2}, "top_k must be >= 0 (0 disables it), got -2"),
    ({"min_p": 1.0}, "min_p must be in [0, 1), got 1.0"),
    ({"seed": 2**32}, "seed must be in [0, 2**32), got 4294967296"),
    (
        {"num_speculative_tokens": 5},
        "num_speculative_tokens must be an integer in [0, 3] (the engine's K), got 5",
    ),
    ({"relaxed_topk": 2}, "relaxed_topk needs an engine created with think_tokens and a draft"),
    ({"stop": [""]}, "stop must be a non-empty string or a list of them, got ['']"),
    ({"stop_token_ids": (5, 10**6)}, "stop_token_ids: token id 1000000 at index 1 is outside [0, 2048)"),
]


@pytest.mark.parametrize(("bad", "message"), FAULTS, ids=[next(iter(b)) for b, _ in FAULTS])
def test_the_same_fault_gets_the_same_message_everywhere(model, engine, bad, message):
    params = SamplingParams(max_new_tokens=4, **bad)
    sc = step_config(model, SpeculativeConfig("mtp", 3))
    messages = []
    for call in (
        lambda: check_request(model, PROMPTS[0], params, sc, context=64, context_name="64"),
        lambda: engine.submit(PROMPTS[0], params),
        lambda: engine.submit(PROMPTS[0], max_new_tokens=4, **bad),
    ):
        with pytest.raises(mtp_jax.InvalidRequestError) as e:
            call()
        messages.append(str(e.value))
    if "relaxed_topk" not in bad:  # generate() turns relaxed acceptance on for the requests that ask
        with pytest.raises(mtp_jax.InvalidRequestError) as e:
            model.generate([PROMPTS[0]], params, SpeculativeConfig("mtp", 3))
        messages.append(str(e.value))
    assert messages == [message] * len(messages)


def test_the_server_answers_a_fault_with_the_engines_message(engine):
    require_extra("starlette")
    require_extra("httpx")
    from starlette.testclient import TestClient

    from mtp_jax.server import Server

    client = TestClient(Server(engine, "tiny").app())
    for body, (_, message) in [
        ({"top_p": 0}, FAULTS[1]),
        ({"top_k": -2}, FAULTS[2]),
        ({"speculation": {"num_speculative_tokens": 5}}, FAULTS[5]),
        ({"stop": [""]}, FAULTS[7]),
    ]:
        r = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4, **body})
        assert r.status_code == 400 and r.json()["error"]["message"] == message, r.text
    ok = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200, ok.text


def test_an_engine_takes_a_speculative_config(model, engine):
    keywords = mtp_jax.Engine(model, slots=4, max_len=64, draft="mtp", num_speculative_tokens=3)
    with keywords:
        want = keywords.submit(PROMPTS[1], max_new_tokens=10, ignore_eos=True).result(timeout=120).tokens
    got = engine.submit(PROMPTS[1], SamplingParams(max_new_tokens=10, ignore_eos=True)).result(timeout=120)
    assert got.tokens == want
    assert engine.sc == keywords.sc
    with pytest.raises(TypeError, match="inside speculative=SpeculativeConfig"):
        mtp_jax.Engine(model, speculative=SpeculativeConfig("mtp"), num_speculative_tokens=2)
    with pytest.raises(mtp_jax.InvalidRequestError, match="auto_k is a setting of Model.generate"):
        mtp_jax.Engine(model, speculative=SpeculativeConfig("mtp", auto_k={1: 2}))


def test_a_checked_request_travels_as_json(model):
    """What process 0 sends the other processes of a multi-process engine rebuilds the same request."""
    import json

    params = SamplingParams(
        max_new_tokens=7, temperature=0.5, seed=9, stop="ab", stop_token_ids=[3], grammar={"regex": "a+"}
    )
    checked = check_request(
        model,
        PROMPTS[2],
        params,
        step_config(model, SpeculativeConfig("mtp", 2)),
        context=64,
        context_name="64",
    )
    assert checked.params.num_speculative_tokens == 2 and checked.params.stop == ("ab",) and checked.text
    again = CheckedRequest.from_json(json.loads(json.dumps(checked.to_json())))
    assert again == checked
    assert dataclasses.replace(again.params, seed=1) != checked.params


def test_a_drafts_own_settings_come_from_its_configure_hook(model):
    """``draft_block_size`` belongs to drafts with a configure hook; others refuse it by name."""
    with pytest.raises(
        mtp_jax.InvalidRequestError,
        match="draft_block_size=4 is a setting of draft=dspark, dflash.*; the draft is",
    ):
        step_config(model, SpeculativeConfig("mtp", draft_block_size=4))
    assert step_config(model, SpeculativeConfig("mtp")).k == mtp_jax.drafts.DRAFTS["mtp"].default_k == 3
