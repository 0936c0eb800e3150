"""Sequential temperature scaling (DSpark paper section 3.2.1): the confidence head's logits z_k
divided by one temperature T_k per block slot, fitted on held-out speculative rollouts so that the
running products of sigmoid(z_k / T_k) (what the confidence scheduler weighs) match how often each
prefix of drafts was accepted.

Left to right: T_1..T_{k-1} fixed, T_k is the value on a log-spaced grid that minimises the
expected calibration error (20 equal-width bins) of the cumulative product up to slot k against
the slot-k prefix label (drafts 1..k all accepted). The grid and the bin count are not in the
paper; these are the DSpark note's recommendation. The result goes into the draft's config as
``confidence_temperatures`` (:func:`mtp_jax.drafts.dspark.checkpoint.dspark_config_dict`).

A temperature keeps a logit's sign, so it cannot remove a bias: a head trained on the target's
own low-temperature replies and rolled out at temperature 1 is overconfident everywhere (the
SmolLM2 DSpark expected 0.750 accepted drafts a step where 0.565 were), and the ECE-best
temperature sharpens it instead. :func:`fit_scaling` (mtp-jax's extension, the default of
``scripts/train_dspark.py``) fits a temperature and a shift per slot, sigmoid(z_k / T_k + s_k),
still slot by slot against the cumulative product, by the log-loss: a proper score, so a constant
at the base rate (which a shift would let the ECE prefer) does not win over a head that tells
rows apart. Both transforms are increasing in z, so the scheduler's order of prefixes is the
head's either way, and neither reads anything but the draft's own logits (acceptance stays exact).
"""

from __future__ import annotations

import numpy as np

GRID = np.exp(np.linspace(np.log(0.05), np.log(20.0), 121))
"""The temperatures tried per slot (log-spaced, 0.05..20)."""


SHIFTS = np.linspace(-4.0, 4.0, 161)
"""The shifts tried per slot with :func:`fit_scaling` (0.05 apart)."""


def expected_calibration_error(predicted: np.ndarray, labels: np.ndarray, bins: int = 20) -> float:
    """ECE: over ``bins`` equal-width bins of the predicted probabilities, the mean absolute gap
    between the mean prediction and the mean label, weighted by the bin's share of the samples."""
    predicted, labels = np.asarray(predicted, np.float64), np.asarray(labels, np.float64)
    if predicted.size == 0:
        return 0.0
    index = np.minimum((predicted * bins).astype(np.int64), bins - 1)
    count = np.bincount(index, minlength=bins)
    gap = np.abs(np.bincount(index, predicted, bins) - np.bincount(index, labels, bins))
    return float(gap.sum() / predicted.size) if count.any() else 0.0


def prefix_labels(accepted: np.ndarray, proposed: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(labels [n, slots], observed [n, slots]) from rollouts: ``accepted`` [n] drafts accepted of
    ``proposed`` [n] verified. Slot k's label is whether drafts 1..k were all accepted; it is
    observed only where k drafts were verified."""
    k = np.arange(1, slots + 1)[None, :]
    return (np.asarray(accepted)[:, None] >= k), (np.asarray(proposed)[:, None] >= k)


def fit_temperatures(
    logits: np.ndarray, labels: np.ndarray, observed: np.ndarray | None = None, grid: np.ndarray = GRID
) -> tuple[float, ...]:
    """One temperature per slot from confidence logits [n, slots] and prefix labels [n, slots]
    (``observed`` [n, slots]: which entries count; default all), fitted left to right."""
    logits, labels = np.asarray(logits, np.float64), np.asarray(labels, bool)
    observed = np.ones_like(labels) if observed is None else np.asarray(observed, bool)
    if logits.shape != labels.shape or logits.ndim != 2:
        raise ValueError(f"logits and labels must both be [n, slots], got {logits.shape} and {labels.shape}")
    temps: list[float] = []
    running = np.ones(len(logits))
    for k in range(logits.shape[1]):
        rows = observed[:, k]
        if not rows.any():  # no rollout verified this far: keep the head as it is
            temps.append(1.0)
            running = running / (1 + np.exp(-logits[:, k]))
            continue

        before, z, y = running[rows], logits[rows, k], labels[rows, k]

        def ece(t: float, before=before, z=z, y=y) -> float:
            return expected_calibration_error(before / (1 + np.exp(-z / t)), y)

        best = float(min(grid, key=ece))
        temps.append(best)
        running = running / (1 + np.exp(-logits[:, k] / best))
    return tuple(temps)


def fit_scaling(
    logits: np.ndarray,
    labels: np.ndarray,
    observed: np.ndarray | None = None,
    grid: np.ndarray = GRID,
    shifts: np.ndarray = SHIFTS,
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(temperatures, shifts): per slot, left to right, the pair on ``grid`` x ``shifts`` whose
    cumulative product running * sigmoid(z_k / T_k + s_k) has the least mean log-loss against the
    slot-k prefix labels (``observed`` as :func:`fit_temperatures`; ties to the smaller shift, then
    the temperature nearer 1). A slot no rollout verified keeps (1, 0)."""
    logits, labels = np.asarray(logits, np.float64), np.asarray(labels, bool)
    observed = np.ones_like(labels) if observed is None else np.asarray(observed, bool)
    if logits.shape != labels.shape or logits.ndim != 2:
        raise ValueError(f"logits and labels must both be [n, slots], got {logits.shape} and {labels.shape}")
    grid, shifts = np.asarray(grid, np.float64), np.asarray(shifts, np.float64)
    shift_of, temp_of = (a.ravel() for a in np.meshgrid(shifts, grid, indexing="ij"))  # [shifts x grid]
    order = np.lexsort((np.abs(np.log(temp_of)), np.abs(shift_of)))  # the preferred first
    temps: list[float] = []
    moved: list[float] = []
    log_running = np.zeros(len(logits))
    for k in range(logits.shape[1]):
        rows = observed[:, k]
        t, s = 1.0, 0.0
        if rows.any():
            before, z, y = log_running[rows], logits[rows, k], labels[rows, k]
            loss = np.empty((len(shifts), len(grid)))
            for j, temp in enumerate(grid):
                x = z[None, :] / temp + shifts[:, None]  # [shifts, n]
                log_c = before[None, :] - np.logaddexp(0.0, -x)  # log of the cumulative product
                log_not = np.log1p(-np.minimum(np.exp(log_c), 1 - 1e-12))
                loss[:, j] = -np.mean(np.where(y[None, :], log_c, log_not), axis=1)
            best = order[np.argmin(loss.ravel()[order])]
            s, t = float(shift_of[best]), float(temp_of[best])
        temps.append(t)
        moved.append(s)
        log_running = log_running - np.logaddexp(0.0, -(logits[:, k] / t + s))
    return tuple(temps), tuple(moved)
