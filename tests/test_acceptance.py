"""Exactness of speculative sampling, checked against exact probability math.

Two levels:

1. The acceptance rules themselves (``accept_argmax_drafts`` / ``accept_sampled_drafts``) on
   hand-picked distributions over a vocabulary of 5-6 tokens. One call decodes tens of thousands
   of independent rows (distinct seeds, or distinct positions under one seed); the empirical
   acceptance rates are compared with min(1, p/q) (p for argmax drafts) by a binomial 5-sigma
   bound, and the emitted tokens with the processed target distribution by Pearson chi-square.
2. ``Model.generate`` end to end on a model with an 8-token vocabulary: the joint distribution of
   the first three generated tokens (one from prefill, two from speculative steps, so acceptance,
   residual and bonus sampling are all exercised) against the exact product of teacher-forced
   conditionals, processed by the independent numpy code below.

Plus: argmax drafts reproduce plain sampling token for token, and a row's speculative output does
not depend on its batch. Chi-square tests use an upper tail of 1e-4; every random input here is
seeded, so the outcomes are deterministic.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax import sampling
from mtp_jax.checkpoint.safetensors_io import write_hub_checkpoint
from mtp_jax.drafts.dflash.config import DFlashConfig
from mtp_jax.drafts.dflash.synthetic import dflash_hub_tensors
from mtp_jax.drafts.eagle3.config import Eagle3Config
from mtp_jax.drafts.eagle3.synthetic import eagle3_hub_tensors
from mtp_jax.sampling import RowSampling
from tests.conftest import TINY_CONFIG, oracle_tensors

accept_argmax = jax.jit(sampling.accept_argmax_drafts)
accept_sampled = jax.jit(sampling.accept_sampled_drafts)
processed_logprobs = jax.jit(sampling.processed_logprobs)

N_ROWS = 200_000  # rows per unit-level call (one shape per K: few compilations)

# --- the independent numpy reference ----------------------------------------------------------


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def reference_probs(
    logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> tuple[np.ndarray, float]:
    """(processed distribution [V] in float64, margin) from the specification: divide by the
    temperature; keep the k largest (0 = off); of those keep the shortest descending prefix whose
    renormalised mass reaches top_p (1 = off); of those keep the tokens whose probability is at least
    min_p times the largest (0 = off); renormalise.

    ``margin``: distance of the closest top-p / min-p decision from its threshold (inf when none).
    """
    x = np.asarray(logits, np.float64) / (temperature if temperature > 0 else 1.0)
    assert len(np.unique(x)) == len(x), "ties would make the truncation ambiguous"
    kept = np.argsort(-x)
    if top_k > 0:
        kept = kept[:top_k]
    margin = math.inf
    if top_p < 1.0:
        cum = np.cumsum(_softmax(x[kept]))
        if len(kept) > 1:
            margin = min(margin, float(np.min(np.abs(cum[:-1] - top_p))))
        reached = np.flatnonzero(cum >= top_p)
        kept = kept[: (reached[0] + 1 if len(reached) else len(kept))]
    if min_p > 0.0:
        ratio = np.exp(x[kept] - x[kept[0]])
        if len(kept) > 1:
            margin = min(margin, float(np.min(np.abs(ratio[1:] - min_p))))
        kept = kept[ratio >= min_p]
    out = np.zeros(len(x))
    out[kept] = _softmax(x[kept])
    return out, margin


# --- statistics ---------------------------------------------------------------------------------


def chi2_critical(dof: int, z: float = 3.7190) -> float:
    """Wilson–Hilferty approximation of the chi-square quantile; z = 3.7190 is the standard normal
    quantile of an upper tail of 1e-4."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def pooling(probs: np.ndarray, n: float) -> tuple[np.ndarray, np.ndarray]:
    """(group of each cell, expected count of each group) of Pearson's test of ``n`` draws.

    Cells with expected count >= 5 are groups of their own; the others with positive probability are
    pooled into one group, merged into the smallest regular group if that pool is still below 5.
    Zero-probability cells are in no group (-1): any draw there is outside the support.
    """
    probs = np.asarray(probs, np.float64).ravel()
    assert abs(probs.sum() - 1.0) < 1e-9, probs.sum()
    expected = n * probs
    big = expected >= 5
    small = ~big & (probs > 0)
    group = np.full(len(probs), -1)
    group[big] = np.arange(int(big.sum()))
    exp = list(expected[big])
    if small.any():
        pool = float(expected[small].sum())
        if pool >= 5 or not exp:
            group[small] = len(exp)
            exp.append(pool)
        else:
            i = int(np.argmin(exp))
            group[small] = i
            exp[i] += pool
    return group, np.asarray(exp)


def pearson_many(counts: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, int, np.ndarray]:
    """(statistics, dof, draws outside the support) of each row of ``counts`` [runs, cells], all
    of the same total, against exact probabilities, pooled as :func:`pooling` says."""
    counts = np.asarray(counts, np.float64)
    group, exp = pooling(probs, counts[0].sum())
    inside = group >= 0
    onehot = np.zeros((len(group), len(exp)))
    onehot[np.flatnonzero(inside), group[inside]] = 1.0
    obs = counts @ onehot
    return ((obs - exp) ** 2 / exp).sum(-1), len(exp) - 1, counts[:, ~inside].sum(-1)


def pearson(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int, int]:
    """(statistic, dof, draws outside the support) of counts against exact probabilities
    (:func:`pooling` says how small cells are pooled)."""
    counts = np.asarray(counts, np.float64).ravel()
    assert counts.shape == np.asarray(probs).ravel().shape
    stat, dof, outside = pearson_many(counts[None], probs)
    return float(stat[0]), dof, int(outside[0])


def rejection_rate(probs: np.ndarray, law: np.ndarray, n: int, runs: int = 2000, seed: int = 0) -> float:
    """The fraction of ``runs`` seeded samples of ``n`` draws from ``law`` that
    :func:`assert_distribution` rejects as not following ``probs``: its power against ``law`` at
    that sample size and cell count (its pooling, support check and critical value)."""
    law = np.asarray(law, np.float64).ravel()
    counts = np.random.default_rng(seed).multinomial(n, law / law.sum(), size=runs)
    stat, dof, outside = pearson_many(counts, probs)
    rejected = (outside > 0) | (stat >= (chi2_critical(dof) if dof > 0 else math.inf))
    return float(rejected.mean())


def even_bias(probs: np.ndarray, tv: float = 0.04) -> np.ndarray:
    """A law at total variation ``tv`` from ``probs`` whose change at every cell of the support is
    in proportion to its probability (p(1 + delta s), s = +1 / -1 alternating down the sorted
    cells, renormalised): of all biases of that size, the one with the least chi-square
    noncentrality (sum (p' - p)^2 / p >= (2 tv)^2, equal when |p' - p| is proportional to p), so the
    hardest for Pearson's test. A law too concentrated for that pattern to reach ``tv`` moves mass
    from its largest cell to all the others instead."""
    p = np.asarray(probs, np.float64).ravel()
    support = np.flatnonzero(p > 0)
    assert len(support) > 1, "a single-cell law has no bias"
    order = support[np.argsort(-p[support], kind="stable")]
    alternating = np.zeros_like(p)
    alternating[order] = np.where(np.arange(len(order)) % 2 == 0, 1.0, -1.0)
    drain = np.where(p > 0, 1.0, 0.0)
    drain[order[0]] = -1.0

    def law(signs: np.ndarray, delta: float) -> np.ndarray:
        x = p * (1.0 + delta * signs)
        return x / x.sum()

    def distance(signs: np.ndarray, delta: float) -> float:
        return 0.5 * float(np.abs(law(signs, delta) - p).sum())

    signs = alternating if distance(alternating, 0.999) >= tv else drain
    assert distance(signs, 0.999) >= tv, f"no bias of total variation {tv} of this shape"
    lo, hi = 0.0, 0.999
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if distance(signs, mid) < tv else (lo, mid)
    return law(signs, hi)


POWER = 0.99  # every law check catches a bias of total variation TV_BIAS at least this often
TV_BIAS = 0.04


def assert_power(probs: np.ndarray, n: int, what: str, against: dict[str, np.ndarray] | None = None) -> None:
    """A check of ``n`` draws against ``probs`` rejects the hardest bias of total variation
    :data:`TV_BIAS` (:func:`even_bias`), and each named law in ``against``, in at least
    :data:`POWER` of seeded simulated runs: the check has power at its own size and cells."""
    probs = np.asarray(probs, np.float64).ravel()
    laws = dict(against or {})
    if (probs > 0).sum() > 1:
        laws[f"a bias of total variation {TV_BIAS}"] = even_bias(probs, TV_BIAS)
    for name, law in laws.items():
        rate = rejection_rate(probs, law, n)
        assert rate >= POWER, f"{what}: {n} draws catch {name} in only {rate:.1%} of runs (< {POWER:.0%})"


def has_power(n: int, probs: np.ndarray, against: dict[str, np.ndarray] | None = None) -> bool:
    """Whether ``n`` draws are enough for :func:`assert_power` against ``probs`` (for checks of
    subsets whose sizes the draws decide)."""
    if n < 100:  # assert_distribution's own floor
        return False
    try:
        assert_power(probs, n, "", against)
    except AssertionError:
        return False
    return True


def powered_size(probs: np.ndarray, against: dict[str, np.ndarray] | None = None, step: int = 4096) -> int:
    """The smallest multiple of ``step`` draws at which a check against ``probs`` has its power."""
    n = step
    while not has_power(n, probs, against):
        n += step
    return n


def assert_distribution(
    samples: np.ndarray,
    probs: np.ndarray,
    what: str,
    *,
    against: dict[str, np.ndarray] | None = None,
    power: bool = True,
) -> None:
    """Samples (token ids, or flat cell indices) follow ``probs`` exactly: nothing outside the
    support, and Pearson chi-square below its 1e-4 critical value. First (``power``) the check
    shows it would have caught a bias of total variation 0.04, and each law in ``against``, at this
    sample size (:func:`assert_power`)."""
    samples = np.asarray(samples).ravel()
    assert samples.size >= 100, f"{what}: only {samples.size} samples"
    counts = np.bincount(samples, minlength=len(probs))
    assert len(counts) == len(probs), f"{what}: token ids beyond the distribution"
    if power:
        assert_power(probs, samples.size, what, against)
    stat, dof, outside = pearson(counts, probs)
    assert outside == 0, f"{what}: {outside} draws outside the support {np.flatnonzero(probs)}"
    if dof == 0:  # a single-token support: the support check is the whole test
        return
    crit = chi2_critical(dof)
    assert stat < crit, (
        f"{what}: chi2 = {stat:.1f} >= {crit:.1f} (dof {dof}); observed "
        f"{np.round(counts / samples.size, 4)} expected {np.round(probs, 4)}"
    )


def assert_rate(hits: np.ndarray, expected: float, what: str) -> None:
    """A Bernoulli frequency equals ``expected`` within 5 binomial standard deviations (exactly
    when expected is 0 or 1)."""
    hits = np.asarray(hits, bool)
    n = hits.size
    assert n >= 100, f"{what}: only {n} trials"
    rate = float(hits.mean())
    tol = 5.0 * math.sqrt(expected * (1.0 - expected) / n)
    assert abs(rate - expected) <= tol + 1e-12, (
        f"{what}: rate {rate:.4f} vs {expected:.4f} +- {tol:.4f} ({n})"
    )


def _chi2_sf(x: float, dof: int) -> float:
    """Exact upper tail of the chi-square distribution (series of the lower incomplete gamma)."""
    a, z = dof / 2.0, x / 2.0
    term = total = 1.0 / a
    n = 0
    while term > 1e-17 * total:
        n += 1
        term *= z / (a + n)
        total += term
    return 1.0 - math.exp(a * math.log(z) - z - math.lgamma(a)) * total


def test_chi2_critical_values_have_the_intended_tail():
    assert abs(_chi2_sf(15.137, 1) - 1e-4) < 1e-6 and abs(_chi2_sf(29.588, 10) - 1e-3) < 1e-5  # tables
    for dof in (1, 2, 3, 5, 10, 30, 100, 300):
        # Wilson-Hilferty errs on the generous side for small dof, and is close for large ones
        assert 5e-5 <= _chi2_sf(chi2_critical(dof), dof) <= 1e-4, dof


def residual_bug(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The law of a verified draft position when a rejected draft is replaced by a draw from p
    instead of the residual max(p - q, 0) (the classic rejection bug): min(p, q) + (1 - sum min) p."""
    kept = np.minimum(p, q)
    return kept + (1.0 - kept.sum()) * p


def test_checks_reject_wrong_distributions():
    """The helpers have teeth, and :func:`rejection_rate` measures them: its simulated runs agree
    with the scalar check and with the noncentral chi-square law; the null is rejected at the
    1e-4 level, the hardest bias of total variation 0.04 and the residual bug at 99% or more."""
    rng = np.random.default_rng(0)
    p = np.array([0.4, 0.25, 0.2, 0.1, 0.05])
    n = 10_000
    assert_distribution(rng.choice(5, size=n, p=p), p, "exact")
    biased = even_bias(p)
    assert abs(0.5 * np.abs(biased - p).sum() - TV_BIAS) < 1e-9
    assert np.all(np.sign(biased - p) != 0) and ((biased - p) ** 2 / p).sum() >= (2 * TV_BIAS) ** 2 - 1e-12
    with pytest.raises(AssertionError, match="chi2"):
        assert_distribution(rng.choice(5, size=n, p=biased), p, "off")
    assert rejection_rate(p, p, n) <= 2 / 2000  # the level: about 1e-4
    assert rejection_rate(p, biased, n) >= POWER
    # the scalar check rejects the same share of the same seeded runs
    counts = np.random.default_rng(0).multinomial(n, biased, size=200)
    scalar = [pearson(c, p)[0] >= chi2_critical(4) for c in counts]
    assert abs(np.mean(scalar) - rejection_rate(p, biased, n, runs=200)) < 1e-12
    # Pearson's statistic under a fixed alternative: noncentral chi-square with
    # lambda = n sum (p' - p)^2 / p (many cells, large counts: the approximation holds)
    wide = np.random.default_rng(1).dirichlet(np.full(64, 20.0))
    away = even_bias(wide, 0.03)
    lam = 20_000 * ((away - wide) ** 2 / wide).sum()
    draws = np.random.default_rng(2).noncentral_chisquare(63, lam, size=200_000)
    theory = (draws >= chi2_critical(63)).mean()
    assert abs(rejection_rate(wide, away, 20_000, runs=4000) - theory) < 0.04, theory
    # the residual bug with a uniform draft: caught at the same size
    bug = residual_bug(p, np.full(5, 0.2))
    assert 0.5 * np.abs(bug - p).sum() > 0.04 and rejection_rate(p, bug, n) >= POWER
    with pytest.raises(AssertionError, match="only"):  # a check without power is refused
        assert_distribution(rng.choice(5, size=2000, p=p), p, "too few")
    with pytest.raises(AssertionError, match="outside the support"):
        assert_distribution(
            np.r_[rng.choice(4, size=n, p=[0.4, 0.3, 0.2, 0.1]), 4], [0.4, 0.3, 0.2, 0.1, 0], "x"
        )
    with pytest.raises(AssertionError, match="rate"):
        assert_rate(rng.random(20_000) < 0.53, 0.5, "biased coin")
    assert_rate(rng.random(4000) < 0.5, 0.5, "fair coin")
    with pytest.raises(AssertionError, match="rate"):
        assert_rate(np.r_[np.ones(999, bool), False], 1.0, "almost always")


def test_reference_probs_hand_computed():
    logp = np.log([0.5, 0.3, 0.15, 0.05])
    np.testing.assert_allclose(reference_probs(logp, top_p=0.79)[0], [0.625, 0.375, 0, 0])
    np.testing.assert_allclose(reference_probs(logp, top_k=3, top_p=0.84)[0], [0.625, 0.375, 0, 0])
    np.testing.assert_allclose(reference_probs(logp, min_p=0.5)[0], [0.625, 0.375, 0, 0])
    np.testing.assert_allclose(reference_probs(logp, top_k=3)[0], [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    flat = np.sqrt([0.5, 0.3, 0.15, 0.05])
    np.testing.assert_allclose(reference_probs(logp, temperature=2.0)[0], flat / flat.sum())


# --- unit level: the acceptance rules -----------------------------------------------------------

P_A = np.array([0.4, 0.25, 0.2, 0.1, 0.05])
P_B = np.array([0.1, 0.15, 0.3, 0.05, 0.4])
P_C = np.array([0.2, 0.35, 0.05, 0.3, 0.1])


def _params(n: int, randomness: str, **kw) -> tuple[RowSampling, jax.Array]:
    """(params, first) for n independent rows: distinct seeds at one position, or one seed at
    positions far enough apart that no two rows share a (seed, position) key."""
    if randomness == "seeds":
        return RowSampling.build(n, seed=list(range(n)), **kw), jnp.full((n,), 11, jnp.int32)
    return RowSampling.build(n, seed=12345, **kw), jnp.arange(n, dtype=jnp.int32) * 8


def _logits(per_position: list[np.ndarray], n: int) -> jax.Array:
    """[n, K+1, V] float32 logits, the same at every row: log of the given distributions."""
    rows = np.log(np.stack(per_position))
    return jnp.asarray(np.broadcast_to(rows, (n,) + rows.shape).astype(np.float32))


def _target_probs(logits: jax.Array, params: RowSampling) -> np.ndarray:
    """The package's own processed p [K+1, V] of row 0 (float64): for q == p exactly."""
    k1 = logits.shape[1]
    lp = processed_logprobs(logits[0], jax.tree.map(lambda x: jnp.repeat(x[:1], k1), params))
    return np.exp(np.asarray(lp, np.float64))


def check_speculative_rows(
    emitted: np.ndarray, n_acc: np.ndarray, drafts: np.ndarray, p: np.ndarray, accept: np.ndarray, what: str
) -> None:
    """The exact laws of one speculative step when position j's target distribution p[j] does not
    depend on the tokens before it:

    - accepted drafts are emitted unchanged;
    - given that drafts 0..j-1 were accepted and draft j is d, draft j is accepted with
      probability accept[j, d];
    - given that position j is emitted at all (n_acc >= j), its token follows p[j] exactly
      (j = K is the bonus token).
    """
    emitted, n_acc, drafts = (np.asarray(a) for a in (emitted, n_acc, drafts))
    k = drafts.shape[1]
    assert emitted.shape == (drafts.shape[0], k + 1) and n_acc.shape == (drafts.shape[0],)
    assert n_acc.min() >= 0 and n_acc.max() <= k
    for j in range(k):
        took = n_acc > j
        np.testing.assert_array_equal(emitted[took, j], drafts[took, j], err_msg=f"{what}: draft {j}")
    for j in range(k + 1):
        reached = n_acc >= j
        assert_distribution(emitted[reached, j], p[j], f"{what}: token {j} given n_acc >= {j}")
        if j == k:
            continue
        for d in range(p.shape[1]):
            rows = reached & (drafts[:, j] == d)
            if rows.sum() >= 300:
                assert_rate(n_acc[rows] > j, accept[j, d], f"{what}: accept draft {j} = {d}")


@pytest.mark.parametrize("randomness", ["seeds", "positions"])
def test_argmax_drafts_k1(randomness):
    """One draft, each token of the vocabulary as the draft in turn: accepted with probability
    p(d); the emitted token follows p whatever the draft; the bonus token follows p_1."""
    n = N_ROWS
    params, first = _params(n, randomness, temperature=1.0)
    drafts = (np.arange(n) % 5).astype(np.int32)[:, None]
    emitted, n_acc = accept_argmax(_logits([P_A, P_B], n), jnp.asarray(drafts), params, first)
    emitted, n_acc = np.asarray(emitted), np.asarray(n_acc)
    p = np.stack([P_A, P_B])
    check_speculative_rows(emitted, n_acc, drafts, p, p[:1], f"argmax K=1 {randomness}")
    for d in range(5):
        assert_distribution(emitted[drafts[:, 0] == d, 0], P_A, f"emitted[0] with draft {d}")
    # the first disagreeing draw replaces the draft
    assert (emitted[n_acc == 0, 0] != drafts[n_acc == 0, 0]).all()


def test_argmax_drafts_k2_accepts_both_with_product_probability():
    n = N_ROWS
    params, first = _params(n, "seeds", temperature=1.0)
    drafts = np.tile(np.array([[0, 2]], np.int32), (n, 1))  # p_0(0) = 0.4, p_1(2) = 0.3
    emitted, n_acc = accept_argmax(_logits([P_A, P_B, P_C], n), jnp.asarray(drafts), params, first)
    emitted, n_acc = np.asarray(emitted), np.asarray(n_acc)
    assert_rate(n_acc == 2, 0.4 * 0.3, "P(n_acc = 2)")
    assert_distribution(n_acc, np.array([0.6, 0.4 * 0.7, 0.4 * 0.3]), "n_acc")
    p = np.stack([P_A, P_B, P_C])
    check_speculative_rows(emitted, n_acc, drafts, p, p[:2], "argmax K=2")
    # the draws depend on the keys only, not on the drafts
    other, _ = accept_argmax(_logits([P_A, P_B, P_C], n), jnp.asarray(drafts[:, ::-1].copy()), params, first)
    np.testing.assert_array_equal(np.asarray(other), emitted)


def _sampled_case(p_rows, q_rows, randomness, rng, n=N_ROWS, q_from_target=False, **kw):
    """Draw drafts from q (numpy), run accept_sampled_drafts; returns (emitted, n_acc, drafts, q)."""
    params, first = _params(n, randomness, **kw)
    logits = _logits(p_rows, n)
    k = len(p_rows) - 1
    q = _target_probs(logits, params)[:k] if q_from_target else np.stack(q_rows).astype(np.float64)
    drafts = np.stack([rng.choice(q.shape[1], size=n, p=q[j] / q[j].sum()) for j in range(k)], 1)
    q32 = jnp.asarray(np.broadcast_to(q, (n,) + q.shape).astype(np.float32))
    emitted, n_acc = accept_sampled(logits, jnp.asarray(drafts, jnp.int32), q32, params, first)
    return np.asarray(emitted), np.asarray(n_acc), drafts, q


def _accept_probs(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(q > 0, np.minimum(1.0, p / np.where(q > 0, q, 1.0)), np.nan)


Q_CASES = {
    # p(d) > q(d) for d in {0, 2, 4} (always accepted), p(d) < q(d) for d in {1, 3}
    "mixed": np.array([0.1, 0.5, 0.12, 0.25, 0.03]),
    # no draft mass on tokens 0, 3, 4 although the target has mass there: only the residual
    # can emit them
    "zero_mass": np.array([0.0, 0.7, 0.3, 0.0, 0.0]),
    # a one-hot proposal on the least likely target token
    "one_hot": np.array([0.0, 0.0, 0.0, 0.0, 1.0]),
    "flat": np.full(5, 0.2),
}


@pytest.mark.parametrize("case", list(Q_CASES))
def test_sampled_drafts_k1_reproduce_p(case):
    rng = np.random.default_rng(list(Q_CASES).index(case))
    randomness = "positions" if case == "flat" else "seeds"
    q = Q_CASES[case]
    emitted, n_acc, drafts, q = _sampled_case([P_A, P_B], [q], randomness, rng, temperature=1.0)
    p = np.stack([P_A, P_B])
    accept = _accept_probs(p[:1], q)
    check_speculative_rows(emitted, n_acc, drafts, p, accept, f"sampled K=1 q={case}")
    assert_rate(n_acc == 1, float(np.minimum(P_A, q).sum()), "P(accept) = sum min(p, q)")
    if case == "mixed":  # both sides of min(1, p/q) were exercised with enough rows
        assert (drafts == 1).sum() > 5000 and (drafts == 0).sum() > 1000
        assert_rate(n_acc[drafts[:, 0] == 1] == 1, 0.5, "p < q: accepted with p/q")
        assert (n_acc[drafts[:, 0] == 0] == 1).all()  # p > q: always accepted


# (seed, position) whose ACCEPT stream draws exactly 0.0, and a key whose first of three splits
# does (found by search: about one draw in 2^23 is 0.0)
ZERO_ACCEPT_DRAW = (0, 612_944)
ZERO_SIBLING_KEY = 3_353_848


def test_a_uniform_draw_of_zero_does_not_accept_a_token_without_mass():
    """The acceptance test is u q < p with u on [0, 1): a draw of exactly 0.0 (one in 2^23, so
    about once per ten million drafts) must not accept a draft whose target probability is 0."""
    seed, position = ZERO_ACCEPT_DRAW
    key = sampling.row_keys(jnp.asarray([seed]), jnp.asarray([position]), sampling.ACCEPT)[0]
    u = jax.random.uniform(key)
    assert float(u) == 0.0
    params = RowSampling.build(1, seed=seed, temperature=1.0, top_k=2)  # p(token 4) = 0 after top-k
    drafts = jnp.asarray([[4]], jnp.int32)
    q = jnp.asarray(np.broadcast_to(P_B, (1, 1, 5)).astype(np.float32))
    emitted, n_acc = accept_sampled(_logits([P_A, P_B], 1), drafts, q, params, jnp.asarray([position]))
    assert int(n_acc[0]) == 0 and int(emitted[0, 0]) in (0, 1)
    # a tree node: the first candidate has no mass under the target, its uniform is 0.0
    keys = jnp.asarray([jax.random.key(ZERO_SIBLING_KEY)])
    assert float(jax.random.uniform(jax.random.split(keys[0], 3)[0])) == 0.0
    p = jnp.asarray([[0.6, 0.4, 0.0]])
    candidates = jnp.asarray([[2, 0]], jnp.int32)
    laws = jnp.asarray([[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    chosen, token = sampling.accept_siblings(p, candidates, laws, keys)
    assert int(chosen[0]) != 0 and int(token[0]) != 2


def test_sampled_drafts_with_q_equal_p_always_accept():
    rng = np.random.default_rng(7)
    emitted, n_acc, drafts, q = _sampled_case(
        [P_A, P_B, P_C], None, "seeds", rng, q_from_target=True, temperature=1.0
    )
    assert (n_acc == 2).all()
    p = np.stack([P_A, P_B, P_C])
    check_speculative_rows(emitted, n_acc, drafts, p, np.ones((2, 5)), "sampled q == p")


@pytest.mark.parametrize("randomness", ["seeds", "positions"])
def test_sampled_drafts_k2(randomness):
    """Two drafts from different proposals: given that draft 0 was accepted, position 1 (accepted
    draft or residual) still follows p_1, and after two acceptances the bonus follows p_2."""
    rng = np.random.default_rng(3 if randomness == "seeds" else 4)
    q0, q1 = Q_CASES["mixed"], np.array([0.3, 0.3, 0.05, 0.0, 0.35])
    emitted, n_acc, drafts, q = _sampled_case([P_A, P_B, P_C], [q0, q1], randomness, rng, temperature=1.0)
    p = np.stack([P_A, P_B, P_C])
    check_speculative_rows(emitted, n_acc, drafts, p, _accept_probs(p[:2], q), f"sampled K=2 {randomness}")
    a0, a1 = np.minimum(P_A, q0).sum(), np.minimum(P_B, q1).sum()
    assert_distribution(n_acc, np.array([1 - a0, a0 * (1 - a1), a0 * a1]), "n_acc")
    # independence: given n_acc >= 1, emitted[1] follows p_1 whatever emitted[0] was
    checked = 0
    for t in range(5):
        rows = (n_acc >= 1) & (emitted[:, 0] == t)
        if has_power(int(rows.sum()), P_B):  # the likelier first tokens
            assert_distribution(emitted[rows, 1], P_B, f"emitted[1] given emitted[0] = {t}")
            checked += 1
    assert checked >= 3, checked


@pytest.mark.parametrize("draft_sampling", ["argmax", "sampled"])
def test_a_per_row_cap_keeps_acceptance_exact(draft_sampling):
    """Rows capped at 0, 1 or 2 of K = 2 drafts (a request asking for fewer drafts than the step
    verifies): no row accepts past its cap, accepted drafts follow the uncapped law below it, and
    every emitted position, the one at the cap included, still follows p exactly."""
    rng = np.random.default_rng(11)
    n = 3 * N_ROWS
    params, first = _params(n, "seeds", temperature=1.0)
    logits = _logits([P_A, P_B, P_C], n)
    cap = np.arange(n) % 3
    q = np.stack([Q_CASES["mixed"], np.array([0.3, 0.3, 0.05, 0.0, 0.35])])
    drafts = np.stack([rng.choice(5, size=n, p=q[j]) for j in range(2)], 1).astype(np.int32)
    if draft_sampling == "sampled":
        q32 = jnp.asarray(np.broadcast_to(q, (n, 2, 5)).astype(np.float32))
        emitted, n_acc = accept_sampled(logits, jnp.asarray(drafts), q32, params, first, jnp.asarray(cap))
        accept = _accept_probs(np.stack([P_A, P_B]), q)
    else:
        emitted, n_acc = accept_argmax(logits, jnp.asarray(drafts), params, first, jnp.asarray(cap))
        accept = np.stack([P_A, P_B])
    emitted, n_acc = np.asarray(emitted), np.asarray(n_acc)
    assert (n_acc <= cap).all()
    p = np.stack([P_A, P_B, P_C])
    for c in range(3):  # capped at c, a row is a K = c step whose token c follows p_c
        rows = cap == c
        what = f"{draft_sampling}, cap {c}"
        check_speculative_rows(
            emitted[rows, : c + 1], n_acc[rows], drafts[rows, :c], p[: c + 1], accept[:c], what
        )


def test_relaxed_rule_on_hand_built_logits():
    """relaxed_ok: inside thinking, a draft among the top relaxed_topk with p >= p_top1 - delta;
    never outside thinking or for rows that do not ask (relaxed_topk 0)."""
    probs = np.array([0.5, 0.3, 0.12, 0.08])
    logits = jnp.asarray(np.log(np.stack([probs, probs]))[None].repeat(6, 0).astype(np.float32))
    drafts = jnp.asarray([[1], [1], [2], [1], [1], [0]], jnp.int32)
    params = RowSampling.build(
        6, relaxed_topk=[2, 2, 3, 2, 0, 1], relaxed_delta=[0.25, 0.1, 0.5, 0.25, 0.25, 0.0]
    )
    thinking = jnp.asarray([[True], [True], [True], [False], [True], [True]])
    got = np.asarray(sampling.relaxed_ok(logits, drafts, params, thinking))[:, 0].tolist()
    # 1: top-2, 0.3 >= 0.5 - 0.25 | 0.3 < 0.5 - 0.1 | 2 is third, 0.12 >= 0.5 - 0.5
    # | outside thinking | not asked | the argmax itself, delta 0
    assert got == [True, False, True, False, False, True]


def test_relaxed_acceptance_emits_the_draft_and_leaves_other_rows_alone():
    """Greedy rows: a relaxed row accepts a near-top draft and emits it (not the target's argmax),
    then stops at the first draft that passes neither rule; a row with relaxed_topk 0 is exactly
    strict acceptance, bit for bit."""
    p0, p1, p2 = np.array([0.5, 0.4, 0.1]), np.array([0.1, 0.2, 0.7]), np.array([0.6, 0.3, 0.1])
    logits = jnp.asarray(np.log(np.stack([p0, p1, p2]))[None].repeat(2, 0).astype(np.float32))
    drafts = jnp.asarray([[1, 0], [1, 0]], jnp.int32)  # 1 is near the top at 0; 0 is far below at 1
    params = RowSampling.build(2, relaxed_topk=[2, 0], relaxed_delta=0.2)
    first = jnp.asarray([5, 5], jnp.int32)
    thinking = jnp.ones((2, 2), bool)
    relaxed = sampling.relaxed_ok(logits, drafts, params, thinking)
    emitted, n = accept_argmax(logits, drafts, params, first, None, relaxed)
    strict_emitted, strict_n = accept_argmax(logits, drafts, params, first)
    assert np.asarray(n).tolist() == [1, 0] and np.asarray(strict_n).tolist() == [0, 0]
    assert np.asarray(emitted)[0, :2].tolist() == [1, 2]  # the draft, then the target's argmax
    np.testing.assert_array_equal(np.asarray(emitted)[1], np.asarray(strict_emitted)[1])


PROCESSED_LOGITS = [
    np.array([2.0, 1.1, 0.3, -0.4, -1.5, 0.8]),
    np.array([-0.2, 0.9, 1.7, 0.1, 0.5, -1.0]),
    np.array([0.4, -0.6, 0.0, 1.3, 1.0, -0.3]),
]
PROCESSED_CASES = [
    # (temperature, top_k, top_p, min_p)
    dict(temperature=0.7, top_k=3),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.3),
    dict(temperature=1.5, top_k=5, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("draft_sampling", ["argmax", "sampled"])
def test_processed_target_distribution_is_reproduced(draft_sampling):
    """Temperature / top-k / top-p / min-p: the processed distribution (computed here in numpy)
    is what the emitted tokens follow; drafts outside its support are never accepted."""
    # rows per case: enough reach the last position for the check's power (the first case's drafts
    # are accepted least)
    sizes = [120_000, 100_000, 120_000, 100_000]
    cases = PROCESSED_CASES
    n = sum(sizes)
    cols = {
        key: [c.get(key, d) for c, size in zip(cases, sizes, strict=True) for _ in range(size)]
        for key, d in [("temperature", 1.0), ("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)]
    }
    params = RowSampling.build(n, seed=list(range(n)), **cols)
    first = jnp.full((n,), 3, jnp.int32)
    logits = jnp.asarray(np.broadcast_to(np.stack(PROCESSED_LOGITS), (n, 3, 6)).astype(np.float32))
    rng = np.random.default_rng(11)
    # proposals with mass outside every support: flat, and one favouring the unlikely tokens
    q = np.stack([np.full(6, 1 / 6), _softmax(-PROCESSED_LOGITS[1])])
    if draft_sampling == "sampled":
        drafts = np.stack([rng.choice(6, size=n, p=q[j]) for j in range(2)], 1).astype(np.int32)
        q32 = jnp.asarray(np.broadcast_to(q, (n, 2, 6)).astype(np.float32))
        emitted, n_acc = accept_sampled(logits, jnp.asarray(drafts), q32, params, first)
    else:
        # mostly the target's top token (accepted often), else any token (often outside the support)
        top = np.argmax(PROCESSED_LOGITS[:2], axis=-1)
        drafts = np.where(rng.random((n, 2)) < 0.6, top, rng.integers(0, 6, size=(n, 2))).astype(np.int32)
        emitted, n_acc = accept_argmax(logits, jnp.asarray(drafts), params, first)
    emitted, n_acc = np.asarray(emitted), np.asarray(n_acc)
    for i, case in enumerate(cases):
        rows = slice(sum(sizes[:i]), sum(sizes[: i + 1]))
        p = []
        for lg in PROCESSED_LOGITS:
            probs, margin = reference_probs(lg, **case)
            assert margin > 1e-3
            p.append(probs)
        p = np.stack(p)
        assert ((p > 0).sum(-1) < 6).any(), "the case should truncate something"
        accept = _accept_probs(p[:2], q) if draft_sampling == "sampled" else p[:2]
        check_speculative_rows(
            emitted[rows], n_acc[rows], drafts[rows], p, accept, f"{draft_sampling} {case}"
        )
        for j in range(2):
            outside = p[j][drafts[rows, j]] == 0
            assert (n_acc[rows][outside] <= j).all(), "a draft outside the support was accepted"


def test_greedy_rows_accept_exactly_while_draft_is_argmax():
    """Temperature-0 rows mixed into a stochastic batch (with truncation parameters that greedy
    ignores): accept while draft == argmax of the raw logits, then emit that argmax."""
    rng = np.random.default_rng(5)
    n, k, v = 4096, 3, 6
    logits = rng.normal(size=(n, k + 1, v)).astype(np.float32)
    top = logits.argmax(-1)
    agree = rng.random((n, k)) < 0.7
    drafts = np.where(agree, top[:, :k], (top[:, :k] + rng.integers(1, v, size=(n, k))) % v).astype(np.int32)
    greedy = np.arange(n) % 2 == 0
    temperature = np.where(greedy, 0.0, 1.0).tolist()
    params = RowSampling.build(n, temperature=temperature, top_k=2, top_p=0.5, min_p=0.2, seed=list(range(n)))
    first = jnp.asarray(rng.integers(0, 1000, size=n), jnp.int32)
    q = rng.dirichlet(np.ones(v), size=(n, k)).astype(np.float32)
    want_n = np.sum(np.cumprod(drafts == top[:, :k], axis=1), axis=1)
    assert len(np.unique(want_n[greedy])) == k + 1  # every acceptance length occurs
    runs = {
        "argmax": accept_argmax(jnp.asarray(logits), jnp.asarray(drafts), params, first),
        "sampled": accept_sampled(jnp.asarray(logits), jnp.asarray(drafts), jnp.asarray(q), params, first),
    }
    for name, (emitted, n_acc) in runs.items():
        emitted, n_acc = np.asarray(emitted), np.asarray(n_acc)
        np.testing.assert_array_equal(n_acc[greedy], want_n[greedy], err_msg=name)
        for b in np.flatnonzero(greedy):
            m = want_n[b]
            np.testing.assert_array_equal(emitted[b, : m + 1], top[b, : m + 1], err_msg=f"{name} row {b}")
        # the stochastic neighbours are the same as in a batch without greedy rows
        sp = jax.tree.map(lambda x: x[~greedy], params)
        if name == "argmax":
            alone_e, alone_n = accept_argmax(
                jnp.asarray(logits[~greedy]), jnp.asarray(drafts[~greedy]), sp, first[~greedy]
            )
        else:
            alone_e, alone_n = accept_sampled(
                jnp.asarray(logits[~greedy]),
                jnp.asarray(drafts[~greedy]),
                jnp.asarray(q[~greedy]),
                sp,
                first[~greedy],
            )
        np.testing.assert_array_equal(np.asarray(alone_n), n_acc[~greedy], err_msg=name)
        np.testing.assert_array_equal(np.asarray(alone_e), emitted[~greedy], err_msg=name)


# --- end to end through Model.generate ----------------------------------------------------------

VOCAB = 8
PROMPT = [0, 6, 4]
NGRAM_PROMPT = [
    *[0, 6, 0, 4, 4],
    *[0, 6, 1, 7, 2],
    *[0, 6, 2, 6, 0],
    *[0, 6, 3, 6, 0],
    *[0, 6, 4, 4, 4],
    *[0, 6, 5, 0, 4],
    *[0, 6, 6, 0, 4],
    *[0, 6, 7, 2, 6],
    *[0, 6],
]
"""For the n-gram draft, which needs a three-token match: "0 6 v" for every v, each followed by the
small-vocabulary model's two greedy tokens after it, ending in "0 6": whatever the first token, the
text then ends with a three-token suffix seen before, and its followers are often accepted."""


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    """A float32 model with an 8-token vocabulary whose MTP draft is accepted often but not always.

    ``oracle_tensors`` makes the MTP layer predict the target's bigram part (alpha scales what the
    target adds to it); the shared output head is sharpened x3 so that the distributions are far
    from flat and the argmax drafts are accepted a fair share of the time.
    """
    config = copy.deepcopy(TINY_CONFIG)
    config.update(vocab_size=VOCAB, eos_token_id=1)
    tensors = oracle_tensors(config, alpha=2.0)
    head = tensors["lm_head.weight"] * 3.0
    tensors["lm_head.weight"] = head
    tensors[f"model.layers.{config['num_hidden_layers']}.shared_head.head.weight"] = head
    path = str(tmp_path_factory.mktemp("vocab8") / "ckpt")
    write_hub_checkpoint(path, config, tensors)
    return mtp_jax.load(path, dtype="float32", page_size=4)


EAGLE3_VOCAB_IDS = [0, 2, 3, 4, 6, 7]  # a 6-token draft vocabulary: tokens 1 and 5 are never drafted


@pytest.fixture(scope="module")
def small_vocab_eagle3(small_vocab_model, tmp_path_factory):
    """The same target with an EAGLE-3 draft (random, head sharpened) over a 6-token draft
    vocabulary: its distributions are exactly zero at two target ids."""
    raw = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": 32,
        "intermediate_size": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": VOCAB,
        "draft_vocab_size": len(EAGLE3_VOCAB_IDS),
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
    }
    tensors = eagle3_hub_tensors(Eagle3Config.from_dict(raw), 7, 0.2, draft_ids=np.array(EAGLE3_VOCAB_IDS))
    tensors["lm_head.weight"] *= 4.0
    path = tmp_path_factory.mktemp("vocab8-eagle3") / "draft"
    write_hub_checkpoint(path, raw, tensors)
    return mtp_jax.load(small_vocab_model.path, "float32", page_size=4, draft_model=str(path))


SMALL_DFLASH = {
    "architectures": ["DFlashDraftModel"],
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "vocab_size": VOCAB,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
    "block_size": 4,
    "dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 2]},
}


@pytest.fixture(scope="module")
def small_vocab_dflash(small_vocab_model, tmp_path_factory):
    """The same target (a DeepSeek-V3: MLA, MoE) with a random DFlash draft: a block of 4 proposed
    at once, each position drawn independently given the context, from the target's head."""
    raw = SMALL_DFLASH
    path = tmp_path_factory.mktemp("vocab8-dflash") / "draft"
    write_hub_checkpoint(path, raw, dflash_hub_tensors(DFlashConfig.from_dict(raw), 2, 7, 0.3))
    return mtp_jax.load(small_vocab_model.path, "float32", page_size=4, draft_model=str(path))


@pytest.fixture(scope="module")
def small_vocab_dflash_vocab(small_vocab_model, tmp_path_factory):
    """The same DFlash draft over EAGLE-3's 6-token draft vocabulary: the target head's columns
    for those ids, so its distributions are exactly zero at target ids 1 and 5."""
    raw = {**SMALL_DFLASH, "draft_vocab_size": len(EAGLE3_VOCAB_IDS)}
    tensors = dflash_hub_tensors(DFlashConfig.from_dict(raw), 2, 7, 0.3, draft_ids=np.array(EAGLE3_VOCAB_IDS))
    path = tmp_path_factory.mktemp("vocab8-dflash-vocab") / "draft"
    write_hub_checkpoint(path, raw, tensors)
    return mtp_jax.load(small_vocab_model.path, "float32", page_size=4, draft_model=str(path))


SMALL_DSPARK = {
    **{k: v for k, v in SMALL_DFLASH.items() if k != "dflash_config"},
    "architectures": ["Qwen3DSparkModel"],
    "mask_token_id": 5,
    "num_target_layers": 3,
    "target_layer_ids": [-1, 1],
    "markov_rank": 4,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
}


@pytest.fixture(scope="module")
def small_vocab_dspark(small_vocab_model, tmp_path_factory):
    """The same target with a random DSpark draft: a block of 4 from one forward, then each slot's
    logits biased by the token drawn at the slot before (a Markov head strong enough that the law
    of the second draft depends on the first), so acceptance must use each slot's distribution
    given the drafts actually drawn."""
    from mtp_jax.drafts.dspark.config import DSparkConfig
    from mtp_jax.drafts.dspark.synthetic import dspark_hub_tensors

    model = small_vocab_model
    embed = np.asarray(model.params["embed"])
    head = np.asarray(model.params["lm_head"]).T
    tensors = dspark_hub_tensors(DSparkConfig.from_dict(SMALL_DSPARK), embed, head, 7, 0.3, head_std=1.0)
    path = tmp_path_factory.mktemp("vocab8-dspark") / "draft"
    write_hub_checkpoint(path, SMALL_DSPARK, tensors)
    drafted = mtp_jax.load(model.path, "float32", page_size=4, draft_model=str(path))
    # the block at the prompt's last token, its second slot given each first draft: far apart laws
    logits = drafted.draft_logits([PROMPT + [a] for a in range(VOCAB)])[:, len(PROMPT) - 1, 1]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    assert 0.5 * np.abs(probs[:, None] - probs[None]).sum(-1).max() > 0.3
    return drafted


@pytest.fixture(scope="module")
def small_vocab_dspark_vocab(small_vocab_model, tmp_path_factory):
    """The same DSpark draft over EAGLE-3's 6-token draft vocabulary: the block's head and the
    Markov head's W2 over those ids only, so every slot's law, the bias of the token drawn before
    included, is exactly zero at target ids 1 and 5."""
    from mtp_jax.drafts.dspark.config import DSparkConfig
    from mtp_jax.drafts.dspark.synthetic import dspark_hub_tensors

    model = small_vocab_model
    raw = {**SMALL_DSPARK, "draft_vocab_size": len(EAGLE3_VOCAB_IDS)}
    embed, head = np.asarray(model.params["embed"]), np.asarray(model.params["lm_head"]).T
    ids = np.array(EAGLE3_VOCAB_IDS)
    tensors = dspark_hub_tensors(
        DSparkConfig.from_dict(raw), embed, head, 7, 0.3, head_std=1.0, draft_ids=ids
    )
    path = tmp_path_factory.mktemp("vocab8-dspark-vocab") / "draft"
    write_hub_checkpoint(path, raw, tensors)
    drafted = mtp_jax.load(model.path, "float32", page_size=4, draft_model=str(path))
    logits = drafted.draft_logits([PROMPT + [a] for a in range(VOCAB)])[:, len(PROMPT) - 1]
    outside = np.setdiff1d(np.arange(VOCAB), ids)
    assert np.all(np.isneginf(logits[..., outside]))  # not vacuous: the restriction is in force
    return drafted


@pytest.fixture(scope="module")
def small_vocab_draft_model(small_vocab_model, tmp_path_factory):
    """The same target drafted by a separate model: its own checkpoint with the head's scale
    halved (a flatter distribution with the same argmax): K chained passes of another model."""
    from mtp_jax.checkpoint.safetensors_io import CheckpointReader

    reader = CheckpointReader(small_vocab_model.path)
    tensors = {k: np.asarray(reader.get(k)) for k in reader.keys()}
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 0.5
    with open(os.path.join(small_vocab_model.path, "config.json")) as f:
        raw = json.load(f)
    path = tmp_path_factory.mktemp("vocab8-draft-model") / "draft"
    write_hub_checkpoint(path, raw, tensors)
    return mtp_jax.load(small_vocab_model.path, "float32", page_size=4, draft_model=str(path))


@pytest.fixture(scope="module")
def small_vocab_mtp_lora(small_vocab_model, tmp_path_factory):
    """The same target and MTP draft with a random LoRA adapter on the target's attention and
    shared experts (the draft keeps the base weights): requests name it as "lora"."""
    from tests.test_lora import write_random_adapter

    modules = ["q_a_proj", "kv_b_proj", "o_proj", "gate_proj", "down_proj"]
    adapter = write_random_adapter(
        tmp_path_factory.mktemp("vocab8-lora"), small_vocab_model, 4, modules, seed=2
    )
    return mtp_jax.load(small_vocab_model.path, "float32", page_size=4, lora_adapters={"lora": adapter})


@pytest.fixture(scope="module")
def small_vocab_ngram(small_vocab_model):
    """The n-gram draft needs no weights: the same model."""
    return small_vocab_model


@pytest.fixture(scope="module")
def small_vocab_suffix(small_vocab_model):
    """Nor does suffix decoding."""
    return small_vocab_model


@pytest.fixture(scope="module")
def small_vocab_suffix_index(small_vocab_model):
    return small_vocab_model


@pytest.fixture(scope="module")
def small_vocab_hybrid(small_vocab_model):
    return small_vocab_model


def exact_first_three(model, prompt: list[int], params: dict, lora: str | None = None) -> np.ndarray:
    """P(t1, t2, t3) [V, V, V] of the first three generated tokens: the product of the processed
    teacher-forced conditionals, over every two-token continuation of the prompt."""
    n = len(prompt)
    seqs = [prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)]
    logits = model.logits(seqs, lora=lora).astype(np.float64).reshape(VOCAB, VOCAB, n + 2, VOCAB)

    def proc(lg):
        probs, margin = reference_probs(lg, **params)
        assert margin > 1e-4, f"a truncation decision within float rounding of its threshold: {params}"
        return probs

    p1 = proc(logits[0, 0, n - 1])
    joint = np.zeros((VOCAB,) * 3)
    for a in range(VOCAB):
        p2 = proc(logits[a, 0, n])
        for b in range(VOCAB):
            joint[a, b] = p1[a] * p2[b] * proc(logits[a, b, n + 1])
    return joint


E2E_PARAMS = {
    "t1": dict(temperature=1.0),
    "truncated": dict(temperature=1.0, top_k=5, top_p=0.9, min_p=0.05),
}


def first_three_of_many_seeds(model, prompt: list[int], n: int, **settings):
    """One generate call of ``prompt`` with ``n`` seeds in one batch, three new tokens each
    (``settings``: the draft, its speculation, the sampling parameters)."""
    return model.generate(
        [prompt] * n,
        max_new_tokens=3,
        seed=list(range(n)),
        ignore_eos=True,
        **{"max_batch": n, **settings},
    )


def first_three_laws(joint: np.ndarray) -> dict[str, np.ndarray]:
    """Laws of the first three tokens that a wrong acceptance rule gives: the classic residual
    bug (a rejected draft replaced by a draw from p, not from max(p - q, 0)) at both speculative
    positions, with a uniform draft and with the target's argmax as the draft."""
    v = joint.shape[0]
    drafts = {
        "a uniform draft": lambda p: np.full(v, 1 / v),
        "the argmax draft": lambda p: np.eye(v)[np.argmax(p)],
    }
    first = joint.sum((1, 2))
    laws = {}
    for name, q_of in drafts.items():
        law = np.zeros_like(joint)
        for a in np.flatnonzero(first):
            second = joint[a].sum(1) / first[a]
            second = residual_bug(second, q_of(second))
            for b in np.flatnonzero(second):
                mass = joint[a, b].sum()  # 0: a second token only the bug emits; any third law
                third = joint[a, b] / mass if mass > 0 else np.full(v, 1 / v)
                law[a, b] = first[a] * second[b] * residual_bug(third, q_of(third))
        laws[f"the residual bug with {name}"] = law.ravel()
    return laws


E2E_CASES = [
    # (draft, K, draft_sampling, parameters)
    ("mtp", 2, "argmax", "t1"),
    ("mtp", 2, "sampled", "t1"),
    ("mtp", 2, "argmax", "truncated"),
    ("mtp", 2, "sampled", "truncated"),
    # K = 1: the third token is the bonus token whenever the first draft is accepted
    ("mtp", 1, "sampled", "truncated"),
    # a draft vocabulary smaller than the target's: q is zero at the ids it cannot propose
    ("eagle3", 2, "argmax", "truncated"),
    ("eagle3", 2, "sampled", "truncated"),
    # a block draft: both positions proposed at once, independently given the context
    ("dflash", 2, "argmax", "truncated"),
    ("dflash", 2, "sampled", "truncated"),
    # ... over a draft vocabulary (the target head's columns for 6 of the 8 ids)
    ("dflash_vocab", 2, "sampled", "truncated"),
    # a block with a sequential head: the second draft's law depends on the first one drawn
    ("dspark", 2, "sampled", "truncated"),
    # ... over a draft vocabulary (the head and the Markov bias over 6 of the 8 ids)
    ("dspark_vocab", 2, "sampled", "truncated"),
    # deterministic drafts copied from the row's own text (q one-hot in sampled mode)
    ("ngram", 2, "argmax", "truncated"),
    ("ngram", 2, "sampled", "truncated"),
    # suffix decoding: from the row's own text, and (the requests in four waves) from the index of
    # the earlier waves' outputs (fixed candidates: the likeliest continuations seen)
    ("suffix", 2, "sampled", "truncated"),
    ("suffix_index", 2, "argmax", "truncated"),
    # ... beside the MTP layer: each row's drafts from one of the two by its suffix tree's score
    ("hybrid", 2, "sampled", "truncated"),
    # the target with a LoRA adapter (verification adapted, the MTP draft on base weights)
    ("mtp_lora", 2, "sampled", "truncated"),
    # another model's chained distribution
    ("draft_model", 2, "argmax", "truncated"),
    ("draft_model", 2, "sampled", "truncated"),
]


def _cases(cases: list[tuple], optimized: set[tuple]) -> list:
    """``cases`` as pytest params named by their fields, those in ``optimized`` marked so (the
    worker compiles them at XLA's level 2: the cases measured faster there, the drafts copied from
    text whose prompt takes the most seeds; tests/conftest.py)."""
    marks = {c: [pytest.mark.optimized] if c in optimized else [] for c in cases}
    return [pytest.param(*c, id="-".join(map(str, c)), marks=marks[c]) for c in cases]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("draft", "k", "draft_sampling", "which"),
    _cases(
        E2E_CASES,
        {
            ("ngram", 2, "argmax", "truncated"),
            ("ngram", 2, "sampled", "truncated"),
            ("suffix", 2, "sampled", "truncated"),
            ("hybrid", 2, "sampled", "truncated"),
        },
    ),
)
def test_generate_first_three_tokens_follow_the_target(request, draft, k, draft_sampling, which):
    """Many seeds of one prompt in one generate call (as many as the check's power needs): the
    joint law of the first three tokens (the first from prefill, the others from the speculative
    steps) is the target's, exactly."""
    model = request.getfixturevalue("small_vocab_model" if draft == "mtp" else f"small_vocab_{draft}")
    lora = "lora" if draft.endswith("_lora") else None
    waves = 4 if draft in ("suffix_index", "hybrid") else 1  # later waves drafted from earlier outputs
    draft = (
        draft.split("_vocab")[0].removesuffix("_lora").removesuffix("_index").replace("hybrid", "suffix_mtp")
    )
    params = E2E_PARAMS[which]
    prompt = (
        NGRAM_PROMPT if draft in ("ngram", "suffix_mtp") or (draft == "suffix" and waves == 1) else PROMPT
    )
    joint = exact_first_three(model, prompt, params, lora)
    if lora:  # not vacuous: the adapted law is far from the base model's
        assert np.abs(joint - exact_first_three(model, prompt, params)).sum() > 0.2
    if which == "truncated":
        assert (joint == 0).sum() > 100  # the truncation removes something at every step
    wrong = first_three_laws(joint)
    n = powered_size(joint.ravel(), wrong)
    settings = dict(
        draft=draft, num_speculative_tokens=k, draft_sampling=draft_sampling, max_batch=n // waves
    )
    result = first_three_of_many_seeds(
        model, prompt, n, **settings, **params, **({"lora": lora} if lora else {})
    )
    if draft == "suffix_mtp":  # not vacuous: some rows drafted from the suffix tree
        alone = first_three_of_many_seeds(model, prompt, n, **{**settings, "draft": "mtp"}, **params)
        assert alone.stats["num_draft_tokens"] != result.stats["num_draft_tokens"]
    elif waves > 1:  # not vacuous: the index proposed, more than the rows' own texts alone would
        alone = first_three_of_many_seeds(
            model, prompt, n, **settings, draft_options={"index_slots": 0}, **params
        )
        assert result.stats["num_accepted_tokens"] > 1.2 * alone.stats["num_accepted_tokens"], (
            result.stats["num_accepted_tokens"],
            alone.stats["num_accepted_tokens"],
        )
    # not vacuous: drafts are accepted at each position, but not always
    at_least = result.stats["acceptance_rate_per_position"]
    per_position = [at_least[0]] + [at_least[j] / at_least[j - 1] for j in range(1, k)]
    low = 0.2 if draft == "mtp" else 0.05  # random drafts (EAGLE-3, DFlash, a model) are accepted less
    assert all(low < a < 0.9 for a in per_position), per_position
    tokens = np.asarray(result.tokens)
    assert tokens.shape == (n, 3)
    cells = (tokens[:, 0] * VOCAB + tokens[:, 1]) * VOCAB + tokens[:, 2]
    what = f"first three tokens, {draft_sampling} drafts, {params}"
    assert_distribution(cells, joint.ravel(), what, against=wrong)
    assert_distribution(tokens[:, 0], joint.sum((1, 2)), "first token")
    assert_distribution(tokens[:, 1] * VOCAB + tokens[:, 2], joint.sum(0).ravel(), "tokens 2 and 3")


# A DSpark draft whose confidence in its first draft is 1/2 whatever the context (temperature 100 on
# slot 1's logit) and in its second all or nothing by the first draft drawn (temperature 0.02: zero
# after tokens 1 and 5, one after the others): a width decided after seeing that draft is biased.
SHARP_DSPARK = {**SMALL_DSPARK, "confidence_temperatures": [100.0, 0.02, 1.0, 1.0]}


@pytest.fixture(scope="module")
def small_vocab_dspark_sharp(small_vocab_model, tmp_path_factory):
    from mtp_jax.drafts.dspark.config import DSparkConfig
    from mtp_jax.drafts.dspark.synthetic import dspark_hub_tensors

    model = small_vocab_model
    embed, head = np.asarray(model.params["embed"]), np.asarray(model.params["lm_head"]).T
    tensors = dspark_hub_tensors(DSparkConfig.from_dict(SHARP_DSPARK), embed, head, 7, 0.3, head_std=1.0)
    path = tmp_path_factory.mktemp("vocab8-dspark-sharp") / "draft"
    write_hub_checkpoint(path, SHARP_DSPARK, tensors)
    return mtp_jax.load(model.path, "float32", page_size=4, draft_model=str(path))


def scheduled_first_three(model, n: int, table: list[float], *, early_stop: bool = True, batch: int = 1):
    """The first three tokens of ``n`` seeds of PROMPT with K = 2 DSpark drafts and the confidence
    schedule weighing ``table`` (steps/s at widths 1..3), ``batch`` requests a step (one: each
    width decided by that request's own confidences alone). ``early_stop=False``: the search over
    every width (biased). Returns (tokens [n, 3], stats)."""
    from mtp_jax.autok import batch_controls

    settings = dict(
        draft="dspark", num_speculative_tokens=2, draft_sampling="sampled", **E2E_PARAMS["truncated"]
    )
    settings.update(schedule="confidence", sps_table={batch: table}, max_batch=batch)

    def search_every_width(model, speculative):  # the biased search, through the same generate path
        inner = batch_controls(model, speculative)
        return lambda b, sc: dataclasses.replace(inner(b, sc), schedule_global=True)

    with pytest.MonkeyPatch.context() as patch:
        if not early_stop:
            patch.setattr("mtp_jax.model.batch_controls", search_every_width)
        result = first_three_of_many_seeds(model, PROMPT, n, **settings)
    return np.asarray(result.tokens), result.stats


@pytest.mark.slow
def test_the_confidence_schedule_keeps_the_first_three_tokens_exact(small_vocab_dspark_sharp):
    """Each request's width chosen alone from its own confidences (a batch of one), one draft or
    both by what the first draft was: the joint law of the first three tokens is still the
    target's."""
    model = small_vocab_dspark_sharp
    joint = exact_first_three(model, PROMPT, E2E_PARAMS["truncated"])
    wrong = first_three_laws(joint)
    n = powered_size(joint.ravel(), wrong)
    tokens, stats = scheduled_first_three(model, n, [1.0, 0.7, 0.65])
    # not vacuous: width 2 or 3 by the first draft (theta(2) = 1.5 x 0.7 > 1; theta(3) = (1.5 + c2 / 2)
    # x 0.65 passes 1.05 only when c2 is one), so some steps verified one draft and some two
    assert stats["num_drafts"] < stats["num_draft_tokens"] < 2 * stats["num_drafts"], stats
    assert stats["num_accepted_tokens"] > 0
    cells = (tokens[:, 0] * VOCAB + tokens[:, 1]) * VOCAB + tokens[:, 2]
    assert_distribution(cells, joint.ravel(), "first three tokens, confidence schedule", against=wrong)


@pytest.mark.slow
def test_a_width_chosen_after_seeing_its_drafts_is_caught_as_biased(small_vocab_dspark_sharp):
    """The paper's Appendix A: the best of all widths (no early stop) verifies the first draft only
    when the second draft's confidence, a function of the first draft, is high. With speeds
    (1, 0.6, 0.6) the early stop never leaves width 1 (one draft never pays), the full search picks
    width 3 exactly when the second confidence is high, and the checker rejects its law."""
    model = small_vocab_dspark_sharp
    joint = exact_first_three(model, PROMPT, E2E_PARAMS["truncated"])
    n = 8192  # chi2 about 120 at 4,096 draws against a critical value of 69
    tokens, stats = scheduled_first_three(model, n, [1.0, 0.6, 0.6], early_stop=False)
    assert stats["num_draft_tokens"] > 0, stats  # the search did verify drafts, sometimes
    cells = (tokens[:, 0] * VOCAB + tokens[:, 1]) * VOCAB + tokens[:, 2]
    with pytest.raises(AssertionError, match="chi2"):
        assert_distribution(
            cells, joint.ravel(), "first three tokens, a search over every width", power=False
        )
    exact, stats = scheduled_first_three(model, n // 2, [1.0, 0.6, 0.6])
    assert stats["num_draft_tokens"] == 0  # the early stop: plain decoding here, exactly the target
    cells = (exact[:, 0] * VOCAB + exact[:, 1]) * VOCAB + exact[:, 2]
    assert_distribution(cells, joint.ravel(), "first three tokens, early stop", power=False)


TREE_CASES = [
    # (draft, draft_sampling, parameters, tree): trees of depth 2, the root's two likeliest (or two
    # drawn) children and the first one's two: multi-draft acceptance among siblings at every node;
    # or a dynamic tree (each row's own 4 of the 6 candidates EAGLE-2 proposes, fixed candidates)
    ("mtp", "argmax", "t1", "static"),
    ("mtp", "sampled", "truncated", "static"),
    ("eagle3", "sampled", "truncated", "static"),
    ("draft_model", "argmax", "truncated", "static"),
    ("eagle3", "argmax", "truncated", "dynamic"),
    # ... per row the suffix tree of the row's own text or the MTP layer's dynamic tree
    ("hybrid", "argmax", "truncated", "dynamic"),
]
TREE = {"depth": 2, "topk": 2, "nodes": 4}
TREES = {"static": TREE, "dynamic": dict(TREE, dynamic=True)}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("draft", "draft_sampling", "which", "shape"),
    _cases(TREE_CASES, {("hybrid", "argmax", "truncated", "dynamic")}),
)
def test_token_trees_keep_the_first_three_tokens_exact(request, draft, draft_sampling, which, shape):
    """As :func:`test_generate_first_three_tokens_follow_the_target`, with a token tree verified
    each step: fixed top-2 children (argmax) or two children drawn without replacement (sampled),
    accepted by recursive rejection among siblings, or a dynamic tree whose shape each row's draft
    chooses; the joint law of the first three tokens is the target's, exactly."""
    model = request.getfixturevalue("small_vocab_model" if draft == "mtp" else f"small_vocab_{draft}")
    params = E2E_PARAMS[which]
    prompt, draft = (NGRAM_PROMPT, "suffix_mtp") if draft == "hybrid" else (PROMPT, draft)
    joint = exact_first_three(model, prompt, params)
    wrong = first_three_laws(joint)
    n = powered_size(joint.ravel(), wrong)
    result = first_three_of_many_seeds(
        model, prompt, n, draft=draft, speculative_tree=TREES[shape], draft_sampling=draft_sampling, **params
    )
    if draft == "suffix_mtp":  # not vacuous: rows verified each kind of tree, and accepted from it
        by_source = result.stats["drafts_by_source"]
        assert by_source["text"]["accepted"] > 0 and by_source["neural"]["accepted"] > 0, by_source
    at_least = result.stats["acceptance_rate_per_position"]
    low = 0.05 if draft == "mtp" else 0.01  # random drafts are accepted less
    assert low < at_least[1] < at_least[0] < 0.995, at_least  # not vacuous
    tokens = np.asarray(result.tokens)
    cells = (tokens[:, 0] * VOCAB + tokens[:, 1]) * VOCAB + tokens[:, 2]
    what = f"first three tokens, {shape} tree, {draft_sampling} drafts, {params}"
    assert_distribution(cells, joint.ravel(), what, against=wrong)
    assert_distribution(tokens[:, 0], joint.sum((1, 2)), "first token")


MIXED_PROMPTS = [
    [0, 6, 4],
    [0, 2, 7, 7, 3, 5, 1, 6, 2],
    [5],
    [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5],
    [3, 3],
]


@pytest.mark.slow
def test_argmax_drafts_sample_exactly_what_plain_decoding_samples(small_vocab_model):
    """Each position's token is drawn from the same (seed, position) key as plain decoding draws
    it, and accepted drafts are exactly those draws: the outputs are identical token for token."""
    kw = dict(max_new_tokens=20, temperature=0.8, top_p=0.9, seed=[3, 1, 4, 1, 5], ignore_eos=True)
    plain = small_vocab_model.generate(MIXED_PROMPTS, **kw)
    spec = small_vocab_model.generate(
        MIXED_PROMPTS, draft="mtp", num_speculative_tokens=2, draft_sampling="argmax", **kw
    )
    assert spec.tokens == plain.tokens
    assert all(len(t) == 20 for t in spec.tokens)
    assert spec.stats["acceptance_length"] > 1.3  # drafts were accepted: several tokens per step
    assert len({tuple(t) for t in plain.tokens}) == len(MIXED_PROMPTS)


@pytest.mark.slow
@pytest.mark.parametrize("draft_sampling", ["argmax", "sampled"])
def test_speculative_row_output_does_not_depend_on_the_batch(small_vocab_model, draft_sampling):
    model = small_vocab_model
    kw = dict(max_new_tokens=16, ignore_eos=True, draft="mtp", num_speculative_tokens=2)
    kw["draft_sampling"] = draft_sampling
    mine = dict(temperature=0.9, top_k=6, top_p=0.95, min_p=0.02, seed=77)
    target = MIXED_PROMPTS[1]
    alone = model.generate([target], **mine, **kw)
    assert alone.stats["acceptance_length"] > 1.3
    alone = alone.tokens[0]
    # among other prompts, seeds and parameters (one of them greedy), twice, in a batch of 4
    others = dict(
        temperature=[1.2, 0.9, 0.0, 0.9],
        top_k=[0, 6, 3, 6],
        top_p=[0.7, 0.95, 1.0, 0.95],
        min_p=[0.1, 0.02, 0.0, 0.02],
        seed=[5, 77, 9, 77],
    )
    batch = model.generate([MIXED_PROMPTS[0], target, MIXED_PROMPTS[3], target], **others, **kw).tokens
    assert batch[1] == alone and batch[3] == alone
    # joining later into whichever slot frees first (continuous batching, 7 requests on 4 slots)
    later = model.generate(
        MIXED_PROMPTS[:4] + [MIXED_PROMPTS[4], target, MIXED_PROMPTS[0]],
        temperature=[1.0, 0.5, 0.0, 1.5, 0.8, 0.9, 1.0],
        top_k=[0, 0, 0, 4, 0, 6, 0],
        top_p=[1.0, 0.9, 1.0, 1.0, 0.9, 0.95, 1.0],
        min_p=[0.0, 0.0, 0.0, 0.0, 0.1, 0.02, 0.0],
        seed=[1, 2, 3, 4, 5, 77, 6],
        max_batch=4,
        **kw,
    ).tokens
    assert later[5] == alone
    # the seed matters: the same request under another seed gives another continuation
    assert model.generate([target], **{**mine, "seed": 78}, **kw).tokens[0] != alone


# --- token trees: several candidates for one position --------------------------------------------


@pytest.mark.parametrize(
    "mode, m",
    [("without", 1), ("without", 3), ("with", 2), ("with", 4), ("fixed", 2), ("fixed", 5)],
)
def test_sibling_candidates_give_the_target_law_exactly(mode, m):
    """Multi-draft speculative sampling at one tree node (mtp_jax.sampling.accept_siblings): with
    m candidates drawn from the draft's q without replacement, with replacement, or fixed (its
    top m), the emitted token follows the target's p exactly (chi-square over 20000 draws, p with
    a zero entry); candidates are accepted and rejected both; a fixed candidate the target gives
    no mass is never accepted."""
    from mtp_jax.sampling import accept_siblings, without_replacement

    v, n = 7, 20000
    rng = np.random.default_rng(10 * m + len(mode))
    p = rng.dirichlet(np.full(v, 0.8))
    p[-1] = 0.0  # a token the target never emits (the draft may well propose it)
    p /= p.sum()
    q = rng.dirichlet(np.full(v, 0.8))
    key_draw, key_accept = jax.random.split(jax.random.key(m))
    qs = jnp.broadcast_to(jnp.asarray(q, jnp.float32), (n, v))
    if mode == "without":  # Gumbel top-m: an ordered sample without replacement
        g = jax.random.gumbel(key_draw, (n, v))
        candidates = jax.lax.top_k(jnp.log(qs) + g, m)[1].astype(jnp.int32)
        laws = without_replacement(qs, candidates)
    elif mode == "with":
        candidates = jax.random.categorical(key_draw, jnp.log(qs)[:, None, :], shape=(n, m)).astype(jnp.int32)
        laws = jnp.broadcast_to(qs[:, None, :], (n, m, v))
    else:
        top = np.argsort(-q)[:m]
        if v - 1 not in top:
            top[-1] = v - 1  # include the zero-mass token among the fixed candidates
        candidates = jnp.broadcast_to(jnp.asarray(top, jnp.int32), (n, m))
        laws = jax.nn.one_hot(candidates, v, dtype=jnp.float32)
    keys = jax.random.split(key_accept, n)
    chosen, token = jax.jit(accept_siblings)(
        jnp.asarray(np.broadcast_to(p, (n, v)), jnp.float32), candidates, laws, keys
    )
    chosen, token = np.asarray(chosen), np.asarray(token)
    assert_distribution(token, p, f"{m} candidates, {mode}")
    accepted = chosen >= 0
    assert 0.02 < accepted.mean() < 0.999, accepted.mean()
    assert np.all(np.asarray(candidates)[accepted, chosen[accepted]] == token[accepted])
    if mode == "fixed":
        dead = int(np.flatnonzero(np.asarray(candidates[0]) == v - 1)[0])
        assert not np.any(chosen == dead)


def test_a_candidate_its_law_cannot_draw_is_skipped():
    """Two children drawn without replacement from a draft distribution with one token in its
    support: the second is a placeholder (its law is all zeros) and is never accepted, whatever
    the target's residual holds, so nothing outside the target's support is emitted."""
    rows = 10_000
    p = jnp.tile(jnp.asarray([[0.6, 0.4, 0.0]]), (rows, 1))
    q = jnp.tile(jnp.asarray([[0.0, 1.0, 0.0]]), (rows, 1))
    candidates = jnp.tile(jnp.asarray([[1, 2]], jnp.int32), (rows, 1))
    laws = sampling.without_replacement(q, candidates)
    keys = jax.random.split(jax.random.key(0), rows)
    chosen, token = sampling.accept_siblings(p, candidates, laws, keys)
    chosen, token = np.asarray(chosen), np.asarray(token)
    assert (chosen != 1).all() and (token != 2).all()
    assert_distribution(token, np.asarray([0.6, 0.4, 0.0]), "a lone draft token among two children")
