"""HD-MoE and HDA-MoE agents and full episodes of every agent (paper-model.md §9.4, §10.1)."""

from __future__ import annotations

import numpy as np
import pytest

import agents
from agents import CompositeAgent, HDAMoEAgent, HDMoEAgent, NoOpAgent
from hdamoe_env.config.errors import ConfigError


@pytest.mark.parametrize("name", sorted(agents.AGENTS))
def test_full_episode_with_valid_masked_actions(make_tiny_env, name):
    env = make_tiny_env()
    agent = agents.make_agent(name, env=env)
    obs, _ = env.reset(seed=1)
    steps, done = 0, False
    while not done:
        mask = env.action_masks()
        action, _ = agent.predict(obs, action_masks=mask)
        assert env.action_space.contains(action)
        parts = agent.layout.split_mask(mask)
        assert all(parts[d][v] for d, v in enumerate(action)), (name, action)
        obs, reward, term, trunc, info = env.step(action)
        assert isinstance(reward, float) and info["total_us"] > 0
        steps += 1
        done = term or trunc
    assert steps == env.steps_per_episode * env.num_layers
    assert info["episode_tbt_us"] > 0


def test_hd_and_hda_agents_compose_their_levers(make_tiny_env):
    env = make_tiny_env(k_b=1)
    hd, hda = HDMoEAgent.from_env(env), HDAMoEAgent.from_env(env)
    pre = agents.GreedyPreBroadcastAgent.from_env(env)
    obs, _ = env.reset(seed=2)
    obs, *_ = env.step(NoOpAgent.from_env(env).predict(obs)[0])     # layer 1: k_b = 1
    a_pre, a_hd, a_hda = pre.predict(obs)[0], hd.predict(obs)[0], hda.predict(obs)[0]
    assert np.array_equal(a_hd, a_pre)
    assert np.array_equal(a_hda[:-1], a_hd[:-1])
    assert env.gating_levels[a_hda[-1]] == 1.0 and a_hd[-1] == 0
    assert env.dispatch_rules[a_hd[-2]] == "least_loaded"


def test_composite_checks_layouts():
    with pytest.raises(ConfigError):
        CompositeAgent()
    with pytest.raises(ConfigError, match="layouts"):
        CompositeAgent(dispatch=agents.LeastLoadedDispatchAgent(num_experts=4),
                       gating=agents.HardwareAwareGatingAgent(num_experts=5))
