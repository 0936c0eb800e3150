"""Confidence scheduling (mtp_jax.schedule): the width rule on the paper's numbers, the property that
makes it exact (the early stop never reads a confidence that depends on a draft it decides on),
caps and idle rows, SPS tables, and generate with it. Its laws through ``generate`` are checked in
tests/test_acceptance.py (exact with the early stop; the search over every width caught as
biased)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.errors import InvalidRequestError
from mtp_jax.schedule import SpsTable, choose_width, cumulative, throughputs


def _width(a, sps, cap=None, active=None, early_stop=True) -> int:
    a = jnp.asarray(a, jnp.float32)
    b, k = a.shape
    cap = jnp.full((b,), k) if cap is None else jnp.asarray(cap)
    active = jnp.ones((b,), bool) if active is None else jnp.asarray(active)
    return int(choose_width(a, cap, active, sps, early_stop))


def test_the_papers_appendix_a_numbers():
    """One request, two drafts, a_1 = 0.8, SPS(1, 2, 3) = (1.0, 0.5, 0.45): theta = (1, 0.9, 1.134)
    when c_2 = 0.9 and (1, 0.9, 0.81) when c_2 = 0. The early stop keeps width 1 either way; the
    search over every width picks 3 exactly when c_2 is high."""
    sps = (1.0, 0.5, 0.45)
    high, low = [[0.8, 0.72]], [[0.8, 0.0]]
    np.testing.assert_allclose(
        throughputs(jnp.asarray(high), jnp.array([2]), jnp.array([True]), sps), [1, 0.9, 1.134]
    )
    assert _width(high, sps) == _width(low, sps) == 1
    assert _width(high, sps, early_stop=False) == 3 and _width(low, sps, early_stop=False) == 1
    # where theta rises the width grows: (1, 1.8 x 0.9 = 1.62, 2.52 x 0.8 = 2.02)
    assert _width(high, (1.0, 0.9, 0.8)) == 3
    assert _width(high, (1.0, 0.9, 0.6)) == 2  # 2.52 x 0.6 = 1.51 < 1.62


def test_the_early_stop_reads_no_confidence_past_the_width_it_picks():
    """The width W picked with the early stop depends on a[:, :W] only (a_j is a function of drafts
    before j, so draft j's verification never depends on draft j): changing any a past it changes
    nothing, on random batches, speeds and caps. The search over every width fails this."""
    rng = np.random.default_rng(0)
    anticipates = 0
    for _ in range(300):
        b, k = rng.integers(1, 5), rng.integers(1, 8)
        a = np.cumprod(rng.uniform(0.2, 1.0, (b, k)), axis=1)
        sps = np.cumprod(rng.uniform(0.6, 1.0, k + 1))
        cap = rng.integers(0, k + 1, b)
        w = _width(a, sps, cap)
        later = a.copy()
        later[:, w:] = (
            np.minimum(later[:, w - 1 : w], rng.uniform(0, 1, (b, k - w))) if w < k else later[:, w:]
        )
        later[:, w:] = np.minimum.accumulate(later[:, w:], axis=1) if w < k else later[:, w:]
        assert _width(later, sps, cap) == w
        g = _width(a, sps, cap, early_stop=False)
        anticipates += g != _width(later, sps, cap, early_stop=False)
    assert anticipates > 0  # the property is not vacuous: the full search does read them


def test_caps_and_idle_rows():
    sps = (1.0, 0.95, 0.9)
    a = [[0.9, 0.8], [0.9, 0.8]]
    assert _width(a, sps) == 3
    assert _width(a, sps, cap=[0, 0]) == 1  # nothing to verify: plain decoding
    assert _width(a, sps, cap=[1, 1]) == 2  # the requests' caps bound the width
    assert _width(a, sps, active=[False, False]) == 1
    # an idle row's confidences count for nothing: theta(2) = (1 + 0.1) x 0.95 > 1, theta(3) < it
    assert _width([[0.1, 0.01], [0.99, 0.98]], sps, active=[True, False]) == 2
    np.testing.assert_allclose(np.asarray(cumulative(jnp.zeros((1, 3)))), [[0.5, 0.25, 0.125]])


def test_sps_tables_round_trip_and_refuse_bad_input(tmp_path):
    table = SpsTable(2, {1: (10.0, 9.0, 8.0), 8: (5.0, 3.0, 2.0)}, {"context": 256})
    path = tmp_path / "sps.json"
    table.save(path)
    back = SpsTable.load(path)
    assert back == table and json.loads(path.read_text())["context"] == 256
    assert back.for_batch(1, 2) == (10.0, 9.0, 8.0)
    assert back.for_batch(4, 1) == (5.0, 3.0)  # the smallest measured batch that is not smaller
    assert back.for_batch(64, 2) == (5.0, 3.0, 2.0)  # beyond: the largest
    assert SpsTable.load({"4": [1, 2]}).tables == {4: (1.0, 2.0)}
    # plain decoding's speed: speculation is off where no width pays even with every draft accepted
    with_plain = SpsTable(2, table.tables, {}, {1: 9.5, 8: 6.5})
    with_plain.save(path)
    assert SpsTable.load(path) == with_plain
    assert with_plain.speculation_can_pay(1, 2)  # 3 x 8.0 > 9.5
    assert with_plain.speculation_can_pay(1, 1) and not with_plain.speculation_can_pay(8, 2)  # 6.0 < 6.5
    assert table.speculation_can_pay(8, 2)  # plain not measured: no opinion
    with pytest.raises(InvalidRequestError, match="covers widths up to 3"):
        back.for_batch(1, 3)
    for bad, match in (
        ({1: [1.0, -2.0]}, "positive steps/s"),
        ({}, "at least one batch"),
        (
            {"k": 1, "tables": {"1": [1.0, 2.0]}, "plain": {"1": 0}},
            "plain decoding's steps/s must be positive",
        ),
        ({"x": [1.0]}, "maps batch sizes"),
        ([1.0, 2.0], "is a file, or"),
        (str(tmp_path / "missing.json"), "cannot read the SPS table"),
    ):
        with pytest.raises(InvalidRequestError, match=match):
            SpsTable.load(bad)


# --- through generate ------------------------------------------------------------------------------
PROMPTS = [[5, 9, 17, 3], [40, 2, 2, 7, 91, 13, 13, 60, 1, 77, 5], [100], [8, 8, 8, 8, 8, 8, 8]]


@pytest.fixture(scope="module")
def dspark_model(tmp_path_factory):
    """The Llama test target with test_dspark's draft "a" (a Markov head, a confidence head)."""
    import mtp_jax
    from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint
    from mtp_jax.drafts.dspark.config import DSparkConfig
    from mtp_jax.drafts.dspark.synthetic import dspark_hub_tensors
    from tests.drafts.test_dspark import DSPARK_A, _target_arrays
    from tests.drafts.test_eagle3 import TARGET

    embed, head = _target_arrays(mtp_jax.load(TARGET, "float32"))
    path = tmp_path_factory.mktemp("schedule") / "dspark"
    write_hub_checkpoint(
        path, DSPARK_A, dspark_hub_tensors(DSparkConfig.from_dict(DSPARK_A), embed, head, 3, 0.05, 0.5)
    )
    return mtp_jax.load(TARGET, "float32", draft_model=str(path))


def test_greedy_speculation_with_the_schedule_is_lossless(dspark_model, capsys):
    """Whatever widths the speeds make it pick, greedy speculation gives plain decoding's tokens,
    and the statistics count the drafts the steps verified: all four with equal speeds, none where
    one more token a step costs more than any draft can pay back."""
    model = dspark_model
    kw = dict(max_new_tokens=14, ignore_eos=True, max_batch=3, draft="dspark", schedule="confidence")
    plain = model.generate(PROMPTS, max_new_tokens=14, ignore_eos=True, max_batch=3)
    fixed = model.generate(PROMPTS, **{**kw, "schedule": "fixed"})
    flat = model.generate(PROMPTS, **kw, sps_table={4: [1.0] * 5})
    costly = model.generate(PROMPTS, **kw, sps_table={4: [1.0, 0.4, 0.3, 0.2, 0.1]})
    middle = model.generate(PROMPTS, **kw, sps_table={4: [1.0, 0.9, 0.8, 0.7, 0.6]})
    for out in (fixed, flat, costly, middle):
        assert out.tokens == plain.tokens
    assert flat.stats["num_draft_tokens"] == fixed.stats["num_draft_tokens"] > 0
    assert costly.stats["num_draft_tokens"] == 0
    assert 0 < middle.stats["num_draft_tokens"] < fixed.stats["num_draft_tokens"]
    lengths = np.asarray(middle.stats["steps_per_verified_drafts"])  # the lengths the schedule chose
    assert lengths.sum() == sum(r["steps"] for r in middle.request_stats)  # one entry per row and step
    assert lengths @ np.arange(5) == middle.stats["num_draft_tokens"]
    assert np.count_nonzero(lengths) >= 2 and fixed.stats["steps_per_verified_drafts"][-1] > 0
    assert middle.stats["num_accepted_tokens"] > 0
    # the accepted drafts the confidences expected: over the drafts verified only
    assert 0 < middle.stats["expected_accepted_tokens"] < fixed.stats["expected_accepted_tokens"]
    assert costly.stats["expected_accepted_tokens"] == 0
    never = {"k": 4, "tables": {"4": [1.0, 0.4, 0.3, 0.2, 0.1]}, "plain": {"4": 1.5}}
    off = model.generate(PROMPTS, **kw, sps_table=never)  # no width could pay: plain decoding
    assert off.tokens == plain.tokens and off.stats["num_speculative_tokens"] == 0
    measured = model.generate(PROMPTS[:1], **{**kw, "max_batch": 1})  # no table: measured first
    assert measured.tokens == plain.tokens[:1]
    err = capsys.readouterr().err
    assert "measuring steps/s at widths 1..5, batch 1" in err and "batch 1, plain decoding" in err


def test_the_schedule_is_refused_where_it_cannot_apply(dspark_model, tmp_path):
    model = dspark_model
    with pytest.raises(InvalidRequestError, match="schedule must be one of"):
        model.generate(PROMPTS[:1], draft="dspark", schedule="sometimes")
    with pytest.raises(InvalidRequestError, match="sps_table is what schedule='confidence' weighs"):
        model.generate(PROMPTS[:1], draft="dspark", sps_table={1: [1.0] * 5})
    with pytest.raises(InvalidRequestError, match=r"needs a draft that estimates its acceptance \(DSpark"):
        model.generate(PROMPTS[:1], draft="ngram", schedule="confidence")
    with pytest.raises(InvalidRequestError, match="covers widths up to 3"):
        model.generate(PROMPTS[:1], draft="dspark", schedule="confidence", sps_table={1: [1.0] * 3})


def test_an_engine_schedules_its_steps_with_per_request_caps_and_logprobs(dspark_model):
    """The serving engine with schedule="confidence": requests with their own caps (K = 0 among
    them) and log-probabilities, a shared prefix, steps of the smaller-K variants (their speeds cut
    to their widths): every request gets plain decoding's tokens and log-probabilities."""
    import mtp_jax

    model = dspark_model
    prompts = [[5, 9, 17, 3, 8, 8, 8, 8, 1, 2], [5, 9, 17, 3, 8, 8, 8, 8, 40, 2], [100, 7]]
    plain = model.generate(prompts, max_new_tokens=8, ignore_eos=True, logprobs=2)
    table = {4: [1.0, 0.9, 0.8, 0.7, 0.6]}
    spec = mtp_jax.SpeculativeConfig(draft="dspark", schedule="confidence", sps_table=table)
    with mtp_jax.Engine(model, speculative=spec, slots=4, max_len=48) as engine:
        assert engine.sc.schedule == (1.0, 0.9, 0.8, 0.7, 0.6)
        caps = [4, 0, 2]
        handles = [
            engine.submit(p, max_new_tokens=8, ignore_eos=True, logprobs=2, num_speculative_tokens=k)
            for p, k in zip(prompts, caps, strict=True)
        ]
        results = [h.result(timeout=300) for h in handles]
    drafted = [r.stats["num_draft_tokens"] for r in results]
    assert drafted[1] == 0 and drafted[0] > 0 and drafted[2] > 0  # the caps held, the others verified
    assert drafted[2] <= 2 * 8  # at most its cap a step
    for got, want, wlp in zip(results, plain.tokens, plain.logprobs, strict=True):
        assert list(got.tokens) == want
        np.testing.assert_allclose([t.logprob for t in got.logprobs], [t.logprob for t in wlp], atol=1e-5)
