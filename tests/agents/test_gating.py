"""Tests of agents.gating: the hardware-aware gating agent (paper-model.md §11) — its default
level, the predicted-imbalance switch and the routing it changes in the env."""

from __future__ import annotations

import numpy as np
import pytest

from agents import HardwareAwareGatingAgent
from agents.gating import predicted_imbalance


def test_gating_agent_default_level_is_one(make_tiny_env):
    env = make_tiny_env()
    obs, _ = env.reset(seed=0)
    agent = HardwareAwareGatingAgent.from_env(env)
    action, _ = agent.predict(obs)
    assert env.gating_levels[action[-1]] == 1.0
    assert (action[:env.max_broadcast] == env.num_experts).all()
    off = HardwareAwareGatingAgent.from_env(env, level=0.0).predict(obs)[0]
    assert env.gating_levels[off[-1]] == 0.0


def test_gating_agent_imbalance_switch():
    balanced = {"pred_load": np.array([0.5, 0.5], np.float32),
                "replicas": np.array([[1, 0], [0, 1]], np.float32)}
    skewed = {"pred_load": np.array([0.9, 0.1], np.float32),
              "replicas": np.array([[1, 0], [0, 1]], np.float32)}
    assert predicted_imbalance(balanced) == pytest.approx(1.0)
    assert predicted_imbalance(skewed) == pytest.approx(1.8)
    agent = HardwareAwareGatingAgent(num_experts=2, min_imbalance=1.2)
    assert agent.choose_level(balanced) == 0
    assert agent.layout.gating_levels[agent.choose_level(skewed)] == 1.0


def test_gating_agent_changes_routing_in_the_env(make_tiny_env):
    env = make_tiny_env(k_b=0)
    agent = HardwareAwareGatingAgent.from_env(env, level=2.0)
    obs, _ = env.reset(seed=0)
    stats, done = [], False
    while not done:
        obs, _, term, trunc, info = env.step(agent.predict(obs)[0])
        assert info["gating_level"] == 2.0
        stats.append((info["changed_fraction"], info["top1_retention"]))
        done = term or trunc
    assert all(0.0 <= c <= 1.0 and 0.0 <= t <= 1.0 for c, t in stats)
