"""Tests of the judgement-knob ranges and their Latin-hypercube sampling."""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.profiles import Conventions
from hdamoe_env.config.uncertainty import (
    UNCERTAINTIES,
    Uncertainty,
    latin_hypercube,
    sample_profiles,
)


def test_every_uncertainty_is_a_knob_and_contains_the_default():
    default = Conventions()
    for name, unc in UNCERTAINTIES.items():
        assert name == unc.knob
        value = getattr(default, name)
        assert unc.low <= value <= unc.high, name


def test_latin_hypercube_has_one_point_per_stratum():
    u = latin_hypercube(64, 3, np.random.default_rng(0))
    assert u.shape == (64, 3)
    for j in range(3):
        assert sorted(np.floor(u[:, j] * 64).astype(int).tolist()) == list(range(64))


def test_sample_profiles_is_deterministic_and_in_range():
    a = sample_profiles("faithful", 16, np.random.default_rng(5))
    b = sample_profiles("faithful", 16, np.random.default_rng(5))
    assert [p.name for p in a] == [p.name for p in b]
    for p in a:
        assert p.tile_cols in (16, 32, 64, 128)
        assert 10e-9 <= p.gemm_overhead_s <= 1e-6 + 1e-15
    assert len({p.tile_cols for p in a}) > 1
    for p in a:   # the knobs of docs/PHYSICS.md §4, §12–14
        assert p.col_granularity in (8, 16, 32, 64)
        assert 0.70 <= p.dram_efficiency <= 0.95
        assert isinstance(p.nonmoe_ctx_len, int) and 512 <= p.nonmoe_ctx_len <= 8192
    assert {"col_granularity", "dram_efficiency", "nonmoe_ctx_len"} <= set(UNCERTAINTIES)


def test_bad_ranges_and_knobs_are_typed_errors():
    with pytest.raises(ConfigError):
        Uncertainty("tile_cols", 10, 1, "reversed")
    with pytest.raises(ConfigError):
        Uncertainty("tile_cols", 0, 1, "log of zero", scale="log")
    with pytest.raises(ConfigError):
        sample_profiles("faithful", 2, np.random.default_rng(0),
                        {"nosuch": Uncertainty("nosuch", 0, 1, "x")})
