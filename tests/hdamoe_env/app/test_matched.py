"""Tests of hdamoe_env.app.matched: the gating-quality probe on a real env (top-1 retention
monotone in the gating scale, on a synthetic and on the recorded Mixtral trace) and the matched
level search on it.
"""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.app.matched import GatingQualityProbe, search_matched_levels
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.decisions.quality import DEFAULT_SCALE_GRID, monotone_violations
from hdamoe_env.env.environment import HdMoeEnv


@pytest.fixture(scope="module")
def mixtral_probe():
    """Mixtral-8x7B under ``paper`` on a synthetic trace with a skewed EP placement."""
    env = HdMoeEnv(model="mixtral-8x7b", conventions="paper", batch=64, steps_per_episode=2,
                   placement="ep", trace_requests=8)
    return GatingQualityProbe(env, seeds=(10_000,))


def test_top1_retention_is_monotone_in_the_gating_scale(mixtral_probe):
    curve = mixtral_probe.curve((*DEFAULT_SCALE_GRID, 1.5, 2.0))
    top1 = [c["top1_retention"] for c in curve]
    changed = [c["changed_fraction"] for c in curve]
    assert top1[0] == 1.0 and changed[0] == 0.0
    assert top1[-1] < 0.99, "gating at 2x the defaults should move some top-1 experts"
    # non-increasing up to sampling noise (one decode step can go either way by a token)
    assert monotone_violations(top1, tolerance=2.0 / (64 * 32)) == 0, top1
    assert np.all(np.diff(changed) >= -0.02), changed


def test_search_on_a_real_trace(mixtral_probe):
    found = search_matched_levels(mixtral_probe, (0.99, 0.95))
    assert found[0.99].level <= found[0.95].level
    for target, m in found.items():
        assert mixtral_probe.measure(m.level)["top1_retention"] >= target
        stronger = [g for g in m.grid if g > m.level]
        if stronger:
            assert mixtral_probe.measure(stronger[0])["top1_retention"] < target


def test_probe_rejects_bad_scales(mixtral_probe):
    with pytest.raises(ConfigError, match="scale"):
        mixtral_probe.measure(-1.0)


def test_top1_retention_is_monotone_on_the_real_mixtral_trace(reference_traces):
    """The recorded Mixtral router scores (reasoning trace), ``paper`` profile, EP placement."""
    path = reference_traces / "mixtral" / "experts_reasoning_mixtral.json"
    if not path.exists():
        pytest.skip(f"{path.name} not in the reference traces")
    env = HdMoeEnv(model="mixtral-8x7b", conventions="paper", batch=128, steps_per_episode=2,
                   placement="ep", trace=path)
    probe = GatingQualityProbe(env, seeds=(10_000,))
    top1 = [c["top1_retention"] for c in probe.curve(DEFAULT_SCALE_GRID)]
    assert top1[0] == 1.0 and top1[-1] < 0.9
    assert monotone_violations(top1, tolerance=2.0 / (2 * 128 * 32)) == 0, top1
