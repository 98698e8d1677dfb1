"""Agent protocol, action layout, NoOp and Random agents (paper-model.md §10.1, style.md R11)."""

from __future__ import annotations

import numpy as np
import pytest

import agents
from agents.base import ActionLayout, NoOpAgent, RandomAgent
from hdamoe_env.config.errors import ConfigError


def test_layout_matches_env(make_tiny_env):
    env = make_tiny_env()
    layout = ActionLayout.from_env(env)
    assert np.array_equal(layout.nvec, env.action_space.nvec)
    assert layout.none == env.num_experts
    a = layout.encode([1, 3], "home", 1.0)
    assert a.tolist() == [1, 3, 4, 4, 4, 4, 4, 4, 2, 2]
    assert env.action_space.contains(a)
    with pytest.raises(ConfigError, match="dispatch rule"):
        layout.rule_index("nearest")
    with pytest.raises(ConfigError, match="mask has"):
        layout.split_mask(np.ones(3, dtype=bool))


def test_every_registered_agent_satisfies_the_protocol(make_tiny_env):
    env = make_tiny_env()
    for name in agents.AGENTS:
        agent = agents.make_agent(name, env=env)
        assert isinstance(agent, agents.Agent), name
    with pytest.raises(ConfigError, match="did you mean 'hd-moe'"):
        agents.make_agent("hd-mo")


def test_noop_is_the_static_placement(make_tiny_env):
    env = make_tiny_env()
    agent = NoOpAgent.from_env(env)
    obs, _ = env.reset(seed=0)
    action, state = agent.predict(obs, state="s", episode_start=np.array([True]))
    assert state == "s"
    assert action.tolist() == [env.num_experts] * env.max_broadcast + [0, 0]


def test_random_agent_respects_masks_and_its_seed(make_tiny_env):
    env = make_tiny_env()
    actions = []
    for _ in range(2):
        agent = RandomAgent.from_env(env, seed=7)
        obs, _ = env.reset(seed=0)
        seq, done = [], False
        while not done:
            mask = env.action_masks()
            action, _ = agent.predict(obs, action_masks=mask)
            parts = agent.layout.split_mask(mask)
            assert all(parts[d][v] for d, v in enumerate(action))
            slots = [v for v in action[:env.max_broadcast] if v != env.num_experts]
            assert len(slots) == len(set(slots))
            seq.append(action)
            obs, _, term, trunc, _ = env.step(action)     # never InvalidAction
            done = term or trunc
        actions.append(np.stack(seq))
    assert np.array_equal(actions[0], actions[1])
    obs, _ = env.reset(seed=0)
    draws = [np.stack([RandomAgent.from_env(env, seed=s).predict(obs)[0] for _ in range(30)])
             for s in (7, 8)]
    assert not np.array_equal(draws[0], draws[1])


def test_random_agent_without_mask_uses_the_budget():
    agent = RandomAgent(num_experts=4, seed=0, max_broadcast=3)
    obs = {"budget": np.array([1 / 3], np.float32), "layer": np.array([1.0], np.float32)}
    for _ in range(20):
        action, _ = agent.predict(obs)
        assert (action[1:3] == 4).all()
    obs0 = {"budget": np.array([1.0], np.float32), "layer": np.array([0.0], np.float32)}
    assert (agent.predict(obs0)[0][:3] == 4).all()


def test_batched_predict(make_tiny_env):
    env = make_tiny_env()
    obs, _ = env.reset(seed=0)
    batch = {k: np.stack([v, v]) for k, v in obs.items()}
    masks = np.stack([env.action_masks()] * 2)
    for name in ("noop", "hda-moe", "random"):
        agent = agents.make_agent(name, env=env)
        actions, _ = agent.predict(batch, action_masks=masks)
        assert actions.shape == (2, env.max_broadcast + 2)


def test_every_agent_acts_on_a_replicated_placement(make_tiny_env):
    """A placement with redundant experts adds the replica-rule dimension; every registered
    heuristic agent built from the env answers it (index 0, the env's default rule)."""
    from hdamoe_env.sim.placement import Placement, expert_parallel

    ep = expert_parallel(2, 4, 4, np.random.default_rng(0))
    reps = np.zeros(ep.P.shape, dtype=bool)
    for layer in range(2):
        reps[layer, 0, int(np.flatnonzero(ep.P[layer, 0] == 0)[0])] = True
    env = make_tiny_env(placement=Placement(ep.P, ep.pi, "ep+rep", replicas=reps),
                        replica_rule="nearest")
    for name in agents.AGENTS:
        agent = agents.make_agent(name, env=env, seed=0)
        assert agent.layout.replica_rules == env.replica_rules
        obs, _ = env.reset(seed=0)
        action, _ = agent.predict(obs, action_masks=env.action_masks())
        assert env.action_space.contains(action)
        _, _, _, _, info = env.step(action)
        assert info["replica_rule"] in env.replica_rules
