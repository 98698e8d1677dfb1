"""Tests of hdamoe_env.env.config: ``EnvConfig`` resolves its names once and equals the env's
keyword arguments; the trace-skew argument (traces.synthetic skew power τ)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.env.config import EnvConfig


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


def test_env_config_resolves_once_and_matches_kwargs():  # style.md R2, paper-model.md §4
    import dataclasses

    from hdamoe_env.env.environment import EnvConfig, HdMoeEnv
    from hdamoe_env.config.profiles import Conventions, get_profile
    from hdamoe_env.config.specs import HardwareSpec, ModelSpec, TopologySpec

    kwargs = dict(batch=8, steps_per_episode=1, conventions="paper", k_b=1)
    a = HdMoeEnv(**kwargs)
    cfg = EnvConfig(**kwargs)
    b = HdMoeEnv(cfg)
    assert isinstance(cfg.model, ModelSpec) and isinstance(cfg.hardware, HardwareSpec)
    assert isinstance(cfg.topology, TopologySpec) and isinstance(cfg.conventions, Conventions)
    assert b.config is cfg and a.config == cfg
    assert a.config_digest() == b.config_digest()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.batch = 4  # type: ignore[misc]
    derived = get_profile("paper").derive(chunks=2)
    c = HdMoeEnv(cfg, conventions=derived)
    assert c.conv is derived and c.sim.conv is derived
    with pytest.raises(ConfigError, match="batch must be a positive integer"):
        EnvConfig(batch=0)


@pytest.mark.parametrize("kwargs, match", [
    ({"gating_levels": "0,1"}, "gating_levels"),
    ({"gating_levels": ["x"]}, "gating_levels"),
    ({"gating_levels": (0.0, 1.0, 1.0)}, "repeat"),
    ({"batch_options": "x"}, "batch_options"),
    ({"batch_options": {"nosuch": 1}}, "nosuch"),
    ({"batch_options": {"cycle": "no"}}, "True or False"),
    ({"predictor_accuracy": float("nan")}, "predictor_accuracy"),
    ({"predictor_accuracy": "high"}, "predictor_accuracy"),
    ({"hardware": "x"}, "HardwareSpec"),
    ({"reward_scale": "x"}, "reward_scale"),
    ({"trace_seed": 1.5}, "trace_seed"),
    ({"placement_seed": -1}, "placement_seed"),
    ({"dispatch_rules": "first"}, "dispatch_rules"),
    ({"dispatch_rules": ("first", "first")}, "repeat"),
    ({"measure_twin_error": "yes"}, "measure_twin_error"),
    ({"gammas": [float("nan")] * 32}, "gammas"),
    ({"gating_coefficients": (1.0,)}, "gating_coefficients"),
])
def test_every_bad_argument_is_a_config_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EnvConfig(model="mixtral-8x7b", mesh="2x2", **kwargs)


def test_unknown_keyword_is_refused_with_a_suggestion():
    with pytest.raises(ConfigError, match="batch_mode"):
        EnvConfig.create(model="mixtral-8x7b", batch_mod="streams")
    cfg = EnvConfig.create(model="mixtral-8x7b", mesh="2x2")
    with pytest.raises(ConfigError, match="foo"):
        cfg.replace(foo=1)
    assert cfg.replace(steps_per_episode=2).steps_per_episode == 2


def test_batch_options_keep_real_booleans():
    cfg = EnvConfig(model="mixtral-8x7b", mesh="2x2", batch_options={"cycle": np.bool_(False)})
    assert cfg.batch_options == {"cycle": False} and type(cfg.batch_options["cycle"]) is bool
