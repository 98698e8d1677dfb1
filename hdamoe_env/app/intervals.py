"""Interval estimates over seeds: Student-t intervals, IQM with a stratified bootstrap, pairs.

The statistics of ``hdamoe compare`` (and of ``hdamoe train --seeds``); scipy is imported
lazily (the ``opt`` extra, also in ``all``).

* :func:`t_interval` — mean ± t(0.975, n − 1) · s / √n with the sample standard deviation s
  (``ddof=1``) and the Student-t quantile from ``scipy.stats.t``.
* :func:`iqm` — the interquartile mean (mean of the middle 50 % of the scores,
  ``scipy.stats.trim_mean(x, 0.25)``), the aggregate recommended by Agarwal et al., "Deep
  Reinforcement Learning at the Edge of the Statistical Precipice" (NeurIPS 2021).
* :func:`stratified_bootstrap_interval` — the percentile interval of a statistic under the
  stratified bootstrap of the same paper: runs (seeds) are resampled with replacement
  independently within each task (stratum), from the caller's ``numpy.random.Generator``.
  [decision] Implemented here rather than imported from ``rliable``: rliable 1.2 pulls
  ``arch`` and ``pandas``/``seaborn``, none of them tested under constraints.txt; the
  procedure is a dozen lines (resample indices per task, apply the statistic, take the
  percentiles).
* :func:`paired_difference` — per-seed differences of two methods measured on the same
  episodes, with their t interval (the pairing removes the episode-to-episode variance
  the two methods share).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.config.errors import ConfigError, DependencyNotInstalled

__all__ = ["MIN_SEEDS_IQM", "Interval", "iqm", "paired_difference",
           "stratified_bootstrap_interval", "t_interval", "t_quantile"]

#: Fewest seeds for which the IQM and its bootstrap interval are reported (below, the
#: trimmed mean keeps too few values to mean anything).
MIN_SEEDS_IQM = 5


@dataclass(frozen=True, slots=True)
class Interval:
    """A point estimate with a two-sided interval.

    Attributes:
        estimate: The point estimate.
        low: Lower end (None: undefined, e.g. a single seed).
        high: Upper end (None likewise).
        n: Number of values it rests on.
        method: How the interval was made (``"t"``, ``"bootstrap"``).
    """

    estimate: float
    low: float | None
    high: float | None
    n: int
    method: str

    @property
    def half_width(self) -> float | None:
        """Half the interval's width (symmetric for t intervals), or None."""
        if self.low is None or self.high is None:
            return None
        return (self.high - self.low) / 2


def _scipy_stats() -> Any:
    """Return ``scipy.stats`` (lazily imported)."""
    try:
        from scipy import stats
    except ImportError:
        raise DependencyNotInstalled("intervals over seeds need scipy; install with "
                                     "`pip install -c constraints.txt -e \".[opt]\"`") from None
    return stats


def _values(values: ArrayLike, what: str) -> NDArray[np.float64]:
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size == 0:
        raise ConfigError(f"{what} needs at least one value, got none; pass one per seed")
    if not np.all(np.isfinite(x)):
        raise ConfigError(f"{what} needs finite values, got {x.tolist()}")
    return x


def t_quantile(dof: int, confidence: float = 0.95) -> float:
    """Return the two-sided Student-t quantile t((1 + confidence) / 2, dof) (scipy)."""
    if dof < 1:
        raise ConfigError(f"degrees of freedom must be >= 1, got {dof}")
    return float(_scipy_stats().t.ppf(0.5 + confidence / 2, dof))


def t_interval(values: ArrayLike, confidence: float = 0.95) -> Interval:
    """Return the mean and its two-sided Student-t interval over independent seeds.

    Args:
        values: [n] one value per seed.
        confidence: Coverage of the interval (default 95 %).

    Returns:
        ``Interval(mean, mean − h, mean + h, n, "t")`` with h = t(0.5 + c/2, n − 1)·s/√n and the
        sample standard deviation s (``ddof=1``); low/high are None for n = 1.

    Raises:
        ConfigError: No values or non-finite values.
        DependencyNotInstalled: scipy is missing.
    """
    x = _values(values, "t_interval")
    mean = float(x.mean())
    if x.size == 1:
        return Interval(mean, None, None, 1, "t")
    half = t_quantile(x.size - 1, confidence) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return Interval(mean, mean - half, mean + half, int(x.size), "t")


def iqm(values: ArrayLike) -> float:
    """Return the interquartile mean: the mean of the middle 50 % (25 % trimmed per side).

    Args:
        values: Scores of any shape (flattened: all runs of all tasks).
    """
    x = _values(values, "iqm")
    return float(_scipy_stats().trim_mean(x, 0.25))


def stratified_bootstrap_interval(scores: ArrayLike,
                                  statistic: Callable[[NDArray[np.float64]], float],
                                  rng: np.random.Generator, *, reps: int = 2000,
                                  confidence: float = 0.95) -> Interval:
    """Return a statistic and its percentile interval under the stratified bootstrap.

    Args:
        scores: [runs, tasks] (or [runs] for one task) scores; each column is a stratum whose
            runs are resampled with replacement independently of the other columns.
        statistic: Maps a [runs, tasks] array to a number (e.g. :func:`iqm`).
        rng: The caller's generator (style.md R7); the only randomness.
        reps: Bootstrap replicates.
        confidence: Coverage of the percentile interval.

    Returns:
        ``Interval(statistic(scores), low, high, runs, "bootstrap")``.

    Raises:
        ConfigError: Empty or non-finite scores, or ``reps`` < 1.
    """
    x = np.asarray(scores, dtype=np.float64)
    if x.ndim == 1:
        x = x[:, None]
    if x.ndim != 2 or x.size == 0 or not np.all(np.isfinite(x)):
        raise ConfigError(f"scores must be a finite [runs, tasks] array, got shape {x.shape}")
    if reps < 1:
        raise ConfigError(f"reps must be >= 1, got {reps}")
    runs, tasks = x.shape
    point = float(statistic(x))
    idx = rng.integers(0, runs, size=(reps, runs, tasks))
    cols = np.arange(tasks)[None, None, :]
    samples = x[idx, cols]                                    # [reps, runs, tasks]
    stats = np.array([float(statistic(s)) for s in samples])
    alpha = (1 - confidence) / 2
    low, high = np.quantile(stats, [alpha, 1 - alpha])
    return Interval(point, float(low), float(high), runs, "bootstrap")


def paired_difference(values: ArrayLike, reference: ArrayLike,
                      confidence: float = 0.95) -> Interval:
    """Return the mean per-seed difference ``values − reference`` and its t interval.

    Args:
        values: [n] a method's per-seed values.
        reference: [n] the reference method's values on the same seeds (same order).
        confidence: Coverage of the interval.

    Raises:
        ConfigError: The two do not have the same length.
    """
    a = _values(values, "paired_difference")
    b = _values(reference, "paired_difference")
    if a.shape != b.shape:
        raise ConfigError(f"paired values need the same seeds: {a.size} values vs {b.size} of "
                          "the reference")
    return t_interval(a - b, confidence)

