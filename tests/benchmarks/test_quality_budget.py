"""``benchmarks/quality_budget.py``: the offline allocator equals the env's, the hypervolume."""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.config.specs import ModelSpec
from hdamoe_env.env.quality import HdMoeQualityEnv, price_policy, run_policy

MODEL = ModelSpec(key="tiny-qb", name="tiny-qb", num_moe_layers=3, num_experts=8, top_k=2,
                  hidden_size=64, expert_intermediate=256, attn_weight_elements=4 * 64 * 64,
                  kv_elements_per_token=2 * 64, core_flops_per_ctx_token=4 * 64)


def test_hypervolume_and_pareto(load_benchmark):
    qb = load_benchmark("quality_budget")
    # one point (0.8, 0.95) w.r.t. (1, 0.85): 0.2 × 0.10
    assert qb.hypervolume([(0.8, 0.95)], 0.85) == pytest.approx(0.02)
    # a dominated point adds nothing; points outside the reference box neither
    assert qb.hypervolume([(0.8, 0.95), (0.9, 0.9), (1.1, 1.0), (0.5, 0.8)], 0.85) == \
        pytest.approx(0.02)
    # two staircase points: 0.2·0.10 + 0.1·(0.99 − 0.95)
    assert qb.hypervolume([(0.8, 0.95), (0.9, 0.99)], 0.85) == pytest.approx(0.024)
    assert qb.pareto([(0.9, 0.99), (0.8, 0.95), (0.9, 0.9)]) == [(0.8, 0.95), (0.9, 0.99)]


def test_simulated_allocator_equals_the_env(load_benchmark):
    qb = load_benchmark("quality_budget")
    env = HdMoeQualityEnv(model=MODEL, mesh="2x2", setting="1/1", batch=16, trace_requests=8,
                          trace_tokens=256, steps_per_episode=2, target=0.9,
                          gating_coefficients=(-1e7, -0.05), levels=(1.0, 4.0), protect=(0, 1))
    env.reset(seed=5)
    lat, loss = env.episode_table()
    for price in (0.0, 0.3, 2.0):
        total, lost = qb.simulate_price(lat, loss, env.budget, price, env.batch)
        res = run_policy(env, price_policy(price), 5)
        assert res["tbt_us"] == pytest.approx((total / 2 + env.dense_s) * 1e6)
        assert res["top1"] == pytest.approx(1 - lost / (16 * 3 * 2))
        assert lost <= env.budget
    scalars = qb.step_scalars({"total_us": 2.0, "tp_total_us": 4.0, "ungated_us": 3.0,
                               "lost": 1, "remaining": 3, "tbt_us": 9.0})
    assert scalars["latency/total_over_tp"] == 0.5 and scalars["latency/tbt_us"] == 9.0
    assert np.isfinite(list(scalars.values())).all()


def test_tensorboard_run_per_episode(tmp_path, load_benchmark):
    import argparse

    qb = load_benchmark("quality_budget")
    env = HdMoeQualityEnv(model=MODEL, mesh="2x2", setting="1/1", batch=16, trace_requests=8,
                          trace_tokens=256, steps_per_episode=2, target=0.9,
                          gating_coefficients=(-1e7, -0.05), levels=(1.0,), protect=(0,))
    args = argparse.Namespace(tensorboard=str(tmp_path))
    assert qb.tb_logger(argparse.Namespace(tensorboard=None), "m", "1/1", 16, "x", 0) is None
    run_policy(env, price_policy(0.0), 0,
               on_step=qb.tb_logger(args, "tiny-qb", "1/1", 16, "allocator@0.9", 0))
    runs = list(tmp_path.iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("HdMoE-Quality-v1__tiny-qb__1-1__B16__")
    assert any(runs[0].iterdir())                     # the writer wrote its file
