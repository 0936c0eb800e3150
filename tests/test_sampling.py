"""Sampling math against an independent float64 numpy reference, sampling frequencies, seeding,
parameter validation, and sampling end to end through ``Model.generate``.

The reference below is written from the specification, not from the implementation: temperature,
then top-k (keep the k largest; 0 = off), then top-p on the renormalised top-k survivors (keep the
shortest descending prefix whose mass reaches p; 1 = off), then min-p (keep tokens whose probability
is >= min_p times the largest; 0 = off), then renormalise. Temperature 0 rows are processed as
temperature 1 (callers take the argmax for them).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax import sampling
from mtp_jax.errors import InvalidRequestError
from mtp_jax.sampling import RowSampling, processed_logprobs
from tests.test_acceptance import assert_distribution

# Jitted (once per shape): much cheaper than op-by-op dispatch, which compiles every primitive.
sample = jax.jit(sampling.sample)

# --- the independent reference ----------------------------------------------------------------


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def reference_probs(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
) -> tuple[np.ndarray, float]:
    """(processed probabilities [V] in float64, margin).

    ``margin`` is how far the row is from a float-rounding-sensitive decision: the smallest distance
    between p and a cumulative top-p mass at a cut point, and between min_p and a probability ratio.
    Rows with a small margin could legitimately be decided either way in float32.
    """
    x = np.asarray(logits, np.float64) / (temperature if temperature > 0 else 1.0)
    vocab = x.shape[0]
    order = np.argsort(-x)  # descending, no ties in our inputs
    keep = np.zeros(vocab, bool)

    # top-k
    n = vocab if top_k == 0 else min(top_k, vocab)
    survivors = list(order[:n])

    # top-p on the renormalised survivors
    margin = math.inf
    probs = _softmax(x[survivors])  # survivors are in descending order
    if top_p < 1.0:
        mass = 0.0
        kept = []
        for tok, pr in zip(survivors, probs, strict=True):
            kept.append(tok)
            mass += pr
            if mass >= top_p:
                break
        cums = np.cumsum(probs)[:-1]  # the cut points where a decision is taken
        if len(cums):
            margin = min(margin, float(np.min(np.abs(cums - top_p))))
        survivors = kept
    elif len(survivors) > 1:
        # p = 1 must keep everything; a float32 cumulative sum can saturate at 1 before the tail
        margin = min(margin, float(1.0 - np.sum(probs[:-1])))

    # min-p relative to the largest surviving probability
    if min_p > 0:
        pr = _softmax(x[survivors])
        ratio = pr / pr.max()
        survivors = [t for t, r in zip(survivors, ratio, strict=True) if r >= min_p]
        others = ratio[ratio < 1.0]
        if len(others):
            margin = min(margin, float(np.min(np.abs(others - min_p))))

    keep[survivors] = True
    out = np.zeros(vocab)
    out[keep] = _softmax(x[keep])
    return out, margin


def _params(rows: list[tuple[float, int, float, float]], seeds: list[int] | None = None) -> RowSampling:
    t, k, p, m = (list(c) for c in zip(*rows, strict=True))
    return RowSampling.build(len(rows), t, k, p, m, seeds if seeds is not None else 0)


def _random_row_params(rng: np.random.Generator, vocab: int) -> tuple[float, int, float, float]:
    temperature = float(rng.choice([0.0, 0.3, 0.7, 1.0, 1.6, 3.0, rng.uniform(0.05, 4.0)]))
    top_k = int(rng.choice([0, 0, 1, 2, 5, 17, vocab - 1, vocab, vocab + 7, 10_000]))
    top_p = float(rng.choice([1.0, 1.0, 1e-6, 0.05, 0.5, 0.9, 0.99, rng.uniform(0.01, 1.0)]))
    min_p = float(rng.choice([0.0, 0.0, 1e-4, 0.05, 0.3, 0.999, rng.uniform(0.0, 0.99)]))
    return temperature, top_k, top_p, min_p


def _distinct_logits(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    scale = rng.uniform(0.3, 4.0, size=(rows, 1))
    logits = (rng.normal(size=(rows, vocab)) * scale).astype(np.float32)
    for row in logits:
        assert len(np.unique(row)) == vocab  # no ties anywhere
    return logits


# --- processed_logprobs vs the reference ------------------------------------------------------


def _mixed_batch(rows: int = 384, vocab: int = 50) -> tuple[np.ndarray, list, np.ndarray]:
    """Logits, row parameters and the reference probabilities of a batch mixing every regime, with
    rows too close to a float32-sensitive decision redrawn."""
    rng = np.random.default_rng(1234)
    logits = _distinct_logits(rng, rows, vocab)
    # The first rows pin the corner cases; the rest are random mixes.
    pinned = [
        (1.0, vocab + 7, 1.0, 0.0),  # k > vocab
        (0.7, 10_000, 0.9, 0.0),  # k far beyond vocab, with top-p
        (1.0, 1, 1.0, 0.0),  # k = 1
        (2.0, 1, 0.9, 0.5),  # k = 1 with everything else on
        (1.0, 0, 1e-6, 0.0),  # p tiny: only the top token
        (3.0, 0, 1e-6, 0.0),
        (1.0, 0, 1.0, 0.999),  # min_p near 1: only the top token
        (0.0, 4, 0.8, 0.2),  # temperature 0 is processed as temperature 1
        (5.0, 0, 1.0, 0.0),  # flat enough that p = 1 keeps the whole vocabulary
        (2.5, 8, 0.7, 0.1),
    ]
    params, refs = [], []
    redraws = 0
    for i in range(rows):
        row = pinned[i] if i < len(pinned) else _random_row_params(rng, vocab)
        while True:
            ref, margin = reference_probs(logits[i], *row)
            if margin > 2e-5:
                break
            if i < len(pinned):  # keep the pinned parameters, flatten the logits instead
                logits[i] *= 0.5
            else:
                redraws += 1
                row = _random_row_params(rng, vocab)
        params.append(row)
        refs.append(ref)
    assert redraws < rows // 2
    return logits, params, np.stack(refs)


@pytest.mark.parametrize("candidates", [(256, 4096), (8,), (4, 8), (4, 80)])
def test_processed_logprobs_matches_reference_on_mixed_batch(monkeypatch, candidates):
    """With the default candidate counts every row of this 50-token vocabulary is a candidate; with
    8, or 4 then 8, many rows' top-k or nucleus reach past them and the batch takes the full sort;
    4 then 80 (all 50 values) never sorts."""
    monkeypatch.setattr(sampling, "TRUNCATION_CANDIDATES", candidates)
    logits, params, refs = _mixed_batch()
    rows, vocab = logits.shape
    got = np.asarray(processed_logprobs(jnp.asarray(logits), _params(params)))
    assert got.shape == (rows, vocab) and got.dtype == np.float32
    assert not np.isnan(got).any()
    support = np.isfinite(got)
    for i in range(rows):
        np.testing.assert_array_equal(support[i], refs[i] > 0, err_msg=f"row {i} params {params[i]}")
    np.testing.assert_allclose(np.exp(got), refs, atol=1e-6, rtol=0)
    # Each row is a distribution.
    np.testing.assert_allclose(np.exp(got).sum(-1), 1.0, atol=1e-5)

    # The mix really covers the regimes: single-token supports, full supports, in between.
    sizes = (refs > 0).sum(-1)
    assert (sizes == 1).sum() >= 20
    assert (sizes == vocab).sum() >= 3
    assert ((sizes > 1) & (sizes < vocab)).sum() >= 100
    assert sizes[0] == vocab and sizes[2] == sizes[3] == sizes[4] == sizes[5] == sizes[6] == 1


def test_candidate_thresholds_are_exact_where_they_say_so(monkeypatch):
    """The partial selection (8 of 50 values) against the sort: every row it calls exact keeps the
    same tokens as the sort; rows past it (top-k > 8, or no top-k and a nucleus of 8 or more) are
    the ones it calls inexact; and a batch of only exact rows, which never sorts, matches the
    float64 reference."""
    logits, params, refs = _mixed_batch()
    rp = _params(params)
    x = jnp.asarray(logits) / jnp.where(rp.temperature > 0, rp.temperature, 1.0)[:, None]
    cand, exact = sampling.candidate_thresholds(x, rp, candidates=8)
    full = sampling.sorted_thresholds(x, rp)
    exact = np.asarray(exact)
    assert 50 < exact.sum() < len(exact) - 50  # both kinds, plenty of each
    keep_cand, keep_full = np.asarray(x >= cand), np.asarray(x >= full)
    np.testing.assert_array_equal(keep_cand[exact], keep_full[exact])
    k = np.array([t[1] for t in params])
    p = np.array([t[2] for t in params])
    sizes = keep_full.sum(-1)
    # a nucleus of exactly 8 is inexact too: whether a 9th value would join is past the candidates
    past = ((k > 8) & (k < 50)) | ((k == 0) | (k >= 50)) & (p < 1.0) & (sizes >= 8)
    np.testing.assert_array_equal(~exact, past)

    monkeypatch.setattr(sampling, "TRUNCATION_CANDIDATES", (8,))
    only = [i for i in range(len(params)) if exact[i]]
    got = np.asarray(processed_logprobs(jnp.asarray(logits[only]), _params([params[i] for i in only])))
    np.testing.assert_allclose(np.exp(got), refs[only], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(np.isfinite(got), refs[only] > 0)


def test_processed_logprobs_hand_computed_cases():
    base = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    logits = jnp.asarray(np.tile(base, (7, 1)), jnp.float32)
    rows = [
        (1.0, 0, 0.8, 0.0),  # 0.5 + 0.3 reaches 0.8: exactly the first two
        (1.0, 0, 0.81, 0.0),  # just past 0.8: three
        (1.0, 3, 0.9, 0.0),  # top-k 3 renormalises to [.526, .316, .158]; 0.842 < 0.9: three
        (1.0, 3, 0.84, 0.0),  # on the renormalised survivors 0.842 >= 0.84: two (unrenormalised: three)
        (1.0, 0, 1.0, 0.5),  # min-p 0.5: prob >= 0.25 keeps 0.5 and 0.3
        (1.0, 2, 1.0, 0.0),  # top-k 2
        (2.0, 0, 0.8, 0.0),  # temperature first: sqrt-flattened probs need three tokens for 0.8
    ]
    got = np.exp(np.asarray(processed_logprobs(logits, _params(rows))))
    two = np.array([0.5, 0.3, 0, 0]) / 0.8
    three = np.array([0.5, 0.3, 0.15, 0]) / 0.95
    flat = np.sqrt([0.5, 0.3, 0.15, 0.05])
    flat /= flat.sum()  # [.393, .305, .215, .088]: .393 + .305 = .698 < .8, + .215 = .913
    flat3 = np.append(flat[:3], 0) / flat[:3].sum()
    expected = [two, three, three, two, two, two, flat3]
    np.testing.assert_allclose(got, np.stack(expected), atol=1e-6, rtol=0)
    np.testing.assert_array_equal(got > 0, np.stack(expected) > 0)


def test_all_filters_off_is_softmax_of_scaled_logits():
    # A distribution whose smallest probability is far above float32 resolution.
    logits = jnp.asarray([[0.3, -1.2, 2.0, 0.0, -0.4]], jnp.float32)
    for t in (0.5, 1.0, 2.0):
        got = np.asarray(processed_logprobs(logits, RowSampling.build(1, temperature=t)))
        x = np.asarray(logits[0], np.float64) / t
        np.testing.assert_allclose(got[0], x - np.log(np.exp(x).sum()), atol=1e-5)


def test_top_p_one_is_really_off():
    # Default parameters: every filter off. The processed distribution must be log_softmax(logits);
    # tokens with tiny but nonzero probability stay in the support.
    logits = jnp.asarray([[0.0, -30.0, -40.0, -5.0]], jnp.float32)
    got = np.asarray(processed_logprobs(logits, RowSampling.build(1, temperature=1.0)))
    assert np.isfinite(got).all(), got
    x = np.asarray(logits[0], np.float64)
    np.testing.assert_allclose(got[0], x - np.log(np.exp(x).sum()), rtol=1e-5)


# --- sample -----------------------------------------------------------------------------------


def test_temperature_zero_is_argmax_whatever_the_other_params():
    rng = np.random.default_rng(7)
    rows, vocab = 128, 40
    logits = _distinct_logits(rng, rows, vocab)
    params = [_random_row_params(rng, vocab) for _ in range(rows)]
    greedy_rows = np.arange(rows) % 2 == 0
    params = [
        (0.0, *p[1:]) if g else (max(p[0], 0.1), *p[1:]) for p, g in zip(params, greedy_rows, strict=True)
    ]
    seeds = [int(s) for s in rng.integers(0, 2**32, size=rows)]
    positions = jnp.asarray(rng.integers(0, 5000, size=rows), jnp.int32)
    sp = _params(params, seeds)
    got = np.asarray(sample(jnp.asarray(logits), sp, positions))
    assert got.dtype == np.int32 and got.shape == (rows,)
    np.testing.assert_array_equal(got[greedy_rows], logits[greedy_rows].argmax(-1))
    # Sampled rows stay inside their processed support.
    for i in np.flatnonzero(~greedy_rows):
        ref, _ = reference_probs(logits[i], *params[i])
        assert ref[got[i]] > 0


SAMPLING_CASES = [
    # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 1.0, 0.0),
    (1.8, 0, 1.0, 0.0),
    (1.3, 4, 1.0, 0.0),
    (1.0, 0, 0.75, 0.0),
    (0.9, 0, 1.0, 0.3),
    (1.5, 5, 0.9, 0.1),
    (0.6, 3, 0.95, 0.0),
]


@pytest.mark.parametrize("seed", [0, 2**32 - 1])
def test_sample_frequencies_match_processed_distribution(seed):
    logits_row = np.array([1.0, 0.2, -0.5, 0.7, -1.3, 0.0], np.float32)
    n = 20_000
    batch_params, expected = [], []
    for case in SAMPLING_CASES:
        ref, margin = reference_probs(logits_row, *case)
        assert margin > 1e-3
        expected.append(ref)
        batch_params += [case] * n
    # One batch of len(cases) * n rows: each case gets positions 0..n-1 (so keys differ per draw).
    logits = jnp.asarray(np.tile(logits_row, (len(batch_params), 1)))
    positions = jnp.asarray(np.tile(np.arange(n), len(SAMPLING_CASES)), jnp.int32)
    draws = np.asarray(sample(logits, _params(batch_params, seed), positions)).reshape(len(SAMPLING_CASES), n)

    for case, ref, got in zip(SAMPLING_CASES, expected, draws, strict=True):
        assert (ref > 0).sum() >= 2
        # support, Pearson chi-square at 1e-4, and the check's power at this size (test_acceptance)
        assert_distribution(got, ref, f"{case}")


def test_sample_single_token_supports_never_leave_them():
    rng = np.random.default_rng(3)
    logits_row = rng.normal(size=12).astype(np.float32)
    top = int(np.argmax(logits_row))
    cases = [(1.5, 1, 1.0, 0.0), (2.0, 0, 1e-6, 0.0), (1.0, 0, 1.0, 0.999)]
    n = 2000
    params = [c for c in cases for _ in range(n)]
    logits = jnp.asarray(np.tile(logits_row, (len(params), 1)))
    positions = jnp.asarray(np.tile(np.arange(n), len(cases)), jnp.int32)
    draws = np.asarray(sample(logits, _params(params, 17), positions))
    assert (draws == top).all()


def test_same_seed_and_position_same_token_regardless_of_row_and_neighbours():
    rng = np.random.default_rng(11)
    rows, vocab, width = 200, 30, 256  # every batched call below has ``width`` rows (one compile)
    logits = _distinct_logits(rng, rows, vocab)
    logits /= np.abs(logits).max(-1, keepdims=True)  # flat-ish rows: the draws are genuinely random
    params = [
        (float(rng.uniform(0.5, 2.0)), int(rng.choice([0, 10])), float(rng.choice([1.0, 0.9])), 0.0)
        for _ in range(rows)
    ]
    seeds = [int(s) for s in rng.integers(0, 2**32, size=rows)]
    positions = rng.integers(0, 100_000, size=rows)

    def draw(idx, lead=0):
        """Sample rows ``idx`` (in that order) after ``lead`` unrelated rows, padded with unrelated
        rows to ``width`` (or alone when idx has one row and lead is 0)."""
        extra = 0 if (len(idx) == 1 and lead == 0) else width - len(idx)
        nb_logits = _distinct_logits(rng, extra, vocab)
        nb_params = [_random_row_params(rng, vocab) for _ in range(extra)]
        nb_seeds = [int(s) for s in rng.integers(0, 2**32, size=extra)]
        nb_pos = rng.integers(0, 100_000, size=extra)
        order = list(range(lead)) + [None] * len(idx) + list(range(lead, extra))
        lg, pr, sd, pos = [], [], [], []
        ours = iter(idx)
        for o in order:
            i = next(ours) if o is None else None
            lg.append(logits[i] if o is None else nb_logits[o])
            pr.append(params[i] if o is None else nb_params[o])
            sd.append(seeds[i] if o is None else nb_seeds[o])
            pos.append(positions[i] if o is None else nb_pos[o])
        out = np.asarray(sample(jnp.asarray(np.stack(lg)), _params(pr, sd), jnp.asarray(pos, jnp.int32)))
        return out[lead : lead + len(idx)]

    idx = np.arange(rows)
    first = draw(idx)
    np.testing.assert_array_equal(first, draw(idx))  # same call again (other padding rows)
    perm = rng.permutation(rows)
    np.testing.assert_array_equal(draw(perm), first[perm])  # other row indices
    np.testing.assert_array_equal(draw(perm, lead=37), first[perm])  # shifted, other neighbours
    # One row alone in a batch of one.
    for i in (0, 57, 199):
        np.testing.assert_array_equal(draw(np.array([i])), first[[i]])
    # The draws are not constant: they depend on seed and position.
    assert len(np.unique(first)) > 5


def test_different_positions_and_seeds_give_different_draws():
    vocab, n = 6, 3000
    logits = jnp.zeros((n, vocab), jnp.float32)  # uniform
    params = RowSampling.build(n, temperature=1.0, seed=5)
    base = np.asarray(sample(logits, params, jnp.arange(n, dtype=jnp.int32)))
    shifted = np.asarray(sample(logits, params, jnp.arange(1, n + 1, dtype=jnp.int32)))
    np.testing.assert_array_equal(base[1:], shifted[:-1])  # the draw belongs to (seed, position)
    # Consecutive positions agree about 1/6 of the time, like independent uniform draws.
    assert 0.12 < np.mean(base[1:] == base[:-1]) < 0.22
    other_seed = np.asarray(
        sample(logits, RowSampling.build(n, temperature=1.0, seed=6), jnp.arange(n, dtype=jnp.int32))
    )
    assert 0.12 < np.mean(base == other_seed) < 0.22
    # Many seeds at one position also cover the vocabulary.
    seeds = list(range(n))
    by_seed = np.asarray(
        sample(logits, RowSampling.build(n, temperature=1.0, seed=seeds), jnp.full((n,), 9, jnp.int32))
    )
    counts = np.bincount(by_seed, minlength=vocab)
    assert counts.min() > n / vocab * 0.8


# --- RowSampling.build validation ----------------------------------------------------------

INVALID = [
    # (batch, kwargs, words the message must contain)
    (1, {"temperature": -0.5}, ["temperature"]),
    (1, {"temperature": float("nan")}, ["temperature"]),
    (1, {"temperature": float("inf")}, ["temperature"]),
    (1, {"temperature": -float("inf")}, ["temperature"]),
    (1, {"top_p": 0.0}, ["top_p"]),
    (1, {"top_p": 1.5}, ["top_p"]),
    (1, {"top_p": -0.2}, ["top_p"]),
    (1, {"top_p": float("nan")}, ["top_p"]),
    (1, {"top_k": -1}, ["top_k"]),
    (1, {"top_k": 2.5}, ["top_k"]),
    (1, {"min_p": 1.0}, ["min_p"]),
    (1, {"min_p": -0.1}, ["min_p"]),
    (1, {"min_p": float("nan")}, ["min_p"]),
    (1, {"seed": -1}, ["seed"]),
    (1, {"seed": 2**32}, ["seed"]),
    (1, {"seed": 1.5}, ["seed"]),
    (1, {"temperature": True}, ["temperature"]),
    (1, {"top_k": False}, ["top_k"]),
    (1, {"seed": True}, ["seed"]),
    (1, {"min_p": np.bool_(False)}, ["min_p"]),
    (1, {"temperature": "0.5"}, ["temperature"]),
    (1, {"top_p": None}, ["top_p"]),
    # per-row lists: wrong length
    (2, {"temperature": [0.5]}, ["temperature", "1", "2"]),
    (2, {"top_k": [1, 2, 3]}, ["top_k", "3", "2"]),
    (3, {"seed": []}, ["seed", "0", "3"]),
    (1, {"min_p": (0.1, 0.2)}, ["min_p", "2", "1"]),
    # per-row lists: the bad row is named
    (3, {"top_p": [0.9, 0.0, 0.5]}, ["top_p", "row 1"]),
    (3, {"temperature": [0.0, 1.0, -1.0]}, ["temperature", "row 2"]),
    (2, {"top_k": [-3, 4]}, ["top_k", "row 0"]),
    (2, {"min_p": [0.1, 1.0]}, ["min_p", "row 1"]),
    (4, {"seed": [1, 2, 3, 2**32]}, ["seed", "row 3"]),
    (2, {"temperature": np.array([0.5, np.inf])}, ["temperature", "row 1"]),
]


@pytest.mark.parametrize(
    ("batch", "kwargs", "words"), INVALID, ids=[f"{i}-{list(c[1])[0]}" for i, c in enumerate(INVALID)]
)
def test_build_rejects_invalid(batch, kwargs, words):
    with pytest.raises(ValueError) as info:
        RowSampling.build(batch, **kwargs)
    assert isinstance(info.value, InvalidRequestError)
    msg = str(info.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


@pytest.mark.parametrize(
    "kwargs", [{"top_k": [1, 2.5]}, {"temperature": [0.5, True]}, {"seed": [3, "4"]}], ids=["k", "t", "s"]
)
def test_build_type_errors_in_lists_name_the_row(kwargs):
    with pytest.raises(InvalidRequestError, match="row 1"):
        RowSampling.build(2, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{"top_k": float("inf")}, {"top_k": float("nan")}, {"seed": float("inf")}],
    ids=["kinf", "knan", "sinf"],
)
def test_build_rejects_non_finite_integers_cleanly(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(InvalidRequestError, match=name):
        RowSampling.build(1, **kwargs)


def test_build_huge_top_k_is_off():
    """A top_k past the vocabulary (even past int32) keeps every token, as top_k = 0 does."""
    logits = jnp.asarray([[0.5, -0.1, 1.2, 0.3]], jnp.float32)
    sp = RowSampling.build(1, temperature=1.0, top_k=2**40)
    np.testing.assert_allclose(
        np.asarray(processed_logprobs(logits, sp)),
        np.asarray(processed_logprobs(logits, RowSampling.build(1, temperature=1.0))),
    )


def test_build_accepts_valid_edges_and_broadcasts():
    sp = RowSampling.build(
        3,
        temperature=[0.0, 0.5, 7],
        top_k=[0, 1, 10**6],
        top_p=[1.0, 1e-9, 0.5],
        min_p=[0.0, 0.999999, 0.5],
        seed=[0, 2**32 - 1, np.uint32(7)],
    )
    np.testing.assert_array_equal(np.asarray(sp.seed), np.array([0, 2**32 - 1, 7], np.uint32))
    np.testing.assert_array_equal(np.asarray(sp.top_k), [0, 1, 10**6])
    sp = RowSampling.build(4, temperature=0.25, top_k=3, top_p=0.5, min_p=0.1, seed=9)
    for field, value in [("temperature", 0.25), ("top_k", 3), ("top_p", 0.5), ("min_p", 0.1), ("seed", 9)]:
        arr = np.asarray(getattr(sp, field))
        assert arr.shape == (4,)
        np.testing.assert_allclose(arr, value, rtol=1e-6)


# --- end to end through the model -------------------------------------------------------------

PROMPT_A = [0, 5, 9, 13, 2]
PROMPT_B = [0, 40, 41]
PROMPT_C = [0, 7, 7, 7, 7, 7, 7, 8]
A_PARAMS = {"temperature": 0.9, "top_k": 30, "top_p": 0.95, "min_p": 0.01, "seed": 11}


def test_generate_sampling_is_reproducible(tiny_model):
    kw = {"max_new_tokens": 12, "ignore_eos": True}
    first = tiny_model.generate([PROMPT_A], temperature=1.0, seed=123, **kw)
    second = tiny_model.generate([PROMPT_A], temperature=1.0, seed=123, **kw)
    assert first.tokens == second.tokens
    assert len(first.tokens[0]) == 12
    assert all(0 <= t < tiny_model.config.vocab_size for t in first.tokens[0])
    greedy = tiny_model.generate([PROMPT_A], temperature=0.0, **kw).tokens
    # Temperature 0 ignores the other parameters and the seed.
    assert (
        tiny_model.generate([PROMPT_A], temperature=0.0, top_k=3, top_p=0.2, seed=99, **kw).tokens == greedy
    )
    # Sampling at temperature 1 on a random model is not greedy decoding.
    assert first.tokens != greedy


def test_generate_row_independence_end_to_end(tiny_model):
    # Batches of 3 and 4 prompts both run as batch 4: one compile serves every batched call here.
    kw = {"max_new_tokens": 12, "ignore_eos": True}
    alone_a = tiny_model.generate([PROMPT_A], **A_PARAMS, **kw).tokens[0]
    alone_c = tiny_model.generate([PROMPT_C], temperature=0.0, **kw).tokens[0]
    batch = tiny_model.generate(
        [PROMPT_B, PROMPT_A, PROMPT_C, PROMPT_A],
        temperature=[1.2, 0.9, 0.0, 0.9],
        top_k=[0, 30, 5, 30],
        top_p=[0.5, 0.95, 1.0, 0.95],
        min_p=[0.2, 0.01, 0.0, 0.01],
        seed=[5, 11, 9, 11],
        **kw,
    ).tokens
    assert batch[1] == alone_a  # same seed and params alone and among others
    assert batch[3] == alone_a  # the same request twice in one batch
    assert batch[2] == alone_c  # a greedy neighbour is unaffected by the sampled rows
    # Moved to another slot with other neighbours: still the same tokens.
    again = tiny_model.generate(
        [PROMPT_C, PROMPT_B, PROMPT_A],
        temperature=[0.5, 2.0, 0.9],
        top_k=[0, 2, 30],
        top_p=[0.3, 1.0, 0.95],
        min_p=[0.0, 0.0, 0.01],
        seed=[1, 2, 11],
        **kw,
    ).tokens
    assert again[2] == alone_a
    # Another seed with the same prompt and parameters gives another continuation.
    other = tiny_model.generate([PROMPT_A] * 4, **{**A_PARAMS, "seed": [12, 13, 14, 11]}, **kw).tokens
    assert other[3] == alone_a
    assert all(t != alone_a for t in other[:3])


def test_generate_different_seeds_usually_differ(tiny_model):
    out = tiny_model.generate(
        [PROMPT_A] * 4, max_new_tokens=12, temperature=1.0, seed=[0, 1, 2, 3], ignore_eos=True
    ).tokens
    assert len({tuple(t) for t in out}) >= 3


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"top_p": 0.0}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.0}, "min_p"),
        ({"seed": -1}, "seed"),
        ({"seed": [1, 2]}, "seed"),  # two seeds for one prompt
        ({"temperature": [0.5, 0.5, 0.5]}, "temperature"),
    ],
)
def test_generate_rejects_bad_sampling_params_and_stays_usable(tiny_model, kwargs, word):
    kw = {"max_new_tokens": 12, "ignore_eos": True}
    with pytest.raises(InvalidRequestError, match=word):
        tiny_model.generate([PROMPT_A], **kw, **kwargs)
    # The model still works, with the same results as before the failed call.
    ok = tiny_model.generate([PROMPT_A], temperature=0.8, seed=4, **kw)
    assert ok.tokens == tiny_model.generate([PROMPT_A], temperature=0.8, seed=4, **kw).tokens
    assert len(ok.tokens[0]) == 12
