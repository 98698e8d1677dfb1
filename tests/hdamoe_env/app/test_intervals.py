"""Tests of hdamoe_env.app.intervals: t intervals (scipy, ddof=1), IQM, stratified bootstrap,
paired differences."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hdamoe_env.app import intervals
from hdamoe_env.config.errors import ConfigError

pytest.importorskip("scipy")


def test_t_interval_matches_the_textbook_value():
    x = [10.0, 12.0, 11.0, 13.0, 9.0]                # mean 11, s = sqrt(2.5)
    iv = intervals.t_interval(x)
    assert iv.estimate == pytest.approx(11.0)
    assert iv.half_width == pytest.approx(2.776445 * math.sqrt(2.5) / math.sqrt(5), rel=1e-5)
    assert iv.low < 11 < iv.high and iv.n == 5
    one = intervals.t_interval([3.0])
    assert one.low is None and one.half_width is None
    with pytest.raises(ConfigError, match="at least one"):
        intervals.t_interval([])


def test_iqm_trims_a_quarter_per_side():
    x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 100.0]
    assert intervals.iqm(x) == pytest.approx(np.mean([3.0, 4.0, 5.0, 6.0]))


def test_stratified_bootstrap_is_seeded_and_stratified():
    scores = np.column_stack([np.arange(10.0), 100 + np.arange(10.0)])   # two tasks
    a = intervals.stratified_bootstrap_interval(scores, intervals.iqm,
                                                np.random.default_rng(3), reps=300)
    b = intervals.stratified_bootstrap_interval(scores, intervals.iqm,
                                                np.random.default_rng(3), reps=300)
    assert a == b and a.low <= a.estimate <= a.high
    # each resample keeps 10 runs per task: the per-task means stay in their own ranges
    task_means = intervals.stratified_bootstrap_interval(
        scores, lambda s: float(s[:, 1].mean() - s[:, 0].mean()), np.random.default_rng(0),
        reps=200)
    assert task_means.low >= 91 and task_means.high <= 109
    const = intervals.stratified_bootstrap_interval([5.0] * 6, intervals.iqm,
                                                    np.random.default_rng(0), reps=50)
    assert const.low == const.high == 5.0
    with pytest.raises(ConfigError, match="reps"):
        intervals.stratified_bootstrap_interval(scores, intervals.iqm,
                                                np.random.default_rng(0), reps=0)


def test_paired_difference_removes_the_shared_episode_variance():
    episode = np.array([100.0, 140.0, 90.0, 180.0, 120.0])     # episodes differ a lot
    method = episode - 5.0 + np.array([0.1, -0.1, 0.0, 0.2, -0.2])
    d = intervals.paired_difference(method, episode)
    assert d.estimate == pytest.approx(-5.0)
    assert d.high < 0                                          # clearly faster when paired
    unpaired = intervals.t_interval(method).half_width
    assert d.half_width < unpaired / 50
    with pytest.raises(ConfigError, match="same seeds"):
        intervals.paired_difference([1.0, 2.0], [1.0])
