"""Tests of agents.dispatch: the dispatch agent (paper-model.md §10.6) only chooses the rule."""

from __future__ import annotations

import pytest

from agents import LeastLoadedDispatchAgent
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
