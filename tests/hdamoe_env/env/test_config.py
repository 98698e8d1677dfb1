"""EnvConfig (hdamoe_env.env.config): the trace-skew argument (traces.synthetic skew power τ)."""

from __future__ import annotations

import dataclasses

import pytest

from hdamoe_env.env.config import EnvConfig
from hdamoe_env.config.errors import ConfigError


def test_trace_skew_defaults_to_one_and_reaches_the_trace():
    base = EnvConfig(trace_requests=2, trace_tokens=200)
    assert base.trace_skew == 1.0
    sharp = dataclasses.replace(base, trace_skew=2, hardware=None)
    assert isinstance(sharp.trace_skew, float) and sharp.trace_skew == 2.0
    assert sharp.load_trace().meta["generator"]["skew"] == 2.0
    assert base.load_trace().meta["generator"]["skew"] == 1.0


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf"), "sharp", True])
def test_trace_skew_rejects_non_positive_and_non_finite(bad):
    with pytest.raises(ConfigError, match="trace_skew"):
        EnvConfig(trace_skew=bad)


def test_trace_skew_needs_the_synthetic_trace(tmp_path):
    with pytest.raises(ConfigError, match="synthetic"):
        EnvConfig(trace=str(tmp_path / "t.npz"), trace_skew=1.5)
