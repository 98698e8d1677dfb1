"""Dispatch and hardware-aware gating agents (paper-model.md §10.6, §11)."""

from __future__ import annotations

import numpy as np
import pytest

from agents import HardwareAwareGatingAgent, LeastLoadedDispatchAgent
from agents.gating import predicted_imbalance
from hdamoe_env.config.errors import ConfigError


def test_dispatch_agent_only_chooses_the_rule(make_tiny_env):
    env = make_tiny_env()
    obs, _ = env.reset(seed=0)
    for rule in env.dispatch_rules:
        action, _ = LeastLoadedDispatchAgent.from_env(env, rule=rule).predict(obs)
        assert (action[:env.max_broadcast] == env.num_experts).all()
        assert env.dispatch_rules[action[-2]] == rule
        assert action[-1] == 0
    with pytest.raises(ConfigError):
        LeastLoadedDispatchAgent(num_experts=4, rule="random")


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
