"""Tests of hdamoe_env.app.envbench: env step rates with gating, masked random actions and the
HDA-MoE agent (``hdamoe bench-env``).
"""

from __future__ import annotations

from hdamoe_env.app import envbench


def test_bench_env_reports_gating_random_masked_and_agent_rates():
    res = envbench.bench_env(seconds=0.05, model="mixtral-8x7b", mesh="2x2", setting="1/1",
                             batch=8)
    for fid in ("des", "analytic"):
        for suffix in ("", "_gating", "_random_masked", "_hda_moe"):
            assert res[f"env_{fid}{suffix}_steps_per_s"] > 0
        assert res[f"ratio_{fid}_gating_on_vs_off"] > 0
    assert "gating_on_vs_off" in res["pass"]
    table = envbench.format_bench_env(res)
    assert "gating on (level 1)" in table and "random masked actions" in table
    assert "HDA-MoE agent" in table
